"""Repeated layers: find the decoder/encoder layers of a lowered program and emit them as one Cell class.

Which layer a node belongs to comes from where the exporter says it was: the module path of its ONNX node
(`scopes`: dynamo's `namespace` metadata or TorchScript's `/model/layers.3/self_attn/MatMul` names, both
recorded before onnxsim drops the metadata: `record_scopes`), else the weights it reads
(`model.layers.3.mlp.down_proj.weight`), else its producers' layer (nodes a pass made). The layer list is the
module path prefix with the most indices (`model.layers`). Then:
  - what every layer computes alike from values outside the layers (the attention mask's conversions,
    cos/sin, position ids) moves before the first layer and is computed once (identical nodes merged);
  - each layer becomes a Body: its inputs the outside values it reads (the hidden state, the mask, cos/sin,
    weights it shares with others), its outputs what is read after it, its attributes the weights only it
    reads;
  - layers whose Blocks are the same up to renaming (structure, literals, attribute shapes and dtypes,
    constant values) share one CellClass; each is replaced by a call of its instance in a CellList.
A layer that fits no class stays inline (in place); the program then still computes the same. `group`
returns what it found, for the report (`layers`: prefix, layers, classes, grouped, and the reason when
nothing was grouped).
"""

from __future__ import annotations

import dataclasses
import re

import onnx

from graphconv.compiler import partition
from graphconv.compiler.program_ir import Attr, AttrValue, Body, CellClass, Node, Program, Ref, Value

_INDEXED = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?[A-Za-z_][\w]*)\.(?P<index>\d+)(?:\.|$)")


@dataclasses.dataclass
class Scopes:
    """Where the exporter says each ONNX node came from: node name -> module path, and module path -> the
    module's class (dynamo records it: `LlamaDecoderLayer`), which names the emitted layer class."""

    nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    classes: dict[str, str] = dataclasses.field(default_factory=dict)

    def get(self, node_name: str) -> str | None:
        return self.nodes.get(node_name)

    def __contains__(self, node_name: str) -> bool:
        return node_name in self.nodes


def record_scopes(model: onnx.ModelProto) -> Scopes:
    """The module path (`model.layers.0.self_attn`) of every node that has one, from dynamo's `namespace`
    metadata or a TorchScript scoped node name."""
    scopes = Scopes()
    for node in model.graph.node:
        if not node.name:
            continue
        ns = next((p.value for p in node.metadata_props if p.key == "namespace"), None)
        if ns:  # ": top/model: LlamaForCausalLM/model.model.layers.0: LlamaDecoderLayer/.../view_2: aten.view"
            modules = []
            for part in ns.split("/")[:-1]:
                path, _, cls = part.partition(":")
                if path.strip():
                    modules.append(path.strip())
                    scopes.classes.setdefault(path.strip(), cls.strip().rpartition(".")[2])
            if modules:
                scopes.nodes[node.name] = modules[-1]
        elif node.name.startswith("/") and node.name.count("/") >= 2:
            scopes.nodes[node.name] = ".".join(p for p in node.name.split("/")[1:-1] if p)
    return scopes


def layer_of(path: str | None) -> tuple[str, int] | None:
    """(list prefix, index) of the first indexed module in a dotted path: `model.layers.3.mlp` -> (model.layers, 3)."""
    if not path:
        return None
    m = _INDEXED.match(path)
    return (m.group("prefix"), int(m.group("index"))) if m else None


def _is_constant(a: Attr) -> bool:
    """A small constant tensor (written into the source): each layer class gets its own copy."""
    return a.param is None and not a.as_parameter and a.value is not None


def _callees(nodes) -> set[int]:
    """Values called as functions (primitive instances: `ops.auto_generate.Swiglu()`): they stay where
    they are used, neither merged nor moved out of a layer, nor passed to a layer."""
    return {id(n.target) for n in nodes if isinstance(n.target, Value) and not isinstance(n.target, Ref)}


