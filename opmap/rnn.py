"""Recurrent layers: RNN, GRU, LSTM (opsets 7 and 14), unrolled over a static sequence length (the batch may be
dynamic); an LSTM over a dynamic sequence runs MindSpore's LSTM primitive (`_lstm_primitive`, CPU only).

The ONNX equations, one statement group per time step (the input projection of all steps is one matmul up
front): gates in ONNX's order (GRU z, r, h; LSTM i, o, f, c), bias = Wb + Rb, GRU's linear_before_reset, LSTM
peepholes (P = [Pi, Po, Pf]), clip applied to the pre-activations, forward / reverse / bidirectional, layout 0
(seq, batch, feature) or 1 (batch, seq, feature). Activations: Sigmoid, Tanh (as 2 * sigmoid(2x) - 1: ops.tanh
is off by up to 1e-4 on CPU), Relu, HardSigmoid, LeakyRelu, Affine, ScaledTanh, Softsign, Softplus, Elu,
ThresholdedRelu, with their alpha / beta. sequence_lens: steps past a batch entry's length keep its state and
output 0 (forward direction only). LSTM input_forget=1 is refused.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register

DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_ALPHA = {"LeakyRelu": 0.01, "ThresholdedRelu": 1.0, "Elu": 1.0, "HardSigmoid": 0.2, "Affine": 1.0,
          "ScaledTanh": 1.0}
_BETA = {"HardSigmoid": 0.5, "Affine": 0.0, "ScaledTanh": 1.0}


def _activation(n, name: str, alpha, beta):
    a = _ALPHA.get(name) if alpha is None else alpha
    b = _BETA.get(name) if beta is None else beta

    def tanh(x):
        return n.binop("-", n.binop("*", 2, n.call("ops.sigmoid", n.binop("*", 2, x))), 1)

    forms = {
        "Sigmoid": lambda x: n.call("ops.sigmoid", x),
        "Tanh": tanh,
        "Relu": lambda x: n.call("ops.relu", x),
        "HardSigmoid": lambda x: n.call("ops.clamp", n.binop("+", n.binop("*", a, x), b), 0.0, 1.0),
        "LeakyRelu": lambda x: n.call("ops.where", n.binop(">=", x, 0), x, n.binop("*", a, x)),
        "Affine": lambda x: n.binop("+", n.binop("*", a, x), b),
        "ScaledTanh": lambda x: n.binop("*", a, n.binop(
            "-", n.binop("*", 2, n.call("ops.sigmoid", n.binop("*", 2 * b, x))), 1)),
        "Softsign": lambda x: n.binop("/", x, n.binop("+", 1, n.call("ops.abs", x))),
        "Softplus": lambda x: n.call("ops.softplus", x),
        "Elu": lambda x: n.call("ops.where", n.binop(">=", x, 0), x,
                                n.binop("*", a, n.binop("-", n.call("ops.exp", x), 1))),
        "ThresholdedRelu": lambda x: n.call("ops.where", n.binop(">", x, a), x, n.call("ops.zeros_like", x)),
    }
    if name not in forms:
        n.fail(f"activation {name!r} is not supported")
    return forms[name]


def _recurrent(n, kind: str):
    xs = n.shape(0)
    layout = int(n.attr("layout", 0))
    if xs is None or len(xs) != 3:
        n.fail("the input must be 3-D with a known rank")
    seq, batch = (xs[1], xs[0]) if layout else (xs[0], xs[1])
    if not isinstance(seq, int):
        if kind == "LSTM":
            return _lstm_primitive(n, layout)
        n.fail("the sequence length must be static (the sequence is unrolled)")
    hidden = int(n.attr("hidden_size"))
    dirs = directions(n)
    gates = _GATES[kind]
    acts = [text(a) for a in (n.attr("activations") or DEFAULT_ACTIVATIONS[kind] * len(dirs))]
    alphas = list(n.attr("activation_alpha") or [])
    betas = list(n.attr("activation_beta") or [])
    per_dir = len(DEFAULT_ACTIVATIONS[kind])
    clip = n.attr("clip", None)
    if kind == "LSTM" and n.attr("input_forget", 0):
        n.fail("input_forget=1 is not supported")
    if kind == "GRU":
        lbr = bool(n.attr("linear_before_reset", 0))
    x = n.x(0)
    if layout:
        x = n.call("ops.transpose", x, (1, 0, 2))
    seq_lens = n.x(4) if n.has(4) else None
    if seq_lens is not None and "reverse" in dirs:
        n.fail("sequence_lens with a reverse direction is not supported")
    if seq_lens is not None:
        seq_lens = n.call("ops.cast", seq_lens, n.ms_dtype(ir.DataType.INT64))
    if isinstance(batch, int):
        zeros = n.const_tensor(np.zeros((batch, hidden), n.dtype(0).numpy()), "zeros_h")
    else:  # a dynamic batch: zeros at the run's batch
        zeros = n.getitem(_state_zeros(n, x, hidden), 0)
    ys, hs, cs = [], [], []
    for d, name in enumerate(dirs):
        fs = []
        for k in range(per_dir):
            i = d * per_dir + k
            fs.append(_activation(n, acts[i], alphas[i] if i < len(alphas) else None,
                                  betas[i] if i < len(betas) else None))
        w_t = n.call("ops.transpose", n.getitem(n.x(1), d), (1, 0))
        r_t = n.call("ops.transpose", n.getitem(n.x(2), d), (1, 0))
        xw = n.call("ops.matmul", x, w_t)
        wb = rb = None
        if n.has(3):
            wb = n.getitem(n.x(3), (d, slice(None, gates * hidden)))
            rb = n.getitem(n.x(3), (d, slice(gates * hidden, None)))
            xw = n.binop("+", xw, wb)
        h = n.getitem(n.x(5), d) if n.has(5) else zeros
        c = None
        if kind == "LSTM":
            c = n.getitem(n.x(6), d) if n.has(6) else zeros
            peep = [n.getitem(n.x(7), (d, slice(g * hidden, (g + 1) * hidden))) for g in range(3)] \
                if n.has(7) else None

        def clipped(e):
            return n.call("ops.clamp", e, -float(clip), float(clip)) if clip is not None else e

        def gate(pre, g):
            return n.getitem(pre, (slice(None), slice(g * hidden, (g + 1) * hidden)))

        def plus_rb(e):
            return n.binop("+", e, rb) if rb is not None else e

        steps = range(seq) if name == "forward" else range(seq - 1, -1, -1)
        outs = [None] * seq
        for t in steps:
            xt = n.getitem(xw, t)
            hr = n.call("ops.matmul", h, r_t)
            if kind == "RNN":
                h_new = fs[0](clipped(plus_rb(n.binop("+", xt, hr))))
            elif kind == "GRU":
                hr = plus_rb(hr)
                z = fs[0](clipped(n.binop("+", gate(xt, 0), gate(hr, 0))))
                r = fs[0](clipped(n.binop("+", gate(xt, 1), gate(hr, 1))))
                if lbr:
                    hh = n.binop("+", gate(xt, 2), n.binop("*", r, gate(hr, 2)))
                else:
                    r_h = n.getitem(r_t, (slice(None), slice(2 * hidden, None)))
                    rh = n.call("ops.matmul", n.binop("*", r, h), r_h)
                    hh = n.binop("+", gate(xt, 2), rh)
                    if rb is not None:
                        hh = n.binop("+", hh, n.getitem(rb, slice(2 * hidden, None)))
                hh = fs[1](clipped(hh))
                h_new = n.binop("+", n.binop("*", n.binop("-", 1, z), hh), n.binop("*", z, h))
            else:
                pre = plus_rb(n.binop("+", xt, hr))
                ig, og, fg, cg = (gate(pre, g) for g in range(4))
                if peep:
                    ig = n.binop("+", ig, n.binop("*", peep[0], c))
                    fg = n.binop("+", fg, n.binop("*", peep[2], c))
                i_ = fs[0](clipped(ig))
                f_ = fs[0](clipped(fg))
                g_ = fs[1](clipped(cg))
                c_new = n.binop("+", n.binop("*", f_, c), n.binop("*", i_, g_))
                if peep:
                    og = n.binop("+", og, n.binop("*", peep[1], c_new))
                o_ = fs[0](clipped(og))
                h_new = n.binop("*", o_, fs[2](c_new))
            if seq_lens is not None:
                live = n.call("ops.expand_dims", n.binop("<", t, seq_lens), 1)
                outs[t] = n.call("ops.where", live, h_new, zeros)
                h_new = n.call("ops.where", live, h_new, h)
                if kind == "LSTM":
                    c_new = n.call("ops.where", live, c_new, c)
            else:
                outs[t] = h_new
            h = h_new
            if kind == "LSTM":
                c = c_new
        ys.append(n.call("ops.stack", tuple(outs), 0))
        hs.append(h)
        cs.append(c)
    y = n.call("ops.stack", tuple(ys), 1)  # (seq, dirs, batch, hidden)
    y_h = n.call("ops.stack", tuple(hs), 0)
    y_c = n.call("ops.stack", tuple(cs), 0) if kind == "LSTM" else None
    if layout:
        y = n.call("ops.transpose", y, (2, 0, 1, 3))
        y_h = n.call("ops.transpose", y_h, (1, 0, 2))
        y_c = n.call("ops.transpose", y_c, (1, 0, 2)) if y_c is not None else None
    outputs = (y, y_h) if kind != "LSTM" else (y, y_h, y_c)
    return outputs[: max(1, n.n_outputs)]


def directions(n) -> list[str]:
    direction = text(n.attr("direction", "forward"))
    return ["forward", "reverse"] if direction == "bidirectional" else [direction]


def _state_zeros(n, x, hidden: int):
    """Zeros (1, batch, hidden) in time-major x's dtype, at the run's batch."""
    return n.call("ops.tile", n.call("ops.zeros_like", n.getitem(x, (slice(0, 1), slice(None), slice(0, 1)))),
                  (1, 1, hidden))


def lstm_weights(n, order: tuple[int, ...], refusal: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per direction of LSTM-like node n, (W, R, Wb + Rb) from its constant inputs 1, 2 and 3, their gate blocks
    (ONNX's i, o, f, c) put in `order`: a primitive's layout, made at compile time. B absent: zeros."""
    hidden = int(n.attr("hidden_size"))
    w, r = n.const(1), n.const(2)
    b = n.const(3) if n.has(3) else None
    if w is None or r is None or (n.has(3) and b is None):
        n.fail(refusal)

    def gates(a):
        return np.concatenate([a[g * hidden:(g + 1) * hidden] for g in order])

    return [(gates(w[d]), gates(r[d]), gates(b[d][:4 * hidden] + b[d][4 * hidden:]) if b is not None
             else np.zeros(4 * hidden, w.dtype)) for d in range(len(w))]


