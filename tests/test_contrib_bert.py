"""The contrib ops of onnxruntime's transformers optimizer, each on hand-built graphs: the decomposition
(graphconv/frontend/contrib/{layer_norm,embed,gelu,matmul,bert_attention}.py) computes what onnxruntime's
CPU kernel computes, for every attribute and input form claimed, and the fusion it is spelled for fires.
Inputs are given explicitly where the op reads indices, lengths or masks, and compared at every position
(rows a mask drops entirely included: they pin the kernels' exact mask arithmetic)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from graphconv.errors import UnsupportedError
from graphconv.frontend import contrib
from graphconv.frontend.contrib import matmul
from graphconv.verify.reference import ReferenceCase
from tests.contrib_utils import decomposition_matches, model

F, I32 = TensorProto.FLOAT, TensorProto.INT32
MS = "com.microsoft"
H = 16  # hidden size
SIZES = ((3, 5), (2, 7))  # (batch, seq) of the two cases


def _vi(name, dims, dtype=F):
    return helper.make_tensor_value_info(name, dtype, dims)


def _init(name, shape, seed, low=-1.0, high=1.0):
    return numpy_helper.from_array(np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32), name)


def _cases(make):
    """Two cases; make(rng, batch, seq, case_index) -> inputs. No mask: every position is compared."""
    return [ReferenceCase(f"case{i}", make(np.random.default_rng(i), b, s, i)) for i, (b, s) in enumerate(SIZES)]


def _randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _fused(m: onnx.ModelProto, spec: str, pass_name: str) -> int:
    """How often `pass_name` fires on the decomposition of `m` when the passes of `spec` run."""
    decomposed, _ = contrib.decompose(m)
    g = ir.from_proto(onnx.shape_inference.infer_shapes(decomposed, data_prop=True))
    return passes.PassManager(spec).run(g)[pass_name]


# --- SkipLayerNormalization, LayerNormalization ------------------------------------------------------------

def _skip_ln(beta=True, bias=True, skip_dims=("batch", "seq", H), read_sum=False):
    inits = [_init("gamma", H, 1, 0.5, 1.5)]
    ins = ["x", "skip", "gamma", "", ""]
    if beta:
        inits.append(_init("beta", H, 2))
        ins[3] = "beta"
    if bias:
        inits.append(_init("bias", H, 3))
        ins[4] = "bias"
    outs = [_vi("y", ["batch", "seq", H])] + ([_vi("sum", ["batch", "seq", H])] if read_sum else [])
    node = helper.make_node("SkipLayerNormalization", ins, ["y", "", "", "sum" if read_sum else ""], domain=MS,
                            epsilon=1e-5, name="sln")
    return model([node], [_vi("x", ["batch", "seq", H]), _vi("skip", list(skip_dims))], outs, inits)


@pytest.mark.parametrize("beta,bias,skip_dims,read_sum", [
    (True, True, ("batch", "seq", H), True), (True, False, ("batch", "seq", H), False),
    (False, True, ("batch", "seq", H), True), (True, True, (1, "seq", H), False), (True, False, ("seq", H), True)])
def test_skip_layer_normalization_decomposes_exactly(beta, bias, skip_dims, read_sum):
    _, counts = decomposition_matches(_skip_ln(beta, bias, skip_dims, read_sum))
    assert counts == {f"{MS}::SkipLayerNormalization": 1}


@pytest.mark.parametrize("beta", [True, False])
def test_skip_layer_normalization_fuses_to_layernorm(beta):
    assert _fused(_skip_ln(beta=beta), "canonicalize,fuse-rmsnorm,fuse-layernorm", "fuse-layernorm") == 1


def test_skip_layer_normalization_in_float16_decomposes_within_fp16_tolerance():
    m = _skip_ln(read_sum=True)
    for vi in (*m.graph.input, *m.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    for t in m.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    decomposition_matches(m, atol=1e-2, rtol=1e-2)


def test_reading_skip_layer_normalizations_mean_is_refused():
    m = _skip_ln()
    m.graph.node[0].output[1] = "mean"
    m.graph.output.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, None))  # read
    with pytest.raises(UnsupportedError, match="mean / inv_std_var"):
        contrib.decompose(m)


def _ln16(axis=-1, bias=True, stats=True):
    shape = [H] if axis == -1 else [4, H]
    inits = [_init("g", shape, 1, 0.5, 1.5)] + ([_init("b", shape, 2)] if bias else [])
    outs = ["y", "mean", "inv"] if stats else ["y"]
    node = helper.make_node("LayerNormalization", ["x", "g"] + (["b"] if bias else []), outs, axis=axis,
                            epsilon=1e-5, name="ln")
    stat_dims = ["batch", 1, 1] if axis == 1 else ["batch", 4, 1]
    outputs = [_vi("y", ["batch", 4, H])] + ([_vi("mean", stat_dims), _vi("inv", stat_dims)] if stats else [])
    return model([node], [_vi("x", ["batch", 4, H])], outputs, inits, opset=16)


@pytest.mark.parametrize("axis,bias,stats", [(-1, True, True), (-1, False, False), (1, True, True)])
def test_layer_normalization_below_opset_17_decomposes_exactly(axis, bias, stats):
    m = _ln16(axis, bias, stats)
    assert len(contrib.contrib_nodes(m)) == 1  # onnxruntime's own before opset 17
    _, counts = decomposition_matches(m)
    assert counts == {"LayerNormalization": 1}


def test_layer_normalization_below_opset_17_fuses_to_layernorm():
    assert _fused(_ln16(stats=False), "canonicalize,fuse-rmsnorm,fuse-layernorm", "fuse-layernorm") == 1


def test_layer_normalization_at_opset_17_is_onnxs_own_and_stays():
    m = _ln16(stats=False)
    m.opset_import[0].version = 17
    assert contrib.contrib_nodes(m) == []


# --- EmbedLayerNormalization ------------------------------------------------------------------------------

VOCAB, MAXPOS, TYPES = 20, 12, 3


def _embed(segment=True, mask=True, position_ids=None, outputs=("y", "mask_index", "sum")):
    inits = [_init("word", (VOCAB, H), 1), _init("pos", (MAXPOS, H), 2), _init("seg", (TYPES, H), 3),
             _init("gamma", H, 4, 0.5, 1.5), _init("beta", H, 5)]
    ins = ["ids", "segment_ids" if segment else "", "word", "pos", "seg" if segment else "", "gamma", "beta",
           "mask" if mask else "", "position_ids" if position_ids else ""]
    inputs = [_vi("ids", ["batch", "seq"], I32)]
    if segment:
        inputs.append(_vi("segment_ids", ["batch", "seq"], I32))
    if mask:
        inputs.append(_vi("mask", ["batch", "seq"], I32))
    if position_ids:
        inputs.append(_vi("position_ids", [1 if position_ids == "shared" else "batch", "seq"], I32))
    dims = {"y": ["batch", "seq", H], "mask_index": ["batch"], "sum": ["batch", "seq", H]}
    outs = [_vi(o, dims[o], I32 if o == "mask_index" else F) for o in outputs if o]
    node = helper.make_node("EmbedLayerNormalization", ins, list(outputs), domain=MS, epsilon=1e-5, name="emb")
    return model([node], inputs, outs, inits)


def _embed_inputs(m):
    names = {i.name for i in m.graph.input}

    def make(rng, b, s, _):
        out = {"ids": rng.integers(0, VOCAB, (b, s)).astype(np.int32)}
        if "segment_ids" in names:
            out["segment_ids"] = rng.integers(0, TYPES, (b, s)).astype(np.int32)
        if "mask" in names:  # ones anywhere, a 2 (not counted: the kernel counts values equal to 1), a zero row
            mask = (rng.random((b, s)) < 0.6).astype(np.int32)
            mask[0, 0], mask[-1] = 2, 0
            out["mask"] = mask
        if "position_ids" in names:
            rows = 1 if m.graph.input[-1].type.tensor_type.shape.dim[0].dim_value == 1 else b
            out["position_ids"] = rng.integers(0, MAXPOS, (rows, s)).astype(np.int32)
        return out
    return _cases(make)


@pytest.mark.parametrize("segment,mask,position_ids,outputs", [
    (True, True, None, ("y", "mask_index", "sum")), (False, False, None, ("y", "mask_index", "")),
    (True, False, "per_row", ("y", "", "sum")), (False, True, "shared", ("y", "mask_index", ""))])
def test_embed_layer_normalization_decomposes_exactly(segment, mask, position_ids, outputs):
    m = _embed(segment, mask, position_ids, outputs)
    _, counts = decomposition_matches(m, cases=_embed_inputs(m))
    assert counts == {f"{MS}::EmbedLayerNormalization": 1}


def test_embed_layer_normalization_fuses_its_layernorm():
    assert _fused(_embed(), "canonicalize,fuse-rmsnorm,fuse-layernorm", "fuse-layernorm") == 1


# --- the GELU family ----------------------------------------------------------------------------------------

def _unary(op, bias=False, **attrs):
    ins = ["x", "b"] if bias else ["x"]
    node = helper.make_node(op, ins, ["y"], domain=MS, name=op.lower(), **attrs)
    return model([node], [_vi("x", ["batch", "seq", H])], [_vi("y", ["batch", "seq", H])],
                 [_init("b", H, 7)] if bias else [])


@pytest.mark.parametrize("op,bias,attrs,fused", [
    ("Gelu", False, {}, 1), ("BiasGelu", True, {}, 1), ("FastGelu", False, {}, 1), ("FastGelu", True, {}, 1),
    ("QuickGelu", False, {}, 1), ("QuickGelu", False, {"alpha": 1.702}, 1), ("QuickGelu", False, {"alpha": 0.5}, 0)])
def test_gelu_family_decomposes_exactly_and_fuses(op, bias, attrs, fused):
    m = _unary(op, bias, **attrs)
    _, counts = decomposition_matches(m)
    assert counts == {f"{MS}::{op}": 1}
    assert _fused(m, "canonicalize,fuse-gelu", "fuse-gelu") == fused


@pytest.mark.parametrize("op,fused_op", [("Gelu", "Gelu"), ("BiasGelu", "Gelu"), ("FastGelu", "GeluTanh"),
                                         ("QuickGelu", "FastGelu")])
def test_gelu_family_fuses_to_the_matching_mindspore_op(op, fused_op):
    """FastGelu is the tanh GELU (mindspore::GeluTanh), never MindSpore's FastGeLU; QuickGelu at 1.702 is."""
    decomposed, _ = contrib.decompose(_unary(op, bias=op == "BiasGelu"))
    g = ir.from_proto(onnx.shape_inference.infer_shapes(decomposed, data_prop=True))
    passes.PassManager("canonicalize,fuse-gelu").run(g)
    assert [n.op_type for n in g.graph if n.domain == "mindspore"] == [fused_op]


