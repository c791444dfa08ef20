"""graphconv export CHECKPOINT_DIR --task: local transformers checkpoints (save_pretrained folders) to ONNX.

The proof of the with-past export: onnxruntime runs prefill, then 3 decode steps feeding present.* back as
past_key_values.* (mask grown, position_ids from the mask), and reproduces at every step the logits of the
PyTorch model run on the whole sequence without a cache, a left-padded row included.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from models.hf import INITIALIZER_RANGE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = {"vocab_size": 128, "initializer_range": INITIALIZER_RANGE}


def _llama(**over):
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "hidden_size": 64, "intermediate_size": 128,
                                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "max_position_embeddings": 128,
                                                 "bos_token_id": 1, "eos_token_id": 2, **over}))


def _gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(**TINY, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                            bos_token_id=127, eos_token_id=127))


def _bert():
    return tf.BertModel(tf.BertConfig(**TINY, max_position_embeddings=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4), add_pooling_layer=False)


def _save(model, path: Path, **kwargs) -> Path:
    torch.manual_seed(0)
    model.save_pretrained(path, **kwargs)
    return path


def _export(src: Path, out: Path, task: str, *extra: str):
    return subprocess.run([sys.executable, "-m", "graphconv", "export", str(src), "-o", str(out), "--task", task,
                           *extra], capture_output=True, text=True, cwd=ROOT)


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _io(path: Path) -> tuple[dict, dict]:
    m = onnx.load(str(path))
    return {vi.name: _dims(vi) for vi in m.graph.input}, {vi.name: _dims(vi) for vi in m.graph.output}


def _positions(mask: np.ndarray) -> np.ndarray:
    return (np.cumsum(mask, -1) - 1) * (mask != 0)


def _generate_with_ort(out: Path, prompt: np.ndarray, mask: np.ndarray, new_tokens: np.ndarray, num_layers: int):
    """Prefill, then one decode step per column of new_tokens; the logits of every step's token."""
    import onnxruntime as ort

    prefill = ort.InferenceSession(str(out / "prefill.onnx"), providers=["CPUExecutionProvider"])
    decode = ort.InferenceSession(str(out / "decode.onnx"), providers=["CPUExecutionProvider"])
    names = [f"{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    outs = prefill.run(None, {"input_ids": prompt, "attention_mask": mask, "position_ids": _positions(mask)})
    steps = [outs[0]]
    past = dict(zip(names, outs[1:]))
    for t in range(new_tokens.shape[1]):
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], axis=1)
        feed = {"input_ids": new_tokens[:, t:t + 1], "attention_mask": mask,
                "position_ids": _positions(mask)[:, -1:],
                **{f"past_key_values.{n}": v for n, v in past.items()}}
        outs = decode.run(None, feed)
        assert outs[1].shape[2] == mask.shape[1]  # the grown cache
        steps.append(outs[0])
        past = dict(zip(names, outs[1:]))
    return steps, mask


def _check_generation(src: Path, out: Path, num_layers: int) -> None:
    rng = np.random.default_rng(0)
    batch, prompt_len, steps = 2, 5, 3
    prompt = rng.integers(0, 128, (batch, prompt_len), dtype=np.int64)
    mask = np.ones((batch, prompt_len), np.int64)
    mask[0, :2] = 0  # row 0 left-padded by two
    new = rng.integers(0, 128, (batch, steps), dtype=np.int64)
    got, full_mask = _generate_with_ort(out, prompt, mask, new, num_layers)

    model = tf.AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True).eval()
    full = np.concatenate([prompt, new], axis=1)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(full), attention_mask=torch.from_numpy(full_mask),
                    position_ids=torch.from_numpy(_positions(full_mask)), use_cache=False).logits.numpy()
    # prefill: every unpadded position; then each decode step's token against the same position of the full run
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[0][valid], ref[:, :prompt_len][valid], atol=1e-4, rtol=0)
    for t in range(steps):
        np.testing.assert_allclose(got[1 + t][:, -1], ref[:, prompt_len + t], atol=1e-4, rtol=0)
    assert np.abs(ref[:, -1]).max() > 0.1  # the comparison is not of near-zero logits


