"""Opset-aware spellings of the few standard ops whose signature changed (axes and split sizes became inputs
at opset 13, ReduceMean's axes at 18), for the decompositions of graphconv/frontend/contrib/."""

from __future__ import annotations

import numpy as np

from graphconv.frontend.contrib.rewrite import Rewrite


def ints(rw: Rewrite, values) -> str:
    return rw.const(np.asarray(values, np.int64))


def unsqueeze(rw: Rewrite, x: str, axes: list[int]) -> str:
    if rw.opset >= 13:
        return rw.op("Unsqueeze", x, ints(rw, axes))
    return rw.op("Unsqueeze", x, axes=axes)


def split(rw: Rewrite, x: str, sizes: list[int], axis: int, outputs: list[str] | None = None) -> list[str]:
    outs = outputs if outputs is not None else len(sizes)
    if rw.opset >= 13:
        return rw.op("Split", x, ints(rw, sizes), outputs=outs, axis=axis)
    return rw.op("Split", x, outputs=outs, axis=axis, split=list(sizes))


def reduce_sum(rw: Rewrite, x: str, axes: list[int], keepdims: int) -> str:
    if rw.opset >= 13:
        return rw.op("ReduceSum", x, ints(rw, axes), keepdims=keepdims)
    return rw.op("ReduceSum", x, axes=axes, keepdims=keepdims)


def dim(rw: Rewrite, x: str, axis: int) -> str:
    """x.shape[axis] as an int64 scalar computed at run time."""
    return rw.op("Gather", rw.op("Shape", x), rw.const(np.int64(axis)), axis=0)


def positions(rw: Rewrite, length: str) -> str:
    """Range(0, length) of an int64 scalar `length`: 0, 1, ..., length - 1."""
    return rw.op("Range", rw.const(np.int64(0)), length, rw.const(np.int64(1)))
