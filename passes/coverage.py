"""Fusion coverage: every candidate of a fusion family is either fused or listed with the pass and a reason.

A *family* groups the passes that fuse one kind of computation and states its *candidate rule*: which nodes
of the graph a perfect compiler would fuse. The pass manager takes the candidates just before the family's
first pass runs and judges them right after its last one: a candidate node that is gone (or dead) was fused;
one that is still computing was refused, and the report says why:
  1. the family's passes are not in the pipeline (disabled) -> that;
  2. a pass recorded a failed check at that node (the onnxscript tracer's reason, or one the pass gives) ->
     that reason, with the pass;
  3. the family's `explain` (the pass's own analysis run from the candidate) -> its reason;
  4. else "no <pass> pattern matched this <op>".
A silent zero is therefore impossible: `coverage[family]["refused"]` counts each reason.

The candidate rules (also stated in each pass's docstring):
  attention  every Softmax, and every opset-23 Attention node.
  norm       every second-moment reduction: ReduceMean of a square (Mul(x, x) or Pow(x, 2)), and every
             LayerNormalization / RMSNormalization / SimplifiedLayerNormalization node.
  rotary     every Neg whose result reaches a Concat within two shape-only ops (rotate_half's
             concat(-x2, x1), the interleaved stack(-x_odd, x_even)), every opset-23 RotaryEmbedding, and
             every Concat of a Sub and an Add of two products each (the half-length form
             cat(x1*cos - x2*sin, x2*cos + x1*sin), or its parts the other way round, or each unsqueezed:
             the pairs' complex product stacked, Llama 4).
  gated_mlp  every Mul of an activation (x*sigmoid(x), SiLU, a GELU) with something other than the
             activation's own input: silu(gate) * up, gelu(gate) * up.
  gelu       every Erf, every Gelu, every Tanh of a GELU-shaped argument (a 0.044715 or sqrt(2/pi)
             coefficient within four producers), every Sigmoid of x times a constant other than 1
             (quick GELU).
  moe        every TopK over Softmax or Sigmoid scores (through Casts), or whose values go on to a Softmax
             or (scattered back over the experts) to a Sigmoid,
             or over Sigmoid/Softmax scores plus an expert bias (through a masked_fill's Where) whose indices
             gather the chosen weights; every ArgMax of router logits whose index gathers from a Softmax
             (PhiMoE's sparsemixer) (registered by passes/fuse_moe.py).
  recurrent  every LSTM over a dynamic sequence length (registered by passes/fuse_lstm.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import onnx_ir as ir

from graphconv.onnx_domains import is_default_domain
from passes import match

_GELU_COEFFICIENTS = (0.044715, 0.7978845608028654, 0.035677408136300125)  # 0.044715*sqrt(2/pi): Bloom


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    passes: tuple[str, ...]
    candidates: Callable[[ir.Graph], list[ir.Node]]
    # The pass's own reason for a candidate that no check recorded one for (None: not known).
    explain: Callable[[ir.Node], str | None] | None = None


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def set_explain(name: str, explain: Callable[[ir.Node], str | None]) -> None:
    """Let a pass module give its family's explanation for unmatched candidates."""
    FAMILIES[name] = dataclasses.replace(FAMILIES[name], explain=explain)


def _std(node: ir.Node, *op_types: str) -> bool:
    return is_default_domain(node.domain) and node.op_type in op_types


# --- the candidate rules ---------------------------------------------------------------------------------


def attention_candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if _std(n, "Softmax", "Attention")]


def _is_square(value: ir.Value | None) -> bool:
    p = value.producer() if value is not None else None
    if p is None or not is_default_domain(p.domain):
        return False
    if p.op_type == "Cast":
        return _is_square(p.inputs[0])
    if p.op_type == "Mul":
        return len(p.inputs) == 2 and p.inputs[0] is p.inputs[1]
    return p.op_type == "Pow" and match.scalar(p.inputs[1]) == 2.0


def norm_candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph
            if (_std(n, "ReduceMean") and _is_square(n.inputs[0]))
            or _std(n, "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")]


def _reaches_concat(value: ir.Value, hops: int = 2) -> bool:
    for use in value.uses():
        node = use.node
        if _std(node, "Concat"):
            return True
        if hops and _std(node, *match.SHAPE_ONLY) and _reaches_concat(node.outputs[0], hops - 1):
            return True
    return False


def products_combined(value: ir.Value | None, op_type: str) -> bool:
    node = value.producer() if value is not None else None
    return node is not None and _std(node, op_type) and all(
        v is not None and v.producer() is not None and _std(v.producer(), "Mul") for v in node.inputs)


