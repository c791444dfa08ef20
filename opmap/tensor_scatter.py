"""TensorScatter (opset 24): a KV-cache write, present = past with update written at write_indices[b] along axis.

As the ONNX reference: for each batch b and update position s < sequence_length, present[b, ..., w[b] + s, ...] =
update[b, ..., s, ...] (mode "circular": the position modulo max_sequence_length); write_indices default to 0.
Lowered as a gather, not a scatter: cache position p reads update position s = p - w[b] (mod max in circular
mode) where 0 <= s < sequence_length, and keeps the past value elsewhere. In circular mode an update longer than
the cache would overwrite itself (the last write wins): refused.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register


@register("TensorScatter", since=24)
def tensor_scatter(n):
    rank = n.require_rank(0)
    axis = n.axis(int(n.attr("axis", -2)), rank)
    if axis == 0:
        n.fail("axis 0 is the batch axis (the spec forbids it)")
    mode = n.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        n.fail(f"mode {mode!r} (linear or circular)")
    max_len, seq_len = n.shape(0)[axis], (n.shape(1) or [None] * rank)[axis]
    if not isinstance(max_len, int) or not isinstance(seq_len, int):
        n.fail("the cache and update lengths along the axis must be static")
    if mode == "circular" and seq_len > max_len:
        n.fail(f"a circular update of length {seq_len} longer than the cache ({max_len})")
    i64 = n.ms_dtype(ir.DataType.INT64)
    positions = n.const_tensor(np.arange(max_len, dtype=np.int64)[None, :], "positions")  # (1, max)
    if n.has(2):
        source = n.binop("-", positions, n.call("ops.reshape", n.x(2), (-1, 1)))  # (B, max)
    else:
        source = positions
    if mode == "circular":
        source = n.call("ops.remainder", source, max_len)
    valid = n.call("ops.logical_and", n.binop(">=", source, 0), n.binop("<", source, seq_len))
    index = n.call("ops.where", valid, source, n.call("ops.zeros_like", source))
    for _ in range(axis - 1):  # (B, max) -> (B, 1.., max, 1..): the axis in place
        index, valid = n.call("ops.expand_dims", index, 1), n.call("ops.expand_dims", valid, 1)
    for _ in range(rank - axis - 1):
        index, valid = n.call("ops.expand_dims", index, -1), n.call("ops.expand_dims", valid, -1)
    past, update = n.x(0), n.x(1)
    full = n.binop("+", index, n.call("ops.cast", n.call("ops.zeros_like", past), i64))  # past's shape
    gathered = n.call("ops.gather_elements", update, axis, full)
    return n.call("ops.where", valid, gathered, past)
