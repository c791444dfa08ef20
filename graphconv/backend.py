"""graphconv as an ONNX backend (`onnx.backend.base.Backend`), the way onnxruntime.backend is one.

    import graphconv.backend
    rep = graphconv.backend.prepare(model)          # load stage: check, opset, shape inference, op coverage
    outputs = rep.run([x, y])                       # lower, emit MindIR, run it with MindSpore on CPU

    onnx.backend.test.BackendTest(graphconv.backend, __name__)   # onnx's own conformance suite

Everything goes through the compile pipeline's stages: `graphconv.load.load` (the model is written to a
private folder first), `graphconv.lower` via `graphconv.emit.prepare`, `mindspore.export` to MindIR, and the
MindIR is loaded into an `nn.GraphCell` and run on CPU. MindSpore lives in one long-lived child process (it
can abort from C++); a crash fails that run and the next run starts a new child.

Two things a backend has to decide that `graphconv compile` does not:
- **Opsets below 13** (the node tests build each model at its op's since_version, so `And` is opset 7) are
  upgraded to opset 13 with onnx.version_converter first; above 23 the model is refused like `compile` does.
- **Compile-time inputs.** Some lowerings need a value at compile time that a node test passes as a graph
  input (Reduce* axes, Pad pads, Tile repeats, Resize scales...). When the lowering refuses a node for that
  reason, `run` binds the small graph inputs feeding that node's parameter inputs (position >= 1, directly
  or through shape arithmetic) to the values it was given (they become initializers) and compiles once per
  distinct value. A node is never left with constant inputs only (that would let the lowering fold it with
  onnx.reference instead of running it with MindSpore). `GraphconvRep.bound` names them after a run.

Compiled networks are cached per (model, bound values): a suite never pays the same compile twice.
`run_batch` is the batch form the conformance command uses (graphconv.runner.run_models: one MindSpore child
for many models).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from graphconv import emit, load, lower
from graphconv.child import child_env
from graphconv.errors import GraphconvError, InternalError, UnsupportedError

MIN_OPSET, MAX_OPSET = load.MIN_OPSET, load.MAX_OPSET
_NODE_ERROR = re.compile(r"node '([^']*)' \(")
# The parameter inputs of an op, as a slice (default: all but the first, the data); Loop's are its trip count and
# condition (the loop-carried values are data).
_PARAMETERS = {"Loop": (0, 2)}
# Bound inputs are small parameter vectors (axes, pads, sizes, scales); a larger input stays a run-time input.
_BIND_MAX_ELEMENTS = 64


# --- the load stage for an in-memory model --------------------------------------------------------------------


def _default_opset(model: onnx.ModelProto) -> int | None:
    return next((i.version for i in model.opset_import if i.domain in load.DEFAULT_DOMAINS), None)


def upgrade(model: onnx.ModelProto) -> onnx.ModelProto:
    """A model below opset 13 upgraded to 13 with onnx.version_converter; others unchanged."""
    opset = _default_opset(model)
    if opset is None or opset >= MIN_OPSET:
        return model
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors from C++
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnsupportedError(f"opset {opset} is below {MIN_OPSET} and onnx.version_converter cannot upgrade "
                               f"this model: {first[:200]}") from None


def load_model(model: onnx.ModelProto | str | bytes | os.PathLike, workdir: Path) -> onnx.ModelProto:
    """graphconv's load stage (checker, opset range, shape inference, node names) for a proto, bytes or path."""
    if isinstance(model, (str, os.PathLike)):
        model = load.read_proto(Path(model))
    elif isinstance(model, bytes):
        model = onnx.load_from_string(model)
    for role, values in (("input", model.graph.input), ("output", model.graph.output)):
        for vi in values:
            kind = vi.type.WhichOneof("value")
            if kind != "tensor_type":
                raise UnsupportedError(f"graph {role} {vi.name!r} is a {(kind or 'untyped').replace('_type', '')} "
                                       "value; graphconv lowers tensors only")
    model = upgrade(model)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "model.onnx"
    onnx.save(model, str(path))
    return load.load(path).proto


# --- compile-time inputs --------------------------------------------------------------------------------------


def _bind(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    if not values:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [vi for vi in out.graph.input if vi.name not in values]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    for name, value in values.items():
        out.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value), name))
    return out


def _lower_check(model: onnx.ModelProto) -> None:
    lower.lower(ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True)))


