#!/usr/bin/env python3
"""tp_scale: `graphconv compile --tp N` on a billion-parameter model, as a user runs it.

    .venv/bin/python benchmarks/tp_scale.py --size default --tp 2                        # 1.1B fp32, verified
    .venv/bin/python benchmarks/tp_scale.py --size 7b --dtype fp16 --tp 8 --no-verify    # 7B fp16
    .venv/bin/python benchmarks/tp_scale.py --size 7b --dtype fp16 --tp 8 --layers 2     # its shapes, verified

1. Builds compile_scale's Llama-shaped model (its build_model: the weights in one external data file,
   written one tensor at a time), or takes --model.
2. Runs `python -m graphconv compile MODEL --tp N -o OUT --report R` (plus --no-verify if asked) in its own
   process tree, polled by compile_scale.measure: wall, peak summed RSS of the tree (the compile, its
   children, msrun and the N ranks), ru_maxrss of its largest process.
3. Prints, per rank, from the report: weight bytes and share of the unsharded model's, bytes of the rank's
   MindIR on disk (rank_<i>.mindir + rank_<i>_variables/), peak RSS of the rank's process (ru_maxrss, taken in
   the rank), whether its MindIR was written streamed, max abs vs onnxruntime; then one JSON line. Deletes the
   workdir unless --keep.

Disk: the model, the compile's spill file (the shards of its split weights, ~ the model) and the N MindIRs
(~ the model plus N - 1 copies of the replicated weights): checked up front (3.3 x the weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_scale import DTYPES, SIZES, build_model, dir_bytes, log, measure

DISK_FACTOR = 3.3


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, help="override the size's layer count (its widths and heads kept)")
    ap.add_argument("--no-verify", action="store_true", help="passed to graphconv compile")
    ap.add_argument("--model", type=Path, help="an existing model.onnx instead of building one")
    ap.add_argument("--workdir", type=Path, help="new or empty directory (default: a new one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (model, OUT_DIR, report, logs)")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(SIZES[args.size], **({"layers": args.layers} if args.layers else {}))
    weight_bytes = DTYPES[args.dtype].itemsize * cfg.n_params()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tp_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise SystemExit(f"tp_scale: --workdir {work} is not empty")
    free, factor = shutil.disk_usage(work).free, DISK_FACTOR - (1 if args.model else 0)  # (--model: built)
    if free < factor * weight_bytes:
        raise SystemExit(f"tp_scale: {free / 1e9:.1f} GB free, need {factor:.1f} x {weight_bytes / 1e9:.1f} GB")
    try:
        model = args.model
        if model is None:
            log(f"building {args.size} {args.dtype} ({weight_bytes / 1e9:.2f} GB) in {work}")
            model, _ = build_model(cfg, work / "model", 0, "random", args.dtype)  # (compile_scale's defaults)
        out, report = work / "out", work / "report.json"
        cmd = [sys.executable, "-m", "graphconv", "compile", str(model), "--tp", str(args.tp), "-o", str(out),
               "--report", str(report), "-q"] + (["--no-verify"] if args.no_verify else [])
        log(" ".join(cmd[1:]))
        m = measure(cmd, work / "logs", "compile")
        if m["exit_code"] != 0 or not report.exists():
            print(f"compile failed (exit {m['exit_code']}): {(work / 'logs' / 'compile.err').read_text()[-800:]}")
            return 1
        r = json.loads(report.read_text())
        tp = r["validation"]["tensor_parallel"]
        rows = []
        for row in tp["ranks"]:
            k = row["rank"]
            on_disk = (out / f"rank_{k}.mindir").stat().st_size + dir_bytes(out / f"rank_{k}_variables")
            rows.append({**row, "mindir_bytes": on_disk})
        print(f"{args.size} {args.dtype} --tp {args.tp}: {r['status']}, wall {m['wall_s']:.1f} s, peak RSS of the "
              f"tree {m['peak_rss_tree_bytes'] / 2**30:.2f} GiB, unsharded weights {tp['unsharded_weight_bytes']:,}")
        for row in rows:
            err = f"{row['max_abs']:.3g}" if "max_abs" in row else "-"
            rss = row.get("peak_rss_bytes") or 0
            print(f"  rank {row['rank']}: weights {row['weight_bytes']:,} ({row['share']:.4f}), MindIR on disk "
                  f"{row['mindir_bytes']:,}, peak RSS {rss / 2**30:.2f} GiB, streamed {row['streamed']}, "
                  f"max abs {err}")
        print(json.dumps({"size": args.size, "dtype": args.dtype, "tp": args.tp, "status": r["status"],
                          "wall_s": m["wall_s"], "peak_rss_tree_bytes": m["peak_rss_tree_bytes"],
                          "stages": {s["name"]: s.get("seconds") for s in r.get("stages", [])}, "ranks": rows}))
        return 0
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:  # (the report and the logs stay)
            for sub in ("model", "out"):
                shutil.rmtree(work / sub, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
