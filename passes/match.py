"""Matching helpers every fusion pass shares: constant values, scalars, dims, operand order, guards.

One definition of each, so the passes cannot drift apart in what they call a constant (an initializer, a
`Constant` node's `value` / `value_float(s)` / `value_int(s)`), a static dim, or an acceptable dtype.
Pattern-building helpers (`mul`, `add`) take the `op` builder of an onnxscript pattern; check helpers take
`ir.Value`s and return plain Python values or None when something is not provable.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.dtypes import FUSED_FLOATS
from graphconv.frontend import weights
from graphconv.onnx_domains import is_default_domain
from opmap.fused.record import ISLAND_OPSET

# The float dtypes MindSpore's fused primitives take (graphconv.dtypes holds the definition).
FLOATS = FUSED_FLOATS
# Below this opset a reference body has no CastLike, so it can only express fp32.
MIN_LOW_PRECISION_OPSET = ISLAND_OPSET


def _numeric(c: np.ndarray) -> np.ndarray:
    """bfloat16 arrays (numpy kind 'V' under ml_dtypes) as float32, so dtype-kind checks see a float."""
    return c.astype(np.float32) if c.dtype == ml_dtypes.bfloat16 else c


def last_axis(axis: int, rank: int) -> bool:
    """Whether `axis` names the last of `rank` axes (-1 or rank - 1); an axis out of range never does (a
    modulo would make 2**31 the last axis of rank 3)."""
    return -rank <= axis < rank and axis % rank == rank - 1


def last_axes(axes, rank: int) -> bool:
    """Whether `axes` is exactly the last axis."""
    return len(axes) == 1 and last_axis(axes[0], rank)


def made_weight(name: str, make, sources: list[ir.Value], axis: int = 0, dtype=None) -> ir.TensorProtocol:
    """A weight a pass makes from others (`make()`: merged gate/up), of the sources' shapes concatenated
    along `axis` (one source: its shape), computed only when read: by the spill after the pass
    (graphconv.frontend.weights.spill_new_tensors), one weight at a time, or when the model is serialized.
    The sources' memory maps are closed after each computation, so that a pass over 32 layers never holds
    32 layers' weights. Its dtype is const_value's (bfloat16 read as float32), or `dtype` (an ir.DataType: what
    make() returns). A source that is a Constant node's output (not an initializer) makes it at once."""
    if any(v.const_value is None for v in sources):
        return ir.tensor(make(), name=name)
    first = sources[0].const_value
    shape = list(first.shape)
    shape[axis] = sum(v.const_value.shape[axis] for v in sources)
    if dtype is None:
        dtype = ir.DataType.FLOAT if first.dtype == ir.DataType.BFLOAT16 else first.dtype

    def compute() -> ir.Tensor:
        array = make()
        for v in sources:
            if isinstance(v.const_value, ir.ExternalTensor):
                v.const_value.release()
        return ir.tensor(array, name=name)

    return ir.LazyTensor(compute, dtype=dtype, shape=ir.Shape(shape), name=name)


def concatenated(name: str, sources: list[ir.Value], axis: int, stored: bool = False) -> ir.TensorProtocol:
    """made_weight of np.concatenate(sources' values, axis), marked as such (weights.Concatenated: where every
    source is in a file, the spill after the pass only names it). `stored`: in the sources' own dtype (bfloat16
    stays bfloat16: weights read through a Cast, which the merged one is too)."""
    if stored:
        made = made_weight(name, lambda: np.concatenate([v.const_value.numpy() for v in sources], axis=axis),
                           sources, axis, dtype=sources[0].const_value.dtype)
    else:
        made = made_weight(name, lambda: np.concatenate([const_value(v) for v in sources], axis=axis), sources,
                           axis)
    if not isinstance(made, ir.LazyTensor):
        return made
    return weights.Concatenated(made._func, sources, axis, dtype=made.dtype, shape=made.shape, name=name)


def const_value(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or a `Constant` node's output, else None (bfloat16 read as float32)."""
    if value is None:
        return None
    if value.const_value is not None:
        return _numeric(value.const_value.numpy())
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or not is_default_domain(producer.domain):
        return None
    attr = producer.attributes.get("value")
    if attr is not None:
        return _numeric(attr.value.numpy())
    for name, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                        ("value_int", np.int64), ("value_ints", np.int64)):
        attr = producer.attributes.get(name)
        if attr is not None:
            return np.array(attr.value, dtype)
    return None


def scalar(value: ir.Value | None) -> float | None:
    """A constant holding one number (any rank), as a float; else None."""
    c = const_value(value)
    if c is None or c.size != 1 or c.dtype.kind not in "fiu":
        return None
    return float(c.reshape(-1)[0])


