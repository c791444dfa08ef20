"""Lower stage: an ONNX graph (onnx_ir) -> the Python source of a MindSpore nn.Cell.

Each ONNX node becomes one statement in `construct`, written by the opmap handler registered for its
(domain, op_type, opset). Values known at compile time (initializers, Constant nodes, and nodes whose inputs
are all known) are folded here; small ones become constants in `__init__`, large ones Parameters that keep
their ONNX initializer names. Symbolic dims are never resolved: shapes flow as int64 tensors at run time.
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import re
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

import opmap
from opmap import helpers as helper_lib
from graphconv.errors import UnsupportedError

# Initializers with more elements than this become Parameters (bound from the weights file at emit time);
# smaller ones are written into the source as literals.
PARAM_MIN_ELEMENTS = 64
# Constant folding at lowering time produces at most this many elements per value.
FOLD_MAX_ELEMENTS = 1 << 16
_RESERVED = {"self", "ms", "ops", "nn", "np", "Tensor", "Parameter", "mint", "weights"}

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

    expr: str | None  # Python expression in `construct` (None until materialised, for constants)
    const: np.ndarray | None = None  # value, when known at compile time
    initializer: ir.Value | None = None  # the ONNX initializer, for Parameters


@dataclasses.dataclass
class ParamSpec:
    attr: str  # attribute on the Cell (a Python identifier)
    onnx_name: str  # initializer name in the lowered graph
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    transposed: bool = False  # stored as the initializer's transpose (Linear layout, see dense_weights)
    name: str = ""  # the Parameter's name (the .ckpt key): graphconv.param_names, else onnx_name

    def __post_init__(self):
        self.name = self.name or self.onnx_name


@dataclasses.dataclass
class LoweredNetwork:
    source: str
    class_name: str
    input_names: list[str]  # ONNX graph input names, in construct's argument order
    output_names: list[str]
    params: list[ParamSpec]
    op_histogram: dict[str, int]


def py_name(name: str, used: set[str], fallback: str = "v") -> str:
    """A readable, unique Python identifier for an ONNX name."""
    base = re.sub(r"_output_(\d+)$", r"_\1", name)
    base = re.sub(r"\W+", "_", base).strip("_") or fallback
    if base[0].isdigit():
        base = f"{fallback}_{base}"
    if keyword.iskeyword(base) or base in _RESERVED or base.startswith("__"):
        base = f"{fallback}_{base}"
    base = base[:60]
    candidate, k = base, 1
    while candidate in used:
        k += 1
        candidate = f"{base}_{k}"
    used.add(candidate)
    return candidate


def _scalar_literal(value: np.ndarray) -> str | None:
    """A Python literal for a finite 0-d int or float, else None."""
    if value.ndim != 0:
        return None
    if value.dtype.kind in "iu":
        return repr(int(value))
    if value.dtype.kind == "f" and np.isfinite(value):
        return repr(float(value))
    return None


class NodeContext:
    """The view of one node that an opmap handler gets."""

    def __init__(self, lowering: "Lowering", node: ir.Node, opset: int):
        self._low = lowering
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

    def x(self, i: int) -> str | None:
        """Tensor expression for input i (None when the optional input is absent)."""
        if not self.has(i):
            return None
        return self._low.tensor_expr(self.node.inputs[i])

    def is_dense_weight(self, i: int) -> bool:
        """Input i is an initializer stored transposed for ops.dense (Lowering.dense_weights)."""
        return self.has(i) and self.node.inputs[i] in self._low.dense_weights

    def xs(self) -> list[str]:
        return [self.x(i) for i in range(self.n_inputs) if self.has(i)]

    def operand(self, i: int):
        """Input i as a Python scalar literal when it is a finite 0-d constant, else as a tensor expression.
        For elementwise ops, where a scalar broadcasts like a 0-d tensor."""
        c = self.const(i)
        if c is not None:
            lit = _scalar_literal(c)
            if lit is not None:
                return lit
        return self.x(i)

    def const(self, i: int) -> np.ndarray | None:
        if not self.has(i):
            return None
        return self._low.const_value(self.node.inputs[i])

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
        c = self._low.const_value(v)
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
            self.fail(f"attribute {name} holds a subgraph (control flow is not supported)")
        v = a.value
        return list(v) if isinstance(v, (tuple, list)) else v

    # --- code generation ----------------------------------------------------------------------------
    def ms_dtype(self, dtype: ir.DataType | int) -> str:
        dtype = ir.DataType(dtype)
        if dtype not in MS_DTYPES:
            self.fail(f"dtype {dtype.name} has no MindSpore equivalent")
        return MS_DTYPES[dtype]

    def helper(self, name: str) -> str:
        """Use a function from opmap.helpers in the generated source; returns its name."""
        self._low.use_helper(name)
        return name

    def tmp(self, expr: str, hint: str = "t") -> str:
        """Assign expr to a fresh variable (for values used more than once); returns the variable."""
        name = py_name(f"{self._low.var_prefix(self.node)}_{hint}", self._low.used_names)
        self._low.emit(f"{name} = {expr}")
        return name

    def const_tensor(self, value: np.ndarray, hint: str = "c") -> str:
        """Expression for a constant tensor created in __init__."""
        return self._low.constant_attr(np.asarray(value), hint)

    def fail(self, message: str):
        raise UnsupportedError(f"node {self.node.name!r} ({self.node.op_type}): {message}")

    def axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < max(rank, 1):
            self.fail(f"axis {axis} is out of range for rank {rank}")
        return axis + rank if axis < 0 else axis


class Lowering:
    def __init__(self, model: ir.Model, class_name: str = "Network", param_names: dict[str, str] | None = None):
        self.model = model
        # initializer name -> Parameter name (graphconv.param_names; unique); absent: the ONNX name.
        self.param_names = dict(param_names or {})
        self._taken_names = set(self.param_names.values())
        self.graph = model.graph
        self.class_name = class_name
        self.opsets = {("" if d == "ai.onnx" else d): v for d, v in model.opset_imports.items()}
        self.used_names: set[str] = set()
        self.operands: dict[ir.Value, Operand] = {}
        self.body: list[str] = []
        self.init_lines: list[str] = []
        self.params: list[ParamSpec] = []
        self.helpers: list[str] = []
        self.histogram: dict[str, int] = {}

    # --- bookkeeping --------------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.body.append(line)

    def use_helper(self, name: str) -> None:
        if name in self.helpers:
            return
        fn = getattr(helper_lib, name)
        for dep in helper_lib.dependencies(fn):
            self.use_helper(dep)
        self.helpers.append(name)

    def var_prefix(self, node: ir.Node) -> str:
        return node.outputs[0].name if node.outputs and node.outputs[0].name else node.op_type.lower()

    def constant_attr(self, value: np.ndarray, hint: str) -> str:
        attr = py_name(f"c_{hint}", self.used_names)
        while attr in self._taken_names or attr in self.graph.initializers:  # it is a Parameter name too
            attr = py_name(f"c_{hint}", self.used_names)
        dt = value.dtype
        if value.size > PARAM_MIN_ELEMENTS:
            # Folded constants too big for a literal are Parameters as well, bound by attribute name.
            self.params.append(ParamSpec(attr, attr, tuple(value.shape), _np_name(dt)))
            self._folded_params[attr] = value
            self.init_lines.append(f"self.{attr} = _param(weights, {attr!r}, {tuple(value.shape)!r}, {_ms_dt(dt)})")
        else:
            self.init_lines.append(f"self.{attr} = Tensor({_np_literal(value)}, {_ms_dt(dt)})")
        return f"self.{attr}"

    def const_value(self, value: ir.Value) -> np.ndarray | None:
        op = self.operands.get(value)
        if op is None:
            return None
        if op.const is None and op.initializer is not None and op.initializer.const_value is not None:
            op.const = op.initializer.const_value.numpy()
        return op.const

    def tensor_expr(self, value: ir.Value) -> str:
        op = self.operands.get(value)
        if op is None:
            raise UnsupportedError(f"value {value.name!r} is used before it is defined")
        if op.expr is None:
            if op.initializer is not None:
                value = op.initializer  # also when `value` aliases it (an identity Cast, see _try_fold)
                t = value.const_value
                shape = tuple(int(d) for d in t.shape)
                size = int(np.prod(shape, dtype=np.int64))
                # Weights stay Parameters under the model's names (the .ckpt and fine-tuning need them);
                # scalars and tiny integer tables (shapes, axes) are written as literals.
                if size > PARAM_MIN_ELEMENTS or (len(shape) > 0 and t.dtype.is_floating_point()):
                    name = self.param_names.get(value.name, value.name)
                    attr = py_name(name, self.used_names, "p")
                    dtype = t.dtype.numpy()
                    transposed = value in self.dense_weights
                    if transposed:
                        shape = shape[::-1]
                    self.params.append(ParamSpec(attr, value.name, shape, _np_name(dtype), transposed, name))
                    self.init_lines.append(f"self.{attr} = _param(weights, {name!r}, {shape!r}, "
                                           f"{_ms_dt(dtype)}{', transposed=True' if transposed else ''})")
                    op.expr = f"self.{attr}"
                    return op.expr
            op.expr = self.constant_attr(self.const_value(value), py_name(value.name, set(), "c"))
        return op.expr

    # --- the walk -----------------------------------------------------------------------------------
    def run(self) -> LoweredNetwork:
        self._folded_params: dict[str, np.ndarray] = {}
        args = []
        for v in self.graph.inputs:
            name = py_name(v.name, self.used_names, "x")
            args.append(name)
            self.operands[v] = Operand(expr=name)
        for v in self.graph.initializers.values():
            self.operands[v] = Operand(expr=None, initializer=v)
        self.dense_weights = dense_weights(self.graph)
        for node in self.graph:
            self.histogram[f"{node.domain + '::' if node.domain else ''}{node.op_type}"] = \
                self.histogram.get(f"{node.domain + '::' if node.domain else ''}{node.op_type}", 0) + 1
            self.lower_node(node)
        outs = [self.tensor_expr(v) for v in self.graph.outputs]
        ret = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ",)"
        self.emit(f"return {ret}")
        return LoweredNetwork(
            source=self.render(args),
            class_name=self.class_name,
            input_names=[v.name for v in self.graph.inputs],
            output_names=[v.name for v in self.graph.outputs],
            params=self.params,
            op_histogram=dict(sorted(self.histogram.items())),
        )

    def lower_node(self, node: ir.Node) -> None:
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = self.opsets.get(domain, 1)
        if node.op_type == "Constant" and domain == "":
            self._set_const(node.outputs[0], _constant_node_value(node))
            return
        if self._try_fold(node, opset):
            return
        handler = opmap.lookup(domain, node.op_type, opset)
        if handler is None:
            raise UnsupportedError(f"no lowering for {_op_label(node)} at opset {opset}")
        result = handler.fn(NodeContext(self, node, opset))
        exprs = (result,) if isinstance(result, (str, np.ndarray)) else tuple(result)
        if node.name:
            self.emit(f"# {node.name}")
        for value, expr in zip(node.outputs, exprs):
            if not value.name:
                continue
            if isinstance(expr, np.ndarray):  # the handler resolved the output at compile time
                self._set_const(value, expr)
                continue
            var = py_name(value.name, self.used_names)
            self.emit(f"{var} = {expr}")
            self.operands[value] = Operand(expr=var)
        for value in node.outputs[len(exprs):]:
            if value.name and (value.uses() or value.is_graph_output()):
                raise UnsupportedError(f"node {node.name!r} ({node.op_type}): output {len(exprs)} is not supported")

    def _set_const(self, value: ir.Value, array: np.ndarray) -> None:
        self.operands[value] = Operand(expr=None, const=np.asarray(array))

    def _try_fold(self, node: ir.Node, opset: int) -> bool:
        """Evaluate a node whose inputs are all compile-time constants (shape arithmetic, mostly)."""
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD or _has_subgraph(node):
            return False
        if _is_identity(node) and node.inputs[0] is not None:
            src = self.operands.get(node.inputs[0])
            if src is not None and src.initializer is not None:
                # Identity / same-dtype Cast of a weight (the RmsNorm body's gamma): the same Parameter,
                # under its own name, rather than an anonymous folded copy.
                self.operands[node.outputs[0]] = src
                return True
        for v in node.inputs:
            op = self.operands.get(v) if v is not None and v.name else None
            if op is None or op.initializer is None or v.const_value is None:
                continue
            size = int(np.prod([int(d) for d in v.const_value.shape], dtype=np.int64))
            # Checked before reading any weight: too big to fold, or a weight that other nodes read too
            # (folding Transpose(tied embedding) would store the weight twice).
            if size > FOLD_MAX_ELEMENTS or (size > PARAM_MIN_ELEMENTS and len(v.uses()) > 1):
                return False
        ins = []
        for v in node.inputs:
            if v is None or not v.name:
                ins.append(None)
                continue
            c = self.const_value(v)
            if c is None:
                return False
            ins.append(c)
        if any(c is not None and c.size > FOLD_MAX_ELEMENTS for c in ins):
            return False
        if not any(c is not None for c in ins) and node.op_type not in ("ConstantOfShape", "Range"):
            return False
        outs = _evaluate(node, ins, opset)
        if outs is None or any(o.size > FOLD_MAX_ELEMENTS for o in outs):
            return False
        for value, arr in zip(node.outputs, outs):
            self._set_const(value, arr)
        return True

    def render(self, args: list[str]) -> str:
        parts = [
            f'"""MindSpore network generated by graphconv from {self.graph.name or "an ONNX graph"}."""',
            "import numpy as np",
            "import mindspore as ms",
            "from mindspore import Parameter, Tensor, nn, ops",
            "",
            "",
            inspect.getsource(helper_lib._param).rstrip(),
        ]
        for h in self.helpers:
            parts += ["", "", inspect.getsource(getattr(helper_lib, h)).rstrip()]
        parts += ["", "", f"class {self.class_name}(nn.Cell):",
                  "    def __init__(self, weights=None):",
                  "        super().__init__()"]
        parts += [f"        {line}" for line in self.init_lines]
        parts += ["", f"    def construct(self, {', '.join(args)}):"]
        parts += [f"        {line}" for line in self.body]
        return "\n".join(parts) + "\n"


# Ops never folded at compile time: random or stateful.
_NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}


def _evaluate(node: ir.Node, inputs: list, opset: int) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    in_names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    out_names = [f"o{k}" for k in range(len(node.outputs))]
    proto = onnx.helper.make_node(node.op_type, in_names, out_names, domain=node.domain)
    for attr in node.attributes.values():
        proto.attribute.append(ir.serde.serialize_attribute(attr))
    graph = onnx.helper.make_graph(
        [proto], "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in zip(in_names, inputs) if a is not None],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in out_names])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        ev = ReferenceEvaluator(model)
        outs = ev.run(None, {n: a for n, a in zip(in_names, inputs) if a is not None})
    except Exception:  # noqa: BLE001 - not foldable: the handler lowers it at run time instead
        return None
    return [np.asarray(o) for o in outs]


def _is_identity(node: ir.Node) -> bool:
    if node.op_type == "Identity" and len(node.inputs) == 1:
        return True
    if node.op_type == "Cast" and len(node.inputs) == 1 and node.inputs[0] is not None:
        to = node.attributes.get("to")
        return to is not None and node.inputs[0].dtype is not None and ir.DataType(to.value) == node.inputs[0].dtype
    return False


def _constant_node_value(node: ir.Node) -> np.ndarray:
    (name, attr), = node.attributes.items()
    if name == "value":
        return attr.value.numpy()
    if name in ("value_float", "value_int"):
        return np.array(attr.value, dtype=np.float32 if name == "value_float" else np.int64)
    if name in ("value_floats", "value_ints"):
        return np.array(list(attr.value), dtype=np.float32 if name == "value_floats" else np.int64)
    raise UnsupportedError(f"Constant node {node.name!r} with attribute {name} is not supported")


def _op_label(node: ir.Node) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _np_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def _ms_dt(dtype: np.dtype) -> str:
    return MS_DTYPES[ir.DataType.from_numpy(np.dtype(dtype))]


def _np_literal(value: np.ndarray) -> str:
    if value.dtype.kind == "f" and value.dtype.itemsize < 4 or value.dtype.name == "bfloat16":
        value = value.astype(np.float32)  # cast back to the right MindSpore dtype by Tensor(..., dtype)
    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
        body = repr(value.tolist()).replace("inf", "np.inf").replace("nan", "np.nan")
        return f"np.array({body}, dtype={value.dtype.name!r})"
    return f"np.array({value.tolist()!r}, dtype={value.dtype.name!r})"


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Every op of the model (main graph and functions) that opmap cannot lower, as 'domain::Op (opset N)'."""
    opsets = {("" if i.domain == "ai.onnx" else i.domain): i.version for i in model.opset_import}
    local_functions = {(f.domain, f.name) for f in model.functions}
    missing = set()

    def visit(nodes):
        for n in nodes:
            domain = "" if n.domain == "ai.onnx" else n.domain
            if (n.domain, n.op_type) in local_functions:
                continue
            if n.op_type == "Constant" and domain == "":
                continue
            if opmap.lookup(domain, n.op_type, opsets.get(domain, 1)) is None:
                label = f"{domain}::{n.op_type}" if domain else n.op_type
                missing.add(f"{label} (opset {opsets.get(domain, '?')})" if domain in opsets else
                            f"{label} (domain {domain!r} is not imported)")

    visit(model.graph.node)
    for f in model.functions:
        visit(f.node)
    return sorted(missing)