def _param_path(v: Value) -> str | None:
    if isinstance(v, AttrValue) and v.attr.param is not None:
        return v.attr.param.name
    return None


def _assign(nodes: list[Node], scopes: Scopes, policy: str = "readers") -> tuple[str | None, dict[int, int | None]]:
    """The layer list's prefix and each top-level node's layer index (None: outside the layers).

    The IR nodes one ONNX node was lowered to (one origin) stay together. An origin's layer is its ONNX
    node's module scope, else the layer of a weight it reads (a weight with a model name but no layer index,
    `bert.embeddings.LayerNorm.weight`, places it outside): the evidence. An origin with neither (a node a
    pass made, or any node of an exporter that records no scopes) can sit anywhere between the layer of what
    it reads and the layer of what reads it; `policy` picks:
      - "readers": with what reads it — its first reader's layer (a decomposed norm's first ops, which read the
        previous layer's output, are the next layer's), outside if something outside reads it;
      - "producers": with the evidence it reads — the last layer among its producers placed by evidence (a
        residual add of a layer's output projection is that layer's), else as "readers".
    An origin nothing placed reads takes its producers' last layer. `group` tries both and keeps the one under
    which the most layers share a structure."""
    groups: dict[str, list[Node]] = {}
    for node in nodes:  # (an inlined fused-op body, `<fused node>::<op>_<k>`, is its fused node's)
        groups.setdefault(_group(node.origin), []).append(node)
    found: dict[str, tuple[str, int] | None] = {}
    named_weights: set[str] = set()
    for origin, members in groups.items():
        where = layer_of(scopes.get(origin))
        for v in (v for n in members for v in n.inputs()) if where is None else ():
            path = _param_path(v)
            where = layer_of(path)
            if where is not None:
                break
            if path and "." in path:
                named_weights.add(origin)
        found[origin] = where
    counts: dict[str, set[int]] = {}
    for where in found.values():
        if where is not None:
            counts.setdefault(where[0], set()).add(where[1])
    if not counts:
        return None, {}
    prefix = max(counts, key=lambda p: len(counts[p]))
    placed: dict[str, int | None] = {}
    for origin, where in found.items():
        if where is not None and where[0] == prefix:
            placed[origin] = where[1]
        elif where is not None or origin in scopes or origin in named_weights:
            placed[origin] = None  # the exporter placed it (or its weights) outside the layer list
    origin_of = {id(o): _group(n.origin) for n in nodes for o in n.outputs}
    if policy == "producers":
        evidence = {o: k for o, k in placed.items() if k is not None}
        for origin, members in groups.items():
            if origin not in placed:
                ks = [evidence[src] for n in members for v in n.inputs()
                      if (src := origin_of.get(id(v))) in evidence and src != origin]
                if ks:
                    placed[origin] = max(ks)
    readers: dict[str, set[str]] = {}
    for node in nodes:
        for v in node.inputs():
            src = origin_of.get(id(v))
            if src is not None and src != _group(node.origin):
                readers.setdefault(src, set()).add(_group(node.origin))
    for origin in reversed(list(groups)):
        if origin in placed:
            continue
        ks = [placed[r] for r in readers.get(origin, ()) if r in placed]
        if ks:
            placed[origin] = None if None in ks else min(ks)
    for origin, members in groups.items():
        if origin not in placed:
            ks = [placed.get(origin_of.get(id(v))) for n in members for v in n.inputs() if id(v) in origin_of]
            ks = [k for k in ks if k is not None]
            placed[origin] = max(ks) if ks else None
    return prefix, {id(n): placed[_group(n.origin)] for n in nodes}


def _group(origin: str) -> str:
    return origin.partition("::")[0]


