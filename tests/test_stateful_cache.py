"""The KV cache held in place (passes/stateful_cache.py, opmap/kv_cache.py, `compile --stateful-cache`).

The transform turns past -> Concat -> present into a cache Parameter written by each call. Proven here:
- on a hand-built with-past graph: the transform's structure, onnxruntime's equality at past length 0, and the
  compiled MindIR called three times in a row on one GraphCell giving what the stateless graph gives when its
  caller feeds the grown cache back (the state is kept between calls, and nothing else changes);
- on a transformers export: the stateful generation directory generates transformers' tokens, every cached
  step within 1e-4 of onnxruntime on the stateless pair, and the ascend MindIR holds one cached-attention
  primitive and two cache writes (keys, values) per layer, no cache input and no cache output;
- refusals, one line each.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.runtime.child import run_task
from graphconv.compiler import export_task
from graphconv.verify.census import mind_ir_pb2, primitive_census
from passes import stateful_cache

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(0)
HEADS, DIM, VOCAB = 2, 4, 16


def _with_past_graph() -> onnx.ModelProto:
    """A cache as every exporter writes one: new = heads of Gather(embedding, ids) @ W, present = Concat(past,
    new) along the sequence, y = sum over the sequence of present (every cached position counts); the batch
    read from Shape(past), as dynamo writes it."""
    weights = np.random.default_rng(1)  # (the same weights at every call)
    emb = weights.standard_normal((VOCAB, 8)).astype(np.float32)
    w = weights.standard_normal((8, HEADS * DIM)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Reshape", ["xw", "heads_shape"], ["xh"]),
        helper.make_node("Transpose", ["xh"], ["new"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=-2),
        helper.make_node("ReduceSum", ["present.0.key", "axis2"], ["summed"], keepdims=0),
        helper.make_node("Shape", ["past_key_values.0.key"], ["batch"], start=0, end=1),
        helper.make_node("Concat", ["batch", "minus1"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["summed", "flat_shape"], ["y"]),
    ]
    inits = [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.array([0, 0, HEADS, DIM], np.int64), "heads_shape"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    graph = helper.make_graph(
        nodes, "with_past",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
         helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", HEADS, "past_len", DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HEADS * DIM]),
         helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", HEADS, "total", DIM])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)


def test_the_transform_on_a_hand_built_graph():
    original = _with_past_graph()
    stateful, layout = stateful_cache.make_stateful(_with_past_graph(), max_batch=3, max_seq=10,
                                                    past_names=["past_key_values.0.key"])
    onnx.checker.check_model(stateful)
    assert [i.name for i in stateful.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in stateful.graph.output] == ["y"]
    updates = [n for n in stateful.graph.node if n.op_type == stateful_cache.OP]
    assert len(updates) == 1 and updates[0].domain == stateful_cache.DOMAIN
    assert layout.caches == {"past_key_values.0.key": ("cache.past_key_values.0.key", HEADS, DIM, "present.0.key")}
    [cache] = [t for t in stateful.graph.initializer if t.name == "cache.past_key_values.0.key"]
    assert list(cache.dims) == [3, HEADS, 10, DIM]
    assert stateful_cache.cache_names(stateful) == ["cache.past_key_values.0.key"]
    # at past length 0 (a prompt) onnxruntime runs the function body on the zeros: the stateless graph's value
    ids = RNG.integers(0, VOCAB, (2, 5))
    mask = np.ones((2, 5), np.int64)
    want = _ort(original, {"input_ids": ids, "attention_mask": mask,
                           "past_key_values.0.key": np.zeros((2, HEADS, 0, DIM), np.float32)})
    got = _ort(stateful, {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_array_equal(got[0], want[0])


def test_the_compiled_cache_keeps_its_state_between_calls(tmp_path):
    """A prompt of 4 tokens, then steps of 1 and 2 tokens, on one GraphCell: each call's y equals the stateless
    graph's fed the cache grown so far (computed by onnxruntime), so the Parameter kept every earlier write."""
    import graphconv

    path = tmp_path / "with_past.onnx"
    onnx.save(_with_past_graph(), path)
    mindir = tmp_path / "stateful.mindir"
    report = graphconv.compile(path, mindir, target="cpu", cache_capacity=(3, 10),
                               dims={"batch": (2, 3), "seq": (3, 5), "total": (3, 5)})
    assert report.status == "verified"
    held = next(s.detail["cache_held_in_place"] for s in report.stages if s.name == "load")
    assert held["caches"] == {"past_key_values.0.key": "cache.past_key_values.0.key"}
    assert held["bytes"] == 3 * 10 * HEADS * DIM * 4
    assert primitive_census(mindir).get("ScatterNdUpdate") == 1

    original, batch = _with_past_graph(), 2
    past = np.zeros((batch, HEADS, 0, DIM), np.float32)
    cases, expected = [], []
    for q in (4, 1, 2):
        ids = RNG.integers(0, VOCAB, (batch, q))
        mask = np.ones((batch, past.shape[2] + q), np.int64)
        y, past = _ort(original, {"input_ids": ids, "attention_mask": mask, "past_key_values.0.key": past})
        cases.append({"input_ids": ids, "attention_mask": mask})
        expected.append(y)
    stateful, _ = stateful_cache.make_stateful(_with_past_graph(), 3, 10, past_names=["past_key_values.0.key"])
    for got, want in zip(_calls_on_one_cell(mindir, stateful, cases, tmp_path), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _calls_on_one_cell(mindir: Path, stateful: onnx.ModelProto, cases: list[dict], tmp_path: Path) -> list:
    """The MindIR's first output at each case, the cases called in order on one GraphCell (its state kept)."""
    files, outs = [], []
    for k, case in enumerate(cases):
        np.savez(tmp_path / f"case{k}.npz", **case)
        files.append(str(tmp_path / f"case{k}.npz"))
        outs.append(str(tmp_path / f"case{k}.out.npz"))
    placeholders = export_task.placeholders(stateful)
    run_task("run_mindir", {"mindir": str(mindir), "cases": files, "outputs": outs,
                            "input_names": [s["name"] for s in placeholders], "inputs": placeholders},
             tmp_path, "stateful GraphCell run")
    results = []
    for out in outs:
        with np.load(out) as z:
            results.append(z["out0"])
    return results


def _gqa_step_graph() -> onnx.ModelProto:
    """A builder-style step: packed q/k/v = Gather(embedding, ids), one com.microsoft GroupQueryAttention with
    rotary reading graph-input caches (their head dim symbolic, as the builder writes `kv_cache_dim`), seqlens_k
    and total_sequence_length from the mask's lengths; y = its output, present.0.* the grown caches."""
    from tests.contrib_utils import model

    n, kv, h, max_pos = 2, 1, 16, 32
    weights = np.random.default_rng(2)
    inv = 10000.0 ** (-np.arange(h // 2) * 2 / h)
    angles = np.arange(max_pos)[:, None] * inv[None]
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["qkv"]),
        helper.make_node("ReduceSum", ["attention_mask", "axis1"], ["lengths"], keepdims=0),
        helper.make_node("Sub", ["lengths", "one"], ["seqlens64"]),
        helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["total1"], start=1, end=2),
        helper.make_node("Squeeze", ["total1"], ["total64"]),
        helper.make_node("Cast", ["total64"], ["total_sequence_length"], to=TensorProto.INT32),
        helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key_values.0.key", "past_key_values.0.value",
                                                 "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
                         ["y", "present.0.key", "present.0.value"], domain="com.microsoft", num_heads=n,
                         kv_num_heads=kv, do_rotary=1),
    ]
    inits = [numpy_helper.from_array(weights.standard_normal((VOCAB, (n + 2 * kv) * h)).astype(np.float32), "emb"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache")]
    cache = ["batch", kv, "past", "kv_cache_dim"]
    return model(nodes, [vi("input_ids", TensorProto.INT64, ["batch", "seq"]),
                         vi("attention_mask", TensorProto.INT64, ["batch", "total"]),
                         vi("past_key_values.0.key", TensorProto.FLOAT, cache),
                         vi("past_key_values.0.value", TensorProto.FLOAT, cache)],
                 [vi("y", TensorProto.FLOAT, ["batch", "seq", n * h]),
                  vi("present.0.key", TensorProto.FLOAT, ["batch", kv, "total", "kv_cache_dim"]),
                  vi("present.0.value", TensorProto.FLOAT, ["batch", kv, "total", "kv_cache_dim"])], inits)


def test_group_query_attention_caches_are_held_in_place(tmp_path):
    """GroupQueryAttention reads its cache inside the op; decomposed on load, it is past -> Concat -> attention,
    and its presents (the Concat in the kernel's layout) leave the outputs like a Concat's. Compiled, a prompt
    of 4 tokens then two 1-token steps on one GraphCell give onnxruntime's kernel fed the presents back."""
    import graphconv
    from graphconv.frontend.load import load
    from graphconv.frontend.contrib.gqa import gqa_presents

    path = tmp_path / "gqa_step.onnx"
    onnx.save(_gqa_step_graph(), path)
    loaded = load(path)
    assert gqa_presents(loaded.as_given) == {f"past_key_values.0.{kv}": f"present.0.{kv}" for kv in ("key", "value")}
    stateful, layout = stateful_cache.make_stateful(loaded.proto, 3, 10, presents=gqa_presents(loaded.as_given))
    assert [i.name for i in stateful.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in stateful.graph.output] == ["y"]
    assert {past: c[1:] for past, c in layout.caches.items()} == {  # (heads, head dim found from the new keys)
        f"past_key_values.0.{kv}": (1, 16, f"present.0.{kv}") for kv in ("key", "value")}
    mindir = tmp_path / "stateful.mindir"
    report = graphconv.compile(path, mindir, target="cpu", cache_capacity=(3, 10),
                               dims={"batch": (2, 3), "seq": (3, 5), "total": (3, 5)})
    assert report.status == "verified", report.error
    assert primitive_census(mindir).get("ScatterNdUpdate") == 2

    batch = 2
    past_k = past_v = np.zeros((batch, 1, 0, 16), np.float32)
    cases, expected = [], []
    for q in (4, 1, 1):  # (onnxruntime's kernel takes one new token over a cache at batch > 1)
        ids = RNG.integers(0, VOCAB, (batch, q))
        mask = np.ones((batch, past_k.shape[2] + q), np.int64)
        y, past_k, past_v = _ort(_gqa_step_graph(), {"input_ids": ids, "attention_mask": mask,
                                                     "past_key_values.0.key": past_k,
                                                     "past_key_values.0.value": past_v})
        cases.append({"input_ids": ids, "attention_mask": mask})
        expected.append(y)
    for got, want in zip(_calls_on_one_cell(mindir, stateful, cases, tmp_path), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit, reason", [
    (lambda g: g.node.append(helper.make_node("Identity", ["past_key_values.0.key"], ["also"])),
     "past_key_values.0.key is read by Identity"),
    (lambda g: g.input.remove(next(i for i in g.input if i.name == "attention_mask")), "no 'attention_mask'"),
    (lambda g: next(n for n in g.node if n.output[0] == "present.0.key").input.reverse(),
     "is not [past, new] along the sequence axis"),
])
def test_a_graph_the_transform_cannot_take_says_why(edit, reason):
    model = _with_past_graph()
    edit(model.graph)
    with pytest.raises(stateful_cache.NotStateful, match=re.escape(reason)):
        stateful_cache.make_stateful(model, 2, 8, past_names=["past_key_values.0.key"])


# --- a real export ------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from test_generate import _DECODER, _generate_matches_transformers, _run  # noqa: E402
from test_hf_export import _gpt2, _llama, _save, llama_with_past  # noqa: E402,F401  (a fixture)


@pytest.fixture(scope="module")
def llama_stateful(llama_with_past, tmp_path_factory):  # noqa: F811 - the imported fixture
    """(checkpoint, export folder, GEN_DIR compiled with --stateful-cache --target ascend, its report)."""
    src, out, _ = llama_with_past
    gen = tmp_path_factory.mktemp("stateful-llama") / "gen"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(out), "-o", str(gen), "--stateful-cache",
                           "--max-batch", "4", "--max-seq-len", "64", "--json"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return src, out, gen, json.loads(proc.stdout)


def test_stateful_llama_generates_as_transformers(llama_stateful):
    src, _, gen, report = llama_stateful
    assert report["status"] == "verified"
    check = report["cache"]["cached_steps_check"]
    assert check["steps"] == 4 and check["max_abs"] <= 1e-4 and check["argmax_match"]
    meta = json.loads((gen / "generation.json").read_text())
    caches = {f"cache.past_key_values.{i}.{kv}": {"shape": [4, 2, 64, 16], "dtype": "float32"}  # rows, heads, pos, dim
              for i in range(2) for kv in ("key", "value")}
    assert meta["graphs"]["decode"]["state"] == {"max_batch": 4, "max_seq_len": 64, "outputs": ["logits"],
                                                 "inputs": ["input_ids", "attention_mask", "position_ids"],
                                                 "params": caches}
    for mindir in ("decode.mindir", "decode.cpu.mindir"):  # the cache's zeros are not stored: made at load
        assert _stored_bytes(gen / mindir, caches) == {name: 0 for name in caches}
    _generate_matches_transformers(src, gen, eos=2, pad=2)


def _stored_bytes(mindir: Path, names) -> dict[str, int]:
    """The bytes each named Parameter has in the MindIR (inline or in its data file)."""
    from graphconv.runtime.mindir_stream import parameter_name
    from graphconv.verify import census

    model = census.mind_ir_pb2().ModelProto.FromString(mindir.read_bytes())
    return {parameter_name(t.name): len(t.raw_data) + (t.external_data.length if t.HasField("external_data") else 0)
            for t in model.graph.parameter if parameter_name(t.name) in names}


def test_stateful_ascend_mindir_holds_the_cache(llama_stateful):
    """Per layer (2): one FusedInferAttentionScore reading the cache and two in-place writes (keys, values);
    the graph takes ids, mask and positions and gives the logits only."""
    _, _, gen, report = llama_stateful
    census = primitive_census(gen / "decode.mindir")
    assert census.get("FusedInferAttentionScore") == 2 and census.get("ScatterNdUpdate") == 4
    decode = report["graphs"]["decode"]
    assert [i["name"] for i in decode["model"]["inputs"]] == ["input_ids", "attention_mask", "position_ids"]
    assert [o["name"] for o in decode["model"]["outputs"]] == ["logits"]
    assert report["cache"]["bytes"] == 4 * 64 * 2 * 16 * 4 * 4  # rows x positions x heads x dim x fp32, 4 caches
    # the cache path: the write, the read of its rows and positions, and (fp32 compile: the attention takes fp16
    # or bf16 on Ascend) a Cast, into the attention's key or value list: no Concat
    assert _cache_paths(gen / "decode.mindir") == [
        ["ScatterNdUpdate", "StridedSlice", "Cast", "MakeTuple", "FusedInferAttentionScore"]] * 4


def _cache_paths(mindir: Path) -> list[list[str]]:
    """Per cache write in the MindIR (each ScatterNdUpdate), the primitives its result flows through to the
    attention that reads it (the data users: not the side-effect order, UpdateState, nor TensorShape, which
    reads the shape only): the cache path, where a Concat would be the copy the held cache avoids."""
    from graphconv.verify import census

    def prim(node) -> str:
        found = census._PRIM.match(node.op_type)
        return found.group(1) if found else node.op_type

    paths = []
    for graph, calls in census.executed_graphs(census.read_mindir(mindir)):
        users: dict[str, list] = {}
        for n in graph.node:
            for i in n.input:
                users.setdefault(i, []).append(n)
        for n in graph.node:
            if prim(n) != "ScatterNdUpdate":
                continue
            path, node = [prim(n)], n
            while path[-1] != "FusedInferAttentionScore":
                data = [u for u in users.get(node.output[0], []) if prim(u) not in ("UpdateState", "TensorShape")]
                if len(data) != 1:
                    break
                node = data[0]
                path.append(prim(node))
            paths += [path] * calls
    return paths


@pytest.mark.parametrize("args, message", [
    (["--input-ids", ";".join(["1,2"] * 5)], "5 prompts: the cache holds 4 rows"),
    (["--input-ids", ",".join(["3"] * 60), "--max-new-tokens", "8"], "the prompts need 67 cache positions"),
])
def test_a_request_beyond_the_capacity_is_one_line_exit_1(llama_stateful, args, message):
    _, _, gen, _ = llama_stateful
    proc = _run(str(gen), *args)
    assert proc.returncode == 1 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _two_graph_folder(out: Path, pair: Path) -> Path:
    """The export folder `out` as one whose decode graph was not checked to serve the prompt (written before
    that check): its prefill and decode compile as a pair."""
    pair.mkdir()
    for f in ("prefill.onnx", "decode.onnx"):
        (pair / f).symlink_to(out / f)
    meta = json.loads((out / "generation.json").read_text())
    meta["graphs"]["decode"].pop("serves_prompt", None)
    (pair / "generation.json").write_text(json.dumps(meta))
    return pair


def test_stateful_cache_needs_a_graph_serving_the_prompt(llama_stateful, tmp_path):
    """A folder whose decode graph did not serve the prompt (prefill + decode pair) is refused, one line."""
    _, out, _, _ = llama_stateful
    pair = _two_graph_folder(out, tmp_path / "pair")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(pair), "-o", str(tmp_path / "gen"),
                           "--stateful-cache", "--target", "cpu"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "decode graph serves the prompt" in proc.stderr, proc.stderr
    assert not (tmp_path / "gen").exists()


def test_by_default_a_pair_that_cannot_hold_the_cache_passes_it_and_says_why(llama_stateful, tmp_path):
    """The default compile holds the cache in place where it can; a folder whose decode graph did not serve the
    prompt cannot, so it compiles the prefill + decode pair with the cache passed in and out: exit 0, the
    reason in the summary and in report.json (a warning where progress shows), and the folder generates the
    tokens of the stateful one. --no-stateful-cache passes it in and out on request."""
    _, out, gen_stateful, _ = llama_stateful
    pair = _two_graph_folder(out, tmp_path / "pair")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(pair), "-o", str(tmp_path / "gen"),
                           "--target", "cpu"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    why = "it takes one graph serving prompt and decode"
    assert f"KV cache passed in and out, not held in place: {why}" in proc.stdout
    report = json.loads((tmp_path / "gen" / "report.json").read_text())
    assert report["cache"]["held_in_place"] is False and report["cache"]["why"].startswith(why)
    assert report["steps"] == {"prefill": "prefill", "decode": "decode"}
    assert "state" not in json.loads((tmp_path / "gen" / "generation.json").read_text())["graphs"]["decode"]
    prompts = "5,6,7,8,9,10,11;12,13,14;15,16,17,18,19"
    ran = [_run(str(g), "--input-ids", prompts, "--max-new-tokens", "6") for g in (tmp_path / "gen", gen_stateful)]
    assert ran[0].returncode == 0 and ran[0].stdout == ran[1].stdout, ran[0].stderr[-2000:]

    asked = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(out), "-o", str(tmp_path / "gen2"),
                            "--target", "cpu", "--no-stateful-cache", "--no-verify", "--json"], capture_output=True,
                           text=True, cwd=ROOT)
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["cache"] == {"held_in_place": False,
                                                 "why": "not asked for (--no-stateful-cache)"}


