"""WeightQuantBatchMatmul's int8 weights (opmap/fused/weight_quant_batch_matmul.py, weight_bits 8) and the
weight-only QDQ MatMuls written as it on load (graphconv/frontend/weight_only_qdq.py): the body against numpy on
every int8 value, 8-bit MatMulNBits and each DequantizeLinear spelling equal to onnxruntime on the graph as
given, the refusals and their reasons, the ascend MindIR's int8 Parameters, the gate/up merge, and a tiny Llama
quantized by onnxruntime's own tools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opmap.fused  # noqa: F401  (registers the fused-op table the load's rewrites read)
from graphconv.frontend import contrib, weight_only_qdq
from graphconv.frontend.contrib import quant
from opmap.fused import attach_functions
from tests.contrib_utils import compile_verified, model
from tests.test_contrib_quant import nbits_model

RNG = np.random.default_rng(11)


def _run(m: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """onnxruntime at its basic optimizations, as graphconv's oracle runs it: above them it rewrites a
    DequantizeLinear + MatMul into its own MatMulNBits, which may quantize x (accuracy_level 4)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(m.SerializeToString(), opts).run(None, feeds)[0]


def test_the_body_reads_int8_weights_as_they_are_per_channel_and_per_group():
    """weight_bits 8: q is the int8 byte itself (every value), (q + offset) * scale per output channel with
    group 0 and (N,) scales, per group of K with (K/g, N) ones."""
    k, n = 256, 8
    w = np.arange(-128, 128, dtype=np.int16).astype(np.int8)[None, :].repeat(n, 0)  # [N, K]: every byte
    w = np.ascontiguousarray(np.roll(w, 3, axis=0))
    x = RNG.standard_normal((3, k)).astype(np.float32)
    for group, laid in ((0, (n,)), (64, (k // 64, n))):
        s = RNG.uniform(0.01, 0.1, laid).astype(np.float32)
        o = RNG.integers(-128, 128, laid).astype(np.float32)
        per_k = (lambda v: np.broadcast_to(v, (k, n))) if group == 0 else (lambda v: np.repeat(v, group, axis=0))
        ref = x @ ((w.T.astype(np.float32) + per_k(o)) * per_k(s))
        node = helper.make_node("WeightQuantBatchMatmul", ["x", "w", "s", "o"], ["y"], domain="mindspore",
                                antiquant_group_size=group, weight_bits=8)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(a, name) for a, name in ((w, "w"), (s, "s"), (o, "o"))])
        m = attach_functions(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
        np.testing.assert_allclose(_run(m, {"x": x}), ref, rtol=1e-5, atol=1e-4)


def test_the_xor_relayout_of_8_bit_weights_is_the_zero_point_exactly():
    q = np.arange(256, dtype=np.uint8)
    signed = (q ^ np.uint8(0x80)).view(np.int8).astype(np.int16)
    for zp in range(256):
        assert np.array_equal(signed + (128 - zp), q.astype(np.int16) - zp)


# --- 8-bit MatMulNBits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("zp,block,bias", [("none", 32, False), ("packed", 32, True), ("packed", 64, False),
                                           ("none", 128, True)])
