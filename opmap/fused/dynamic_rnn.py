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

from opmap.attrs import text
from opmap.fused.record import FusedOp, define
from opmap.registry import register

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


def _gates(a: np.ndarray, hidden: int) -> np.ndarray:
    return np.concatenate([a[g * hidden:(g + 1) * hidden] for g in _TO_DYNAMIC_RNN_GATES])


@register("DynamicRNN", since=1, domain="mindspore")
def lower_dynamic_rnn(n):
    hidden = int(n.attr("hidden_size"))
    direction = text(n.attr("direction", "forward"))
    dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    w, r = n.const(1), n.const(2)
    b = n.const(3) if n.has(3) else None
    if w is None or r is None or (n.has(3) and b is None):
        n.fail("W, R and B must be constants (laid out for DynamicRNN)")
    f16 = n.ms_dtype(onnx.TensorProto.FLOAT16)
    x = n.call("ops.cast", n.x(0), f16)
    reverse = n.call("ops.ReverseV2", [0])
    zeros = None
    ys, hs, cs = [], [], []
    for d, name in enumerate(dirs):
        weight = np.concatenate([_gates(w[d], hidden), _gates(r[d], hidden)], axis=1).T  # (I + H, 4H)
        bias = _gates(b[d][:4 * hidden] + b[d][4 * hidden:], hidden) if b is not None else np.zeros(4 * hidden)
        weight = n.const_tensor(np.ascontiguousarray(weight).astype(np.float16), f"rnn_weight_{name}")
        bias = n.const_tensor(bias.astype(np.float16), f"rnn_bias_{name}")
        if not (n.has(4) and n.has(5)) and zeros is None:  # (1, batch, H) zeros at the run's batch
            zeros = n.call("ops.tile", n.call("ops.zeros_like", n.getitem(x, (slice(0, 1), slice(None),
                                                                               slice(0, 1)))), (1, 1, hidden))
        h0 = n.call("ops.cast", n.getitem(n.x(4), slice(d, d + 1)), f16) if n.has(4) else zeros
        c0 = n.call("ops.cast", n.getitem(n.x(5), slice(d, d + 1)), f16) if n.has(5) else zeros
        xd = n.call(reverse, x) if name == "reverse" else x
        y, h, c = n.call_n(n.call("ops.DynamicRNN"), 8, xd, weight, bias, None, h0, c0)[:3]
        ys.append(n.call(reverse, y) if name == "reverse" else y)
        hs.append(n.getitem(h, slice(-1, None)))
        cs.append(n.getitem(c, slice(-1, None)))
    f32 = n.ms_dtype(n.dtype(0))
    y = n.call("ops.cast", n.call("ops.stack", tuple(ys), 1), f32)  # (seq, dirs, batch, hidden)
    y_h = n.call("ops.cast", n.call("ops.concat", tuple(hs), 0) if len(hs) > 1 else hs[0], f32)
    y_c = n.call("ops.cast", n.call("ops.concat", tuple(cs), 0) if len(cs) > 1 else cs[0], f32)
    return (y, y_h, y_c)[: max(1, n.n_outputs)]
