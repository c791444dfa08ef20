"""Layer-streamed verification: the generated network run block by block, so that only one block's weights
are ever resident.

The generated network (graphconv/target/codegen.py) computes, in its construct, a prologue, then one
statement per repeated layer (`h = self.layers[3](x, mask, ...)`: an instance of the layer's Cell class in a
CellList), then an epilogue. `plan` cuts that construct, read from the generated source, into *blocks*: each
layer call is one, each run of other statements between them another (the prologue, the epilogue, layers
left inline). Each block becomes a Cell class of its own (`block_source`): its __init__ binds only the
attributes its statements use (the layer block: the one layer instance, built from the same CellList row),
its construct takes the values it reads and returns the values later blocks read. `run_blocks` (in the
MindSpore child) builds one block at a time with its weights read from their files (graphconv.target.
mindir_stream.Source), runs every case through it, keeps its outputs, and releases it before the next: the
outputs at the end are those of the whole network (the same statements, in the same order, on the same
kernels). Blocks that are the same up to renaming (`structure`: a model's layers) run on one Cell, compiled
once per input shape, which takes each block's weights in turn (Parameter.set_data): the first layer's graph
compile serves them all (measured on the 1.1B benchmark model: ~1.2 s per layer instead of ~2.7 s).

The run is also the streamed MindIR's weight writer (mindir_stream.WeightsFile): each block's Parameters,
once set, are put into the MindIR's data file (by a background thread, while the block runs), so the
weights are read from disk and transposed once for both. The next block's weights are asked of the kernel
ahead (posix_fadvise WILLNEED), so that their reading overlaps this block's work.

The reference: onnxruntime runs the model one layer at a time (graphconv.verify.piecewise), keeping the
ONNX values the block boundaries correspond to; where the oracle could not be cut into layers, it runs the
model once with those values added as graph outputs (`oracle_values`).
A generated name maps to an ONNX value when the code generator's naming of that value gives exactly it
(`onnx_names`; a layer call's outputs are named `<list>_<index>_<value without its layer path>`). Boundary
values with no ONNX counterpart (a value made by the lowering) are not compared on their own: the next block
that reads them is checked at its outputs.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import json
import resource
import time
from pathlib import Path

import numpy as np

from graphconv.frontend import readahead
from graphconv.target.codegen import py_name
from graphconv.target.layers import _strip, layer_of

# Above this many bytes of Parameters the compile verifies layer by layer (CompileOptions.layer_streamed
# overrides): the whole-network check holds every weight at once (the cpu twin's Parameters, or
# mindspore.load's ~2x for the cpu target), which past a few GiB is the compile's peak memory.
THRESHOLD_BYTES = 2 << 30


@dataclasses.dataclass
class Block:
    """One piece of the construct: `kind` "layer" (one layer call) or "code" (statements between them)."""

    kind: str  # layer | inline (a layer left inline, cut out by the weights it reads) | code
    name: str  # prologue | epilogue | code <k> | <list attr>[<index>] | <layer module path> (inline)
    inputs: list[str]  # generated names it reads (construct args or earlier blocks' outputs)
    outputs: list[str]  # generated names it makes that later blocks read (the last block: the return)
    statements: list[ast.stmt]
    layer: tuple[str, int] | None = None  # (CellList attribute, index) of a layer block
    layer_class: str | None = None


@dataclasses.dataclass
class Plan:
    class_name: str
    args: list[str]
    blocks: list[Block]
    text: str  # the generated module's source
    init: dict[str, ast.stmt]  # top-level attribute -> its statement in the network's __init__
    rows: dict[tuple[str, int], ast.expr]  # (CellList attribute, index) -> the layer instance expression
    returns_tuple: bool = False
    _starts: list[int] | None = dataclasses.field(default=None, repr=False, compare=False)
    _bytes: bytes = dataclasses.field(default=b"", repr=False, compare=False)

    @property
    def layers(self) -> list[Block]:
        return [b for b in self.blocks if b.kind in ("layer", "inline")]

    def segment(self, node: ast.AST) -> str:
        """The source text of `node` (ast.get_source_segment's, which splits the whole text on every call:
        on a 1.1B model's network that was 16 s of the layer-streamed run)."""
        if self._starts is None:
            self._bytes = self.text.encode()
            self._starts = [0] + [i + 1 for i, c in enumerate(self._bytes) if c == 0x0A]
        begin = self._starts[node.lineno - 1] + node.col_offset  # (col offsets count UTF-8 bytes)
        end = self._starts[node.end_lineno - 1] + node.end_col_offset
        return self._bytes[begin:end].decode()


def _names(nodes, ctx) -> list[str]:
    seen = []
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ctx) and n.id not in seen:
                seen.append(n.id)
    return seen


