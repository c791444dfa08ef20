#!/usr/bin/env python3
"""mindir_stream: peak memory and wall time of writing the MindIR of a large model, mindspore.export's way
(every Parameter resident) against graphconv/runtime/mindir_stream's (graph on lazy Parameters, weights copied
in bounded chunks), for one of benchmarks/compile_scale.py's synthetic Llama models.

In one run: builds the model (compile_scale.build_model: external fp32 weights), runs graphconv's own stages up
to the export task (load, onnxsim on the weight-less graph, the passes, optionally --precision, lower; as
`graphconv compile` does, target ascend unless --target cpu), then, each in a fresh child running graphconv's
worker (wall time, and peak RSS as the child's own VmHWM: anonymous and file-mapped pages):

  floor     read every weight byte once and write it once (64 MiB buffer; no fsync, like the two below)
  export    the export task as graphconv ran it before (mindspore.export; past 1 GiB it splits the weights)
  streamed  the same task streamed

and checks that both wrote the same thing: data_0 byte for byte, the graphs equal once normalized (what two
runs of mindspore.export already differ in: the compile_phase attribute, the order of the primitives table).
With --load, each MindIR is also loaded with mindspore.load and run once through nn.GraphCell, outputs
compared (mindspore.load holds the whole data file and the tensors: about twice the weights).

    .venv/bin/python benchmarks/mindir_stream.py [--size small|default] [--precision fp32|fp16]
                                                 [--target ascend|cpu] [--load]
                                                 [--workdir DIR] [--keep] [--json]

Outputs are deleted as soon as they are compared; the workdir unless --keep. Needs about 3x the weight bytes
of free disk (the model, and both MindIRs while they are compared).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import compile_scale  # noqa: E402  (benchmarks/compile_scale.py: the model builder)


def log(msg: str) -> None:
    print(f"[mindir_stream] {msg}", file=sys.stderr, flush=True)


# Appended to every child script: its peak RSS as the kernel counts it for its own address space (VmHWM:
# anonymous and file-mapped pages). ru_maxrss from wait4 would not do: Linux carries the forking parent's
# high-water mark over the exec, and this parent holds the lowered model.
_PEAK = """
import atexit
def _peak():
    kib = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    print(f"VMHWM_KIB {kib}", flush=True)
atexit.register(_peak)
"""


def measured(script: str, args: list[str], cwd: Path, env: dict | None = None) -> dict:
    """Run `script` in a fresh interpreter; its wall time and peak RSS."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK + script, *args], cwd=cwd, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed ({done.returncode}): {done.stderr[-2000:]}")
    kib = int(next(ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("VMHWM_KIB ")))
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(kib * 1024 / 2**30, 2)}


_FLOOR = """
import os, sys
src, dst = sys.argv[1], sys.argv[2]
buf = bytearray(64 * 2**20)
view = memoryview(buf)
with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as g:
    while True:
        n = f.readinto(buf)
        if not n:
            break
        g.write(view[:n])
"""

# graphconv's worker, with mindspore.export's split threshold at 0: the small size (0.4 GB) is then written
# in the same split layout as the large ones (no effect past 1 GiB, where export splits anyway)
_WORKER = """
import sys
from mindspore.train import serialization
serialization.TOTAL_SAVE = 0
from graphconv.runtime import worker
if worker.main([None, sys.argv[1]]):
    sys.exit(1)
"""

_LOAD_RUN = """
import json, sys
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn
ms.set_device("CPU"); ms.set_context(mode=ms.GRAPH_MODE)
cell = nn.GraphCell(ms.load(sys.argv[1]))
ids = np.random.default_rng(0).integers(0, 1000, (1, 8)).astype(np.int64)
np.save(sys.argv[2], cell(Tensor(ids)).asnumpy())
"""


def normalized(graph_file: Path) -> bytes:
    from graphconv.runtime import mindir_stream

    return mindir_stream.comparable(graph_file).SerializeToString()