def _check_with_past_files(out: Path, gen: dict, num_layers: int, heads: int, head_dim: int) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "generation.json", "prefill.onnx"]
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    ins, outs = _io(out / "prefill.onnx")
    assert ins == {n: ["batch", "sequence_length"] for n in ("input_ids", "attention_mask", "position_ids")}
    assert list(outs) == ["logits", *present]
    assert outs["present.0.key"] == ["batch", heads, "sequence_length", head_dim]
    ins, outs = _io(out / "decode.onnx")
    assert list(ins) == ["input_ids", "attention_mask", "position_ids", *past]
    assert ins["input_ids"] == ins["position_ids"] == ["batch", "sequence_length"]
    assert ins["attention_mask"] == ["batch", "past_sequence_length + sequence_length"]
    assert ins["past_key_values.1.value"] == ["batch", heads, "past_sequence_length", head_dim]
    assert list(outs) == ["logits", *present]
    assert outs["present.1.value"] == ["batch", heads, "past_sequence_length + sequence_length", head_dim]
    assert (gen["task"], gen["num_layers"], gen["num_kv_heads"], gen["head_dim"]) == \
        ("text-generation-with-past", num_layers, heads, head_dim)
    assert gen["cache_layout"] == "BNSD: [batch, kv_heads, seq, head_dim]"
    assert "padded positions set to 0" in gen["position_ids"]
    assert list(gen["graphs"]["decode"]["inputs"]) == ["input_ids", "attention_mask", "position_ids", *past]
    for name, cases in (("prefill", {"export shape", "second shape"}),
                        ("decode", {"export shape", "second shape", "empty cache"})):
        checks = gen["graphs"][name]["checks"]
        assert {c["shape"] for c in checks} == cases
        assert all(c["ok"] for c in checks) and {c["output"] for c in checks} == {"logits", *present}
    shapes = {c["shape"]: c["inputs"] for c in gen["graphs"]["decode"]["checks"]}
    first, second = shapes["export shape"], shapes["second shape"]
    assert first["input_ids"][0] != second["input_ids"][0]  # batch changes
    assert first["past_key_values.0.key"][2] != second["past_key_values.0.key"][2]  # and past
    # the decode graph at an empty cache, given a whole prompt, matched PyTorch: it can serve the prompt
    assert shapes["empty cache"]["past_key_values.0.key"][2] == 0 and shapes["empty cache"]["input_ids"][1] > 1
    assert gen["graphs"]["decode"]["serves_prompt"] is True and "serves_prompt" not in gen["graphs"]["prefill"]


@pytest.fixture(scope="module")
def llama_with_past(tmp_path_factory):
    base = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    src = _save(_llama(), base / "ckpt")
    out = base / "out"
    proc = _export(src, out, "text-generation-with-past")
    assert proc.returncode == 0, proc.stderr
    return src, out, proc


def test_llama_with_past_graphs_names_and_generation_json(llama_with_past):
    src, out, proc = llama_with_past
    gen = json.loads((out / "generation.json").read_text())
    _check_with_past_files(out, gen, num_layers=2, heads=2, head_dim=16)
    assert (gen["model_type"], gen["bos_token_id"], gen["eos_token_id"], gen["vocab_size"]) == ("llama", 1, 2, 128)
    assert gen["dtype"] == "fp32" and gen["opset"] == 18
    assert any("'sdpa'" in n for n in gen["notes"])
    assert "prefill: onnxruntime vs PyTorch at second shape" in proc.stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["ckpt", "out"]  # no partial directory left


def test_llama_prefill_and_three_decode_steps_reproduce_the_full_sequence(llama_with_past):
    src, out, _ = llama_with_past
    _check_generation(src, out, num_layers=2)


