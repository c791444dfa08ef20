"""The child process: everything that can abort the interpreter from C++ (onnxsim, MindSpore) runs here.

A task is a JSON dict whose "kind" names a function of TASKS; its result is {"ok": true, ...} or
{"ok": false, "error": "..."}. `python -m graphconv.target.worker TASK.json` does one task and writes the result
to the task's "result" file; `python -m graphconv.target.worker --serve` does one task per stdin line and writes
one result line to stdout each. A crash leaves no result; the parent (graphconv.target.child) turns that into a
clean error. The working directory is the run's private temporary directory, so files that MindSpore drops
in the cwd (rank_0/, kernel_meta/) stay in it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path


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


def _import_network(source: str, class_name: str, direct: bool = False):
    """The generated network class. direct: the network will be run as a Cell, not exported: its layer
    classes without lazy_inline (MindSpore 2.10's CPU runs a lazy_inline network only from its MindIR; the
    generated module's LAZY_INLINE switch, graphconv/target/codegen.py)."""
    spec = importlib.util.spec_from_file_location(Path(source).stem, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    if direct:
        text = Path(source).read_text().replace("\nLAZY_INLINE = True\n", "\nLAZY_INLINE = False\n", 1)
        exec(compile(text, source, "exec"), module.__dict__)
    else:
        spec.loader.exec_module(module)
    return getattr(module, class_name)


class _Weights(dict):
    """name -> numpy array for every Parameter. Weights that live in the model's own files (graphconv.frontend.weights)
    are read one at a time when the network asks for them, so only the Parameters hold the values."""

    def __init__(self, small: dict, external: dict, progress=None, shared: dict | None = None, deferred=None):
        super().__init__(small)
        self.external = external
        self.progress = progress
        self.shared = shared or {}
        self.deferred = deferred or {}  # name -> initializer not read up front (a shared name's own copy)

    def shared_parameter(self, name, shape, dtype, transposed):
        """An already built Parameter of that name, layout, shape and dtype (the exported network's, for the
        cpu twin built in the same process: opmap/helpers._param asks), or None."""
        found = self.shared.get((name, bool(transposed)))
        if found is None or tuple(found.shape) != tuple(shape) or found.dtype != dtype:
            return None
        return found

    def __missing__(self, name):
        from graphconv.frontend.weights import read

        if name in self.deferred:
            return self.deferred[name].const_value.numpy()
        ref = self.external[name]
        if self.progress is not None:
            self.progress(ref[2])
        return read(ref, mmap=False)


def _weights(task: dict, progress=None, shared: dict | None = None) -> dict:
    import numpy as np
    import onnx_ir as ir

    wanted = set(task["param_names"])
    reused = {name for name, _ in (shared or {})}
    small, deferred = {}, {}
    if task.get("weights_onnx"):
        model = ir.load(task["weights_onnx"])
        for name, value in model.graph.initializers.items():
            if name in reused:
                deferred[name] = value  # read only if the shared Parameter does not fit
            elif name in wanted:
                small[name] = value.const_value.numpy()
    if task.get("folded_npz"):
        with np.load(task["folded_npz"]) as folded:
            small.update({k: folded[k] for k in folded.files})
    external = task.get("external_weights") or {}
    missing = wanted - set(small) - set(external) - set(deferred)
    if missing:
        raise RuntimeError(f"weights missing for parameters {sorted(missing)[:5]}")
    return _Weights(small, external, progress, shared, deferred)


def _progress_writer(task: dict):
    """A callback adding bytes read to the count the parent polls (graphconv.target.child.run_task), or None."""
    path = task.get("progress_file")
    if not path:
        return None
    done = [0]

    def advance(nbytes: int) -> None:
        done[0] += nbytes
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(done[0]))
        os.replace(tmp, path)

    return advance


def export(task: dict) -> dict:
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    if _streams(task):
        return _export_streamed(task)[0]
    net, build_seconds = _build_network(task, direct=bool(task.get("direct")))
    return {**_export_built(net, task), "build_seconds": build_seconds}


def _sources(task: dict) -> dict:
    """Parameter name -> graphconv.target.mindir_stream.Source, from the same three places `_weights` reads:
    the weights file emit wrote (its big tensors are in its .data file), the folded constants, and the
    model's own files (external refs: the ONNX data, the spill file)."""
    import numpy as np
    import onnx_ir as ir

    from graphconv.target.mindir_stream import Source

    wanted = set(task["param_names"])
    found = {}
    if task.get("weights_onnx"):
        for name, value in ir.load(task["weights_onnx"]).graph.initializers.items():
            if name not in wanted:
                continue
            t = value.const_value
            if isinstance(t, ir.ExternalTensor):
                found[name] = Source(tuple(int(d) for d in t.shape), t.dtype.numpy().name, t.path, t.offset or 0,
                                     t.length if t.length is not None else t.nbytes)
            else:
                found[name] = Source.of_array(t.numpy())
    if task.get("folded_npz"):
        with np.load(task["folded_npz"]) as folded:
            found.update({k: Source.of_array(folded[k]) for k in folded.files})
    found.update({n: Source.of_ref(ref) for n, ref in (task.get("external_weights") or {}).items()})
    missing = wanted - set(found)
    if missing:
        raise RuntimeError(f"weights missing for parameters {sorted(missing)[:5]}")
    return found


def _streams(task: dict) -> bool:
    """Whether the export is streamed (emit.prepare decides; a checkpoint is then copied from the MindIR)."""
    return bool(task.get("streamed"))


def _export_streamed(task: dict, put_by_verification: bool = False) -> tuple[dict, object]:
    """graphconv/target/mindir_stream: the network built on lazy Parameters, its graph exported, the weights
    copied from their files into <file_base>_variables/data_0 in bounded chunks. With put_by_verification
    the weights file is only laid out: the returned writer (else None) takes the weights the layer-streamed
    verification holds anyway (blockwise.run_blocks), and its finish() writes the rest and the graph."""
    import mindspore as ms
    from mindspore import Tensor

    from graphconv.target import mindir_stream

    t0 = time.perf_counter()
    net = _import_network(task["source"], task["class_name"], bool(task.get("direct")))(mindir_stream.LazyWeights())
    net.set_train(False)
    t1 = time.perf_counter()
    placeholders = [Tensor(shape=spec["shape"], dtype=getattr(ms, spec["ms_dtype"])) for spec in task["inputs"]]
    advance, external = _progress_writer(task), task.get("external_weights") or {}

    def progress(name: str, nbytes: int) -> None:  # (the parent's tracker counts the model's own files)
        if advance is not None and name in external:
            advance(nbytes)

    writer = mindir_stream.Writer(net, placeholders, task["file_base"], _sources(task), task.get("param_layouts"),
                                  progress=progress)
    out = {"build_seconds": round(t1 - t0, 2), "streamed": True, "graph_seconds": writer.graph_seconds}
    if put_by_verification:
        return out, writer
    t2 = time.perf_counter()
    files = writer.finish(task.get("checkpoint"))
    return {**out, "files": sorted(str(f) for f in files), "weights_seconds": round(time.perf_counter() - t2, 2),
            "export_seconds": round(time.perf_counter() - t1, 2)}, None


def _export_built(net, task: dict) -> dict:
    import mindspore as ms
    from mindspore import Tensor

    t1 = time.perf_counter()
    placeholders = [Tensor(shape=spec["shape"], dtype=getattr(ms, spec["ms_dtype"])) for spec in task["inputs"]]
    ms.export(net, *placeholders, file_name=task["file_base"], file_format="MINDIR")
    t2 = time.perf_counter()
    if task.get("checkpoint"):
        ms.save_checkpoint(net, task["checkpoint"])
    base = Path(task["file_base"])
    produced = sorted(str(p) for p in base.parent.iterdir() if p.name.startswith(base.name))
    return {"files": produced, "export_seconds": round(t2 - t1, 2)}


def export_and_verify(task: dict) -> dict:
    """One process for the export and the verification run (ARCHITECTURE.md: Parameters built once):
    build the network and export it, then run the cases — on the cpu twin built in this process from the
    exported network's own Parameters where name, layout, shape and dtype agree (ascend: no second copy of
    the weights), or (cpu target) on the MindIR itself through GraphCell, after the network is released. A
    failing run is reported in "verify_error" beside the exported files."""
    import gc

    import mindspore as ms
    from mindspore import nn

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    exp, run, twin = task["export"], task["run"], task.get("twin")
    writer, blocks, blocks_error = None, None, None
    if run.get("block_values"):  # layer-streamed: the first block's weights are read while the graph exports
        from graphconv.target import blockwise

        checked = twin if twin is not None else exp
        try:
            blocks = blockwise.Prepared(checked, run, _sources(checked))
        except Exception as e:  # noqa: BLE001 - reported as the verification's error, after the export
            blocks_error = e
    if _streams(exp):  # (graphconv/target/mindir_stream) no Parameter holds a value: nothing to share
        net, (out, writer) = None, _export_streamed(exp, put_by_verification=bool(run.get("block_values")))
    else:
        net, build_seconds = _build_network(exp, direct=bool(exp.get("direct")))
        out = {**_export_built(net, exp), "build_seconds": build_seconds}
    try:
        if blocks_error is not None:
            raise blocks_error
        if blocks is not None:  # layer-streamed (graphconv/target/blockwise): one block's weights at a time
            del net
            gc.collect()
            out["verify"] = blockwise.run_blocks(blocks, writer and writer.weights)
        elif twin is None:
            del net
            gc.collect()
            mindir = next(f for f in out["files"] if f.endswith(".mindir"))
            out["verify"] = _run_cases(nn.GraphCell(ms.load(mindir)), run)
        elif net is None:  # the streamed export: the cpu twin reads its weights from the files
            twin_net, twin_seconds = _build_network(twin, direct=True)
            out["verify"] = {**_run_cases(twin_net, run), "build_seconds": twin_seconds, "shared_parameters": 0}
        else:
            layouts = exp.get("param_layouts") or {}
            shared = {(p.name, bool(layouts.get(p.name))): p for p in net.get_parameters() if p.name in layouts}
            twin_net, twin_seconds = _build_network(twin, direct=True, shared=shared)
            out["verify"] = {**_run_cases(twin_net, run), "build_seconds": twin_seconds,
                             "shared_parameters": sum(1 for _ in shared)}
    except Exception as e:  # noqa: BLE001 - the parent decides (a lazy_inline refusal is retried)
        out["verify_error"] = f"{type(e).__name__}: {_first_line(str(e))}"
    if writer is not None:  # the weights the blocks did not put (all of them if they failed), then the graph
        t0 = time.perf_counter()
        out["files"] = sorted(str(f) for f in writer.finish(exp.get("checkpoint")))
        out.update(weights_put_by_verification_bytes=writer.weights.put_bytes,
                   weights_seconds=round(time.perf_counter() - t0, 2))
    return out


# GraphCells that run_mindir keeps for the next tasks that run the same MindIR with "keep": true (a server's
# repeated runs: the ONNX backend), oldest first; past _KEEP_CELLS the oldest is dropped (its MindIR stays on
# disk). A server that has loaded _RETIRE_AFTER of them asks to be replaced, which keeps MindSpore's
# per-graph memory bounded.
_KEEP_CELLS = 32
_RETIRE_AFTER = 200
_kept: dict = {}
_kept_loads = 0


def run_mindir(task: dict) -> dict:
    global _kept_loads
    import mindspore as ms
    from mindspore import nn

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cell = _kept.get(task["mindir"]) if task.get("keep") else None
    if cell is not None:
        return _run_cases(cell, task, placeholders=False)  # set at its first run
    cell = nn.GraphCell(ms.load(task["mindir"]))
    if task.get("keep"):
        if len(_kept) >= _KEEP_CELLS:
            _kept.pop(next(iter(_kept)))
        _kept[task["mindir"]] = cell
        _kept_loads += 1
    return _run_cases(cell, task)


def run_network(task: dict) -> dict:
    """Build the generated network from its source and weights and run the cases (no MindIR round trip:
    used for the cpu twin of an ascend compile, whose MindIR would be written only to be read back)."""
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    net, build_seconds = _build_network(task, direct=True)
    return {**_run_cases(net, task), "build_seconds": build_seconds}


def _build_network(task: dict, direct: bool = False, shared: dict | None = None):
    """The generated network with its Parameters bound (weights read as it asks for them; `shared` ones
    reused), in eval mode; and the seconds that took. direct: see _import_network."""
    t0 = time.perf_counter()
    network_cls = _import_network(task["source"], task["class_name"], direct)
    net = network_cls(_weights(task, _progress_writer(task), shared))
    net.set_train(False)
    return net, round(time.perf_counter() - t0, 2)


def _typed(array):
    """np.savez stores bfloat16 (ml_dtypes) as 2-byte void: the same bytes, viewed as bfloat16 again."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        import ml_dtypes

        return array.view(ml_dtypes.bfloat16)
    return array


def _run_cases(cell, task: dict, placeholders: bool = True) -> dict:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    # Dynamic placeholders are optional for a user (tests/test_graphcell_load.py runs "plain": true, as a user
    # who skips set_inputs does); with them the graph compiles once for every case, without them a GraphCell
    # re-infers and recompiles it at each new shape (0.12 s vs 0.6 s for the second case of a tiny Llama).
    if placeholders and not task.get("plain"):
        cell.set_inputs(*[Tensor(shape=s["shape"], dtype=getattr(ms, s["ms_dtype"])) for s in task["inputs"]])
    results, seconds = [], []
    for case_path, out_path in zip(task["cases"], task["outputs"]):
        with np.load(case_path) as data:
            args = [Tensor(_typed(data[name])) for name in task["input_names"]]
        t0 = time.perf_counter()
        out = cell(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        arrays = {f"out{i}": o.asnumpy() for i, o in enumerate(out)}
        seconds.append(round(time.perf_counter() - t0, 2))  # the first includes MindSpore's graph compile
        np.savez(out_path, **arrays)
        results.append(out_path)
    return {"outputs": results, "case_seconds": seconds}


def export_and_run(task: dict) -> dict:
    """Many small networks in one process (op tests, the ONNX backend): export each, then run its MindIR.
    A failure is recorded per item, so one bad network does not hide the others."""
    import gc

    results = []
    for item in task["items"]:
        # MindSpore runs gc.collect() on every graph compile; freezing what is alive so far keeps that
        # cheap across hundreds of networks (measured: 110 s -> 39 s for 355 one-op models).
        gc.freeze()
        try:
            export(item)
            run_mindir({**item, "mindir": item["file_base"] + ".mindir"})
            results.append({"ok": True})
        except Exception as e:  # noqa: BLE001 - reported per item
            results.append({"ok": False, "error": f"{type(e).__name__}: {_first_line(str(e))}"})
    return {"items": results}


def generate(task: dict) -> dict:
    """Greedy decoding with a compiled prefill + decode pair (graphconv.generate): both GraphCells loaded once,
    with dynamic set_inputs (one graph compile each, not one per cache length); the prompt prefilled, then one
    decode step per new token, present.* fed back as past_key_values.* (MindSpore Tensors, never copied to the
    host) and a 1 appended to the mask. A row that produced an eos is fed the pad id from then on. Returns the
    chosen tokens [batch][steps] and the seconds; with "logits" the last-position logits of every step go
    there (step0 the prefill's) for the parent's onnxruntime check."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    from graphconv.target import greedy

    ms.set_device("Ascend" if task["device"] == "ascend" else "CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    t0 = time.perf_counter()
    cells = {}  # by MindIR: one graph may serve both steps (onnxruntime-genai's model builder)
    for name in ("prefill", "decode"):
        path = task[name]["mindir"]
        if path not in cells:
            cell = nn.GraphCell(ms.load(path))
            cell.set_inputs(*[Tensor(shape=s["shape"], dtype=getattr(ms, s["ms_dtype"])) for s in task[name]["inputs"]])
            cells[path] = cell
    load_seconds = time.perf_counter() - t0
    with np.load(task["prompt"]) as data:
        ids, mask = data["input_ids"], data["attention_mask"]
    saved, seconds, clock = {}, [], [time.perf_counter()]

    def run(name, ids, mask, positions, cache=None):
        clock[0] = time.perf_counter()
        graph = task[name]
        feed = greedy.step_feed(graph["inputs"], ids, mask, positions, cache, graph.get("empty_cache", False))
        out = cells[graph["mindir"]](*[Tensor(a) if isinstance(a, np.ndarray) else a for a in feed])
        return greedy.split_outputs(graph["outputs"], out)

    def on_step(step, logits):
        seconds.append(time.perf_counter() - clock[0])
        if task.get("logits"):
            saved[f"step{step}"] = logits

    tokens = greedy.greedy(lambda i, m, p: run("prefill", i, m, p), lambda i, m, p, cache: run("decode", i, m, p, cache),
                           lambda logits: logits.asnumpy()[:, -1], ids, mask, task["max_new_tokens"],
                           task["eos_token_ids"], task["pad_token_id"], on_step)
    if task.get("logits"):
        np.savez(task["logits"], **saved)
    return {"tokens": tokens.tolist(), "logits": task.get("logits"),
            "timings": {"load": round(load_seconds, 3), "prefill": round(seconds[0], 4),
                        "decode": [round(s, 4) for s in seconds[1:]]}}


def _first_line(message: str) -> str:
    """MindSpore errors carry long C++ call stacks: keep the first meaningful line."""
    return next((ln for ln in message.strip().splitlines() if ln.strip() and not ln.startswith("-")), "")[:500]


TASKS = {"simplify": simplify, "export": export, "run_mindir": run_mindir, "run_network": run_network,
         "export_and_run": export_and_run, "export_and_verify": export_and_verify, "generate": generate}


def handle(task: dict) -> dict:
    """The task done, as its result."""
    try:
        return {"ok": True, **TASKS[task["kind"]](task)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides what it means
        return {"ok": False, "error": f"{type(e).__name__}: {_first_line(str(e))}",
                "traceback": traceback.format_exc()}


def serve() -> int:
    """Tasks from stdin, one JSON line each, until it closes; one result line each on stdout. A result with
    "retire": true is the last (see _RETIRE_AFTER): the parent starts a new server for the next task."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what MindSpore (or anything else) prints goes to the log, not between the results
    for line in sys.stdin:
        result = handle(json.loads(line))
        retire = _kept_loads >= _RETIRE_AFTER
        replies.write(json.dumps({**result, "retire": True} if retire else result) + "\n")
        replies.flush()
        if retire:
            break
    return 0


def _tiny_network():
    """A network of a few CPU kernels, for _warm_up (defined here: nn.Cell needs MindSpore, which this module
    does not import at its top)."""
    import mindspore as ms
    from mindspore import nn, ops

    class Tiny(nn.Cell):
        def construct(self, x):
            return ops.softmax(ops.dense(x * ops.sigmoid(x), ops.ones((4, 4), ms.float32)), -1)

    return Tiny()


def _warm_up() -> dict:
    """What the warm child (graphconv.target.child.Warm) does while the parent still runs the stages before the
    emit: import what every export task imports (MindSpore; onnx_ir, the streamed writer and the layer-streamed
    run: onnx_ir alone took 0.8 s of the 1.1B benchmark's emit), then compile, run and export a tiny network,
    so that MindSpore's first-use set-up is done before the task comes (measured on the 1.1B's
    export_and_verify task: 13.1 s without, 12.0 s with, mean of 4 runs each). The imported objects are frozen
    out of the collector's walks (MindSpore collects on every graph compile). Returns its seconds, or the
    error it met, which is the task's to meet again (the task's result carries this as "warm_up")."""
    import gc

    t0 = time.perf_counter()
    import mindspore as ms
    import numpy as np
    import onnx_ir  # noqa: F401
    from mindspore import Tensor

    from graphconv.target import blockwise, mindir_stream  # noqa: F401

    outcome = {}
    try:
        ms.set_device("CPU")
        ms.set_context(mode=ms.GRAPH_MODE)
        _tiny_network()(Tensor(np.ones((2, 4), np.float32)))
        mindir_stream.export_graph(_tiny_network(), Tensor(shape=[None, 4], dtype=ms.float32), file_name="warm-up")
    except Exception as e:  # noqa: BLE001 - an optimization only
        outcome["error"] = f"{type(e).__name__}: {_first_line(str(e))}"
    gc.collect()
    gc.freeze()
    return {**outcome, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str]) -> int:
    if argv[1:] == ["--serve"]:
        return serve()
    if argv[1:] == ["--warm"]:  # graphconv.target.child.Warm: MindSpore imported before the task's path comes
        warmed = _warm_up()
        line = sys.stdin.readline().strip()
        if not line:  # the compile needed no task (it failed before)
            return 0
        argv = [argv[0], line]
    else:
        warmed = None
    task_path = Path(argv[1])
    task = json.loads(task_path.read_text())
    result_path = Path(task["result"])
    result = handle(task) if warmed is None else {**handle(task), "warm_up": warmed}
    tmp = result_path.with_suffix(".partial")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)
    return 0 if result["ok"] else 1


def exit_without_teardown(code: int) -> None:
    """End the process now, its standard streams flushed: without the interpreter's teardown, whose release of
    every module and object took 1.1-1.2 s in this child after the 1.1B benchmark model's export_and_verify
    task (0.1 s without it, 2 runs each; the parent reads the result once the child has exited) and
    0.6-0.9 s in the `graphconv` command after a compile (graphconv.cli.run, which runs the exit handlers
    first). The caller has nothing pending: every file a task writes is closed before its result is."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv))