def test_bias_split_gelu_decomposes_to_its_cuda_kernels_formula():
    """onnxruntime has no CPU kernel for it: checked against the formula of bias_split_gelu_impl.cu."""
    node = helper.make_node("BiasSplitGelu", ["x", "b"], ["y"], domain=MS)
    bias = _init("b", 2 * H, 8)
    m = model([node], [_vi("x", ["batch", "seq", 2 * H])], [_vi("y", ["batch", "seq", H])], [bias])
    decomposed, counts = contrib.decompose(m)
    assert counts == {f"{MS}::BiasSplitGelu": 1}
    import onnxruntime as ort

    x = _randn(np.random.default_rng(0), 3, 5, 2 * H)
    s = x + numpy_helper.to_array(bias)
    left, right = s[..., :H], s[..., H:]
    want = left * right * 0.5 * (1 + np.vectorize(math.erf)(right / math.sqrt(2))).astype(np.float32)
    session = ort.InferenceSession(decomposed.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="BiasSplitGelu"):
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


# --- FusedMatMul --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a_shape,b_shape,attrs", [
    ((3, 4, 5), (3, 5, 6), {}),
    ((3, 5, 4), (3, 6, 5), {"transA": 1, "transB": 1, "alpha": 0.25}),
    ((4, 3, 5), (3, 5, 6), {"transBatchA": 1}),
    ((4, 3, 5), (1, 5, 6), {"transBatchA": 1, "alpha": 0.5}),
    ((5, 3, 4), (3, 6, 5), {"transBatchA": 1, "transA": 1, "transB": 1, "alpha": -2.0}),
    ((2, 3, 4, 5), (6, 2, 3, 5), {"transBatchB": 1, "transB": 1}),
    ((2, 3, 4, 5), (5, 2, 3, 6), {"transBatchB": 1, "alpha": 3.0}),
    ((3, 4, 5), (5,), {"transB": 1})])
