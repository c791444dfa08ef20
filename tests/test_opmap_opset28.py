"""The standard ops up to opset 28 (onnx 1.23): every op has an opmap handler or a one-line reason
(opmap/refusals.py); the new handlers pass onnx's own node tests through the conformance machinery and
compile and verify (graphconv.compile, target cpu, two shapes, against onnxruntime) on hand-built graphs.

Until graphconv/frontend/load.MAX_OPSET is raised to 28 on main, the tests raise it for themselves (the node
tests are at each op's newest opset: 24 to 28 here); nothing else about the cases is changed. Expected values
are onnx's test data (node tests) and onnxruntime's outputs (compiles), never graphconv's.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as oh

import graphconv
import opmap
from graphconv.frontend import load
from graphconv.compiler import lowering
from graphconv.tools import conformance
from opmap import refusals

@pytest.fixture
def opset28():
    """The loader and the conformance run take opsets up to onnx's newest (28)."""
    assert load.MAX_OPSET == 28


def test_every_standard_op_has_a_handler_or_a_reason():
    newest = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain in ("", "ai.onnx") and s.since_version <= 28:
            newest[s.name] = max(newest.get(s.name, 0), s.since_version)
    assert len(newest) > 190
    missing = [op for op, v in sorted(newest.items()) if op != "Constant"
               and opmap.lookup("", op, 28) is None and refusals.reason(op) is None]
    assert not missing, f"no handler and no reason: {missing}"
    both = [op for op in refusals.REASONS if opmap.lookup("", op, 28) is not None]
    assert not both, f"a handler and a refusal: {both}"
    assert not [op for op in refusals.REASONS if op not in newest]
    for op, why in refusals.REASONS.items():  # one line, and no commas (unsupported_ops lists ops with ", ")
        assert why and "\n" not in why and "," not in why, op


def test_the_reason_is_in_the_refusal():
    g = oh.make_graph([oh.make_node("RandomNormalLike", ["x"], ["y"])], "g",
                      [oh.make_tensor_value_info("x", T.FLOAT, [2])], [oh.make_tensor_value_info("y", T.FLOAT, [2])])
    got = lowering.unsupported_ops(oh.make_model(g, opset_imports=[oh.make_opsetid("", 22)]))
    assert got == [f"RandomNormalLike (opset 22: {refusals.REASONS['RandomNormalLike']})"]


# --- onnx's node tests -----------------------------------------------------------------------------------------

# Every node test of these ops (and the newer versions checked), and what each must give. A case not listed
# in NOT_PASSING must pass.
OPS = ("einsum|depthtospace|spacetodepth|compress|unique|reversesequence|cumprod|celu|swish|bitshift|bitcast|mod"
       "|range|reduce_log_sum|optional|squeeze")
SLOW_OPS = "reduce_log_sum|bitshift|mod"  # many cases of handlers that existed before: the slow slice
BF16_IO = "bfloat16 numpy arrays"
NOT_PASSING = {
    r"_bfloat16(_|$)": BF16_IO,
    r"^test_range_bfloat16": BF16_IO,
    r"^test_range_.*_expanded$": "trip count must be a compile-time constant",
    r"^test_bitcast_(2d_float32_to_int32|float32_to_int32|float64_to_int64|int32_to_float32|int64_to_float64"
    r"|scalar_float32_to_int32)$": "cannot reinterpret float bits",
    r"^test_mod_uint64$": "no uint64 subtraction",
    r"^test_optional_(get_element_(optional_sequence|optional_tensor|sequence)|has_element_(empty_optional_input"
    r"|optional_input|tensor_input))$": "graphconv lowers tensors only",
}


def _expected(name: str) -> str | None:
    return next((why for rx, why in NOT_PASSING.items() if re.search(rx, name)), None)


def _run(pattern: str):
    cases = conformance.collect(pattern)
    assert cases
    return cases, conformance.run(cases)


def _check(outcomes):
    bad = []
    for o in outcomes:
        why = _expected(o.name)
        if why is None and o.status != "passed":
            bad.append(f"{o.name}: {o.status}: {o.reason}")
        elif why is not None and (o.status == "passed" or why not in o.reason):
            bad.append(f"{o.name}: expected not to pass ({why}), got {o.status}: {o.reason}")
    assert not bad, "\n".join(bad)


def test_node_tests(opset28):
    fast = "|".join(op for op in OPS.split("|") if op not in SLOW_OPS.split("|"))
    cases, outcomes = _run(rf"^test_({fast})")
    assert {c.opset for c in cases} >= {24, 25, 26, 28}
    _check(outcomes)


@pytest.mark.slow
def test_node_tests_of_extended_handlers(opset28):
    cases, outcomes = _run(rf"^test_({SLOW_OPS})")
    assert len(cases) >= 70
    _check(outcomes)


# --- hand-built graphs through graphconv.compile ---------------------------------------------------------------

def _vi(name, elem, shape):
    return oh.make_tensor_value_info(name, elem, shape)


