"""Attention and MultiHeadAttention (com.microsoft) -> the eager attention of a PyTorch export: projections,
Reshape/Transpose to heads, MatMul(q, kᵀ) * scale + mask, Softmax, MatMul with v, heads merged back
(fuse-attention makes mindspore::FlashAttentionScore of it where the primitive can take it).

What onnxruntime's CPU kernels compute (contrib_ops/cpu/bert/attention.cc, multihead_attention.cc,
attention_cpu_base.h ApplyAttention, attention_helper.h PrepareMask; float32 only):
  q, k, v (B, N, S|L, H) from the inputs; with past, k and v are concat(past, new) over the sequence axis
  (T = P + L keys) and present is what the next step reads;
  P = softmax(scale · q @ kᵀ + attention_bias + M) over the keys, scale default 1 / sqrt(H); out = P @ v with
  the heads merged, (B, S, N·H_v).
  M (mask_filter_value f, default -10000): 0 where a key is kept, f where the mask drops it:
    (B) mask_index          key j kept when j < mask_index[b] (right padding);
    (2B) mask_index         also j >= mask_index[B + b] (left padding; Attention only);
    (B, T) raw mask         kept where the value > 0;  (B, S, T) the same per query row;
  and with unidirectional=1 key j > P + i is set to the lowest float (causal; past keys all visible) for
  every query row but the last (the kernel's loop runs over rows 0..S-2): with as many new keys as queries
  that row is causal anyway; MultiHeadAttention's cross attention with more keys than queries lets it see
  all of them, and the decomposition does the same.
  A row whose keys are all dropped by the mask alone still softmaxes over scores - 10000 (no NaN).

Attention: input (B, S, D_in) @ weights (D_in, D + D + D_v) + bias, split into q | k | v (qkv_hidden_sizes,
  else three equal parts), num_heads heads; past (2, B, N, P, H), present (2, B, N, T, H).
MultiHeadAttention: query (B, S, D), key/value (B, L, D|D_v) plus bias (D + D + D_v) split the same way, or
  key/value (B, N, L, H) already in heads (no bias, no past); past_key/past_value (B, N, P, H),
  present_key/present_value (B, N, T, H); key_padding_mask and attention_bias as above.
Refused, one reason each: 4-D (Megatron) mask_index and the (3B + 2) packed-lengths form (no CPU kernel
defines them), packed QKV / packed KV inputs (not implemented on CPU), do_rotary, past_present_share_buffer /
past_sequence_length / cache_indirection (the CUDA decoding buffers), the qk output, dtypes other than float32.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphconv.frontend.contrib import spell
from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite

FLOAT = onnx.TensorProto.FLOAT
LOWEST = float(np.finfo(np.float32).min)


def _float32_only(rw: Rewrite, *values: str) -> None:
    for v in values:
        dtype = rw.dtype(v)
        if dtype is not None and dtype != FLOAT:
            rw.fail(f"{v!r} is {onnx.TensorProto.DataType.Name(dtype)}: onnxruntime's CPU kernel (the semantics "
                    "decomposed here) takes float32 only")


def _to_heads(rw: Rewrite, x: str, heads: int, size: int) -> str:
    """(B, S, N·H) -> (B, N, S, H)."""
    return rw.op("Transpose", rw.op("Reshape", x, spell.ints(rw, [0, 0, heads, size])), perm=[0, 2, 1, 3])


def _same_dim(a, b) -> bool:
    return a is not None and a == b


def _padding_keep(rw: Rewrite, mask: str, batch, k_total: str, allow_starts: bool) -> tuple[str, int]:
    """(bool keep mask, its rank) from mask_index / key_padding_mask: (B, T) for the 1-D and 2-D forms,
    (B, S, T) for 3-D."""
    shape = rw.shape(mask)
    if shape is None:
        rw.fail("the mask's rank is unknown (shape inference did not give it)")
    rank = len(shape)
    if rank == 2 or rank == 3:
        return rw.op("Greater", mask, rw.const(np.int32(0))), rank
    if rank == 4:
        rw.fail("a 4-D mask_index (Megatron's (B, 1, max, max)): onnxruntime's CPU kernel does not implement it")
    if rank != 1:
        rw.fail(f"a mask of rank {rank}")
    n = shape[0]
    keys = spell.positions(rw, spell.dim(rw, k_total, 2))  # (T,)
    if _same_dim(n, batch):  # end positions (right padding)
        end = spell.unsqueeze(rw, rw.op("Cast", mask, to=onnx.TensorProto.INT64), [1])
        return rw.op("Less", keys, end), 2
    two_b = isinstance(n, int) and isinstance(batch, int) and n == 2 * batch
    two_b = two_b or (isinstance(n, str) and isinstance(batch, str) and n.replace(" ", "") == f"2*{batch}")
    if two_b and allow_starts:  # end positions, then start positions (left padding)
        pair = rw.op("Cast", rw.op("Reshape", mask, spell.ints(rw, [2, -1])), to=onnx.TensorProto.INT64)
        end = spell.unsqueeze(rw, rw.op("Gather", pair, rw.const(np.int64(0)), axis=0), [1])
        start = spell.unsqueeze(rw, rw.op("Gather", pair, rw.const(np.int64(1)), axis=0), [1])
        return rw.op("And", rw.op("Less", keys, end), rw.op("GreaterOrEqual", keys, start)), 2
    if isinstance(n, int) and isinstance(batch, int) and n == 3 * batch + 2:
        rw.fail("a (3 * batch + 2) mask_index (cumulative lengths of packed sequences): not decomposed")
    rw.fail(f"a 1-D mask of length {n} that shape inference does not show to be the batch {batch}"
            + (" or twice it" if allow_starts else ""))


def _mask(rw: Rewrite, mask: str, batch, q: str, k_total: str, past_len: str | None, causal: bool,
          fill: float, cross: bool) -> str | None:
    """The additive mask M (module docstring), broadcastable to (B, N, S, T), or None. `cross`: keys of
    their own (MultiHeadAttention's key/value), whose count may exceed the queries'."""
    m = None
    if mask:
        keep, rank = _padding_keep(rw, mask, batch, k_total, allow_starts=rw.node.op_type == "Attention")
        pad = rw.op("Where", keep, rw.const(np.float32(0.0)), rw.const(np.float32(fill)))
        m = spell.unsqueeze(rw, pad, [1, 2] if rank == 2 else [1])  # (B, 1, 1|S, T)
    if causal:
        seq = spell.dim(rw, q, 2)
        rows = spell.unsqueeze(rw, spell.positions(rw, seq), [1])  # (S, 1)
        keys = spell.positions(rw, spell.dim(rw, k_total, 2))  # (T,)
        keep = rw.op("LessOrEqual", keys, rw.op("Add", rows, past_len) if past_len is not None else rows)
        if cross:  # the kernel's causal loop stops before the last query row, which sees every key
            last = rw.op("Equal", rows, rw.op("Sub", seq, rw.const(np.int64(1))))
            keep = rw.op("Or", keep, last)
        c = rw.op("Where", keep, rw.const(np.float32(0.0)), rw.const(np.float32(LOWEST)))
        m = c if m is None else rw.op("Add", m, c)
    return m


def _attend(rw: Rewrite, q: str, k: str, v: str, mask: str, bias: str, batch, past_len: str | None, head: int,
            v_size: int, out: str, cross: bool = False) -> None:
    """softmax(scale q kᵀ + bias + M) v, heads merged into `out` (B, S, v_size); `head` the q/k head size."""
    scale = rw.attr("scale", 0.0) or float(np.float32(1.0) / np.sqrt(np.float32(head)))
    kt = rw.op("Transpose", k, perm=[0, 1, 3, 2])
    scores = rw.op("Mul", rw.op("MatMul", q, kt), rw.const(np.float32(scale)))
    if bias:
        scores = rw.op("Add", scores, bias)
    m = _mask(rw, mask, batch, q, k, past_len, bool(rw.attr("unidirectional", 0)),
              float(rw.attr("mask_filter_value", -10000.0)), cross)
    if m is not None:
        scores = rw.op("Add", scores, m)
    ctx = rw.op("MatMul", rw.op("Softmax", scores, axis=-1), v)
    merged = rw.op("Transpose", ctx, perm=[0, 2, 1, 3])
    rw.op("Reshape", merged, spell.ints(rw, [0, 0, v_size]), outputs=[out])


def _with_past(rw: Rewrite, past: str, new: str) -> str:
    return rw.op("Concat", past, new, axis=2) if past else new


@decomposes("Attention", domain=MICROSOFT)
def attention(rw: Rewrite) -> None:
    x, w = rw.input(0), rw.input(1)
    _float32_only(rw, x, w)
    for attr in ("do_rotary", "past_present_share_buffer"):
        if rw.attr(attr, 0):
            rw.fail(f"{attr}=1 (onnxruntime's CPU kernel does not implement it)")
    if rw.has(6):
        rw.fail("a past_sequence_length input (the shared past/present buffer of CUDA decoding)")
    heads = rw.attr("num_heads")
    wshape = rw.shape(w)
    total = wshape[1] if wshape and len(wshape) == 2 and isinstance(wshape[1], int) else None
    sizes = list(rw.attr("qkv_hidden_sizes", []) or [])
    if not sizes:
        if total is None or total % 3:
            rw.fail(f"weights of shape {wshape}: the Q/K/V split is not known (no qkv_hidden_sizes)")
        sizes = [total // 3] * 3
    dq, dk, dv = sizes
    if dq != dk or any(d % heads for d in sizes):
        rw.fail(f"qkv_hidden_sizes {sizes} with {heads} heads: Q and K sizes must agree and divide by the heads")
    qkv = rw.op("MatMul", x, w)
    if rw.has(2):
        qkv = rw.op("Add", qkv, rw.input(2))
    q3, k3, v3 = spell.split(rw, qkv, sizes, axis=2)
    q, k, v = (_to_heads(rw, t, heads, d // heads) for t, d in ((q3, dq), (k3, dk), (v3, dv)))
    past_len = None
    if rw.has(4):
        if not dq == dk == dv:
            rw.fail(f"past state with Q/K/V sizes {sizes} (onnxruntime requires them equal)")
        past = rw.input(4)
        k = _with_past(rw, rw.op("Gather", past, rw.const(np.int64(0)), axis=0), k)
        v = _with_past(rw, rw.op("Gather", past, rw.const(np.int64(1)), axis=0), v)
        past_len = spell.dim(rw, past, 3)
    if rw.output(1):
        rw.op("Concat", spell.unsqueeze(rw, k, [0]), spell.unsqueeze(rw, v, [0]), axis=0, outputs=[rw.output(1)])
    batch = (rw.shape(x) or [None])[0]
    _attend(rw, q, k, v, rw.input(3), rw.input(5), batch, past_len, dq // heads, dv, rw.output(0))


@decomposes("MultiHeadAttention", domain=MICROSOFT)
def multi_head_attention(rw: Rewrite) -> None:
    query, key, value = rw.input(0), rw.input(1), rw.input(2)
    _float32_only(rw, query, key, value)
    qshape, kshape = rw.shape(query), rw.shape(key) if key else None
    if qshape is not None and len(qshape) == 5 or not key:
        rw.fail("packed QKV in query (B, L, N, 3, H): onnxruntime's CPU kernel does not implement it")
    if kshape is not None and len(kshape) == 5:
        rw.fail("packed KV in key (B, L, N, 2, H): onnxruntime's CPU kernel does not implement it")
    for i, what in ((8, "past_sequence_length"), (9, "cache_indirection")):
        if rw.has(i):
            rw.fail(f"a {what} input (the shared-buffer / beam-search decoding of CUDA)")
    if rw.output(3):
        rw.fail("its qk output is read")
    heads = rw.attr("num_heads")
    dq = rw.static_dim(query, 2)
    if dq is None or dq % heads:
        rw.fail(f"query hidden size {dq} is not known or not a multiple of {heads} heads")
    if kshape is None or len(kshape) not in (3, 4):
        rw.fail(f"key of shape {kshape}: expected (B, L, D) or (B, N, L, H)")
    bnsh = len(kshape) == 4
    if bnsh:
        dv = rw.static_dim(value, 3)
        dv = dv * heads if dv is not None else None
    else:
        dv = rw.static_dim(value, 2)
    if dv is None:
        rw.fail("the value's hidden size is not known")
    bias_q = bias_k = bias_v = ""
    if rw.has(3):
        bias_q, bias_k, bias_v = spell.split(rw, rw.input(3), [dq, dq, dv], axis=0)
    q = _to_heads(rw, rw.op("Add", query, bias_q) if bias_q else query, heads, dq // heads)
    if bnsh:  # already (B, N, L, H): no bias, no past (the CPU kernel's kv_BNSH path)
        if rw.has(6) or rw.has(7):
            rw.fail("past_key/past_value with key/value already in heads (B, N, L, H)")
        k, v = key, value
    else:
        k = _to_heads(rw, rw.op("Add", key, bias_k) if bias_k else key, heads, dq // heads)
        v = _to_heads(rw, rw.op("Add", value, bias_v) if bias_v else value, heads, dv // heads)
    past_len = None
    if rw.has(6) != rw.has(7):
        rw.fail("only one of past_key / past_value is given")
    if rw.has(6):
        k, v = _with_past(rw, rw.input(6), k), _with_past(rw, rw.input(7), v)
        past_len = spell.dim(rw, rw.input(6), 2)
    rw.identity(k, rw.output(1))
    rw.identity(v, rw.output(2))
    batch = (qshape or [None])[0]
    cross = bnsh or key != query
    _attend(rw, q, k, v, rw.input(4), rw.input(5), batch, past_len, dq // heads, dv, rw.output(0), cross)
