"""com.microsoft RotaryEmbedding -> the RoPE spelling of a PyTorch export (fuse-rope makes
mindspore::RotaryPositionEmbedding of it). `apply_rotary` is also GroupQueryAttention's do_rotary (gqa.py).

RotaryEmbedding(input, position_ids, cos_cache, sin_cache; interleaved=0, num_heads=0, rotary_embedding_dim=0,
scale=1.0, is_packed_batching=0) -> output, read from onnxruntime's schema and its CPU kernel
(contrib_ops/cpu/bert/rotary_embedding.cc, rotary_embedding_helper.h):
  input        (B, S, hidden) viewed as (B, S, N, H), or (B, N, S, H); H = 2 * cos_cache.shape[1] when
               rotary_embedding_dim is 0 (R = H), else hidden / num_heads (R = rotary_embedding_dim <= H)
  position_ids (B, S) int64, or one element p0 meaning positions p0 + s
  cos/sin      (max_pos, R/2); c = cos_cache[pos], s = sin_cache[pos]
  halves (interleaved 0), i < R/2:  y[i] = x[i]·c[i] - x[i+R/2]·s[i];  y[i+R/2] = x[i+R/2]·c[i] + x[i]·s[i]
  pairs  (interleaved 1):           y[2i] = x[2i]·c[i] - x[2i+1]·s[i]; y[2i+1] = x[2i+1]·c[i] + x[2i]·s[i]
  y[R:] = x[R:] (partial rotary). `scale` is read by the kernel but not used in the computation.
Written as y = x·cos + rot(x)·sin with cos = concat(c, c) and rot = concat(-x2, x1) (halves; transformers'
rotate_half), or cos = repeat_interleave(c, 2) and rot = flatten(stack(-x[1::2], x[0::2])) (pairs; GPT-J's
rotate_every_two): the two spellings fuse-rope matches. Refused: is_packed_batching (ragged batches), opset < 13.
"""

from __future__ import annotations

import numpy as np

from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite


def ints(rw: Rewrite, *values: int) -> str:
    return rw.const(np.array(values, np.int64))


def _slice_last(rw: Rewrite, x: str, start: int, end: int, step: int = 1) -> str:
    return rw.op("Slice", x, ints(rw, start), ints(rw, end), ints(rw, -1), ints(rw, step))


def widen(rw: Rewrite, c: str, rotary_dim: int, interleaved: bool) -> str:
    """(..., R/2) angles -> (..., R): concat(c, c) for halves, repeat_interleave(c, 2) for pairs (Unsqueeze,
    Expand of the new axis to 2, Reshape merging the last two axes: the form fuse-rope proves pairs of)."""
    if not interleaved:
        return rw.op("Concat", c, c, axis=-1)
    grown = rw.op("Expand", rw.op("Unsqueeze", c, ints(rw, -1)), ints(rw, 1, 1, 1, 2))
    return rw.op("Reshape", grown, ints(rw, 0, 0, rotary_dim))


def apply_rotary(rw: Rewrite, x: str, cos: str, sin: str, head_size: int, rotary_dim: int,
                 interleaved: bool) -> str:
    """RoPE on the 4-D `x` (head dim last, size `head_size`) with cos/sin already widened to `rotary_dim` and
    broadcastable to x[..., :rotary_dim]; the part beyond rotary_dim passes through."""
    xr = _slice_last(rw, x, 0, rotary_dim) if rotary_dim < head_size else x
    half = rotary_dim // 2
    if interleaved:
        even = _slice_last(rw, xr, 0, rotary_dim, 2)
        odd = _slice_last(rw, xr, 1, rotary_dim, 2)
        stacked = rw.op("Concat", rw.op("Unsqueeze", rw.op("Neg", odd), ints(rw, -1)),
                        rw.op("Unsqueeze", even, ints(rw, -1)), axis=-1)
        rot = rw.op("Reshape", stacked, ints(rw, 0, 0, 0, rotary_dim))
    else:
        x1, x2 = _slice_last(rw, xr, 0, half), _slice_last(rw, xr, half, rotary_dim)
        rot = rw.op("Concat", rw.op("Neg", x2), x1, axis=-1)
    y = rw.op("Add", rw.op("Mul", xr, cos), rw.op("Mul", rot, sin))
    if rotary_dim < head_size:
        y = rw.op("Concat", y, _slice_last(rw, x, rotary_dim, head_size), axis=-1)
    return y


