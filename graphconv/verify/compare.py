"""The one comparison rule every part of graphconv uses (verify, debug, matrix, tests).

elementwise |a - b| <= atol + rtol * |b| with b the reference; per-dtype default tolerances; integers and
bools must match exactly; inf/NaN must match in kind. A result that only holds at 100x the tolerance is
*suspicious*.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# (atol, rtol) per floating dtype of the *reference* computation.
DEFAULT_TOLERANCE = {
    "float32": (1e-4, 1e-4),
    "float64": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (3e-2, 3e-2),
}
SUSPICIOUS_FACTOR = 100.0
# A float32 tensor reaching this magnitude is at the end of its range (float32 ends at 3.4e38); failures no
# larger than EDGE_ROUNDING times its magnitude are float rounding (Comparison.overflow).
EDGE_OF_RANGE = 1e30
EDGE_ROUNDING = 1e-6


def default_tolerance(precision: str) -> tuple[float, float]:
    return DEFAULT_TOLERANCE.get(precision, DEFAULT_TOLERANCE["float32"])


@dataclasses.dataclass
class Comparison:
    """How one actual tensor compares with its reference."""

    ok: bool
    suspicious: bool  # fails the rule but holds at SUSPICIOUS_FACTOR x the tolerance
    max_abs: float
    mean_abs: float
    cosine: float
    compared: int  # number of elements compared (after masking)
    reason: str = ""  # why ok is False, in a few words
    # fails only where both sides are non-finite, in different kinds (inf vs NaN, +inf vs -inf), or by no
    # more than float rounding at the end of the range: float overflow, whose outcome depends on the order
    # of the arithmetic
    overflow: bool = False
    # a low-precision output judged against the model's exact values: the other distances from them
    exact: dict | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def compare(
    actual: np.ndarray,
    expected: np.ndarray,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    valid: np.ndarray | None = None,
) -> Comparison:
    """Compare actual with the reference `expected`.

    `valid` is a boolean array broadcastable to the leading dims of `expected`: only those positions are
    compared (left-padded positions of an attention mask are undefined and skipped).
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return Comparison(False, False, float("inf"), float("inf"), 0.0, 0,
                          f"shape {list(actual.shape)} != reference {list(expected.shape)}")
    if valid is not None:
        keep = np.broadcast_to(valid.reshape(valid.shape + (1,) * (expected.ndim - valid.ndim)), expected.shape)
        actual, expected = actual[keep], expected[keep]
    actual, expected = actual.ravel(), expected.ravel()
    n = int(expected.size)
    exact_kind = expected.dtype.kind in "biuU" or actual.dtype.kind in "biuU"
    if exact_kind:
        equal = actual == expected
        diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64)) if n else np.zeros(0)
        ok = bool(np.all(equal))
        mx = float(diff.max()) if n else 0.0
        return Comparison(ok, False, mx, float(diff.mean()) if n else 0.0,
                          _cosine(actual.astype(np.float64), expected.astype(np.float64)), n,
                          "" if ok else f"{int((~equal).sum())} of {n} elements differ (exact match required)")
    a = actual.astype(np.float64)
    b = expected.astype(np.float64)
    finite_b = np.isfinite(b)
    # Non-finite values must match in kind: NaN where NaN, +inf where +inf, -inf where -inf.
    kind_ok = (np.isnan(a) == np.isnan(b)) & (np.isposinf(a) == np.isposinf(b)) & (np.isneginf(a) == np.isneginf(b))
    both_finite = finite_b & np.isfinite(a)
    diff = np.abs(a[both_finite] - b[both_finite])
    bound = atol + rtol * np.abs(b[both_finite])
    mx = float(diff.max()) if diff.size else 0.0
    mean = float(diff.mean()) if diff.size else 0.0
    cos = _cosine(np.where(both_finite, a, 0.0), np.where(both_finite, b, 0.0))
    bad_kind = int((~kind_ok).sum())
    within = diff <= bound
    if bad_kind:
        overflow = bool(np.all(~np.isfinite(a[~kind_ok])) and np.all(~finite_b[~kind_ok]) and np.all(within))
        return Comparison(False, False, mx, mean, cos, n,
                          f"{bad_kind} of {n} elements differ in inf/NaN kind from the reference", overflow)
    if bool(np.all(within)):
        return Comparison(True, False, mx, mean, cos, n)
    suspicious = bool(np.all(diff <= SUSPICIOUS_FACTOR * bound))
    # Values at the end of float32's range (a weight of 3e38): float32's rounding there is ~1e31, far beyond
    # any tolerance, and which way it goes depends on the order of the arithmetic; failures that small
    # against the tensor's magnitude are that rounding, like the overflow above.
    scale = float(np.abs(b[both_finite]).max()) if diff.size else 0.0
    edge = (expected.dtype.itemsize >= 4 and scale >= EDGE_OF_RANGE
            and bool(np.all(diff[~within] <= EDGE_ROUNDING * scale)))
    return Comparison(False, suspicious, mx, mean, cos, n,
                      f"{int((~within).sum())} of {n} elements exceed atol={atol:g} + rtol={rtol:g}*|ref|", edge)


