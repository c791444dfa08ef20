"""com.microsoft GroupQueryAttention and RotaryEmbedding: decomposed on load (graphconv/frontend/contrib/gqa.py,
rotary.py) into the attention / RoPE spellings fuse-attention and fuse-rope fuse; onnxruntime runs both the
contrib graph and the decomposition. Hand-built graphs for each attribute variant, and onnxruntime-genai's model
builder output (tiny Llama, Qwen2, Phi-3 saved from code) compiled for ascend with the cpu twin verified."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import graphconv
from fusion_utils import fuse, fused_nodes
from graphconv.errors import UnsupportedError
from graphconv.frontend import contrib
from graphconv.verify import compare, reference
from graphconv.verify.reference import ReferenceCase
from tests.contrib_utils import decomposition_matches, model

N, KV, H = 4, 2, 16


def _caches(rotary_dim: int, max_pos: int = 64):
    inv = 10000.0 ** (-np.arange(rotary_dim // 2) * 2 / rotary_dim)
    ang = np.arange(max_pos)[:, None] * inv[None]
    return [numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos_cache"),
            numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin_cache")]


def gqa_model(packed=True, past=True, rotary=True, n=N, kv=KV, h=H, rotary_dim=None, batch="batch", sink=False,
              positions=False, bias_heads=0, **attrs):
    """One GroupQueryAttention node as the model builder writes it (packed QKV, past/present, seqlens_k and
    total_sequence_length as graph inputs, cos/sin caches as initializers), or a variant; `positions` adds the
    position_ids input and `bias_heads` (1 or n) an attention_bias input of that many heads, as transformers'
    exporter with ort_fusions writes them."""
    hidden = (n + 2 * kv) * h if packed else n * h
    vi = helper.make_tensor_value_info
    inputs = [vi("query", T.FLOAT, [batch, "seq", hidden])]
    names = ["query", "", ""]
    if not packed:
        inputs += [vi(x, T.FLOAT, [batch, "seq", kv * h]) for x in ("key", "value")]
        names = ["query", "key", "value"]
    if past:
        inputs += [vi(x, T.FLOAT, [batch, kv, "past", h]) for x in ("past_key", "past_value")]
    names += ["past_key", "past_value"] if past else ["", ""]
    inputs += [vi("seqlens_k", T.INT32, [batch]), vi("total_sequence_length", T.INT32, [])]
    names += ["seqlens_k", "total_sequence_length"]
    inits = []
    if rotary:
        inits = _caches(rotary_dim or h)
        names += ["cos_cache", "sin_cache"]
    if positions:
        names += [""] * (9 - len(names)) + ["position_ids"]
        inputs.append(vi("position_ids", T.INT64, [batch, "seq"]))
    if bias_heads:
        names += [""] * (10 - len(names)) + ["attention_bias"]
        inputs.append(vi("attention_bias", T.FLOAT, [batch, bias_heads, "seq", "total"]))
    if sink:
        names += [""] * (11 - len(names)) + ["head_sink"]
        inits.append(numpy_helper.from_array(np.linspace(-1, 2, n).astype(np.float32), "head_sink"))
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", name="gqa", num_heads=n, kv_num_heads=kv, do_rotary=int(rotary),
                            **attrs)
    outputs = [vi("output", T.FLOAT, [batch, "seq", n * h]),
               vi("present_key", T.FLOAT, [batch, kv, "total", h]),
               vi("present_value", T.FLOAT, [batch, kv, "total", h])]
    return model([node], inputs, outputs, inits)


def gqa_case(m, b, s, past, lens, seed=0) -> ReferenceCase:
    """Inputs for `m`: batch b, s new tokens, a cache of `past` rows, T_b = lens[b] (seqlens_k = lens - 1);
    total_sequence_length = max(lens). lens < past + s: a ragged (right-padded) batch."""
    rng = np.random.default_rng(seed)
    specs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    sizes = {"batch": b, "seq": s, "past": past, "total": max(lens)}
    feeds = {}
    for name, dims in specs.items():
        if name == "position_ids":  # any positions within the cos/sin caches' 64 rows
            feeds[name] = rng.integers(0, 60, (b, s)).astype(np.int64)
        elif name == "attention_bias":  # a bias, some entries a large negative (a padding mask's)
            x = rng.standard_normal([sizes.get(d, d) for d in dims])
            feeds[name] = np.where(rng.random(x.shape) < 0.2, -1e9, x).astype(np.float32)
        elif name == "seqlens_k":
            feeds[name] = np.array(lens, np.int32) - 1
        elif name == "total_sequence_length":
            feeds[name] = np.array(max(lens), np.int32)
        else:
            feeds[name] = rng.standard_normal([sizes.get(d, d) for d in dims]).astype(np.float32)
    return ReferenceCase(f"b{b}s{s}p{past}", feeds)


# (batch, new tokens, cache rows, T_b): a right-padded first prompt (T_1 = 3 < S = 5: padded rows compared
# too, the kernel's values there are matched), a ragged decode step (row 1's cache holds 2 valid rows of 4), and
# more than one new token over a cache (onnxruntime takes that at batch 1 only).
PROMPT, DECODE, CHUNK = (2, 5, 0, [5, 3]), (2, 1, 4, [5, 3]), (1, 3, 4, [7])

VARIANTS = {
    "builder": {},  # packed QKV, do_rotary, halves, past/present: what onnxruntime-genai's builder writes
    "separate-qkv": dict(packed=False),
    "interleaved": dict(rotary_interleaved=1),
    "partial-rotary": dict(h=32, rotary_dim=16),
    "partial-interleaved": dict(h=32, rotary_dim=16, rotary_interleaved=1),
    "no-rotary": dict(rotary=False),
    "local-window": dict(local_window_size=2),
    "softcap": dict(softcap=1.5),
    "smooth-softmax": dict(smooth_softmax=1),
    "head-sink": dict(sink=True),
    "scale": dict(scale=0.1),
    "mha": dict(kv=4),
    # transformers' exporter (OnnxConfig(ort_fusions="cpu")): position_ids and an attention_bias (its mask)
    "position-ids": dict(positions=True),
    "attention-bias": dict(bias_heads=1),
    "per-head-bias": dict(bias_heads=N),
    "exporter": dict(positions=True, bias_heads=1),
    "bias-softcap": dict(bias_heads=1, softcap=1.5),
    "bias-window": dict(bias_heads=1, local_window_size=2),
    "bias-sink": dict(bias_heads=1, sink=True),
    "positions-interleaved-partial": dict(positions=True, h=32, rotary_dim=16, rotary_interleaved=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_group_query_attention_decomposes_exactly(variant):
    kw = VARIANTS[variant]
    m = gqa_model(**kw)
    _, counts = decomposition_matches(m, cases=[gqa_case(m, *c, seed=k) for k, c in enumerate((PROMPT, DECODE, CHUNK))])
    assert counts == {"com.microsoft::GroupQueryAttention": 1}


def _fp16(m):
    for v in list(m.graph.input) + list(m.graph.output):
        if v.type.tensor_type.elem_type == T.FLOAT:
            v.type.tensor_type.elem_type = T.FLOAT16
    for t in m.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    return m


@pytest.mark.parametrize("variant", ["builder", "local-window", "softcap", "head-sink", "exporter"])
def test_float16_group_query_attention_decomposes_within_fp16_tolerance(variant):
    """onnxruntime's fp16 kernel computes the scores and softmax in fp32 (the decomposition's Cast island around
    the softmax). Compared on the valid rows: its padded rows differ from its own fp32 kernel's with a window."""
    m = _fp16(gqa_model(**VARIANTS[variant]))
    cases = []
    for k, (b, s, past, lens) in enumerate((PROMPT, DECODE, CHUNK)):
        case = gqa_case(m, b, s, past, lens, seed=k)
        case.inputs = {n: x.astype(np.float16) if x.dtype == np.float32 else x for n, x in case.inputs.items()}
        first = past == 0
        case.mask = np.array([[(i < t) if first else True for i in range(s)] for t in lens])
        cases.append(case)
    decomposition_matches(m, atol=1e-2, rtol=1e-2, cases=cases)