def _self_attrs(nodes) -> list[str]:
    seen = []
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                    and n.attr not in seen:
                seen.append(n.attr)
    return seen


def _layer_call(stmt: ast.stmt, lists: set[str]) -> tuple[str, int] | None:
    """(list attribute, index) when `stmt` is `targets = self.<list>[<k>](...)`."""
    if not isinstance(stmt, ast.Assign) or not isinstance(stmt.value, ast.Call):
        return None
    f = stmt.value.func
    if isinstance(f, ast.Subscript) and isinstance(f.value, ast.Attribute) and isinstance(f.value.value, ast.Name) \
            and f.value.value.id == "self" and f.value.attr in lists and isinstance(f.slice, ast.Constant):
        return f.value.attr, int(f.slice.value)
    return None


def _weight_layer(stmt: ast.stmt, prefix: str | None) -> int | None:
    """The layer index of the weight an __init__ statement binds (`_param(weights, 'model.layers.3...', ...)`)."""
    v = getattr(stmt, "value", None)
    if prefix and isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "_param" \
            and len(v.args) > 1 and isinstance(v.args[1], ast.Constant) and isinstance(v.args[1].value, str):
        where = layer_of(v.args[1].value)
        if where is not None and where[0] == prefix:
            return where[1]
    return None


def _split_inline(stmts: list[ast.stmt], owner: dict[str, int]) -> list[tuple[int | None, list[ast.stmt]]]:
    """Statements of layers left inline (no Cell class), cut where the layer of the weights they read changes:
    a statement reading no layer's weight stays with the one before it, except after the last one that reads
    one (the epilogue: the last residual add, the final norm, the head). Then, so that every layer has one
    structure (one compiled Cell for all: `run_blocks`): the first layer's statements that read only values
    from before it (a shape or mask the exporter computes once and every layer reads) go before it, and the
    last layer keeps as many of the statements after it as the layer before it ends with (its residual add),
    where they read its values. Any cut runs the same statements in the same order."""
    keys = []
    for stmt in stmts:
        ks = [owner[a] for a in _self_attrs([stmt]) if a in owner]
        keys.append(max(ks) if ks else None)
    last = max((i for i, k in enumerate(keys) if k is not None), default=len(stmts))
    out: list[tuple[int | None, list[ast.stmt]]] = []
    for i, (stmt, k) in enumerate(zip(stmts, keys)):
        if i == last + 1:
            out.append((None, [stmt]))
        elif out and (k is None or k == out[-1][0]):
            out[-1][1].append(stmt)
        else:
            out.append((k, [stmt]))
    layers = [i for i, (k, _) in enumerate(out) if k is not None]
    if len(layers) >= 2:
        keys_of = dict(zip(map(id, stmts), keys))
        _hoist_into_prologue(out, layers[0], keys_of)
        layers = [i for i, (k, _) in enumerate(out) if k is not None]
        _keep_layer_tail(out, layers[-2], layers[-1], keys_of)
    return out


def _hoist_into_prologue(out: list, first: int, keys_of: dict) -> None:
    """Move the first layer's weightless statements that read nothing it makes into the code before it."""
    made, kept, hoisted = set(), [], []
    for stmt in out[first][1]:
        if keys_of[id(stmt)] is None and not set(_names([stmt], ast.Load)) & made:
            hoisted.append(stmt)
        else:
            kept.append(stmt)
            made.update(_names([stmt], ast.Store))
    if not hoisted:
        return
    out[first] = (out[first][0], kept)
    if first > 0:  # (the code before the first layer)
        out[first - 1][1].extend(hoisted)
    else:
        out.insert(first, (None, hoisted))


