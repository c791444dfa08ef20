"""The largest size each dim of the graph can take, for the fusions' constraint checks (opmap/fused/record.py's
Constraint).

The compile declares a bound for every symbolic dim of the model's inputs: the maximum of its --shape-range
where the user gave one, else the largest of its reference sizes (the shapes the compile verifies at). A fusion
reads the bound of a dim through `largest`; a static dim is its own bound; a dim computed from declared dims
(an exporter's `4*batch`, `past_sequence_length + 1`: onnx-ir reads them as sympy expressions) is bounded by its
value at their bounds where it cannot decrease as they grow; any other dim (unnamed, a name nothing declares,
an expression that can decrease, or no declaration: a plugin's own pipeline) is unknown, and a constraint
reading it is not checked. The bounds travel in the model's `meta` (not serialized), so pass signatures stay
`apply(model)`.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

KEY = "graphconv.dim_bounds"


@dataclasses.dataclass(frozen=True)
class Bound:
    largest: int
    origin: str  # how it was declared, as the refusal names it: "declared range batch=1..512"


def declare(model: ir.Model, ranges: dict[str, tuple[int, int]], reference: dict[str, list[int]]) -> None:
    """Bounds for the dims named in `ranges` (--shape-range, or a generation folder's capacity) and in
    `reference` (their reference sizes)."""
    bounds = {name: Bound(max(sizes), f"reference sizes {name}={','.join(map(str, sizes))}")
              for name, sizes in reference.items() if sizes}
    bounds.update({name: Bound(hi, f"declared range {name}={lo}..{hi}") for name, (lo, hi) in ranges.items()})
    model.meta[KEY] = bounds


def largest(model: ir.Model | None, value: ir.Value, axis: int) -> tuple[int, str] | None:
    """(size, origin) of the largest size `value`'s dim `axis` can take, or None when unknown (no model: the
    static sizes only)."""
    if value.shape is None or not -value.shape.rank() <= axis < value.shape.rank():
        return None
    d = value.shape[axis]
    if isinstance(d, int):
        return d, "static"
    declared = model.meta.get(KEY, {}) if model is not None else {}
    if not isinstance(d, ir.SymbolicDim) or not d.value:
        return None
    bound = declared.get(d.value)
    return (bound.largest, bound.origin) if bound else _computed(d, declared)


def _computed(d: ir.SymbolicDim, declared: dict[str, Bound]) -> tuple[int, str] | None:
    """The bound of an expression over declared dims, or None."""
    names = d.free_symbols()
    try:
        expr = d._expr  # (onnx-ir's parse of the string; it has no public accessor)
    except Exception:  # noqa: BLE001 - a dim_param sympy cannot parse is just not an expression
        return None
    if not names or not names <= declared.keys() or expr is None or not _non_decreasing(expr):
        return None
    value = d.evaluate({n: declared[n].largest for n in names})
    if not isinstance(value, int):
        return None
    return value, f"{d.value} with " + ", ".join(f"{n} up to {declared[n].largest} ({declared[n].origin})"
                                                for n in sorted(names))


def _non_decreasing(expr) -> bool:
    """Whether `expr` (of positive integer symbols) cannot decrease as any symbol grows: sums, products with
    positive factors, positive integer powers, floor/ceiling, max/min of such terms (so its value at the
    symbols' bounds bounds it)."""
    import sympy

    if expr.is_Symbol or expr.is_Number:
        return True
    if isinstance(expr, sympy.Add):
        return all(_non_decreasing(a) for a in expr.args)
    if isinstance(expr, sympy.Mul):
        return all(a.is_Number and a > 0 or not a.is_Number and _non_decreasing(a) for a in expr.args)
    if isinstance(expr, sympy.Pow):
        return expr.exp.is_Integer and expr.exp > 0 and _non_decreasing(expr.base)
    if isinstance(expr, (sympy.floor, sympy.ceiling, sympy.Max, sympy.Min)):
        return all(_non_decreasing(a) for a in expr.args)
    return False


def sizes(model: ir.Model | None, value: ir.Value,
          axes: dict[str, int]) -> tuple[dict[str, int | None], dict[str, str]]:
    """The largest sizes of `value`'s named axes ({"B": 0, "N": 2}), and each as a refusal shows it."""
    found, shown = {}, {}
    for name, axis in axes.items():
        got = largest(model, value, axis)
        found[name] = got[0] if got else None
        if got:
            shown[name] = f"{name}={got[0]}" if got[1] == "static" else f"{name} up to {got[0]} ({got[1]})"
    return found, shown


def refusal(op_name: str, constraint, shown: dict[str, str]) -> str:
    """The refusal text of a broken constraint: the limit, where it is documented, the sizes that break it."""
    named = [shown[r] for r in constraint.reads if r in shown]
    at = f" at {', '.join(named)}" if named else ""
    return f"{op_name} needs {constraint.text} ({constraint.source}){at}"