def _hoist(nodes: list[Node], layer: dict[int, int | None]) -> None:
    """Work that several layers share moves out of them. A layer node is *invariant* when it reads no value
    a non-invariant layer node computes and no weight of its own layer (only inputs, outside values,
    constants, shared weights, weights no layer's name claims). After merge_identical made the layers' identical
    copies of such work one, an invariant node that another layer or an outside node reads, and the invariant nodes
    feeding it, are computed before the layers."""
    attr_layers: dict[int, set] = {}
    for node in nodes:
        for v in node.inputs():
            if isinstance(v, AttrValue):
                attr_layers.setdefault(id(v.attr), set()).add(layer[id(node)])
    invariant: set[int] = set()
    variant_values: set[int] = set()
    callees = _callees(nodes)
    producer: dict[int, Node] = {}
    for node in nodes:
        k = layer[id(node)]
        for o in node.outputs:
            producer[id(o)] = node
        if k is None:
            continue
        # (a weight only this layer reads pins the node to it when its name says it is a layer's: the rotary
        # inverse frequencies an exporter names `inv_freq` are read in whichever layer reads cos/sin first)
        own_weight = any(isinstance(v, AttrValue) and (v.attr.param is not None or v.attr.as_parameter)
                         and len(attr_layers.get(id(v.attr), ())) == 1
                         and (v.attr.param is None or layer_of(_param_path(v)) is not None) for v in node.inputs())
        callee = any(id(o) in callees for o in node.outputs)
        if node.kind != "if" and not own_weight and not callee and \
                not any(id(v) in variant_values for v in node.inputs()):
            invariant.add(id(node))
        else:
            variant_values.update(id(o) for o in node.outputs)
    hoisted: set[int] = set()
    for node in nodes:  # invariant values read from elsewhere
        for v in node.inputs():
            p = producer.get(id(v))
            if p is not None and id(p) in invariant and layer[id(p)] != layer[id(node)]:
                hoisted.add(id(p))
    stack = [n for n in nodes if id(n) in hoisted]
    while stack:  # and what feeds them
        for v in stack.pop().inputs():
            p = producer.get(id(v))
            if p is not None and id(p) in invariant and id(p) not in hoisted:
                hoisted.add(id(p))
                stack.append(p)
    for node in nodes:
        if id(node) in hoisted:
            layer[id(node)] = None


