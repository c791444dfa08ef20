#!/usr/bin/env python3
"""layer_scaling: how graphconv's compile time and generated source grow with a model's depth.

The same small-width transformers Llama (hidden 64, 4 heads, 2 kv heads, default settings: sdpa attention)
at 4, 16 and 32 layers (or --layers), exported by torch.onnx (dynamo, opset 18, batch and seq dynamic) and
compiled with `graphconv compile --emit-source` (default target ascend: lazy_inline layer classes; the
cpu twin verified), each in a fresh process. Printed per depth:
export seconds, compile wall seconds, the lines of the emitted network.py, the layer classes and instances
the report found; then the ratios of the deepest to the shallowest model.

Targets (issue 13, printed as PASS/MISS): compile wall(32) <= 3 x wall(4) and lines(32) <= 1.3 x lines(4).
The compile is verified (against onnxruntime) as in any compile; timings are one run on a shared machine.

    .venv/bin/python benchmarks/layer_scaling.py [--layers 4,16,32] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WALL_TARGET, LINES_TARGET = 3.0, 1.3

EXPORT = r"""
import sys, torch, transformers
layers, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    for m in model.modules():  # norm gammas away from 1, as trained checkpoints have them
        if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm):
            m.weight.add_(0.1 * torch.randn_like(m.weight))


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.model = m

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


ids = torch.randint(0, 256, (2, 7))
batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
torch.onnx.export(Logits(model), (ids,), out, dynamo=True, opset_version=18, input_names=["input_ids"],
                  output_names=["logits"], dynamic_shapes={"input_ids": {0: batch, 1: seq}})
"""


def run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"layer_scaling: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def measure(depth: int, work: Path) -> dict:
    onnx_path = work / f"llama{depth}.onnx"
    print(f"[layer_scaling] export {depth} layers", file=sys.stderr)
    export_s = run([sys.executable, "-c", EXPORT, str(depth), str(onnx_path)], work / f"export{depth}.log")
    src, report = work / f"src{depth}", work / f"report{depth}.json"
    print(f"[layer_scaling] compile {depth} layers", file=sys.stderr)
    wall = run([sys.executable, "-m", "graphconv", "compile", str(onnx_path), "-o",
                str(work / f"llama{depth}.mindir"), "--emit-source", str(src), "--report", str(report), "-q"],
               work / f"compile{depth}.log")
    rep = json.loads(report.read_text())
    lower = next((s for s in rep["stages"] if s["name"] == "lower"), {})
    grouping = (lower.get("detail") or {}).get("layers") or {}
    return {"layers": depth, "export_s": round(export_s, 1), "compile_s": round(wall, 1),
            "lines": (src / "network.py").read_text().count("\n"), "classes": grouping.get("classes", 0),
            "grouped": grouping.get("grouped", 0), "status": rep["status"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,16,32", help="depths, comma separated (first and last are compared)")
    ap.add_argument("--workdir", type=Path, help="keep the exports and reports here")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"layer_scaling: needs torch and transformers ({e})", file=sys.stderr)
        return 1
    depths = [int(x) for x in args.layers.split(",")]
    with tempfile.TemporaryDirectory(prefix="layer_scaling_") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [measure(d, work) for d in depths]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'layers':>6} {'export s':>9} {'compile s':>10} {'lines':>7} {'classes':>8} {'grouped':>8}  status")
    for r in rows:
        print(f"{r['layers']:>6} {r['export_s']:>9} {r['compile_s']:>10} {r['lines']:>7} {r['classes']:>8} "
              f"{r['grouped']:>8}  {r['status']}")
    first, last = rows[0], rows[-1]
    wall, lines = last["compile_s"] / first["compile_s"], last["lines"] / first["lines"]
    print(f"compile wall {last['layers']}/{first['layers']} layers: {wall:.2f} (target <= {WALL_TARGET}) "
          f"{'PASS' if wall <= WALL_TARGET else 'MISS'}")
    print(f"network.py lines {last['layers']}/{first['layers']} layers: {lines:.2f} (target <= {LINES_TARGET}) "
          f"{'PASS' if lines <= LINES_TARGET else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