def lstm_directions(n, x, initial: tuple[int, int], run, state_dtype=None):
    """(y (seq, dirs, batch, H), y_h, y_c (dirs, batch, H)) of LSTM-like node n over time-major x, from
    `run(x, h0, c0, d, name)` -> (y, final h, final c) once per direction: the reverse one on the time-reversed x,
    its y reversed back. h0 and c0: the node's inputs `initial` (cast to `state_dtype` if given), else zeros."""
    hidden = int(n.attr("hidden_size"))
    reverse = n.call("ops.ReverseV2", [0])
    zeros = None if all(n.has(i) for i in initial) else _state_zeros(n, x, hidden)

    def state(i, d):
        if not n.has(i):
            return zeros
        s = n.getitem(n.x(i), slice(d, d + 1))
        return n.call("ops.cast", s, state_dtype) if state_dtype is not None else s

    ys, hs, cs = [], [], []
    for d, name in enumerate(directions(n)):
        y, h, c = run(n.call(reverse, x) if name == "reverse" else x, *(state(i, d) for i in initial), d, name)
        ys.append(n.call(reverse, y) if name == "reverse" else y)
        hs.append(h)
        cs.append(c)
    y = n.call("ops.stack", tuple(ys), 1)  # (seq, dirs, batch, hidden)
    y_h = n.call("ops.concat", tuple(hs), 0) if len(hs) > 1 else hs[0]
    y_c = n.call("ops.concat", tuple(cs), 0) if len(cs) > 1 else cs[0]
    return y, y_h, y_c


