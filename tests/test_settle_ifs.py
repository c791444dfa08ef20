"""settle-ifs (passes/settle_ifs.py): an If whose branches return different ranks becomes the one branch the
graph's types allow, on a hand-built graph and on a TorchScript export shaped like silero-vad's."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper, numpy_helper

import graphconv
from fusion_utils import fuse
from graphconv.errors import UnsupportedError

C = 8


def _squeeze_then(consumer: str) -> onnx.ModelProto:
    """x [batch, C, frames]: `if frames == 1: x = x.squeeze(2)`, then an LSTM cell's rank test (`if x.dim() != 2:
    x = x.unsqueeze(0)`), then `consumer`: Gemm (rank 2 only) or ReduceSum (any rank)."""
    m = helper.make_node
    squeeze = helper.make_graph([m("Squeeze", ["x", "ax2"], ["sq"])], "then", [],
                                [helper.make_tensor_value_info("sq", T.FLOAT, ["batch", C])])
    keep = helper.make_graph([m("Identity", ["x"], ["same"])], "else", [],
                             [helper.make_tensor_value_info("same", T.FLOAT, ["batch", C, "frames"])])
    lift = helper.make_graph([m("Unsqueeze", ["y", "ax0"], ["up"])], "then", [],
                             [helper.make_tensor_value_info("up", T.FLOAT, None)])
    as_is = helper.make_graph([m("Identity", ["y"], ["y2"])], "else", [],
                              [helper.make_tensor_value_info("y2", T.FLOAT, None)])
    tail = ([m("Gemm", ["z", "w"], ["out"])] if consumer == "Gemm"
            else [m("ReduceSum", ["z"], ["out"], keepdims=0)])
    nodes = [m("Shape", ["x"], ["s"]), m("Gather", ["s", "i2"], ["frames"]), m("Equal", ["frames", "one"], ["is1"]),
             m("If", ["is1"], ["y"], then_branch=squeeze, else_branch=keep),
             m("Shape", ["y"], ["sy"]), m("Size", ["sy"], ["rank"]), m("Equal", ["rank", "two"], ["batched"]),
             m("Not", ["batched"], ["single"]),
             m("If", ["single"], ["z"], then_branch=lift, else_branch=as_is), *tail]
    inits = [numpy_helper.from_array(np.array([2], np.int64), "ax2"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0"),
             numpy_helper.from_array(np.array(2, np.int64), "i2"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array(2, np.int64), "two"),
             numpy_helper.from_array(np.random.default_rng(0).standard_normal((C, 3)).astype(np.float32), "w")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, ["batch", C, "frames"])],
                          [helper.make_tensor_value_info("out", T.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _ifs(graph: onnx.GraphProto) -> int:
    return sum(1 + sum(_ifs(a.g) for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
               for n in graph.node if n.op_type == "If")


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_branch_the_types_allow_is_kept():
    """Squeezing keeps the Gemm's input at rank 2; keeping the frames gives it rank 4 after the rank test's
    Unsqueeze, which Gemm's types refuse (onnxruntime fails the same way on frames != 1). One If settled, the
    rank test folded with it: no If is left, and the result equals onnxruntime's on the original graph at two
    batch sizes."""
    original = _squeeze_then("Gemm")
    count, settled = fuse(original, "settle-ifs")
    assert count == 1
    assert _ifs(original.graph) == 2 and _ifs(settled.graph) == 0
    for batch in (3, 5):
        x = np.random.default_rng(batch).standard_normal((batch, C, 1)).astype(np.float32)
        np.testing.assert_allclose(_run(settled, x), _run(original, x), rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="Gemm"):  # the branch that was dropped: the original model cannot run it
        _run(original, np.ones((3, C, 4), np.float32))


def test_an_if_both_of_whose_branches_type_check_stays():
    """A ReduceSum to a scalar takes either rank: nothing tells which branch the model runs, so both stay."""
    original = _squeeze_then("ReduceSum")
    count, settled = fuse(original, "settle-ifs")
    assert count == 0
    assert _ifs(settled.graph) == 2


def _torchscript_vad(path):
    """silero-vad's structure, exported by the TorchScript exporter as silero-vad's own file was: one decoder
    per sampling rate (an If on `sr`), each squeezing its frames axis when it is 1 (an If whose branches return
    ranks 2 and 3) before an LSTM cell."""
    torch = pytest.importorskip("torch")

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTMCell(C, C)
            self.out = torch.nn.Linear(C, 1)

        def forward(self, x, h, c):
            if x.shape[-1] == 1:
                x = x.squeeze(-1)
            h2, c2 = self.rnn(x, (h, c))
            return torch.sigmoid(self.out(h2)), h2, c2

    class Vad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.at16k, self.at8k = Decoder(), Decoder()

        def forward(self, x, h, c, sr):
            if int(sr) == 16000:
                return self.at16k(x, h, c)
            return self.at8k(x, h, c)

    torch.manual_seed(0)
    batch = {0: "batch"}
    torch.onnx.export(torch.jit.script(Vad().eval()), (torch.randn(2, C, 1), torch.zeros(2, C), torch.zeros(2, C),
                                                       torch.tensor(16000)),
                      str(path), input_names=["x", "h", "c", "sr"], output_names=["p", "h2", "c2"],
                      dynamic_axes={"x": batch, "h": batch, "c": batch}, dynamo=False, opset_version=17)


@pytest.mark.filterwarnings("ignore")
def test_a_torchscript_export_with_rank_changing_ifs_compiles_and_verifies(tmp_path):
    """Both decoders' squeeze Ifs sit inside the `sr` If, where onnxruntime's run cannot give their ranks:
    the lowering refused the LSTM's Unsqueeze before (rank unknown). Settled, the network verifies against
    onnxruntime, and the report says which branch each If kept. (The LSTM weights folded inside the `sr` If's
    branches are the branches' own initializers: literals of the network, not weights of the model, which
    emission once looked for among the model's.)"""
    path = tmp_path / "vad.onnx"
    _torchscript_vad(path)
    report = graphconv.compile(path, tmp_path / "vad.mindir", target="cpu")
    assert report.status == "verified"
    assert report.fusions["settle-ifs"] == 2
    notes = next(s for s in report.stages if s.name == "passes").detail["notes"]["settle-ifs"]
    assert len(notes) == 2 and all("keeps its then branch" in n for n in notes), notes
    for case in report.validation["cases"]:
        for out in case["outputs"]:
            assert out["ok"] and out["max_abs"] < 1e-5, out
    # The 8 kHz decoder is compiled but not run: the report says so
    assert "input 'sr' is 16000 in every reference case (the graph compares it with 16000): what the model " \
           "computes at another value of it is compiled but not verified (--inputs with one verifies it)" \
           in report.warnings, report.warnings
    with pytest.raises(UnsupportedError, match="Unsqueeze.*the rank of input 0 is unknown"):
        graphconv.compile(path, tmp_path / "plain.mindir", target="cpu", disable_passes=("settle-ifs",))