def test_the_stateful_bundle_script_generates_the_same_tokens(llama_stateful, tmp_path):
    """--bundle with --stateful-cache: generate_mindspore.py, run with MindSpore alone (--device CPU on a --target
    cpu compile), passes ids, mask and positions only and prints the tokens `graphconv generate` does."""
    import os

    from gen_folder import compile_folder

    _, out, _, _ = llama_stateful
    bundle, gen = tmp_path / "bundle", tmp_path / "gen"
    compile_folder(out, gen, target="cpu", bundle=bundle, stateful_cache=True, max_batch=4, max_seq_len=64)
    assert "held in place" in (bundle / "README.md").read_text()
    prompts = "5,6,7,8,9,10,11;12,13,14;15,16,17,18,19"
    ran = subprocess.run([sys.executable, str(bundle / "generate_mindspore.py"), "--input-ids", prompts,
                          "--max-new-tokens", "6", "--device", "CPU"], capture_output=True, text=True,
                         cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    ours = _run(str(gen), "--input-ids", prompts, "--max-new-tokens", "6")
    assert ours.returncode == 0 and ran.stdout.split("\n") == ours.stdout.split("\n")


def test_a_cache_past_protobufs_limit_is_held_in_place_and_not_stored(llama_stateful, tmp_path):
    """The cache's zeros are a hole of a file while compiling (no protobuf, memory or disk holds them): a
    capacity of 2.5 GiB, past protobuf's 2 GB, compiles, verifies its prompt calls and cached steps, and the
    folder stores none of it."""
    _, out, _, _ = llama_stateful
    gen = tmp_path / "gen"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(out), "-o", str(gen), "--target", "cpu",
                           "--stateful-cache", "--max-batch", "1280", "--max-seq-len", "4096", "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # 1280 x 4096 positions x 2 layers x (keys, values) x 2 heads x 16 dims x 4 bytes = 2.5 GiB
    assert report["cache"]["bytes"] == 1280 * 4096 * 2 * 2 * 2 * 16 * 4
    assert report["status"] == "verified" and report["cache"]["cached_steps_check"]["argmax_match"]
    caches = json.loads((gen / "generation.json").read_text())["graphs"]["decode"]["state"]["params"]
    assert len(caches) == 4 and all(c["shape"] == [1280, 2, 4096, 16] for c in caches.values())
    assert _stored_bytes(gen / "decode.mindir", caches) == {name: 0 for name in caches}
    on_disk = sum(f.stat().st_blocks * 512 for f in gen.rglob("*") if f.is_file())
    assert on_disk < 8 * 2**20, on_disk  # (the weights: 0.5 MiB)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_low_precision_compile_holds_the_cache_low_and_its_cpu_mindir_fp32(tmp_path, precision):
    """A bf16 checkpoint exported --dtype auto and compiled --precision bf16/fp16 (the 7B's flow): the ascend
    MindIR's cache is in that dtype, the cpu MindIR's fp32 (generation.json's state.params and cpu_params: the
    zeros each loader gives), the bf16 network's verification on CPU (fp32 holding rounded values) writes its
    fp32 cache in place, and the cpu MindIR generates as transformers (fp32 compute)."""
    from graphconv.frontend.hf_export import export_checkpoint

    torch.manual_seed(0)
    src = _save(_llama().to(torch.bfloat16), tmp_path / "ckpt")
    export_checkpoint(src, tmp_path / "exp", "text-generation-with-past", dtype="auto")
    gen = tmp_path / "gen"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(tmp_path / "exp"), "-o", str(gen),
                           "--precision", precision, "--max-batch", "4", "--max-seq-len", "64", "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "verified" and report["cache"]["cached_steps_check"]["argmax_match"]
    state = json.loads((gen / "generation.json").read_text())["graphs"]["decode"]["state"]
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert {p["dtype"] for p in state["params"].values()} == {low} and len(state["params"]) == 4
    assert {p["dtype"] for p in state["cpu_params"].values()} == {"float32"}
    assert report["cache"]["bytes"] == 4 * 64 * 2 * 2 * 2 * 16 * 2  # rows, positions, layers, k/v, heads, dims, bytes
    census = primitive_census(gen / "decode.mindir")
    assert census.get("FusedInferAttentionScore") == 2 and census.get("ScatterNdUpdate") == 4
    _generate_matches_transformers(src, gen, eos=2, pad=2)


def test_cached_steps_too_large_for_this_host_are_skipped_with_the_reason(llama_stateful, tmp_path, monkeypatch):
    """Where MindSpore CPU cannot hold the model (the 1.1B), the compile still verifies the prompt calls, and
    the report says the cached steps were not checked and why."""
    from graphconv.generation import run as generation
    from gen_folder import compile_folder
    from graphconv.generation.report import summary

    _, out, _, _ = llama_stateful
    monkeypatch.setattr(generation, "fits_in_memory", lambda mindirs, gen: "needs about 25 GiB")
    report = compile_folder(out, tmp_path / "gen", target="cpu", stateful_cache=True, max_batch=2, max_seq_len=16)
    assert report["status"] == "verified" and report["cache"]["cached_steps_check"] == {"skipped": "needs about 25 GiB"}
    assert "cached steps not checked: needs about 25 GiB" in summary(report)  # (what the CLI prints)


STATEFUL_ARCHITECTURES = {  # beyond Llama: learned positions, sliding windows of 4 (shorter than the prompts)
    "gpt2": lambda: _gpt2(),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**_DECODER, sliding_window=4)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**_DECODER, head_dim=16, sliding_window=4)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_DECODER, head_dim=16)),
    # MLA: transformers caches the latent (kv_lora_rank 32) and the rotated key (16), one head each (a cache of
    # two head dims), decompressed at every step; DeepSeek-V3's interleaved rotary
    "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**_DECODER, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, first_k_dense_replace=2)),
    # layers of their own cache shapes: a sliding layer's head dim 16, the global layer's 64
    "gemma4": lambda: tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(
        **_DECODER, head_dim=16, global_head_dim=64, sliding_window=4, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16)),
    "minicpm3": lambda: tf.MiniCPM3ForCausalLM(tf.MiniCPM3Config(
        **{**_DECODER, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16)),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", STATEFUL_ARCHITECTURES)
def test_architecture_with_the_cache_held_in_place_generates_as_transformers(arch, tmp_path):
    from graphconv.frontend.hf_export import export_checkpoint
    from gen_folder import compile_folder

    torch.manual_seed(0)
    model = STATEFUL_ARCHITECTURES[arch]()
    src = _save(model, tmp_path / "ckpt")
    export_checkpoint(src, tmp_path / "out", "text-generation-with-past")
    report = compile_folder(tmp_path / "out", tmp_path / "gen", target="cpu", stateful_cache=True, max_batch=4,
                          max_seq_len=32)
    assert report["status"] == "verified" and report["cache"]["cached_steps_check"]["argmax_match"]
    eos = model.config.eos_token_id
    _generate_matches_transformers(src, tmp_path / "gen", eos=eos, pad=eos)


@pytest.mark.slow
def test_a_transformers_exporter_folder_compiles_to_the_stateful_form(tmp_path):
    """export_for_generation(..., multi_token_decode=True): its decode graph (cache inputs input.cache.layers.*)
    takes the prompt at past 0, so it alone is compiled with the cache held in place; the prompt step is checked
    against its own prefill.onnx. One-token decode graphs are refused with the reason."""
    from transformers.exporters import OnnxConfig, OnnxExporter

    from gen_folder import compile_folder

    torch.manual_seed(0)
    model = _llama().eval()
    src = _save(model, tmp_path / "ckpt")
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    for multi in (False, True):
        exported = OnnxExporter().export_for_generation(model, {"input_ids": ids, "attention_mask": mask},
                                                        OnnxConfig(dynamic=True), multi_token_decode=multi)
        exported.save_pretrained(tmp_path / f"exported-{multi}")
    with pytest.raises(graphconv.InputError, match="cannot take the prompt"):
        compile_folder(tmp_path / "exported-False", tmp_path / "gen1", target="cpu", stateful_cache=True)
    gen = tmp_path / "gen"
    report = compile_folder(tmp_path / "exported-True", gen, target="cpu", stateful_cache=True, max_batch=4)
    assert report["status"] == "verified" and report["steps"] == {"prefill": "decode", "decode": "decode"}
    assert report["cache"]["max_seq"] == 128 and report["cache"]["cached_steps_check"]["argmax_match"]
    assert sorted(report["cache"]["caches"]) == [f"input.cache.layers.{i}.{kv}" for i in (0, 1)
                                                 for kv in ("keys", "values")]
    _generate_matches_transformers(src, gen, eos=2, pad=2)


def test_a_streamed_mindir_keeps_no_cache_bytes_in_its_data_file(llama_stateful, tmp_path, monkeypatch):
    """Weights arriving as external data past export_task.STREAM_MIN_BYTES (lowered so the tiny model takes it) go to
    the split MindIR (decode_variables/data_0): the cache's bytes are cut out of that file too, the other
    Parameters moved up, and the generation gives the tokens of the inline MindIR."""
    from gen_folder import compile_folder
    from graphconv.compiler import export_task

    _, out, gen_inline, _ = llama_stateful
    src = tmp_path / "external"
    src.mkdir()
    onnx.save(onnx.load(str(out / "decode.onnx")), str(src / "decode.onnx"), save_as_external_data=True,
              location="decode.onnx.data", size_threshold=0)
    for f in ("prefill.onnx", "generation.json"):
        (src / f).symlink_to(out / f)
    monkeypatch.setattr(export_task, "STREAM_MIN_BYTES", 0)
    gen = tmp_path / "gen"
    compile_folder(src, gen, target="cpu", stateful_cache=True, max_batch=4, max_seq_len=64)
    model = mind_ir_pb2().ModelProto.FromString((gen / "decode.mindir").read_bytes())
    entries = [t.external_data for t in model.graph.parameter if t.HasField("external_data")]
    assert entries and {e.location for e in entries} == {"decode_variables/data_0"}
    caches = json.loads((gen / "generation.json").read_text())["graphs"]["decode"]["state"]["params"]
    assert len(caches) == 4 and _stored_bytes(gen / "decode.mindir", caches) == {n: 0 for n in caches}
    # data_0: the 64-byte header, then every other Parameter at a multiple of 64, nothing else
    padded = sum(-(-e.length // 64) * 64 for e in entries)
    assert (gen / "decode_variables" / "data_0").stat().st_size == 64 + padded
    assert sorted(e.offset for e in entries) == [64 + sum(-(-e.length // 64) * 64 for e in sorted(
        entries, key=lambda e: e.offset)[:k]) for k in range(len(entries))]
    prompts = "5,6,7,8,9,10,11;12,13,14;15,16,17,18,19"
    ran = [_run(str(g), "--input-ids", prompts, "--max-new-tokens", "6") for g in (gen, gen_inline)]
    assert ran[0].returncode == 0 and ran[0].stdout == ran[1].stdout, ran[0].stderr[-2000:]


def _torch_decode_export(model, path: Path) -> None:
    """A decode graph as a user exports it with torch alone: a wrapper taking the cache as tensors (their own
    names: k0, v0, ...), torch.onnx.export(dynamo=True) with every dim dynamic (torch names them s18, s70, ...,
    the mask's apart from the ids')."""
    import torch
    from transformers import DynamicCache

    layers = model.config.num_hidden_layers
    names = [f"{kv}{i}" for i in range(layers) for kv in ("k", "v")]

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=True, return_dict=True)
        return (out.logits, *[t for layer in out.cache.layers for t in (layer.keys, layer.values)])

    Step.forward = forward
    heads = model.config.num_key_value_heads
    dim = model.config.hidden_size // model.config.num_attention_heads
    past = [torch.randn(2, heads, 5, dim) for _ in names]
    ids = torch.randint(0, model.config.vocab_size, (2, 3))
    dynamic = torch.export.Dim.DYNAMIC
    shapes = ({0: dynamic, 1: dynamic},) * 3 + (({0: dynamic, 2: dynamic},) * len(names),)  # (*past: one tuple)
    torch.onnx.export(Step().eval(), (ids, torch.ones(2, 8, dtype=torch.long), torch.arange(5, 8).expand(2, 3), *past),
                      str(path), input_names=["input_ids", "attention_mask", "position_ids", *names],
                      output_names=["logits", *[f"{n}_out" for n in names]], dynamic_shapes=shapes, dynamo=True)


def test_a_decode_graph_exported_by_torch_directly_generates_as_transformers(tmp_path):
    """`compile decode.onnx -o GEN --stateful-cache` on a with-past graph torch exported from the user's own
    wrapper: the cache inputs are found by the pattern (named k0, v0, ...), the capacity and the token ids come
    from the checkpoint's config beside the graph, and generate gives transformers' tokens. Without a config
    beside it, --max-seq-len is required (one line, exit 1, nothing written)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    src = _save(_llama(), tmp_path / "ckpt")
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    _torch_decode_export(model, src / "decode.onnx")
    gen = tmp_path / "gen"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(src / "decode.onnx"), "-o", str(gen),
                           "--stateful-cache", "--target", "cpu", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["cache"]["max_seq"] == 128 and report["cache"]["cached_steps_check"]["argmax_match"]
    meta = json.loads((gen / "generation.json").read_text())
    assert meta["cache_feeds"] == {f"{n}_out": n for n in ("k0", "v0", "k1", "v1")} and meta["eos_token_id"] == 2
    _generate_matches_transformers(src, gen, eos=2, pad=2)

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "decode.onnx").symlink_to(src / "decode.onnx")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(bare / "decode.onnx"), "-o",
                           str(tmp_path / "gen2"), "--stateful-cache"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "--max-seq-len is required" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "gen2").exists()


def test_the_cache_capacity_declares_the_batch_and_length_ranges():
    """--max-batch and --max-seq-len bound the graph's batch and length dims for the fusions' size limits
    (passes/dim_bounds.py); a --shape-range the user gave wins."""
    from graphconv.generation import cache
    from graphconv.options import CompileOptions

    inputs = {"input_ids": ["batch", "sequence_length"], "position_ids": ["batch", "sequence_length"],
              "attention_mask": ["batch", "past_sequence_length + sequence_length"],
              "past_key_values.0.key": ["batch", 2, "past_sequence_length", 16]}
    meta = {"graphs": {"decode": {"inputs": inputs}}}
    assert cache.sizes(meta, (512, 64), CompileOptions()).ranges == {"batch": (1, 512), "sequence_length": (1, 64)}
    given = cache.sizes(meta, (512, 64), CompileOptions(shape_ranges={"batch": (1, 4)})).ranges
    assert given == {"batch": (1, 4), "sequence_length": (1, 64)}
