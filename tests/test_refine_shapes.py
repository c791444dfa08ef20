"""refine-shapes: static dims proved by onnxruntime's symbolic shape inference (a -1 head count)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
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


def _torchscript_style_heads(other_batch: bool = False) -> onnx.ModelProto:
    """TorchScript's spelling: h = Reshape(x @ w, Concat(Shape(x)[0:2], [64])), then Reshape(h, Concat(
    Unsqueeze(Gather(Shape(x), 0)), Unsqueeze(Gather(Shape(x), 1)), [-1], [16])), Transpose, Mul by a scale.
    With `other_batch` the target's first piece comes from another input's Shape: nothing is provable."""
    first = "z" if other_batch else "x"
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Shape", [first], ["fs"]),
        helper.make_node("Slice", ["xs", "zero", "two"], ["bs"]),
        helper.make_node("Concat", ["bs", "width"], ["flat"], axis=0),
        helper.make_node("Reshape", ["mm", "flat"], ["h"]),
        helper.make_node("Gather", ["fs", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["xs", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Unsqueeze", ["s", "zero"], ["s1"]),
        helper.make_node("Concat", ["b1", "s1", "minus_one", "d"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["t", "scale"], ["y"]),
    ]
    ints = {"zero": [0], "two": [2], "width": [64], "minus_one": [-1], "d": [16]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    inits += [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(1, np.int64), "i1"),
              numpy_helper.from_array(np.eye(64, dtype=np.float32), "w"),
              numpy_helper.from_array(np.array(0.25, np.float32), "scale")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64]),
              helper.make_tensor_value_info("z", TensorProto.FLOAT, ["other", "seq"])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]),
                                             data_prop=True)


def test_minus_one_solved_from_the_shape_arithmetic(monkeypatch):
    """Where onnxruntime's symbolic inference gives up (simulated: it proves nothing), the -1 is solved from
    the Shape pieces themselves and carried through the Transpose and the scaling."""
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    model = ir.from_proto(_torchscript_style_heads())
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert not isinstance(values["heads"].shape[2], int)
    passes.PassManager("refine-shapes").run(model)
    assert values["heads"].shape[2] == 4 and values["t"].shape[1] == 4 and values["y"].shape[1] == 4
    assert not isinstance(values["heads"].shape[0], int)  # batch stays symbolic


def test_minus_one_stays_open_when_a_factor_is_not_the_inputs(monkeypatch):
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    model = ir.from_proto(_torchscript_style_heads(other_batch=True))
    heads = next(v for n in model.graph for v in n.outputs if v.name == "heads")
    passes.PassManager("refine-shapes").run(model)
    assert not isinstance(heads.shape[2], int)


@pytest.mark.parametrize("name", ["hf/bert", pytest.param("hf/distilbert", marks=pytest.mark.slow),
                                  pytest.param("hf/clip_text", marks=pytest.mark.slow)])
def test_torchscript_transformers_encoders_fuse_attention(name, export_cache, tmp_path):
    """transformers' BERT through TorchScript: onnxruntime's shape inference stops at the position-id slice
    (Min(128, seq)), the head count hides behind Reshape(q, [b, s, -1, 16]); now proved, attention fuses."""
    pytest.importorskip("transformers")
    report = graphconv.compile(export_cache(name, 17, "torchscript"), tmp_path / "m.mindir")
    assert report.status == "verified"
    assert report.coverage["attention"] == {"candidates": 2, "fused": 2, "refused": {}, "items": []}
    assert report.census.get("FlashAttentionScore") == 2
