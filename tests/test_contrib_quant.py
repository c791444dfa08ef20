"""com.microsoft MatMulNBits and GatherBlockQuantized: decomposed on load into standard ONNX that keeps the
packed uint8 weights and dequantizes them in the graph (graphconv/frontend/contrib/quant.py). onnxruntime
runs the contrib graph at accuracy_level 0 (its exact semantics) and the decomposition; they must agree. The
integer matmuls (MatMulIntegerToFloat, DynamicQuantizeMatMul) are also checked against numpy's exact products:
the oracle computes them in int32 (graphconv/verify/integer_products.py), not with onnxruntime's u8s8 kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphconv.errors import UnsupportedError
from graphconv.frontend import contrib
from graphconv.frontend.contrib import quant
from graphconv.verify import compare, reference
from tests.contrib_utils import compile_verified, decomposition_matches, model

RNG = np.random.default_rng(0)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values < 2^bits along the last axis -> packed bytes, lowest bits first (onnxruntime's layout)."""
    per = 8 // bits
    q = q.astype(np.uint8).reshape(*q.shape[:-1], -1, per)
    return sum((q[..., i] << (i * bits)) for i in range(per)).astype(np.uint8)


def nbits_model(k=80, n=24, bits=4, block=32, zp="none", bias=False, a_type=TensorProto.FLOAT, opset=21,
                accuracy_level=0):
    """A MatMulNBits graph with random packed weights; K=80 leaves the last block of 32 half padded."""
    k_blocks = -(-k // block)
    q = RNG.integers(0, 1 << bits, (n, k_blocks, block))
    np_type = helper.tensor_dtype_to_np_dtype(a_type) if a_type != TensorProto.BFLOAT16 else np.float32
    inits = [numpy_helper.from_array(pack(q, bits) if bits < 8 else q.astype(np.uint8), "w_q"),
             numpy_helper.from_array(RNG.uniform(0.01, 0.1, (n, k_blocks)).astype(np_type), "w_scales")]
    ins = ["a", "w_q", "w_scales"]
    if zp == "packed":
        z = RNG.integers(0, 1 << bits, (n, k_blocks))
        if bits < 8:  # each row padded to whole bytes
            per = 8 // bits
            z = np.pad(z, ((0, 0), (0, -k_blocks % per)))
        inits.append(numpy_helper.from_array(pack(z, bits) if bits < 8 else z.astype(np.uint8), "w_zp"))
        ins.append("w_zp")
    elif zp == "float":
        inits.append(numpy_helper.from_array(RNG.uniform(4, 12, (n, k_blocks)).astype(np_type), "w_zp"))
        ins.append("w_zp")
    if bias:
        ins += [""] * (5 - len(ins)) + ["bias"]
        inits.append(numpy_helper.from_array(RNG.standard_normal(n).astype(np_type), "bias"))
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", name="proj", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=accuracy_level)
    a = helper.make_tensor_value_info("a", a_type, ["batch", "seq", k])
    y = helper.make_tensor_value_info("y", a_type, ["batch", "seq", n])
    return model([node], [a], [y], inits, opset=opset)


@pytest.mark.parametrize("bits,zp", [(4, "none"), (4, "packed"), (4, "float"), (8, "none"), (8, "packed"),
                                     (2, "packed")])
def test_matmul_nbits_decomposes_exactly(bits, zp):
    _, counts = decomposition_matches(nbits_model(bits=bits, zp=zp, bias=True))
    assert counts == {"com.microsoft::MatMulNBits": 1}


def test_matmul_nbits_below_opset_18_unpacks_without_bitwise_and():
    decomposed, _ = decomposition_matches(nbits_model(opset=17, zp="packed"))
    ops = {n.op_type for n in decomposed.graph.node}
    assert "BitwiseAnd" not in ops and {"BitShift", "Mod"} <= ops


def test_matmul_nbits_fp16_computes_in_float32_like_onnxruntime():
    m = nbits_model(a_type=TensorProto.FLOAT16, zp="packed", bias=True)
    decomposition_matches(m, atol=1e-3, rtol=1e-3)


def test_the_packed_weight_stays_the_initializer():
    m = nbits_model(zp="packed")
    decomposed, _ = contrib.decompose(m)
    inits = {t.name: t for t in decomposed.graph.initializer}
    assert inits["w_q"].data_type == TensorProto.UINT8 and list(inits["w_q"].dims) == [24, 3, 16]
    assert inits["w_q"].raw_data == next(t for t in m.graph.initializer if t.name == "w_q").raw_data


@pytest.mark.parametrize("change,match", [(dict(bits=3), "bits=3"), (dict(block_size=24), "block_size=24"),
                                          (dict(weight_prepacked=1), "weight_prepacked")])
def test_matmul_nbits_forms_not_defined_are_refused(change, match):
    m = nbits_model()
    node = m.graph.node[0]
    kept = [a for a in node.attribute if a.name not in change]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in change.items()])
    with pytest.raises(UnsupportedError, match=match):
        contrib.decompose(m)


