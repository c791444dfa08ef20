"""graphconv as an ONNX backend (`onnx.backend.base.Backend`), the way onnxruntime.backend is one.

    import graphconv.tools.backend
    rep = graphconv.tools.backend.prepare(model)          # load stage: check, opset, shape inference, op coverage
    outputs = rep.run([x, y])                       # lower, emit MindIR, run it with MindSpore on CPU

    onnx.backend.test.BackendTest(graphconv.tools.backend, __name__)   # onnx's own conformance suite

Everything goes through the compile pipeline's stages: `graphconv.frontend.load.load` (the model is written to a
private folder first), `graphconv.compiler.lowering` via `graphconv.compiler.export_task.prepare`,
`mindspore.export` to MindIR, and the
MindIR is loaded into an `nn.GraphCell` and run on CPU, by graphconv.runtime.worker's tasks in one long-lived child
process (graphconv.runtime.child.Server: MindSpore can abort from C++); a crash fails that run and the next run starts
a new child.

Two things a backend has to decide that `graphconv compile` does not:
- **Opsets below 13** (the node tests build each model at its op's since_version, so `And` is opset 7) are
  upgraded to opset 13 with onnx.version_converter first; above load.MAX_OPSET (28, the newest onnx 1.23
  defines) the model is refused like `compile` does.
- **Compile-time inputs.** Some lowerings need a value at compile time that a node test passes as a graph
  input (Reduce* axes, Pad pads, Tile repeats, Resize scales...). When the lowering refuses a node for that
  reason, `run` binds the small graph inputs feeding that node's parameter inputs (position >= 1, directly
  or through shape arithmetic) to the values it was given (they become initializers) and compiles once per
  distinct value. A node is never left with constant inputs only (that would let the lowering fold it with
  onnx.reference instead of running it with MindSpore). `GraphconvRep.bound` names them after a run. If the
  lowering still refuses, shape arithmetic is evaluated first (`fold_static`: Shape of static values, nodes
  with constant inputs, If with a constant condition) so that ONNX shape inference sees its results.

Compiled networks are cached per (model, bound values): a suite never pays the same compile twice.
`run_batch` is the batch form the conformance command uses (graphconv.runtime.runner.run_models: one MindSpore child
for many models).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from graphconv.frontend import load
from graphconv.compiler import constant_fold, export_task, lowering, node_context
from graphconv.runtime.child import ChildError, Server
from graphconv.errors import GraphconvError, InternalError, UnsupportedError
from graphconv.onnx_domains import DEFAULT_DOMAINS, find_default_opset, is_default_domain

MIN_OPSET, MAX_OPSET = load.MIN_OPSET, load.MAX_OPSET
_NODE_ERROR = re.compile(r"node '([^']*)' \(")
# The parameter inputs of an op, as a slice (default: all but the first, the data); Loop's are its trip count and
# condition (the loop-carried values are data).
_PARAMETERS = {"Loop": (0, 2)}
# Bound inputs are small parameter vectors (axes, pads, sizes, scales); a larger input stays a run-time input.
_BIND_MAX_ELEMENTS = 64


# --- the load stage for an in-memory model --------------------------------------------------------------------


def check_interface(model: onnx.ModelProto) -> None:
    """Refuse, in one line, what the backend cannot exchange with MindSpore: other domains than the standard one,
    non-tensor graph inputs/outputs, and element types MindSpore has no tensors for (or, for bfloat16, that numpy
    cannot hand to MindSpore)."""
    domains = sorted({i.domain for i in model.opset_import} - {*DEFAULT_DOMAINS, "mindspore"})
    if domains:
        raise UnsupportedError(f"domain {', '.join(domains)} is not supported (graphconv lowers the standard ONNX "
                               "domain)")
    for role, values in (("input", model.graph.input), ("output", model.graph.output)):
        for vi in values:
            kind = vi.type.WhichOneof("value")
            if kind != "tensor_type":
                raise UnsupportedError(f"graph {role} {vi.name!r} is a {(kind or 'untyped').replace('_type', '')} "
                                       "value; graphconv lowers tensors only")
            elem = vi.type.tensor_type.elem_type
            name = onnx.TensorProto.DataType.Name(elem).lower() if elem else "undefined"
            if elem == onnx.TensorProto.BFLOAT16:
                raise UnsupportedError(f"graph {role} {vi.name!r} is bfloat16: MindSpore cannot take or return "
                                       "bfloat16 numpy arrays (bfloat16 inside the network is supported)")
            if elem and ir.DataType(elem) not in node_context.MS_DTYPES:
                raise UnsupportedError(f"graph {role} {vi.name!r} has dtype {name}, which MindSpore has no tensors for")


def load_model(model: onnx.ModelProto | str | bytes | os.PathLike, workdir: Path) -> onnx.ModelProto:
    """graphconv's load stage (checker, opset range, shape inference, node names) for a proto, bytes or path."""
    if isinstance(model, (str, os.PathLike)):
        model = load.read_proto(Path(model))
    elif isinstance(model, bytes):
        model = onnx.load_from_string(model)
    check_interface(model)
    model = load.upgrade(model)
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
    lowering.lower(ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True)))