def test_group_query_attention_without_a_cache_decomposes_exactly():
    m = gqa_model(past=False)
    decomposition_matches(m, cases=[gqa_case(m, *PROMPT), gqa_case(m, 1, 4, 0, [4], seed=1)])


@pytest.mark.parametrize("inputs, attrs, why", [
    ({12: "k_scale"}, {}, "k_scale"), ({16: "query_seqlens"}, {}, "query_seqlens"),
    ({}, {"causal": 0}, "causal=0"), ({}, {"sliding_window_cache": 1, "local_window_size": 4}, "sliding_window_cache"),
    ({}, {"k_quant_type": "PER_TENSOR"}, "quantized"),
])
def test_what_is_not_decomposed_is_refused_in_one_line(inputs, attrs, why):
    m = gqa_model(**attrs)
    node = m.graph.node[0]
    for i, name in inputs.items():
        while len(node.input) <= i:
            node.input.append("")
        node.input[i] = name
    with pytest.raises(UnsupportedError, match=why) as e:
        contrib.decompose(m)
    assert "\n" not in str(e.value) and "GroupQueryAttention" in str(e.value)


def _fused(m, pass_name):
    decomposed, _ = contrib.decompose(m)
    return decomposed, fuse(decomposed, pass_name)


def same_as_onnxruntime(original, fused, cases, tol=1e-5):
    """onnxruntime on the fused graph (function bodies inlined) equals onnxruntime on the contrib graph."""
    for case, exp, got in zip(cases, reference.Oracle(original).run(cases), reference.Oracle(fused).run(cases)):
        for name, ref in exp.items():
            c = compare.compare(got[name], ref, tol, tol)
            assert c.ok, (name, case.shape_text(), c)


