"""A generated network built in the MindSpore child from what the compiler wrote (graphconv/compiler/export_task.py):
its source module, its weights (the weights file beside it, the folded constants, the model's own files), and
the cases it runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the child never imports the compiler: the type is for readers)
    from graphconv.compiler.export_task import ExportTask, Placeholder


def import_class(source: str, class_name: str):
    """The class `class_name` of the generated module `source` (graph mode reads construct from the file)."""
    spec = importlib.util.spec_from_file_location(Path(source).stem, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, class_name)


class Weights(dict):
    """name -> numpy array for every Parameter, as the generated `_param` asks for them. Weights that live in
    the model's own files (graphconv.frontend.weights) are read one at a time when asked for, so that only
    the Parameters hold the values; `shared` ones (name -> a built Parameter of the same layout, shape and
    dtype: the exported network's, for the cpu twin built in the same process) are given as they are."""

    def __init__(self, small: dict, external: dict, progress=None, shared: dict | None = None, deferred=None):
        super().__init__(small)
        self.external = external
        self.progress = progress
        self.shared = shared or {}
        self.deferred = deferred or {}  # name -> initializer not read up front (a shared name's own copy)

    def __missing__(self, name):
        from graphconv.frontend.weights import read

        if name in self.shared:
            return self.shared[name]
        if name in self.deferred:
            return self.deferred[name].const_value.numpy()
        ref = self.external[name]
        if self.progress is not None:
            self.progress(ref[2])
        return read(ref, mmap=False)


def weights(task: dict, progress=None, shared: dict | None = None) -> Weights:
    import numpy as np
    import onnx_ir as ir

    wanted = set(task["param_names"])
    shared = shared or {}
    small, deferred = {}, {}
    if task.get("weights_onnx"):
        model = ir.load(task["weights_onnx"])
        for name, value in model.graph.initializers.items():
            if name in shared:
                deferred[name] = value
            elif name in wanted:
                small[name] = value.const_value.numpy()
    if task.get("folded_npz"):
        with np.load(task["folded_npz"]) as folded:
            small.update({k: folded[k] for k in folded.files if k not in shared})
    external = task.get("external_weights") or {}
    missing = wanted - set(small) - set(external) - set(deferred) - set(shared)
    if missing:
        raise RuntimeError(f"weights missing for parameters {sorted(missing)[:5]}")
    return Weights(small, external, progress, shared, deferred)


def shareable(task: dict, built, built_task: dict) -> dict:
    """The Parameters of `built` (the network of `built_task`, in this process) that `task`'s network can use
    as its own: same name, layout, shape and dtype."""
    from graphconv.runtime import mindir_stream

    shapes, layouts, theirs = task.get("param_shapes") or {}, task.get("param_layouts") or {}, \
        built_task.get("param_layouts") or {}
    found = {}
    for p in built.get_parameters():
        if p.name not in shapes or p.name not in theirs:
            continue
        shape, dtype = shapes[p.name]
        if tuple(p.shape) == tuple(shape) and p.dtype == mindir_stream.ms_dtype(dtype) \
                and bool(theirs[p.name]) == bool(layouts.get(p.name)):
            found[p.name] = p
    return found


def sources(task: ExportTask) -> dict:
    """Parameter name -> graphconv.runtime.mindir_stream.Source, from the same three places `weights` reads:
    the weights file emit wrote (its big tensors are in its .data file), the folded constants, and the
    model's own files (external refs: the ONNX data, the spill file)."""
    import numpy as np
    import onnx_ir as ir

    from graphconv.runtime.mindir_stream import Source

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


def progress_writer(task: ExportTask):
    """A callback adding bytes read to the count the parent polls (graphconv.runtime.child.run_task), or None."""
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


def build(task: ExportTask, shared: dict | None = None):
    """The generated network with its Parameters bound (weights read as it asks for them; `shared` ones
    reused), in eval mode; and the seconds that took."""
    t0 = time.perf_counter()
    net = import_class(task["source"], task["class_name"])(weights(task, progress_writer(task), shared))
    net.set_train(False)
    return net, round(time.perf_counter() - t0, 2)


def placeholders(specs: list[Placeholder]) -> list:
    """Input placeholders (None for every symbolic dim) from the task's input specs."""
    import mindspore as ms
    from mindspore import Tensor

    return [Tensor(shape=s["shape"], dtype=getattr(ms, s["ms_dtype"])) for s in specs]


def typed(array):
    """np.savez stores bfloat16 (ml_dtypes) as 2-byte void: the same bytes, viewed as bfloat16 again."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        import ml_dtypes

        return array.view(ml_dtypes.bfloat16)
    return array


def run_cases(cell, task: dict, with_placeholders: bool = True) -> dict:
    """Each case file of the task through `cell`, its outputs saved where the task says."""
    import numpy as np
    from mindspore import Tensor

    # Dynamic placeholders are optional for a user (tests/test_graphcell_load.py runs "plain": true, as a user
    # who skips set_inputs does); with them the graph compiles once for every case, without them a GraphCell
    # re-infers and recompiles it at each new shape.
    if with_placeholders and not task.get("plain"):
        cell.set_inputs(*placeholders(task["inputs"]))
    results, seconds = [], []
    for case_path, out_path in zip(task["cases"], task["outputs"]):
        with np.load(case_path) as data:
            args = [Tensor(typed(data[name])) for name in task["input_names"]]
        t0 = time.perf_counter()
        out = cell(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        arrays = {f"out{i}": o.asnumpy() for i, o in enumerate(out)}
        seconds.append(round(time.perf_counter() - t0, 2))  # the first includes MindSpore's graph compile
        np.savez(out_path, **arrays)
        results.append(out_path)
    return {"outputs": results, "case_seconds": seconds}


_DEVICE_SET = False


def cpu_graph_mode() -> None:
    """CPU, graph mode. The device is set once per process (MindSpore refuses a second set_device, and a rank
    under msrun sets it before joining its group: graphconv/runtime/msrun.py)."""
    import mindspore as ms

    global _DEVICE_SET
    if not _DEVICE_SET:
        ms.set_device("CPU")
        _DEVICE_SET = True
    ms.set_context(mode=ms.GRAPH_MODE)


def first_line(message: str) -> str:
    """MindSpore errors carry long C++ call stacks: keep the first meaningful line. It differs from
    errors.first_line on purpose: MindSpore frames its stack in lines starting with "-", which it skips."""
    return next((ln for ln in message.strip().splitlines() if ln.strip() and not ln.startswith("-")), "")[:500]
