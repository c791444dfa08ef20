"""mindspore::DynamicRNN(X, W, R, B, initial_h, initial_c; hidden_size, direction) -> (Y, Y_h, Y_c): an ONNX LSTM
over a dynamic sequence as MindSpore's `DynamicRNN` primitive (Ascend only), one call per direction.

The reference body is the ONNX LSTM itself (default activations, no clip, peepholes or sequence_lens:
passes/fuse_lstm.py), so the cpu twin lowers it as opmap/rnn.py does (MindSpore's CPU LSTM primitive).
Where the ascend lowering comes from: MindSpore's own `nn.LSTM` on Ascend (mindspore/nn/layer/rnns.py,
_DynamicLSTMAscend, mindspore 2.10): DynamicRNN() with its defaults (cell_type LSTM, UNIDIRECTIONAL, tanh,
forget_bias 0, time_major), x, w, b, h0, c0 in float16, w = the (4H, I) input and (4H, H) recurrent weights
side by side, transposed to (I + H, 4H), gates in the order i, j (the cell candidate), f, o, b = b_ih + b_hh in
that order; its h and c outputs hold every step, the last one is the final state; a bidirectional layer is a
second call on the time-reversed sequence (ReverseV2), its output reversed back. DynamicRNN's docstring gives
the same equations, shapes and float16 inputs. ONNX's gates are i, o, f, c.

DynamicRNN computes in float16 (ascend_compute): the ascend-precision body rounds X, W, R, B, initial_h and
initial_c to float16 before the same LSTM (the per-step rounding inside the kernel is not modelled).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opmap.fused.record import FusedOp, define
from opmap.registry import register
from opmap.rnn import lstm_directions, lstm_weights

_INPUTS = ("X", "W", "R", "B", "initial_h", "initial_c")
# ONNX's gate blocks (i, o, f, c) in DynamicRNN's order (i, j = c, f, o)
_TO_DYNAMIC_RNN_GATES = (0, 3, 2, 1)


def _lstm(inputs: list[str]) -> onnx.NodeProto:
    node = helper.make_node("LSTM", [*inputs[:4], "", *inputs[4:]], ["Y", "Y_h", "Y_c"])
    node.attribute.append(helper.make_attribute_ref("hidden_size", onnx.AttributeProto.INT))
    node.attribute.append(helper.make_attribute_ref("direction", onnx.AttributeProto.STRING))
    return node


def _body(opset: int) -> list[onnx.NodeProto]:
    return [_lstm(list(_INPUTS))]


def _ascend_body(opset: int) -> list[onnx.NodeProto]:
    rounded = []
    for name in _INPUTS:
        rounded += [helper.make_node("Cast", [name], [f"{name}16"], to=onnx.TensorProto.FLOAT16),
                    helper.make_node("Cast", [f"{name}16"], [f"{name}r"], to=onnx.TensorProto.FLOAT)]
    return [*rounded, _lstm([f"{n}r" for n in _INPUTS])]


DYNAMIC_RNN = define(FusedOp(
    name="DynamicRNN", inputs=_INPUTS, outputs=("Y", "Y_h", "Y_c"), attributes=("hidden_size", "direction"),
    body=_body, ascend_body=_ascend_body, primitive="DynamicRNN", doc=__doc__, producer="fuse-lstm",
    family="recurrent", ascend_compute="fp16",
    likely_causes="the gate order (ONNX i, o, f, c; DynamicRNN i, j, f, o) or float16 over a long sequence"))


@register("DynamicRNN", since=1, domain="mindspore")
def lower_dynamic_rnn(n):
    """One DynamicRNN per direction (opmap.rnn.lstm_directions), in fp16, the final h and c its last step's."""
    weights = lstm_weights(n, _TO_DYNAMIC_RNN_GATES, "W, R and B must be constants (laid out for DynamicRNN)")
    f16 = n.ms_dtype(onnx.TensorProto.FLOAT16)

    def run(x, h0, c0, d, name):
        w, r, bias = weights[d]
        weight = np.ascontiguousarray(np.concatenate([w, r], axis=1).T).astype(np.float16)  # (I + H, 4H)
        y, h, c = n.call_n(n.call("ops.DynamicRNN"), 8, x, n.const_tensor(weight, f"rnn_weight_{name}"),
                           n.const_tensor(bias.astype(np.float16), f"rnn_bias_{name}"), None, h0, c0)[:3]
        return y, n.getitem(h, slice(-1, None)), n.getitem(c, slice(-1, None))

    outputs = lstm_directions(n, n.call("ops.cast", n.x(0), f16), (4, 5), run, state_dtype=f16)
    f32 = n.ms_dtype(n.dtype(0))
    return tuple(n.call("ops.cast", v, f32) for v in outputs)[: max(1, n.n_outputs)]