def dense_weights(graph: ir.Graph) -> set[ir.Value]:
    """2-D float initializers read only as the weight (input 1) of MatMuls whose data has rank >= 2: they are
    stored transposed, in Linear's [out, in] layout, and those MatMuls lower to ops.dense (x @ w.T).

    Why: MindSpore 2.10's ops.matmul of an N-d input by a 2-d weight broadcasts the weight over the batch,
    and its CPU kernel keeps packed copies: running a 0.4 GB Llama at two shapes took 5 GB; ops.dense reads
    the [out, in] weight as is (measured: 8 weights of 16 MB, +900 MB with ops.matmul, +23 MB with dense).
    """
    picked = set()
    for v in graph.initializers.values():
        t = v.const_value
        if (t is None or len(t.shape) != 2 or not t.dtype.is_floating_point() or t.size <= PARAM_MIN_ELEMENTS
                or v.is_graph_output()):
            continue
        uses = list(v.uses())
        if uses and all(u.node.op_type == "MatMul" and u.node.domain in ("", "ai.onnx") and u.idx == 1
                        and u.node.inputs[0] is not None and u.node.inputs[0].shape is not None
                        and len(u.node.inputs[0].shape) >= 2 for u in uses):
            picked.add(v)
    return picked


def lower(model: ir.Model, class_name: str = "Network",
          param_names: dict[str, str] | None = None) -> tuple[LoweredNetwork, dict[str, np.ndarray]]:
    """Returns the network and the folded constants that became Parameters (name -> value).
    `param_names`: initializer name -> Parameter name (graphconv.param_names); others keep their ONNX name."""
    low = Lowering(model, class_name, param_names)
    net = low.run()
    return net, low._folded_params


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