def rotation_pair(node: ir.Node) -> int | None:
    """Where a Concat of more than two inputs holds a half-length rotation's (Sub, Add) products side by side
    (onnxsim merges DeepSeek's cat(q_pass, cat(Sub, Add)) into one Concat): the index of the Sub, else None."""
    ins = list(node.inputs)
    return next((i for i in range(len(ins) - 1)
                 if products_combined(ins[i], "Sub") and products_combined(ins[i + 1], "Add")), None)


def stacked_rotation(node: ir.Node) -> bool:
    """A Concat of Unsqueeze(a*c - b*s) and Unsqueeze(a*s + b*c): the rotation of interleaved pairs (a, b)
    written as a complex product and stacked back into pairs (Llama 4's rotary, traced as real pairs)."""
    ins = list(node.inputs)
    if len(ins) != 2:
        return False
    inner = [match.producer(v, "Unsqueeze") if v is not None else None for v in ins]
    return all(u is not None for u in inner) and \
        products_combined(inner[0].inputs[0], "Sub") and products_combined(inner[1].inputs[0], "Add")


def holds_rotation(node: ir.Node) -> bool:
    """A Concat of a half-length rotation's products, (Sub, Add) or (Add, Sub), or with more inputs a (Sub, Add)
    pair among them (rotation_pair), or of the two stacked (stacked_rotation)."""
    ins = list(node.inputs)
    if len(ins) == 2:
        return any(products_combined(ins[k], "Sub") and products_combined(ins[1 - k], "Add") for k in (0, 1)) \
            or stacked_rotation(node)
    return rotation_pair(node) is not None


def rotary_candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph
            if (_std(n, "Neg") and _reaches_concat(n.outputs[0])) or _std(n, "RotaryEmbedding")
            or (_std(n, "Concat") and holds_rotation(n))]


_MS_ACTIVATIONS = {"SiLU", "Gelu", "GeluTanh", "FastGelu"}


def _activation_input(value: ir.Value | None) -> ir.Value | None:
    """x when `value` is an activation of x (x*sigmoid(x), SiLU, a GELU), else None."""
    p = value.producer() if value is not None else None
    if p is None:
        return None
    if p.domain == "mindspore" and p.op_type in _MS_ACTIVATIONS:
        return p.inputs[0]
    if _std(p, "Gelu"):
        return p.inputs[0]
    if _std(p, "Mul") and len(p.inputs) == 2:
        for x, s in ((p.inputs[0], p.inputs[1]), (p.inputs[1], p.inputs[0])):
            sig = match.producer(s, "Sigmoid")
            if sig is not None and sig.inputs[0] is x:
                return x
    return None


def gated_mlp_candidates(graph: ir.Graph) -> list[ir.Node]:
    found = []
    for n in graph:
        if not _std(n, "Mul") or len(n.inputs) != 2:
            continue
        for act, other in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
            x = _activation_input(act)
            if x is not None and other is not x and match.const_value(other) is None:
                found.append(n)
                break
    return found


def _gelu_shaped(value: ir.Value | None, depth: int = 4) -> bool:
    p = value.producer() if value is not None else None
    if p is None or depth == 0:
        return False
    for x in p.inputs:
        c = match.scalar(x)
        if c is not None and any(abs(c - k) <= 1e-3 * k for k in _GELU_COEFFICIENTS):
            return True
    return any(_gelu_shaped(x, depth - 1) for x in p.inputs if x is not None)


def gelu_candidates(graph: ir.Graph) -> list[ir.Node]:
    found = []
    for n in graph:
        if _std(n, "Erf", "Gelu") or (_std(n, "Tanh") and _gelu_shaped(n.inputs[0])):
            found.append(n)
        elif _std(n, "Sigmoid"):
            scaled = match.producer(n.inputs[0], "Mul")
            if scaled is not None and any(match.scalar(x) not in (None, 1.0) for x in scaled.inputs):
                found.append(n)
    return found


# (the candidate rules in words: this module's docstring)
register_family(Family("attention", ("fuse-attention",), attention_candidates))
register_family(Family("norm", ("fuse-rmsnorm", "fuse-layernorm"), norm_candidates))
register_family(Family("rotary", ("fuse-rope",), rotary_candidates))
register_family(Family("gated_mlp", ("fuse-silu", "fuse-swiglu"), gated_mlp_candidates))
register_family(Family("gelu", ("fuse-gelu",), gelu_candidates))