# (two graphs in CI through tests/test_generate.py's transformers-exporter folder)
@pytest.mark.parametrize("route", ["one graph", pytest.param("two graphs", marks=pytest.mark.slow)])
def test_llama_pair_compiles_into_a_generation_folder(llama_with_past, tmp_path, route):
    """`graphconv compile EXPORT_DIR -o GEN_DIR` with the cache passed in and out, verified with no --inputs (the
    decode mask's dims are past + seq). One graph: the decode graph serves the prompt too (the export checked it
    at an empty cache), verified at an empty cache and a cached step, its ascend MindIR holding
    FusedInferAttentionScore once per layer and no
    Softmax: the weights once per target. Two graphs (an export folder without that check, as written before
    it): the prefill's FlashAttentionScore beside it. The cpu MindIRs verified on their own; nothing else
    written."""
    _, out, _ = llama_with_past
    if route == "two graphs":
        old = tmp_path / "old"
        shutil.copytree(out, old)
        meta = json.loads((old / "generation.json").read_text())
        del meta["graphs"]["decode"]["serves_prompt"]
        (old / "generation.json").write_text(json.dumps(meta))
        out = old
    gen = tmp_path / "gen"
    # (the cache passed in and out: asked for on the one graph, which would hold it in place by default; the
    # default's fallback on the two: tests/test_stateful_cache.py)
    asked = ["--no-stateful-cache"] if route == "one graph" else []
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(out), "-o", str(gen), "-q", *asked],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs = {"decode": ("FusedInferAttentionScore", "FlashAttentionScore")}
    if route == "two graphs":
        graphs["prefill"] = ("FlashAttentionScore", "FusedInferAttentionScore")
    assert sorted(p.name for p in gen.iterdir()) == sorted(
        ["generation.json", "report.json", *(f"{g}{suffix}" for g in graphs for suffix in (".mindir", ".cpu.mindir"))])
    report = json.loads((gen / "report.json").read_text())
    assert report["status"] == "verified"
    assert report["steps"] == {"prefill": "prefill" if route == "two graphs" else "decode", "decode": "decode"}
    for name, (primitive, other) in graphs.items():
        r = report["graphs"][name]
        assert r["status"] == "verified" and r["validation"]["checked"].startswith("cpu twin of")
        assert r["census"].get(primitive) == 2 and other not in r["census"] and "Softmax" not in r["census"]
        assert r["coverage"]["attention"]["fused"] == 2
        twin = report["cpu_twins"][name]
        assert twin["status"] == "verified" and not twin["validation"]["checked"].startswith("cpu twin")
        assert report["weights"][name]["mindir_bytes"] > 0
    pasts = sorted(c["inputs"]["past_key_values.0.key"][2] for c in report["graphs"]["decode"]["validation"]["cases"])
    assert (pasts[0] == 0) == (route == "one graph") and pasts[-1] > 0
    steps = json.loads((gen / "generation.json").read_text())
    assert steps["source_dir"] == str(out.resolve())
    assert bool(steps["graphs"]["prefill"].get("empty_cache")) == (route == "one graph")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["gen"] + (["old"] if route == "two graphs" else []))
    probe = tmp_path / "probe"
    probe.mkdir()
    assert gen.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777  # a new directory's, not mkdtemp's 0700
    # generate runs either layout, each step within 1e-4 of onnxruntime's (tests/test_generate.py: the tokens)
    from graphconv.generation import run as generation

    result = generation.generate(gen, [[5, 6, 7, 8, 9], [10, 11]], 4, check=True, device="cpu")
    assert len(result.steps) == 4 and all(s["argmax_match"] and s["max_abs"] <= 1e-4 for s in result.steps)


@pytest.mark.parametrize("case, message", [
    ("exists", "already exists"), ("inputs", "one graph (decode) serves the prompt"),
    ("task", "is not text-generation-with-past")])
