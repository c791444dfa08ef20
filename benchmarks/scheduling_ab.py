#!/usr/bin/env python3
"""scheduling_ab: does each latency mechanism of graphconv/runtime/scheduling.py pay for itself?

Times `graphconv compile MODEL` (its defaults: target ascend, onnxsim and verification on) as a whole process,
in interleaved pairs: A with every mechanism on (the default schedule), B with one mechanism off
(GRAPHCONV_SCHEDULING=-NAME), A B A B ... so that the machine's drift hits both alike. For each mechanism it
prints every pair (wall, and the peak RSS of the process tree polled every 0.1 s), the median gain (B - A) and
its spread (the interquartile range of the pairs' differences), and whether the gain exceeds the spread. Then
all on against all off (GRAPHCONV_SCHEDULING=off). With --baseline-repo DIR, also the compile of another
checkout (the code before a change: `python -m graphconv` run in DIR) against this one, every mechanism on.

The model is the 1.1B benchmark model of benchmarks/compile_scale.py (TinyLlama-1.1B's shape, fp32, 4.4 GB of
external weights, layer-streamed), built once into --model-dir and kept:

    .venv/bin/python benchmarks/scheduling_ab.py --model-dir /path/kept [--pairs 5] [--only NAME,...]
                                                 [--baseline-repo DIR] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def log(msg: str) -> None:
    print(f"[scheduling_ab] {msg}", file=sys.stderr, flush=True)


def model_path(model_dir: Path) -> Path:
    """The 1.1B benchmark model in model_dir, built there first if absent (compile_scale's generator, its
    defaults: seed 0, norm gammas 1 + N(0, 0.02))."""
    import compile_scale

    path = model_dir / "model.onnx"
    if not path.exists():
        log(f"building the 1.1B benchmark model in {model_dir} (once)")
        compile_scale.build_model(compile_scale.SIZES["default"], model_dir, seed=0, gamma="random")
    return path


def run_compile(model: Path, repo: Path, schedule: str | None) -> dict:
    """One `python -m graphconv compile` in `repo` (whose code it runs) with GRAPHCONV_SCHEDULING=schedule:
    wall seconds, peak RSS of the process tree, exit code."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="scheduling-ab-", dir=model.parent) as out:
        env = {k: v for k, v in os.environ.items() if k != "GRAPHCONV_SCHEDULING"}
        if schedule is not None:
            env["GRAPHCONV_SCHEDULING"] = schedule
        cmd = [sys.executable, "-m", "graphconv", "compile", str(model), "-o", str(Path(out) / "m.mindir"), "-q"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        err = proc.stderr.read().decode(errors="replace").strip()
    if proc.returncode != 0:
        raise SystemExit(f"the compile failed (exit {proc.returncode}): {err[-400:]}")
    return {"wall_s": round(wall, 2), "peak_rss_gib": round(peak / 2**30, 2)}


@dataclasses.dataclass
class Comparison:
    name: str
    a: str  # what A is
    b: str
    pairs: list[tuple[dict, dict]]

    @property
    def gains(self) -> list[float]:
        return [round(b["wall_s"] - a["wall_s"], 2) for a, b in self.pairs]

    @property
    def median_gain(self) -> float:
        return round(statistics.median(self.gains), 2)

    @property
    def spread(self) -> float:
        q = statistics.quantiles(self.gains, n=4, method="inclusive") if len(self.gains) > 1 else [0, 0, 0]
        return round(q[2] - q[0], 2)

    def as_dict(self) -> dict:
        return {"name": self.name, "a": self.a, "b": self.b, "pairs": self.pairs, "gains_s": self.gains,
                "median_gain_s": self.median_gain, "spread_s": self.spread, "pays": self.median_gain > self.spread}


def compare(name: str, model: Path, pairs: int, a: tuple[str, Path, str | None],
            b: tuple[str, Path, str | None]) -> Comparison:
    got = Comparison(name, a[0], b[0], [])
    for k in range(pairs):
        first = run_compile(model, a[1], a[2])
        second = run_compile(model, b[1], b[2])
        got.pairs.append((first, second))
        log(f"{name} pair {k + 1}/{pairs}: {a[0]} {first['wall_s']} s, {b[0]} {second['wall_s']} s")
    return got


def table(rows: list[Comparison]) -> str:
    lines = ["| comparison | A | B | pairs: A / B wall (s) | peak RSS A / B (GiB, max) | median B - A "
             "| spread (IQR) | pays |",
             "|---|---|---|---|---|---|---|---|"]
    for c in rows:
        pairs = ", ".join(f"{a['wall_s']:.1f} / {b['wall_s']:.1f}" for a, b in c.pairs)
        rss = f"{max(a['peak_rss_gib'] for a, _ in c.pairs):.2f} / {max(b['peak_rss_gib'] for _, b in c.pairs):.2f}"
        lines.append(f"| {c.name} | {c.a} | {c.b} | {pairs} | {rss} | {c.median_gain:+.2f} s | {c.spread:.2f} s "
                     f"| {'yes' if c.median_gain > c.spread else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    from graphconv.runtime.scheduling import Schedule

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="where the 1.1B model is (built there if absent)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--only", help="mechanisms to compare, comma-separated (default: all, then all on vs off)")
    ap.add_argument("--baseline-repo", type=Path, help="another checkout to compare this one with")
    ap.add_argument("--json", action="store_true")
    opt = ap.parse_args()
    model = model_path(opt.model_dir.absolute())
    names = [f.name for f in dataclasses.fields(Schedule)]
    chosen = opt.only.split(",") if opt.only else names + ["all"]
    run_compile(model, REPO, None)  # (a warm-up: the weights into the page cache, as the pairs find them)
    rows = []
    for name in chosen:
        if name == "all":
            rows.append(compare("all mechanisms", model, opt.pairs, ("all on", REPO, None), ("all off", REPO, "off")))
        elif name in names:
            rows.append(compare(name, model, opt.pairs, ("on", REPO, None), (f"without {name}", REPO, f"-{name}")))
        else:
            ap.error(f"unknown mechanism {name!r} (choose from {', '.join(names)})")
    if opt.baseline_repo:
        rows.append(compare("this code vs the baseline", model, opt.pairs, ("this code", REPO, None),
                            ("baseline", opt.baseline_repo.absolute(), None)))
    print(json.dumps([c.as_dict() for c in rows], indent=1) if opt.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
