"""ONNX Attention (opsets 23-25) beyond opmap/attention.py's 4-D path: 3-D inputs (q_num_heads / kv_num_heads),
past_key / past_value with the present_key / present_value outputs, softcap, the qk_matmul_output output
(modes 0-3), softmax_precision, fp16/bf16 inputs computed in the order of the ONNX function body, opset 24's
nonpad_kv_seqlen (an external, statically sized KV cache) and opset 25's sliding window
(left_window_size / right_window_size).

Follows the ONNX reference (onnx/reference/ops/op_attention.py) step by step: Q and K^T are each scaled by
sqrt(scale) (scale computed in fp32, then cast to the input type), K/V heads repeated for GQA, softcap as
softcap * tanh(qk / softcap), then the bias: an attention mask shorter than the key length is padded with
False / -inf, a bool mask maps to 0 / -inf, and is_causal adds -inf where key j > query i + past length
(bottom-right aligned with a cache). The frontier's offset is the past length, or, with nonpad_kv_seqlen,
nonpad_kv_seqlen[b] - q_len per batch (computed in the graph: it is a run-time input); the sliding window admits
key j for the query at absolute position p = offset + i when p - left <= j <= p + right (-1: unbounded), and
nonpad_kv_seqlen also hides keys j >= nonpad_kv_seqlen[b]. A query row whose bias is -inf everywhere outputs 0.
The masked scores are
set to the type's lowest finite value before the softmax (MindSpore's CPU softmax turns other rows to NaN
when one row is all -inf); the probabilities are the same. qk_matmul_output: modes 0 and 1 the (softcapped) QK
product, mode 2 with the bias added, mode 3 the probabilities.
Refused: nonpad_kv_seqlen together with past_key/past_value (the spec forbids it), symbolic sequence lengths
where a mask, is_causal, a window or nonpad_kv_seqlen needs them.
"""

from __future__ import annotations

import numpy as np

_LOW_PRECISION = ("FLOAT16", "BFLOAT16")


def needs_general(n) -> bool:
    """Whether this Attention node needs more than opmap/attention.py's 4-D lowering."""
    rank = n.rank(0)
    low = n.dtype(0) is not None and n.dtype(0).name in _LOW_PRECISION
    extra_outputs = any(v.name for v in n.node.outputs[1:])
    windowed = any(n.attr(w, -1) != -1 for w in ("left_window_size", "right_window_size"))
    return (rank == 3 or n.has(4) or n.has(5) or n.has(6) or bool(n.attr("softcap", 0.0)) or extra_outputs or low
            or windowed)


def repeat_heads(n, x, grow, heads):
    """(B, Nkv, S, D) -> (B, Nq, S, D), each kv head repeated Nq / Nkv times (numpy's repeat on axis 1): a
    broadcast add of zeros `grow` (1, 1, rep, 1, 1), then the shape with `heads` (a [Nq] constant)."""
    grown = n.binop("+", n.call("ops.expand_dims", x, 2), grow)
    dims = n.call("ops.dyn_shape", x)
    target = n.call("ops.concat", (n.getitem(dims, slice(0, 1)), heads, n.getitem(dims, slice(2, 4))))
    return n.call("ops.reshape", grown, n.call(n.helper("onnx_dims"), target))


def attention(n):
    rank = n.require_rank(0)
    if rank not in (3, 4):
        n.fail(f"rank {rank} inputs are not supported")
    if n.has(6) and (n.has(4) or n.has(5)):
        n.fail("nonpad_kv_seqlen together with past_key/past_value (the spec allows one cache form)")
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
            heads.append(n.call("ops.transpose", n.call(reshape, x, shape), (0, 2, 1, 3)))
        q, k, v = heads
    else:
        qh, kvh, dq = qs[1], ks[1], qs[3]
    past = 0
    if n.has(4):
        ps = n.shape(4)
        if ps is None or not isinstance(ps[2], int):
            n.fail("past_key needs a static sequence length")
        past = ps[2]
        k = n.call("ops.concat", (n.x(4), k), 2)
    if n.has(5):
        v = n.call("ops.concat", (n.x(5), v), 2)
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
        k, v = (repeat_heads(n, x, grow, n_heads) for x in (k, v))
    scores = n.call("ops.matmul", n.binop("*", q, root),
                    n.binop("*", n.call("ops.transpose", k, (0, 1, 3, 2)), root))
    softcap = float(n.attr("softcap", 0.0) or 0.0)
    if softcap > 0:  # tanh as 2 * sigmoid(2x) - 1: ops.tanh is off by up to 1e-4 on CPU
        sigmoid = n.call("ops.sigmoid", n.binop("*", 2, n.binop("/", scores, softcap)))
        scores = n.binop("*", softcap, n.binop("-", n.binop("*", 2, sigmoid), 1))
    bias = _bias(n, q, present_k, past, np_dt)
    with_bias = n.binop("+", scores, bias) if bias is not None else scores
    lowest = n.const_tensor(np.array(np.finfo(np_dt).min, np_dt), "lowest")
    # ops.maximum(x, lowest) keeps -inf in graph mode on CPU: select on the bias instead.
    logits = n.call("ops.where", n.binop("==", bias, float("-inf")), lowest, with_bias) if bias is not None \
        else with_bias
    precision = n.attr("softmax_precision", None)
    if precision is not None and precision != int(dt):
        probs = n.call("ops.cast", n.call("ops.softmax", n.call("ops.cast", logits, n.ms_dtype(precision)), -1),
                       n.ms_dtype(dt))
    else:
        probs = n.call("ops.softmax", logits, -1)
    if bias is not None:
        masked_row = n.binop("==", n.call("ops.amax", bias, -1, keepdims=True), float("-inf"))
        probs = n.call("ops.where", masked_row, n.call("ops.zeros_like", probs), probs)
    y = n.call("ops.matmul", probs, v)
    if rank == 3:
        y = n.call("ops.flatten", n.call("ops.transpose", y, (0, 2, 1, 3)), start_dim=2)
    mode = int(n.attr("qk_matmul_output_mode", 0))
    qk_out = {0: scores, 1: scores, 2: with_bias, 3: probs}.get(mode)
    if qk_out is None:
        n.fail(f"qk_matmul_output_mode={mode} is not supported")
    return (y, present_k, present_v, qk_out)[: max(1, n.n_outputs)]