@decomposes("RotaryEmbedding", domain=MICROSOFT)
def rotary_embedding(rw: Rewrite) -> None:
    x, positions, cos_cache, sin_cache = (rw.input(i) for i in range(4))
    if rw.opset < 13:
        rw.fail(f"the model's opset {rw.opset} < 13 (the decomposition writes Unsqueeze with an axes input)")
    if rw.attr("is_packed_batching", 0):
        rw.fail("is_packed_batching=1 (ragged batches) is not decomposed")
    interleaved = bool(rw.attr("interleaved", 0))
    shape, half = rw.shape(x), rw.static_dim(cos_cache, 1)
    if shape is None or len(shape) not in (3, 4):
        rw.fail(f"input of shape {shape}: a 3-D (B, S, hidden) or 4-D (B, N, S, H) input with known rank is needed")
    if half is None or rw.static_dim(sin_cache, 1) != half:
        rw.fail("cos_cache/sin_cache need the same static last dim")
    rank = len(shape)
    rotary_dim = rw.attr("rotary_embedding_dim", 0)
    heads = rw.attr("num_heads", 0)
    if rotary_dim and not heads:
        rw.fail("rotary_embedding_dim without num_heads (onnxruntime refuses it too)")
    hidden = rw.static_dim(x, 2) if rank == 3 else None
    if rank == 4:
        n, h4 = rw.static_dim(x, 1), rw.static_dim(x, 3)
        if n is None or h4 is None:
            rw.fail(f"4-D input {shape}: heads and head size must be static")
        hidden = n * h4
    if hidden is None:
        rw.fail(f"input {shape}: the hidden size must be static")
    head_size = 2 * half if not rotary_dim else hidden // heads
    rotary_dim = rotary_dim or head_size
    if hidden % head_size or rotary_dim > head_size or rotary_dim != 2 * half:
        rw.fail(f"hidden {hidden}, head size {head_size}, rotary_embedding_dim {rotary_dim} and cos_cache "
                f"last dim {half} do not fit (cos_cache must be (max_pos, rotary_dim / 2))")
    if heads and hidden != heads * head_size and not rw.attr("rotary_embedding_dim", 0):
        rw.fail(f"num_heads {heads} and the head size {head_size} of cos_cache do not make the hidden size {hidden}")
    if rank == 4 and head_size != shape[3]:
        rw.fail(f"4-D input {shape} with a head size of {head_size} from the attributes")
    pos_shape = rw.shape(positions)
    if pos_shape is None or len(pos_shape) not in (0, 1, 2) or (len(pos_shape) == 1 and pos_shape[0] != 1):
        rw.fail(f"position_ids of shape {pos_shape}: (B, S) or one element is decomposed")
    if len(pos_shape) == 2:
        pos = positions  # (B, S)
    else:  # p0 + s for s in range(S), (1, S)
        seq = rw.op("Gather", rw.op("Shape", x), rw.const(np.int64(2 if rank == 4 else 1)), axis=0)
        steps = rw.op("Range", rw.const(np.int64(0)), seq, rw.const(np.int64(1)))
        pos = rw.op("Unsqueeze", rw.op("Add", rw.op("Reshape", positions, ints(rw, 1)), steps), ints(rw, 0))
    # cos/sin (B|1, S, R) with a head axis: (B|1, 1, S, R) for BNSH, (B|1, S, 1, R) for BSNH
    head_axis = 1 if rank == 4 else 2
    cos, sin = (rw.op("Unsqueeze", widen(rw, rw.op("Gather", c, pos, axis=0), rotary_dim, interleaved),
                      ints(rw, head_axis)) for c in (cos_cache, sin_cache))
    x4 = x if rank == 4 else rw.op("Reshape", x, ints(rw, 0, 0, hidden // head_size, head_size))
    y = apply_rotary(rw, x4, cos, sin, head_size, rotary_dim, interleaved)
    if rank == 3:
        rw.op("Reshape", y, ints(rw, 0, 0, hidden), outputs=[rw.output(0)])
    else:
        rw.identity(y, rw.output(0))