def test_pair_bad_input_is_one_line_and_writes_nothing(llama_with_past, tmp_path, case, message):
    _, out, _ = llama_with_past
    src, gen, extra = out, tmp_path / "gen", []
    if case == "exists":
        gen.mkdir()
    elif case == "inputs":
        extra = ["--inputs", f"prefill={tmp_path / 'x.npz'}"]
    else:
        src = tmp_path / "other"
        src.mkdir()
        meta = json.loads((out / "generation.json").read_text())
        (src / "generation.json").write_text(json.dumps({**meta, "task": "text-generation"}))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(src), "-o", str(gen), *extra],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _with_past(model, tmp_path, heads: int):
    """Save `model`, export it with past, check its files; (checkpoint, out dir, generation.json)."""
    src = _save(model, tmp_path / "ckpt")
    out = tmp_path / "out"
    proc = _export(src, out, "text-generation-with-past")
    assert proc.returncode == 0, proc.stderr
    gen = json.loads((out / "generation.json").read_text())
    _check_with_past_files(out, gen, num_layers=2, heads=heads, head_dim=16)
    return src, out, gen


@pytest.mark.slow
def test_gpt2_with_past_reproduces_the_full_sequence(tmp_path):
    """GPT-2: learned absolute positions (position_ids matter), tied lm_head, 4 kv heads of 16."""
    torch.manual_seed(0)
    src, out, gen = _with_past(_gpt2(), tmp_path, heads=4)
    assert (gen["model_type"], gen["eos_token_id"]) == ("gpt2", 127)
    assert any("tied parameters" in n for n in gen["notes"])
    _check_generation(src, out, num_layers=2)


@pytest.mark.slow
def test_mixtral_with_past_exports_its_experts_as_batched_mm(tmp_path):
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**TINY, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   max_position_embeddings=128, num_local_experts=4,
                                                   num_experts_per_tok=2, bos_token_id=1, eos_token_id=2))
    src, out, gen = _with_past(model, tmp_path, heads=2)
    assert any("experts_implementation='batched_mm'" in n for n in gen["notes"])
    _check_generation(src, out, num_layers=2)


def test_bert_feature_extraction(tmp_path):
    torch.manual_seed(0)
    src = _save(_bert(), tmp_path / "ckpt")
    out = tmp_path / "out"
    proc = _export(src, out, "feature-extraction")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["generation.json", "model.onnx"]
    ins, outs = _io(out / "model.onnx")
    assert ins == {"input_ids": ["batch", "sequence_length"], "attention_mask": ["batch", "sequence_length"]}
    assert outs == {"last_hidden_state": ["batch", "sequence_length", 64]}
    gen = json.loads((out / "generation.json").read_text())
    assert (gen["model_type"], gen["task"]) == ("bert", "feature-extraction")
    assert all(c["ok"] for c in gen["graphs"]["model"]["checks"]) and len(gen["graphs"]["model"]["checks"]) == 2


@pytest.mark.slow
def test_sharded_bf16_llama_text_generation_is_upcast(tmp_path):
    """A bf16 checkpoint in shards: loaded as fp32 (the note says so), logits checked at two shapes, and the
    logits agree with the fp32 PyTorch model of the same folder."""
    import onnxruntime as ort

    torch.manual_seed(0)
    src = _save(_llama().to(torch.bfloat16), tmp_path / "ckpt", max_shard_size="50KB")
    assert (src / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    proc = _export(src, out, "text-generation")
    assert proc.returncode == 0, proc.stderr
    gen = json.loads((out / "generation.json").read_text())
    assert gen["stored_dtypes"] == ["bf16"]
    assert any("stored in bf16 were upcast to fp32" in n for n in gen["notes"])
    ins, outs = _io(out / "model.onnx")
    assert list(ins) == ["input_ids", "attention_mask"] and outs == {"logits": ["batch", "sequence_length", 128]}
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    mask = np.ones_like(ids)
    got = ort.InferenceSession(str(out / "model.onnx")).run(None, {"input_ids": ids, "attention_mask": mask})[0]
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


# --- bad input: one line, exit 1, nothing written ---------------------------------------------------------------


def _refused(proc, match: str, out: Path) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("graphconv: error:") and match in lines[-1], proc.stderr
    assert not any("Traceback" in ln for ln in lines)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    _refused(_export(tmp_path / "ckpt", tmp_path / "out", "text-generation"), "no config.json", tmp_path / "out")


def test_unknown_model_type_is_refused(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["NoSuch"]}))
    (src / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    _refused(_export(src, tmp_path / "out", "text-generation"), "model type 'no-such-model' is unknown",
             tmp_path / "out")


def test_missing_shard_is_refused(tmp_path):
    torch.manual_seed(0)
    src = _save(_llama(), tmp_path / "ckpt", max_shard_size="50KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    _refused(_export(src, tmp_path / "out", "text-generation"), f"missing shard(s) {shards[-1].name}",
             tmp_path / "out")


def test_a_cache_of_another_kind_is_refused(tmp_path):
    """Qwen3-Next's linear-attention layers keep a recurrent state, not keys and values: with-past is refused
    before anything is traced (config.json and a few tensors whose sizes agree with it are all it reads)."""
    from safetensors.torch import save_file

    src = tmp_path / "ckpt"
    src.mkdir()
    config = tf.Qwen3NextConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                vocab_size=128)
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(src)
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64),
               **{f"model.layers.{i}.input_layernorm.weight": torch.ones(64) for i in range(4)}},
              src / "model.safetensors")
    _refused(_export(src, tmp_path / "out", "text-generation-with-past"),
             "model type 'qwen3_next' has linear_attention layers", tmp_path / "out")


