"""The program IR: the MindSpore program the lowering builds, before it is source text.

Modelled on torch.fx: a program is a graph of calls on values. opmap handlers build nodes through their
NodeContext (`n.call("ops.rms_norm", x, gamma, eps)` returns a Value); graphconv/compiler/codegen.py names the
values, drops dead ones, renders nested blocks (If) and groups repeated layers into one Cell class.

  Value   an input of `construct` (or of a block), an output of a Node, a Cell attribute (a Parameter or a
          constant tensor made in __init__: `Attr`), or a `Ref` (a name the generated module defines:
          `ms.float16`, a helper function).
  Node    one operation: a call `target(*args, **kwargs)`, a method call `args[0].target(...)`, an infix
          or prefix operator, a subscript, a tuple, or an `If` with two Blocks. Arguments are Values or
          Python literals (int, float, bool, None, str, and tuples/lists/slices of them).
  Body   nodes in order, with the block's inputs and outputs (the program body; a branch of an If; one
          layer of a repeated structure).
Nothing here imports the lowering or opmap (graphconv/compiler/node_context.py is the handlers' view of it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np


class Value:
    """A value of the emitted program. `hint` is the name the code generator starts from; `onnx_name` the ONNX
    value it holds, set by the lowering (None for values the lowering made on the way): the block-by-block
    verification compares a block's outputs with onnxruntime's values of these names."""

    __slots__ = ("producer", "index", "hint", "onnx_name", "__weakref__")

    def __init__(self, producer: "Node | None" = None, index: int = 0, hint: str | None = None,
                 onnx_name: str | None = None):
        self.producer, self.index, self.hint, self.onnx_name = producer, index, hint, onnx_name

    def __repr__(self) -> str:
        what = self.producer.target if self.producer is not None else "input"
        return f"Value({self.hint or '?'} <- {what})"


class Ref(Value):
    """A name of the generated module, rendered verbatim: `ms.float16`, `ops.dyn_shape`, a helper."""

    __slots__ = ("code",)

    def __init__(self, code: str):
        super().__init__(None, 0, code)
        self.code = code

    def __repr__(self) -> str:
        return f"Ref({self.code})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Ref) and other.code == self.code

    def __hash__(self) -> int:
        return hash(("Ref", self.code))


@dataclasses.dataclass
class Attr:
    """A Cell attribute made in __init__: a Parameter bound from the weights (`param` set) or a constant
    tensor (`value` set; large ones are Parameters too, bound by attribute name)."""

    name: str  # the attribute on the Cell
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    param: Any = None  # graphconv.compiler.lowering.ParamSpec for a weight
    value: np.ndarray | None = None  # the constant, for a constant tensor
    as_parameter: bool = False  # a constant too big for a literal: a Parameter named after the attribute


class AttrValue(Value):
    """`self.<attr.name>` in construct."""

    __slots__ = ("attr",)

    def __init__(self, attr: Attr):
        super().__init__(None, 0, attr.name)
        self.attr = attr

    def __repr__(self) -> str:
        return f"AttrValue(self.{self.attr.name})"


KINDS = ("call", "method", "binop", "unop", "getitem", "tuple", "if", "cell")
BINARY_OPERATORS = {"+", "-", "*", "/", "//", "%", "**", "@", "<", "<=", ">", ">=", "==", "!=", "&", "|", "^",
                    "and", "or"}
UNARY_OPERATORS = {"-", "~", "not"}


@dataclasses.dataclass(eq=False)
class Node:
    kind: str
    target: Any  # call: a dotted name or a Ref; method: the method name; binop/unop: the operator; cell: name
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    n_outputs: int = 1
    origin: str = ""  # the ONNX node this came from (readability: inlining stays within one ONNX node)
    blocks: tuple["Body", ...] = ()  # an If's then and else blocks
    outputs: list[Value] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown node kind {self.kind!r}")
        if self.kind == "binop" and self.target not in BINARY_OPERATORS:
            raise ValueError(f"unknown binary operator {self.target!r}")
        if self.kind == "unop" and self.target not in UNARY_OPERATORS:
            raise ValueError(f"unknown unary operator {self.target!r}")
        if not self.outputs:
            self.outputs = [Value(self, k) for k in range(self.n_outputs)]

    def inputs(self) -> Iterator[Value]:
        """Every Value among the arguments (nested in tuples, lists and slices too), and a called value
        (`ops.LayerNorm(-1, -1, eps)(x, g, b)`: the primitive made by an earlier call)."""
        if isinstance(self.target, Value) and not isinstance(self.target, Ref):
            yield self.target
        yield from _values(self.args)
        yield from _values(tuple(self.kwargs.values()))


def _values(items) -> Iterator[Value]:
    for a in items:
        if isinstance(a, Value):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _values(a)
        elif isinstance(a, slice):
            yield from _values((a.start, a.stop, a.step))


@dataclasses.dataclass(eq=False)
class Body:
    inputs: list[Value] = dataclasses.field(default_factory=list)
    nodes: list[Node] = dataclasses.field(default_factory=list)
    outputs: list[Value] = dataclasses.field(default_factory=list)

    def walk(self) -> Iterator[Node]:
        """Every node, nested blocks' included."""
        for node in self.nodes:
            yield node
            for b in node.blocks:
                yield from b.walk()


