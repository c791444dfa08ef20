"""mindspore::WeightQuantBatchMatmul (opmap/fused/weight_quant_batch_matmul.py): its body against numpy on raw
qint4x2 bytes, MatMulNBits written as it on load (graphconv/frontend/contrib/quant.py) equal to onnxruntime's
own kernel, the ascend MindIR holding qint4x2 weights, the constraints, and a Llama quantized by onnxruntime's
MatMulNBitsQuantizer compiled with the float model's fusions."""

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

import opmap.fused  # noqa: F401  (registers the fused-op table the load's decomposition reads)
from graphconv.frontend import contrib
from graphconv.frontend.contrib import quant
from opmap.fused import FUSED_OPS, attach_functions
from tests.contrib_utils import compile_verified
from tests.test_contrib_quant import nbits_model

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(7)
WQBMM = FUSED_OPS["WeightQuantBatchMatmul"]


def _body_model(k: int, n: int, group: int, x_type=TensorProto.FLOAT):
    node = helper.make_node("WeightQuantBatchMatmul", ["x", "w", "s", "o"], ["y"], domain="mindspore",
                            antiquant_group_size=group, weight_bits=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, ["m", k]),
                                            helper.make_tensor_value_info("w", TensorProto.INT8, [n, k // 2]),
                                            helper.make_tensor_value_info("s", x_type, [k // group, n]),
                                            helper.make_tensor_value_info("o", x_type, [k // group, n])],
                              [helper.make_tensor_value_info("y", x_type, ["m", n])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return attach_functions(m)


def test_the_body_reads_qint4x2_bytes_low_nibble_first_and_adds_the_offset():
    """y = x @ ((q + offset) * scale), q the two's-complement nibbles, element 2j in the low one: every byte
    value, against numpy's own unpacking."""
    k, n, g = 64, 8, 32
    w = np.arange(-128, 128, dtype=np.int16).astype(np.int8).reshape(8, 32)  # every byte
    s = RNG.uniform(0.01, 0.1, (k // g, n)).astype(np.float32)
    o = RNG.integers(-7, 9, (k // g, n)).astype(np.float32)
    x = RNG.standard_normal((3, k)).astype(np.float32)
    lo = ((w.astype(np.int16) & 0xF) ^ 8) - 8
    hi = w.astype(np.int16) >> 4
    q = np.stack([lo, hi], -1).reshape(n, k).astype(np.float32)  # [N, K]
    ref = x @ ((q.T + np.repeat(o, g, axis=0)) * np.repeat(s, g, axis=0))
    got = ort.InferenceSession(_body_model(k, n, g).SerializeToString()).run(None, {"x": x, "w": w, "s": s, "o": o})
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-5)


def test_the_xor_relayout_is_the_zero_point_exactly():
    """B XOR 0x88 as signed nibbles plus offset 8 - zp is q - zp for every q and zp."""
    q = np.arange(16, dtype=np.uint8)
    byte = (q[:, None] | (q[None, :] << 4)).astype(np.uint8)  # low nibble q_i, high nibble q_j
    signed = (byte ^ 0x88).view(np.int8).astype(np.int16)
    lo, hi = ((signed & 0xF) ^ 8) - 8, signed >> 4
    for zp in range(16):
        assert np.array_equal(lo + (8 - zp), np.broadcast_to(q[:, None].astype(np.int16) - zp, lo.shape))
        assert np.array_equal(hi + (8 - zp), np.broadcast_to(q[None, :].astype(np.int16) - zp, hi.shape))


@pytest.mark.parametrize("zp,bias", [("none", False), ("packed", True), ("packed", False)])
def test_matmul_nbits_becomes_one_fused_node_equal_to_onnxruntime(zp, bias):
    m = nbits_model(k=128, n=48, zp=zp, bias=bias, opset=18)
    fused, counts = contrib.decompose(m)
    assert counts == {"com.microsoft::MatMulNBits": 1}
    assert [n.op_type for n in fused.graph.node] == ["WeightQuantBatchMatmul"] + (["Add"] if bias else [])
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert inits["proj::weight_qint4x2"].dtype == np.int8 and inits["proj::weight_qint4x2"].shape == (48, 64)
    assert inits["proj::antiquant_scale"].shape == (4, 48) and "w_q" not in inits
    for shape in ((2, 3, 128), (1, 7, 128)):
        a = RNG.standard_normal(shape).astype(np.float32)
        want = ort.InferenceSession(m.SerializeToString()).run(None, {"a": a})[0]
        got = ort.InferenceSession(fused.SerializeToString()).run(None, {"a": a})[0]
        np.testing.assert_array_equal(got, want)  # the same float weights, the same fp32 MatMul


@pytest.mark.parametrize("k,block", [(128, 128), (96, 128)])
def test_an_8_bit_matmul_nbits_of_one_block_over_k_is_per_channel_exactly(k, block):
    """One block spanning K (padded past it where K is no power of 2): one scale per output channel, written
    as the per-channel form (group 0, scale and offset (N,)), equal to onnxruntime's kernel."""
    m = nbits_model(k=k, n=48, bits=8, block=block, zp="packed", opset=18)
    fused, _ = contrib.decompose(m)
    (node,) = [n for n in fused.graph.node if n.op_type == "WeightQuantBatchMatmul"]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["antiquant_group_size"] == 0
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert inits["proj::weight_int8"].shape == (48, k) and inits["proj::antiquant_scale"].shape == (48,)
    a = RNG.standard_normal((2, 3, k)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString()).run(None, {"a": a})[0]
    got = ort.InferenceSession(fused.SerializeToString()).run(None, {"a": a})[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("change,reason", [
    (dict(bits=2), "bits=2 (WeightQuantBatchMatmul takes 4-bit weights, as qint4x2, and 8-bit ones, as int8)"),
    (dict(block=16), "WeightQuantBatchMatmul needs antiquant_group_size 0 (per channel) or a multiple of 32 in"),
    (dict(k=80), "K=80 is not a multiple of block_size=32 (a padded last block)"),
    (dict(opset=14), "opset 14 (the fused body needs CastLike, opset 15)"),
])
def test_forms_it_cannot_take_keep_the_decomposition_with_the_reason(change, reason):
    m = nbits_model(**{"k": 128, "n": 48, "zp": "packed", "opset": 18, **change})
    fused, _ = contrib.decompose(m)
    assert "WeightQuantBatchMatmul" not in {n.op_type for n in fused.graph.node}
    matmul = next(n for n in fused.graph.node if n.op_type == "MatMul")
    assert matmul.doc_string.startswith(quant.NOT_FUSED + reason)


def test_constraints_at_their_boundaries():
    assert WQBMM.broken({"K": 64, "N": 65535, "G": 32}) is None
    assert WQBMM.broken({"K": 65534, "N": 8, "G": 64}) is None
    assert "multiple of 32" in WQBMM.broken({"K": 32, "N": 8, "G": 32}).text  # G <= K - 1
    assert "multiple of 32" in WQBMM.broken({"K": 128, "N": 8, "G": 48}).text
    assert "N at most" in WQBMM.broken({"K": 64, "N": 65536, "G": 32}).text
    assert "K at most" in WQBMM.broken({"K": 65536, "N": 8, "G": 64}).text
    assert "K even" in WQBMM.broken({"K": 65, "N": 8, "G": 32, "bits": 4}).text
    assert WQBMM.broken({"K": 65, "N": 8, "G": 0, "bits": 8}) is None  # int8, per channel: K odd is fine
    assert "weight_bits 4" in WQBMM.broken({"K": 64, "N": 8, "G": 32, "bits": 2}).text


def _qint4x2_bytes(mindir: Path) -> dict[str, tuple[list, int]]:
    from mindspore.train import mind_ir_pb2

    proto = mind_ir_pb2.ModelProto()
    proto.ParseFromString(mindir.read_bytes())
    qint4x2 = mind_ir_pb2.TensorProto.DataType.Value("QINT4X2")
    return {p.name.split(":", 1)[1]: (list(p.dims), len(p.raw_data)) for p in proto.graph.parameter
            if p.data_type == qint4x2}


def test_compiles_to_one_primitive_with_a_qint4x2_weight(tmp_path):
    m = nbits_model(k=128, n=48, zp="packed", bias=True, opset=18)
    report = compile_verified(m, tmp_path)
    assert report.census["WeightQuantBatchMatmul"] == 1 and report.fusions["fuse-quant-matmul"] == 1
    assert not {"RightShift", "FloorDiv", "MatMulExt", "MatMul"} & set(report.census)
    assert report.census["Cast"] == 2  # x to fp16 and y back; the scales and offsets are stored in fp16
    assert all(o["max_abs"] == 0 for c in report.validation["cases"] for o in c["outputs"])
    assert len(report.validation["cases"]) == 2
    assert _qint4x2_bytes(tmp_path / "contrib.mindir") == {"proj::weight_qint4x2": ([48, 64], 48 * 128 // 2)}


def _compile(onnx_path: Path, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "graphconv", "compile", str(onnx_path), "-o", str(out),
                    "--report", str(out.with_suffix(".json")), "-q"], check=True, cwd=ROOT)
    return json.loads(out.with_suffix(".json").read_text())


# onnxruntime 1.32's own quantizer, as a user runs it: 4 bits, blocks of 32, symmetric or with zero points
QUANTIZE = """
import sys, onnx
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
q = MatMulNBitsQuantizer(onnx.load(sys.argv[1]), algo_config=DefaultWeightOnlyQuantConfig(
    block_size=32, is_symmetric=sys.argv[3] == "True", bits=4))
q.process()
onnx.save(q.model.model, sys.argv[2])
"""


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("float")
    return _compile(ROOT / "models/examples/tiny_llama.onnx", d / "float.mindir")


@pytest.mark.parametrize("symmetric", [True, False])
def test_tiny_llama_quantized_by_onnxruntime_keeps_its_fusions(tmp_path, float_llama, symmetric):
    # In a child: onnxruntime.transformers imports a module `fusion_utils`, which tests/ also has.
    subprocess.run([sys.executable, "-c", QUANTIZE, str(ROOT / "models/examples/tiny_llama.onnx"),
                    str(tmp_path / "q.onnx"), str(symmetric)], check=True, cwd=tmp_path, capture_output=True)
    quantized = onnx.load(tmp_path / "q.onnx")
    nbits = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert len(nbits) == 15  # 7 linears x 2 layers and the lm_head
    report = _compile(tmp_path / "q.onnx", tmp_path / "q.mindir")
    assert report["status"] == "verified"
    fused = {k: v for k, v in report["fusions"].items() if k != "fuse-quant-matmul"}
    assert fused == {k: v for k, v in float_llama["fusions"].items() if k != "fuse-quant-matmul"}
    for family in ("attention", "norm", "rotary", "gated_mlp"):
        assert report["coverage"][family]["fused"] == float_llama["coverage"][family]["fused"] > 0, family
    assert float_llama["fusions"]["fuse-swiglu"] == 2
    # 15 MatMulNBits, the gate/up pair of each layer merged into one by fuse-swiglu: 13 primitives
    census = subprocess.run([sys.executable, "-m", "graphconv", "inspect", str(tmp_path / "q.mindir"), "--json"],
                            check=True, cwd=ROOT, capture_output=True, text=True)
    primitives = json.loads(census.stdout)["primitives"]
    assert primitives["WeightQuantBatchMatmul"] == 13 == report["fusions"]["fuse-quant-matmul"]
    assert not {"RightShift", "FloorDiv", "MatMulExt", "MatMul", "BatchMatMul"} & set(primitives)
    weights = _qint4x2_bytes(tmp_path / "q.mindir")
    assert sum(b for _, b in weights.values()) == sum(a["K"] * a["N"] // 2 for a in attrs)
    assert all(b == dims[0] * dims[1] for dims, b in weights.values())


def test_the_cpu_form_unpacks_the_same_bytes_at_run_time_exactly(tmp_path):
    """A weight above the lowering's folding limit (65536 elements): the cpu network holds the int8 container
    and runs the body's integer unpacking on MindSpore's CPU, equal to onnxruntime's MatMulNBits."""
    from mindspore.train import mind_ir_pb2

    m = nbits_model(k=512, n=512, zp="packed", opset=18)
    report = compile_verified(m, tmp_path, target="cpu")
    assert "WeightQuantBatchMatmul" not in report.census and report.census["MatMulExt"] == 1
    assert all(o["max_abs"] == 0 for c in report.validation["cases"] for o in c["outputs"])
    proto = mind_ir_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "contrib.mindir").read_bytes())
    int8 = mind_ir_pb2.TensorProto.DataType.Value("INT8")
    assert [(list(p.dims), len(p.raw_data)) for p in proto.graph.parameter if p.data_type == int8] == \
        [([512, 256], 512 * 256)]


def _gated_mlp(blocks: tuple[int, int], k: int = 128, n: int = 96):
    """silu(MatMulNBits(x, Wg)) * MatMulNBits(x, Wu), 4-bit, the two projections' block sizes `blocks`."""
    from tests.contrib_utils import model
    from tests.test_contrib_quant import pack

    nodes, inits = [], []
    for name, block in zip(("gate", "up"), blocks):
        q = RNG.integers(0, 16, (n, k // block, block))
        inits += [numpy_helper.from_array(pack(q, 4), f"{name}_q"),
                  numpy_helper.from_array(RNG.uniform(0.01, 0.1, (n, k // block)).astype(np.float32), f"{name}_s")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"{name}_q", f"{name}_s"], [name], domain="com.microsoft",
                                      name=name, K=k, N=n, bits=4, block_size=block))
    nodes += [helper.make_node("Sigmoid", ["gate"], ["sig"]), helper.make_node("Mul", ["gate", "sig"], ["act"]),
              helper.make_node("Mul", ["act", "up"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])], inits, opset=18)


def test_fuse_swiglu_merges_a_gate_up_pair_into_one_weight_quant_batch_matmul(tmp_path):
    report = compile_verified(_gated_mlp((32, 32)), tmp_path)
    assert report.fusions["fuse-swiglu"] == 1 and report.fusions["fuse-quant-matmul"] == 1
    assert report.census["WeightQuantBatchMatmul"] == 1 and report.census["Swiglu"] == 1
    # the merged weight [2N, K/2]: gate rows first
    assert list(_qint4x2_bytes(tmp_path / "contrib.mindir").values()) == [([192, 64], 192 * 64)]


def test_a_gate_up_pair_of_two_group_sizes_is_not_merged_and_says_why(tmp_path):
    report = compile_verified(_gated_mlp((32, 64)), tmp_path)
    assert report.fusions["fuse-swiglu"] == 0 and report.census["WeightQuantBatchMatmul"] == 2
    (reason,) = report.coverage["gated_mlp"]["refused"]
    assert "group sizes 32 and 64" in reason, reason


@pytest.mark.parametrize("bits, n", [(4, 4096), (8, 2048)])  # (1 MiB of weight each: spilled, not held)
def test_weights_in_an_external_file_are_re_laid_into_the_workspace(tmp_path, bits, n):
    """A model whose weights are in an external data file (as every model past 2 GB is): the re-laid weight
    goes to a file of the compile's private directory instead of memory, and still runs on one
    WeightQuantBatchMatmul whose integer Parameter holds K * N * bits / 8 bytes; the cpu compile verifies."""
    from mindspore.train import mind_ir_pb2

    m = nbits_model(k=512, n=n, bits=bits, block=128, zp="packed", opset=18)
    scales = next(t for t in m.graph.initializer if t.name == "w_scales")  # (weights of a trained model's size:
    scales.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scales) / 100, "w_scales"))  # sums stay small)
    src = tmp_path / "model.onnx"
    onnx.save(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=0)
    assert onnx.load(src, load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    report = _compile(src, tmp_path / "q.mindir")
    assert report["status"] == "verified" and report["census"]["WeightQuantBatchMatmul"] == 1
    assert report["quantized_linears"]["on_low_bit_primitives"] == 1 == report["quantized_linears"]["linears"]
    proto = mind_ir_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "q.mindir").read_bytes())
    kind = mind_ir_pb2.TensorProto.DataType.Value("QINT4X2" if bits == 4 else "INT8")
    held = [len(p.raw_data) or p.external_data.length for p in proto.graph.parameter if p.data_type == kind]
    assert held == [512 * n * bits // 8], held
    cpu = graphconv_compile_cpu(src, tmp_path / "cpu.mindir")
    assert cpu["status"] == "verified" and cpu["validation"]["checked"]


def graphconv_compile_cpu(src: Path, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "graphconv", "compile", str(src), "-o", str(out), "--target", "cpu",
                    "--report", str(out.with_suffix(".json")), "-q"], check=True, cwd=ROOT)
    return json.loads(out.with_suffix(".json").read_text())