def test_8_bit_matmul_nbits_becomes_one_fused_node_equal_to_onnxruntime(zp, block, bias):
    m = nbits_model(k=256, n=48, bits=8, block=block, zp=zp, bias=bias, opset=18)
    fused, counts = contrib.decompose(m)
    assert counts == {"com.microsoft::MatMulNBits": 1}
    assert [n.op_type for n in fused.graph.node] == ["WeightQuantBatchMatmul"] + (["Add"] if bias else [])
    attrs = {a.name: helper.get_attribute_value(a) for a in fused.graph.node[0].attribute}
    assert attrs == {"antiquant_group_size": block, "weight_bits": 8}
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert inits["proj::weight_int8"].dtype == np.int8 and inits["proj::weight_int8"].shape == (48, 256)
    assert inits["proj::antiquant_scale"].shape == (256 // block, 48) and "w_q" not in inits
    for shape in ((2, 3, 256), (1, 5, 256)):
        a = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(_run(fused, {"a": a}), _run(m, {"a": a}))


def test_one_block_of_all_k_is_the_per_channel_form():
    """block_size = K (a per-channel checkpoint: msModelSlim's W8A16, GPTQ group -1) is the primitive's group 0
    with (N,) scales and offsets: its groups must be below K."""
    m = nbits_model(k=256, n=48, bits=8, block=256, zp="packed", bias=False, opset=18)
    fused, _ = contrib.decompose(m)
    assert [n.op_type for n in fused.graph.node] == ["WeightQuantBatchMatmul"]
    attrs = {a.name: helper.get_attribute_value(a) for a in fused.graph.node[0].attribute}
    assert attrs == {"antiquant_group_size": 0, "weight_bits": 8}
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert inits["proj::antiquant_scale"].shape == inits["proj::antiquant_offset"].shape == (48,)
    a = RNG.standard_normal((2, 3, 256)).astype(np.float32)
    np.testing.assert_array_equal(_run(fused, {"a": a}), _run(m, {"a": a}))


# --- weight-only QDQ --------------------------------------------------------------------------------------

def _pack4(values: np.ndarray) -> bytes:
    """4-bit values (flat, row-major) as ONNX stores INT4/UINT4: element 2i in the low nibble."""
    v = (values.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    v = np.pad(v, (0, len(v) % 2))
    return (v[0::2] | (v[1::2] << 4)).tobytes()


def _q_tensor(name: str, q_type: int, values: np.ndarray) -> onnx.TensorProto:
    if q_type in (TensorProto.INT4, TensorProto.UINT4):
        return helper.make_tensor(name, q_type, list(values.shape), _pack4(values), raw=True)
    return numpy_helper.from_array(values.astype(helper.tensor_dtype_to_np_dtype(q_type)), name)


_RANGES = {TensorProto.INT8: (-128, 128), TensorProto.UINT8: (0, 256), TensorProto.INT4: (-8, 8),
           TensorProto.UINT4: (0, 16)}


def qdq_model(q_type=TensorProto.INT8, layout="channel", zp=False, k=128, n=48, block=32, opset=21,
              x_dequantized=False, weights=1):
    """x @ DequantizeLinear(W_q [K, N], scale, zero_point) for `weights` MatMuls (each reading x), their sum
    the output; layout: "tensor" (one scale), "channel" (scale [N], axis 1), "block" (block_size on axis 0,
    scale [K/block, N]) or "rows" (scale [K], axis 0: per row of K, no output channel)."""
    lo, hi = _RANGES[q_type]
    shape, attrs = {"tensor": ((), {}), "channel": ((n,), {"axis": 1}), "rows": ((k,), {"axis": 0}),
                    "block": ((k // block, n), {"axis": 0, "block_size": block})}[layout]
    nodes, inits, outs = [], [], []
    x = "x"
    if x_dequantized:
        inits += [_q_tensor("x_scale", TensorProto.FLOAT, np.float32(0.05))]
        nodes += [helper.make_node("QuantizeLinear", ["x", "x_scale"], ["x_q"]),
                  helper.make_node("DequantizeLinear", ["x_q", "x_scale"], ["x_dq"])]
        x = "x_dq"
    for i in range(weights):
        ins = [f"w{i}_q", f"w{i}_s"] + ([f"w{i}_zp"] if zp else [])
        inits += [_q_tensor(f"w{i}_q", q_type, RNG.integers(lo, hi, (k, n))),
                  numpy_helper.from_array((RNG.uniform(0.01, 0.1, shape) * 8 / (hi - lo)).astype(np.float32),
                                          f"w{i}_s")]  # weights of about 4-bit ones' magnitude
        if zp:
            inits.append(_q_tensor(f"w{i}_zp", q_type, RNG.integers(lo, hi, shape)))
        nodes += [helper.make_node("DequantizeLinear", ins, [f"w{i}"], **attrs),
                  helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"], name=f"proj{i}")]
        outs.append(f"y{i}")
    total = outs[0]
    for i, o in enumerate(outs[1:]):
        nodes.append(helper.make_node("Add", [total, o], [f"sum{i}"]))
        total = f"sum{i}"
    nodes.append(helper.make_node("Identity", [total], ["y"]))
    return model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])], inits, opset=opset)


SPELLINGS = [  # (q type, layout, zero points, the fused node's weight_bits and antiquant_group_size)
    (TensorProto.INT8, "channel", False, 8, 0),
    (TensorProto.INT8, "channel", True, 8, 0),
    (TensorProto.INT8, "tensor", False, 8, 0),
    (TensorProto.UINT8, "tensor", True, 8, 0),  # asymmetric per tensor: offset 128 - zp, exact
    (TensorProto.UINT8, "channel", True, 8, 0),
    (TensorProto.INT8, "block", False, 8, 32),
    (TensorProto.INT4, "block", False, 4, 32),  # MatMulNBitsQuantizer's QDQ, symmetric
    (TensorProto.UINT4, "block", True, 4, 32),  # and asymmetric
]


@pytest.mark.parametrize("q_type,layout,zp,bits,group", SPELLINGS)
def test_weight_only_qdq_becomes_weight_quant_batch_matmul_equal_to_onnxruntime(q_type, layout, zp, bits, group):
    m = qdq_model(q_type, layout, zp, weights=2)
    fused, described, written = weight_only_qdq.fuse(m)
    assert written == 2
    wqbmm = [n for n in fused.graph.node if n.op_type == "WeightQuantBatchMatmul"]
    assert len(wqbmm) == 2 and not any(n.op_type in ("DequantizeLinear", "MatMul") for n in fused.graph.node)
    assert {a.name: helper.get_attribute_value(a) for a in wqbmm[0].attribute} == \
        {"antiquant_group_size": group, "weight_bits": bits}
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    weight = inits[wqbmm[0].input[1]]
    assert weight.dtype == np.int8 and weight.shape == ((48, 128) if bits == 8 else (48, 64))
    assert inits[wqbmm[0].input[2]].shape == ((48,) if group == 0 else (128 // group, 48))
    assert not {"w0_q", "w1_q"} & set(inits) and set(described) == {"w0_q", "w1_q"}
    for shape in ((2, 3, 128), (1, 7, 128)):
        x = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(_run(fused, {"x": x}), _run(m, {"x": x}))


@pytest.mark.parametrize("change,reason", [
    (dict(q_type=TensorProto.INT4, layout="channel"), "a 4-bit weight per channel (4-bit ones are taken in blocks"),
    (dict(layout="rows"), "scales of shape [128] on axis 0 (per output channel taken, axis 1)"),
    (dict(layout="block", block=16), "WeightQuantBatchMatmul needs antiquant_group_size 0 (per channel) or a "
                                     "multiple of 32 in [32, K-1]"),
    (dict(layout="block", k=96, block=64), "K=96 is not a multiple of block_size=64 (a padded last block)"),
    (dict(opset=13), "opset 13 (the fused body needs CastLike, opset 15)"),
])
def test_forms_it_cannot_take_keep_the_dequantize_linear_with_the_reason(change, reason):
    m = qdq_model(**{"zp": True, **change})
    fused, described, written = weight_only_qdq.fuse(m)
    assert written == 0 and [n.op_type for n in fused.graph.node] == [n.op_type for n in m.graph.node]
    matmul = next(n for n in fused.graph.node if n.op_type == "MatMul")
    assert matmul.doc_string.startswith(quant.NOT_FUSED + reason), matmul.doc_string
    assert described["w0_q"].startswith(f"dequantized in the network ({reason}")


def test_a_weight_read_twice_is_not_re_laid():
    m = qdq_model()
    m.graph.node.append(helper.make_node("MatMul", ["x", "w0"], ["again"]))
    m.graph.output.append(helper.make_tensor_value_info("again", TensorProto.FLOAT, None))
    fused, _, written = weight_only_qdq.fuse(m)
    assert written == 0
    assert fused.graph.node[1].doc_string == quant.NOT_FUSED + \
        "the quantized weight is read 2 times (re-laid for one WeightQuantBatchMatmul, it would be stored twice)"


def test_an_activation_quantized_matmul_is_left_as_it_is():
    """MatMul(DequantizeLinear(x_q), DequantizeLinear(W_q)) quantizes its activations too: no candidate here."""
    m = qdq_model(x_dequantized=True)
    fused, described, written = weight_only_qdq.fuse(m)
    assert fused is m and described == {} and written == 0
    assert all(not n.doc_string for n in m.graph.node)


def test_onnxsim_keeps_a_dequantize_linear_of_a_constant():
    """What lets a refused weight reach the network quantized: onnxsim does not fold it into a float weight."""
    import onnxsim

    m = qdq_model(layout="block", block=16)
    simplified, _ = onnxsim.simplify(m, check_n=0)
    assert [n.op_type for n in simplified.graph.node if n.op_type == "DequantizeLinear"] == ["DequantizeLinear"]
    assert {t.name: t.data_type for t in simplified.graph.initializer}["w0_q"] == TensorProto.INT8


# --- compiled -------------------------------------------------------------------------------------------

def _parameters(mindir, type_name: str) -> dict[str, tuple[list, int]]:
    """The MindIR's Parameters of one data type: name -> (dims, bytes)."""
    from mindspore.train import mind_ir_pb2

    proto = mind_ir_pb2.ModelProto()
    proto.ParseFromString(mindir.read_bytes())
    wanted = mind_ir_pb2.TensorProto.DataType.Value(type_name)
    return {p.name.split(":", 1)[1]: (list(p.dims), len(p.raw_data)) for p in proto.graph.parameter
            if p.data_type == wanted}


@pytest.mark.parametrize("source", ["matmul_nbits", "qdq"])
def test_compiles_to_one_primitive_with_an_int8_weight(tmp_path, source):
    m = nbits_model(k=256, n=96, bits=8, zp="packed", bias=True, opset=18) if source == "matmul_nbits" else \
        qdq_model(TensorProto.UINT8, "channel", zp=True, k=256, n=96)
    report = compile_verified(m, tmp_path)
    assert report.census["WeightQuantBatchMatmul"] == 1 and report.fusions["fuse-quant-matmul"] == 1
    assert not {"MatMulExt", "MatMul", "Dequantize", "RightShift"} & set(report.census)
    assert all(o["max_abs"] == 0 for c in report.validation["cases"] for o in c["outputs"])
    assert list(_parameters(tmp_path / "contrib.mindir", "INT8").values()) == [([96, 256], 96 * 256)]
    assert _parameters(tmp_path / "contrib.mindir", "QINT4X2") == {}
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["quantized_weights"] == {"w_q": f"uint8 block 32, zero points given; {quant.AS_INT8}"} \
        if source == "matmul_nbits" else {"w0_q": "uint8 per channel, offsets 128 - zero point; the int8 [N, K] "
                                                  "weight of a WeightQuantBatchMatmul"}


def test_a_blocked_int4_dequantize_linear_compiles_to_a_qint4x2_weight(tmp_path):
    report = compile_verified(qdq_model(TensorProto.UINT4, "block", zp=True, k=256, n=96), tmp_path)
    assert report.census["WeightQuantBatchMatmul"] == 1
    assert list(_parameters(tmp_path / "contrib.mindir", "QINT4X2").values()) == [([96, 128], 96 * 128)]


def test_a_refused_dequantize_linear_compiles_dequantized_and_says_why(tmp_path):
    report = compile_verified(qdq_model(layout="block", block=16, k=256, n=96), tmp_path)
    assert "WeightQuantBatchMatmul" not in report.census and report.fusions["fuse-quant-matmul"] == 0
    (reason,) = report.coverage["quant_matmul"]["refused"]
    assert reason.startswith("WeightQuantBatchMatmul needs antiquant_group_size 0 (per channel)"), reason


def test_the_cpu_form_reads_the_int8_weight_at_run_time_exactly(tmp_path):
    """A weight above the lowering's folding limit (65536 elements): the cpu network holds the int8 bytes and
    runs the body's integer ops on MindSpore's CPU: the weight is exact, the fp32 products of K = 512 are summed
    in another order than onnxruntime's (outputs of about 10, 2e-5 apart at most; a wrong offset would be 0.1)."""
    report = compile_verified(qdq_model(TensorProto.INT8, "channel", zp=True, k=512, n=256), tmp_path, target="cpu")
    assert "WeightQuantBatchMatmul" not in report.census and report.census["MatMulExt"] == 1
    assert all(o["max_abs"] < 1e-4 for c in report.validation["cases"] for o in c["outputs"])
    assert list(_parameters(tmp_path / "contrib.mindir", "INT8").values()) == [([256, 512], 256 * 512)]


def _gated_mlp(k: int = 128, n: int = 96):
    """silu(x @ DQ(Wg)) * (x @ DQ(Wu)), int8 per channel."""
    nodes, inits = [], []
    for name in ("gate", "up"):
        inits += [numpy_helper.from_array(RNG.integers(-128, 128, (k, n)).astype(np.int8), f"{name}_q"),
                  numpy_helper.from_array(RNG.uniform(0.0005, 0.005, n).astype(np.float32), f"{name}_s")]
        nodes += [helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s"], [f"{name}_w"], axis=1),
                  helper.make_node("MatMul", ["x", f"{name}_w"], [name], name=name)]
    nodes += [helper.make_node("Sigmoid", ["gate"], ["sig"]), helper.make_node("Mul", ["gate", "sig"], ["act"]),
              helper.make_node("Mul", ["act", "up"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])], inits, opset=21)


def test_fuse_swiglu_merges_an_int8_gate_up_pair_into_one_weight_quant_batch_matmul(tmp_path):
    report = compile_verified(_gated_mlp(), tmp_path)
    assert report.fusions["fuse-swiglu"] == 1 and report.fusions["fuse-quant-matmul"] == 1
    assert report.census["WeightQuantBatchMatmul"] == 1 and report.census["Swiglu"] == 1
    assert list(_parameters(tmp_path / "contrib.mindir", "INT8").values()) == [([192, 128], 192 * 128)]


# --- a tiny Llama quantized by onnxruntime's own tools ---------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 2  # models/llama.py's default, which models/examples/tiny_llama.onnx was exported with
LINEARS = 7 * LAYERS + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
# MatMulNBitsQuantizer as a user runs it: blocks of 32, with zero points; 8 bits as MatMulNBits (QOperator), 4
# bits as DequantizeLinear of int4 / uint4 (QDQ: the only width its QDQ format writes). onnxruntime 1.32 has no
# weight-only int8 QDQ: quantize_static quantizes activations too, quantize_dynamic writes integer matmuls.
QUANTIZE = """
import sys, onnx
from onnxruntime.quantization import QuantFormat
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
bits, qdq = int(sys.argv[3]), sys.argv[4] == "qdq"
q = MatMulNBitsQuantizer(onnx.load(sys.argv[1]), algo_config=DefaultWeightOnlyQuantConfig(
    block_size=32, is_symmetric=False, bits=bits, quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator))
q.process()
onnx.save(q.model.model, sys.argv[2])
"""


def _compile(onnx_path: Path, out: Path, target: str = "ascend") -> dict:
    subprocess.run([sys.executable, "-m", "graphconv", "compile", str(onnx_path), "-o", str(out), "--target", target,
                    "--report", str(out.with_suffix(".json")), "-q"], check=True, cwd=ROOT)
    return json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def float_llama_fusions(tmp_path_factory):
    report = _compile(ROOT / "models/examples/tiny_llama.onnx", tmp_path_factory.mktemp("float") / "float.mindir")
    return {k: v for k, v in report["fusions"].items() if k != "fuse-quant-matmul"}


def _quantized_llama(tmp_path: Path, bits: int, fmt: str) -> tuple[Path, list[tuple[int, int]]]:
    """The quantized model and the (K, N) of each quantized weight, read from it."""
    path = tmp_path / "q.onnx"
    # In a child: onnxruntime.transformers imports a module `fusion_utils`, which tests/ also has.
    subprocess.run([sys.executable, "-c", QUANTIZE, str(ROOT / "models/examples/tiny_llama.onnx"), str(path),
                    str(bits), fmt], check=True, cwd=tmp_path, capture_output=True)
    m = onnx.load(path)
    if fmt == "qoperator":
        nbits = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in m.graph.node
                 if n.op_type == "MatMulNBits"]
        assert all(a["bits"] == bits for a in nbits)
        return path, [(a["K"], a["N"]) for a in nbits]
    dims = {t.name: list(t.dims) for t in m.graph.initializer}
    dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    assert {TensorProto.UINT4} == {t.data_type for t in m.graph.initializer if t.name in {n.input[0] for n in dq}}
    return path, [tuple(dims[n.input[0]]) for n in dq]


@pytest.mark.parametrize("bits,fmt", [(8, "qoperator"), pytest.param(4, "qdq", marks=pytest.mark.slow)])
def test_tiny_llama_quantized_by_onnxruntime_is_weight_quant_batch_matmuls_with_the_float_fusions(
        tmp_path, float_llama_fusions, bits, fmt):
    path, weights = _quantized_llama(tmp_path, bits, fmt)
    assert len(weights) == LINEARS
    report = _compile(path, tmp_path / "q.mindir")
    assert report["status"] == "verified"
    assert {k: v for k, v in report["fusions"].items() if k != "fuse-quant-matmul"} == float_llama_fusions
    assert float_llama_fusions["fuse-swiglu"] == LAYERS and float_llama_fusions["fuse-attention"] == LAYERS
    # every linear a WeightQuantBatchMatmul, each layer's gate/up pair merged into one by fuse-swiglu
    census = subprocess.run([sys.executable, "-m", "graphconv", "inspect", str(tmp_path / "q.mindir"), "--json"],
                            check=True, cwd=ROOT, capture_output=True, text=True)
    primitives = json.loads(census.stdout)["primitives"]
    assert primitives["WeightQuantBatchMatmul"] == LINEARS - LAYERS == report["fusions"]["fuse-quant-matmul"]
    assert not {"MatMulExt", "MatMul", "BatchMatMul", "RightShift", "Dequantize"} & set(primitives)
    stored = _parameters(tmp_path / "q.mindir", "INT8" if bits == 8 else "QINT4X2")
    assert len(stored) == LINEARS - LAYERS
    assert sum(b for _, b in stored.values()) == sum(k * n * bits // 8 for k, n in weights)
    assert all(b == dims[0] * dims[1] for dims, b in stored.values())


@pytest.mark.slow
@pytest.mark.parametrize("bits,fmt", [(8, "qoperator"), (4, "qdq")])
def test_tiny_llama_quantized_compiles_for_cpu_equal_to_onnxruntime(tmp_path, bits, fmt):
    """--target cpu: the network (the bodies' integer unpacking, in MindSpore) against onnxruntime on the
    quantized model at the reference cases' shapes, (3, 5) and (5, 11): not the export's (2, 7)."""
    path, _ = _quantized_llama(tmp_path, bits, fmt)
    report = _compile(path, tmp_path / "q.mindir", target="cpu")
    assert report["status"] == "verified" and report["fusions"]["fuse-quant-matmul"] == LINEARS - LAYERS
    outputs = [o for c in report["validation"]["cases"] for o in c["outputs"]]
    assert [c["inputs"]["input_ids"] for c in report["validation"]["cases"]] == [[3, 5], [5, 11]]
    assert all(o["max_abs"] < 1e-4 and o["cosine"] > 0.99999 for o in outputs), outputs