def _key(v) -> tuple:
    if isinstance(v, Ref):
        return ("ref", v.code)
    if isinstance(v, AttrValue):
        return ("attr", id(v.attr))
    if isinstance(v, Value):
        return ("value", id(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__,) + tuple(_key(x) for x in v)
    if isinstance(v, slice):
        return ("slice", _key(v.start), _key(v.stop), _key(v.step))
    if isinstance(v, float):
        return ("float", repr(v))
    return ("lit", type(v).__name__, v)


def merge_identical(block: Body) -> dict[int, Value]:
    """Common-subexpression elimination over a block's top level: a node with the same kind, target and
    arguments as an earlier one is dropped and its outputs replaced by the earlier one's. Returns that
    replacement (value id -> value), for the nodes outside the block that read the dropped ones."""
    seen: dict[tuple, Node] = {}
    mapping: dict[int, Value] = {}
    keep = []
    callees = _callees(block.nodes)
    for node in block.nodes:
        if mapping:
            _substitute_node(node, mapping)
        if node.kind in ("if", "cell") or any(id(o) in callees for o in node.outputs):
            keep.append(node)
            continue
        k = (node.kind, _key(node.target) if isinstance(node.target, Value) else node.target, node.n_outputs,
             _key(node.args), _key(tuple(sorted(node.kwargs.items()))))
        first = seen.get(k)
        if first is None:
            seen[k] = node
            keep.append(node)
            continue
        for a, b in zip(node.outputs, first.outputs):
            mapping[id(a)] = b
    block.nodes = keep
    block.outputs = [mapping.get(id(v), v) for v in block.outputs]
    return mapping


def _sub(x, mapping: dict[int, Value]):
    if isinstance(x, Value):
        return mapping.get(id(x), x)
    if isinstance(x, tuple):
        return tuple(_sub(a, mapping) for a in x)
    if isinstance(x, list):
        return [_sub(a, mapping) for a in x]
    if isinstance(x, slice):
        return slice(_sub(x.start, mapping), _sub(x.stop, mapping), _sub(x.step, mapping))
    return x


def _substitute_node(node: Node, mapping: dict[int, Value]) -> None:
    if isinstance(node.target, Value):
        node.target = _sub(node.target, mapping)
    node.args = _sub(node.args, mapping)
    node.kwargs = {k: _sub(v, mapping) for k, v in node.kwargs.items()}
    for b in node.blocks:
        for inner in b.nodes:
            _substitute_node(inner, mapping)
        b.outputs = [mapping.get(id(v), v) for v in b.outputs]


class _Layer:
    """One layer's nodes as a Body candidate, with its canonical signature: every value numbered by where
    it is made (or first read, for inputs and attributes), so two layers that compute the same up to renaming
    have equal signatures."""

    def __init__(self, index: int, nodes: list[Node], used_elsewhere: set[int], attr_users: dict[int, set]):
        self.index, self.nodes = index, nodes
        self._attr_users = attr_users
        self.inputs: list[Value] = []
        self.attrs: list[Attr] = []
        self._numbers: dict[int, tuple] = {}
        sig = [self._node_sig(node) for node in nodes]
        self.outputs = [o for n in nodes for o in n.outputs if id(o) in used_elsewhere]
        sig.append(tuple(self._numbers[id(o)] for o in self.outputs))
        self.signature = tuple(sig)

    def _node_sig(self, node: Node) -> tuple:
        args = self._arg(node.args)
        kwargs = tuple((k, self._arg(v)) for k, v in sorted(node.kwargs.items()))
        blocks = tuple(tuple(self._node_sig(n) for n in b.nodes) + (tuple(self._arg(v) for v in b.outputs),)
                       for b in node.blocks)
        target = self._arg(node.target) if isinstance(node.target, Value) else node.target
        for k, o in enumerate(node.outputs):
            self._numbers[id(o)] = ("made", len(self._numbers), k)
        return (node.kind, target, node.n_outputs, args, kwargs, blocks)

    def _arg(self, v):
        if isinstance(v, Ref):
            return ("ref", v.code)
        if isinstance(v, AttrValue) and (self._attr_users.get(id(v.attr)) == {self.index} or _is_constant(v.attr)):
            a = v.attr
            if not any(x is a for x in self.attrs):
                self.attrs.append(a)
            const = None if a.value is None or a.as_parameter else (a.value.dtype.str, a.value.tobytes())
            transposed = a.param.transposed if a.param is not None else False
            number = next(k for k, x in enumerate(self.attrs) if x is a)
            return ("attr", number, a.shape, a.dtype, a.param is not None, transposed, const)
        if isinstance(v, Value):
            if id(v) in self._numbers:
                return self._numbers[id(v)]
            if not any(x is v for x in self.inputs):
                self.inputs.append(v)
            return ("in", next(k for k, x in enumerate(self.inputs) if x is v))
        if isinstance(v, (tuple, list)):
            return (type(v).__name__,) + tuple(self._arg(x) for x in v)
        if isinstance(v, slice):
            return ("slice",) + tuple(self._arg(x) for x in (v.start, v.stop, v.step))
        if isinstance(v, float):
            return ("float", repr(v))
        return ("lit", type(v).__name__, v)


def _class_name(prefix: str, program: Program, scopes: Scopes, index: int) -> str:
    known = scopes.classes.get(f"{prefix}.{index}")
    if known and known.isidentifier() and known != program.class_name:
        return known
    base = "".join(p[:1].upper() + p[1:] for p in re.split(r"[^A-Za-z0-9]+", prefix.split(".")[-1]) if p)
    base = (base[:-1] if base.endswith("s") and len(base) > 1 else base) or "Layer"
    if base[0].isdigit():
        base = f"Layer{base}"
    return base if base != program.class_name else f"{base}Block"


def _strip(hint: str | None, prefix: str, index: int) -> str | None:
    """A value or attribute name without its layer path (`model_layers_3_self_attn_...` -> `self_attn_...`)."""
    if not hint:
        return hint
    pattern = re.escape(prefix).replace(r"\.", r"[^A-Za-z0-9]+")
    stripped = re.sub(rf"^.*?{pattern}[^A-Za-z0-9]+{index}(?:[^A-Za-z0-9]+|$)", "", hint)
    return stripped or hint


@dataclasses.dataclass
class Grouping:
    """What `group` found: the summary for the report, and the partition into blocks (None when the program
    has no layers, or they cannot be cut out of it)."""

    summary: dict
    partition: "partition.Partition | None" = None


@dataclasses.dataclass
class _Cut:
    """The program's nodes cut into prologue, layers and epilogue under one placement policy (`_cut`)."""

    policy: str
    prefix: str
    pro: list[Node]
    epi: list[Node]
    candidates: list[_Layer]
    by_signature: dict[tuple, list[_Layer]]
    min_layers: int

    def classed(self, c: _Layer) -> bool:
        return len(self.by_signature[c.signature]) >= self.min_layers

    @property
    def grouped(self) -> int:
        return sum(1 for c in self.candidates if self.classed(c))


def _sink_into_epilogue(nodes: list[Node], layer: dict[int, int | None], depends: dict[int, bool],
                        outputs: set[int]) -> None:
    """A node outside the layers that needs none of them (prologue by default) but that only the epilogue reads
    goes to the epilogue: the LM head's weight cast (a `--dtype auto` export's Cast of the bf16 weight) is then
    computed where it is used, not kept from the prologue across every layer, and no block passes on a weight
    stored in another layout than the ONNX value's (graphconv.compiler.lowering.dense_weights)."""
    readers: dict[int, list[Node]] = {}
    for node in nodes:
        for v in node.inputs():
            readers.setdefault(id(v), []).append(node)
        for b in node.blocks:
            for inner in b.walk():
                for v in inner.inputs():
                    readers.setdefault(id(v), []).append(node)
    for node in reversed(nodes):  # (readers first: a chain of such nodes moves together)
        if layer[id(node)] is not None or depends[id(node)] or any(id(o) in outputs for o in node.outputs):
            continue
        read_by = [r for o in node.outputs for r in readers.get(id(o), [])]
        if read_by and all(layer[id(r)] is None and depends[id(r)] for r in read_by):
            depends[id(node)] = True


def _cut(program: Program, nodes: list[Node], scopes: Scopes, policy: str, min_layers: int) -> _Cut | dict:
    """The cut under `policy` (_assign), or the summary saying why there is none."""
    prefix, layer = _assign(nodes, scopes, policy)
    if prefix is None:
        return {"grouped": 0, "reason": "no node has a layer index (no module scopes or layer weights)"}
    _hoist(nodes, layer)
    # order: what needs no layer, the layers in index order, then the rest; refuse if that breaks a dependency
    produced_by: dict[int, int | None] = {}
    depends: dict[int, bool] = {}
    for node in nodes:
        k = layer[id(node)]
        dep = any(depends.get(id(v)) or produced_by.get(id(v)) is not None for v in node.inputs())
        depends[id(node)] = dep
        for o in node.outputs:
            produced_by[id(o)] = k
            depends[id(o)] = dep or k is not None
    _sink_into_epilogue(nodes, layer, depends, {id(v) for v in program.body.outputs})
    indices = sorted({k for k in layer.values() if k is not None})
    if len(indices) < min_layers:
        return {"prefix": prefix, "layers": len(indices), "grouped": 0, "reason": "fewer than two layers"}
    pro = [n for n in nodes if layer[id(n)] is None and not depends[id(n)]]
    epi = [n for n in nodes if layer[id(n)] is None and depends[id(n)]]
    per = {k: [n for n in nodes if layer[id(n)] == k] for k in indices}
    order = pro + [n for k in indices for n in per[k]] + epi
    position = {}
    for p, n in enumerate(order):
        for o in n.outputs:
            position[id(o)] = p
    for p, n in enumerate(order):
        if any(position.get(id(v), -1) >= p for v in n.inputs()):
            return {"prefix": prefix, "layers": len(indices), "grouped": 0,
                    "reason": "a node outside the layers sits between two of them"}
    uses_outside: dict[int, set] = {}  # value id -> the layers (or None) reading it
    attr_users: dict[int, set] = {}
    for n in order:
        where = layer[id(n)]
        for v in n.inputs():
            uses_outside.setdefault(id(v), set()).add(where)
            if isinstance(v, AttrValue):
                attr_users.setdefault(id(v.attr), set()).add(where)
        for b in n.blocks:
            for inner in b.walk():
                for v in inner.inputs():
                    uses_outside.setdefault(id(v), set()).add(where)
                    if isinstance(v, AttrValue):
                        attr_users.setdefault(id(v.attr), set()).add(where)
            for v in b.outputs:
                uses_outside.setdefault(id(v), set()).add(where)
    for v in program.body.outputs:
        uses_outside.setdefault(id(v), set()).add("output")
    candidates = []
    for k in indices:
        elsewhere = {vid for vid, users in uses_outside.items() if users - {k}}
        candidates.append(_Layer(k, per[k], elsewhere, attr_users))
    by_signature: dict[tuple, list[_Layer]] = {}
    for c in candidates:
        by_signature.setdefault(c.signature, []).append(c)
    return _Cut(policy, prefix, pro, epi, candidates, by_signature, min_layers)


def group(program: Program, scopes: Scopes | None, min_layers: int = 2) -> Grouping:
    """Group the program's repeated layers (this module's docstring) and cut it into blocks (partition.py)."""
    scopes = scopes or Scopes()
    merged = merge_identical(program.body)  # each layer's copy of the same mask conversion becomes one
    nodes = program.body.nodes
    cut: _Cut | dict | None = None
    for policy in ("readers", "producers"):
        tried = _cut(program, nodes, scopes, policy, min_layers)
        if cut is None or (isinstance(tried, _Cut) and (not isinstance(cut, _Cut) or tried.grouped > cut.grouped)):
            cut = tried
    if not isinstance(cut, _Cut):
        return Grouping(cut)
    prefix = cut.prefix
    pro, epi = cut.pro, cut.epi
    body: list[Node] = list(pro)
    blocks = [partition.Block("prologue", "prologue", list(pro))] if pro else []
    classes: dict[tuple, tuple[CellClass, str, list]] = {}
    mapping: dict[int, Value] = {}
    for c in cut.candidates:
        if not cut.classed(c):
            for n in c.nodes:
                _substitute_node(n, mapping)
            body += c.nodes
            blocks.append(partition.Block("inline", f"{prefix}.{c.index}", list(c.nodes)))
            continue
        if c.signature not in classes:
            classes[c.signature] = _make_class(program, c, prefix, len(classes), scopes)
        cell, list_attr, instances = classes[c.signature]
        inputs = [mapping.get(id(v), v) for v in c.inputs]
        call = Node("cell", f"self.{list_attr}[{len(instances)}]", tuple(inputs), n_outputs=len(c.outputs),
                    origin=f"{prefix}.{c.index}")
        for old, new in zip(c.outputs, call.outputs):
            new.hint = _strip(old.hint, prefix, c.index) if old.hint else None
            new.hint = f"{list_attr}_{c.index}_{new.hint or 'out'}"
            new.onnx_name = old.onnx_name
            mapping[id(old)] = new
        instances.append(c.attrs)
        body.append(call)
        blocks.append(partition.Block("layer", f"{list_attr}[{len(instances) - 1}]", [call], layer_class=cell.name,
                                      instance=(list_attr, len(instances) - 1),
                                      weights=[a for a in c.attrs if partition.is_weight(a)]))
    for n in epi:
        _substitute_node(n, mapping)
    body += epi
    blocks.append(partition.Block("epilogue", "epilogue", list(epi)))
    program.body.nodes = body
    program.body.outputs = [mapping.get(id(v), v) for v in program.body.outputs]
    used = {id(v.attr) for n in program.body.walk() for v in n.inputs() if isinstance(v, AttrValue)}
    used |= {id(v.attr) for v in program.body.outputs if isinstance(v, AttrValue)}
    program.attrs = [a for a in program.attrs if id(a) in used]  # (the rest moved into the layer classes)
    for cell, list_attr, instances in classes.values():
        program.instances.append((cell, list_attr, instances))
    grouped = sum(len(inst) for _, _, inst in classes.values())
    summary = {"prefix": prefix, "layers": len(cut.candidates), "classes": len(classes), "grouped": grouped,
               "merged_shared_nodes": len(merged), "placed_by": cut.policy}
    if grouped < len(cut.candidates):
        summary["inline"] = [c.index for c in cut.candidates if not cut.classed(c)]
    return Grouping(summary, partition.build(program.body.inputs, program.body.outputs, blocks))


def _make_class(program: Program, first: _Layer, prefix: str, number: int,
                scopes: Scopes) -> tuple[CellClass, str, list]:
    """The class body: the first member's nodes, reading its inputs as construct arguments and its
    attributes under layer-independent names."""
    name = _class_name(prefix, program, scopes, first.index) + (str(number + 1) if number else "")
    used: set[str] = set()
    attrs, swap = [], {}
    for a in first.attrs:
        stripped = _strip(a.name, prefix, first.index) or a.name
        k, candidate = 1, stripped
        while candidate in used:
            k += 1
            candidate = f"{stripped}_{k}"
        used.add(candidate)
        copy = Attr(candidate, a.shape, a.dtype, param=a.param, value=a.value, as_parameter=a.as_parameter)
        attrs.append(copy)
        swap[id(a)] = copy
    inputs = [Value(hint=_strip(v.hint or (f"{v.producer.origin}_t" if v.producer is not None else None),
                                prefix, first.index)) for v in first.inputs]
    mapping = {id(v): new for v, new in zip(first.inputs, inputs)}
    body_nodes = [_copy_node(n, mapping, swap, prefix, first.index) for n in first.nodes]
    outputs = [mapping[id(o)] for o in first.outputs]
    cell = CellClass(name, Body(inputs, body_nodes, outputs), attrs)
    list_attr = re.sub(r"\W+", "_", prefix.split(".")[-1]) or "layers"
    if number:
        list_attr = f"{list_attr}_{number + 1}"
    return cell, list_attr, []


def _copy_node(node: Node, mapping: dict[int, Value], swap: dict[int, Attr], prefix: str, index: int) -> Node:
    def conv(x):
        if isinstance(x, AttrValue) and id(x.attr) in swap:
            return AttrValue(swap[id(x.attr)])
        if isinstance(x, Value):
            return mapping.get(id(x), x)
        if isinstance(x, tuple):
            return tuple(conv(a) for a in x)
        if isinstance(x, list):
            return [conv(a) for a in x]
        if isinstance(x, slice):
            return slice(conv(x.start), conv(x.stop), conv(x.step))
        return x

    blocks = tuple(Body([], [_copy_node(n, mapping, swap, prefix, index) for n in b.nodes],
                         [conv(v) for v in b.outputs]) for b in node.blocks)
    target = conv(node.target) if isinstance(node.target, Value) else node.target
    copy = Node(node.kind, target, conv(node.args), {k: conv(v) for k, v in node.kwargs.items()},
                n_outputs=node.n_outputs, origin=node.origin, blocks=blocks)
    for old, new in zip(node.outputs, copy.outputs):
        new.hint = _strip(old.hint, prefix, index)
        mapping[id(old)] = new
    return copy