# A low-precision network against the model's exact values (graphconv/verify/exact.py): it passes where it
# meets the rule against them, or where its typical distance from them (mean abs) is at most EXACT_FACTOR times
# that of the graph computed with every op rounded to its dtype, and its largest (max abs) at most
# EXACT_MAX_FACTOR times that one's. The mean is the measure: two roundings of the same graph agree there to a
# few percent, where their largest distances differ by a quarter either way (docs/design.md, Comparison rule).
EXACT_FACTOR = 1.2
EXACT_MAX_FACTOR = 1.5


def judge_against_exact(actual: np.ndarray, oracle: np.ndarray, exact: np.ndarray, rounded: np.ndarray,
                        atol: float, rtol: float, valid: np.ndarray | None = None) -> Comparison:
    """A low-precision network's output against the model's exact values `exact`: ok when it meets the rule
    against them, or when it is as far from them as `rounded`, the graph computed with every op rounded to its
    dtype (an ideal fp16 device): mean abs within EXACT_FACTOR and max abs within EXACT_MAX_FACTOR of that
    one's. The Comparison's numbers are the network's distances from the exact values; `exact` gives the
    rounded run's and onnxruntime's (`oracle`) beside them. (onnxruntime is no measure here: on a CPU without
    fp16 kernels it computes chains of fp16 ops in fp32 and rounds only at their ends.)"""
    net = compare(actual, exact, atol, rtol, valid)
    per_op = compare(rounded, exact, atol, rtol, valid)
    ort = compare(oracle, exact, atol, rtol, valid)

    def ratio(a: float, b: float) -> float:
        return a / b if b else (0.0 if a == 0 else float("inf"))

    mean_ratio, max_ratio = ratio(net.mean_abs, per_op.mean_abs), ratio(net.max_abs, per_op.max_abs)
    within_factor = bool(np.isfinite(net.max_abs)) and mean_ratio <= EXACT_FACTOR and max_ratio <= EXACT_MAX_FACTOR \
        and not net.reason.endswith("inf/NaN kind from the reference") and net.compared == per_op.compared
    ok = net.ok or within_factor
    beyond = [f"its mean abs {net.mean_abs:.3g} is {mean_ratio:.2f}x the {per_op.mean_abs:.3g} of the graph rounded "
              f"at every op (at most {EXACT_FACTOR:g}x)"] if mean_ratio > EXACT_FACTOR else []
    if max_ratio > EXACT_MAX_FACTOR:
        beyond.append(f"its max abs {net.max_abs:.3g} is {max_ratio:.2f}x that graph's {per_op.max_abs:.3g} (at most "
                      f"{EXACT_MAX_FACTOR:g}x)")
    reason = "" if ok else f"{net.reason} of the exact values, and " + " and ".join(beyond or ["it is not comparable"])
    return dataclasses.replace(net, ok=ok, suspicious=net.suspicious and not ok, reason=reason, exact={
        "rounded_max_abs": per_op.max_abs, "rounded_mean_abs": per_op.mean_abs, "ratio": max_ratio,
        "mean_ratio": mean_ratio, "onnxruntime_max_abs": ort.max_abs, "onnxruntime_mean_abs": ort.mean_abs,
        "passed_by": "tolerance" if net.ok else "factor" if ok else None})
