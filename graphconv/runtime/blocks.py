"""The block-by-block run (layer-streamed verification), in the MindSpore child: the network's blocks run one
after the other, so that only one block's weights are ever resident.

The compiler cut the network into blocks (graphconv/compiler/partition.py: the prologue, one block per layer,
the epilogue) and rendered each as a Cell class `_Block<k>` of a module of its own (codegen.render_blocks);
its plan (`Partition.plan`) says which boundary values each block reads and makes and which weights it binds,
in binding order. Here each block is built with its weights read from their files (graphconv.runtime.
mindir_stream.Source), runs every case, keeps its outputs, and is released before the next: the outputs at the
end are the whole network's (the same statements, in the same order, on the same kernels). The blocks of one
layer class run on one Cell, compiled once per input shape, which takes each layer's weights in turn
(Parameter.set_data in binding order): MindSpore keeps the memory of Parameters a new Cell would replace.

The run is also the streamed MindIR's weight writer (mindir_stream.WeightsFile): each block's Parameters, once
set, are put into the MindIR's data file, so the weights are read from disk and transposed once for both.
"""

from __future__ import annotations

import gc
import importlib.util
import resource
import sys
import time
from pathlib import Path

import numpy as np


def _import(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _BlockWeights:
    """The weights one block binds: read from their files as the generated `_param` asks for them (the source
    array: `_param` transposes it where the Parameter is stored transposed), or taken from `ready` (read ahead
    by _ReadAhead: name -> (array, whether it is transposed already); one transposed already is handed over as
    a ready Parameter, made by the generated module's own `_param`, which the block's `_param` takes as is)."""

    def __init__(self, block: dict, sources: dict, module, ready: dict | None = None):
        self.specs = {name: (shape, dtype) for name, _, shape, dtype in block["weights"]}
        self.sources, self.module, self.ready = sources, module, ready or {}
        self.read_bytes, self.read_ahead = 0, 0

    def _take(self, name: str) -> tuple[np.ndarray, bool]:
        entry = self.ready.pop(name, None)
        if entry is not None:
            self.read_ahead += 1
        else:
            src = self.sources[name]
            entry = (src.array if src.array is not None else src.read()), False
        self.read_bytes += entry[0].nbytes
        return entry

    def __getitem__(self, name: str):
        from graphconv.runtime.mindir_stream import ms_dtype

        array, flipped = self._take(name)
        if not flipped:
            return array
        shape, dtype = self.specs[name]
        return self.module._param({name: array}, name, tuple(shape), ms_dtype(dtype), False)

    def tensor(self, name: str, transposed: bool, param_value):
        """The weight in its Parameter's layout, as a Tensor (the generated module's `_param_value`)."""
        array, flipped = self._take(name)
        return param_value(array, transposed and not flipped)


class _ReadAhead:
    """One block's weights read from their files by a second thread while the block before it runs (the first
    block's: while the child exports the graph), the weights stored transposed transposed there too."""

    def __init__(self, sources: dict, block: dict):
        import threading

        self._result, self._error = {}, None
        self._thread = threading.Thread(target=self._run, args=(sources, block["weights"]),
                                        name=f"read-ahead {block['name']}", daemon=True)
        self._thread.start()

    def _run(self, sources: dict, weights: list) -> None:
        try:
            for name, transposed, _, _ in weights:
                src = sources.get(name)
                if src is None or src.array is not None or name in self._result:
                    continue
                flip = bool(transposed) and len(src.shape) == 2
                self._result[name] = (src.read_transposed() if flip else src.read()), flip
        except BaseException as e:  # noqa: BLE001 - raised in the block loop's thread
            self._error = e

    def result(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Prepared:
    """What the run needs before its first block, made while the child still exports the graph: the block
    module imported, the cases as Tensors, and (`read_ahead`) the first block's weights being read by a second
    thread, each next block's while one runs."""

    def __init__(self, plan: dict, run: dict, sources: dict, read_ahead: bool = False):
        from mindspore import Tensor

        self.plan, self.run, self.sources, self.read_ahead = plan, run, sources, read_ahead
        self.module = _import(plan["module"])
        self.envs = []
        for case_path in run["cases"]:
            with np.load(case_path) as data:
                self.envs.append({i: Tensor(data[n]) for i, n in zip(plan["args"], run["input_names"])})
        self.first = _ReadAhead(sources, plan["blocks"][0]) if read_ahead else None


def run_blocks(prepared: Prepared, weights_file=None) -> dict:
    """Run the cases through the blocks of the plan; write each case's outputs where the whole-network run
    writes them (run["outputs"][case]: out<i>) and the values every block passed on into
    run["block_values"][case] (keyed by boundary number). Returns a row per block (name, kind, class, outputs,
    seconds, weight bytes read, peak resident memory after it). `weights_file` (a streamed MindIR's
    mindir_stream.WeightsFile): each block's Parameters are put into it once set."""
    gc.freeze()  # the collections that release each block need not walk the module and cases again
    try:
        return _run_blocks(prepared, weights_file)
    finally:
        gc.unfreeze()


def _run_blocks(prepared: Prepared, weights_file) -> dict:
    import mindspore as ms

    plan, module, envs, run, sources = prepared.plan, prepared.module, prepared.envs, prepared.run, prepared.sources
    blocks = plan["blocks"]
    compiled: dict[str, object] = {}  # layer class -> the Cell that runs every layer of that class
    saved = [dict() for _ in envs]
    rows = []
    ahead = prepared.first
    for k, b in enumerate(blocks):
        t0 = time.perf_counter()
        reused = b["layer_class"] is not None and b["layer_class"] in compiled
        weights = _BlockWeights(b, sources, module, ahead.result() if ahead else None)
        if reused:  # its graphs are compiled: it takes this block's weights
            cell = compiled[b["layer_class"]]
            params = list(cell.get_parameters())
            _check_binding(b, params, names=False)
            for param, (name, transposed, _, _) in zip(params, b["weights"]):
                param.set_data(weights.tensor(name, transposed, module._param_value))
        else:
            cell = getattr(module, b["class"])(weights)
            cell.set_train(False)
            params = list(cell.get_parameters())
            _check_binding(b, params, names=True)
            compiled = {b["layer_class"]: cell} if b["layer_class"] else {}  # (only one is kept)
        nxt = k + 1 < len(blocks) and blocks[k + 1]
        ahead = _ReadAhead(sources, nxt) if nxt and prepared.read_ahead else None
        t1 = time.perf_counter()
        if weights_file is not None:
            for param, (name, transposed, _, _) in zip(params, b["weights"]):
                weights_file.put(name, param.asnumpy(), transposed)  # (asnumpy: a view of its memory)
        t2 = time.perf_counter()
        for env, kept in zip(envs, saved):
            try:
                out = cell(*[env[i] for i in b["inputs"]])
            except Exception as e:  # named for the parent's one-line error
                raise RuntimeError(f"block {b['name']} does not run: {type(e).__name__}: {str(e).strip()[:300]}") from e
            for i, v in zip(b["outputs"], out):
                env[i] = v
                if isinstance(v, ms.Tensor) and k + 1 < len(blocks) and str(i) in plan["onnx_names"]:
                    kept[i] = v.asnumpy()  # (compared with onnxruntime's value of its ONNX name)
        later = {i for c in blocks[k + 1:] for i in c["inputs"]}
        for env in envs:  # values no later block reads (the last block's outputs stay: the network's)
            for i in [i for i in env if i not in later and k + 1 < len(blocks)]:
                del env[i]
        del cell, params
        gc.collect()
        rows.append({"name": b["name"], "kind": b["kind"], "class": b["layer_class"], "outputs": b["outputs"],
                     "seconds": round(time.perf_counter() - t0, 2), "weight_bytes": weights.read_bytes,
                     "reused": reused, "weights_seconds": round(t1 - t0, 2), "write_seconds": round(t2 - t1, 2),
                     "weights_read_ahead": weights.read_ahead, "rss_after": _rss()})
    for env, kept, out_path, values_path in zip(envs, saved, run["outputs"], run["block_values"]):
        np.savez(out_path, **{f"out{n}": env[i].asnumpy() for n, i in enumerate(plan["outputs"])})
        np.savez(values_path, **{str(i): v for i, v in kept.items()})
    return {"outputs": run["outputs"], "blocks": rows, "layer_streamed": True,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # (the export's included)
            "case_seconds": [round(sum(r["seconds"] for r in rows), 2)]}


def _check_binding(block: dict, params: list, names: bool) -> None:
    """The block's Cell binds the Parameters its plan lists, in that order (by name where it was built for it)."""
    listed = [w[0] for w in block["weights"]]
    if len(params) != len(listed) or (names and [p.name for p in params] != listed):
        raise RuntimeError(f"block {block['name']} binds {len(params)} Parameters, its plan lists {len(listed)}")
