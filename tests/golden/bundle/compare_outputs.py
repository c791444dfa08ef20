#!/usr/bin/env python3
"""Compare a device run with this bundle's reference outputs. Runs anywhere: needs numpy only.

    python compare_outputs.py RUN_DIR                 # RUN_DIR/<case>.npz for every case in reference/cases.json
    python compare_outputs.py RUN.npz --case case0    # one case
    options: --precision fp32|fp16|bf16 (tolerance; default: the bundle's), --atol X --rtol X, --json

A run file is an .npz keyed by output name (what mindspore/infer_mindspore.py and lite/infer_lite.py write).
The rule is graphconv's: elementwise |actual - reference| <= atol + rtol * |reference|; integers and bools
must match exactly; inf/NaN must match in kind; positions whose attention-mask entry is 0 (the left-padded
row of the reference inputs) are skipped. Exit code 0 when every output of every case passes, 1 when one
fails, 2 when files are missing or unreadable.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# ---- graphconv's comparison rule: the source of graphconv/verify/compare.py when this bundle was written ----


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


# ---- the command line ----

# --precision -> the dtype whose DEFAULT_TOLERANCE applies
PRECISION_DTYPE = {'fp32': 'float32', 'fp16': 'float16', 'bf16': 'bfloat16'}
TOLERANCE = {p: default_tolerance(dtype) for p, dtype in PRECISION_DTYPE.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description="Compare a device run with the bundle's reference outputs.")
    p.add_argument("run", type=Path, help="a directory of <case>.npz, or one .npz with --case")
    p.add_argument("--case", help="the reference case RUN (a file) belongs to")
    p.add_argument("--precision", choices=sorted(TOLERANCE), help="tolerance preset (default: the bundle's)")
    p.add_argument("--atol", type=float)
    p.add_argument("--rtol", type=float)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    meta = json.loads((HERE / "reference" / "cases.json").read_text())
    precision = args.precision or meta["precision"]
    atol, rtol = TOLERANCE[precision]
    atol = args.atol if args.atol is not None else atol
    rtol = args.rtol if args.rtol is not None else rtol
    cases = {c["name"]: c for c in meta["cases"] if c.get("outputs")}
    if not cases:
        print("this bundle has no reference outputs", file=sys.stderr)
        return 2
    if args.run.is_dir():
        todo = [(name, args.run / f"{name}.npz") for name in cases]
    elif args.case:
        if args.case not in cases:
            print(f"unknown case {args.case!r} (cases: {', '.join(cases)})", file=sys.stderr)
            return 2
        todo = [(args.case, args.run)]
    else:
        stem = args.run.stem
        if stem not in cases:
            print(f"say which case {args.run} is (--case NAME; cases: {', '.join(cases)})", file=sys.stderr)
            return 2
        todo = [(stem, args.run)]
    results, failed, missing = [], False, False
    for name, path in todo:
        case = cases[name]
        if not path.is_file():
            print(f"missing run file {path} for case {name}", file=sys.stderr)
            missing = True
            continue
        with np.load(HERE / case["outputs"]) as ref, np.load(path) as got:
            mask = np.load(HERE / case["mask"]) if case.get("mask") else None
            for out in meta["outputs"]:
                o = out["name"]
                if o not in got.files:
                    r = {"ok": False, "reason": f"output {o!r} missing from {path.name}"}
                else:
                    expected = ref[o]
                    valid = mask if (mask is not None and expected.ndim >= mask.ndim
                                     and expected.shape[:mask.ndim] == mask.shape) else None
                    r = compare(got[o], expected, atol, rtol, valid).as_dict()
                r.update(case=name, output=o)
                results.append(r)
                failed |= not r["ok"]
    if args.json:
        print(json.dumps({"precision": precision, "atol": atol, "rtol": rtol, "results": results}, indent=2))
    else:
        for r in results:
            status = "ok" if r["ok"] else ("SUSPICIOUS" if r.get("suspicious") else "FAIL")
            detail = f"max abs {r['max_abs']:.3g}, cosine {r['cosine']:.6f}" if "max_abs" in r else ""
            print(f"{r['case']:>10} {r['output']:<24} {status:<10} {detail} {r['reason']}".rstrip())
        print(f"{'FAILED' if failed or missing else 'passed'} (atol={atol:g}, rtol={rtol:g}, precision {precision})")
    if missing:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