def test_g_idx_is_refused():
    m = nbits_model()
    m.graph.node[0].input.extend(["", "g_idx"])
    m.graph.initializer.append(numpy_helper.from_array(np.arange(80, dtype=np.int32) // 32, "g_idx"))
    with pytest.raises(UnsupportedError, match="g_idx"):
        contrib.decompose(m)


# --- GatherBlockQuantized ---------------------------------------------------------------------------

def gather_model(rows=40, width=80, bits=4, block=32, zp=True, scale_type=TensorProto.FLOAT):
    blocks = -(-width // block)
    q = RNG.integers(0, 1 << bits, (rows, width))
    np_type = helper.tensor_dtype_to_np_dtype(scale_type)
    inits = [numpy_helper.from_array(pack(q, bits) if bits < 8 else q.astype(np.uint8), "emb_q"),
             numpy_helper.from_array(RNG.uniform(0.01, 0.1, (rows, blocks)).astype(np_type), "emb_scales")]
    ins = ["emb_q", "ids", "emb_scales"]
    if zp:
        z = RNG.integers(0, 1 << bits, (rows, blocks))
        if bits < 8:
            z = np.pad(z, ((0, 0), (0, -blocks % (8 // bits))))
        inits.append(numpy_helper.from_array(pack(z, bits) if bits < 8 else z.astype(np.uint8), "emb_zp"))
        ins.append("emb_zp")
    node = helper.make_node("GatherBlockQuantized", ins, ["y"], domain="com.microsoft", name="embed", bits=bits,
                            block_size=block, gather_axis=0, quantize_axis=1)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", scale_type, ["batch", "seq", width])
    return model([node], [ids], [y], inits)


@pytest.mark.parametrize("bits,zp", [(4, True), (4, False), (8, True), (2, True)])
def test_gather_block_quantized_decomposes_exactly(bits, zp):
    _, counts = decomposition_matches(gather_model(bits=bits, zp=zp))
    assert counts == {"com.microsoft::GatherBlockQuantized": 1}


def test_gather_block_quantized_out_of_range_ids_give_zeros():
    m = gather_model()
    ids = np.array([[0, 39, -1, -40], [40, -41, 1000, 5]], dtype=np.int64)
    decomposition_matches(m, cases=[reference.ReferenceCase("edges", {"ids": ids})])


def test_gather_block_quantized_int4_data_is_refused():
    m = gather_model()
    m.graph.initializer[0].data_type = TensorProto.UINT4
    with pytest.raises(UnsupportedError, match="int4/uint4"):
        contrib.decompose(m)


# --- compile ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["ascend", pytest.param("cpu", marks=pytest.mark.slow)])
def test_matmul_nbits_compiles_packed_and_verifies_against_accuracy_level_0(tmp_path, target):
    """accuracy_level 4 (the model builder's CPU default) lets onnxruntime quantize A to int8: the oracle runs
    the model at level 0 and the report gives the difference; a 4-bit weight of whole blocks of 32 becomes a
    WeightQuantBatchMatmul's qint4x2 weight (tests/test_weight_quant_batch_matmul.py), an 8-bit one is
    dequantized in the network; the MindIR holds either packed (smaller than the float weight alone)."""
    m = nbits_model(k=256, n=512, zp="packed", bias=True, accuracy_level=4)  # B [512, 8, 16]
    report = compile_verified(m, tmp_path, target=target)
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["quantized_weights"] == {"w_q": "uint4 block 32, zero points given; " + quant.AS_QINT4X2}
    diff = report.validation["accuracy_level_4_vs_0"]["y"]
    assert 0 < diff["max_abs"] < 0.5 and diff["cosine"] > 0.999
    if target == "ascend":
        assert report.census["WeightQuantBatchMatmul"] == 1 and "RightShift" not in report.census
    assert (tmp_path / "contrib.mindir").stat().st_size < 256 * 512 * 4


def test_matmul_nbits_8_bit_of_blocks_of_16_compiles_dequantized_in_the_network(tmp_path):
    """An 8-bit weight is a WeightQuantBatchMatmul's int8 weight (tests/test_weight_quant_int8.py) when its
    blocks are a group the primitive takes; blocks of 16 are not: the weight is dequantized in the network."""
    m = nbits_model(k=256, n=512, bits=8, block=16, zp="packed", bias=True)
    report = compile_verified(m, tmp_path)
    load = next(s for s in report.stages if s.name == "load")
    why = "WeightQuantBatchMatmul needs antiquant_group_size 0 (per channel) or a multiple of 32 in [32, K-1]"
    assert load.detail["quantized_weights"]["w_q"].startswith(f"uint8 block 16, zero points given; {quant.KEPT} "
                                                              f"({why}")
    assert report.census["MatMulExt"] == 1 and "WeightQuantBatchMatmul" not in report.census
    (reason,) = report.coverage["quant_matmul"]["refused"]
    assert reason.startswith(why) and reason.endswith("at K=256, N=512, group 16"), reason
    assert (tmp_path / "contrib.mindir").stat().st_size < 256 * 512 * 4


# --- integer matmuls and com.microsoft (De)QuantizeLinear -------------------------------------------------

def _int_matmul_model(op: str, per_column: bool):
    """The model and its constants; B's column 0 is all 127, so a row of A at 255 (uint8, or A's maximum when
    DynamicQuantizeMatMul quantizes it) makes pairs of products beyond int16 (onnxruntime's u8s8 kernel
    saturates there on x86 without VNNI)."""
    k, n = 32, 16
    b = RNG.integers(-128, 128, (k, n)).astype(np.int8)
    b[:, 0] = 127
    values = {"b": b, "b_scale": RNG.uniform(0.01, 0.05, n if per_column else ()).astype(np.float32),
              "b_zp": RNG.integers(-3, 3, n if per_column else ()).astype(np.int8),
              "bias": RNG.standard_normal(n).astype(np.float32)}
    if op == "DynamicQuantizeMatMul":
        a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", k])
        node = helper.make_node(op, ["a", "b", "b_scale", "b_zp", "bias"], ["y"], domain="com.microsoft")
    else:
        a = helper.make_tensor_value_info("a", TensorProto.UINT8, ["batch", k])
        values.update(a_scale=np.float32(0.02), a_zp=np.uint8(120))
        node = helper.make_node(op, ["a", "b", "a_scale", "b_scale", "a_zp", "b_zp", "bias"], ["y"],
                                domain="com.microsoft")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])
    return model([node], [a], [y], [numpy_helper.from_array(v, name) for name, v in values.items()]), values


def _dynamic_quantize(x: np.ndarray) -> tuple[np.ndarray, np.float32, np.uint8]:
    """DynamicQuantizeLinear in numpy, float32 throughout (the ONNX definition)."""
    lo, hi = min(np.float32(0), x.min()), max(np.float32(0), x.max())
    scale = np.float32((hi - lo) / np.float32(255))
    zp = np.uint8(np.rint(np.clip(np.float32(0) - lo / scale, 0, 255)))
    return np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8), scale, zp


def _int_matmul_exact(op: str, v: dict, a: np.ndarray) -> np.ndarray:
    """numpy: the int64 product of the centered operands, converted to float32, times the float32 scale
    product, plus the bias."""
    if op == "DynamicQuantizeMatMul":
        q, a_scale, a_zp = _dynamic_quantize(a)
    else:
        q, a_scale, a_zp = a, v["a_scale"], v["a_zp"]
    acc = (q.astype(np.int64) - int(a_zp)) @ (v["b"].astype(np.int64) - v["b_zp"].astype(np.int64))
    return acc.astype(np.float32) * (np.float32(a_scale) * v["b_scale"]) + v["bias"]


@pytest.mark.parametrize("op", ["MatMulIntegerToFloat", "DynamicQuantizeMatMul"])
@pytest.mark.parametrize("per_column", [False, True])
def test_integer_matmuls_decompose_exactly(op, per_column):
    """The contrib op, its decomposition (both run by the oracle) and numpy's exact computation agree."""
    m, values = _int_matmul_model(op, per_column)
    rng = np.random.default_rng(7)
    cases = []
    for rows in (3, 5):
        if op == "DynamicQuantizeMatMul":
            a = rng.standard_normal((rows, 32)).astype(np.float32)
            a[0] = a.max()  # quantized to 255
        else:
            a = rng.integers(0, 256, (rows, 32)).astype(np.uint8)
            a[0] = 255
        cases.append(reference.ReferenceCase(f"c{rows}", {"a": a}))
    _, counts = decomposition_matches(m, cases=cases)
    assert counts == {f"com.microsoft::{op}": 1}
    for case, got in zip(cases, reference.Oracle(m).run(cases)):
        exact = _int_matmul_exact(op, values, case.inputs["a"])
        assert compare.compare(got["y"], exact, 1e-5, 1e-5).ok, (case.name, np.abs(got["y"] - exact).max())


def test_microsoft_quantize_dequantize_become_the_standard_ops():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    inits = [numpy_helper.from_array(RNG.uniform(0.01, 0.1, 8).astype(np.float32), "s"),
             numpy_helper.from_array(RNG.integers(0, 255, 8).astype(np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], domain="com.microsoft", axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], domain="com.microsoft", axis=1)]
    decomposed, counts = decomposition_matches(model(nodes, [x], [y], inits, opset=17))
    assert [(n.domain, n.op_type) for n in decomposed.graph.node] == [("", "QuantizeLinear"), ("", "DequantizeLinear")]


# --- blocked DequantizeLinear (opset 21), lowered by opmap/quant.py ---------------------------------------------

def test_blocked_dequantize_linear_compiles_and_verifies(tmp_path):
    """x uint8 [batch, 80] with block 32 along axis 1 (the last block has 16 values): scale and zero point
    [batch, 3] are graph inputs, so nothing is folded at compile time."""
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, ["batch", 80])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 3])
    z = helper.make_tensor_value_info("z", TensorProto.UINT8, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 80])
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=1, block_size=32)
    m = helper.make_model(helper.make_graph([node], "blocked", [x, s, z], [y]),
                          opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    compile_verified(m, tmp_path, target="cpu")  # was refused before: "blocked quantization is not supported"


# --- DynamicQuantizeLSTM ------------------------------------------------------------------------------------

LSTM_H, LSTM_K = 8, 6


def _dq_lstm_model(direction: str, per_column: bool, unsigned: bool) -> tuple[onnx.ModelProto, dict]:
    """A DynamicQuantizeLSTM over X [seq, batch, K] as onnxruntime's quantizer writes it (8-bit W [D, K, 4H] and
    R [D, H, 4H], per-direction or per-column scales). Weights within +-63 of their zero point: a pair of
    products stays inside int16, where onnxruntime's u8s8 kernel cannot saturate on any CPU."""
    d, h4 = (2 if direction == "bidirectional" else 1), 4 * LSTM_H
    rng = np.random.default_rng(7)
    zp_value, q_type = (128, np.uint8) if unsigned else (0, np.int8)
    scale_shape = (d, h4) if per_column else (d,)
    c = {"w": (rng.integers(-63, 64, (d, LSTM_K, h4)) + zp_value).astype(q_type),
         "r": (rng.integers(-63, 64, (d, LSTM_H, h4)) + zp_value).astype(q_type),
         "b": rng.normal(0, 0.1, (d, 2 * h4)).astype(np.float32),
         "w_scale": rng.uniform(0.002, 0.01, scale_shape).astype(np.float32),
         "r_scale": rng.uniform(0.002, 0.01, scale_shape).astype(np.float32),
         "w_zp": np.full(scale_shape, zp_value, q_type), "r_zp": np.full(scale_shape, zp_value, q_type)}
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "w", "r", "b", "", "h0", "c0", "", "w_scale", "w_zp",
                                                    "r_scale", "r_zp"], ["y", "y_h", "y_c"], domain="com.microsoft",
                            direction=direction, hidden_size=LSTM_H, name="lstm",
                            activations=["Sigmoid", "Tanh", "Tanh"] * d)  # (the defaults, spelled out)
    f = TensorProto.FLOAT
    m = model([node], [helper.make_tensor_value_info("x", f, ["seq", "batch", LSTM_K]),
                       helper.make_tensor_value_info("h0", f, [d, "batch", LSTM_H]),
                       helper.make_tensor_value_info("c0", f, [d, "batch", LSTM_H])],
              [helper.make_tensor_value_info("y", f, ["seq", d, "batch", LSTM_H]),
               helper.make_tensor_value_info("y_h", f, [d, "batch", LSTM_H]),
               helper.make_tensor_value_info("y_c", f, [d, "batch", LSTM_H])],
              [numpy_helper.from_array(v, k) for k, v in c.items()], opset=21)
    return m, c