def _mode(node):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == "mode")


@pytest.mark.parametrize("past, kind", [(True, "FusedInferAttentionScore"), (False, "FlashAttentionScore")])
def test_the_attention_fuses_over_a_cache_and_without_one(past, kind):
    """Expected from the node: one attention; with past/present it runs over a cache (Concat(past, new)),
    FusedInferAttentionScore, without one FlashAttentionScore; GQA's kv heads stay un-repeated (N2 = 2)."""
    m = gqa_model(past=past)
    decomposed, (count, fused) = _fused(m, "fuse-attention")
    (node,) = fused_nodes(fused)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert count == 1 and node.op_type == kind
    assert (attrs["head_num"], attrs["kv_head_num"]) == (N, KV) and attrs["scale"] == pytest.approx(H ** -0.5)
    cases = [gqa_case(m, 2, 5, 0, [5, 5])] + ([gqa_case(m, 2, 1, 4, [5, 5], seed=1)] if past else [])
    same_as_onnxruntime(m, fused, cases)


@pytest.mark.parametrize("interleaved, batch, fused_count", [(0, "batch", 2), (1, 1, 2), (1, "batch", 0)])
def test_the_rotary_part_fuses_to_rotary_position_embedding(interleaved, batch, fused_count):
    """q and k are rotated: 2 RoPE applications. Halves (mode 0) take cos/sin of B1SD; pairs (mode 1) only 11SD,
    which GroupQueryAttention's per-row positions give only at a static batch of 1 (else refused, with why)."""
    m = gqa_model(rotary_interleaved=interleaved, batch=batch)
    _, (count, fused) = _fused(m, "fuse-rope")
    assert count == fused_count
    assert all(_mode(n) == interleaved for n in fused_nodes(fused))
    b = 1 if batch == 1 else 2
    same_as_onnxruntime(m, fused, [gqa_case(m, b, 5, 0, [5] * b), gqa_case(m, b, 1, 4, [5] * b, seed=1)])