def test_truncated_shard_is_refused(tmp_path):
    """A shard cut short (an interrupted download or copy): its header promises more tensor bytes than it holds."""
    torch.manual_seed(0)
    src = _save(_llama(), tmp_path / "ckpt", max_shard_size="50KB")
    shard = sorted(src.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _refused(_export(src, tmp_path / "out", "text-generation-with-past"), f"{shard.name}: truncated",
             tmp_path / "out")


def test_a_task_the_model_cannot_do_is_refused(tmp_path):
    torch.manual_seed(0)
    src = _save(_bert(), tmp_path / "ckpt")
    _refused(_export(src, tmp_path / "out", "text-generation"), "has no language-model head", tmp_path / "out")
    _refused(_export(src, tmp_path / "out", "text-generation-with-past"), "cannot do text-generation-with-past",
             tmp_path / "out")


def test_existing_output_and_a_folder_without_weights_are_refused(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    proc = _export(src, out, "text-generation")
    assert proc.returncode == 1 and "already exists" in proc.stderr.strip().splitlines()[-1]
    assert [p.name for p in out.iterdir()] == ["keep"]
    proc = subprocess.run([sys.executable, "-m", "graphconv", "export", str(src), "-o", str(tmp_path / "new")],
                          capture_output=True, text=True, cwd=ROOT)
    _refused(proc, "no *.safetensors weights", tmp_path / "new")  # (no --task: auto, after the folder's checks)


def test_gemma4_per_layer_head_dim_exports_and_compiles(tmp_path):
    """Gemma 4's config raises for `head_dim` (a per-layer attribute: transformers 5's heterogeneous configs),
    which ended the export in an internal error (exit 3) while writing generation.json. The export now records
    no global head dim and the model compiles, every attention, norm and rotary fused; the with-past export
    records each cache layer's shape (its sliding layer's head dim 16, its global layer's 512: transformers'
    default global_head_dim)."""
    import graphconv

    torch.manual_seed(0)
    config = tf.Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    src = _save(tf.Gemma4ForCausalLM(config).eval(), tmp_path / "ckpt")
    proc = _export(src, tmp_path / "out", "text-generation")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "generation.json").read_text())["head_dim"] is None
    report = graphconv.compile(tmp_path / "out" / "model.onnx", tmp_path / "m.mindir", target="ascend")
    assert report.status == "verified"
    for family in ("attention", "norm", "rotary"):
        c = report.coverage[family]
        assert c["candidates"] > 0 and c["fused"] == c["candidates"], (family, c)
    proc = _export(src, tmp_path / "past", "text-generation-with-past")
    assert proc.returncode == 0, proc.stderr
    assert config.layer_types == ["sliding_attention", "full_attention"]
    meta = json.loads((tmp_path / "past" / "generation.json").read_text())
    assert meta["cache_layers"] == [[2, 16, 16], [2, 512, 512]]  # [kv heads, key head dim, value head dim]


