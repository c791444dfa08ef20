"""ONNX Attention (opset 23) lowered to MindSpore ops, for the CPU path and for what fuse-attention refuses.

The 4-D form only: Q (B, Nq, S1, D), K (B, Nkv, S2, D), V (B, Nkv, S2, Dv), Nq a multiple of Nkv (query head
n reads kv head n // (Nq / Nkv), numpy's repeat on axis 1, as the ONNX reference). scale defaults to
1/sqrt(D). attn_mask: bool (True takes part, the rest -inf) or float (added). is_causal: key j is visible to
query i when j <= i (the ONNX reference's offset is the past length, 0 here: top-left aligned). A query row
that sees no key (bool mask / causal) outputs 0, as onnxruntime and the ONNX reference do.
Refused: 3-D inputs, past key/value, nonpad_kv_seqlen, softcap, sliding windows; the extra outputs
(present key/value, qk) are not produced.
"""

from __future__ import annotations

import math

import numpy as np

from opmap import attention_general
from opmap.registry import register


@register("Attention", since=23)
def attention(n):
    if attention_general.needs_general(n):  # 3-D, past/present, softcap, qk output, fp16: the general lowering
        return attention_general.attention(n)
    if n.require_rank(0) != 4:
        n.fail("3-D (q_num_heads/kv_num_heads) inputs are not supported")
    for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
        if n.has(i):
            n.fail(f"{what} is not supported")
    if n.attr("softcap", 0.0):
        n.fail("softcap is not supported")
    for window in ("left_window_size", "right_window_size"):
        if n.attr(window, -1) != -1:
            n.fail(f"{window} is not supported")
    qs, ks = n.shape(0), n.shape(1)
    scale = n.attr("scale", None)
    if scale is None:
        if not isinstance(qs[3], int):
            n.fail("the default scale needs a static head dim")
        scale = 1.0 / math.sqrt(qs[3])
    np_dt = np.float32 if n.dtype(0) is None else n.dtype(0).numpy()
    q, k, v = n.x(0), n.x(1), n.x(2)
    nq, nkv = qs[1], ks[1]
    if nq != nkv:
        if not (isinstance(nq, int) and isinstance(nkv, int) and nkv and nq % nkv == 0):
            n.fail(f"query heads {nq} are not a multiple of kv heads {nkv}")
        rep = nq // nkv
        heads = n.const_tensor(np.array([nq], np.int64), "heads")
        grow = n.const_tensor(np.zeros((1, 1, rep, 1, 1), np_dt), "grow")
        dims = n.helper("onnx_dims")
        k, v = (n.tmp(f"ops.reshape(ops.expand_dims({x}, 2) + {grow}, {dims}(ops.concat((ops.dyn_shape({x})[0:1], "
                      f"{heads}, ops.dyn_shape({x})[2:4]))))", hint) for x, hint in ((k, "k_rep"), (v, "v_rep")))
    scores = n.tmp(f"ops.matmul({q}, ops.transpose({k}, (0, 1, 3, 2))) * {float(scale)!r}", "scores")
    # Masked scores get the dtype's lowest finite value, not -inf: MindSpore's CPU softmax (graph mode) turns
    # other rows to NaN when some row is all -inf. Same probabilities wherever a row keeps a key.
    lowest = n.const_tensor(np.array(np.finfo(np_dt).min, np_dt), "lowest")
    visible = None
    if n.attr("is_causal", 0):
        one = "Tensor(1, ms.int64)"
        rows = f"ops.range(Tensor(0, ms.int64), ops.dyn_shape({q})[2], {one})"
        cols = f"ops.range(Tensor(0, ms.int64), ops.dyn_shape({k})[2], {one})"
        visible = n.tmp(f"ops.expand_dims({cols}, 0) <= ops.expand_dims({rows}, 1)", "causal")
    if n.has(3) and n.dtype(3) is not None and n.dtype(3).name == "BOOL":
        visible = n.x(3) if visible is None else n.tmp(f"ops.logical_and({visible}, {n.x(3)})", "visible")
    if visible is not None:
        scores = n.tmp(f"ops.where({visible}, {scores}, {lowest})", "scores")
    if n.has(3) and (n.dtype(3) is None or n.dtype(3).name != "BOOL"):
        scores = n.tmp(f"{scores} + {n.x(3)}", "scores")
    out = f"ops.matmul(ops.softmax({scores}, -1), {v})"
    if visible is not None:  # ONNX: a query row that sees no key outputs 0
        keeps = f"ops.cast(ops.ReduceAny(keep_dims=True)({visible}, -1), {n.ms_dtype(n.dtype(0))})"
        out = f"{out} * {keeps}"
    return out
