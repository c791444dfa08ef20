"""LinearAttention and CausalConvWithState (opset 27): the recurrent blocks of Gated DeltaNet / Mamba-style
models, as the ONNX reference (onnx/reference/ops/op_linear_attention.py, op_causal_conv_with_state.py) computes
them.

LinearAttention: query/key/value (and decay/beta) packed as (B, T, H*D), unpacked to (B, H, T, D) and computed in
fp32. Per token t: gated rules decay the state S *= exp(g_t) (g per head or per key dim), delta rules correct the
value v_t <- beta_t * (v_t - S^T k_t), then S += k_t (x) v_t and o_t = scale * q_t^T S (each kv head's state read by
q_num_heads / kv_num_heads query heads, numpy's repeat). The recurrence is unrolled over T, so T must be static
(a prefill or a decode step of a fixed length); present_state is S in past_state's dtype (else the query's).

CausalConvWithState: the input left-padded with past_state (or zeros) to L + k - 1, a depthwise valid conv as k
shifted products (k static), the bias, optionally SiLU in fp32; present_state the last k - 1 padded positions.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap import attention_general
from opmap.registry import register

_RULES = ("linear", "gated", "delta", "gated_delta")


def _heads(n, x, shape, heads, hint):
    """(B, T, H*D) -> (B, H, T, D)."""
    target = n.const_tensor(np.array([0, 0, heads, shape[2] // heads], np.int64), hint)
    return n.call("ops.transpose", n.call(n.helper("onnx_reshape"), x, target), (0, 2, 1, 3))


@register("LinearAttention", since=27)
def linear_attention(n):
    rule = n.attr("update_rule", "gated_delta")
    if rule not in _RULES:
        n.fail(f"update_rule {rule!r} (one of {', '.join(_RULES)})")
    qh, kvh = n.attr("q_num_heads"), n.attr("kv_num_heads")
    if not qh or not kvh or qh % kvh:
        n.fail(f"q_num_heads {qh} must be a positive multiple of kv_num_heads {kvh}")
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gating != n.has(4) or delta != n.has(5):
        n.fail(f"update_rule {rule!r} takes {'decay' if gating else 'no decay'} and {'beta' if delta else 'no beta'}")
    shapes = [n.shape(i) for i in range(3)]
    if any(s is None or len(s) != 3 or not isinstance(s[2], int) for s in shapes):
        n.fail("query, key and value must be (B, T, H*D) with static hidden sizes")
    steps = shapes[0][1]
    if not isinstance(steps, int):
        n.fail("the sequence length T must be static (the recurrence is unrolled)")
    dk = shapes[0][2] // qh
    f32 = n.ms_dtype(ir.DataType.FLOAT)
    q, k, v = (n.call("ops.cast", _heads(n, n.x(i), shapes[i], h, hint), f32)
               for i, h, hint in ((0, qh, "q_heads"), (1, kvh, "k_heads"), (2, kvh, "v_heads")))
    decay = beta = None
    if gating:
        last = (n.shape(4) or [None] * 3)[-1]
        if last not in (kvh, kvh * dk):
            n.fail(f"decay's last dim {last} must be kv_num_heads ({kvh}) or kv_num_heads * d_k ({kvh * dk})")
        decay = n.call("ops.cast", _heads(n, n.x(4), n.shape(4), kvh, "decay_heads"), f32)  # (B, Hkv, T, 1|dk)
    if delta:
        last = (n.shape(5) or [None] * 3)[-1]
        if last not in (kvh, 1):
            n.fail(f"beta's last dim {last} must be kv_num_heads ({kvh}) or 1")
        beta = n.call("ops.cast", _heads(n, n.x(5), n.shape(5), last, "beta_heads"), f32)  # (B, Hkv|1, T, 1)
    scale = n.attr("scale", 0.0)
    scale = float(scale) if scale else 1.0 / float(np.sqrt(dk))
    state = n.call("ops.cast", n.x(3), f32) if n.has(3) else None  # None: zeros
    if qh != kvh:
        grow = n.const_tensor(np.zeros((1, 1, qh // kvh, 1, 1), np.float32), "grow")
        n_heads = n.const_tensor(np.array([qh], np.int64), "heads")
    outputs = []
    for t in range(steps):
        q_t, k_t, v_t = (n.getitem(x, (slice(None), slice(None), slice(t, t + 1))) for x in (q, k, v))  # (B,H,1,D)
        if gating and state is not None:
            g_t = n.getitem(decay, (slice(None), slice(None), t))  # (B, Hkv, 1|dk)
            state = n.binop("*", state, n.call("ops.expand_dims", n.call("ops.exp", g_t), -1))
        if delta:
            b_t = n.getitem(beta, (slice(None), slice(None), slice(t, t + 1)))  # (B, Hkv|1, 1, 1)
            if state is not None:  # S^T k_t as k_t (1, dk) @ S (dk, dv)
                v_t = n.binop("-", v_t, n.call("ops.matmul", k_t, state))
            v_t = n.binop("*", b_t, v_t)
        outer = n.call("ops.matmul", n.call("ops.transpose", k_t, (0, 1, 3, 2)), v_t)  # (B, Hkv, dk, dv)
        state = outer if state is None else n.binop("+", state, outer)
        read = state if qh == kvh else attention_general.repeat_heads(n, state, grow, n_heads)
        outputs.append(n.binop("*", n.call("ops.matmul", q_t, read), scale))  # (B, Hq, 1, dv)
    y = outputs[0] if steps == 1 else n.call("ops.concat", tuple(outputs), 2)
    y = n.call("ops.flatten", n.call("ops.transpose", y, (0, 2, 1, 3)), start_dim=2)
    out_dt = n.dtype(0)
    state_dt = n.dtype(3) if n.has(3) else out_dt
    y = y if out_dt == ir.DataType.FLOAT else n.call("ops.cast", y, n.ms_dtype(out_dt))
    present = state if state_dt == ir.DataType.FLOAT else n.call("ops.cast", state, n.ms_dtype(state_dt))
    return (y, present)[: max(1, n.n_outputs)]


@register("CausalConvWithState", since=27)
def causal_conv_with_state(n):
    activation = n.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        n.fail(f"activation {activation!r} (none, silu or swish)")
    if n.require_rank(0) != 3:
        n.fail("input must be (batch, channels, length)")
    ws = n.shape(1)
    if ws is None or len(ws) != 3 or not isinstance(ws[2], int):
        n.fail("weight must be (channels, 1, k) with a static k")
    taps = ws[2]
    dt = n.dtype(0)
    low = dt in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)  # the reference rounds the conv to dt once
    f32 = n.ms_dtype(ir.DataType.FLOAT)
    x = n.x(0)
    padded = n.call("ops.concat", (n.x(3), x), 2) if n.has(3) else \
        (n.call("ops.pad", x, (taps - 1, 0)) if taps > 1 else x)
    conv_in, w = (padded, n.x(1)) if not low else (n.call("ops.cast", padded, f32), n.call("ops.cast", n.x(1), f32))
    y = None
    for j in range(taps):  # y[:, c, l] = sum_j padded[:, c, l + j] * w[c, 0, j]
        end = j - (taps - 1)
        window = n.getitem(conv_in, (slice(None), slice(None), slice(j, end if end else None)))
        term = n.binop("*", window, n.getitem(w, (None, slice(None), 0, slice(j, j + 1))))  # w as (1, C, 1)
        y = term if y is None else n.binop("+", y, term)
    if n.has(2):
        bias = n.call("ops.reshape", n.x(2), (1, -1, 1))
        y = n.binop("+", y, bias if not low else n.call("ops.cast", bias, f32))
    if low:
        y = n.call("ops.cast", y, n.ms_dtype(dt))
    if activation != "none":
        f = y if dt == ir.DataType.FLOAT else n.call("ops.cast", y, n.ms_dtype(ir.DataType.FLOAT))
        f = n.binop("*", f, n.call("ops.sigmoid", f))
        y = f if dt == ir.DataType.FLOAT else n.call("ops.cast", f, n.ms_dtype(dt))
    if n.n_outputs < 2 or not n.node.outputs[1].name:
        return y
    if taps == 1:  # an empty carry: (B, C, 0), known when B and C are
        xs = n.shape(0)
        if not all(isinstance(d, int) for d in xs[:2]):
            n.fail("kernel size 1 leaves an empty present_state: batch and channels must be static")
        return y, np.zeros((xs[0], xs[1], 0), n.dtype(0).numpy())
    present = n.getitem(padded, (slice(None), slice(None), slice(1 - taps, None)))
    return y, present
