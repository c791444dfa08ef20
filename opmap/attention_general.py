"""ONNX Attention (opset 23) beyond opmap/attention.py's 4-D path: 3-D inputs (q_num_heads / kv_num_heads),
past_key / past_value with the present_key / present_value outputs, softcap, the qk_matmul_output output
(modes 0-3), softmax_precision, and fp16/bf16 inputs computed in the order of the ONNX function body.

Follows the ONNX reference (onnx/reference/ops/op_attention.py) step by step: Q and K^T are each scaled by
sqrt(scale) (scale computed in fp32, then cast to the input type), K/V heads repeated for GQA, softcap as
softcap * tanh(qk / softcap), then the bias: an attention mask shorter than the key length is padded with
False / -inf, a bool mask maps to 0 / -inf, and is_causal adds -inf where key j > query i + past length
(bottom-right aligned with a cache). A query row whose bias is -inf everywhere outputs 0. The masked scores are
set to the type's lowest finite value before the softmax (MindSpore's CPU softmax turns other rows to NaN
when one row is all -inf); the probabilities are the same. qk_matmul_output: modes 0 and 1 the (softcapped) QK
product, mode 2 with the bias added, mode 3 the probabilities.
Refused: sliding windows (left/right_window_size) and nonpad_kv_seqlen (opset 24 and later).
"""

from __future__ import annotations

import numpy as np

_LOW_PRECISION = ("FLOAT16", "BFLOAT16")


def needs_general(n) -> bool:
    """Whether this Attention node needs more than opmap/attention.py's 4-D lowering."""
    rank = n.rank(0)
    low = n.dtype(0) is not None and n.dtype(0).name in _LOW_PRECISION
    extra_outputs = any(v.name for v in n.node.outputs[1:])
    return rank == 3 or n.has(4) or n.has(5) or bool(n.attr("softcap", 0.0)) or extra_outputs or low