def test_fused_matmul_decomposes_exactly(a_shape, b_shape, attrs):
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain=MS, **attrs)
    a = np.zeros(a_shape).transpose(matmul.operand_perm(len(a_shape), bool(attrs.get("transA")),
                                                        bool(attrs.get("transBatchA"))))
    b = np.zeros(b_shape).transpose(matmul.operand_perm(len(b_shape), bool(attrs.get("transB")),
                                                        bool(attrs.get("transBatchB"))))
    out = list((a @ b).shape)  # (the output's declared shape; the values are onnxruntime's)
    m = model([node], [_vi("a", list(a_shape)), _vi("b", list(b_shape))], [_vi("y", out)])
    _, counts = decomposition_matches(m)
    assert counts == {f"{MS}::FusedMatMul": 1}


def test_fused_matmul_batch_transpose_of_unequal_ranks_is_refused():
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain=MS, transBatchA=1)
    m = model([node], [_vi("a", [4, 3, 5]), _vi("b", [5, 6])], [_vi("y", [3, 4, 6])])
    with pytest.raises(UnsupportedError, match="one rank >= 3"):
        contrib.decompose(m)


# --- Attention --------------------------------------------------------------------------------------------

HEADS = 2
AH = 32  # attention's hidden size: head size 16, FlashAttentionScore's multiple of 16