def _live(model: onnx.ModelProto, bound: set[str]) -> set[str]:
    """Values that depend on a run-time input once `bound` inputs are constants."""
    inits = {t.name for t in model.graph.initializer}
    live = {vi.name for vi in model.graph.input if vi.name not in inits and vi.name not in bound}
    for node in model.graph.node:
        if any(i in live for i in node.input):
            live.update(o for o in node.output if o)
    return live


def _bindable(model: onnx.ModelProto, error: UnsupportedError, feeds: dict, bound: set[str]) -> list[str]:
    """Small graph inputs that feed the parameter inputs (position >= 1) of the node `error` names, directly
    or through shape arithmetic; [] when binding them would leave that node (or another consumer) with
    constant inputs only."""
    m = _NODE_ERROR.search(str(error))
    if not m:
        return []
    nodes = list(model.graph.node)
    failing = next((n for n in nodes if n.name == m.group(1)), None)
    if failing is None:
        return []
    producer = {o: n for n in nodes for o in n.output if o}
    start, stop = _PARAMETERS.get(failing.op_type, (1, None))
    params = list(failing.input)[start:stop]
    cone, stack, seen = set(), [i for i in params if i], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        cone.add(v)
        if v in producer:
            stack.extend(i for i in producer[v].input if i)
    runtime = {vi.name: vi for vi in model.graph.input}
    picks = [name for name in sorted(cone)
             if name in runtime and name not in bound and name in feeds
             and np.asarray(feeds[name]).size <= _BIND_MAX_ELEMENTS]
    if not picks:
        return []
    live = _live(model, bound | set(picks))
    cone_nodes = {id(producer[v]) for v in cone if v in producer}
    for node in nodes:
        uses_pick = any(i in picks for i in node.input)
        if node is failing or (uses_pick and id(node) not in cone_nodes):
            if not any(i in live for i in node.input if i):
                return []  # every input constant: the lowering would fold the node instead of running it
    return picks


def specialise(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None) -> tuple[onnx.ModelProto, list[str]]:
    """The model to compile for these inputs: unchanged when it lowers as is, else with the compile-time inputs
    of the refusing nodes bound to their values (repeated while that helps). Raises the lowering's
    UnsupportedError when binding cannot help."""
    bound: set[str] = set()
    feeds = feeds or {}
    while True:
        candidate = _bind(model, {n: feeds[n] for n in bound})
        try:
            _lower_check(candidate)
            return candidate, sorted(bound)
        except UnsupportedError as e:
            picks = _bindable(model, e, feeds, bound)
            if not picks:
                raise
            bound.update(picks)


def _key(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:20]


# --- the MindSpore child --------------------------------------------------------------------------------------

_REPLY = "@@graphconv-backend "


class _Server:
    """One long-lived MindSpore child: exports networks to MindIR and runs them (GraphCell on CPU)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.loaded: set[str] = set()
        self.log = workdir / "mindspore-child.log"

    def _start(self) -> None:
        self.loaded = set()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphconv.backend", "--serve"], cwd=self.workdir, env=child_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "ab"), text=True, bufsize=1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def request(self, message: dict) -> dict:
        if not self.alive():
            self._start()
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith(_REPLY):
                    return json.loads(line[len(_REPLY):])
        except (BrokenPipeError, OSError):
            pass
        code = self.proc.wait()
        self.proc = None
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:] if self.log.exists() else []
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        raise InternalError(f"the MindSpore child process died ({how}): {' | '.join(tail)[-300:]}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc = None


def _serve() -> int:
    """The child's loop: one JSON request per stdin line, one reply line on stdout."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from graphconv import worker

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cells: dict[str, Any] = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "load":
                task = req["task"]
                mindir = task["file_base"] + ".mindir"
                if not Path(mindir).exists():
                    worker.export(task)
                cell = nn.GraphCell(ms.load(mindir))
                cell.set_inputs(*[Tensor(shape=s["shape"], dtype=getattr(ms, s["ms_dtype"])) for s in task["inputs"]])
                if len(cells) >= 32:
                    cells.pop(next(iter(cells)))
                cells[req["key"]] = cell
                reply = {"ok": True}
            elif req["op"] == "run":
                with np.load(req["inputs"]) as data:
                    args = [Tensor(data[name]) for name in req["input_names"]]
                out = cells[req["key"]](*args)
                out = out if isinstance(out, (tuple, list)) else (out,)
                np.savez(req["outputs"], **{f"out{i}": o.asnumpy() for i, o in enumerate(out)})
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown request {req['op']!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            reply = {"ok": False, "error": f"{type(e).__name__}: {worker._first_line(str(e))}"}
        print(_REPLY + json.dumps(reply), flush=True)
    return 0


# --- the backend ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Network:
    key: str
    task: dict
    source: str
    input_names: list[str]
    output_names: list[str]


class _State:
    """Per-process caches: loaded models, compiled networks, the MindSpore child."""

    def __init__(self):
        self.root: Path | None = None
        self.server: _Server | None = None
        self.networks: dict[str, _Network] = {}
        self.loaded: dict[str, onnx.ModelProto] = {}

    def dir(self) -> Path:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="graphconv-backend-"))
            atexit.register(self.close)
        return self.root

    def get_server(self) -> _Server:
        if self.server is None:
            self.server = _Server(self.dir())
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        self.networks.clear()
        self.loaded.clear()