# ONNX's LSTM gate blocks (i, o, f, c) in the order of MindSpore's LSTM primitive (PyTorch's: i, f, c, o)
_TO_MINDSPORE_GATES = (0, 2, 3, 1)


def _lstm_primitive(n, layout: int):
    """An LSTM over a dynamic sequence: MindSpore's own `ops.LSTM` primitive, one unidirectional call per
    direction (lstm_directions), its weights laid out as `nn.LSTM` lays them out on CPU (mindspore/nn/layer/
    rnns.py, _DynamicLSTMCPUGPU: w_ih, w_hh, then b_ih + b_hh, flattened, gates i, f, c, o). MindSpore runs this
    primitive on CPU and GPU only (Ascend's nn.LSTM uses DynamicRNN: passes/fuse_lstm.py): the ascend target
    refuses it (graphconv/compiler/targets.py)."""
    hidden = int(n.attr("hidden_size"))
    dirs = directions(n)
    acts = [text(a) for a in (n.attr("activations") or DEFAULT_ACTIVATIONS["LSTM"] * len(dirs))]
    if acts != DEFAULT_ACTIVATIONS["LSTM"] * len(dirs) or n.attr("clip", None) is not None \
            or n.attr("input_forget", 0):
        n.fail("over a dynamic sequence only the default activations, no clip and no input_forget are supported "
               "(MindSpore's LSTM primitive)")
    if n.has(4) or n.has(7):
        n.fail("over a dynamic sequence, sequence_lens and peepholes are not supported (MindSpore's LSTM primitive)")
    weights = lstm_weights(n, _TO_MINDSPORE_GATES, "over a dynamic sequence W, R and B must be constants (laid "
                                                   "out for MindSpore's LSTM primitive)")
    dt = n.dtype(0).numpy()

    def run(x, h0, c0, d, name):
        w, r, bias = weights[d]
        flat = np.concatenate([w.reshape(-1), r.reshape(-1), bias]).astype(dt)
        lstm = n.call("ops.LSTM", w.shape[-1], hidden, 1, True, False, 0.0)
        return n.call_n(lstm, 5, x, h0, c0, n.const_tensor(flat.reshape(-1, 1, 1), f"lstm_weights_{name}"))[:3]

    x = n.call("ops.transpose", n.x(0), (1, 0, 2)) if layout else n.x(0)
    y, y_h, y_c = lstm_directions(n, x, (5, 6), run)
    if layout:
        y = n.call("ops.transpose", y, (2, 0, 1, 3))
        y_h = n.call("ops.transpose", y_h, (1, 0, 2))
        y_c = n.call("ops.transpose", y_c, (1, 0, 2))
    return (y, y_h, y_c)[: max(1, n.n_outputs)]


@register("RNN", "GRU", "LSTM", since=7)
def recurrent7(n):
    """Opsets 7-13: layout 0 only (the attribute does not exist yet)."""
    return _recurrent(n, n.node.op_type)


@register("RNN", "GRU", "LSTM", since=14)
def recurrent14(n):
    """Opset 14 adds layout; 22 only types."""
    return _recurrent(n, n.node.op_type)
