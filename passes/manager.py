"""The pass manager: named passes in an ordered, textual pipeline, each switchable and counted.

A pass is a function `apply(model: onnx_ir.Model) -> PassResult` registered under a name. Third parties add
passes without touching graphconv: a module that calls `register_pass` (or defines onnxscript rewrite rules and
calls `rewrite_pass`), loaded with `--plugin module.path` or through the Python entry-point group
`graphconv.passes`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from typing import Callable

import onnx_ir as ir

from graphconv.errors import InputError, InternalError

ENTRY_POINT_GROUP = "graphconv.passes"
_NOTES_KEY = "graphconv.pass_notes"


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What one application of a pass tells the pass manager; the only thing a pass's `apply` may return, so
    that the manager and the report read every pass, built-in or plugin, the same way."""

    count: int  # how often the pass fired
    # "node: reason" for each candidate match the pass's checks refused (the report's skipped fusions)
    refusals: list[str] = dataclasses.field(default_factory=list)
    # node name -> the reason its match was refused (fusion coverage reads them: passes/coverage.py)
    node_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # anything else the pass wants reported


def note(model: ir.Model, text: str) -> None:
    """Report `text` under the running pass's notes: for a rule's rewrite, which returns a value, not a
    PassResult (e.g. a fusion that chose its second primitive, and why)."""
    model.meta.setdefault(_NOTES_KEY, []).append(text)


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    description: str
    apply: Callable[[ir.Model], PassResult]
    default: bool  # in the default pipeline
    origin: str  # "builtin" or the plugin module that registered it


_PASSES: dict[str, Pass] = {}
_ORIGIN = {"current": "builtin"}


def register_pass(name: str, description: str, *, default: bool = True):
    """Decorator for `apply(model) -> PassResult`. Built-in passes run in DEFAULT_ORDER, plugin passes after them
    in registration order."""

    def deco(fn):
        if name in _PASSES and _PASSES[name].apply is not fn:
            raise InputError(f"pass {name!r} is registered twice ({_PASSES[name].origin} and {_ORIGIN['current']})")
        _PASSES[name] = Pass(name, description, fn, default, _ORIGIN["current"])
        return fn

    return deco


def _ruleset(rules):
    from onnxscript.rewriter import pattern

    return rules if isinstance(rules, pattern.RewriteRuleSet) else pattern.RewriteRuleSet(list(rules))


def _rules_maker(rules) -> Callable[[], object]:
    """rules as a function giving the rule set of one application: a function is called each time, fixed
    rules are the same every time."""
    if callable(rules):
        return lambda: _ruleset(rules())
    ruleset = _ruleset(rules)
    return lambda: ruleset


def apply_rules(ruleset, model: ir.Model, candidates: Callable[[ir.Graph], list] | None = None) -> PassResult:
    """Apply a RewriteRuleSet (or a list of rules) as a pass does.
    candidates: the nodes the rules could fuse (a fusion family's candidate rule, passes/coverage.py)."""
    from onnxscript.rewriter import pattern

    ruleset = _ruleset(ruleset)
    count = ruleset.apply_to_model(model)
    # A second, tracing walk over what is left: with a tracer the rewriter only records why candidate
    # matches failed their checks (it rewrites nothing), which is what the report wants. Skipped when no
    # candidate is left (all fused, or none to begin with): there is no refusal to explain, and the walk
    # costs as much as the rewrite (half of the passes' time on a 1.1B Llama).
    if candidates is not None and not candidates(model.graph):
        return PassResult(count)
    tracer = pattern.MatchingTracer()
    ruleset.apply_to_model(model, tracer=tracer)
    refusals, node_reasons = [], {}
    for rule, matches in tracer.best_matches_map.items():
        for m in matches:
            if m.status == pattern.MatchStatus.CONDITION_FAILED and m.match_result.reason:
                # (a check failing without a reason declines a match another rule takes: not a refusal)
                reason = m.match_result.reason
                refusals.append(f"{m.root_node.name or m.root_node.op_type}: {reason}")
                involved = [m.root_node, *m.match_result.nodes, *m.match_result.failure_nodes_and_values]
                for x in involved:
                    if isinstance(x, ir.Node) and x.name:
                        node_reasons.setdefault(x.name, reason)
    return PassResult(count, sorted(set(refusals)), node_reasons)


def rewrite_pass(name: str, description: str, rules, *, default: bool = True,
                 candidates: Callable[[ir.Graph], list] | None = None,
                 prepare: Callable[[ir.Model], None] | None = None) -> Pass:
    """Register a pass that applies onnxscript rewrite rules: a RewriteRuleSet, a list of rules, or a
    function returning either, called for each application. Rule objects keep what they matched last (the
    onnxscript matcher its last match, a check the analysis it hands to its rewrite), so rules a module holds
    would hold a compile's graph after it: the built-in passes give a function.
    candidates: every node the rules could fuse, if a function can tell (see apply_rules).
    prepare: run on the model first, to restore a spelling the rules match that another tool merged away (an
    exact rewrite; the candidates are counted after it)."""
    make = _rules_maker(rules)

    def apply(model: ir.Model) -> PassResult:
        if prepare is not None:
            prepare(model)
        return apply_rules(make(), model, candidates)

    register_pass(name, description, default=default)(apply)
    return _PASSES[name]


