"""refine-shapes: static dims proved by onnxruntime's symbolic shape inference (a -1 head count)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import graphconv
import passes


def _heads_behind_minus_one() -> onnx.ModelProto:
    """x (batch, seq, 64) @ w -> Reshape to Concat(Shape(x)[0:2], [-1, 16]) -> Transpose: 4 heads, which onnx's
    shape inference cannot see through the -1."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["x"], ["bs"], start=0, end=2),
        helper.make_node("Concat", ["bs", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["y"], perm=[0, 2, 1, 3]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.eye(64, dtype=np.float32), "w"),
                           numpy_helper.from_array(np.array([-1, 16], np.int64), "tail")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]),
                                             data_prop=True)


def test_head_count_behind_minus_one_becomes_static():
    model = ir.from_proto(_heads_behind_minus_one())
    heads = next(n for n in model.graph if n.op_type == "Reshape").outputs[0]
    assert not isinstance(heads.shape[2], int)  # onnx's inference leaves it open
    counts = passes.PassManager("refine-shapes").run(model)
    assert counts["refine-shapes"] >= 1
    assert list(heads.shape)[2:] == [4, 16]
    y = model.graph.outputs[0]
    assert y.shape is None or y.shape[1] == 4
    # symbolic dims stay symbolic: batch and seq are not turned into numbers
    assert not isinstance(heads.shape[0], int) and not isinstance(heads.shape[1], int)


def test_torchscript_transformers_llama_fuses_attention(export_cache, tmp_path):
    """transformers' Llama through the TorchScript exporter reshapes q/k/v with -1 heads: attention fuses
    only with the refined dims, and the compile verifies."""
    report = graphconv.compile(export_cache("hf-llama", 17, "torchscript"), tmp_path / "m.mindir")
    assert report.status == "verified"
    assert report.fusions["refine-shapes"] > 0
    assert report.census.get("FlashAttentionScore") == 2
    off = graphconv.compile(export_cache("hf-llama", 17, "torchscript"), tmp_path / "n.mindir",
                            disable_passes=("refine-shapes",))
    assert off.census.get("FlashAttentionScore", 0) == 0  # the refinement is what makes the difference
