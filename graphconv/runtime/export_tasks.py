"""The child's export tasks: onnxsim (`simplify`), `mindspore.export` of a generated network (`export`), and
the export followed by the verification run in the same process (`export_and_verify`)."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from graphconv.runtime import network

if TYPE_CHECKING:  # (the child never imports the compiler: the type is for readers)
    from graphconv.compiler.export_task import ExportTask


def simplify(task: dict) -> dict:
    # onnxsim imports torch only for optional integrations; blocking it saves ~2 s per compile.
    sys.modules.setdefault("torch", None)
    import onnx
    import onnxsim

    model = onnx.load(task["input"])
    # No input shapes are given, so symbolic dims stay symbolic; onnxsim's own random-input check is off
    # because graphconv validates the result against the original with its own reference inputs. Models
    # with external weights arrive stripped of them (graphconv.frontend.weights), so this file is always small.
    simplified, _ = onnxsim.simplify(model, check_n=0, skip_shape_inference=False)
    onnx.save(simplified, task["output"])
    return {"nodes": len(simplified.graph.node)}


def export(task: ExportTask) -> dict:
    network.cpu_graph_mode()
    if task.get("streamed"):
        return _export_streamed(task)[0]
    net, build_seconds = network.build(task)
    return {**_export_built(net, task), "build_seconds": build_seconds}


def _export_streamed(task: ExportTask, put_by_verification: bool = False) -> tuple[dict, object]:
    """graphconv/runtime/mindir_stream: the network built on lazy Parameters, its graph exported, the weights
    copied from their files into <file_base>_variables/data_0 in bounded chunks. With put_by_verification
    the weights file is only laid out: the returned writer (else None) takes the weights the layer-streamed
    verification holds anyway (blocks.run_blocks), and its finish() writes the rest and the graph."""
    from graphconv.runtime import mindir_stream

    t0 = time.perf_counter()
    net = network.import_class(task["source"], task["class_name"])(mindir_stream.LazyWeights(task["param_shapes"]))
    net.set_train(False)
    t1 = time.perf_counter()
    advance, external = network.progress_writer(task), task.get("external_weights") or {}

    def progress(name: str, nbytes: int) -> None:  # (the parent's tracker counts the model's own files)
        if advance is not None and name in external:
            advance(nbytes)

    writer = mindir_stream.Writer(net, network.placeholders(task["inputs"]), task["file_base"],
                                  network.sources(task), task.get("param_layouts"), progress=progress)
    out = {"build_seconds": round(t1 - t0, 2), "streamed": True, "graph_seconds": writer.graph_seconds}
    if put_by_verification:
        return out, writer
    t2 = time.perf_counter()
    files = writer.finish(task.get("checkpoint"))
    return {**out, "files": sorted(str(f) for f in files), "weights_seconds": round(time.perf_counter() - t2, 2),
            "export_seconds": round(time.perf_counter() - t1, 2)}, None


def _export_built(net, task: ExportTask) -> dict:
    import mindspore as ms

    t1 = time.perf_counter()
    ms.export(net, *network.placeholders(task["inputs"]), file_name=task["file_base"], file_format="MINDIR")
    t2 = time.perf_counter()
    if task.get("checkpoint"):
        ms.save_checkpoint(net, task["checkpoint"])
    base = Path(task["file_base"])
    produced = sorted(str(p) for p in base.parent.iterdir() if p.name.startswith(base.name))
    return {"files": produced, "export_seconds": round(t2 - t1, 2)}


def export_and_verify(task: dict) -> dict:
    """One process for the export and the verification run (Parameters built once): build the network and
    export it, then run the cases — block by block (run["blocks"]: graphconv/runtime/blocks.py), on the cpu
    twin built in this process from the exported network's own Parameters where name, layout, shape and
    dtype agree (ascend: no second copy of the weights), or (cpu target) on the MindIR itself through
    GraphCell, after the network is released. A failing run is reported in "verify_error" beside the
    exported files."""
    import mindspore as ms
    from mindspore import nn

    network.cpu_graph_mode()
    exp, run, twin = task["export"], task["run"], task.get("twin")
    writer, prepared, blocks_error = None, None, None
    if run.get("blocks"):  # layer-streamed: the block module imported (and the first block's weights read) now
        from graphconv.runtime import blocks

        checked = twin if twin is not None else exp
        try:
            prepared = blocks.Prepared(run["blocks"], run, network.sources(checked), bool(run.get("read_ahead")))
        except Exception as e:  # noqa: BLE001 - reported as the verification's error, after the export
            blocks_error = e
    if exp.get("streamed"):  # (graphconv/runtime/mindir_stream) no Parameter holds a value: nothing to share
        net, (out, writer) = None, _export_streamed(exp, put_by_verification=bool(run.get("blocks")))
    else:
        net, build_seconds = network.build(exp)
        out = {**_export_built(net, exp), "build_seconds": build_seconds}
    try:
        if blocks_error is not None:
            raise blocks_error
        if prepared is not None:
            from graphconv.runtime import blocks

            del net
            gc.collect()
            out["verify"] = blocks.run_blocks(prepared, writer and writer.weights)
        elif twin is None:
            del net
            gc.collect()
            mindir = next(f for f in out["files"] if f.endswith(".mindir"))
            out["verify"] = network.run_cases(nn.GraphCell(ms.load(mindir)), run)
        else:
            shared = network.shareable(twin, net, exp) if net is not None else {}
            twin_net, twin_seconds = network.build(twin, shared)
            out["verify"] = {**network.run_cases(twin_net, run), "build_seconds": twin_seconds,
                             "shared_parameters": len(shared)}
    except Exception as e:  # noqa: BLE001 - the parent decides (a lazy_inline refusal is retried)
        out["verify_error"] = f"{type(e).__name__}: {network.first_line(str(e))}"
    if writer is not None:  # the weights the blocks did not put (all of them if they failed), then the graph
        t0 = time.perf_counter()
        out["files"] = sorted(str(f) for f in writer.finish(exp.get("checkpoint")))
        out.update(weights_put_by_verification_bytes=writer.weights.put_bytes,
                   weights_seconds=round(time.perf_counter() - t0, 2))
    return out
