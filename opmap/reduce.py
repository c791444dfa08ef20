"""Reductions and normalising activations: Reduce*, ArgMax/ArgMin, Softmax, LogSoftmax.

Reduce* took `axes` as an attribute until opset 18 (ReduceSum: 13) and as an input from then on.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register


def _square(n, x):
    return n.binop("*", x, x)


# op -> (n, x, axes, keepdims) -> the reduction
_REDUCE = {
    "ReduceMean": lambda n, x, axes, k: n.call("ops.mean", x, axes, keep_dims=k),
    "ReduceSum": lambda n, x, axes, k: n.call("ops.sum", x, axes, keepdim=k),
    "ReduceMax": lambda n, x, axes, k: n.call("ops.amax", x, axes, keepdims=k),
    "ReduceMin": lambda n, x, axes, k: n.call("ops.amin", x, axes, keepdims=k),
    "ReduceProd": lambda n, x, axes, k: n.call("ops.prod", x, axes, keep_dims=k),
    "ReduceL1": lambda n, x, axes, k: n.call("ops.sum", n.call("ops.abs", x), axes, keepdim=k),
    "ReduceL2": lambda n, x, axes, k: n.call("ops.sqrt", n.call("ops.sum", _square(n, x), axes, keepdim=k)),
    "ReduceSumSquare": lambda n, x, axes, k: n.call("ops.sum", _square(n, x), axes, keepdim=k),
    "ReduceLogSum": lambda n, x, axes, k: n.call("ops.log", n.call("ops.sum", x, axes, keepdim=k)),
    "ReduceLogSumExp": lambda n, x, axes, k: n.call("ops.logsumexp", x, axes, keepdim=k),
}


def _reduce(build, axes_is_input: bool):
    def lower(n):
        rank = n.require_rank(0)
        if axes_is_input:
            axes = n.require_ints(1, "reduction axes") if n.has(1) else []
        else:
            axes = n.attr("axes") or []
        if not axes:
            if n.attr("noop_with_empty_axes", 0):
                return n.x(0)
            axes = list(range(rank))
        axes = tuple(sorted(n.axis(a, rank) for a in axes))
        keep = bool(n.attr("keepdims", 1))
        op = n.node.op_type
        shape = n.shape(0) or []
        if any(i < len(shape) and shape[i] == 0 for i in axes):
            return _empty_reduction(n, op, axes, keep)
        if n.dtype(0) == ir.DataType.BOOL and op in ("ReduceMax", "ReduceMin"):
            fn = "ops.any" if op == "ReduceMax" else "ops.all"  # max of bools is any, min is all
            return n.call(fn, n.x(0), axes, keep)
        return build(n, n.x(0), axes, keep)

    return lower


def _empty_reduction(n, op: str, axes: tuple, keep: bool):
    """A reduction over an empty axis: the identity of the reduction, in the output's shape (0 for sums, 1 for
    products, the lowest / highest value for max / min, -inf for the log-sums)."""
    shape = n.shape(0)
    if not all(isinstance(d, int) for d in shape):
        n.fail("a reduction over an empty axis needs a static shape")
    out = [1 if i in axes else d for i, d in enumerate(shape) if keep or i not in axes]
    np_dt = n.dtype(0).numpy()
    kind = np.dtype(np_dt).kind
    if op == "ReduceProd":
        value = 1
    elif op in ("ReduceMax", "ReduceMin"):
        big = True if kind == "b" else (np.inf if kind == "f" else np.iinfo(np_dt).max)
        low = False if kind == "b" else (-np.inf if kind == "f" else np.iinfo(np_dt).min)
        value = low if op == "ReduceMax" else big
    elif op in ("ReduceLogSum", "ReduceLogSumExp"):
        value = -np.inf
    else:
        value = 0
    return np.full(out, value, dtype=np_dt)


for _op, _t in _REDUCE.items():
    register(_op, since=1)(_reduce(_t, axes_is_input=False))
    register(_op, since=13 if _op == "ReduceSum" else 18)(_reduce(_t, axes_is_input=True))


@register("ArgMax", "ArgMin", since=13)
def arg_reduce(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", 0), rank)
    fn = "ops.argmax" if n.node.op_type == "ArgMax" else "ops.argmin"
    keep = bool(n.attr("keepdims", 1))
    i64 = n.ms_dtype(ir.DataType.INT64)
    if n.attr("select_last_index", 0):
        # The last extreme is the first one of the reversed axis: index dim - 1 - (argmax of the flip).
        dim = (n.shape(0) or [None] * rank)[axis]
        dim = dim if isinstance(dim, int) else n.getitem(n.call("ops.dyn_shape", n.x(0)), axis)
        flipped = n.call("ops.cast", n.call(fn, n.call("ops.flip", n.x(0), (axis,)), axis, keep), i64)
        return n.binop("-", n.binop("-", dim, 1), flipped)
    return n.call("ops.cast", n.call(fn, n.x(0), axis, keep), i64)


@register("Softmax", since=13)
def softmax(n):
    """MindSpore's CPU softmax (graph mode) returns zeros for the whole tensor when one slice along the axis is
    all -inf: such slices go in as zeros and come out as NaN, as ONNX defines them (exp(-inf - -inf))."""
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", -1), rank)
    x = n.x(0)
    live = n.binop(">", n.call("ops.amax", x, axis, keepdims=True), float("-inf"))
    y = n.call("ops.softmax", n.call("ops.where", live, x, n.call("ops.zeros_like", x)), axis)
    nan = n.const_tensor(np.array(np.nan, n.dtype(0).numpy()), "nan")
    return n.call("ops.where", live, y, nan)


@register("LogSoftmax", since=13)
def log_softmax(n):
    rank = n.require_rank(0)
    return n.call("ops.log_softmax", n.x(0), n.axis(n.attr("axis", -1), rank))


@register("Hardmax", since=13)
def hardmax(n):
    """1 at the first maximum along axis, 0 elsewhere."""
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", -1), rank)
    dim = (n.shape(0) or [None] * rank)[axis]
    if not isinstance(dim, int):
        n.fail("the axis must have a static size")
    positions = n.const_tensor(np.arange(dim, dtype=np.int64).reshape((-1,) + (1,) * (rank - axis - 1)), "positions")
    first = n.call("ops.cast", n.call("ops.argmax", n.x(0), axis, True), n.ms_dtype(ir.DataType.INT64))
    return n.call("ops.cast", n.call("ops.equal", positions, first), n.ms_dtype(n.dtype(0)))


@register("CumProd", since=26)
def cumprod(n):
    """Like CumSum (opmap/shape.py): reverse by flipping; exclusive shifts the products one step along the axis,
    a slice of ones first (not y / x, which a zero would break)."""
    rank = n.require_rank(0)
    axis = n.axis(n.require_ints(1, "CumProd axis")[0], rank)
    x = n.x(0)
    reverse = n.attr("reverse", 0)
    if reverse:
        x = n.call("ops.flip", x, (axis,))
    y = n.call("ops.cumprod", x, axis)
    if n.dtype(0) not in (None, ir.DataType.INT64, ir.DataType.FLOAT):
        y = n.call("ops.cast", y, n.ms_dtype(n.dtype(0)))  # ops.cumprod widens int32 to int64
    if n.attr("exclusive", 0):
        lead = (slice(None),) * axis
        first = n.call("ops.ones_like", n.getitem(y, lead + (slice(0, 1),)))
        y = n.call("ops.concat", n.tuple(first, n.getitem(y, lead + (slice(None, -1),))), axis)
    if reverse:
        y = n.call("ops.flip", y, (axis,))
    return y
