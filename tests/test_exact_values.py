"""A low-precision model's exact values (graphconv/verify/exact.py) and the rule that judges a network against
them (compare.judge_against_exact): the float64 upcast against numpy in float64, the rule's three outcomes, and
a compile of an fp16 model through the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphconv.verify import compare, exact, piecewise
from graphconv.verify.reference import ReferenceCase

RNG = np.random.default_rng(0)
W1 = (RNG.standard_normal((16, 32)) * 0.25).astype(np.float16)
W2 = (RNG.standard_normal((32, 8)) * 0.25).astype(np.float16)


def _mlp(elem=TensorProto.FLOAT16) -> onnx.ModelProto:
    """y = gelu_erf(x @ W1) @ W2 * 0.5 + ones, in fp16, with the constants spelled the ways an upcast must reach:
    a Constant's value_float, ConstantOfShape's value, a Cast to fp16 inside, Erf (no double kernel in
    onnxruntime: onnx.reference runs it)."""
    np_dt = helper.tensor_dtype_to_np_dtype(elem)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["sqrt2"], value_float=math.sqrt(2.0)),
        helper.make_node("Div", ["h32", "sqrt2"], ["hs"]),
        helper.make_node("Erf", ["hs"], ["e"]),
        helper.make_node("Constant", [], ["one"], value_float=1.0),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h32", "e1"], ["g2"]),
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Mul", ["g2", "half"], ["g32"]),
        helper.make_node("Cast", ["g32"], ["g"], to=elem),
        helper.make_node("MatMul", ["g", "w2"], ["z"]),
        helper.make_node("Shape", ["z"], ["zs"]),
        helper.make_node("ConstantOfShape", ["zs"], ["ones"],
                         value=numpy_helper.from_array(np.array([1.0], np_dt))),
        helper.make_node("Add", ["z", "ones"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", elem, ["batch", 16])],
                              [helper.make_tensor_value_info("y", elem, ["batch", 8])],
                              [numpy_helper.from_array(W1.astype(np_dt), "w1"),
                               numpy_helper.from_array(W2.astype(np_dt), "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _numpy_exact(x: np.ndarray) -> np.ndarray:
    """The same function in float64 on the same fp16 weights and inputs."""
    h = x.astype(np.float64) @ W1.astype(np.float64)
    g = h * (1 + np.vectorize(math.erf)(h / np.float64(np.float32(math.sqrt(2.0))))) * 0.5
    return g @ W2.astype(np.float64) + 1.0


def test_the_upcast_graph_computes_what_numpy_computes_in_float64():
    model = _mlp()
    assert exact.computes_in_low_precision(model)
    cases = [ReferenceCase("case0", {"x": RNG.standard_normal((3, 16)).astype(np.float16)})]
    values, _, rows = piecewise.run(model, piecewise.whole(model), cases, exact=True)
    assert rows[0]["engine"] == "onnx.reference"  # (onnxruntime has no double Erf)
    got = values[0]["y"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, _numpy_exact(cases[0].inputs["x"]), rtol=0, atol=1e-12)
    upcast = exact.upcast(model)
    types = {t.name: t.data_type for t in upcast.graph.initializer}
    assert types == {"w1": TensorProto.DOUBLE, "w2": TensorProto.DOUBLE}
    assert not exact.computes_in_low_precision(_mlp(TensorProto.FLOAT))


def test_the_rule_passes_within_tolerance_or_within_the_factor_and_fails_beyond():
    truth = np.linspace(-4, 4, 64)
    rounded = truth + 0.05  # the graph rounded at every op: 0.05 off, beyond fp16's 1e-2 + 1e-2·|x|
    onnxruntime = (truth + 0.02).astype(np.float16)
    atol, rtol = compare.default_tolerance("float16")
    close = compare.judge_against_exact(truth + 0.001, onnxruntime, truth, rounded, atol, rtol)
    assert close.ok and close.exact["passed_by"] == "tolerance"
    within = compare.judge_against_exact(truth + 0.059, onnxruntime, truth, rounded, atol, rtol)
    assert within.ok and within.exact["passed_by"] == "factor"
    assert within.max_abs == pytest.approx(0.059) and within.exact["rounded_max_abs"] == pytest.approx(0.05)
    assert within.exact["onnxruntime_max_abs"] == float(np.abs(onnxruntime.astype(np.float64) - truth).max())
    far = compare.judge_against_exact(truth + 0.061, onnxruntime, truth, rounded, atol, rtol)
    assert not far.ok and "its mean abs 0.061 is 1.22x the 0.05 of the graph rounded at every op" in far.reason


def test_the_factor_is_on_the_typical_distance_with_a_guard_on_the_largest():
    """Two roundings of one graph differ in their largest distance from the exact values by a quarter either
    way, and in their mean by a few percent (docs/design.md): a network whose one largest element is 1.4x the
    rounded graph's, at the same mean, passes; one element 1.6x as far, or the whole tensor 1.25x, fails."""
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(4096)
    noise = rng.standard_normal(4096) * 0.04  # beyond fp16's tolerance, as at a deep model's outputs
    rounded = truth + noise
    atol, rtol = compare.default_tolerance("float16")
    peak = int(np.argmax(np.abs(noise)))
    spike = noise.copy()
    spike[peak] *= 1.4
    one = compare.judge_against_exact(truth + spike, truth, truth, rounded, atol, rtol)
    assert one.ok and one.exact["ratio"] == pytest.approx(1.4) and one.exact["mean_ratio"] < 1.01
    spike[peak] = noise[peak] * 1.6
    two = compare.judge_against_exact(truth + spike, truth, truth, rounded, atol, rtol)
    assert not two.ok and "its max abs" in two.reason and "is 1.60x that graph's" in two.reason
    wide = compare.judge_against_exact(truth + noise * 1.25, truth, truth, rounded, atol, rtol)
    assert not wide.ok and "its mean abs" in wide.reason and wide.exact["mean_ratio"] == pytest.approx(1.25)


