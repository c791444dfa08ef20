"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 13), as the ONNX reference computes them.

loss[n, d...] = -input[n, target[n, d...], d...] * weight[target] (weight 1 without one); a target equal to
ignore_index contributes 0 and is left out of the mean's denominator. mean = sum(loss) / sum(weights taken).
Targets equal to ignore_index may lie outside [0, C): they are replaced by 0 before indexing.
"""

from __future__ import annotations

from opmap.registry import register


def _nll(n, log_prob: str, target: str, weight: str | None) -> str:
    dt = n.ms_dtype(n.dtype(0))
    ignore = n.attr("ignore_index", None)
    reduction = n.attr("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction not in ("none", "sum", "mean"):
        n.fail(f"reduction={reduction!r} is not supported")
    t = n.tmp(f"ops.cast({target}, ms.int64)", "target")
    valid = None
    if ignore is not None:
        valid = n.tmp(f"{t} != {int(ignore)}", "valid")
        t = n.tmp(f"ops.where({valid}, {t}, ops.zeros_like({t}))", "target_safe")
    picked = n.tmp(f"ops.squeeze(ops.gather_elements({log_prob}, 1, ops.expand_dims({t}, 1)), 1)", "picked")
    w = None
    if weight is not None:
        w = f"ops.gather({weight}, {t}, 0)"
    if valid is not None:
        v = f"ops.cast({valid}, {dt})"
        w = v if w is None else f"{w} * {v}"
    if w is not None:
        w = n.tmp(w, "w")
    loss = f"-{picked}" if w is None else f"-{picked} * {w}"
    if reduction == "none":
        return loss
    total = f"ops.sum({loss})"
    if reduction == "sum":
        return total
    return f"{total} / ops.sum({w})" if w is not None else f"ops.mean({loss})"


@register("NegativeLogLikelihoodLoss", since=13)
def negative_log_likelihood_loss(n):
    return _nll(n, n.x(0), n.x(1), n.x(2) if n.has(2) else None)


@register("SoftmaxCrossEntropyLoss", since=13)
def softmax_cross_entropy_loss(n):
    log_prob = n.tmp(f"ops.log_softmax({n.x(0)}, 1)", "log_prob")
    loss = _nll(n, log_prob, n.x(1), n.x(2) if n.has(2) else None)
    return (loss, log_prob) if n.n_outputs > 1 else loss