def _keep_layer_tail(out: list, before: int, last: int, keys_of: dict) -> None:
    """Give the last layer the statements after it that the layer before it ends with (as many, each reading
    a value the last layer makes)."""
    tail = 0
    for stmt in reversed(out[before][1]):
        if keys_of[id(stmt)] is not None:
            break
        tail += 1
    if not tail or last + 1 >= len(out) or out[last + 1][0] is not None:
        return
    made = set(_names(out[last][1], ast.Store))
    rest = out[last + 1][1]
    moved = 0
    while moved < min(tail, len(rest) - 1) and set(_names([rest[moved]], ast.Load)) & made:
        made.update(_names([rest[moved]], ast.Store))
        moved += 1
    out[last][1].extend(rest[:moved])
    del rest[:moved]


def plan(source_text: str, class_name: str, prefix: str | None = None) -> Plan:
    """The blocks of the generated network class `class_name` (this module's docstring). With `prefix` (the
    layer list's module path), layers left inline are cut into blocks by the weights their statements read."""
    tree = ast.parse(source_text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    construct = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "construct")
    attrs, rows = {}, {}
    for stmt in init.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute):
            attr = stmt.targets[0].attr
            v = stmt.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "CellList":
                for k, row in enumerate(v.args[0].elts):
                    rows[(attr, k)] = row
            else:
                attrs[attr] = stmt
    lists = {a for a, _ in rows}
    args = [a.arg for a in construct.args.args[1:]]
    pieces: list[tuple[str, list[ast.stmt], tuple | None]] = []
    for stmt in construct.body:
        where = _layer_call(stmt, lists)
        if where is not None:
            pieces.append(("layer", [stmt], where))
        elif pieces and pieces[-1][0] == "code":
            pieces[-1][1].append(stmt)
        else:
            pieces.append(("code", [stmt], None))
    owner = {a: k for a, stmt in attrs.items() if (k := _weight_layer(stmt, prefix)) is not None}
    if owner:
        cut = []
        for kind, stmts, where in pieces:
            if kind == "layer":
                cut.append((kind, stmts, where))
                continue
            cut += [("code" if k is None else "inline", part, k) for k, part in _split_inline(stmts, owner)]
        pieces = cut
    blocks = []
    for k, (kind, stmts, where) in enumerate(pieces):
        if kind == "inline":
            blocks.append(Block("inline", f"{prefix}.{where}", [], [], stmts))
            continue
        if kind == "layer":
            row = rows[where]
            name, cls_name = f"{where[0]}[{where[1]}]", row.func.id if isinstance(row.func, ast.Name) else None
        else:
            name = "prologue" if k == 0 else "epilogue" if k == len(pieces) - 1 else f"code {k}"
            cls_name = None
        blocks.append(Block(kind, name, [], [], stmts, where, cls_name))
    defined = set(args)
    for b in blocks:  # what a block reads from before it (a statement reads before it writes)
        made = set()
        for stmt in b.statements:
            for n in _names([stmt], ast.Load):
                if n not in made and n in defined and n not in b.inputs:
                    b.inputs.append(n)
            made.update(_names([stmt], ast.Store))
        defined |= made
    for k, b in enumerate(blocks):
        made = _names(b.statements, ast.Store)
        later = {n for c in blocks[k + 1:] for n in c.inputs}
        b.outputs = [n for n in made if n in later]
    _mirror_outputs(blocks)
    last = blocks[-1].statements[-1]
    returns_tuple = isinstance(last, ast.Return) and isinstance(last.value, ast.Tuple)
    return Plan(class_name, args, blocks, source_text, attrs, rows, returns_tuple)


def _mirror_outputs(blocks: list[Block]) -> None:
    """The last inline layer also returns what the layer before it returns at the same statements (the
    residual stream, which only the next layer reads), so that both have one structure."""
    inline = [b for b in blocks if b.kind == "inline"]
    if len(inline) < 2 or len(inline[-2].statements) != len(inline[-1].statements):
        return
    prev, last = inline[-2], inline[-1]
    where = {n: i for i, stmt in enumerate(prev.statements) for n in _names([stmt], ast.Store)}
    mirrored = []
    for n in prev.outputs:
        stored = _names([last.statements[where[n]]], ast.Store)
        if len(stored) != 1:
            return
        mirrored.append(stored[0])
    if set(last.outputs) <= set(mirrored):
        last.outputs = mirrored