def exporter_gqa_model(past=True):
    """GroupQueryAttention as transformers' exporter writes it with OnnxConfig(ort_fusions="cpu"): position_ids
    (input 9) and, as attention_bias (input 10), its padding-and-causal mask Cast(Not(keep)) · float32 min
    built in the graph from a bool `keep` (B, 1, S, T) (a graph input here; the export computes it)."""
    m = gqa_model(past=past, positions=True, bias_heads=1)
    keep = helper.make_tensor_value_info("keep", T.BOOL, ["batch", 1, "seq", "total"])
    bias = [helper.make_node("Not", ["keep"], ["discard"]),
            helper.make_node("Cast", ["discard"], ["discard_f"], to=T.FLOAT),
            helper.make_node("Mul", ["discard_f", "fmin"], ["attention_bias"])]
    m.graph.initializer.append(numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "fmin"))
    (old,) = [i for i in m.graph.input if i.name == "attention_bias"]
    m.graph.input.remove(old)
    m.graph.input.append(keep)
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(bias + nodes)
    return m


def _exporter_case(m, b, s, past, seed=0, pad_query=False):
    """Full rows (the exporter's seqlens_k), positions past + s, and a mask keeping the causal keys of all but
    the first key of row 1 (a padded position); `pad_query`: also for the query at that position, which then
    keeps no key (the kernel gives 0 there; the fused primitives leave such a row undefined)."""
    case = gqa_case(m, b, s, past, [past + s] * b, seed=seed)
    case.inputs["position_ids"] = np.tile(past + np.arange(s), (b, 1)).astype(np.int64)
    keep = np.tril(np.ones((s, past + s), bool), k=past)[None, None].repeat(b, 0)
    keep[1, :, 0 if pad_query else 1:, 0] = False
    case.inputs["keep"] = keep
    case.inputs.pop("attention_bias", None)
    return case


@pytest.mark.parametrize("past, kind", [(True, "FusedInferAttentionScore"), (False, "FlashAttentionScore")])
def test_the_exporter_spelling_fuses_attention_and_rotary(past, kind):
    """Expected from the node: one attention over the cache (or none), its mask the exporter's bias, and two RoPE
    applications (q and k) at position_ids. The old code refused the node ("its position_ids input is not
    decomposed")."""
    m = exporter_gqa_model(past)
    cases = [_exporter_case(m, 2, 5, 0)] + ([_exporter_case(m, 2, 1, 4, seed=1)] if past else [])
    decomposition_matches(m, cases=cases + [_exporter_case(m, 2, 5, 0, pad_query=True)])
    _, (count, fused) = _fused(m, "fuse-attention")
    assert count == 1 and [n.op_type for n in fused_nodes(fused)] == [kind]
    same_as_onnxruntime(m, fused, cases)
    _, (count, fused) = _fused(m, "fuse-rope")
    assert count == 2 and all(_mode(n) == 0 for n in fused_nodes(fused))
    same_as_onnxruntime(m, fused, cases)


def test_softcap_decomposes_but_does_not_fuse():
    """FlashAttentionScore has no soft-capping argument: the decomposition stays unfused (fuse-attention's
    coverage says why)."""
    _, (count, _) = _fused(gqa_model(softcap=2.0), "fuse-attention")
    assert count == 0


# --- com.microsoft RotaryEmbedding ---------------------------------------------------------------------------
def rope_model(rank=3, positions="2d", n=N, h=H, rotary_dim=0, **attrs):
    shape = ["batch", "seq", n * h] if rank == 3 else ["batch", n, "seq", h]
    vi = helper.make_tensor_value_info
    inputs = [vi("x", T.FLOAT, shape), vi("pos", T.INT64, ["batch", "seq"] if positions == "2d" else [1])]
    if rotary_dim:
        attrs.update(rotary_embedding_dim=rotary_dim, num_heads=n)
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos_cache", "sin_cache"], ["y"], domain="com.microsoft",
                            name="rope", **attrs)
    return model([node], inputs, [vi("y", T.FLOAT, shape)], _caches(rotary_dim or h))


def _rope_cases(m, positions):
    cases = []
    for k, (b, s) in enumerate(((2, 5), (3, 2))):
        rng = np.random.default_rng(k)
        dims = [d.dim_value or d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim]
        x = rng.standard_normal([{"batch": b, "seq": s}.get(d, d) for d in dims]).astype(np.float32)
        pos = rng.integers(0, 50, (b, s)) if positions == "2d" else np.array([7 + k])
        cases.append(ReferenceCase(f"b{b}s{s}", {"x": x, "pos": pos.astype(np.int64)}))
    return cases