def _live(model: onnx.ModelProto, bound: set[str]) -> set[str]:
    """Values that depend on a run-time input once `bound` inputs are constants."""
    inits = {t.name for t in model.graph.initializer}
    live = {vi.name for vi in model.graph.input if vi.name not in inits and vi.name not in bound}
    for node in model.graph.node:
        if any(i in live for i in node.input):
            live.update(o for o in node.output if o)
    return live


def _cone(nodes: list, start: list[str]) -> set[str]:
    """The values `start` depend on (themselves included)."""
    producer = {o: n for n in nodes for o in n.output if o}
    cone, stack = set(), [v for v in start if v]
    while stack:
        v = stack.pop()
        if v in cone:
            continue
        cone.add(v)
        if v in producer:
            stack.extend(i for i in producer[v].input if i)
    return cone


def _bindable(model: onnx.ModelProto, error: UnsupportedError, feeds: dict, bound: set[str]) -> list[str]:
    """Small graph inputs that feed the parameter inputs (position >= 1) of the node `error` names, directly
    or through shape arithmetic; failing those, the small integer graph inputs its data depends on (sizes that
    shape it); [] when binding them would leave that node (or another consumer) with constant inputs only."""
    m = _NODE_ERROR.search(str(error))
    if not m:
        return []
    nodes = list(model.graph.node)
    failing = next((n for n in nodes if n.name == m.group(1)), None)
    if failing is None:
        return []
    producer = {o: n for n in nodes for o in n.output if o}
    start, stop = _PARAMETERS.get(failing.op_type, (1, None))
    runtime = {vi.name: vi for vi in model.graph.input}

    def candidates(cone, integers_only):
        return [name for name in sorted(cone)
                if name in runtime and name not in bound and name in feeds
                and np.asarray(feeds[name]).size <= _BIND_MAX_ELEMENTS
                and (not integers_only or np.asarray(feeds[name]).dtype.kind in "iu")]

    cone = _cone(nodes, list(failing.input)[start:stop])
    picks = candidates(cone, False)
    if not picks:
        cone = _cone(nodes, list(failing.input))
        picks = candidates(cone, True)
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
    folded = False
    while True:
        candidate = _bind(model, {n: feeds[n] for n in bound})
        if folded:
            candidate = fold_static(candidate)
        try:
            _lower_check(candidate)
            return candidate, sorted(bound)
        except UnsupportedError as e:
            picks = _bindable(candidate, e, feeds, bound)
            if picks:
                bound.update(picks)
            elif not folded:
                folded = True
            else:
                raise


