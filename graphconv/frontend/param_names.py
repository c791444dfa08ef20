"""Weight names: the PyTorch state_dict names of a model's initializers, and names for weights a pass made.

The Parameters of the generated network (and so the .ckpt keys) carry the model's own names wherever the
ONNX lets them be recovered unambiguously; otherwise the ONNX initializer name is kept. Where a name comes
from:

- **the initializer's own name** when it is not one an exporter made up (dynamo keeps state_dict names for
  weights it reads as they are: embeddings, norms, biases, convolutions);
- **dynamo's node metadata** for a Linear weight the exporter folded into `W^T` (`val_76`): the MatMul that
  reads it implements `aten.linear` (`pkg.torch.onnx.fx_node`), whose arguments name the lifted parameter
  `%p_model_layers_0_self_attn_q_proj_weight`; the module path `model.layers.0.self_attn.q_proj`
  (`pkg.torch.onnx.name_scopes`) turns that mangled name back into `model.layers.0.self_attn.q_proj.weight`
  (accepted only when the mangling matches and the leaf has no underscore, which the mangling would hide);
- **TorchScript's node name scope** for its pre-transposed Linear weights (`onnx::MatMul_123` read as input 1
  of `/model/layers.0/self_attn/q_proj/MatMul`): `model.layers.0.self_attn.q_proj.weight`;
- **a folded chain**: on the loaded model, before onnxsim, every output of a layout-only op chain fed by an
  initializer (Transpose, Cast, Reshape, Squeeze, Unsqueeze, Flatten, Identity) is recorded as
  output name -> (source initializer, transform). When onnxsim folds the chain into an initializer named
  after its output, that initializer gets the source's name and the transform;
- **a pass** that made the weight and said so through `record_made` (sources, transform, naming rule):
  fuse-swiglu's merged gate/up becomes `model.layers.0.mlp.gate_up_proj.weight`. A weight a later stage made
  without recording it, but named `<known name><suffix>` (`val_76__fp16`), is named `<that name's name><suffix>`;
- **the module of its readers** for a value the exporter computed from weights and folded (Gemma's `1 + w`:
  dynamo's `add_127`, which a reader takes as the FX value `%add_127`, TorchScript's `onnx::Mul_741`): not a
  state_dict name, so qualified rather than replaced: `model.layers.0.input_layernorm.add_127`.

Two initializers claiming one name, or a name another initializer already has, keep their ONNX names.
`layout` in the mapping file says how a stored value relates to the PyTorch tensor of that name
(Linear weights recovered from `W^T` are stored transposed back in the lowering's `ops.dense` layout, so
they match the state_dict exactly: "same").

`WeightNames.record(model)` runs on the loaded model; `WeightNames.assign(names, made)` gives the final names
of the initializers of the graph that is lowered; `mapping(...)` is the JSON written beside the .ckpt
(`network.names.json`)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from typing import Iterable

import numpy as np
import onnx

# Initializer names that exporters make up (no state_dict name behind them).
GENERATED = re.compile(r"^(val_\d+|_val_\d+|onnx::.*|const_.*|_v_\d+|\d+)$")
LAYOUT_OPS = {"Transpose", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
_MADE_KEY = "graphconv.made_weight:"  # graph metadata_props key prefix used by record_made
_PLACEHOLDER = re.compile(r"%([pb])_(\w+)")
# fx ops whose ONNX MatMul reads the weight transposed (aten.linear(x, W) = MatMul(x, W^T)).
_LINEAR_TARGETS = ("aten.linear.default",)


@dataclasses.dataclass
class Origin:
    """Where one initializer's name and value come from."""

    name: str  # the Parameter / .ckpt name
    source: list[str]  # initializer(s) of the input ONNX model the value is computed from ([] when unknown)
    transform: list[str]  # steps from the source(s) to this ONNX value, e.g. ["transpose [1, 0]"]
    recovered: str  # how the name was found
    # For names recovered from PyTorch: the steps from the PyTorch tensor to this ONNX value (None when the
    # name is not a PyTorch one).
    from_pytorch: list[str] | None = None
    made_by: str | None = None
    derived_from: list[str] | None = None  # for a weight a pass made: its sources' Parameter names
    dtype: str | None = None  # numpy dtype name of this ONNX value when recorded (None: unknown)


def generated(name: str) -> bool:
    return bool(GENERATED.match(name or ""))