def _quantized(a: np.ndarray) -> np.ndarray:
    """a through uint8 and back as DynamicQuantizeLinear does (range with 0, round half to even)."""
    lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
    scale = np.float32((hi - lo) / 255) if hi > lo else np.float32(1)
    zp = np.clip(np.round(np.float32(-lo) / scale), 0, 255)
    return (np.clip(np.round(a / scale) + zp, 0, 255) - zp).astype(np.float32) * scale


def _numpy_dq_lstm(c: dict, x, h0, c0, quantize_state: bool, direction: str):
    """onnx's LSTM (gates i, o, f, c; sigmoid/tanh) on the dequantized weights, X quantized as a whole; with
    `quantize_state`, the hidden state too before each step's recurrent product (onnxruntime's kernel)."""
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    d = len(c["w"])
    lead = (d, 1, -1) if c["w_scale"].ndim == 2 else (d, 1, 1)
    w = (c["w"].astype(np.float32) - c["w_zp"].astype(np.float32).reshape(lead)) * c["w_scale"].reshape(lead)
    r = (c["r"].astype(np.float32) - c["r_zp"].astype(np.float32).reshape(lead)) * c["r_scale"].reshape(lead)
    xq = _quantized(x)
    ys, hs, cs = [], [], []
    for k in range(d):
        h, cell, out = h0[k], c0[k], [None] * len(x)
        backward = k == 1 or direction == "reverse"
        steps = reversed(range(len(x))) if backward else range(len(x))
        for t in steps:
            hin = _quantized(h) if quantize_state else h
            g = xq[t] @ w[k] + hin @ r[k] + c["b"][k][:4 * LSTM_H] + c["b"][k][4 * LSTM_H:]
            i, o, f, z = np.split(g, 4, axis=-1)
            cell = sig(f) * cell + sig(i) * np.tanh(z)
            h = sig(o) * np.tanh(cell)
            out[t] = h
        ys.append(np.stack(out))
        hs.append(h)
        cs.append(cell)
    return np.stack(ys, 1), np.stack(hs), np.stack(cs)


