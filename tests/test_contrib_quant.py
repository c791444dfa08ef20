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
    the model at level 0 and the report gives the difference; the weight is reported as dequantized, and the
    MindIR holds it packed (smaller than the float weight alone)."""
    m = nbits_model(k=256, n=512, zp="packed", bias=True, accuracy_level=4)  # B [512, 8, 16]
    report = compile_verified(m, tmp_path, target=target)
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["quantized_weights"] == {"w_q": "uint4 block 32, zero points given; " + quant.KEPT}
    diff = report.validation["accuracy_level_4_vs_0"]["y"]
    assert 0 < diff["max_abs"] < 0.5 and diff["cosine"] > 0.999
    assert report.census["RightShift"] == 1 and report.census["MatMulExt"] == 1  # unpacked in the network
    assert "WeightQuantBatchMatmul" not in report.census
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