ROPE_VARIANTS = {
    "bsh": {}, "bnsh": dict(rank=4), "offset": dict(positions="offset"),
    "bnsh-offset": dict(rank=4, positions="offset"),
    "interleaved": dict(interleaved=1), "bnsh-interleaved": dict(rank=4, interleaved=1),
    "partial": dict(rotary_dim=8), "partial-interleaved": dict(rotary_dim=8, interleaved=1),
    "scale-unused": dict(scale=0.5), "num-heads": dict(num_heads=N),
}


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rotary_embedding_decomposes_exactly(variant):
    kw = ROPE_VARIANTS[variant]
    m = rope_model(**kw)
    _, counts = decomposition_matches(m, cases=_rope_cases(m, kw.get("positions", "2d")))
    assert counts == {"com.microsoft::RotaryEmbedding": 1}


@pytest.mark.parametrize("variant, fused_count", [("bsh", 1), ("bnsh", 1), ("partial", 1), ("bnsh-offset", 1),
                                                  ("offset", 1), ("interleaved", 0), ("bnsh-interleaved", 0)])
def test_rotary_embedding_fuses(variant, fused_count):
    """One application. Position ids (B, S) give cos/sin B1SD (BNSH) or BS1D (BSH): fused in mode 0 only
    (mode 1 takes 11SD / 1S1D); one-element positions give 11SD / 1S1D, fused in either mode."""
    kw = ROPE_VARIANTS[variant]
    m = rope_model(**kw)
    _, (count, fused) = _fused(m, "fuse-rope")
    assert count == fused_count
    same_as_onnxruntime(m, fused, _rope_cases(m, kw.get("positions", "2d")))


@pytest.mark.parametrize("variant", ["offset-interleaved", "bnsh-offset-interleaved"])
def test_interleaved_rotary_embedding_with_an_offset_fuses_in_mode_1(variant):
    m = rope_model(rank=4 if variant.startswith("bnsh") else 3, positions="offset", interleaved=1)
    _, (count, fused) = _fused(m, "fuse-rope")
    assert count == 1 and _mode(fused_nodes(fused)[0]) == 1
    same_as_onnxruntime(m, fused, _rope_cases(m, "offset"))


def test_packed_batching_is_refused():
    with pytest.raises(UnsupportedError, match="is_packed_batching"):
        contrib.decompose(rope_model(is_packed_batching=1))


# --- whole compiles ---------------------------------------------------------------------------------------
def _npz(path, case: ReferenceCase):
    np.savez(path, **case.inputs)
    return path


def test_a_hand_built_decode_graph_compiles_fused_for_ascend(tmp_path):
    m = gqa_model()
    path = tmp_path / "gqa.onnx"
    onnx.save(m, path)
    inputs = [_npz(tmp_path / "prompt.npz", gqa_case(m, 2, 5, 0, [5, 5])),
              _npz(tmp_path / "step.npz", gqa_case(m, 1, 3, 4, [7], seed=1))]
    report = graphconv.compile(path, tmp_path / "gqa.mindir", target="ascend", inputs=inputs)
    assert report.status == "verified", report.error
    assert report.fusions["fuse-attention"] == 1 and report.fusions["fuse-rope"] == 2
    assert report.census.get("FusedInferAttentionScore") == 1 and report.census.get("RotaryPositionEmbedding") == 2
    assert "Softmax" not in report.census


# --- onnxruntime-genai's model builder -----------------------------------------------------------------------
_CHECKPOINT = r'''
import sys, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
arch, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
V = 256
common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
if arch == "llama":
    cfg, M = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
elif arch == "qwen2":
    cfg, M = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
else:
    cfg = transformers.Phi3Config(**common, pad_token_id=0, original_max_position_embeddings=256)
    M = transformers.Phi3ForCausalLM
M(cfg).eval().save_pretrained(out)
vocab = {f"t{i}": i for i in range(V)}
vocab["[UNK]"] = 0
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="t1", bos_token="t2").save_pretrained(out)
'''