def block_source(p: Plan, k: int) -> str:
    """The Cell class `_Block<k>` for block k: bind what it uses, run its statements, return its outputs."""
    b = p.blocks[k]
    seg = p.segment
    used = [a for a in _self_attrs(b.statements) if a in p.init]
    lines = [f"class _Block{k}(nn.Cell):", "    def __init__(self, weights):", "        super().__init__(auto_prefix=False)"]
    lines += [f"        {seg(p.init[a])}" for a in used]
    body = [ast.unparse(s) for s in b.statements]
    if b.kind == "layer":
        lines.append(f"        self.layer = {seg(p.rows[b.layer])}")
        call = f"self.{b.layer[0]}[{b.layer[1]}]"
        body = [body[0].replace(call, "self.layer", 1)]
    lines.append(f"    def construct(self, {', '.join(b.inputs)}):" if b.inputs else "    def construct(self):")
    for text in body:
        lines += ["        " + ln for ln in text.splitlines()]
    if k < len(p.blocks) - 1:
        lines.append(f"        return ({''.join(n + ', ' for n in b.outputs)})")
    return "\n".join(lines) + "\n"


def structure(p: Plan, k: int) -> str:
    """Block k's class up to renaming: its values, attributes and weight names replaced by their order of
    appearance. Two blocks with the same structure compute the same function of their inputs and weights (the
    layers of a model whose layers were left inline), so one compiled Cell serves both (`run_blocks`)."""
    tree = ast.parse(block_source(p, k))
    b = p.blocks[k]
    local = set(b.inputs) | set(_names(b.statements, ast.Store))
    names: dict[str, str] = {}
    attrs: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            n.name = "_"
        elif isinstance(n, ast.arg) and n.arg in local:
            n.arg = names.setdefault(n.arg, f"v{len(names)}")
        elif isinstance(n, ast.Name) and n.id in local:
            n.id = names.setdefault(n.id, f"v{len(names)}")
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                and n.attr != "layer":
            n.attr = attrs.setdefault(n.attr, f"a{len(attrs)}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) > 1:
            weight = n.args[1]  # _param(weights, '<weight>', ...) and <LayerClass>(weights, ('<weight>', ...))
            for c in ast.walk(weight):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    c.value = "?"
    return ast.dump(tree)


def weight_names(p: Plan, k: int) -> set[str]:
    """The string constants of block k's weight bindings (its `_param(weights, '<weight>', ...)` statements and
    its layer instance's `<LayerClass>(weights, ('<weight>', ...))`): every weight it reads is among them."""
    b = p.blocks[k]
    nodes = [p.init[a] for a in _self_attrs(b.statements) if a in p.init]
    if b.kind == "layer":
        nodes.append(p.rows[b.layer])
    return {c.value for n in nodes for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def _read_ahead(sources: dict, names: set[str]) -> None:
    """Ask the kernel to start reading these weights' file ranges into the page cache (readahead.ask_files:
    posix_fadvise WILLNEED, 1 MiB per call, as the kernel reads no more of one), so that the next block's reads
    overlap this block's transposes and run."""
    readahead.ask_files((src.path, src.offset, src.length)
                        for name in names if name in sources for src in sources[name].files())


def module_source(p: Plan) -> str:
    """The generated module (its layer classes without lazy_inline: they run directly) with every block class."""
    text = p.text.replace("\nLAZY_INLINE = True\n", "\nLAZY_INLINE = False\n", 1)
    return text + "\n\n" + "\n\n".join(block_source(p, k) for k in range(len(p.blocks)))


# --- the names: generated <-> ONNX ------------------------------------------------------------------------


def _generated(name: str) -> str:
    return py_name(name, set(), "v")


def onnx_names(p: Plan, graph_names, prefix: str | None) -> dict[str, str]:
    """Generated name -> the ONNX value it holds, for every block output (and construct argument) whose
    name the code generator derived from exactly one ONNX value name (`graph_names`); `prefix` is the
    layer list's module path (graphconv/target/layers.group's summary), which a layer call's outputs drop."""
    plain: dict[str, list[str]] = {}
    for v in graph_names:
        plain.setdefault(_generated(v), []).append(v)
    found = {}
    for b in p.blocks:
        for n in b.outputs if b is not p.blocks[-1] else []:
            if b.kind == "layer" and prefix:
                attr, index = b.layer
                hits = [v for v in graph_names if _generated(f"{attr}_{index}_{_strip(v, prefix, index)}") == n]
            else:
                hits = plain.get(n, [])
            if len(hits) == 1:
                found[n] = hits[0]
    return found


# --- the reference --------------------------------------------------------------------------------------


def oracle_values(model, names: list[str], cases) -> list[dict[str, np.ndarray]]:
    """onnxruntime's values of `names` (and the graph's outputs) for every case: one run of `model` with them
    added as graph outputs (their types from the graph's value_info where known; onnxruntime infers the rest)."""
    import onnx

    from graphconv.verify import reference

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    typed = {vi.name: vi for vi in exposed.graph.value_info}
    present = {o.name for o in exposed.graph.output}
    for n in names:
        if n not in present:
            exposed.graph.output.append(typed.get(n) or onnx.helper.make_empty_tensor_value_info(n))
            present.add(n)
    return reference.Oracle(exposed).run(cases)


# --- the MindSpore side (the child) ---------------------------------------------------------------------


class _BlockWeights:
    """The weights one block asks for, read from their files when asked (graphconv.target.mindir_stream.Source),
    as the generated `_param` (opmap/helpers.py) expects them: the source array, in the source's dtype.
    `prepared`: arrays already in their Parameter's layout, by (name, transposed) (_Prefetch's); a block Cell
    built anew takes them through `_param`'s shared_parameter hook (`param`: the generated module's _param)."""

    def __init__(self, sources: dict, prepared: dict | None = None, param=None):
        self.sources = sources
        self.prepared = prepared or {}
        self.param = param
        self.read_bytes = 0
        self.read: list[str] = []
        self.taken_prepared = 0

    def shared_parameter(self, name, shape, dtype, transposed):
        ready = self.take_prepared(name, transposed) if self.param is not None else None
        return None if ready is None else self.param({name: ready}, name, shape, dtype, False)

    def take_prepared(self, name: str, transposed: bool) -> np.ndarray | None:
        array = self.prepared.pop((name, bool(transposed)), None)
        if array is not None:
            self.read.append(name)
            self.read_bytes += array.nbytes
            self.taken_prepared += 1
        return array

    def __getitem__(self, name: str) -> np.ndarray:
        src = self.sources[name]
        self.read.append(name)
        if src.array is not None:
            return src.array
        array = src.read()
        self.read_bytes += array.nbytes
        return array


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _import(text: str, path: Path):
    import importlib.util
    import sys

    path.write_text(text)  # graph mode reads construct's source from the file
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Prefetch:
    """Block k's weights read and put in their Parameters' layout (transposed) by a second thread while the
    block before it runs (the first block's: while the child exports the graph). Measured in MindSpore 2.10
    on 2 cores, 7B-sized dense layers: in fp16, 2.25 s of runs and 0.28 s of transposes took 2.20 s together
    (the run leaves a core idle); in fp32, 0.80 s and 0.62 s took 1.38 s (it saves only the waits for the
    disk). The 7B fp16 layer went from 2.1 s to 1.5 s."""

    def __init__(self, k: int, sources: dict, names: set[str], layouts: dict):
        import threading

        self.k, self._result, self._error = k, {}, None
        self._thread = threading.Thread(target=self._run, args=(sources, sorted(names), layouts),
                                        name=f"block-{k}-weights", daemon=True)
        self._thread.start()

    def _run(self, sources: dict, names: list[str], layouts: dict) -> None:
        try:
            for name in names:
                src = sources.get(name)
                if src is None or src.array is not None:
                    continue
                flip = bool(layouts.get(name))
                self._result[name, flip] = src.read_transposed() if flip and len(src.shape) == 2 else src.read()
        except BaseException as e:  # noqa: BLE001 - raised in the block loop's thread
            self._error = e

    def result(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Prepared:
    """What run_blocks needs before its first block, made while the child still exports the graph: the plan,
    the block classes' module, the cases as Tensors, and the first block's weights being read ahead."""

    def __init__(self, task: dict, run: dict, sources: dict):
        from mindspore import Tensor

        self.plan = p = plan(Path(task["source"]).read_text(), task["class_name"], run.get("block_prefix"))
        self.module = _import(module_source(p), Path(run["block_module"]))
        self.envs = []
        for case_path in run["cases"]:
            with np.load(case_path) as data:
                self.envs.append({a: Tensor(data[n]) for a, n in zip(p.args, run["input_names"])})
        self.run, self.sources, self.layouts = run, sources, task.get("param_layouts") or {}
        self.announced = [weight_names(p, k) for k in range(len(p.blocks))]
        _read_ahead(sources, self.announced[0])  # (run_blocks asks for each next block's as it starts a block)
        self.first = _Prefetch(0, sources, self.announced[0], self.layouts)


def run_blocks(prepared: Prepared, weights_file=None) -> dict:
    """Run the cases of the run (graphconv.target.worker's case files) through the network of the task
    (Prepared's) block by block; write each case's outputs where the whole-network run writes them (out<i>)
    and its boundary values into run["block_values"][case] (keyed by generated name). Returns the blocks
    (name, outputs, seconds, weight bytes read) and the peak resident memory seen after each block.
    `weights_file` (a streamed MindIR's mindir_stream.WeightsFile): each block's Parameters are put into it
    as they are set, so the weights are read and transposed once for the run and the MindIR together."""
    gc.freeze()  # the collections that release each block need not walk the plan and module again (~0.1 s each)
    try:
        return _run_blocks(prepared, weights_file)
    finally:
        gc.unfreeze()


def _run_blocks(prepared: Prepared, weights_file) -> dict:
    import mindspore as ms

    p, module, envs, run, sources = prepared.plan, prepared.module, prepared.envs, prepared.run, prepared.sources
    layouts, announced = prepared.layouts, prepared.announced
    compiled: dict[str, object] = {}  # structure -> the Cell that runs every block of that structure
    saved = [dict() for _ in envs]
    blocks, final = [], [None] * len(envs)
    structures = [structure(p, k) for k in range(len(p.blocks))]
    prefetch = prepared.first
    for k, b in enumerate(p.blocks):
        t0 = time.perf_counter()
        if k + 1 < len(p.blocks):
            _read_ahead(sources, announced[k + 1])
        weights = _BlockWeights(sources, prefetch.result(), module._param)
        key = structures[k]
        reused = key in compiled
        if reused:  # its graphs are compiled: it takes this block's weights
            cell, held = _take_weights(compiled[key], getattr(module, f"_Block{k}"), weights, module._param_value)
        else:
            cell = getattr(module, f"_Block{k}")(weights)
            cell.set_train(False)
            compiled = {key: cell}  # (the previous structure's Cell is released: only one is kept)
            held = [(q.name, bool(layouts.get(q.name)), q) for q in cell.get_parameters()]
        # the next block's weights, read and transposed while this one runs
        prefetch = _Prefetch(k + 1, sources, announced[k + 1], layouts) if k + 1 < len(p.blocks) else None
        t1 = time.perf_counter()
        if weights_file is not None:
            for name, transposed, param in held:
                weights_file.put(name, param.asnumpy(), transposed)  # (asnumpy: a view of its memory)
        t2 = time.perf_counter()
        for c, env in enumerate(envs):
            try:
                out = cell(*[env[n] for n in b.inputs])
            except Exception as e:  # noqa: BLE001 - named for the parent's one-line error
                raise RuntimeError(f"block {b.name} does not run: {type(e).__name__}: {str(e).strip()[:300]}") from e
            if k == len(p.blocks) - 1:
                final[c] = out if isinstance(out, (tuple, list)) else (out,)
                continue
            for n, v in zip(b.outputs, out):
                env[n] = v
                if isinstance(v, ms.Tensor):
                    saved[c][n] = v.asnumpy()
        for env in envs:  # values no later block reads
            for n in [n for n in env if not any(n in later.inputs for later in p.blocks[k + 1:])]:
                del env[n]
        del cell
        gc.collect()
        blocks.append({"name": b.name, "kind": b.kind, "class": b.layer_class, "outputs": b.outputs,
                       "seconds": round(time.perf_counter() - t0, 2), "weight_bytes": weights.read_bytes,
                       "reused": reused, "weights_seconds": round(t1 - t0, 2), "write_seconds": round(t2 - t1, 2),
                       "weights_prepared_ahead": weights.taken_prepared,
                       "not_read_ahead": sorted(set(weights.read) - announced[k]),
                       "rss_after": _rss()})
    for c, out_path in enumerate(run["outputs"]):
        np.savez(out_path, **{f"out{i}": o.asnumpy() for i, o in enumerate(final[c])})
        np.savez(run["block_values"][c], **saved[c])
    return {"outputs": run["outputs"], "blocks": blocks, "layer_streamed": True,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # (the export's included)
            "case_seconds": [round(sum(b["seconds"] for b in blocks), 2)]}


class _Recorder:
    """Weights for a block Cell built only to learn which weight each of its Parameters holds: every Parameter
    is a lazy one (graphconv.target.mindir_stream.LazyWeights), recorded with its weight name and layout."""

    def __init__(self):
        from graphconv.target.mindir_stream import LazyWeights

        self.lazy = LazyWeights()
        self.of: dict[int, tuple[str, bool]] = {}  # id(Parameter) -> (weight name, transposed)

    def shared_parameter(self, name, shape, dtype, transposed):
        param = self.lazy.shared_parameter(name, shape, dtype, transposed)
        self.of[id(param)] = (name, bool(transposed))
        return param

    def __getitem__(self, name):
        return self.lazy[name]


def _take_weights(target, block_class, weights: _BlockWeights, param_value):
    """`target` (a compiled block of the same structure) holding block_class's weights, set one at a time
    from their files (its Parameters pair up in order), and (weight name, transposed, Parameter) for each.
    Building the block's own Cell would make a Parameter of each weight, and MindSpore keeps the memory of
    Parameters replaced that way: three layers' worth."""
    recorder = _Recorder()
    fresh = block_class(recorder)
    theirs, ours = list(target.get_parameters()), list(fresh.get_parameters())
    if len(theirs) != len(ours) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(theirs, ours)):
        raise RuntimeError("blocks of the same structure hold different Parameters")
    held = []
    for a, b in zip(theirs, ours):
        name, transposed = recorder.of[id(b)]
        ready = weights.take_prepared(name, transposed)
        a.set_data(param_value(ready, False) if ready is not None else param_value(weights[name], transposed))
        held.append((name, transposed, a))
    return target, held


def check(blocks: list[dict], names: dict[str, str], cases, expected: list[dict], got_files: list[str],
          tolerance) -> tuple[list[dict], str | None]:
    """Each block's boundary values against onnxruntime's, by the comparison rule (`tolerance(reference)`:
    its atol, rtol), in block order: the per-block summary (max abs over the cases of the values compared)
    and the first failure (None if none)."""
    from graphconv.verify import compare

    got = []
    for f in got_files:
        with np.load(f) as data:
            got.append({k: data[k] for k in data.files})
    rows, failure = [], None
    for b in blocks[:-1]:
        compared = [n for n in b["outputs"] if n in names and names[n] in expected[0]]
        worst, bad = 0.0, None
        for case, exp, act in zip(cases, expected, got):
            for n in compared:
                if n not in act or names[n] not in exp:
                    continue
                ref = exp[names[n]]
                c = compare.compare(act[n], ref, *tolerance(ref), case.valid_positions(ref))
                worst = max(worst, c.max_abs)
                if not c.ok and bad is None:
                    bad = f"value {names[n]!r} at {case.shape_text()}: {c.reason} (max abs {c.max_abs:.3g})"
        rows.append({"block": b["name"], "kind": b["kind"], "class": b.get("class"), "values": [names[n] for n in compared],
                     "max_abs": worst, "weight_bytes": b["weight_bytes"], "seconds": b["seconds"],
                     "rss_after": b["rss_after"], "compiled_again": not b["reused"],
                     **{k: b[k] for k in ("weights_seconds", "write_seconds", "weights_prepared_ahead", "not_read_ahead")
                        if k in b}})
        if bad is not None and failure is None:
            failure = f"block {b['name']}" + (f" ({b['class']})" if b.get("class") else "") + f": {bad}"
    last = blocks[-1]
    rows.append({"block": last["name"], "kind": last["kind"], "class": last.get("class"), "values": ["(the network's outputs)"],
                 "weight_bytes": last["weight_bytes"], "seconds": last["seconds"], "rss_after": last["rss_after"],
                 **{k: last[k] for k in ("weights_seconds", "weights_prepared_ahead", "not_read_ahead") if k in last}})
    return rows, failure


def dump_plan(p: Plan) -> str:
    """The blocks in a line each (debugging)."""
    return json.dumps([{"name": b.name, "in": b.inputs, "out": b.outputs} for b in p.blocks], indent=1)
