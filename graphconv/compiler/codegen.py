"""The code generator: a Program (graphconv/compiler/program_ir.py) -> the Python source of a MindSpore nn.Cell.

It names the values (from their hints: the ONNX value names), drops the nodes whose results nothing uses,
writes one statement per ONNX node (a value used once, by a later node of the same ONNX node and block, is
written inline into its user), renders If blocks, and writes each repeated layer class once (with
`@mindspore.lazy_inline` on its __init__: docs/design.md, decision 5) with a CellList of its instances.
"""

from __future__ import annotations

import inspect
import keyword
import math
import re

import numpy as np

from graphconv.compiler.program_ir import Attr, AttrValue, Body, CellClass, Node, Program, Ref, Value
from graphconv.compiler.partition import Partition, attrs_read, param_key

RESERVED = {"self", "ms", "ops", "nn", "np", "Tensor", "Parameter", "mint", "weights", "names"}


def py_name(name: str, used: set[str], fallback: str = "v") -> str:
    """A readable, unique Python identifier for an ONNX name."""
    base = re.sub(r"_output_(\d+)$", r"_\1", name)
    base = re.sub(r"\W+", "_", base).strip("_") or fallback
    if base[0].isdigit():
        base = f"{fallback}_{base}"
    if keyword.iskeyword(base) or base in RESERVED or base.startswith("__"):
        base = f"{fallback}_{base}"
    base = base[:60]
    candidate, k = base, 1
    while candidate in used:
        k += 1
        candidate = f"{base}_{k}"
    used.add(candidate)
    return candidate