def staged_rewrite_pass(name: str, description: str, stages: list, *, finish: Callable[[ir.Model], None] | None = None,
                        default: bool = True) -> Pass:
    """Register a pass that fuses through intermediate ops: each stage's rules (given as rewrite_pass takes
    them) run in order, `finish` last (e.g. to expand intermediate ops no stage took further). The pass's
    count is the last stage's; a node's first recorded refusal wins."""
    makers = [_rules_maker(s) for s in stages]

    def apply(model: ir.Model) -> PassResult:
        count, refusals, node_reasons = 0, set(), {}
        for make in makers:
            result = apply_rules(make(), model)
            count = result.count
            refusals.update(result.refusals)
            for k, v in result.node_reasons.items():
                node_reasons.setdefault(k, v)
        if finish is not None:
            finish(model)
        return PassResult(count, sorted(refusals), node_reasons)

    register_pass(name, description, default=default)(apply)
    return _PASSES[name]


def available_passes() -> list[Pass]:
    """Every registered pass: the built-in ones in DEFAULT_ORDER, then plugins' in registration order."""
    ranked = {name: k for k, name in enumerate(DEFAULT_ORDER)}
    return sorted(_PASSES.values(), key=lambda p: ranked.get(p.name, len(ranked)))


# The built-in pipeline, in order (passes/__init__.py imports the modules that register these names).
# settle-ifs first (what follows reads one rank per value), then canonicalization; norms before the activations
# that read their outputs; GELU before the gated MLPs that take a GELU gate; rotary before attention, which
# reads the rotated q and k; MoE routing after it (attention's coverage explains a router's Softmax as no
# attention before fuse-moe takes it); the LSTMs (independent of the rest) last. The W8A8 linears before the
# fusions, which then see a quantized linear as one node (fuse-swiglu merges a gate/up pair of them).
DEFAULT_ORDER: list[str] = [
    "settle-ifs", "canonicalize", "tie-weights", "refine-shapes", "fuse-qdq-matmul", "fuse-rmsnorm",
    "fuse-layernorm", "fuse-gelu", "fuse-silu", "fuse-swiglu", "fuse-rope", "fuse-attention", "fuse-moe", "fuse-lstm",
    "fuse-quant-matmul",
]


def skipped_fusions(manager: "PassManager") -> dict[str, list[str]]:
    """The report's skipped_fusions: per fusion family's pass, its coverage items ("node: reason"); other
    passes keep the reasons their checks gave."""
    from passes.coverage import family_passes, skipped_view

    covered = family_passes()
    view = {k: v for k, v in manager.skipped.items() if k not in covered}
    view.update(skipped_view(manager.coverage))
    return view


def load_plugins(modules: tuple[str, ...] = (), entry_points: bool = True) -> list[str]:
    """Import plugin modules (from --plugin and the entry-point group); returns what was loaded."""
    loaded = []
    targets = [(m, m) for m in modules]
    if entry_points:
        targets += [(ep.value, ep.name) for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    for target, label in targets:
        module_name = target.split(":")[0]
        _ORIGIN["current"] = module_name
        try:
            importlib.import_module(module_name)
        except ImportError as e:
            raise InputError(f"plugin {label!r}: cannot import {module_name!r} ({e})") from None
        finally:
            _ORIGIN["current"] = "builtin"
        loaded.append(module_name)
    return loaded


class PassManager:
    def __init__(self, spec: str | None = None, disabled: tuple[str, ...] = ()):
        if spec is not None:
            names = [s.strip() for s in spec.split(",") if s.strip()]
        else:
            names = [p.name for p in available_passes() if p.default]
        unknown = [n for n in list(names) + list(disabled) if n not in _PASSES]
        if unknown:
            raise InputError(f"unknown pass(es) {', '.join(unknown)}; available: {', '.join(_PASSES)}")
        self.passes = [_PASSES[n] for n in names if n not in disabled]
        self.skipped: dict[str, list[str]] = {}
        self.node_reasons: dict[str, dict[str, str]] = {}
        self.notes: dict[str, list[str]] = {}
        self.coverage: dict[str, dict] = {}

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(self, model: ir.Model, after_each: Callable[[Pass, ir.Model, int], None] | None = None) -> dict[str, int]:
        """Apply the passes in order; returns pass -> count. Each pass's refusals are left in `self.skipped`,
        its node reasons in `self.node_reasons`, its notes in `self.notes` (passes that gave some), the fusion
        families' candidates and what became of them in `self.coverage` (passes/coverage.py)."""
        from passes.coverage import Tracker

        counts: dict[str, int] = {}
        self.skipped, self.node_reasons, self.notes = {}, {}, {}
        tracker = Tracker(self.names)
        for p in self.passes:
            tracker.before(p.name, model)
            result = p.apply(model)
            if not isinstance(result, PassResult):
                raise _contract_error(p, result)
            counts[p.name] = result.count
            if result.refusals:
                self.skipped[p.name] = list(result.refusals)
            notes = [*result.notes, *model.meta.pop(_NOTES_KEY, [])]
            if notes:
                self.notes[p.name] = notes
            self.node_reasons[p.name] = dict(result.node_reasons)
            tracker.after(p.name, model, self.node_reasons)
            if after_each is not None:
                after_each(p, model, counts[p.name])
        self.coverage = tracker.finish(model, self.node_reasons)
        return counts


def _contract_error(p: Pass, result) -> Exception:
    """A pass returned something other than a PassResult: the plugin's fault (bad input), or graphconv's."""
    if p.origin == "builtin":
        return InternalError(f"built-in pass {p.name!r} returned {type(result).__name__}, not a PassResult")
    return InputError(f"pass {p.name!r} of plugin {p.origin!r} returned {type(result).__name__}, not "
                      "passes.PassResult(count, refusals, node_reasons, notes)")