def test_an_axis_exported_static_is_named():
    """export.fixed_dynamic_axes on an exported graph whose sequence axis came out as a number."""
    import onnx_ir as ir

    from graphconv.frontend.export import fixed_dynamic_axes

    def graph(seq):
        x = ir.Value(name="input_ids", shape=ir.Shape(["batch", seq]), type=ir.TensorType(ir.DataType.INT64))
        return ir.Model(ir.Graph([x], [], nodes=[]), ir_version=10)

    inputs, axes = {"ids": None}, {"ids": {0: "batch", 1: "sequence_length"}}
    assert fixed_dynamic_axes(graph("sequence_length"), inputs, ["input_ids"], axes) is None
    assert fixed_dynamic_axes(graph(7), inputs, ["input_ids"], axes).startswith(
        "PyTorch's dynamo exporter fixed input_ids's axis 1 (sequence_length) at 7, the example's size")


@pytest.mark.slow
def test_a_sequence_length_the_exporter_fixes_is_named_at_export(tmp_path):
    """Qwen 3.5 (linear-attention layers): dynamo fixes the sequence axis at the example's 7 without a word; the
    export ended in onnxruntime's truncated "invalid dimensions" at the second shape. Now one line names the
    input, the axis and the size, exit 1, nothing written."""
    config = tf.Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    src = _save(tf.Qwen3_5ForCausalLM(config).eval(), tmp_path / "ckpt")
    proc = _export(src, tmp_path / "out", "text-generation")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr  # (no torch.onnx warnings either)
    assert "fixed input_ids's axis 1 (sequence_length) at 7, the example's size" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_router_whose_experts_tie_is_named_at_export(tmp_path):
    """AFMoE built from its config: transformers zero-initialises the router, every expert scores 0.5, and
    which 2 of 4 a top-k keeps is the implementation's tie-break (torch.topk kept experts 2 and 3, onnxruntime's
    TopK 0 and 1): every logit disagreed (3600 of 3600). The refusal now names the top-k and its ties, one
    line, exit 1, nothing written; the same checkpoint with a random router exports and agrees with PyTorch."""
    torch.manual_seed(0)
    config = tf.AfmoeConfig(**TINY, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_hidden_layers=2, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                            max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"])
    model = tf.AfmoeForCausalLM(config).eval()
    router = model.model.layers[1].mlp.router.gate.weight
    assert not router.any()  # (transformers' initialisation, what the test is about)
    src = _save(model, tmp_path / "ckpt")
    _refused(_export(src, tmp_path / "out", "text-generation"),
             "torch.topk(k=2) in AfmoeTokenChoiceRouter.forward finds its k-th and (k+1)-th values equal (0.5) "
             "in 14 of 14 rows: torch.topk and ONNX TopK (the lower index first) keep different ones", tmp_path / "out")
    with torch.no_grad():
        router.normal_(0, INITIALIZER_RANGE)
    src = _save(model, tmp_path / "routed")
    proc = _export(src, tmp_path / "out", "text-generation")
    assert proc.returncode == 0, proc.stderr
    checks = json.loads((tmp_path / "out" / "generation.json").read_text())["graphs"]["model"]["checks"]
    assert len(checks) == 2 and all(c["ok"] and c["max_abs"] < 1e-4 for c in checks), checks


def test_a_model_with_a_recurrent_state_is_refused_for_with_past(tmp_path):
    """RWKV returns a recurrent `state`, not a KV cache: the with-past export was an internal error (exit 3,
    "'RwkvCausalLMOutput' object has no attribute 'cache'"); it is one line naming what the model returns."""
    torch.manual_seed(0)
    config = tf.RwkvConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                           intermediate_size=128, context_length=64, bos_token_id=1, eos_token_id=2)
    src = _save(tf.RwkvForCausalLM(config).eval(), tmp_path / "ckpt")
    proc = _export(src, tmp_path / "past", "text-generation-with-past")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "RwkvForCausalLM returns no KV cache (its outputs: logits, state)" in proc.stderr
    assert not (tmp_path / "past").exists()