def fold_static(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape arithmetic evaluated before the lowering, so that shape inference sees its results (the lowering folds
    the same nodes, but too late for ONNX shape inference to know, say, the sizes a computed Split produces):
    Shape/Size of statically shaped values, Constant nodes, and nodes of the main graph whose inputs are all
    constants (evaluated with onnx.reference) become initializers, an If with a constant condition is replaced by
    its taken branch; repeated until nothing changes."""
    model = _reinfer(model)
    opset = find_default_opset(model) or MIN_OPSET
    for _ in range(16):
        graph = model.graph
        consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
        shapes = {}
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            dims = vi.type.tensor_type.shape.dim
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape") and \
                    all(d.HasField("dim_value") for d in dims):
                shapes[vi.name] = [d.dim_value for d in dims]
        keep, added, inlined = [], [], False
        for node in graph.node:
            values = None
            subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
            if subgraph:
                inlined |= _localise_constants(node, consts)
            if node.op_type == "If" and is_default_domain(node.domain) and node.input[0] in consts:
                # A constant condition: the taken branch replaces the If (its outputs renamed by Identity nodes).
                taken = "then_branch" if bool(np.asarray(consts[node.input[0]]).reshape(-1)[0]) else "else_branch"
                branch = next(a.g for a in node.attribute if a.name == taken)
                for k, inner in enumerate(branch.node):
                    inner.name = inner.name or f"{node.name}_{k}_{inner.op_type}"
                keep.extend(branch.node)
                graph.initializer.extend(branch.initializer)
                keep.extend(onnx.helper.make_node("Identity", [b.name], [o], name=f"{node.name}_{o}")
                            for b, o in zip(branch.output, node.output) if o)
                inlined = True
                continue
            if not constant_fold.foldable(node.domain, node.op_type, subgraph):
                pass
            elif node.op_type in ("Shape", "Size") and node.input[0] in shapes:
                dims = shapes[node.input[0]]
                if node.op_type == "Size":
                    values = [np.array(int(np.prod(dims, dtype=np.int64)), np.int64)]
                else:
                    attrs = {a.name: a.i for a in node.attribute}
                    values = [np.array(dims[attrs.get("start", 0):attrs.get("end", None)], np.int64)]
            elif node.input and all(i == "" or i in consts for i in node.input) or node.op_type == "Constant":
                # No FOLD_MAX_ELEMENTS here: a value left unfolded hides its shape from shape inference.
                values = constant_fold.evaluate(node, {i: consts[i] for i in node.input if i}, opset)
            if values is None:
                keep.append(node)
                continue
            for name, v in zip([o for o in node.output if o], values):
                added.append(onnx.numpy_helper.from_array(np.asarray(v), name))
                consts[name] = np.asarray(v)
        if not added and not inlined:
            return model
        del graph.node[:]
        graph.node.extend(keep)
        graph.initializer.extend(added)
        model = _reinfer(model)
    return model


def _localise_constants(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> bool:
    """Small main-graph constants a body reads from the outer scope (Unsqueeze axes, say) copied into the body as
    Constant nodes under a new name: ONNX shape inference does not look up outer-scope values, so without the
    copy a body's shapes stay unknown. True when something was copied."""
    changed = False
    for attr in node.attribute:
        for body in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            local = {t.name for t in body.initializer} | {i.name for i in body.input} | \
                {o for n in body.node for o in n.output}
            copies = {}
            for inner in body.node:
                for k, name in enumerate(inner.input):
                    if name in consts and name not in local and np.asarray(consts[name]).size <= _BIND_MAX_ELEMENTS:
                        copies.setdefault(name, f"{name}__in_{body.name or 'body'}")
                        inner.input[k] = copies[name]
            if copies:
                nodes = [onnx.helper.make_node("Constant", [], [new], value=onnx.numpy_helper.from_array(
                    np.asarray(consts[old]), new)) for old, new in copies.items()] + list(body.node)
                del body.node[:]
                body.node.extend(nodes)
                changed = True
    return changed


def _reinfer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference from scratch: earlier results (value_info) computed without the folded values are dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(out, data_prop=True)


def _key(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:20]


# --- the backend ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Network:
    key: str
    task: dict
    source: str
    input_names: list[str]
    output_names: list[str]


class _State:
    """Per-process caches: loaded models, compiled networks, the MindSpore child (a graphconv.runtime.worker server)."""

    def __init__(self):
        self.root: Path | None = None
        self.server: Server | None = None
        self.networks: dict[str, _Network] = {}
        self.loaded: dict[str, onnx.ModelProto] = {}

    def dir(self) -> Path:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="graphconv-backend-"))
            atexit.register(self.close)
        return self.root

    def get_server(self) -> Server:
        if self.server is None:
            self.server = Server(self.dir())
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
    """Lower and emit (cached per model); the child exports the MindIR (once: the file stays)."""
    key = _key(model)
    net = _STATE.networks.get(key)
    if net is None:
        work = _STATE.dir() / key
        work.mkdir(exist_ok=True)
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        lowered, task = export_task.prepare(inferred, work, "net")
        task = {**task, "file_base": str(work / "net"), "checkpoint": None}
        net = _Network(key, task, lowered.source, [s["name"] for s in task["inputs"]], lowered.output_names)
        _STATE.networks[key] = net
    if not Path(net.task["file_base"] + ".mindir").exists():
        try:
            _STATE.get_server().request("export", net.task, "MindSpore")
        except ChildError as e:
            raise InternalError(f"MindSpore could not export the network: {e.error}") from None
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
        # "keep": the child keeps the loaded GraphCell for the next runs of this network.
        run = {"mindir": net.task["file_base"] + ".mindir", "inputs": net.task["inputs"], "keep": True,
               "input_names": net.input_names, "cases": [str(in_path)], "outputs": [str(out_path)]}
        try:
            _STATE.get_server().request("run_mindir", run, "MindSpore")
        except ChildError as e:
            raise InternalError(f"MindSpore failed to run the network: {e.error}") from None
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
        try:
            return Device(device).type == DeviceType.CPU
        except (AttributeError, ValueError):  # a device name onnx does not know (GPU, NPU...)
            return False

    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs) -> GraphconvRep:
        """Load (check, upgrade below opset 13, refuse above load.MAX_OPSET, infer shapes) and refuse every op that
        has no lowering, in one error; cached per model."""
        if isinstance(model, GraphconvRep):
            return model
        if not cls.supports_device(device):
            raise UnsupportedError(f"device {device!r}: graphconv.tools.backend runs on CPU only")
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
            missing = lowering.unsupported_ops(loaded)
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
        definition of the op up to load.MAX_OPSET)."""
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


def prepare_case(model: onnx.ModelProto, data_sets: list[list[np.ndarray]], workdir: Path):
    """What `prepare` + `run` do before MindSpore, for a model and all its input sets at once. Returns
    (model to run, feeds per data set, bound names) or raises a GraphconvError."""
    loaded = load_model(model, workdir)
    missing = lowering.unsupported_ops(loaded)
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
    """For each (model, data sets): the backend's preparation, then one graphconv.runtime.runner.run_models child for
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
    from graphconv.runtime.runner import run_isolating_crashes

    for k, res in zip(index, run_isolating_crashes(runnable) if runnable else []):
        results[k] = BatchResult(res.outputs, res.error, bound=bound_of[k], source=res.source)
    return results


# The module-level API onnx.backend.test.BackendTest and onnxruntime.backend users expect.
is_compatible = GraphconvBackend.is_compatible
prepare = GraphconvBackend.prepare
run = GraphconvBackend.run_model
run_model = GraphconvBackend.run_model
run_node = GraphconvBackend.run_node
supports_device = GraphconvBackend.supports_device