def _mangle(path: str) -> str:
    return re.sub(r"\W", "_", path)


def _metadata(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _dynamo_candidates(node: onnx.NodeProto, index: int, existing: set[str]) -> set[str] | None:
    """The state_dict name dynamo's metadata gives the weight read as input `index` of `node`; None when the
    node carries no such evidence."""
    md = _metadata(node)
    fx, scopes = md.get("pkg.torch.onnx.fx_node"), md.get("pkg.torch.onnx.name_scopes")
    if not fx or not scopes or not any(t in fx for t in _LINEAR_TARGETS):
        return None
    if not (node.op_type == "MatMul" and index == 1):
        return None
    try:
        scopes = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2 or not scopes[-2]:
        return None
    module = scopes[-2]
    prefix = _mangle(module) + "_"
    args = fx.split("args = (", 1)[1] if "args = (" in fx else fx
    found = set()
    for kind, mangled in _PLACEHOLDER.findall(args):
        if kind != "p" or not mangled.startswith(prefix):
            continue
        leaf = mangled[len(prefix):]
        if leaf and "_" not in leaf:
            found.add(f"{module}.{leaf}")
    return found - existing


def _reader_module(node: onnx.NodeProto) -> str | None:
    """The PyTorch module a node belongs to: dynamo's name scopes, else TorchScript's `/a/b.0/c/Op` name."""
    scopes = _metadata(node).get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            scopes = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            return None
        return scopes[-2] if isinstance(scopes, list) and len(scopes) >= 2 else None
    parts = node.name.strip("/").split("/") if node.name.startswith("/") else []
    return ".".join(parts[:-1]) if len(parts) >= 2 and all(parts[:-1]) else None


def _folded_by_exporter(name: str, uses: list) -> bool:
    """The initializer's name is one the exporter made up: a generated pattern, or (dynamo) the name of an
    FX node that a reader takes as an argument (`aten.mul(%mul_94, %add_127)`: the exporter folded add_127)."""
    if generated(name):
        return True
    ref = re.compile(rf"%{re.escape(name)}(?![\w.])")
    for node, _ in uses:
        fx = _metadata(node).get("pkg.torch.onnx.fx_node", "")
        if "args = (" in fx and ref.search(fx.split("args = (", 1)[1]):
            return True
    return False


def _torchscript_candidates(node: onnx.NodeProto, index: int, init_name: str) -> set[str] | None:
    """TorchScript's pre-transposed Linear weight `onnx::MatMul_N`, read by `/a/b.0/c/MatMul` -> a.b.0.c.weight."""
    if not init_name.startswith("onnx::") or node.op_type != "MatMul" or index != 1:
        return None
    parts = node.name.strip("/").split("/") if node.name.startswith("/") else []
    if len(parts) < 2 or any(not p for p in parts[:-1]):
        return None
    return {".".join(parts[:-1]) + ".weight"}


def _const_ints(name: str, inits: dict[str, onnx.TensorProto], consts: dict[str, onnx.TensorProto]) -> list | None:
    t = inits.get(name) or consts.get(name)
    if t is None or t.data_location == onnx.TensorProto.EXTERNAL:
        return None
    try:
        return [int(v) for v in onnx.numpy_helper.to_array(t).reshape(-1)]
    except Exception:  # noqa: BLE001 - not an integer tensor
        return None


def _step(node: onnx.NodeProto, inits, consts) -> str | None:
    """The transform one layout op applies, as text ('' for Identity); None when it is not layout-only."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    op = node.op_type
    if op == "Identity":
        return ""
    if op == "Transpose":
        perm = attrs.get("perm")
        return f"transpose {list(perm)}" if perm is not None else "transpose (reversed axes)"
    if op == "Cast":
        return f"cast {onnx.helper.tensor_dtype_to_np_dtype(attrs['to']).name}" if "to" in attrs else None
    if op in ("Reshape", "Squeeze", "Unsqueeze"):
        arg = _const_ints(node.input[1], inits, consts) if len(node.input) > 1 and node.input[1] else \
            list(attrs.get("axes", []))
        if len(node.input) > 1 and node.input[1] and arg is None:
            return None  # a run-time shape: not a constant chain
        return f"{op.lower()} {arg}"
    if op == "Flatten":
        return f"flatten axis {attrs.get('axis', 1)}"
    return None


def _simplify(steps: list[str]) -> list[str]:
    """Drop identities and cancel a 2-D transpose applied twice."""
    out: list[str] = []
    for s in steps:
        if not s:
            continue
        if s == "transpose [1, 0]" and out and out[-1] == "transpose [1, 0]":
            out.pop()
            continue
        out.append(s)
    return out


def _merged_name(names: list[str]) -> str | None:
    """`a.b.gate_proj.weight` + `a.b.up_proj.weight` -> `a.b.gate_up_proj.weight`: the names differ in one
    dotted component, whose common '_'-separated head and tail are kept once."""
    parts = [n.split(".") for n in names]
    if len(parts) < 2 or len({len(p) for p in parts}) != 1:
        return None
    differing = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    if len(differing) != 1:
        return None
    i = differing[0]
    tokens = [p[i].split("_") for p in parts]
    head = 0
    while all(len(t) > head for t in tokens) and len({t[head] for t in tokens}) == 1:
        head += 1
    tail = 0
    while all(len(t) - head > tail for t in tokens) and len({t[len(t) - 1 - tail] for t in tokens}) == 1:
        tail += 1
    middles = ["_".join(t[head:len(t) - tail]) for t in tokens]
    if any(not m for m in middles):
        return None
    common_head, common_tail = tokens[0][:head], tokens[0][len(tokens[0]) - tail:] if tail else []
    component = "_".join(common_head + ["_".join(middles)] + common_tail)
    return ".".join(parts[0][:i] + [component] + parts[0][i + 1:])


def record_made(graph, name: str, sources: Iterable[str], transform: str, naming: str = "merge",
                made_by: str | None = None) -> None:
    """For passes: initializer `name` was made from the initializers `sources` by `transform` (text, e.g.
    "concat axis 1"). `naming` says how its Parameter name derives from the sources' names:
    "merge" (names differing in one component: gate_proj + up_proj -> gate_up_proj), "same" (the first
    source's name: a layout/dtype change of one weight that replaces it), or "suffix:<text>" (the first
    source's name + text); `made_by` names the pass. `graph` is the onnx_ir Graph/Function (or Model) that
    holds the initializer, or an onnx GraphProto/ModelProto. The record travels in the graph's
    metadata_props to the lowering (and is visible in a --save-fused model)."""
    record = json.dumps({"sources": list(sources), "transform": transform, "naming": naming, "made_by": made_by})
    target = getattr(graph, "graph", graph)  # a Model -> its graph
    props = getattr(target, "metadata_props", None)
    if isinstance(props, dict):  # onnx_ir
        props[_MADE_KEY + name] = record
        return
    for p in props:  # onnx GraphProto
        if p.key == _MADE_KEY + name:
            p.value = record
            return
    props.add(key=_MADE_KEY + name, value=record)


def made_records(metadata: dict[str, str]) -> dict[str, dict]:
    return {k[len(_MADE_KEY):]: json.loads(v) for k, v in metadata.items() if k.startswith(_MADE_KEY)}


class WeightNames:
    """Recorded on the loaded (unsimplified) model; assigns names to the initializers of a later graph."""

    def __init__(self) -> None:
        self.origins: dict[str, Origin] = {}  # initializer or recorded chain-output name -> origin

    @classmethod
    def record(cls, model: onnx.ModelProto) -> "WeightNames":
        self = cls()
        g = model.graph
        inits = {t.name: t for t in g.initializer}
        consts = {n.output[0]: n.attribute[0].t for n in g.node
                  if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
        consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for n in g.node:
            for k, x in enumerate(n.input):
                if x:
                    consumers.setdefault(x, []).append((n, k))
        existing = set(inits)
        for name, t in inits.items():
            self.origins[name] = dataclasses.replace(self._recover(name, t, consumers.get(name, []), existing),
                                                     dtype=shape_dtype(t)[1])
        # Layout-only chains fed by an initializer: what onnxsim folds into a new initializer.
        todo = list(inits)
        while todo:
            name = todo.pop()
            origin = self.origins[name]
            for node, k in consumers.get(name, []):
                if k != 0 or node.op_type not in LAYOUT_OPS or len(node.output) != 1:
                    continue
                if any(x and x not in inits and x not in consts for x in node.input[1:]):
                    continue
                step = _step(node, inits, consts)
                out = node.output[0]
                if step is None or not out or out in self.origins:
                    continue
                steps = _simplify(origin.transform + [step])
                self.origins[out] = Origin(
                    origin.name, origin.source, steps, f"{origin.recovered}, folded chain ({node.op_type})",
                    None if origin.from_pytorch is None else _simplify(origin.from_pytorch + [step]),
                    dtype=step[len("cast "):] if step.startswith("cast ") else origin.dtype)
                todo.append(out)
        return self

    @staticmethod
    def _recover(name: str, t: onnx.TensorProto, uses: list, existing: set[str]) -> Origin:
        if not _folded_by_exporter(name, uses):
            return Origin(name, [name], [], "onnx name", [])
        votes, how = set(), None
        for node, k in uses:
            cand = _dynamo_candidates(node, k, existing)
            kind = "dynamo metadata (aten.linear)"
            if cand is None:
                cand, kind = _torchscript_candidates(node, k, name), "TorchScript name scope"
            if cand is None:
                continue
            if len(cand) != 1:
                return Origin(name, [name], [], "onnx name (the exporter's metadata is ambiguous)")
            votes |= cand
            how = kind
        if len(votes) == 1 and len(t.dims) == 2:
            (state_name,) = votes
            if state_name not in existing:
                # Linear: the ONNX value is the PyTorch weight transposed.
                return Origin(state_name, [name], [], how, ["transpose [1, 0]"])
        if len(votes) > 1:
            return Origin(name, [name], [], "onnx name (readers disagree on the module)")
        if votes:  # one name, but another initializer has it, or this is no 2-D Linear weight
            return Origin(name, [name], [], f"onnx name ({votes.pop()!r} does not fit it unambiguously)")
        # A value the exporter computed from weights (Gemma's 1 + w: dynamo's `add_127`, TorchScript's
        # `onnx::Mul_741`): no state_dict name, but the module all its readers belong to qualifies it.
        modules = {_reader_module(node) for node, _ in uses}
        if len(modules) == 1 and None not in modules and "" not in modules:
            qualified = f"{modules.pop()}.{re.sub(r'^onnx::', '', name).replace(':', '_')}"
            if qualified not in existing:
                return Origin(qualified, [name], [], "module of its readers (a value the exporter folded; "
                              "not a state_dict name)")
        return Origin(name, [name], [], "onnx name (generated by the exporter)")

    # --- the final names ----------------------------------------------------------------------------
    def assign(self, names: list[str], made: dict[str, dict] | None = None) -> dict[str, Origin]:
        """Origins (with unique names) for the initializer `names` of the graph being lowered."""
        made = made or {}
        memo: dict[str, Origin] = {}
        known = set(self.origins) | set(made)

        def resolve(n: str, depth: int = 0, as_made: bool = True) -> Origin:
            # as_made False: n's origin before the record that rewrote it in place (a dtype cast, "same")
            if as_made and n in memo:
                return memo[n]
            if depth > 20:
                return Origin(n, [], [], "onnx name (origin unknown)")
            if as_made and n in made:
                rec = made[n]
                srcs = [resolve(s, depth + 1, as_made=s != n) for s in rec.get("sources", [])]
                naming = rec.get("naming") or "merge"
                derived = None
                if srcs and naming == "merge":
                    derived = _merged_name([s.name for s in srcs]) if len(srcs) > 1 else srcs[0].name
                elif srcs and naming == "same":
                    derived = srcs[0].name
                elif srcs and naming.startswith("suffix:"):
                    derived = srcs[0].name + naming[len("suffix:"):]
                source = [x for s in srcs for x in s.source]
                what = rec.get("transform") or "made by a pass"
                if len(srcs) == 1:
                    transform = _simplify(srcs[0].transform + [what])
                else:  # one step over several inputs, each named by its source (and its own transform)
                    parts = [" + ".join(s.source) + (f" after {'; '.join(s.transform)}" if s.transform else "")
                             for s in srcs]
                    transform = [f"{what} of {', '.join(parts)}"]
                # Concatenating or permuting keeps the sources' dtype; a recorded cast makes it unknown here.
                dtypes = {s.dtype for s in srcs}
                dtype = dtypes.pop() if len(dtypes) == 1 and "cast" not in what else None
                origin = Origin(derived or n, source, transform,
                                f"made by {rec.get('made_by') or 'a pass'} ({naming})", None,
                                rec.get("made_by") or "a pass", [s.name for s in srcs], dtype)
            elif n in self.origins:
                origin = self.origins[n]
            else:
                # The longest known name that `n` extends at a separator (`val_76__fp16` -> `val_76`).
                base = next((n[:k] for k in range(len(n) - 1, 0, -1)
                             if not n[k].isalnum() and n[:k] in known), None)
                if base is not None:
                    b = resolve(base, depth + 1)
                    origin = Origin(b.name + n[len(base):], b.source,
                                    b.transform + [f"made from {b.name} (not recorded)"],
                                    f"named after {base} by a later stage (not recorded)", None, "a later stage",
                                    [b.name])
                else:
                    origin = Origin(n, [], [], "onnx name (made after loading; origin unknown)")
            if as_made or n not in made:
                memo[n] = origin
            return origin

        out = {n: resolve(n) for n in names}
        # Unique: a name claimed twice, or one that another initializer keeps as its ONNX name, stays ONNX.
        while True:
            final = {n: o.name for n, o in out.items()}
            counts: dict[str, int] = {}
            for v in final.values():
                counts[v] = counts.get(v, 0) + 1
            bad = [n for n, v in final.items() if v != n and (counts[v] > 1 or (v in final and final[v] == v))]
            if not bad:
                return out
            for n in bad:
                o = out[n]
                out[n] = dataclasses.replace(o, name=n, from_pytorch=None,
                                             recovered=f"onnx name ({o.name!r} is not unique)")


def identity() -> WeightNames:
    """Names as they are (no recorded model): every initializer keeps its ONNX name."""
    return WeightNames()


def mapping(params, origins: dict[str, Origin]) -> dict:
    """The mapping file's content: Parameter name -> source initializer(s), transform, layout, shape, dtype.

    `transform`: how the stored (.ckpt) value is computed from the source initializer(s) of the input ONNX
    model; `layout`: how the stored value relates to the tensor the name denotes in the exporting framework
    (the PyTorch weight a name was recovered from, or the input initializer of that name): "same", or the
    steps from it (absent for names made by a pass or left unknown)."""
    out = {}
    for p in params:
        o = origins.get(p.onnx_name)
        stored = ["transpose [1, 0]"] if p.transposed else []
        entry = {"attribute": p.attr, "onnx": p.onnx_name, "shape": list(p.shape), "dtype": p.dtype}
        if o is None:  # a constant the lowering folded
            entry.update(source=[], transform="folded by the lowering", recovered="folded constant")
        else:
            # A later stage that changed the dtype in place (--precision) keeps the name: say so.
            cast = [f"cast {p.dtype}"] if o.dtype is not None and o.dtype != p.dtype else []
            steps = _simplify(o.transform + cast + stored)
            entry.update(source=o.source, transform="; ".join(steps) or None, recovered=o.recovered)
            if o.from_pytorch is not None and o.name == p.name:
                layout = _simplify(o.from_pytorch + cast + stored)
                entry["layout"] = "; ".join(layout) if layout else "same"
            if o.made_by:
                entry["made_by"] = o.made_by
                entry["derived_from"] = o.derived_from
        out[p.name] = entry
    return out


def write_mapping(path, params, origins: dict[str, Origin]) -> None:
    with open(path, "w") as f:
        json.dump(mapping(params, origins), f, indent=1)
        f.write("\n")


def shape_dtype(t: onnx.TensorProto) -> tuple[list[int], str]:
    return [int(d) for d in t.dims], np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).name


def _category(entry: dict) -> str:
    how = entry.get("recovered", "")
    if entry.get("made_by"):
        return "made by a pass"
    for key, cat in (("dynamo metadata", "dynamo metadata"), ("TorchScript", "TorchScript name scope"),
                     ("folded chain", "folded chain"), ("folded constant", "folded constant")):
        if key in how:
            return cat
    if how == "onnx name":
        return "onnx name"
    return "onnx name kept (not recovered)"


def name_summary(path) -> dict[str, int]:
    """How many Parameters got their name which way (the lower stage's report detail); {} without a file."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except FileNotFoundError:
        return {}
    counts: dict[str, int] = {}
    for e in entries.values():
        c = _category(e)
        counts[c] = counts.get(c, 0) + 1
    return dict(sorted(counts.items()))