def same_bytes(a: Path, b: Path, chunk: int = 64 * 2**20) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as f, open(b, "rb") as g:
        while True:
            x, y = f.read(chunk), g.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def prepare_task(model_path: Path, ws, precision: str, target: str) -> dict:
    """graphconv's stages up to the export task, as `graphconv compile` runs them (no verification cases)."""
    import opmap
    from graphconv.pipeline import CompileOptions, Compiler
    from graphconv.progress import SILENT

    c = Compiler(model_path, CompileOptions(output=ws.output_path, precision=precision, target=target), SILENT)
    from graphconv.frontend import weights

    loaded = c.load()
    spill = weights.SpillFile(ws.path("made-weights.bin")) if loaded.model.external_bytes else None
    fused = c.fuse(c.simplify(loaded.model, ws), None, None, spill)
    if precision != "fp32":
        fused = c.apply_precision(fused, spill)
    from graphconv.stage_context import lower

    return lower(c.ctx, c.target.network_graph(fused, opmap.fused.inline_fused(fused)), loaded, ws).task


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(compile_scale.SIZES), default="default")
    ap.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--target", choices=("ascend", "cpu"), default="ascend")
    ap.add_argument("--load", action="store_true", help="also load and run both MindIRs (needs --target cpu: the "
                    "ascend MindIR's fused primitives have no CPU kernels)")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true")
    opt = ap.parse_args()
    if opt.load and opt.target != "cpu":
        ap.error("--load needs --target cpu")

    from graphconv.runtime.child import child_env
    from graphconv.workspace import Workspace

    cfg = compile_scale.SIZES[opt.size]
    work = Path(opt.workdir or tempfile.mkdtemp(prefix="mindir-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    model_path = work / "model" / "model.onnx"
    if not model_path.exists():
        log(f"building the {opt.size} model ({cfg.n_params() / 1e9:.2f}e9 parameters) in {work}")
        compile_scale.build_model(cfg, model_path.parent, seed=0)
    weight_bytes = (model_path.parent / compile_scale.DATA_FILE).stat().st_size
    rows = {}
    env = child_env()
    try:
        out_dir = work / "out"
        out_dir.mkdir(exist_ok=True)
        with Workspace(out_dir / "m.mindir") as ws:
            log("graphconv stages up to the export task")
            t0 = time.perf_counter()
            task = prepare_task(model_path, ws, opt.precision, opt.target)
            log(f"  {time.perf_counter() - t0:.0f} s; streamed by default: {task['streamed']}")
            floor_out = work / "floor.bin"
            log("floor: read and write the weights once")
            rows["floor"] = measured(_FLOOR, [str(model_path.parent / compile_scale.DATA_FILE), str(floor_out)], work)
            floor_out.unlink()
            graphs = {}
            for way in ("export", "streamed"):
                d = ws.path(way)
                d.mkdir()
                t = {**task, "file_base": str(d / "m"), "checkpoint": None, "streamed": way == "streamed",
                     "kind": "export", "result": str(ws.path(f"{way}.result.json"))}
                ws.path(f"{way}.json").write_text(json.dumps(t))
                log(f"{way}")
                rows[way] = measured(_WORKER, [str(ws.path(f"{way}.json"))], ws.dir, env)
                result = json.loads(ws.path(f"{way}.result.json").read_text())
                rows[way].update({k: result[k] for k in ("build_seconds", "export_seconds", "graph_seconds",
                                                          "weights_seconds") if k in result})
                graphs[way] = d
            exp, st = graphs["export"], graphs["streamed"]
            same_data = same_bytes(exp / "m_variables" / "data_0", st / "m_variables" / "data_0")
            same_graph = normalized(exp / "m_graph.mindir") == normalized(st / "m_graph.mindir")
            log(f"data_0 byte-identical: {same_data}; graphs equal (normalized): {same_graph}")
            if opt.load:
                outs = {}
                for way in ("export", "streamed"):
                    log(f"load and run the {way} MindIR")
                    rows[f"load {way}"] = measured(_LOAD_RUN, [str(graphs[way] / "m_graph.mindir"),
                                                               str(ws.path(f"{way}.out.npy"))], ws.dir, env)
                    import numpy as np

                    outs[way] = np.load(ws.path(f"{way}.out.npy"))
                    if way == "export":
                        shutil.rmtree(graphs[way])
                rows["outputs equal"] = bool((outs["export"] == outs["streamed"]).all())
            for d in graphs.values():
                shutil.rmtree(d, ignore_errors=True)
    finally:
        if not opt.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = {"size": opt.size, "precision": opt.precision, "target": opt.target, "weight_bytes": weight_bytes,
               "data_identical": same_data, "graph_identical": same_graph,
               "rows": rows}
    if opt.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{opt.size} model, {weight_bytes / 2**30:.2f} GiB of fp32 weights, --precision {opt.precision}, "
              f"--target {opt.target}")
        print(f"{'':14} {'wall s':>8} {'peak RSS GiB':>13} {'x weights':>10}")
        for k, v in summary["rows"].items():
            if isinstance(v, dict):
                ratio = v["peak_rss_gib"] * 2**30 / weight_bytes
                print(f"{k:14} {v['wall_s']:8.1f} {v['peak_rss_gib']:13.2f} {ratio:10.2f}")
        print(f"data_0 byte-identical: {same_data}; graphs equal: {same_graph}"
              + (f"; outputs equal: {rows['outputs equal']}" if "outputs equal" in rows else ""))
    return 0 if same_data and same_graph else 1


if __name__ == "__main__":
    sys.exit(main())
