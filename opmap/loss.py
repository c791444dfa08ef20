"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 13), as the ONNX reference computes them.

loss[n, d...] = -input[n, target[n, d...], d...] * weight[target] (weight 1 without one); a target equal to
ignore_index contributes 0 and is left out of the mean's denominator. mean = sum(loss) / sum(weights taken).
Targets equal to ignore_index may lie outside [0, C): they are replaced by 0 before indexing.
"""

from __future__ import annotations

import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register


def _nll(n, log_prob, target, weight):
    dt = n.ms_dtype(n.dtype(0))
    ignore = n.attr("ignore_index", None)
    reduction = text(n.attr("reduction", "mean"))
    if reduction not in ("none", "sum", "mean"):
        n.fail(f"reduction={reduction!r} is not supported")
    t = n.call("ops.cast", target, n.ms_dtype(ir.DataType.INT64))
    valid = None
    if ignore is not None:
        valid = n.binop("!=", t, int(ignore))
        t = n.call("ops.where", valid, t, n.call("ops.zeros_like", t))
    picked = n.call("ops.squeeze", n.call("ops.gather_elements", log_prob, 1, n.call("ops.expand_dims", t, 1)), 1)
    w = None
    if weight is not None:
        w = n.call("ops.gather", weight, t, 0)
    if valid is not None:
        v = n.call("ops.cast", valid, dt)
        w = v if w is None else n.binop("*", w, v)
    loss = n.unop("-", picked)
    if w is not None:
        loss = n.binop("*", loss, w)
    if reduction == "none":
        return loss
    total = n.call("ops.sum", loss)
    if reduction == "sum":
        return total
    return n.binop("/", total, n.call("ops.sum", w)) if w is not None else n.call("ops.mean", loss)


@register("NegativeLogLikelihoodLoss", since=13)
def negative_log_likelihood_loss(n):
    return _nll(n, n.x(0), n.x(1), n.x(2) if n.has(2) else None)


@register("SoftmaxCrossEntropyLoss", since=13)
def softmax_cross_entropy_loss(n):
    log_prob = n.call("ops.log_softmax", n.x(0), 1)
    loss = _nll(n, log_prob, n.x(1), n.x(2) if n.has(2) else None)
    return (loss, log_prob) if n.n_outputs > 1 else loss
