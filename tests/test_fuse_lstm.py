"""fuse-lstm: an ONNX LSTM over a dynamic sequence -> mindspore::DynamicRNN, on hand-built graphs (the real
exports: tests/test_compile.py's PyTorch LSTM, and benchmarks/wild_onnx.py's ddddocr and silero-vad files).
The fused graph equals the unfused one in onnxruntime (the body is the LSTM itself) at two sequence lengths;
its ascend-precision body stays within fp16 tolerance; what does not fuse says why."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP, helper as oh, numpy_helper

import opmap.fused
from fusion_utils import fuse, fused_nodes
from graphconv.pipeline import analyze_fusions

H, I = 3, 4  # noqa: E741


def _lstm(seq="seq", bias=True, states=False, **attrs) -> onnx.ModelProto:
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    g = np.random.default_rng(0)
    inits = [numpy_helper.from_array(g.standard_normal((dirs, 4 * H, I)).astype(np.float32), "W"),
             numpy_helper.from_array(g.standard_normal((dirs, 4 * H, H)).astype(np.float32), "R")]
    ins = ["x", "W", "R"]
    if bias:
        inits.append(numpy_helper.from_array(g.standard_normal((dirs, 8 * H)).astype(np.float32), "B"))
        ins.append("B")
    inputs = [oh.make_tensor_value_info("x", TP.FLOAT, [seq, "batch", I])]
    if states:
        ins = ["x", "W", "R", "B" if bias else "", "", "h0", "c0"]
        inputs += [oh.make_tensor_value_info(n, TP.FLOAT, [dirs, "batch", H]) for n in ("h0", "c0")]
    nodes = [oh.make_node("LSTM", ins, ["y", "yh", "yc"], name="lstm", hidden_size=H, **attrs)]
    graph = oh.make_graph(nodes, "g", inputs, [onnx.ValueInfoProto(name=o) for o in ("y", "yh", "yc")], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)])
    inferred = onnx.shape_inference.infer_shapes(model)
    info = {v.name: v for v in inferred.graph.value_info}
    for o in model.graph.output:
        o.CopyFrom(info[o.name])
    return model


def _feeds(model, seq, batch):
    g = np.random.default_rng(seq)
    dirs = 2 if any(a.s == b"bidirectional" for a in model.graph.node[0].attribute) else 1
    feeds = {"x": g.standard_normal((seq, batch, I)).astype(np.float32)}
    for name in ("h0", "c0"):
        if any(i.name == name for i in model.graph.input):
            feeds[name] = g.standard_normal((dirs, batch, H)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("attrs,bias,states", [({"direction": "bidirectional"}, True, False),
                                               ({"direction": "reverse"}, False, True),
                                               ({}, True, True)])
def test_fused_equals_unfused_at_two_lengths(attrs, bias, states):
    model = _lstm(bias=bias, states=states, **attrs)
    count, fused = fuse(model, "fuse-lstm")
    assert count == 1 and len(fused_nodes(fused, "DynamicRNN")) == 1
    assert not [n for n in fused.graph.node if n.op_type == "LSTM"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    fp16 = ort.InferenceSession(opmap.fused.ascend_precision_variant(fused).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    for seq, batch in ((5, 2), (9, 3)):
        feeds = _feeds(model, seq, batch)
        for a, b, c in zip(got.run(None, feeds), want.run(None, feeds), fp16.run(None, feeds)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(c, b, rtol=1e-2, atol=1e-2)  # inputs rounded to fp16
            assert np.abs(c - b).max() > 0  # (the rounding is really there)


def test_a_static_sequence_is_no_candidate(tmp_path):
    """Unrolled by opmap/rnn.py on both targets."""
    path = tmp_path / "m.onnx"
    onnx.save(_lstm(seq=6), path)
    assert analyze_fusions(path, simplify=False).coverage.get("recurrent", {}).get("candidates", 0) == 0


@pytest.mark.parametrize("attrs,reason", [
    ({"clip": 1.0}, "clip or input_forget"),
    ({"activations": ["Sigmoid", "Tanh", "Relu"]}, "activations ['Sigmoid', 'Tanh', 'Relu']"),
])
def test_what_does_not_fuse_says_why(attrs, reason, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_lstm(**attrs), path)
    cov = analyze_fusions(path, simplify=False).coverage["recurrent"]
    assert (cov["candidates"], cov["fused"]) == (1, 0), cov
    (item,) = cov["items"]
    assert item["pass"] == "fuse-lstm" and item["reason"].startswith(reason), item