def test_the_rounded_graph_rounds_every_op_result_to_its_dtype():
    """upcast(rounded=) computes each op in fp32 (as an fp16 device accumulates) and rounds each fp16 result
    once: numpy doing the same gives the same values."""
    model = _mlp()
    x = RNG.standard_normal((4, 16)).astype(np.float16)
    values, _, _ = piecewise.run(model, piecewise.whole(model), [ReferenceCase("c", {"x": x})], exact=True,
                                 rounded=True)

    def r16(a):
        return a.astype(np.float16).astype(np.float32)

    f32 = np.float32
    h = r16(x.astype(f32) @ W1.astype(f32))  # the MatMul's fp16 result; then fp32 up to the Cast
    erf = np.vectorize(math.erf, otypes=[np.float64])
    g32 = (h * (1 + erf(h / f32(math.sqrt(2.0))).astype(f32)) * f32(0.5)).astype(f32)
    z = r16(r16(g32) @ W2.astype(f32))
    assert values[0]["y"].dtype == np.float32
    np.testing.assert_array_equal(values[0]["y"], r16(z + f32(1.0)))


def test_an_fp16_model_compiles_judged_against_its_exact_values(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), path)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(path), "-o", str(tmp_path / "m.mindir"),
                           "--report", str(report)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "against the exact (float64) values" in proc.stdout
    validation = json.loads(report.read_text())["validation"]
    assert validation["exact"]["status"] == "computed"
    for case in validation["cases"]:
        (out,) = case["outputs"]
        assert out["ok"] and out["exact"]["rounded_max_abs"] > 0 and out["exact"]["onnxruntime_max_abs"] > 0


def test_the_summary_of_an_fp16_model_whose_ascend_precision_was_not_measured():
    """An fp16 model's fused attention takes fp16 already: the section says "not needed" with no outputs, and the
    summary printed it as a KeyError (exit 3 for every fp16 model with attention compiled without --json)."""
    from graphconv.report import Report

    report = Report(model={"inputs": [], "outputs": []}, status="verified", validation={
        "status": "verified", "oracle": "onnxruntime", "cases": [],
        "ascend_precision": {"status": "not needed", "why": "the fused ops' inputs are fp16 already"}})
    assert "ascend precision: not needed (the fused ops' inputs are fp16 already)" in report.summary()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_precision_compile_is_judged_against_the_exact_values_of_its_low_precision_graph(tmp_path, precision):
    """--precision: the exact values are the precision pass's graph's (the model on its fp16/bf16 weights, the
    fused ops' function bodies with their fp32 epsilon Constants included); each output row gives them."""
    import graphconv
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "models" / "examples" / "tiny_llama.onnx"
    report = graphconv.compile(example, tmp_path / "t.mindir", precision=precision)
    assert report.validation["exact"]["status"] == "computed", report.validation["exact"]
    for case in report.validation["cases"]:
        for out in case["outputs"]:
            assert out["ok"] and out["exact"]["mean_ratio"] <= compare.EXACT_FACTOR, out


def test_exact_values_too_big_for_memory_are_skipped_with_the_reason(tmp_path, monkeypatch):
    """Where one piece's float64 weights would take more than half the free memory, the exact values are not
    computed, the report says why, and the network is held to onnxruntime's values (the MLP passes them)."""
    import types

    import graphconv
    import graphconv.verification

    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), path)
    monkeypatch.setattr(graphconv.verification.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1000))
    report = graphconv.compile(path, tmp_path / "m.mindir")
    assert report.validation["exact"]["status"] == "not computed"
    assert "float64 weights would take" in report.validation["exact"]["why"]
    assert all("exact" not in o or o["exact"] is None for c in report.validation["cases"] for o in c["outputs"])