@pytest.mark.parametrize("direction,per_column,unsigned", [("forward", False, False), ("bidirectional", True, True),
                                                           ("reverse", True, False)])
def test_dynamic_quantize_lstm_decomposes_to_the_lstm_of_its_dequantized_weights(direction, per_column, unsigned):
    """The decomposition is onnx's LSTM on the dequantized weights with X quantized as onnxruntime quantizes it:
    onnxruntime on it equals numpy computing that, at three sequence lengths. At batch 1, onnxruntime's kernel
    equals numpy quantizing the hidden state at every step as well: the one thing the decomposition leaves out,
    and it moves the outputs by more than float rounding. (At a larger batch the kernel quantizes the state of
    each chunk of rows its threads take apart, so its values depend on its thread pool.)"""
    m, c = _dq_lstm_model(direction, per_column, unsigned)
    decomposed, counts = contrib.decompose(m)
    assert counts == {"com.microsoft::DynamicQuantizeLSTM": 1}
    assert [n.op_type for n in decomposed.graph.node if n.op_type in ("LSTM", "DynamicQuantizeLinear")] == \
        ["DynamicQuantizeLinear", "LSTM"]
    d = len(c["w"])
    rng = np.random.default_rng(3)
    for seq, batch in ((5, 1), (11, 1), (7, 3)):
        feeds = {"x": rng.normal(0, 1, (seq, batch, LSTM_K)).astype(np.float32),
                 "h0": rng.normal(0, 0.5, (d, batch, LSTM_H)).astype(np.float32),
                 "c0": rng.normal(0, 0.5, (d, batch, LSTM_H)).astype(np.float32)}
        case = [reference.ReferenceCase("c", feeds)]
        ours = reference.Oracle(decomposed).run(case)[0]
        kernel = reference.Oracle(m).run(case)[0]
        float_state = _numpy_dq_lstm(c, feeds["x"], feeds["h0"], feeds["c0"], False, direction)
        quantized_state = _numpy_dq_lstm(c, feeds["x"], feeds["h0"], feeds["c0"], True, direction)
        for k, name in enumerate(("y", "y_h", "y_c")):
            np.testing.assert_allclose(ours[name], float_state[k], atol=2e-5, rtol=1e-4)
            if batch == 1:
                np.testing.assert_allclose(kernel[name], quantized_state[k], atol=2e-5, rtol=1e-4)
        assert np.abs(kernel["y"] - ours["y"]).max() > 1e-4


