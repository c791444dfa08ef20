"""Recurrent layers: RNN, GRU, LSTM (opsets 7 and 14), unrolled over a static sequence length.

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

from opmap.registry import register

_DEFAULTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_ALPHA = {"LeakyRelu": 0.01, "ThresholdedRelu": 1.0, "Elu": 1.0, "HardSigmoid": 0.2, "Affine": 1.0,
          "ScaledTanh": 1.0}
_BETA = {"HardSigmoid": 0.5, "Affine": 0.0, "ScaledTanh": 1.0}


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


def _activation(n, name: str, alpha, beta):
    a = _ALPHA.get(name) if alpha is None else alpha
    b = _BETA.get(name) if beta is None else beta
    forms = {
        "Sigmoid": "ops.sigmoid({x})",
        "Tanh": "(2 * ops.sigmoid(2 * {x}) - 1)",
        "Relu": "ops.relu({x})",
        "HardSigmoid": f"ops.clamp({a!r} * {{x}} + {b!r}, 0.0, 1.0)",
        "LeakyRelu": f"ops.where({{x}} >= 0, {{x}}, {a!r} * {{x}})",
        "Affine": f"({a!r} * {{x}} + {b!r})",
        "ScaledTanh": f"{a!r} * (2 * ops.sigmoid(2 * {b!r} * {{x}}) - 1)",
        "Softsign": "({x} / (1 + ops.abs({x})))",
        "Softplus": "ops.softplus({x})",
        "Elu": f"ops.where({{x}} >= 0, {{x}}, {a!r} * (ops.exp({{x}}) - 1))",
        "ThresholdedRelu": f"ops.where({{x}} > {a!r}, {{x}}, ops.zeros_like({{x}}))",
    }
    if name not in forms:
        n.fail(f"activation {name!r} is not supported")
    return lambda x: forms[name].format(x=f"({x})")


def _recurrent(n, kind: str):
    xs = n.shape(0)
    if xs is None or not all(isinstance(d, int) for d in xs):
        n.fail("the input shape must be static (the sequence is unrolled)")
    layout = int(n.attr("layout", 0))
    seq, batch = (xs[1], xs[0]) if layout else (xs[0], xs[1])
    hidden = int(n.attr("hidden_size"))
    direction = _text(n.attr("direction", "forward"))
    dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    gates = _GATES[kind]
    acts = [_text(a) for a in (n.attr("activations") or _DEFAULTS[kind] * len(dirs))]
    alphas = list(n.attr("activation_alpha") or [])
    betas = list(n.attr("activation_beta") or [])
    per_dir = len(_DEFAULTS[kind])
    clip = n.attr("clip", None)
    if kind == "LSTM" and n.attr("input_forget", 0):
        n.fail("input_forget=1 is not supported")
    if kind == "GRU":
        lbr = bool(n.attr("linear_before_reset", 0))
    dt = n.ms_dtype(n.dtype(0))
    x = n.x(0)
    if layout:
        x = n.tmp(f"ops.transpose({x}, (1, 0, 2))", "x_sbf")
    seq_lens = n.x(4) if n.has(4) else None
    if seq_lens is not None and "reverse" in dirs:
        n.fail("sequence_lens with a reverse direction is not supported")
    if seq_lens is not None:
        seq_lens = n.tmp(f"ops.cast({seq_lens}, ms.int64)", "seq_lens")
    zeros = n.const_tensor(np.zeros((batch, hidden), n.dtype(0).numpy()), "zeros_h")
    ys, hs, cs = [], [], []
    for d, name in enumerate(dirs):
        fs = []
        for k in range(per_dir):
            i = d * per_dir + k
            fs.append(_activation(n, acts[i], alphas[i] if i < len(alphas) else None,
                                  betas[i] if i < len(betas) else None))
        w_t = n.tmp(f"ops.transpose({n.x(1)}[{d}], (1, 0))", f"w{d}")
        r_t = n.tmp(f"ops.transpose({n.x(2)}[{d}], (1, 0))", f"r{d}")
        xw = n.tmp(f"ops.matmul({x}, {w_t})", f"xw{d}")
        wb = rb = None
        if n.has(3):
            wb = n.tmp(f"{n.x(3)}[{d}, :{gates * hidden}]", f"wb{d}")
            rb = n.tmp(f"{n.x(3)}[{d}, {gates * hidden}:]", f"rb{d}")
            xw = n.tmp(f"{xw} + {wb}", f"xw{d}")
        h = n.tmp(f"{n.x(5)}[{d}]", f"h{d}") if n.has(5) else zeros
        c = None
        if kind == "LSTM":
            c = n.tmp(f"{n.x(6)}[{d}]", f"c{d}") if n.has(6) else zeros
            peep = [n.tmp(f"{n.x(7)}[{d}, {g * hidden}:{(g + 1) * hidden}]", f"p{d}_{g}") for g in range(3)] \
                if n.has(7) else None

        def clipped(e):
            return f"ops.clamp({e}, {-float(clip)!r}, {float(clip)!r})" if clip is not None else e

        def gate(pre, g):
            return f"{pre}[:, {g * hidden}:{(g + 1) * hidden}]"

        steps = range(seq) if name == "forward" else range(seq - 1, -1, -1)
        outs = [None] * seq
        for t in steps:
            xt = f"{xw}[{t}]"
            hr = f"ops.matmul({h}, {r_t})"
            if kind == "RNN":
                pre = f"{xt} + {hr}" + (f" + {rb}" if rb else "")
                h_new = n.tmp(fs[0](clipped(pre)), f"h{d}")
            elif kind == "GRU":
                hr = n.tmp(hr + (f" + {rb}" if rb else ""), f"hr{d}")
                z = n.tmp(fs[0](clipped(f"{gate(xt, 0)} + {gate(hr, 0)}")), f"z{d}")
                r = n.tmp(fs[0](clipped(f"{gate(xt, 1)} + {gate(hr, 1)}")), f"rg{d}")
                if lbr:
                    hh = f"{gate(xt, 2)} + {r} * {gate(hr, 2)}"
                else:
                    rh = f"ops.matmul({r} * {h}, {r_t}[:, {2 * hidden}:])"
                    hh = f"{gate(xt, 2)} + {rh}" + (f" + {rb}[{2 * hidden}:]" if rb else "")
                hh = n.tmp(fs[1](clipped(hh)), f"hh{d}")
                h_new = n.tmp(f"(1 - {z}) * {hh} + {z} * {h}", f"h{d}")
            else:
                pre = n.tmp(f"{xt} + {hr}" + (f" + {rb}" if rb else ""), f"pre{d}")
                ig, og, fg, cg = (gate(pre, g) for g in range(4))
                if peep:
                    ig, fg = f"{ig} + {peep[0]} * {c}", f"{fg} + {peep[2]} * {c}"
                i_ = n.tmp(fs[0](clipped(ig)), f"i{d}")
                f_ = n.tmp(fs[0](clipped(fg)), f"f{d}")
                g_ = n.tmp(fs[1](clipped(cg)), f"g{d}")
                c_new = n.tmp(f"{f_} * {c} + {i_} * {g_}", f"c{d}")
                if peep:
                    og = f"{og} + {peep[1]} * {c_new}"
                o_ = n.tmp(fs[0](clipped(og)), f"o{d}")
                h_new = n.tmp(f"{o_} * {fs[2](c_new)}", f"h{d}")
            if seq_lens is not None:
                live = n.tmp(f"ops.expand_dims({t} < {seq_lens}, 1)", f"live{d}")
                outs[t] = n.tmp(f"ops.where({live}, {h_new}, {zeros})", f"y{d}")
                h_new = n.tmp(f"ops.where({live}, {h_new}, {h})", f"h{d}")
                if kind == "LSTM":
                    c_new = n.tmp(f"ops.where({live}, {c_new}, {c})", f"c{d}")
            else:
                outs[t] = h_new
            h = h_new
            if kind == "LSTM":
                c = c_new
        ys.append(f"ops.stack(({', '.join(outs)},), 0)")
        hs.append(h)
        cs.append(c)
    y = n.tmp(f"ops.stack(({', '.join(ys)},), 1)", "y")  # (seq, dirs, batch, hidden)
    y_h = f"ops.stack(({', '.join(hs)},), 0)"
    y_c = f"ops.stack(({', '.join(cs)},), 0)" if kind == "LSTM" else None
    if layout:
        y = f"ops.transpose({y}, (2, 0, 1, 3))"
        y_h = f"ops.transpose({y_h}, (1, 0, 2))"
        y_c = f"ops.transpose({y_c}, (1, 0, 2))" if y_c else None
    outputs = (y, y_h) if kind != "LSTM" else (y, y_h, y_c)
    return outputs[: max(1, n.n_outputs)]


@register("RNN", "GRU", "LSTM", since=7)
def recurrent7(n):
    """Opsets 7-13: layout 0 only (the attribute does not exist yet)."""
    return _recurrent(n, n.node.op_type)


@register("RNN", "GRU", "LSTM", since=14)
def recurrent14(n):
    """Opset 14 adds layout; 22 only types."""
    return _recurrent(n, n.node.op_type)