def _compile(tmp_path, nodes, inputs, outputs, inits=(), opset=21):
    """outputs: names (onnx's shape inference types them)."""
    model = oh.make_model(oh.make_graph(nodes, "g", inputs, [onnx.ValueInfoProto(name=o) for o in outputs],
                                        list(inits)), opset_imports=[oh.make_opsetid("", opset)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu")
    assert report.status == "verified", report.error
    return report


def _max_abs(report) -> tuple[int, float]:
    """(cases, the largest max_abs over every output of every reference case)."""
    cases = report.validation["cases"]
    return len(cases), max(o["max_abs"] for case in cases for o in case["outputs"])


def test_compile_opset21_graph(tmp_path):
    """Einsum (matmul, broadcast-multiply and diagonal paths), DepthToSpace CRD -> SpaceToDepth, Celu,
    GlobalLpPool, Compress with a data-dependent condition, Unique (4 outputs), MaxRoiPool, with a symbolic
    batch: onnxruntime's outputs at two batch sizes."""
    x = _vi("x", T.FLOAT, ["n", 8, 4, 6])
    y = _vi("y", T.FLOAT, ["n", 8, 6, 4])
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32), "w")
    rois = onnx.numpy_helper.from_array(np.array([[0, 0, 0, 3, 3], [0, 1.4, 0.6, 5, 2.5], [0, 4, 3, 4, 3]],
                                                 np.float32), "rois")
    three = onnx.numpy_helper.from_array(np.array(3.0, np.float32), "three")
    zero = onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    axis0 = onnx.numpy_helper.from_array(np.array([0], np.int64), "axis0")
    nodes = [
        oh.make_node("Einsum", ["x", "y"], ["mm"], equation="...ij,...jk->...ik"),
        oh.make_node("Einsum", ["x", "w"], ["proj"], equation="nchw,wk->nkch"),
        oh.make_node("Einsum", ["mm"], ["diag"], equation="ncii->nc"),
        oh.make_node("DepthToSpace", ["x"], ["d2s"], blocksize=2, mode="CRD"),
        oh.make_node("SpaceToDepth", ["d2s"], ["s2d"], blocksize=2),
        oh.make_node("Celu", ["s2d"], ["celu"], alpha=0.7),
        oh.make_node("GlobalLpPool", ["celu"], ["lp"], p=3),
        oh.make_node("Greater", ["diag", "zero"], ["pos"]),
        oh.make_node("Flatten", ["pos"], ["pos2"], axis=0),
        oh.make_node("Squeeze", ["pos2", "axis0"], ["cond"]),
        oh.make_node("Compress", ["diag"], ["picked"]),
        oh.make_node("Mul", ["x", "three"], ["x3"]),
        oh.make_node("Floor", ["x3"], ["levels"]),
        oh.make_node("Unique", ["levels"], ["u", "u_first", "u_inverse", "u_counts"], sorted=1),
        oh.make_node("MaxRoiPool", ["x", "rois"], ["pooled"], pooled_shape=[2, 3], spatial_scale=0.8),
    ]
    nodes[10].input.append("cond")
    outputs = ["mm", "proj", "diag", "s2d", "lp", "picked", "u", "u_first", "u_inverse", "u_counts", "pooled"]
    report = _compile(tmp_path, nodes, [x, y], outputs, [w, rois, three, zero, axis0])
    assert report.validation["oracle"] == "onnxruntime", report.warnings
    cases, worst = _max_abs(report)
    assert cases == 2 and worst < 1e-4, worst


def test_compile_opset28_graph(tmp_path, opset28):
    """Opset 24-28 definitions: CumProd (exclusive, reverse), SpaceToDepth mode CRD, Mod with fmod=0 on
    floats, BitShift of a signed type (arithmetic right shift, out-of-range amounts), Einsum, ReverseSequence.
    (Not SwiGLU: onnxruntime 1.32 cannot run SwiGLU-28, whose body's Swish-24 it does not expand; its node
    tests and tests/test_opmap.py check it.)"""
    x = _vi("x", T.FLOAT, ["n", 4, 4, 6])
    b = _vi("b", T.FLOAT, ["n", 4, 4, 6])
    i = _vi("i", T.INT32, ["n", 5])
    s = _vi("s", T.FLOAT, ["t", 4, 3])
    lens = onnx.numpy_helper.from_array(np.array([4, 1, 3, 2], np.int64), "lens")
    axis = onnx.numpy_helper.from_array(np.array(-1, np.int64), "axis")
    amounts = onnx.numpy_helper.from_array(np.array([0, 3, 31, 32, -1], np.int32), "amounts")
    eleven = onnx.numpy_helper.from_array(np.array(11, np.int32), "eleven")
    nodes = [
        oh.make_node("CumProd", ["x", "axis"], ["cp"], exclusive=1, reverse=1),
        oh.make_node("SpaceToDepth", ["x"], ["s2d"], blocksize=2, mode="CRD"),
        oh.make_node("Mod", ["x", "b"], ["mod"], fmod=0),
        oh.make_node("Sub", ["i", "eleven"], ["signed"]),
        oh.make_node("BitShift", ["signed", "amounts"], ["right"], direction="RIGHT"),
        oh.make_node("BitShift", ["signed", "amounts"], ["left"], direction="LEFT"),
        oh.make_node("Einsum", ["x", "b"], ["e"], equation="nchw,nchw->nc"),
        oh.make_node("ReverseSequence", ["s", "lens"], ["rev"], time_axis=0, batch_axis=1),
    ]
    outputs = ["cp", "s2d", "mod", "e", "rev", "right", "left"]
    report = _compile(tmp_path, nodes, [x, b, i, s], outputs, [lens, axis, amounts, eleven], opset=28)
    assert report.validation["oracle"] == "onnxruntime", report.warnings
    cases, worst = _max_abs(report)
    assert cases == 2 and worst < 1e-4, worst
