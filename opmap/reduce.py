"""Reductions and normalising activations: Reduce*, ArgMax/ArgMin, Softmax, LogSoftmax.

Reduce* took `axes` as an attribute until opset 18 (ReduceSum: 13) and as an input from then on.
"""

from __future__ import annotations

from opmap.registry import register

_REDUCE = {
    "ReduceMean": "ops.mean({x}, {axes}, keep_dims={k})",
    "ReduceSum": "ops.sum({x}, {axes}, keepdim={k})",
    "ReduceMax": "ops.amax({x}, {axes}, keepdims={k})",
    "ReduceMin": "ops.amin({x}, {axes}, keepdims={k})",
    "ReduceProd": "ops.prod({x}, {axes}, keep_dims={k})",
    "ReduceL1": "ops.sum(ops.abs({x}), {axes}, keepdim={k})",
    "ReduceL2": "ops.sqrt(ops.sum({x} * {x}, {axes}, keepdim={k}))",
    "ReduceSumSquare": "ops.sum({x} * {x}, {axes}, keepdim={k})",
    "ReduceLogSum": "ops.log(ops.sum({x}, {axes}, keepdim={k}))",
    "ReduceLogSumExp": "ops.logsumexp({x}, {axes}, keepdim={k})",
}


def _reduce(template, axes_is_input: bool):
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
        return template.format(x=n.x(0), axes=axes, k=bool(n.attr("keepdims", 1)))

    return lower


for _op, _t in _REDUCE.items():
    register(_op, since=1)(_reduce(_t, axes_is_input=False))
    register(_op, since=13 if _op == "ReduceSum" else 18)(_reduce(_t, axes_is_input=True))


@register("ArgMax", "ArgMin", since=13)
def arg_reduce(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", 0), rank)
    if n.attr("select_last_index", 0):
        n.fail("select_last_index=1 is not supported")
    fn = "ops.argmax" if n.node.op_type == "ArgMax" else "ops.argmin"
    return f"ops.cast({fn}({n.x(0)}, {axis}, {bool(n.attr('keepdims', 1))}), ms.int64)"


@register("Softmax", since=13)
def softmax(n):
    rank = n.require_rank(0)
    return f"ops.softmax({n.x(0)}, {n.axis(n.attr('axis', -1), rank)})"


@register("LogSoftmax", since=13)
def log_softmax(n):
    rank = n.require_rank(0)
    return f"ops.log_softmax({n.x(0)}, {n.axis(n.attr('axis', -1), rank)})"
