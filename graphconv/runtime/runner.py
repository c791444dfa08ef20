"""Compile and run many small ONNX models in one MindSpore child process.

The full pipeline pays a MindSpore start-up per compile; op tests and the ONNX backend run hundreds of
one-op models, so they go through here: same lowering (graphconv.compiler.export_task.prepare), same export and
GraphCell execution (graphconv.runtime.worker), one child for the whole batch.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import onnx

from graphconv.compiler import export_task
from graphconv.runtime.child import run_task
from graphconv.errors import GraphconvError, InternalError


@dataclasses.dataclass
class RunResult:
    outputs: list[list[np.ndarray]] | None  # per input case, the graph outputs in order
    error: str | None = None
    source: str | None = None  # the generated network, for diagnostics


def run_models(items: list[tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]],
               workdir: Path | None = None) -> list[RunResult]:
    """For each (model, cases): lower, export to MindIR, load it and run every case on CPU. Temporary files
    go under `workdir` when given (a compile's private directory), else under the system's temp dir."""
    results: list[RunResult | None] = [None] * len(items)
    with tempfile.TemporaryDirectory(prefix="graphconv-run-", dir=workdir) as tmp:
        work = Path(tmp)
        tasks, index = [], []
        for k, (model, cases) in enumerate(items):
            try:
                model = onnx.shape_inference.infer_shapes(model, data_prop=True)
                net, task = export_task.prepare(model, work, f"net{k}")
            except GraphconvError as e:
                results[k] = RunResult(None, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - one model's lowering bug must not sink the batch
                results[k] = RunResult(None, f"internal error while lowering: {type(e).__name__}: {e}")
                continue
            case_files, out_files = [], []
            for c, inputs in enumerate(cases):
                p = work / f"net{k}.case{c}.npz"
                np.savez(p, **inputs)
                case_files.append(str(p))
                out_files.append(str(work / f"net{k}.case{c}.out.npz"))
            tasks.append({**task, "file_base": str(work / f"net{k}"), "checkpoint": None,
                          "cases": case_files, "outputs": out_files,
                          "input_names": [s["name"] for s in task["inputs"]]})
            index.append((k, net.source))
        if tasks:
            done = run_task("export_and_run", {"items": tasks}, work, "MindSpore batch")["items"]
            for (k, source), task, res in zip(index, tasks, done):
                if not res["ok"]:
                    results[k] = RunResult(None, res["error"], source)
                    continue
                outs = []
                for f in task["outputs"]:
                    with np.load(f) as z:
                        outs.append([z[f"out{i}"] for i in range(len(z.files))])
                results[k] = RunResult(outs, None, source)
    return results


def run_isolating_crashes(items: list[tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]],
                          workdir: Path | None = None) -> list[RunResult]:
    """run_models in one child; if the child dies (a MindSpore abort), bisect so the crash is pinned on one
    model and the others still get their results."""
    try:
        return run_models(items, workdir)
    except InternalError as e:
        if len(items) == 1:
            return [RunResult(None, f"MindSpore child crashed: {e}")]
        mid = len(items) // 2
        return run_isolating_crashes(items[:mid], workdir) + run_isolating_crashes(items[mid:], workdir)
