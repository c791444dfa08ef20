"""canonicalize: each rewrite fires where it should, never where it would change the numbers, and the
canonical graph equals the original (onnxruntime on both)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusion_utils import assert_same_numerics, fuse

F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _graph(nodes, inits=(), x_type=F, y_type=F, x_shape=("n", 4), y_shape=("n", 4), opset=18):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                          [helper.make_tensor_value_info("y", y_type, list(y_shape))],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


CASES = {
    "div-one": (_graph([helper.make_node("Div", ["one", "x"], ["y"])], {"one": np.float32(1.0)}),
                1, "Reciprocal", "Div"),
    "pow-two": (_graph([helper.make_node("Pow", ["x", "two"], ["y"])], {"two": np.float32(2.0)}),
                1, "Mul", "Pow"),
    "cast-round-trip": (_graph([helper.make_node("Cast", ["x"], ["w"], to=F),
                                helper.make_node("Cast", ["w"], ["c"], to=F16),
                                helper.make_node("Relu", ["c"], ["y"])], x_type=F16, y_type=F16),
                        1, None, "Cast"),
    "gemm": (_graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"])],
                    {"w": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
                     "b": np.arange(3, dtype=np.float32)}, y_shape=("n", 3)), 1, "MatMul", "Gemm"),
    "shape-arithmetic": (_graph([helper.make_node("Shape", ["c"], ["s"]),
                                 helper.make_node("Reshape", ["x", "s"], ["y"])],
                                {"c": np.zeros((2, 2), np.float32)}, x_shape=(4,), y_shape=(2, 2)),
                         1, "Reshape", "Shape"),
}


@pytest.mark.parametrize("name", CASES)
def test_rewrites_fire_and_keep_numerics(name):
    model, expected, present, gone = CASES[name]
    count, out = fuse(model, "canonicalize")
    assert count >= expected
    ops = [n.op_type for n in out.graph.node]
    assert gone not in ops
    if present:
        assert present in ops
    assert_same_numerics(model, out, 0.0 if name != "gemm" else 1e-6, 0.0 if name != "gemm" else 1e-6)


NOT_REWRITTEN = {
    "pow-three": (_graph([helper.make_node("Pow", ["x", "p"], ["y"])], {"p": np.float32(3.0)}), "Pow"),
    "div-two": (_graph([helper.make_node("Div", ["two", "x"], ["y"])], {"two": np.float32(2.0)}), "Div"),
    "lossy-cast-pair": (_graph([helper.make_node("Cast", ["x"], ["h"], to=F16),
                                helper.make_node("Cast", ["h"], ["y"], to=F)]), "Cast"),
    "gemm-transposed": (_graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                               {"w": np.ones((3, 4), np.float32), "b": np.ones(3, np.float32)},
                               y_shape=("n", 3)), "Gemm"),
    "pow-broadcasting-up": (_graph([helper.make_node("Pow", ["x", "two"], ["y"])],
                                   {"two": np.full((2, 1, 1), 2.0, np.float32)}, y_shape=(2, "n", 4)), "Pow"),
}


@pytest.mark.parametrize("name", NOT_REWRITTEN)
def test_inexact_rewrites_are_refused(name):
    model, kept = NOT_REWRITTEN[name]
    _, out = fuse(model, "canonicalize")
    assert kept in [n.op_type for n in out.graph.node]
    assert_same_numerics(model, out, 0.0, 0.0)


def test_an_if_branch_returning_an_outer_value_keeps_its_identity(tmp_path):
    """silero-vad's If: a branch whose output is Identity(an outer value). onnx-ir 1.1's identity elimination
    removed it and left the branch an output no node of it produced (invalid ONNX; the compile then failed with
    "used before it is defined"). The other branch folds a constant into an initializer of its own, which
    the lowering reads as a constant (Slice axes). The compile verifies at both conditions."""
    import graphconv

    def branch(name, nodes, inits=()):
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", F, ["n", 4])],
                                 list(inits))

    keep = branch("keep", [helper.make_node("Identity", ["x"], ["keep_out"])])
    rev = branch("rev", [helper.make_node("Constant", [], ["axis"], value=numpy_helper.from_array(
        np.array([1], np.int64))), helper.make_node("Add", ["axis", "zero"], ["axes"]),
        helper.make_node("Slice", ["x", "minus_one", "very_negative", "axes", "minus_one"], ["rev_out"])],
        [numpy_helper.from_array(np.array([0], np.int64), "zero"),
         numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
         numpy_helper.from_array(np.array([-2**62], np.int64), "very_negative")])
    g = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0), helper.make_node("Less", ["total", "zero_f"],
                                                                                       ["negative"]),
         helper.make_node("If", ["negative"], ["y"], then_branch=rev, else_branch=keep)], "g",
        [helper.make_tensor_value_info("x", F, ["n", 4])], [helper.make_tensor_value_info("y", F, ["n", 4])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero_f")])
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    count, canonical = fuse(onnx.load(path), "canonicalize")
    (if_node,) = [n for n in canonical.graph.node if n.op_type == "If"]
    else_branch = next(a.g for a in if_node.attribute if a.name == "else_branch")
    assert [n.op_type for n in else_branch.node] == ["Identity"]
    report = graphconv.compile(path, tmp_path / "if.mindir", target="cpu", simplify=False)
    assert report.status == "verified", report.error