_STATE = _State()


def _compile(model: onnx.ModelProto) -> _Network:
    """Lower and emit (cached per model); the child exports the MindIR and keeps the GraphCell."""
    key = _key(model)
    net = _STATE.networks.get(key)
    server = _STATE.get_server()
    if net is None:
        work = _STATE.dir() / key
        work.mkdir(exist_ok=True)
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        lowered, task = emit.prepare(inferred, work, "net")
        task = {**task, "file_base": str(work / "net"), "checkpoint": None}
        net = _Network(key, task, lowered.source, [s["name"] for s in task["inputs"]], lowered.output_names)
        _STATE.networks[key] = net
    if not server.alive() or key not in server.loaded:
        reply = server.request({"op": "load", "key": key, "task": net.task})
        if not reply["ok"]:
            raise InternalError(f"MindSpore could not export or load the network: {reply['error']}")
        server.loaded.add(key)
    return net


class GraphconvRep(BackendRep):
    """A loaded model; `run` compiles it for MindSpore (once per distinct set of compile-time inputs) and runs it
    on CPU."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.input_names = [vi.name for vi in model.graph.input
                            if vi.name not in {t.name for t in model.graph.initializer}]
        self.output_names = [vi.name for vi in model.graph.output]
        self.bound: list[str] = []  # graph inputs bound at compile time by the last run

    def _feeds(self, inputs) -> dict[str, np.ndarray]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray) or np.isscalar(inputs):
                inputs = [inputs]
            inputs = list(inputs)
            if len(inputs) != len(self.input_names):
                raise GraphconvError(f"the model takes {len(self.input_names)} inputs, {len(inputs)} given")
            feeds = dict(zip(self.input_names, inputs))
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise GraphconvError(f"inputs missing: {missing}")
        return {n: np.asarray(feeds[n]) for n in self.input_names}

    def run(self, inputs, **kwargs) -> tuple:
        feeds = self._feeds(inputs)
        model, self.bound = specialise(self.model, feeds)
        net = _compile(model)
        work = _STATE.dir() / net.key
        k = len(list(work.glob("run*.npz")))
        in_path, out_path = work / f"run{k}.npz", work / f"run{k}.out.npz"
        np.savez(in_path, **{n: feeds[n] for n in net.input_names})
        server = _STATE.get_server()
        reply = server.request({"op": "run", "key": net.key, "input_names": net.input_names,
                                "inputs": str(in_path), "outputs": str(out_path)})
        if not reply["ok"]:
            raise InternalError(f"MindSpore failed to run the network: {reply['error']}")
        with np.load(out_path) as z:
            outs = [z[f"out{i}"] for i in range(len(z.files))]
        return namedtupledict("Outputs", self.output_names)(*outs)


class GraphconvBackend(Backend):
    """onnx.backend.base.Backend over graphconv's pipeline; MindSpore on CPU."""

    @classmethod
    def is_compatible(cls, model, device: str = "CPU", **kwargs) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU

    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs) -> GraphconvRep:
        """Load (check, upgrade below opset 13, refuse above 23, infer shapes) and refuse every op that has no
        lowering, in one error; cached per model."""
        if isinstance(model, GraphconvRep):
            return model
        if not cls.supports_device(device):
            raise UnsupportedError(f"device {device!r}: graphconv.backend runs on CPU only")
        if isinstance(model, onnx.ModelProto):
            raw = model.SerializeToString(deterministic=True)
        elif isinstance(model, bytes):
            raw = model
        else:
            raw = Path(model).read_bytes()
        key = hashlib.sha256(raw).hexdigest()[:20]
        loaded = _STATE.loaded.get(key)
        if loaded is None:
            loaded = load_model(raw, _STATE.dir() / f"model-{key}")
            missing = lower.unsupported_ops(loaded)
            if missing:
                raise UnsupportedError(f"graphconv cannot lower: {', '.join(missing)}")
            _STATE.loaded[key] = loaded
        return GraphconvRep(loaded)

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs, device: str = "CPU", outputs_info=None, **kwargs) -> tuple:
        """One node as a model: inputs typed from the arrays given, at `opset_version` (default: the newest
        definition of the op up to opset 23)."""
        opset = kwargs.get("opset_version") or max(MIN_OPSET, onnx.defs.get_schema(
            node.op_type, MAX_OPSET, node.domain).since_version)
        arrays = [np.asarray(a) for a in (inputs.values() if isinstance(inputs, dict) else inputs)]
        names = [n for n in node.input if n]
        graph_inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                        for n, a in zip(names, arrays)]
        if outputs_info:
            graph_outputs = [onnx.helper.make_tensor_value_info(
                n, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
                for n, (dt, shape) in zip(node.output, outputs_info)]
        else:
            graph_outputs = [onnx.ValueInfoProto(name=n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(node.domain, opset)])
        model = onnx.shape_inference.infer_shapes(model)
        return cls.run_model(model, arrays, device)


# --- the batch form (conformance) -----------------------------------------------------------------------------


@dataclasses.dataclass
class BatchResult:
    outputs: list[list[np.ndarray]] | None  # per data set
    error: str | None = None
    unsupported: bool = False  # graphconv refused the model (as opposed to a failure while running it)
    bound: list[str] = dataclasses.field(default_factory=list)
    source: str | None = None


def _run_isolating_crashes(items) -> list:
    from graphconv.runner import RunResult, run_models

    try:
        return run_models(items)
    except InternalError as e:
        if len(items) == 1:
            return [RunResult(None, f"MindSpore child crashed: {e}")]
        mid = len(items) // 2
        return _run_isolating_crashes(items[:mid]) + _run_isolating_crashes(items[mid:])


def prepare_case(model: onnx.ModelProto, data_sets: list[list[np.ndarray]], workdir: Path):
    """What `prepare` + `run` do before MindSpore, for a model and all its input sets at once. Returns
    (model to run, feeds per data set, bound names) or raises a GraphconvError."""
    loaded = load_model(model, workdir)
    missing = lower.unsupported_ops(loaded)
    if missing:
        raise UnsupportedError(f"no lowering for {', '.join(missing)}")
    rep = GraphconvRep(loaded)
    feeds = [rep._feeds(list(inputs)) for inputs in data_sets]
    specialised, bound = specialise(loaded, feeds[0])
    for f in feeds[1:]:
        again, b = specialise(loaded, f)
        if b != bound or _key(again) != _key(specialised):
            raise UnsupportedError("the data sets need different compile-time inputs; run them one at a time")
    runtime = [{n: f[n] for n in rep.input_names if n not in bound} for f in feeds]
    return specialised, runtime, bound


def run_batch(items: list[tuple[onnx.ModelProto, list[list[np.ndarray]]]], workdir: Path) -> list[BatchResult]:
    """For each (model, data sets): the backend's preparation, then one graphconv.runner.run_models child for
    the whole batch (bisected when MindSpore aborts, so a crash is pinned on its model)."""
    results: list[BatchResult | None] = [None] * len(items)
    runnable, index, bound_of = [], [], {}
    for k, (model, data_sets) in enumerate(items):
        try:
            specialised, feeds, bound = prepare_case(model, data_sets, workdir / f"case{k}")
        except UnsupportedError as e:
            results[k] = BatchResult(None, str(e), unsupported=True)
            continue
        except GraphconvError as e:
            results[k] = BatchResult(None, str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a lowering bug is this case's failure, not the batch's
            results[k] = BatchResult(None, f"internal error: {type(e).__name__}: {e}")
            continue
        runnable.append((specialised, feeds))
        index.append(k)
        bound_of[k] = bound
    for k, res in zip(index, _run_isolating_crashes(runnable) if runnable else []):
        results[k] = BatchResult(res.outputs, res.error, bound=bound_of[k], source=res.source)
    return results


# The module-level API onnx.backend.test.BackendTest and onnxruntime.backend users expect.
is_compatible = GraphconvBackend.is_compatible
prepare = GraphconvBackend.prepare
run = GraphconvBackend.run_model
run_model = GraphconvBackend.run_model
run_node = GraphconvBackend.run_node
supports_device = GraphconvBackend.supports_device


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.exit(_serve())
    sys.exit("usage: python -m graphconv.backend --serve  (the MindSpore child of graphconv.backend)")