def scalar_with_tolerance(value: ir.Value | None) -> tuple[float, float] | None:
    """A constant scalar and the relative tolerance its dtype can hold a coefficient to (1e-5, or the
    fp16/bf16 rounding step)."""
    if value is None:
        return None
    stored = value.dtype  # the tolerance is the stored dtype's (bf16 is read as float32)
    c = const_value(value)
    if c is None or c.size != 1 or c.dtype.kind not in "fiu":
        return None
    eps = float(ml_dtypes.finfo(stored.numpy()).eps) if stored in FLOATS else float(np.finfo(c.dtype).eps) \
        if c.dtype.kind == "f" else 0.0
    return float(c.reshape(-1)[0]), max(1e-5, eps)


def close_to(value: ir.Value | None, expected: float) -> bool:
    """Whether `value` is a constant scalar equal to `expected` up to its dtype's rounding."""
    found = scalar_with_tolerance(value)
    return found is not None and abs(found[0] - expected) <= found[1] * max(1.0, abs(expected))


def ints(value: ir.Value | None) -> list[int] | None:
    c = const_value(value)
    return None if c is None or c.dtype.kind not in "iu" else [int(v) for v in c.reshape(-1)]


def dims(value: ir.Value | None) -> list | None:
    """Dims as ints (static), strings (symbolic) or None (unknown); None if the rank is unknown."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in value.shape]


def rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else value.shape.rank()


def may_equal(a, b) -> bool:
    """Two dims that may be equal at run time (a static 1 against a non-static dim may be a broadcast)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, int) or isinstance(b, int):
        return (a if isinstance(a, int) else b) != 1
    return True


def producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The standard-domain node of one of `op_types` that produces `value`, else None."""
    p = value.producer() if value is not None else None
    return p if p is not None and is_default_domain(p.domain) and p.op_type in op_types else None


def qdq_pair(value: ir.Value | None) -> ir.Node | None:
    """The QuantizeLinear when `value` = DequantizeLinear(QuantizeLinear(.)), a rounding a fusion must not drop
    (the coverage reasons name it), else None."""
    dq = producer(value, "DequantizeLinear")
    return producer(dq.inputs[0], "QuantizeLinear") if dq is not None else None


def users(value: ir.Value, *op_types: str) -> list[ir.Node]:
    """The standard-domain nodes of one of `op_types` that read `value`."""
    return [u.node for u in value.uses() if is_default_domain(u.node.domain) and u.node.op_type in op_types]


# Ops that only move or relabel a tensor's elements (the coverage rules look through them).
SHAPE_ONLY = frozenset({"Unsqueeze", "Reshape", "Identity", "Squeeze", "Flatten", "Cast"})


def input_at(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def perm(node: ir.Node, rank_: int) -> list[int]:
    """A Transpose's permutation (the default reverses the axes)."""
    attr = node.attributes.get("perm")
    return list(attr.value) if attr is not None else list(range(rank_))[::-1]


def axes(node: ir.Node) -> list[int] | None:
    """The axes of a Reduce*/Squeeze/Unsqueeze node: the input (opset 13/18 on) or the attribute."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return ints(node.inputs[1])
    attr = node.attributes.get("axes")
    return None if attr is None else [int(a) for a in attr.value]


def opset(context_or_model) -> int:
    """The default-domain opset of a rewrite context (or an ir.Model)."""
    model = getattr(context_or_model, "model", context_or_model)
    imports = model.opset_imports
    return next((v for d, v in imports.items() if is_default_domain(d)), 0)


def float_guard(context, result: pattern.MatchResult, x: ir.Value, op_name: str) -> pattern.MatchResult:
    """The dtype/opset guard of every fused op: fp32/fp16/bf16, and fp32 only below opset 15 (where the
    reference body has no CastLike). Fails `result` with the reason, else returns it unchanged."""
    if x.dtype not in FLOATS:
        return result.fail(f"dtype {x.dtype}: {op_name} takes float32, float16 or bfloat16", x)
    if opset(context) < MIN_LOW_PRECISION_OPSET and x.dtype != ir.DataType.FLOAT:
        return result.fail(f"below opset {MIN_LOW_PRECISION_OPSET} {op_name}'s reference body can only "
                           "express fp32", x)
    return result


def mul(op, a, b):
    """Mul(a, b) or Mul(b, a): operand orders as alternatives that backtrack locally, far cheaper than the
    ruleset's commute=True, which multiplies the pattern by 2 for every Mul and Add in it."""
    return pattern.OrValue([op.Mul(a, b), op.Mul(b, a)])


def add(op, a, b):
    """Add(a, b) or Add(b, a) (see `mul`)."""
    return pattern.OrValue([op.Add(a, b), op.Add(b, a)])


def unique_initializer_name(graph: ir.Graph, name: str) -> str:
    """`name`, or `name_2`, `name_3`, ... if an initializer or graph input already has it."""
    taken = set(graph.initializers) | {v.name for v in graph.inputs}
    candidate, k = name, 1
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    return candidate