@dataclasses.dataclass(eq=False)
class CellClass:
    """A repeated layer: one class whose construct is `body`; each instance gets its own attributes."""

    name: str
    body: Body
    attrs: list[Attr]  # the first instance's (the others have the same shapes and dtypes)
    lazy_inline: bool = True


@dataclasses.dataclass(eq=False)
class Program:
    """One nn.Cell: construct(*body.inputs) -> body.outputs, its attributes, the helpers it uses, and the
    layer classes its `cell` nodes call."""

    class_name: str
    body: Body
    attrs: list[Attr] = dataclasses.field(default_factory=list)
    helpers: list[str] = dataclasses.field(default_factory=list)
    # the instances of each cell class: (class, attribute name of the CellList, per-instance attributes)
    instances: list[tuple[CellClass, str, list[list[Attr]]]] = dataclasses.field(default_factory=list)

    @property
    def cells(self) -> list[CellClass]:
        return [cell for cell, _, _ in self.instances]

    def calls(self, target: str) -> list[Node]:
        """Every call node with this target (tests read the IR through this, not the source)."""
        found = [n for n in self.body.walk() if n.kind == "call" and _target_code(n.target) == target]
        for cell in self.cells:
            found += [n for n in cell.body.walk() if n.kind == "call" and _target_code(n.target) == target]
        return found


def _target_code(target) -> str:
    return target.code if isinstance(target, Ref) else str(target)


class Builder:
    """Appends nodes to the current block; `block()` opens a nested one (an If's branch, a layer)."""

    def __init__(self, body: Body):
        self._stack = [body]
        self.origin = ""

    @property
    def current(self) -> Body:
        return self._stack[-1]

    def add(self, node: Node) -> Node:
        node.origin = node.origin or self.origin
        self.current.nodes.append(node)
        return node

    def call(self, target, *args, **kwargs) -> Value:
        return self.add(Node("call", target, args, kwargs)).outputs[0]

    def call_n(self, target, n_outputs: int, *args, **kwargs) -> tuple[Value, ...]:
        if n_outputs == 1:  # `a = f(...)` would bind the 1-tuple itself: take its item instead
            return (self.getitem(self.call(target, *args, **kwargs), 0),)
        return tuple(self.add(Node("call", target, args, kwargs, n_outputs=n_outputs)).outputs)

    def method(self, value: Value, name: str, *args, **kwargs) -> Value:
        return self.add(Node("method", name, (value, *args), kwargs)).outputs[0]

    def binop(self, op: str, a, b) -> Value:
        return self.add(Node("binop", op, (a, b))).outputs[0]

    def unop(self, op: str, a) -> Value:
        return self.add(Node("unop", op, (a,))).outputs[0]

    def getitem(self, value: Value, index) -> Value:
        return self.add(Node("getitem", None, (value, index))).outputs[0]

    def tuple(self, *items) -> Value:
        return self.add(Node("tuple", None, items)).outputs[0]

    def if_(self, cond: Value, then: Body, orelse: Body) -> tuple[Value, ...]:
        if len(then.outputs) != len(orelse.outputs):
            raise ValueError("an If's branches must give the same number of outputs")
        return tuple(self.add(Node("if", None, (cond,), n_outputs=len(then.outputs), blocks=(then, orelse))).outputs)

    def block(self) -> "_Nested":
        return _Nested(self)


class _Nested:
    def __init__(self, builder: Builder):
        self.builder, self.block = builder, Body()

    def __enter__(self) -> Body:
        self.builder._stack.append(self.block)
        return self.block

    def __exit__(self, *exc) -> None:
        self.builder._stack.pop()
