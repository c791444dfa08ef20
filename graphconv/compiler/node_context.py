"""What an opmap handler sees of the lowering: one ONNX node, its operands, and a program builder.

A handler (opmap/registry.py) gets a NodeContext `n` and returns, per output, an emission Value
(graphconv/compiler/program_ir.py) built through `n.call(...)`, `n.binop(...)`, ... or a numpy array (the output is a
compile-time constant). This module sits below both graphconv/compiler/lowering.py (which implements `Scope`)
and opmap/: neither imports the other's internals, and control flow lowers its sub-graphs through `lower_subgraph`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir

from graphconv.compiler.program_ir import AttrValue, Body, Builder, Ref, Value
from graphconv.errors import UnsupportedError

MS_DTYPES = {
    ir.DataType.FLOAT: "ms.float32", ir.DataType.FLOAT16: "ms.float16", ir.DataType.BFLOAT16: "ms.bfloat16",
    ir.DataType.DOUBLE: "ms.float64", ir.DataType.INT8: "ms.int8", ir.DataType.INT16: "ms.int16",
    ir.DataType.INT32: "ms.int32", ir.DataType.INT64: "ms.int64", ir.DataType.UINT8: "ms.uint8",
    ir.DataType.UINT16: "ms.uint16", ir.DataType.UINT32: "ms.uint32", ir.DataType.UINT64: "ms.uint64",
    ir.DataType.BOOL: "ms.bool_", ir.DataType.COMPLEX64: "ms.complex64", ir.DataType.COMPLEX128: "ms.complex128",
}


@dataclasses.dataclass
class Operand:
    """What the lowering knows about one ONNX value."""

    value: Value | None  # the program value (None until materialised, for constants)
    const: np.ndarray | None = None  # its value, when known at compile time
    initializer: ir.Value | None = None  # the ONNX initializer, for Parameters


class Scope(Protocol):
    """The lowering, as the handlers' context needs it (graphconv/compiler/lowering.py's Lowering)."""

    builder: Builder

    def value_of(self, value: ir.Value) -> Value: ...
    def const_value(self, value: ir.Value) -> np.ndarray | None: ...
    def constant(self, array: np.ndarray, hint: str) -> AttrValue: ...
    def use_helper(self, name: str) -> None: ...
    def is_dense_weight(self, value: ir.Value) -> bool: ...
    def is_qint4x2(self, value: ir.Value) -> bool: ...
    def bind(self, value: ir.Value, item: "Value | np.ndarray") -> None: ...
    def lower_graph(self, graph: ir.Graph) -> list["Value | np.ndarray"]: ...


def scalar_literal(value: np.ndarray) -> int | float | None:
    """A Python number for a finite 0-d int or float, else None."""
    if value.ndim != 0:
        return None
    if value.dtype.kind in "iu":
        return int(value)
    if value.dtype.kind == "f" and np.isfinite(value):
        return float(value)
    return None


def _all_nan_constant(v) -> bool:
    """A float literal NaN, or a constant tensor (not a Parameter) of float32/64 whose every element is NaN."""
    if isinstance(v, float):
        return v != v
    if isinstance(v, AttrValue) and v.attr.value is not None and not v.attr.as_parameter:
        arr = v.attr.value
        return arr.dtype.kind == "f" and arr.dtype.itemsize >= 4 and arr.size > 0 and bool(np.isnan(arr).all())
    return False


class NodeContext:
    """The view of one node that an opmap handler gets."""

    def __init__(self, scope: Scope, node: ir.Node, opset: int):
        self._scope = scope
        self.node = node
        self.opset = opset

    # --- inputs -------------------------------------------------------------------------------------
    @property
    def n_inputs(self) -> int:
        return len(self.node.inputs)

    @property
    def n_outputs(self) -> int:
        return len(self.node.outputs)

    def has(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None and self.node.inputs[i].name != ""

    def x(self, i: int) -> Value | None:
        """Input i as a tensor value (None when the optional input is absent)."""
        if not self.has(i):
            return None
        return self._scope.value_of(self.node.inputs[i])

    def xs(self) -> list[Value]:
        return [self.x(i) for i in range(self.n_inputs) if self.has(i)]

    def operand(self, i: int) -> Value | int | float:
        """Input i as a Python number when it is a finite 0-d constant, else as a tensor value. For
        elementwise ops, where a scalar broadcasts like a 0-d tensor."""
        c = self.const(i)
        if c is not None:
            lit = scalar_literal(c)
            if lit is not None:
                return lit
        return self.x(i)

    def is_dense_weight(self, i: int) -> bool:
        """Input i is an initializer stored transposed for ops.dense (lower.dense_weights)."""
        return self.has(i) and self._scope.is_dense_weight(self.node.inputs[i])

    def qint4x2(self, i: int) -> bool:
        """Input i is an int8 initializer bound as a qint4x2 Parameter (lowering.qint4x2_weights)."""
        return self.has(i) and self._scope.is_qint4x2(self.node.inputs[i])

    def const(self, i: int) -> np.ndarray | None:
        if not self.has(i):
            return None
        return self._scope.const_value(self.node.inputs[i])

    def ints(self, i: int) -> list[int] | None:
        c = self.const(i)
        return None if c is None else [int(v) for v in np.asarray(c).reshape(-1)]

    def require_ints(self, i: int, what: str) -> list[int]:
        v = self.ints(i)
        if v is None:
            self.fail(f"{what} must be a constant")
        return v

    def dtype(self, i: int) -> ir.DataType | None:
        v = self.node.inputs[i] if self.has(i) else None
        return v.dtype if v is not None else None

    def out_dtype(self, j: int = 0) -> ir.DataType | None:
        return self.node.outputs[j].dtype

    def shape(self, i: int) -> list | None:
        """Static shape of input i: ints for known dims, str/None for symbolic ones; None if rank unknown."""
        v = self.node.inputs[i] if self.has(i) else None
        if v is None:
            return None
        c = self._scope.const_value(v)
        if c is not None:
            return list(c.shape)
        if v.shape is None:
            return None
        return [d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in v.shape]

    def out_shape(self, j: int = 0) -> list | None:
        v = self.node.outputs[j]
        if v.shape is None:
            return None
        return [d if isinstance(d, int) else None for d in v.shape]

    def rank(self, i: int) -> int | None:
        s = self.shape(i)
        return None if s is None else len(s)

    def require_rank(self, i: int) -> int:
        r = self.rank(i)
        if r is None:
            self.fail(f"the rank of input {i} is unknown (shape inference could not determine it)")
        return r

    # --- attributes ---------------------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        a = self.node.attributes.get(name)
        if a is None:
            return default
        if a.type == ir.AttributeType.TENSOR:
            return a.value.numpy()
        if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return a.value
        v = a.value
        return list(v) if isinstance(v, (tuple, list)) else v

    def ints_attr(self, name: str, length: int, minimum: int, default: int | None = None) -> list[int] | None:
        """An ints attribute checked against the op's contract: `length` values, each >= `minimum` (strides,
        dilations, kernel_shape, pads of the convolutions and pools). Absent: `default` repeated, or None."""
        value = self.attr(name)
        if not value:  # absent (or empty, which onnxruntime reads as absent too)
            return None if default is None else [default] * length
        value = list(value)
        if len(value) != length or any(int(v) < minimum for v in value):
            self.fail(f"{name} {value} must be {length} integers >= {minimum}")
        return [int(v) for v in value]

    def fail(self, message: str):
        raise UnsupportedError(f"node {self.node.name!r} ({self.node.op_type}): {message}")

    def axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < max(rank, 1):
            self.fail(f"axis {axis} is out of range for rank {rank}")
        return axis + rank if axis < 0 else axis

    # --- building the program -----------------------------------------------------------------------
    @property
    def _b(self) -> Builder:
        return self._scope.builder

    def ms_dtype(self, dtype: ir.DataType | int) -> Ref:
        dtype = ir.DataType(dtype)
        if dtype not in MS_DTYPES:
            self.fail(f"dtype {dtype.name} has no MindSpore equivalent")
        return Ref(MS_DTYPES[dtype])

    def helper(self, name: str) -> Ref:
        """A function from opmap.helpers, copied into the generated module: use it as a call target."""
        self._scope.use_helper(name)
        return Ref(name)

    def const_tensor(self, value: np.ndarray, hint: str = "c") -> AttrValue:
        """A constant tensor made in __init__."""
        return self._scope.constant(np.asarray(value), hint)

    def call(self, target: str | Ref, *args, **kwargs) -> Value:
        """`target(*args, **kwargs)`: target a dotted name (`ops.cast`) or a Ref."""
        return self._b.call(target, *args, **kwargs)

    def call_n(self, target: str | Ref, n_outputs: int, *args, **kwargs) -> tuple[Value, ...]:
        """A call returning a tuple of n_outputs values."""
        return self._b.call_n(target, n_outputs, *args, **kwargs)

    def method(self, value: Value, name: str, *args, **kwargs) -> Value:
        """`value.name(*args, **kwargs)`."""
        return self._b.method(value, name, *args, **kwargs)

    def binop(self, op: str, a, b) -> Value:
        """`a op b` (a Python operator: + - * / // % ** @, comparisons, & | ^)."""
        if op in ("+", "*") and (_all_nan_constant(a) or _all_nan_constant(b)):
            self.fail(f"`{op}` with a constant that is all NaN: MindSpore's graph compiler (2.10) folds x {op} NaN "
                      "into x, so the network cannot compute it")
        return self._b.binop(op, a, b)

    def unop(self, op: str, a) -> Value:
        return self._b.unop(op, a)

    def getitem(self, value: Value, index) -> Value:
        """`value[index]`: index an int, a slice, None, Ellipsis, a Value, or a tuple of those."""
        return self._b.getitem(value, index)

    def named(self, value: Value, hint: str) -> Value:
        """Name an intermediate value after this node's output: `<output>_<hint>` (readability only)."""
        base = self.node.outputs[0].name if self.node.outputs and self.node.outputs[0].name else self.node.op_type
        value.hint = f"{base}_{hint}"
        return value

    def tuple(self, *items) -> Value:
        """A Python tuple of values (an argument some ops take: ops.concat((a, b)))."""
        return self._b.tuple(*items)

    # --- sub-graphs (control flow) ------------------------------------------------------------------
    def bind(self, value: ir.Value, item: Value | np.ndarray) -> None:
        """Make a sub-graph input stand for `item` (a Value, or an array: a compile-time constant)."""
        self._scope.bind(value, item)

    def lower_subgraph(self, graph: ir.Graph) -> list[Value | np.ndarray]:
        """Lower a sub-graph's nodes into the current block; returns each output (an array when known at
        compile time)."""
        return self._scope.lower_graph(graph)

    @contextlib.contextmanager
    def block(self):
        """Build into a new Body (an If's branch): `with n.block() as blk: ...`, then `n.if_(...)`."""
        with self._b.block() as blk:
            yield blk

    def if_(self, cond: Value, then: Body, orelse: Body) -> tuple[Value, ...]:
        return self._b.if_(cond, then, orelse)