def attention(n):
    rank = n.require_rank(0)
    if rank not in (3, 4):
        n.fail(f"rank {rank} inputs are not supported")
    if n.has(6):
        n.fail("nonpad_kv_seqlen is not supported")
    for window in ("left_window_size", "right_window_size"):
        if n.attr(window, -1) != -1:
            n.fail(f"{window} is not supported")
    dt = n.dtype(0)
    np_dt = dt.numpy()
    q, k, v = n.x(0), n.x(1), n.x(2)
    qs, ks, vs = n.shape(0), n.shape(1), n.shape(2)
    if rank == 3:
        qh, kvh = n.attr("q_num_heads"), n.attr("kv_num_heads")
        if not qh or not kvh:
            n.fail("3-D inputs need q_num_heads and kv_num_heads")
        if not all(isinstance(s[2], int) for s in (qs, ks, vs)):
            n.fail("3-D inputs need static hidden sizes")
        dq = qs[2] // qh
        reshape = n.helper("onnx_reshape")
        heads = []
        for x, s, h, hint in ((q, qs, qh, "q"), (k, ks, kvh, "k"), (v, vs, kvh, "v")):
            shape = n.const_tensor(np.array([0, 0, h, s[2] // h], np.int64), f"{hint}_heads")
            heads.append(n.tmp(f"ops.transpose({reshape}({x}, {shape}), (0, 2, 1, 3))", f"{hint}_bnsd"))
        q, k, v = heads
    else:
        qh, kvh, dq = qs[1], ks[1], qs[3]
    past = 0
    if n.has(4):
        ps = n.shape(4)
        if ps is None or not isinstance(ps[2], int):
            n.fail("past_key needs a static sequence length")
        past = ps[2]
        k = n.tmp(f"ops.concat(({n.x(4)}, {k}), 2)", "present_key")
    if n.has(5):
        v = n.tmp(f"ops.concat(({n.x(5)}, {v}), 2)", "present_value")
    present_k, present_v = k, v
    scale = n.attr("scale", None)
    if scale is None:
        if not isinstance(dq, int):
            n.fail("the default scale needs a static head size")
        scale = np.float32(1.0) / np.sqrt(np.float32(dq))
    root = n.const_tensor(np.array(np.sqrt(np.float32(scale)), np.float32).astype(np_dt), "scale_sqrt")
    if qh != kvh:
        if not (isinstance(qh, int) and isinstance(kvh, int) and kvh and qh % kvh == 0):
            n.fail(f"query heads {qh} are not a multiple of kv heads {kvh}")
        grow = n.const_tensor(np.zeros((1, 1, qh // kvh, 1, 1), np_dt), "grow")
        n_heads = n.const_tensor(np.array([qh], np.int64), "heads")
        dims = n.helper("onnx_dims")
        k, v = (n.tmp(f"ops.reshape(ops.expand_dims({x}, 2) + {grow}, {dims}(ops.concat((ops.dyn_shape({x})[0:1], "
                      f"{n_heads}, ops.dyn_shape({x})[2:4]))))", hint) for x, hint in ((k, "k_rep"), (v, "v_rep")))
    scores = n.tmp(f"ops.matmul({q} * {root}, ops.transpose({k}, (0, 1, 3, 2)) * {root})", "qk")
    softcap = float(n.attr("softcap", 0.0) or 0.0)
    if softcap > 0:  # tanh as 2 * sigmoid(2x) - 1: ops.tanh is off by up to 1e-4 on CPU
        scores = n.tmp(f"{softcap!r} * (2 * ops.sigmoid(2 * ({scores} / {softcap!r})) - 1)", "qk_softcap")
    bias = _bias(n, q, present_k, past, np_dt)
    with_bias = n.tmp(f"{scores} + {bias}", "qk_bias") if bias is not None else scores
    lowest = n.const_tensor(np.array(np.finfo(np_dt).min, np_dt), "lowest")
    # ops.maximum(x, lowest) keeps -inf in graph mode on CPU: select on the bias instead.
    logits = f"ops.where({bias} == float('-inf'), {lowest}, {with_bias})" if bias is not None else with_bias
    precision = n.attr("softmax_precision", None)
    if precision is not None and precision != int(dt):
        probs = f"ops.cast(ops.softmax(ops.cast({logits}, {n.ms_dtype(precision)}), -1), {n.ms_dtype(dt)})"
    else:
        probs = f"ops.softmax({logits}, -1)"
    probs = n.tmp(probs, "probs")
    if bias is not None:
        masked_row = f"ops.amax({bias}, -1, keepdims=True) == float('-inf')"
        probs = n.tmp(f"ops.where({masked_row}, ops.zeros_like({probs}), {probs})", "probs_safe")
    y = n.tmp(f"ops.matmul({probs}, {v})", "attn")
    if rank == 3:
        y = f"ops.flatten(ops.transpose({y}, (0, 2, 1, 3)), start_dim=2)"
    mode = int(n.attr("qk_matmul_output_mode", 0))
    qk_out = {0: scores, 1: scores, 2: with_bias, 3: probs}.get(mode)
    if qk_out is None:
        n.fail(f"qk_matmul_output_mode={mode} is not supported")
    return (y, present_k, present_v, qk_out)[: max(1, n.n_outputs)]


def _bias(n, q: str, k: str, past: int, np_dt) -> str | None:
    """The additive bias (0 / -inf, or the float mask) of shape broadcastable to (B, H, S_q, S_kv), or None."""
    causal = bool(n.attr("is_causal", 0))
    if not n.has(3) and not causal:
        return None
    q_len = (n.shape(0) or [None] * 3)[-2]
    kv_len = (n.shape(1) or [None] * 3)[-2]
    if n.rank(0) == 3:
        q_len, kv_len = n.shape(0)[1], n.shape(1)[1]
    if not isinstance(q_len, int) or not isinstance(kv_len, int):
        n.fail("masks and is_causal need static sequence lengths")
    kv_len += past
    neg_inf = n.const_tensor(np.array(-np.inf, np_dt), "neg_inf")
    zero = n.const_tensor(np.array(0, np_dt), "zero")
    mask = None
    if n.has(3):
        mask = n.x(3)
        mshape = n.shape(3)
        is_bool = n.dtype(3).name == "BOOL"
        if mshape is None or not isinstance(mshape[-1], int):
            n.fail("the attention mask needs a static last dim")
        pad = kv_len - mshape[-1]
        if pad > 0:
            fill = "False" if is_bool else "float('-inf')"
            mask = n.tmp(f"ops.pad({mask}, (0, {pad}), 'constant', {fill})", "mask_padded")
        if is_bool:
            mask = n.tmp(f"ops.where({mask}, {zero}, {neg_inf})", "mask_bias")
    if causal:
        allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + past
        causal_bias = n.const_tensor(np.where(allowed, 0, -np.inf).astype(np_dt), "causal")
        return n.tmp(causal_bias if mask is None else f"{mask} + {causal_bias}", "bias")
    return mask
