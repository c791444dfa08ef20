"""Static W8A8: QuantizeLinear -> DequantizeLinear -> MatMul by a DequantizeLinear'd int8 weight as
mindspore::QuantV2 + mindspore::QuantBatchMatmul (opmap/fused/quant_batch_matmul.py, passes/fuse_qdq_matmul.py).

Hand-built QDQ linears of each spelling the pass claims, the fused graph under onnxruntime against the exact
integer result and against the unfused graph, the refusals and their reasons, the ascend-precision body's
19-bit scale, the cpu and ascend compiles, and the tiny Llama quantized by onnxruntime's own quantize_static
keeping the float model's fusions."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opmap.fused
import passes
from graphconv.verify.census import mind_ir_pb2, read_mindir
from opmap.fused.quant_batch_matmul import TRUNCATED_SCALE_MASK, truncated_scale_nodes
from tests.contrib_utils import compile_verified

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "models/examples/tiny_llama.onnx"
K, N = 64, 48


def _qdq_linears(act: str, per_channel: bool, bias: bool, linears: int = 1, seed: int = 0):
    """x -> QuantizeLinear -> DequantizeLinear -> `linears` MatMuls, each by DequantizeLinear(int8 W [K, N]),
    [+ a float bias]; act the activation's type (int8, uint8). Returns the model and its arrays."""
    rng = np.random.default_rng(seed)
    zp_type = np.int8 if act == "int8" else np.uint8
    arrays = {"s_x": np.array(0.021, np.float32), "zp_x": np.array(-5 if act == "int8" else 131, zp_type)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_x", "zp_x"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s_x", "zp_x"], ["xd"])]
    outputs = []
    for i in range(linears):
        arrays[f"w{i}"] = rng.integers(-128, 128, (K, N)).astype(np.int8)
        arrays[f"s_w{i}"] = (rng.uniform(0.002, 0.01, N) if per_channel else np.array(0.006)).astype(np.float32)
        arrays[f"zp_w{i}"] = np.zeros(N if per_channel else (), np.int8)
        nodes += [helper.make_node("DequantizeLinear", [f"w{i}", f"s_w{i}", f"zp_w{i}"], [f"wd{i}"], axis=1),
                  helper.make_node("MatMul", ["xd", f"wd{i}"], [f"mm{i}" if bias else f"y{i}"], name=f"proj{i}")]
        if bias:
            arrays[f"b{i}"] = rng.standard_normal(N).astype(np.float32)
            nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["batch", "seq", N]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", K])
    graph = helper.make_graph(nodes, "qdq", [x], outputs, [numpy_helper.from_array(v, k) for k, v in arrays.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), arrays


def _fuse(m: onnx.ModelProto) -> tuple[onnx.ModelProto, passes.PassManager, dict]:
    model = ir.from_proto(onnx.shape_inference.infer_shapes(m))
    pm = passes.PassManager("fuse-qdq-matmul")
    counts = pm.run(model)
    return opmap.fused.attach_functions(ir.to_proto(model)), pm, counts


def _run(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _exact(arrays: dict, x: np.ndarray, i: int, act: str) -> np.ndarray:
    """The W8A8 product in integers: q = saturate(round_half_even(x / s_x) + zp) (fp32 division, as
    QuantizeLinear), acc = (q - zp) @ W exactly, then fp32(acc) * fp32(s_x * s_w) [+ b]."""
    lo, hi = (-128, 127) if act == "int8" else (0, 255)
    zp = int(arrays["zp_x"])
    q = np.clip(np.rint(x / arrays["s_x"]) + zp, lo, hi).astype(np.int64)
    acc = (q - zp) @ arrays[f"w{i}"].astype(np.int64)
    deq = (arrays["s_x"] * np.broadcast_to(arrays[f"s_w{i}"], (N,))).astype(np.float32)
    y = acc.astype(np.float32) * deq
    return y + arrays[f"b{i}"] if f"b{i}" in arrays else y


@pytest.mark.parametrize("act", ["int8", "uint8"])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_a_qdq_linear_becomes_quant_v2_and_quant_batch_matmul_exactly(act, per_channel, bias):
    m, arrays = _qdq_linears(act, per_channel, bias)
    fused, pm, counts = _fuse(m)
    assert counts == {"fuse-qdq-matmul": 1} and pm.coverage["qdq_matmul"]["fused"] == 1
    ops = [(n.domain, n.op_type) for n in fused.graph.node]
    assert ops == [("mindspore", "QuantV2"), ("mindspore", "QuantBatchMatmul")] + ([("", "Add")] if bias else [])
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert np.array_equal(inits["w0_nk"], arrays["w0"].T) and "w0" not in inits  # stored once, [N, K]
    for shape in ((2, 3, K), (1, 7, K)):
        x = np.random.default_rng(1).uniform(-3, 3, shape).astype(np.float32)
        got, want = _run(fused, x)[0], _run(m, x)[0]
        np.testing.assert_array_equal(got, _exact(arrays, x, 0, act))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # the QDQ graph sums dequantized floats


def test_linears_on_one_quantized_activation_share_one_quant_v2():
    """q, k and v projections read one Q/DQ pair: one QuantV2 feeds the three QuantBatchMatmuls."""
    m, arrays = _qdq_linears("uint8", True, False, linears=3)
    fused, _, counts = _fuse(m)
    assert counts == {"fuse-qdq-matmul": 3}
    kinds = [n.op_type for n in fused.graph.node]
    assert kinds.count("QuantV2") == 1 and kinds.count("QuantBatchMatmul") == 3
    assert not {"QuantizeLinear", "DequantizeLinear", "MatMul"} & set(kinds)
    x = np.random.default_rng(2).uniform(-2, 2, (2, 5, K)).astype(np.float32)
    for i, got in enumerate(_run(fused, x)):
        np.testing.assert_array_equal(got, _exact(arrays, x, i, "uint8"))


def test_a_uint8_weight_centred_at_128_is_shifted_to_int8_exactly():
    """(w_u - 128) * s_w is the int8 weight w_u - 128 with zero point 0: the same product, in integers."""
    m, arrays = _qdq_linears("int8", True, False)
    _replace(m, "w0", (arrays["w0"].astype(np.int16) + 128).astype(np.uint8))
    _replace(m, "zp_w0", np.full(N, 128, np.uint8))
    fused, _, counts = _fuse(m)
    assert counts == {"fuse-qdq-matmul": 1}
    x = np.random.default_rng(4).uniform(-3, 3, (2, 3, K)).astype(np.float32)
    np.testing.assert_array_equal(_run(fused, x)[0], _exact(arrays, x, 0, "int8"))


def _refused(m: onnx.ModelProto) -> dict:
    fused, pm, counts = _fuse(m)
    assert counts == {"fuse-qdq-matmul": 0} and pm.coverage["qdq_matmul"]["fused"] == 0
    return pm.coverage["qdq_matmul"]["refused"]


def _replace(m: onnx.ModelProto, name: str, value: np.ndarray) -> onnx.ModelProto:
    (t,) = [t for t in m.graph.initializer if t.name == name]
    t.CopyFrom(numpy_helper.from_array(value, name))
    return m


def test_what_quant_batch_matmul_cannot_express_stays_unfused_with_the_reason():
    m, _ = _qdq_linears("int8", True, False)
    assert _refused(_replace(m, "zp_w0", np.full(N, 3, np.int8))) == {
        "asymmetric int8 weight (zero points != 0): QuantBatchMatmul has no weight offset": 1}
    m, _ = _qdq_linears("int8", True, False)
    m.graph.node[2].attribute[0].i = 0  # the scales along K
    _replace(m, "s_w0", np.full(K, 0.01, np.float32))
    _replace(m, "zp_w0", np.zeros(K, np.int8))
    (reason,) = _refused(m)
    assert reason.startswith("weight scales of shape [64] along axis 0: per tensor or per output channel")
    m, _ = _qdq_linears("int8", False, False)
    m.graph.node[1].input[1] = "s_w0"  # the DequantizeLinear's scale differs from the QuantizeLinear's
    assert _refused(m) == {"the QuantizeLinear and DequantizeLinear of the activation have different scales "
                           "or zero points": 1}


def test_a_float_weight_and_an_activation_product_say_why_they_are_not_w8a8():
    m, arrays = _qdq_linears("int8", False, False)
    m.graph.node[3].input[1] = "wf"  # a float weight
    m.graph.initializer.append(numpy_helper.from_array(arrays["w0"].astype(np.float32), "wf"))
    assert _refused(m) == {"the weight is not computed by a DequantizeLinear (W8A8 needs an int8 weight)": 1}
    m, _ = _qdq_linears("int8", False, False)
    m.graph.node[2].input[0] = "xq"  # x times its own quantized values: not a constant weight
    (reason,) = _refused(m)
    assert reason.startswith("the second operand is dequantized from a computed tensor")


def test_the_ascend_body_reads_the_scale_as_its_top_19_bits():
    """The fp16 path's scale as the hardware reads it (bits & 0xFFFFE000), on scales of every magnitude a
    dequantization has, powers of two and their neighbours included."""
    rng = np.random.default_rng(3)
    s = np.concatenate([10.0 ** rng.uniform(-9, 2, 4000), 2.0 ** np.arange(-30, 5)]).astype(np.float32)
    s = np.concatenate([s, np.nextafter(s, 0), np.nextafter(s, 1)]).astype(np.float32)
    graph = helper.make_graph(truncated_scale_nodes("s", "t"), "g",
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("t", TensorProto.FLOAT, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = ort.InferenceSession(model.SerializeToString()).run(None, {"s": s})[0]
    want = (s.view(np.uint32) & np.uint32(TRUNCATED_SCALE_MASK)).view(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.any(got != s)


def _mindir_int8_weights_of(mindir: Path, primitive: str) -> dict[str, list]:
    """name -> dims of the INT8 Parameters read (through a Load) by `primitive`'s calls in the MindIR."""
    pb2, model = mind_ir_pb2(), read_mindir(mindir)
    int8 = pb2.TensorProto.DataType.Value("INT8")
    params = {p.name: list(p.dims) for p in model.graph.parameter if p.data_type == int8}
    found = {}
    for graph in (model.graph, *model.functions):
        loads = {out: n.input[0] for n in graph.node if n.op_type.startswith("REF::Load") for out in n.output}
        for n in graph.node:
            if n.op_type.startswith(f"REF::{primitive}:"):
                source = loads.get(n.input[1], n.input[1])
                if source in params:
                    found[source.split(":", 1)[1]] = params[source]
    return found


def test_compiles_for_cpu_and_for_ascend(tmp_path):
    m, arrays = _qdq_linears("uint8", True, True, linears=2)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "ascend").mkdir()
    cpu = compile_verified(m, tmp_path / "cpu", target="cpu")
    assert cpu.fusions["fuse-qdq-matmul"] == 2 and "QuantBatchMatmul" not in cpu.census
    assert all(o["max_abs"] < 1e-5 for c in cpu.validation["cases"] for o in c["outputs"])
    ascend = compile_verified(m, tmp_path / "ascend")
    assert ascend.census["QuantBatchMatmul"] == 2 and ascend.census["QuantV2"] == 1
    assert not {"MatMul", "MatMulExt", "BatchMatMul", "Round"} & set(ascend.census)
    weights = _mindir_int8_weights_of(tmp_path / "ascend" / "contrib.mindir", "QuantBatchMatmul")
    assert weights == {"w0_nk": [N, K], "w1_nk": [N, K]}


# --- the tiny Llama quantized by onnxruntime's quantize_static --------------------------------------------------

# onnxruntime 1.32's own static quantizer, as a user runs it: QDQ, int8 weights, the linears only (the
# attention products excluded unless asked, MatMul outputs left unquantized), a small calibration reader.
QUANTIZE = """
import sys, numpy as np, onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
src, dst, act, per_channel, linears_only = sys.argv[1:6]
class Reader(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.data = iter([{"input_ids": rng.integers(0, 100, (1, 8)).astype(np.int64),
                           "attention_mask": np.ones((1, 8), np.int64)} for _ in range(4)])
    def get_next(self):
        return next(self.data, None)
names = [n.name for n in onnx.load(src).graph.node if n.op_type == "MatMul"]
attention = [n for n in names if not n.startswith("node_linear")]
quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel == "1",
                activation_type=QuantType.QInt8 if act == "int8" else QuantType.QUInt8, weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"], nodes_to_exclude=attention if linears_only == "1" else [],
                extra_options={"OpTypesToExcludeOutputQuantization": ["MatMul"]})
"""
LINEARS = 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
ACTIVATIONS = 2 * 4 + 1  # per layer: the norm before q/k/v, attention's output, the norm before gate/up,
#                          the gated product; and the final norm before the lm_head
FAMILIES = ("attention", "norm", "rotary", "gated_mlp")


def _quantized(tmp: Path, act: str, per_channel: bool, linears_only: bool = True) -> Path:
    out = tmp / f"llama_{act}_{int(per_channel)}_{int(linears_only)}.onnx"
    # In a child: onnxruntime.quantization imports a module `fusion_utils`, which tests/ also has.
    subprocess.run([sys.executable, "-c", QUANTIZE, str(LLAMA), str(out), act, str(int(per_channel)),
                    str(int(linears_only))], check=True, cwd=tmp, capture_output=True)
    return out


def _compile(onnx_path: Path, out: Path, *extra: str) -> dict:
    subprocess.run([sys.executable, "-m", "graphconv", "compile", str(onnx_path), "-o", str(out),
                    "--report", str(out.with_suffix(".json")), "-q", *extra], check=True, cwd=ROOT)
    return json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    return _compile(LLAMA, tmp_path_factory.mktemp("float") / "float.mindir")


def _check_llama(onnx_path: Path, report: dict, float_llama: dict, mindir: Path) -> None:
    model = onnx.load(onnx_path)
    kinds = [n.op_type for n in model.graph.node]
    assert kinds.count("QuantizeLinear") == ACTIVATIONS and kinds.count("MatMul") == LINEARS + 4
    assert report["status"] == "verified"
    assert report["fusions"]["fuse-qdq-matmul"] == LINEARS == report["coverage"]["qdq_matmul"]["fused"]
    for family in FAMILIES:
        assert report["coverage"][family]["fused"] == float_llama["coverage"][family]["fused"] > 0, family
    others = {k: v for k, v in report["fusions"].items() if k != "fuse-qdq-matmul"}
    assert others == {k: v for k, v in float_llama["fusions"].items() if k != "fuse-qdq-matmul"}
    census = report["census"]
    # the gate/up pair of each layer merged into one by fuse-swiglu
    assert census["QuantBatchMatmul"] == LINEARS - 2 and census["QuantV2"] == ACTIVATIONS
    assert not {"MatMul", "MatMulExt", "Round"} & set(census) and census["Swiglu"] == 2
    quantized = report["quantized_linears"]  # (graphconv/verify/quantized_census.py)
    assert quantized["linears"] == quantized["on_low_bit_primitives"] == LINEARS and not quantized["fell_back"]
    assert quantized["bytes_per_parameter"] == 1.0
    weights = _mindir_int8_weights_of(mindir, "QuantBatchMatmul")
    assert len(weights) == LINEARS - 2 and sum(d[0] * d[1] for d in weights.values()) == sum(
        numpy_helper.to_array(t).size for t in model.graph.initializer if t.data_type == TensorProto.INT8
        and t.dims and len(t.dims) == 2)


def test_tiny_llama_w8a8_keeps_the_float_fusions_and_compiles_to_quant_batch_matmul(tmp_path, float_llama):
    q = _quantized(tmp_path, "uint8", per_channel=True)
    report = _compile(q, tmp_path / "q.mindir")
    _check_llama(q, report, float_llama, tmp_path / "q.mindir")


@pytest.mark.slow
def test_tiny_llama_w8a8_int8_per_tensor(tmp_path, float_llama):
    q = _quantized(tmp_path, "int8", per_channel=False)
    report = _compile(q, tmp_path / "q.mindir")
    _check_llama(q, report, float_llama, tmp_path / "q.mindir")


def test_the_cpu_network_matches_onnxruntime_at_a_new_shape(tmp_path):
    """The cpu MindIR, loaded plainly, at a batch and length that are neither the export's (2, 7) nor the
    compile's reference cases, against onnxruntime on the QDQ model itself."""
    from tests.test_graphcell_load import plain_graphcell_run

    q = _quantized(tmp_path, "uint8", per_channel=True)
    report = _compile(q, tmp_path / "cpu.mindir", "--target", "cpu")
    assert report["fusions"]["fuse-qdq-matmul"] == LINEARS
    rng = np.random.default_rng(5)
    inputs = {"input_ids": rng.integers(0, 100, (4, 9)).astype(np.int64), "attention_mask": np.ones((4, 9), np.int64)}
    assert all(tuple(c["inputs"]["input_ids"]) != (4, 9) for c in report["validation"]["cases"])
    (got,), = plain_graphcell_run(tmp_path / "cpu.mindir", onnx.load(q), [types.SimpleNamespace(inputs=inputs)],
                                  tmp_path / "run")
    # onnxruntime as it runs by default (its graph optimizations make the QDQ linears integer kernels) and with
    # them off (the QDQ graph as written: dequantized fp32 products)
    literal = ort.SessionOptions()
    literal.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for options in (None, literal):
        want = ort.InferenceSession(str(q), options, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
        diff = np.abs(got.astype(np.float64) - want)
        g, w = got.ravel().astype(np.float64), want.ravel().astype(np.float64)
        cosine = float(g @ w / np.linalg.norm(g) / np.linalg.norm(w))
        assert diff.max() < 1e-4 and diff.mean() < 1e-5 and cosine > 0.999999, (diff.max(), diff.mean(), cosine)


@pytest.mark.slow
def test_a_qdq_pair_inside_attention_keeps_it_unfused_and_says_so(tmp_path, float_llama):
    """With the attention products quantized too, the probabilities are rounded by a Q/DQ pair before P.V:
    attention stays unfused (its coverage names the QuantizeLinear), the linears are still W8A8."""
    q = _quantized(tmp_path, "int8", per_channel=True, linears_only=False)
    report = _compile(q, tmp_path / "q.mindir", "--target", "cpu")
    assert report["status"] == "verified" and report["fusions"]["fuse-qdq-matmul"] == LINEARS
    assert report["coverage"]["attention"]["fused"] == 0
    assert report["coverage"]["attention"]["refused"] == {
        "the probabilities go to QuantizeLinear, not into MatMul(probabilities, v)": 2}
    (reason,) = report["coverage"]["qdq_matmul"]["refused"]
    assert reason.startswith("the second operand is dequantized from a computed tensor")
