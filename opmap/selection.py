"""Ops whose output is a data-dependent selection or permutation of the input: Compress, Unique,
ReverseSequence."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register

_I64 = ir.DataType.INT64


@register("Compress", since=11)
def compress(n):
    """numpy.compress: the slices (elements, without axis) where condition is true; a condition shorter than
    the axis drops the rest, which indices from nonzero(condition) do by themselves."""
    x = n.x(0)
    if n.attr("axis") is None:
        x, axis = n.call("ops.reshape", x, (-1,)), 0
    else:
        axis = n.axis(int(n.attr("axis")), n.require_rank(0))
    index = n.call("ops.reshape", n.call("ops.nonzero", n.x(1)), (-1,))
    return n.call("ops.gather", x, index, axis)


@register("ReverseSequence", since=10)
def reverse_sequence(n):
    op = n.call("ops.ReverseSequence", seq_dim=int(n.attr("time_axis", 0)), batch_dim=int(n.attr("batch_axis", 1)))
    return n.call(op, n.x(0), n.x(1))


def _arange(n, length):
    i64 = n.ms_dtype(_I64)
    return n.call("ops.range", n.call("Tensor", 0, i64), length, n.call("Tensor", 1, i64))


def _argsort(n, key):
    return n.call("ops.cast", n.getitem(n.call("ops.sort", key), 1), n.ms_dtype(_I64))


def _groups(n, inverse, count):
    """For inverse indices (N,) into K groups numbered 0..K-1, each group's first position and its size.
    Sorting inverse * N + position (distinct keys, so no stable sort is needed) lists every group's positions
    in order; a group starts where the group number changes."""
    positions = _arange(n, n.getitem(count, 0))
    ordered = n.getitem(n.call("ops.sort", n.binop("+", n.binop("*", inverse, count), positions)), 0)
    group = n.binop("//", ordered, count)
    head = n.call("ops.ones", (1,), n.ms_dtype(ir.DataType.BOOL))
    change = n.binop("!=", n.getitem(group, slice(1, None)), n.getitem(group, slice(None, -1)))
    starts = n.call("ops.reshape", n.call("ops.nonzero", n.call("ops.concat", (head, change))), (-1,))
    first = n.call("ops.gather", n.binop("-", ordered, n.binop("*", group, count)), starts, 0)
    counts = n.binop("-", n.call("ops.concat", (n.getitem(starts, slice(1, None)), count)), starts)
    return first, counts


@register("Unique", since=11)
def unique(n):
    """The unique values (or slices along axis), first-occurrence indices, inverse indices and counts, sorted
    ascending (sorted=1, lexicographically for slices) or in the order of first occurrence.

    Without axis, ops.unique finds the values (in an order its CPU kernel does not promise) and the inverse
    indices. With an axis, slices are compared pairwise (D x D for D slices): each slice's group is its first
    equal slice, numbered in order of first occurrence. Either way each group's first index and count follow
    from the inverse indices, and everything is then permuted into the order asked for."""
    x = n.x(0)
    i64 = n.ms_dtype(_I64)
    axis = n.attr("axis")
    if axis is None:
        axis = 0
        flat = n.call("ops.reshape", x, (-1,))
        values, inverse = n.call_n("ops.unique", 2, flat)
        inverse = n.call("ops.cast", inverse, i64)
        count = n.getitem(n.call("ops.dyn_shape", flat), slice(0, 1))
        first, counts = _groups(n, inverse, count)
        key = values if n.attr("sorted", 1) else first
    else:
        axis = n.axis(int(axis), n.require_rank(0))
        rows = _rows(n, x, axis)
        count = n.getitem(n.call("ops.dyn_shape", rows), slice(0, 1))
        positions = _arange(n, n.getitem(count, 0))
        same = n.call("ops.all", n.binop("==", n.call("ops.expand_dims", rows, 1),
                                         n.call("ops.expand_dims", rows, 0)), 2)
        # each slice's first equal slice (argmax returns the first of equal maxima)
        first_of = n.call("ops.cast", n.call("ops.argmax", n.call("ops.cast", same, n.ms_dtype(ir.DataType.INT32)), 1),
                          i64)
        is_first = n.binop("==", first_of, positions)
        group_of_first = n.binop("-", n.call("ops.cumsum", n.call("ops.cast", is_first, i64), 0), 1)
        inverse = n.call("ops.gather", group_of_first, first_of, 0)
        first, counts = _groups(n, inverse, count)
        values = n.call("ops.gather", x, first, axis)
        key = _lexicographic_rank(n, n.call("ops.gather", rows, first, 0)) if n.attr("sorted", 1) else first
    order = _argsort(n, key)
    rank = _argsort(n, order)
    return (n.call("ops.gather", values, order, axis), n.call("ops.gather", first, order, 0),
            n.call("ops.gather", rank, inverse, 0), n.call("ops.gather", counts, order, 0))


def _rows(n, x, axis):
    """x as (D, M): the slices along axis, each flattened."""
    rank = n.require_rank(0)
    perm = (axis,) + tuple(i for i in range(rank) if i != axis)
    moved = n.call("ops.transpose", x, perm) if axis else x
    shape = n.shape(0)
    d = shape[axis]
    if isinstance(d, int):
        return n.call("ops.reshape", moved, (d, -1))
    return n.call("ops.reshape", moved, n.call(n.helper("onnx_dims"), n.call(
        "ops.concat", (n.getitem(n.call("ops.dyn_shape", x), slice(axis, axis + 1)),
                       n.const_tensor(np.array([-1], np.int64), "minus_one")))))


def _lexicographic_rank(n, rows):
    """For K distinct rows (K, M): how many rows are lexicographically smaller than each (an int64 key to sort
    by). Row a < row b when at their first differing column a's value is smaller."""
    a = n.call("ops.expand_dims", rows, 1)  # (K, 1, M)
    b = n.call("ops.expand_dims", rows, 0)  # (1, K, M)
    differ = n.binop("!=", a, b)
    col = n.call("ops.argmax", n.call("ops.cast", differ, n.ms_dtype(ir.DataType.INT32)), 2, keepdim=True)
    shape = n.call("ops.dyn_shape", differ)
    col = n.call("ops.broadcast_to", col, n.call(n.helper("onnx_dims"), n.call(
        "ops.concat", (n.getitem(shape, slice(0, 2)), n.call("ops.ones", (1,), n.ms_dtype(_I64))))))
    va = n.call("ops.gather_elements", n.call("ops.broadcast_to", a, n.call(n.helper("onnx_dims"), shape)), 2, col)
    vb = n.call("ops.gather_elements", n.call("ops.broadcast_to", b, n.call(n.helper("onnx_dims"), shape)), 2, col)
    less = n.call("ops.logical_and", n.call("ops.any", differ, 2), n.call("ops.squeeze", n.binop("<", va, vb), 2))
    return n.call("ops.sum", n.call("ops.cast", less, n.ms_dtype(_I64)), 0)  # rows b < a, counted per a