def _attention(mask=None, past=False, attention_bias=False, bias=True, v_size=AH, batch="batch", outputs=None,
               **attrs):
    """com.microsoft Attention over x (batch, seq, AH); `mask` the mask_index dims (None: no mask)."""
    sizes = [AH, AH, v_size]
    inits = [_init("w", (AH, sum(sizes)), 1, -0.5, 0.5)] + ([_init("bias", sum(sizes), 2)] if bias else [])
    if v_size != AH:
        attrs["qkv_hidden_sizes"] = sizes
    inputs = [_vi("x", [batch, "seq", AH])]
    ins = ["x", "w", "bias" if bias else "", "", "", ""]
    if mask is not None:
        inputs.append(_vi("mask_index", mask, I32))
        ins[3] = "mask_index"
    if past:
        inputs.append(_vi("past", [2, batch, HEADS, "past", AH // HEADS]))
        ins[4] = "past"
    if attention_bias:
        inputs.append(_vi("attention_bias", [1, HEADS, "seq", "total"]))
        ins[5] = "attention_bias"
    outs = outputs or (["y", "present"] if past else ["y"])
    node = helper.make_node("Attention", ins, outs, domain=MS, num_heads=HEADS, name="attn", **attrs)
    dims = {"y": [batch, "seq", v_size], "present": [2, batch, HEADS, "total", AH // HEADS]}
    return model([node], inputs, [_vi(o, dims[o]) for o in outs if o], inits)


def _attention_inputs(mask: str | None, past: bool = False, attention_bias: bool = False, batch: int | None = None):
    """Inputs for `_attention`: mask one of None, "lengths", "lengths_starts", "raw", "raw3d"."""
    def make(rng, b, s, i):
        b = batch or b
        p = (4, 3)[i] if past else 0
        t = p + s
        out = {"x": _randn(rng, b, s, AH)}
        if mask == "lengths":  # a row with no key (0), a full row, one cut short
            out["mask_index"] = np.array([0, t, t - 2, 1, t][:b], np.int32)
        elif mask == "lengths_starts":  # ends, then starts (left padding)
            out["mask_index"] = np.array([t, t - 1, 2, 0][:b] + [2, 0, 1, t][:b], np.int32)
        elif mask == "raw":
            raw = (rng.random((b, t)) < 0.7).astype(np.int32)
            raw[0], raw[-1, 0] = 0, 1
            out["mask_index"] = raw
        elif mask == "raw3d":
            raw = (rng.random((b, s, t)) < 0.6).astype(np.int32)
            raw[0, 0] = 0
            out["mask_index"] = raw
        if past:
            out["past"] = _randn(rng, 2, b, HEADS, p, AH // HEADS)
        if attention_bias:
            out["attention_bias"] = _randn(rng, 1, HEADS, s, t)
        return out
    return _cases(make)


MASKS = {"lengths": ["batch"], "raw": ["batch", "total"], "raw3d": ["batch", "seq", "total"]}


@pytest.mark.parametrize("mask", [None, "lengths", "raw", "raw3d"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_attention_masks_decompose_exactly(mask, unidirectional):
    m = _attention(MASKS.get(mask), unidirectional=unidirectional)
    _, counts = decomposition_matches(m, cases=_attention_inputs(mask))
    assert counts == {f"{MS}::Attention": 1}


def test_attention_with_start_and_end_positions_decomposes_exactly():
    """(2B) mask_index: exclusive ends, then inclusive starts (left padding); a static batch shows 2B."""
    m = _attention([4], batch=2)
    decomposition_matches(m, cases=_attention_inputs("lengths_starts", batch=2))


@pytest.mark.parametrize("attrs", [{"scale": 0.3}, {"mask_filter_value": -50.0}, {"mask_filter_value": -1e9}])
def test_attention_scale_and_mask_filter_value_decompose_exactly(attrs):
    m = _attention(MASKS["raw"], unidirectional=1, **attrs)
    decomposition_matches(m, cases=_attention_inputs("raw"))


def test_attention_with_its_own_v_size_without_bias_and_with_attention_bias_decomposes_exactly():
    m = _attention(MASKS["lengths"], attention_bias=True, bias=False, v_size=8)
    decomposition_matches(m, cases=_attention_inputs("lengths", attention_bias=True))


@pytest.mark.parametrize("mask", [None, "raw"])
def test_attention_with_past_and_present_decomposes_exactly(mask):
    """GPT-2's decoding step: past (2, B, N, P, AH) before the new keys, causal from position P on."""
    m = _attention(MASKS.get(mask), past=True, unidirectional=1)
    _, counts = decomposition_matches(m, cases=_attention_inputs(mask, past=True))
    assert counts == {f"{MS}::Attention": 1}


def test_attention_present_without_past_decomposes_exactly():
    m = _attention(None, outputs=["y", "present"], unidirectional=1)
    decomposition_matches(m, cases=_attention_inputs(None))


@pytest.mark.parametrize("mask,unidirectional", [("lengths", 0), ("raw", 1), (None, 1)])
def test_attention_fuses_to_flash_attention(mask, unidirectional):
    m = _attention(MASKS.get(mask), unidirectional=unidirectional)
    assert _fused(m, "canonicalize,refine-shapes,fuse-attention", "fuse-attention") == 1


def test_attention_4d_mask_is_refused():
    with pytest.raises(UnsupportedError, match="4-D mask_index"):
        contrib.decompose(_attention(["batch", 1, "max", "max"]))


@pytest.mark.parametrize("attr", ["do_rotary", "past_present_share_buffer"])
def test_attention_cuda_only_attributes_are_refused(attr):
    with pytest.raises(UnsupportedError, match=attr):
        contrib.decompose(_attention(None, **{attr: 1}))


def test_attention_past_sequence_length_is_refused():
    m = _attention(None)
    m.graph.node[0].input.append("past_sequence_length")
    m.graph.input.append(_vi("past_sequence_length", [1], I32))
    with pytest.raises(UnsupportedError, match="past_sequence_length"):
        contrib.decompose(m)


def test_attention_packed_lengths_mask_is_refused():
    with pytest.raises(UnsupportedError, match=r"3 \* batch \+ 2"):
        contrib.decompose(_attention([8], batch=2))


# --- MultiHeadAttention -------------------------------------------------------------------------------------

def _mha(kv="self", bias=True, mask=None, attention_bias=False, past=False, outputs=("y",), **attrs):
    """kv: "self" (key = value = query), "cross" (key/value (B, L, AH) of their own), "bnsh" ((B, N, L, h))."""
    inputs = [_vi("q", ["batch", "seq", AH])]
    ins = ["q", "q", "q", "", "", "", "", ""]
    if kv == "cross":
        inputs += [_vi("k", ["batch", "kv", AH]), _vi("v", ["batch", "kv", AH])]
        ins[1:3] = ["k", "v"]
    elif kv == "bnsh":
        inputs += [_vi("k", ["batch", HEADS, "kv", AH // HEADS]), _vi("v", ["batch", HEADS, "kv", AH // HEADS])]
        ins[1:3] = ["k", "v"]
    inits = [_init("bias", 3 * AH, 3)] if bias else []
    if bias:
        ins[3] = "bias"
    if mask is not None:
        inputs.append(_vi("key_padding_mask", mask, I32))
        ins[4] = "key_padding_mask"
    if attention_bias:
        inputs.append(_vi("attention_bias", ["batch", HEADS, "seq", "total"]))
        ins[5] = "attention_bias"
    if past:
        inputs += [_vi("past_key", ["batch", HEADS, "past", AH // HEADS]),
                   _vi("past_value", ["batch", HEADS, "past", AH // HEADS])]
        ins[6:8] = ["past_key", "past_value"]
    node = helper.make_node("MultiHeadAttention", ins, list(outputs), domain=MS, num_heads=HEADS, name="mha", **attrs)
    dims = {"y": ["batch", "seq", AH], "present_key": ["batch", HEADS, "total", AH // HEADS],
            "present_value": ["batch", HEADS, "total", AH // HEADS]}
    return model([node], inputs, [_vi(o, dims[o]) for o in outputs if o], inits)


def _mha_inputs(m, mask=None, kv_len=(6, 4), past=(0, 0)):
    names = {i.name for i in m.graph.input}

    def make(rng, b, s, i):
        L = kv_len[i] if "k" in names else s
        p, t = past[i], past[i] + L
        out = {"q": _randn(rng, b, s, AH)}
        if "k" in names:
            shape = (b, HEADS, L, AH // HEADS) if len(m.graph.input[1].type.tensor_type.shape.dim) == 4 else (b, L, AH)
            out["k"], out["v"] = _randn(rng, *shape), _randn(rng, *shape)
        if mask == "lengths":
            out["key_padding_mask"] = np.array([0, t, t - 1][:b], np.int32)
        elif mask == "raw":
            raw = (rng.random((b, t)) < 0.7).astype(np.int32)
            raw[0] = 0
            out["key_padding_mask"] = raw
        elif mask == "raw3d":
            out["key_padding_mask"] = (rng.random((b, s, t)) < 0.6).astype(np.int32)
        if "attention_bias" in names:
            out["attention_bias"] = _randn(rng, b, HEADS, s, t)
        if p:
            out["past_key"] = _randn(rng, b, HEADS, p, AH // HEADS)
            out["past_value"] = _randn(rng, b, HEADS, p, AH // HEADS)
        return out
    return _cases(make)


@pytest.mark.parametrize("kv", ["self", "cross", "bnsh"])
@pytest.mark.parametrize("mask", [None, "lengths", "raw", "raw3d"])
def test_multi_head_attention_forms_decompose_exactly(kv, mask):
    dims = {"lengths": ["batch"], "raw": ["batch", "total"], "raw3d": ["batch", "seq", "total"]}.get(mask)
    m = _mha(kv, mask=dims)
    _, counts = decomposition_matches(m, cases=_mha_inputs(m, mask))
    assert counts == {f"{MS}::MultiHeadAttention": 1}


@pytest.mark.parametrize("attrs", [{"unidirectional": 1}, {"scale": 0.2, "mask_filter_value": -1e6}])
def test_multi_head_attention_with_attention_bias_and_attributes_decomposes_exactly(attrs):
    m = _mha("cross", bias=False, mask=["batch", "total"], attention_bias=True, **attrs)
    decomposition_matches(m, cases=_mha_inputs(m, "raw"))


@pytest.mark.parametrize("mask", [None, "raw"])
def test_multi_head_attention_with_past_and_present_decomposes_exactly(mask):
    m = _mha("self", mask=["batch", "total"] if mask else None, past=True,
             outputs=("y", "present_key", "present_value"), unidirectional=1)
    decomposition_matches(m, cases=_mha_inputs(m, mask, past=(3, 5)))


def test_multi_head_attention_fuses_to_flash_attention():
    m = _mha("self", mask=["batch"])
    assert _fused(m, "canonicalize,refine-shapes,fuse-attention", "fuse-attention") == 1


@pytest.mark.parametrize("form,reason", [("packed_qkv", "packed QKV"), ("packed_kv", "packed KV"),
                                         ("qk", "qk output"), ("cache", "cache_indirection")])
def test_multi_head_attention_forms_without_a_cpu_kernel_are_refused(form, reason):
    m = _mha("cross")
    node = m.graph.node[0]
    if form == "packed_qkv":
        m.graph.input[0].CopyFrom(_vi("q", ["batch", "seq", HEADS, 3, AH // HEADS]))
        del node.input[1:]
    elif form == "packed_kv":
        m.graph.input[1].CopyFrom(_vi("k", ["batch", "kv", HEADS, 2, AH // HEADS]))
        node.input[2] = ""
    elif form == "qk":
        node.output.extend(["", "", "qk"])
        m.graph.output.append(_vi("qk", None))
    else:
        node.input.extend(["", "cache"])
        m.graph.input.append(_vi("cache", ["batch", 1, "max"], I32))
    with pytest.raises(UnsupportedError, match=reason):
        contrib.decompose(m)