def family_passes() -> set[str]:
    """Every pass some fusion family judges (their skip reasons come from the coverage)."""
    return {p for f in FAMILIES.values() for p in f.passes}


# --- judging ---------------------------------------------------------------------------------------------


def _computes(node: ir.Node) -> bool:
    return any(o.uses() or o.is_graph_output() for o in node.outputs)


def _alive(node: ir.Node, graph: ir.Graph, standard_names: set[str]) -> bool:
    """The candidate still computes: the node itself, or (a pass that went through an intermediate op and
    expanded it back: passes/fuse_attention.py) a standard-domain node carrying its name."""
    if node.graph is graph:
        return _computes(node)
    return bool(node.name) and node.name in standard_names


class Tracker:
    """Takes each family's candidates before its first pass and judges them after its last (PassManager)."""

    def __init__(self, pipeline: list[str]):
        self.pipeline = pipeline
        self.pending: dict[str, list[ir.Node]] = {}
        self.result: dict[str, dict] = {}

    def _present(self, family: Family) -> list[str]:
        return [p for p in self.pipeline if p in family.passes]

    def before(self, pass_name: str, model: ir.Model) -> None:
        for f in FAMILIES.values():
            present = self._present(f)
            if present and present[0] == pass_name:
                self.pending[f.name] = f.candidates(model.graph)

    def after(self, pass_name: str, model: ir.Model, node_reasons: dict[str, dict[str, str]]) -> None:
        for f in FAMILIES.values():
            present = self._present(f)
            if present and present[-1] == pass_name and f.name in self.pending:
                self._judge(f, self.pending.pop(f.name), model.graph, node_reasons, None)

    def finish(self, model: ir.Model, node_reasons: dict[str, dict[str, str]]) -> dict[str, dict]:
        for f in FAMILIES.values():
            if f.name in self.result:
                continue
            disabled = f"{'/'.join(f.passes)} not in the pass pipeline (disabled)"
            self._judge(f, f.candidates(model.graph), model.graph, node_reasons, disabled)
        return {name: self.result[name] for name in FAMILIES if name in self.result}

    def _judge(self, f: Family, candidates: list[ir.Node], graph: ir.Graph,
               node_reasons: dict[str, dict[str, str]], disabled: str | None) -> None:
        refused: dict[str, int] = {}
        items = []
        fused = 0
        standard_names = {n.name for n in graph if n.name and is_default_domain(n.domain) and _computes(n)}
        for node in candidates:
            if disabled is None and not _alive(node, graph, standard_names):
                fused += 1
                continue
            pass_name, reason = (f.passes[0], disabled) if disabled else self._reason(f, node, node_reasons)
            refused[reason] = refused.get(reason, 0) + 1
            items.append({"node": node.name, "op": node.op_type, "pass": pass_name, "reason": reason})
        self.result[f.name] = {"candidates": len(candidates), "fused": fused, "refused": refused, "items": items}

    def _reason(self, f: Family, node: ir.Node, node_reasons: dict[str, dict[str, str]]) -> tuple[str, str]:
        for p in self._present(f)[::-1]:
            reason = node_reasons.get(p, {}).get(node.name)
            if reason:
                return p, reason
        if f.explain is not None:
            try:
                reason = f.explain(node)
            except Exception as e:  # noqa: BLE001 - an explanation must never break a compile
                reason = f"(explaining failed: {type(e).__name__}: {e})"
            if reason:
                return self._present(f)[-1], reason
        return self._present(f)[-1], f"no {'/'.join(self._present(f))} pattern matched this {node.op_type}"


def summary_lines(coverage: dict[str, dict]) -> list[str]:
    """One line per family: `attention 0/22 fused: 22 × <reason>`."""
    lines = []
    for name, c in coverage.items():
        if not c["candidates"]:
            continue
        line = f"{name} {c['fused']}/{c['candidates']} fused"
        if c["refused"]:
            line += ": " + "; ".join(f"{k} × {r}" for r, k in sorted(c["refused"].items(), key=lambda kv: -kv[1]))
        lines.append(line)
    return lines


def skipped_view(coverage: dict[str, dict]) -> dict[str, list[str]]:
    """The report's `skipped_fusions` (pass -> ["node: reason"]), derived from the coverage items."""
    view: dict[str, list[str]] = {}
    for c in coverage.values():
        for item in c["items"]:
            view.setdefault(item["pass"], []).append(f"{item['node']}: {item['reason']}")
    return {k: sorted(set(v)) for k, v in view.items()}
