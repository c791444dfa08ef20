#!/usr/bin/env python3
"""fp16_rounding: how far an fp16 model's own oracle is from the exact values, next to graphconv's network.

An fp16 model's oracle, onnxruntime, rounds every op's result to fp16. graphconv's fused ops compute inside
in fp32, as their Ascend kernels do (a Swiglu rounds once, where the decomposed graph rounds after each of
its three ops), so the compiled network and the oracle round at different places. This measures, on
compile_scale's Llama-shaped fp16 model (the same generator, seed and defaults), for the two reference cases
a compile makes:

- R: onnxruntime on the fp16 model, one layer at a time (graphconv.verify.piecewise: the compile's oracle);
- E: the compiled network's outputs, MindSpore CPU running graphconv's cpu twin (`graphconv compile` at the
  default target and tolerance, its private folder kept for the outputs: GRAPHCONV_KEEP_TEMP);
- X: the exact values: compile_scale.numpy_llama in float64 on the same fp16 weights, one layer at a time;

and prints, per case, max abs, mean abs, cosine and the comparison rule's verdict at fp16's default tolerance
(graphconv.verify.compare; "A vs B": B is the reference) for X vs R (what a network computing the exact values
would get from the compile's verification), E vs R (what graphconv's gets), and R vs X, E vs X (how far each
is from the exact values). Where X fails the rule against R, the rule at that tolerance cannot be met by a
network that rounds at other places than onnxruntime does, however exact.

Run (from the repository root; --size 7b needs ~14 GB of disk for the model and ~1 GB per case of memory):

    .venv/bin/python benchmarks/fp16_rounding.py [--size small|default|7b] [--workdir DIR] [--keep] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import compile_scale  # noqa: E402  (the model generator and the float64 forward)


def log(msg: str) -> None:
    print(f"[fp16_rounding] {msg}", file=sys.stderr, flush=True)


def oracle_outputs(model_path: Path):
    """The compile's reference cases and onnxruntime's logits for them, layer by layer (the compile's oracle)."""
    from graphconv.frontend.load import load
    from graphconv.verify import piecewise, reference

    model = load(model_path).proto
    cases = reference.make_cases(model)
    pieces = piecewise.cut(model, compile_scale.layer_boundaries(model))
    expected, _, _ = piecewise.run(model, pieces, cases)
    return cases, [e["logits"] for e in expected]


def compiled_outputs(model_path: Path, work: Path) -> tuple[list[np.ndarray], dict]:
    """graphconv compile at its defaults (target ascend, the comparison rule's default tolerance), with its
    private folder kept: the cpu twin's outputs for each case (case<k>.out.npz), and the report."""
    out = work / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "graphconv", "compile", str(model_path), "-o", str(out / "model.mindir"),
           "--report", str(out / "report.json"), "-q"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "GRAPHCONV_KEEP_TEMP": "1"}, capture_output=True,
                          text=True)
    log(f"graphconv compile: exit {done.returncode} in {time.perf_counter() - t0:.1f}s")
    kept = sorted(out.glob(".graphconv-tmp-*"))
    if not kept:
        raise SystemExit(f"graphconv compile left no private folder to read its outputs from: {done.stderr[-400:]}")
    outputs = []
    for k in range(2):
        with np.load(kept[-1] / f"case{k}.out.npz") as data:
            outputs.append(data["out0"])
    report = json.loads((out / "report.json").read_text())
    return outputs, {"exit_code": done.returncode, "status": report.get("status")}


def exact_outputs(cfg, model_dir: Path, manifest: list[dict], cases) -> list[np.ndarray]:
    """numpy_llama in float64 on the fp16 weights, each weight read from the data file when reached."""
    entries = {w["name"]: w for w in manifest}
    data = model_dir / compile_scale.DATA_FILE
    return [compile_scale.numpy_llama(cfg, lambda name: compile_scale.read_weight(data, entries[name]),
                                      case.inputs["input_ids"]) for case in cases]


def row(label: str, case, got: np.ndarray, ref: np.ndarray) -> dict:
    """The comparison rule at fp16's default tolerance (graphconv.verify.compare), `ref` the reference."""
    from graphconv.verify import compare

    atol, rtol = compare.default_tolerance("float16")
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    c = compare.compare(got, ref, atol, rtol, case.valid_positions(ref))
    over = np.abs(got - ref) > atol + rtol * np.abs(ref)
    return {"pair": label, "case": case.shape_text(), "max_abs": c.max_abs, "mean_abs": c.mean_abs,
            "cosine": c.cosine, "elements_over_tolerance": int(over.sum()), "elements": int(over.size),
            "rule_at_fp16_default": "ok" if c.ok else "FAIL"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(compile_scale.SIZES), default="7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, help="empty or new directory (default: a new one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv[1:])
    cfg = compile_scale.SIZES[args.size]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fp16_rounding-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        # compile_scale's defaults: gammas random, init scaled
        model_path, manifest = compile_scale.build_model(cfg, work / "model", args.seed, "random", "fp16", "scaled")
        log(f"built {args.size} fp16 in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        cases, oracle = oracle_outputs(model_path)
        log(f"onnxruntime layer by layer in {time.perf_counter() - t0:.1f}s")
        compiled, compile_info = compiled_outputs(model_path, work)
        t0 = time.perf_counter()
        exact = exact_outputs(cfg, model_path.parent, manifest, cases)
        log(f"float64 forward in {time.perf_counter() - t0:.1f}s")
        rows = []
        for k, case in enumerate(cases):
            rows += [row("exact vs onnxruntime", case, exact[k], oracle[k]),
                     row("graphconv vs onnxruntime", case, compiled[k], oracle[k]),
                     row("onnxruntime vs exact", case, oracle[k], exact[k]),
                     row("graphconv vs exact", case, compiled[k], exact[k])]
        print(f"fp16_rounding --size {args.size}: hidden {cfg.hidden}, layers {cfg.layers}; graphconv compile exit "
              f"{compile_info['exit_code']} ({compile_info['status']}); rule at fp16's default tolerance")
        print(f"{'pair':<28} {'case':<24} {'max abs':>9} {'mean abs':>9} {'cosine':>10} {'over tol':>14}  rule")
        for r in rows:
            print(f"{r['pair']:<28} {r['case']:<24} {r['max_abs']:9.4f} {r['mean_abs']:9.5f} {r['cosine']:10.7f} "
                  f"{r['elements_over_tolerance']:>6}/{r['elements']:<7}  {r['rule_at_fp16_default']}")
        if args.json:
            print(json.dumps({"size": args.size, "compile": compile_info, "rows": rows}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