def literal(value) -> str:
    """Python source for a literal argument."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, (int, np.integer)):
        return repr(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else '-float("inf")'
        return repr(v)
    if value is Ellipsis:
        return "..."
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a literal")


def _np_literal(value: np.ndarray) -> str:
    if value.dtype.kind == "f" and value.dtype.itemsize < 4 or value.dtype.name == "bfloat16":
        value = value.astype(np.float32)  # cast back to the right MindSpore dtype by Tensor(..., dtype)
    if value.size == 0:  # (a list literal would lose the shape: [] for (0, 1))
        return f"np.zeros({value.shape!r}, dtype={value.dtype.name!r})"
    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
        body = repr(value.tolist()).replace("inf", "np.inf").replace("nan", "np.nan")
        return f"np.array({body}, dtype={value.dtype.name!r})"
    return f"np.array({value.tolist()!r}, dtype={value.dtype.name!r})"


def _uses(block: Body, counts: dict[int, int]) -> None:
    for node in block.nodes:
        for v in node.inputs():
            counts[id(v)] = counts.get(id(v), 0) + 1
        for b in node.blocks:
            _uses(b, counts)  # (a branch's outputs are counted as its uses)
    for v in block.outputs:
        counts[id(v)] = counts.get(id(v), 0) + 1


def eliminate_dead(block: Body) -> None:
    """Drop nodes whose outputs nothing uses (every node is pure), innermost blocks included."""
    while True:
        counts: dict[int, int] = {}
        _uses(block, counts)
        removed = _drop_unused(block, counts)
        if not removed:
            return


def _drop_unused(block: Body, counts: dict[int, int]) -> bool:
    keep, removed = [], False
    for node in block.nodes:
        if not any(counts.get(id(o)) for o in node.outputs):
            removed = True
            continue
        for b in node.blocks:
            removed |= _drop_unused(b, counts)
        keep.append(node)
    block.nodes = keep
    return removed


class _Writer:
    """Renders one construct body (a namespace of its own)."""

    def __init__(self, inputs: list[Value], counts: dict[int, int], used: set[str] | None = None):
        self.counts = counts
        self.used = set(used or ())
        self.names: dict[int, str] = {}
        self.inline: dict[int, str] = {}  # value id -> its expression, for values written into their user
        self.lines: list[str] = []
        self.args = [self.name(v, "x") for v in inputs]

    def name(self, v: Value, fallback: str = "v") -> str:
        if id(v) not in self.names:
            hint = v.hint or (f"{v.producer.origin}_t" if v.producer is not None and v.producer.origin else fallback)
            self.names[id(v)] = py_name(hint, self.used, fallback)
        return self.names[id(v)]

    # --- expressions ------------------------------------------------------------------------------------
    def expr(self, v, operand: bool = False) -> str:
        """`operand`: the expression is an operand of an operator, subscript or attribute access."""
        if isinstance(v, Ref):
            return v.code
        if isinstance(v, AttrValue):
            return f"self.{v.attr.name}"
        if isinstance(v, Value):
            if id(v) in self.inline:
                text, compound = self.inline[id(v)]
                return f"({text})" if operand and compound else text
            return self.name(v)
        if isinstance(v, tuple):
            items = ", ".join(self.expr(x) for x in v)
            return f"({items},)" if len(v) == 1 else f"({items})"
        if isinstance(v, list):
            return "[" + ", ".join(self.expr(x) for x in v) + "]"
        text = literal(v)
        return f"({text})" if operand and text.startswith("-") else text  # x - (-3.75), (-0.75) ** 2

    def _index(self, index) -> str:
        if isinstance(index, slice):
            parts = ["" if p is None else self.expr(p) for p in (index.start, index.stop, index.step)]
            return ":".join(parts[:2]) + (f":{parts[2]}" if index.step is not None else "")
        if isinstance(index, tuple):
            return ", ".join(self._index(i) for i in index) + ("," if len(index) == 1 else "")
        return self.expr(index)

    def _call_args(self, args, kwargs) -> str:
        parts = [self.expr(a) for a in args] + [f"{k}={self.expr(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def node_expr(self, node: Node) -> tuple[str, bool]:
        """(source, whether it is compound: needs parentheses as an operand)."""
        k, a = node.kind, node.args
        if k == "call":
            target = self.expr(node.target, True) if isinstance(node.target, Value) else node.target
            return f"{target}({self._call_args(a, node.kwargs)})", False
        if k == "method":
            return f"{self.expr(a[0], True)}.{node.target}({self._call_args(a[1:], node.kwargs)})", False
        if k == "binop":
            return f"{self.expr(a[0], True)} {node.target} {self.expr(a[1], True)}", True
        if k == "unop":
            sep = " " if node.target == "not" else ""
            return f"{node.target}{sep}{self.expr(a[0], True)}", True
        if k == "getitem":
            return f"{self.expr(a[0], True)}[{self._index(a[1])}]", False
        if k == "tuple":
            return self.expr(tuple(a)), False
        if k == "cell":
            return f"{node.target}({self._call_args(a, node.kwargs)})", False
        raise ValueError(f"node kind {k} has no expression")

    # --- statements -------------------------------------------------------------------------------------
    def block(self, block: Body, indent: str, users: dict[int, Node]) -> None:
        for node in block.nodes:
            if node.kind == "if":
                self._if(node, indent, users)
                continue
            text, compound = self.node_expr(node)
            out = node.outputs[0]
            user = users.get(id(out))
            if (node.n_outputs == 1 and self.counts.get(id(out)) == 1 and user is not None
                    and user.origin == node.origin and user.kind not in ("if",) and node.origin):
                self.inline[id(out)] = (text, compound)
                continue
            targets = ", ".join(self.name(o) if self.counts.get(id(o)) else "_" for o in node.outputs)
            self.lines.append(f"{indent}{targets} = {text}")

    def _if(self, node: Node, indent: str, users: dict[int, Node]) -> None:
        names = [self.name(o) for o in node.outputs]
        self.lines.append(f"{indent}if {self.expr(node.args[0])}:")
        for k, branch in enumerate(node.blocks):
            if k == 1:
                self.lines.append(f"{indent}else:")
            made = {id(o) for n in branch.nodes for o in n.outputs}
            for name, v in zip(names, branch.outputs):  # a branch result made for it takes the If's name
                if id(v) in made and self.counts.get(id(v)) == 1 and id(v) not in self.names:
                    self.names[id(v)] = name
            start = len(self.lines)
            self.block(branch, indent + "    ", users)
            for name, v in zip(names, branch.outputs):
                if self.expr(v) != name:
                    self.lines.append(f"{indent}    {name} = {self.expr(v)}")
            if len(self.lines) == start:
                self.lines.append(f"{indent}    pass")

    def ret(self, outputs: list[Value], indent: str, as_tuple: bool = False) -> None:
        outs = [self.expr(v) for v in outputs]
        one = len(outs) == 1 and not as_tuple
        self.lines.append(f"{indent}return {outs[0] if one else '(' + ', '.join(outs) + ',)'}")


def _users(block: Body, found: dict[int, Node]) -> dict[int, Node]:
    """The (last) user of each value, for the inlining rule (which only inlines values used once)."""
    for node in block.nodes:
        for v in node.inputs():
            found[id(v)] = node
        for b in node.blocks:
            _users(b, found)
    return found


def _construct(block: Body, as_tuple: bool = False) -> _Writer:
    eliminate_dead(block)
    counts: dict[int, int] = {}
    _uses(block, counts)
    w = _Writer(block.inputs, counts)
    w.block(block, "        ", _users(block, {}))
    w.ret(block.outputs, "        ", as_tuple)
    return w


def _ms_dtype(dtype: str) -> str:
    return {"bool": "ms.bool_"}.get(dtype, f"ms.{dtype}")


def _attr_line(a: Attr, name_expr: str | None = None) -> str:
    """`self.<attr> = ...` in __init__; `name_expr` the source of the weights key (a layer's names[k])."""
    key = name_expr or repr(param_key(a))
    if a.param is not None:
        p = a.param
        return (f"self.{a.name} = _param(weights, {key}, {tuple(p.shape)!r}, {_ms_dtype(p.dtype)}"
                f"{', transposed=True' if p.transposed else ''})")
    if a.as_parameter:
        return f"self.{a.name} = _param(weights, {key}, {tuple(a.shape)!r}, {_ms_dtype(a.dtype)})"
    return f"self.{a.name} = Tensor({_np_literal(a.value)}, {_ms_dtype(a.dtype)})"


def _module_head(program: Program, helper_module, title: str, lazy_inline: bool) -> list[str]:
    """Imports, the helpers the program uses and its layer classes."""
    parts = [
        f'"""{title}"""',
        "import numpy as np",
        "import mindspore as ms",
        "from mindspore import Parameter, Tensor, nn, ops",
        "from mindspore.common.initializer import Zero, initializer",
        "",
        "",
        inspect.getsource(helper_module._param_value).rstrip(),
        "",
        "",
        inspect.getsource(helper_module._param).rstrip(),
    ]
    for h in program.helpers:
        parts += ["", "", inspect.getsource(getattr(helper_module, h)).rstrip()]
    if program.cells:
        parts += ["", "", "# @mindspore.lazy_inline on a layer class's __init__ compiles the layer once for all its "
                          "instances;",
                  "# MindSpore 2.10 on CPU then runs the network from its MindIR only: False runs this Cell directly.",
                  f"LAZY_INLINE = {bool(lazy_inline)}"]
    for cell in program.cells:
        parts += ["", ""] + _cell_class(cell)
    return parts


def render(program: Program, helper_module, lazy_inline: bool = True) -> str:
    """The generated module: imports, the helpers used, each layer class, then the network class.
    lazy_inline: the layer classes' __init__ gets @mindspore.lazy_inline (each layer compiles once: the
    export's graph compile stays flat in depth); MindSpore 2.10 then runs the network only from its MindIR
    (GraphCell) on CPU, not directly, so a network run directly (the cpu twin) is written without it."""
    parts = _module_head(program, helper_module, f"MindSpore network generated by graphconv: {program.class_name}.",
                         lazy_inline)
    # auto_prefix=False everywhere: MindSpore otherwise renames a sub-cell's Parameters after its attribute
    # path (`layers.0.w`), and the Parameters carry the model's own names.
    parts += ["", "", f"class {program.class_name}(nn.Cell):", "    def __init__(self, weights=None):",
              "        super().__init__(auto_prefix=False)"]
    parts += [f"        {_attr_line(a)}" for a in program.attrs]
    for cell, attr, per_instance in program.instances:
        rows = []
        for attrs in per_instance:
            rows.append(f"            {cell.name}(weights, {tuple(param_key(a) for a in attrs)!r}),")
        parts += [f"        self.{attr} = nn.CellList(["] + rows + ["        ], auto_prefix=False)"]
    w = _construct(program.body)
    parts += ["", f"    def construct(self, {', '.join(w.args)}):"] + w.lines
    return "\n".join(parts) + "\n"


def _cell_class(cell: CellClass) -> list[str]:
    """class <name>(nn.Cell) with __init__(weights, names): attribute k is bound from weights[names[k]] (a
    Parameter of that name); constant tensors are the same in every instance."""
    lines = [f"class {cell.name}(nn.Cell):"]
    lines += ["    def __init__(self, weights, names):", "        super().__init__(auto_prefix=False)"]
    for k, a in enumerate(cell.attrs):
        lines.append(f"        {_attr_line(a, f'names[{k}]')}")
    w = _construct(cell.body)
    lines += ["", f"    def construct(self, {', '.join(w.args)}):"] + w.lines
    if cell.lazy_inline:
        lines += ["", "", "if LAZY_INLINE:", f"    {cell.name}.__init__ = ms.lazy_inline({cell.name}.__init__)"]
    return lines


def render_blocks(program: Program, part: Partition, helper_module) -> str:
    """The partition's blocks as Cells of their own, `_Block<k>` for block k (graphconv/compiler/partition.py):
    each binds only the weights its nodes read (a layer block: one instance of its layer class, with that
    layer's weights), takes the values it reads and returns, as a tuple, the values it passes on. Run one
    after the other they compute the network's outputs, with the same statements on the same kernels. The
    layer classes are written without lazy_inline: blocks run directly."""
    parts = _module_head(program, helper_module, f"The blocks of {program.class_name}, generated by graphconv.",
                         lazy_inline=False)
    instances = {attr: (cell, rows) for cell, attr, rows in program.instances}
    for k, b in enumerate(part.blocks):
        lines = [f"class _Block{k}(nn.Cell):", "    def __init__(self, weights):",
                 "        super().__init__(auto_prefix=False)"]
        nodes = b.nodes
        if b.instance is not None:
            attr, index = b.instance
            cell, rows = instances[attr]
            lines.append(f"        self.layer = {cell.name}(weights, {tuple(param_key(a) for a in rows[index])!r})")
            call = b.nodes[0]
            nodes = [Node("cell", "self.layer", call.args, call.kwargs, n_outputs=call.n_outputs, origin=call.origin,
                          outputs=call.outputs)]
        else:
            lines += [f"        {_attr_line(a)}" for a in attrs_read(nodes + [Node("tuple", None, tuple(b.outputs))])]
        w = _construct(Body(list(b.inputs), list(nodes), list(b.outputs)), as_tuple=True)
        construct = f"    def construct(self, {', '.join(w.args)}):" if w.args else "    def construct(self):"
        lines += ["", construct] + w.lines
        parts += ["", ""] + lines
    return "\n".join(parts) + "\n"