def genai_model(arch: str, root) -> onnx.ModelProto:
    """A tiny random `arch` checkpoint (head size 16, 4 heads over 2 kv heads, 2 layers) through
    `python -m onnxruntime_genai.models.builder -p fp32 -e cpu`; returns the path of its model.onnx."""
    hf, out = root / f"hf_{arch}", root / f"genai_{arch}"
    subprocess.run([sys.executable, "-c", _CHECKPOINT, arch, str(hf)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                    "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    return out / "model.onnx"


def _genai_case(path, b, s, past, layers=2, seed=0):
    """input_ids, an all-ones attention_mask over past + s, past key/values (kv_cache_dim bound to H)."""
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(3, 256, (b, s)).astype(np.int64),
             "attention_mask": np.ones((b, past + s), np.int64)}
    for i in range(layers):
        for t in ("key", "value"):
            feeds[f"past_key_values.{i}.{t}"] = rng.standard_normal((b, KV, past, H)).astype(np.float32)
    np.savez(path, **feeds)
    return path


def _live_attention(path) -> tuple[int, int]:
    """From the builder's graph: (GroupQueryAttention nodes whose output reaches a graph output, the RoPE
    applications that are live: q and k of those, k alone of a node whose only live outputs are present)."""
    g = onnx.load(path, load_external_data=False).graph
    producers = {o: n for n in g.node for o in n.output}
    live, todo = set(), [o.name for o in g.output]
    while todo:
        v = todo.pop()
        if v in live:
            continue
        live.add(v)
        n = producers.get(v)
        if n is not None:
            todo += [i for i in n.input if i]
    attention = rope = 0
    for n in g.node:
        if n.op_type == "GroupQueryAttention":
            attention += n.output[0] in live
            rope += 2 if n.output[0] in live else int(any(o in live for o in n.output[1:]))
    return attention, rope


def _compile_genai(arch, tmp_path):
    path = genai_model(arch, tmp_path)
    inputs = [_genai_case(tmp_path / "prompt.npz", 2, 5, 0), _genai_case(tmp_path / "chunk.npz", 1, 3, 4, seed=1)]
    report = graphconv.compile(path, tmp_path / f"{arch}.mindir", target="ascend", inputs=inputs)
    assert report.status == "verified", report.error
    assert report.validation["checked"].startswith("cpu twin of")
    for case in report.validation["cases"]:
        assert all(o["ok"] and o["max_abs"] <= 1e-4 for o in case["outputs"]), case
    assert report.coverage["attention"]["refused"] == {} and report.coverage["rotary"]["refused"] == {}
    return path, report


def test_genai_builder_llama_compiles_fused_and_verifies(tmp_path):
    """2 layers: 2 attentions over the cache (FusedInferAttentionScore), q and k rotated in each: 4 RoPE."""
    path, report = _compile_genai("llama", tmp_path)
    assert _live_attention(path) == (2, 4)
    assert report.fusions["fuse-attention"] == 2 and report.fusions["fuse-rope"] == 4
    assert report.census.get("FusedInferAttentionScore") == 2 and report.census.get("RotaryPositionEmbedding") == 4
    assert "Softmax" not in report.census and "FlashAttentionScore" not in report.census


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_genai_builder_qwen2_and_phi3_compile_fused_and_verify(arch, tmp_path):
    """Qwen2 as Llama (2 attentions, 4 RoPE). onnxruntime-genai 0.18's Phi-3 graph feeds lm_head from layer 0's
    post-attention norm, so layer 1's attention output is dead (only its present key/value are outputs): 1
    attention and 3 RoPE (layer 1's k only) are live, read from the graph."""
    path, report = _compile_genai(arch, tmp_path)
    attention, rope = _live_attention(path)
    assert (attention, rope) == ((2, 4) if arch == "qwen2" else (1, 3))
    assert report.fusions["fuse-attention"] == attention and report.fusions["fuse-rope"] == rope
    assert report.census.get("FusedInferAttentionScore") == attention
    assert report.census.get("RotaryPositionEmbedding") == rope
