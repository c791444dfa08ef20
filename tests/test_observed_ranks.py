"""Ranks onnx's shape inference cannot give, taken from onnxruntime's run (graphconv/verify/observed_ranks.py):
paddle2onnx's OCR recognizer reshapes to a shape its graph computes, and the Transpose after it was refused."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T, helper, numpy_helper

import graphconv
from graphconv.verify import observed_ranks, reference


def _computed_reshape() -> onnx.ModelProto:
    """y = ReduceSum(Transpose(Reshape(x, Compress(Shape(x), Shape(x) > 0)))): the shape's length is known only
    at run time, so onnx's inference gives the Reshape and the Transpose no rank."""
    m = helper.make_node
    nodes = [m("Shape", ["x"], ["s"]), m("Greater", ["s", "zero"], ["pos"]),
             m("Compress", ["s", "pos"], ["si"], axis=0),
             m("Reshape", ["x", "si"], ["r"]), m("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
             m("ReduceSum", ["t", "ax"], ["y"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, ["b", "n", 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["b", "n"])],
                          [numpy_helper.from_array(np.array(0, np.int64), "zero"),
                           numpy_helper.from_array(np.array([2], np.int64), "ax")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_the_ranks_come_from_onnxruntimes_run():
    model = onnx.shape_inference.infer_shapes(_computed_reshape(), data_prop=True)
    assert observed_ranks.unknown_rank_values(model) == ["r", "t"]
    completed, given = observed_ranks.complete(model, reference.make_cases(model), reference.Oracle)
    assert given == ["r", "t"]
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in completed.graph.value_info}
    assert ranks["r"] == 3 and ranks["t"] == 3
    dims = [d for v in completed.graph.value_info if v.name in given for d in v.type.tensor_type.shape.dim]
    assert all(d.HasField("dim_param") for d in dims)  # (sizes seen at two inputs say nothing of a third)


def test_a_transpose_after_a_computed_reshape_compiles_and_verifies(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_computed_reshape(), path)
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu")  # (before: "the rank of input 0 is unknown")
    assert report.status == "verified"
    assert any("left the rank of 2 values unknown ('r', 't')" in w for w in report.warnings)