@pytest.mark.parametrize("direction,per_column,unsigned", [("forward", False, False), ("bidirectional", True, True)])
def test_dynamic_quantize_lstm_weights_given_at_run_time_are_dequantized_in_the_graph(direction, per_column,
                                                                                     unsigned):
    """W and R as graph inputs, not initializers: the decomposition dequantizes them with graph ops (Cast, Sub,
    Mul, Transpose) instead of at compile time, and still computes numpy's LSTM of the dequantized weights."""
    m, c = _dq_lstm_model(direction, per_column, unsigned)
    moved = [t for t in m.graph.initializer if t.name in ("w", "r")]
    kept = [t for t in m.graph.initializer if t.name not in ("w", "r")]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    decomposed, _ = contrib.decompose(m)
    assert [n.op_type for n in decomposed.graph.node].count("Transpose") == 2
    d = len(c["w"])
    rng = np.random.default_rng(5)
    feeds = {"x": rng.normal(0, 1, (6, 2, LSTM_K)).astype(np.float32),
             "h0": rng.normal(0, 0.5, (d, 2, LSTM_H)).astype(np.float32),
             "c0": rng.normal(0, 0.5, (d, 2, LSTM_H)).astype(np.float32), "w": c["w"], "r": c["r"]}
    ours = reference.Oracle(decomposed).run([reference.ReferenceCase("c", feeds)])[0]
    expected = _numpy_dq_lstm(c, feeds["x"], feeds["h0"], feeds["c0"], False, direction)
    for k, name in enumerate(("y", "y_h", "y_c")):
        np.testing.assert_allclose(ours[name], expected[k], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("target,primitive", [("cpu", "LSTM"), ("ascend", "DynamicRNN")])
def test_dynamic_quantize_lstm_compiles_and_verifies_against_its_decomposition(tmp_path, target, primitive):
    """Over a dynamic sequence: MindSpore's LSTM primitive on CPU, DynamicRNN on Ascend (passes/fuse_lstm.py),
    the weights dequantized at compile time. The oracle runs the decomposition; the report gives how far
    onnxruntime's kernel (quantizing the state) is from it, and what became of each 8-bit weight."""
    m, _ = _dq_lstm_model("bidirectional", False, False)
    report = compile_verified(m, tmp_path, target=target)
    assert report.census.get(primitive) == 2, report.census  # one per direction
    diff = report.validation["dynamic_quantize_lstm_vs_float_state"]["y"]
    assert 1e-4 < diff["max_abs"] < 0.1 and diff["cosine"] > 0.999
    assert any(w.startswith("DynamicQuantizeLSTM: onnxruntime quantizes the hidden state") for w in report.warnings)
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["quantized_weights"] == {"w": quant.LSTM_WEIGHT, "r": quant.LSTM_WEIGHT}
    assert len({c["inputs"]["x"][0] for c in report.validation["cases"]}) == 2


def test_a_failed_verification_of_run_time_quantization_names_the_cause():
    """The error of a failed verification says why a model that quantizes activations at run time fails a float
    tolerance (ddddocr's common_old.onnx), and nothing of the kind for a model that does not."""
    from graphconv import verification

    note = verification._rounding_note({"Conv": 3, "DynamicQuantizeLinear": 2})
    assert "quantizes activations at run time (2 DynamicQuantizeLinear)" in note and "--atol/--rtol" in note
    assert verification._rounding_note({"Conv": 3, "Sigmoid": 1}) == ""
