"""--precision fp16|bf16: weights and compute in the low dtype, fp32 islands, verified against fp32 onnxruntime."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.verify import compare, reference
from passes import precision
from models import EXAMPLES_DIR

RNG = np.random.default_rng(0)


def _types(model: onnx.ModelProto) -> dict[str, int]:
    vis = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    out = {v.name: v.type.tensor_type.elem_type for v in vis}
    out.update({t.name: t.data_type for t in model.graph.initializer})
    return out


def _attention_block(opset: int = 18) -> onnx.ModelProto:
    """x @ w -> softmax -> @ v, plus a RoPE-style angle path: positions (int) -> float -> * inv_freq -> cos."""
    hidden = 32
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Softmax", ["h"], ["p"], name="probs", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"], name="mix"),
        helper.make_node("Shape", ["x"], ["xs"], name="shape", start=1, end=2),
        helper.make_node("Squeeze", ["xs"], ["seq"], name="seq"),
        helper.make_node("Range", ["zero", "seq", "one"], ["pos"], name="positions"),
        helper.make_node("Cast", ["pos"], ["posf"], name="pos_float", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["posf", "ax1"], ["pos2"], name="pos_col"),
        helper.make_node("Mul", ["pos2", "inv_freq"], ["angles"], name="angles"),
        helper.make_node("Cos", ["angles"], ["cos"], name="cos"),
        helper.make_node("Mul", ["o", "cos"], ["y"], name="rotate"),
    ]
    inits = [
        numpy_helper.from_array((RNG.standard_normal((hidden, hidden)) * 0.3).astype(np.float32), "w"),
        numpy_helper.from_array(RNG.standard_normal((hidden, hidden)).astype(np.float32), "v"),
        numpy_helper.from_array((1.0 / 10000 ** (np.arange(hidden) / hidden)).astype(np.float32), "inv_freq"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
    ]
    g = helper.make_graph(nodes, "block",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def _run(model, x):
    return reference.Oracle(model).run([reference.ReferenceCase("c", {"x": x})])[0]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_fp32_islands_and_io_types(name):
    model = _attention_block()
    low, summary = precision.apply_precision(model, name)
    onnx.checker.check_model(low, full_check=True)
    types, lt = _types(low), precision.LOW_DTYPES[name]
    by_name = {n.name: n for n in low.graph.node}
    # interface unchanged; weights converted in place under their own names
    assert types["x"] == types["y"] == TensorProto.FLOAT
    assert types["w"] == types["v"] == lt
    # Softmax computes in fp32: its input is an fp32 cast of the low-precision matmul
    assert types[by_name["probs"].input[0]] == TensorProto.FLOAT and types["h"] == lt
    # the angle computation stays fp32 from the int positions to the cosine, inv_freq included
    for v in ("posf", "angles", "cos", "inv_freq"):
        assert types[v] == TensorProto.FLOAT, v
    assert types["o"] == lt and types["p"] == TensorProto.FLOAT
    assert summary.fp32_nodes["Softmax"] == 1 and summary.fp32_nodes["Cos"] == 1
    assert summary.weights_converted == 2
    # and the numbers: within the precision's tolerance of fp32 onnxruntime
    x = RNG.standard_normal((3, 9, 32)).astype(np.float32)
    ref = _run(model, x)["y"]
    got = _run(precision.emulate_in_fp32(low, name) if name == "bf16" else low, x)["y"]
    c = compare.compare(got, ref, *compare.default_tolerance(precision.TOLERANCE_KEY[name]))
    assert c.ok and c.max_abs > 0, c  # > 0: it really computed in lower precision


def test_keep_set_is_configurable():
    model = _attention_block()
    low, summary = precision.apply_precision(model, "fp16", keep=())
    types = _types(low)
    assert types["p"] == TensorProto.FLOAT16  # softmax no longer kept
    assert "Softmax" not in summary.fp32_nodes
    assert precision.parse_keep("+Exp") == precision.KEEP_FP32 + ("Exp",)
    assert precision.parse_keep("none") == () and precision.parse_keep(None) == precision.KEEP_FP32
    with pytest.raises(precision.PrecisionError, match="Sofmax"):
        precision.check_keep(("Sofmax",))
    precision.check_keep(("Softmax", "mindspore::RmsNorm"))


def test_bf16_emulation_rounds_every_low_result_through_bf16():
    """The emulated graph holds only fp32 values, and each low-precision node's result equals its fp32
    computation rounded to bf16 (checked on the first matmul against numpy)."""
    model = _attention_block()
    low, _ = precision.apply_precision(model, "bf16")
    emu = precision.emulate_in_fp32(low, "bf16")
    onnx.checker.check_model(emu, full_check=True)
    types = _types(emu)
    # bf16 lives only between the two Casts of each rounding point, and in the weights, kept bf16 (no fp32 copy)
    # and each read by one Cast to fp32
    weights_low = {t.name for t in emu.graph.initializer if t.data_type == TensorProto.BFLOAT16}
    assert weights_low == {"w", "v"}
    stray = [n for n, t in types.items() if t == TensorProto.BFLOAT16 and not n.endswith(("__wide", "__rounded"))]
    assert set(stray) == weights_low
    readers = [(n.op_type, [a.i for a in n.attribute]) for n in emu.graph.node if set(n.input) & weights_low]
    assert readers == [("Cast", [TensorProto.FLOAT])] * 2
    exposed = onnx.ModelProto()
    exposed.CopyFrom(emu)
    exposed.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
    x = RNG.standard_normal((2, 4, 32)).astype(np.float32)
    h = _run(exposed, x)["h"]
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    np.testing.assert_allclose(h, bf(bf(x) @ bf(w)), rtol=1e-2, atol=1e-2)
    assert np.array_equal(h, bf(h))  # every element is a bf16 value


def test_control_flow_is_refused():
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "b", [],
                             [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)], "g",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(precision.PrecisionError, match="control flow"):
        precision.apply_precision(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), "fp16")


@pytest.mark.parametrize("name,max_abs", [("fp16", 1e-2), ("bf16", 3e-2)])
def test_tiny_llama_compiles_at_low_precision(name, max_abs, tmp_path):
    """The shipped tiny Llama (a real dynamo export) at fp16 and bf16: verified against fp32 onnxruntime at
    two shapes, fused primitives kept, weights in the low dtype, per-layer error growth reported."""
    report = graphconv.compile(EXAMPLES_DIR / "tiny_llama.onnx", tmp_path / "m.mindir", precision=name)
    assert report.status == "verified"
    outs = [o for c in report.validation["cases"] for o in c["outputs"]]
    assert len(outs) == 2 and all(o["ok"] and 0 < o["max_abs"] <= max_abs for o in outs), outs
    assert (report.validation["atol"], report.validation["rtol"]) == compare.default_tolerance(
        precision.TOLERANCE_KEY[name])
    info = report.validation["precision"]
    assert info["precision"] == name and info["weights_converted"] > 10
    assert {"Cos", "Sin"} <= set(info["fp32_nodes"])
    assert ("cpu_emulation" in info) == (name == "bf16")
    layers = info["layers"]
    assert [row["op"] for row in layers] == ["mindspore::RmsNorm"] * 5 + ["output"]
    assert all(row["cosine"] > 0.9999 for row in layers)
    assert report.census.get("RmsNorm") == 5 and report.census.get("FlashAttentionScore") == 2
    assert report.provenance["precision"] == name


@pytest.mark.parametrize("args,message", [
    (["--precision", "bf16", "--target", "cpu"], "needs --target ascend"),
    (["--keep-fp32", "Softmax"], "--keep-fp32 needs --precision"),
    (["--precision", "fp16", "--keep-fp32", "Sofmax"], "unknown op type(s) Sofmax"),
])
def test_bad_precision_options_are_one_line_errors(args, message, tmp_path):
    out = tmp_path / "m.mindir"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(EXAMPLES_DIR / "tiny_llama.onnx"),
                           "-o", str(out), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


def test_bf16_verification_writes_no_fp32_copy_of_the_weights(tmp_path, monkeypatch):
    """A model whose weights come from files (as large models do) compiled in bf16: its weights are spilled once,
    in bf16 (passes/precision._to_low), and the cpu twin reads those through a Cast; no fp32 copy of any of
    them is written (at real sizes that copy doubled the weights' bytes in the compile's private
    directory)."""
    from graphconv.frontend import weights

    model = onnx.load(str(EXAMPLES_DIR / "tiny_llama.onnx"))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    spilled = []
    original = weights.SpillFile.tensor_proto

    def recording(self, name, array):
        spilled.append((name, array.dtype.name, array.nbytes))
        return original(self, name, array)

    monkeypatch.setattr(weights.SpillFile, "tensor_proto", recording)
    report = graphconv.compile(tmp_path / "m.onnx", tmp_path / "m.mindir", precision="bf16")
    assert report.status == "verified"
    low = {name for name, dtype, _ in spilled if dtype == "bfloat16"}
    assert 10 < len(low) <= report.validation["precision"]["weights_converted"]  # (those from files)
    assert not [(name, dtype) for name, dtype, _ in spilled if name in low and dtype != "bfloat16"]


@pytest.mark.parametrize("stored, precision_, shortcut", [("bf16", "bf16", True), ("fp16", "fp16", True),
                                                          ("bf16", "fp16", False)])
def test_a_weight_stored_low_and_read_through_a_cast_is_read_as_it_is(stored, precision_, shortcut):
    """`export --dtype auto|bf16|fp16` stores each weight low and reads it through Cast(to=FLOAT). A low reader
    of the widened value takes the stored weight itself (narrowing it back gives the same bits) and the widening
    Cast goes; into another low dtype (bf16 -> fp16 rounds) the Cast to it stays. The graph computes the same."""
    dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[stored]
    elem = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16}[stored]
    w = (RNG.standard_normal((32, 16)) * 0.2).astype(dtype)
    weight = helper.make_tensor("w", elem, w.shape, w.view(np.uint16).tobytes(), raw=True)
    scale = numpy_helper.from_array(np.full(32, 0.5, np.float32), "s")  # an fp32 weight: its product runs low
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"], name="scale"),
             helper.make_node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT, name="widen"),
             helper.make_node("MatMul", ["xs", "w32"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])], [weight, scale]),
        opset_imports=[helper.make_opsetid("", 18)])
    model = onnx.shape_inference.infer_shapes(model)
    low, _ = precision.apply_precision(model, precision_)
    matmul = next(n for n in low.graph.node if n.op_type == "MatMul")
    casts_of_w = [n for n in low.graph.node if n.op_type == "Cast" and "w" in n.input]
    if shortcut:
        assert matmul.input[1] == "w" and casts_of_w == []
    else:
        assert matmul.input[1] != "w" and len(casts_of_w) == 1
    x = RNG.standard_normal((2, 32)).astype(np.float32)
    target = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[precision_]
    xs = (x * 0.5).astype(target).astype(np.float32)
    expected = np.maximum(xs @ w.astype(target).astype(np.float32), 0)
    got = _run(precision.emulate_in_fp32(low, precision_), x)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_zeros_never_written_are_lowered_without_writing(tmp_path, precision):
    """A KV cache's zeros (a hole of the compile's file, weights.SpillFile.zeros) lowered to fp16/bf16: the low
    copy is named in the spill file as zeros too, not read and written (gigabytes at a real capacity)."""
    from graphconv.frontend import weights
    from passes.precision import LOW_DTYPES, apply_precision

    spill = weights.SpillFile(tmp_path / "spill.bin")
    cache = spill.zeros("cache.k", TensorProto.FLOAT, [256, 1024])
    w = numpy_helper.from_array(np.ones((4, 1024), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "cache.k"], ["s"]),
                               helper.make_node("MatMul", ["s", "wt"], ["y"]),
                               helper.make_node("Transpose", ["w"], ["wt"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 1024])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 4])], [cache, w])
    lowered, _ = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), precision,
                                 spill=spill)
    low = next(t for t in lowered.graph.initializer if t.name.startswith("cache.k"))
    assert low.data_type == LOW_DTYPES[precision] and list(low.dims) == [256, 1024]
    ref = weights.weight_ref(low)
    assert ref.path == str(spill.path) and ref.length == 256 * 1024 * 2 and weights.is_zeros(ref)
    assert not weights.read(ref).astype(np.float32).any()
    assert spill.path.stat().st_blocks * 512 < 256 * 1024  # (the fp32 zeros and the low ones: holes)