def _bias(n, q, k, past: int, np_dt):
    """The additive bias (0 / -inf, or the float mask) broadcastable to (B, H, S_q, S_kv), or None: the mask,
    plus the causal frontier and the sliding window (both relative to the offset), plus nonpad_kv_seqlen's
    padding; the sum of 0 / -inf terms is the ONNX reference's step by step."""
    causal = bool(n.attr("is_causal", 0))
    left, right = int(n.attr("left_window_size", -1)), int(n.attr("right_window_size", -1))
    windowed = left >= 0 or right >= 0
    nonpad = n.has(6)
    if not (n.has(3) or causal or windowed or nonpad):
        return None
    q_len = (n.shape(0) or [None] * 3)[-2]
    kv_len = (n.shape(1) or [None] * 3)[-2]
    if n.rank(0) == 3:
        q_len, kv_len = n.shape(0)[1], n.shape(1)[1]
    if not isinstance(q_len, int) or not isinstance(kv_len, int):
        n.fail("masks, is_causal, windows and nonpad_kv_seqlen need static sequence lengths")
    kv_len += past
    neg_inf = n.const_tensor(np.array(-np.inf, np_dt), "neg_inf")
    zero = n.const_tensor(np.array(0, np_dt), "zero")
    terms = []
    if n.has(3):
        mask = n.x(3)
        mshape = n.shape(3)
        is_bool = n.dtype(3).name == "BOOL"
        if mshape is None or not isinstance(mshape[-1], int):
            n.fail("the attention mask needs a static last dim")
        pad = kv_len - mshape[-1]
        if pad > 0:
            mask = n.call("ops.pad", mask, (0, pad), "constant", False if is_bool else float("-inf"))
        if is_bool:
            mask = n.call("ops.where", mask, zero, neg_inf)
        terms.append(mask)
    # diff = (offset + i) - j: the query's absolute position minus the key's.
    diff = np.arange(q_len)[:, None] - np.arange(kv_len)[None, :]
    if causal or windowed:
        if nonpad:  # per batch: offset[b] = nonpad_kv_seqlen[b] - q_len, a run-time value
            offset = n.binop("-", n.call("ops.reshape", n.x(6), (-1, 1, 1)), q_len)
            d = n.binop("+", n.const_tensor(diff.astype(np.int64), "diff"), offset)  # (B, q, kv)
            allowed = None
            for cond in (([n.binop(">=", d, 0)] if causal else []) + ([n.binop("<=", d, left)] if left >= 0 else [])
                         + ([n.binop(">=", d, -right)] if right >= 0 else [])):
                allowed = cond if allowed is None else n.call("ops.logical_and", allowed, cond)
            terms.append(n.call("ops.expand_dims", n.call("ops.where", allowed, zero, neg_inf), 1))
        else:
            d = diff + past
            allowed = np.ones_like(d, dtype=bool)
            if causal:
                allowed &= d >= 0
            if left >= 0:
                allowed &= d <= left
            if right >= 0:
                allowed &= -d <= right
            terms.append(n.const_tensor(np.where(allowed, 0, -np.inf).astype(np_dt), "causal"))
    if nonpad:  # keys at or after nonpad_kv_seqlen[b] are padding: (B, 1, 1, kv)
        keys = n.const_tensor(np.arange(kv_len, dtype=np.int64), "keys")
        valid = n.binop("<", keys, n.call("ops.reshape", n.x(6), (-1, 1, 1, 1)))
        terms.append(n.call("ops.where", valid, zero, neg_inf))
    bias = terms[0]
    for t in terms[1:]:
        bias = n.binop("+", bias, t)
    return bias
