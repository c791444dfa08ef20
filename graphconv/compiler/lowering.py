"""Lower stage: an ONNX graph (onnx_ir) -> a Program (graphconv/compiler/program_ir.py) -> MindSpore source.

Each ONNX node is lowered by the opmap handler registered for its (domain, op_type, opset), which builds
program nodes through its NodeContext (graphconv/compiler/node_context.py). Values known at compile time
(initializers, Constant nodes, and nodes whose inputs are all known) are folded here; small ones become
constants in `__init__`, large ones Parameters named after the model's weights. Symbolic dims are never
resolved: shapes flow as int64 tensors at run time. Repeated layers (graphconv/compiler/layers.py) become one Cell
class instantiated per layer; graphconv/compiler/codegen.py writes the source.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

import opmap
from graphconv.onnx_domains import canonical_domain, is_default_domain, op_key
from opmap import helpers as helper_lib, refusals
from graphconv.compiler import codegen, layers
from graphconv.compiler import partition as partition_
from graphconv.compiler.codegen import py_name
from graphconv.compiler.constant_fold import FOLD_MAX_ELEMENTS, evaluate, foldable
from graphconv.compiler.program_ir import Attr, AttrValue, Body, Builder, Program, Ref, Value
from graphconv.errors import UnsupportedError
from graphconv.compiler.node_context import NodeContext, Operand

# Initializers with more elements than this become Parameters (bound from the weights file at emit time);
# smaller ones are written into the source as literals.
PARAM_MIN_ELEMENTS = 64
# A ParamSpec dtype that is no numpy name: int8 bytes each holding two int4 (mindspore.qint4x2), the weight of a
# mindspore::WeightQuantBatchMatmul (qint4x2_weights); the Parameter keeps the int8 container's shape.
QINT4X2 = "qint4x2"


@dataclasses.dataclass
class ParamSpec:
    attr: str  # attribute on the Cell (a Python identifier)
    onnx_name: str  # initializer name in the lowered graph
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    transposed: bool = False  # stored as the initializer's transpose (Linear layout, see dense_weights)
    name: str = ""  # the Parameter's name (the .ckpt key): graphconv.frontend.param_names, else onnx_name

    def __post_init__(self):
        self.name = self.name or self.onnx_name

    @property
    def nbytes(self) -> int:
        itemsize = 2 if self.dtype == "bfloat16" else 1 if self.dtype == QINT4X2 else np.dtype(self.dtype).itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize


@dataclasses.dataclass
class LoweredNetwork:
    source: str
    class_name: str
    input_names: list[str]  # ONNX graph input names, in construct's argument order
    output_names: list[str]
    params: list[ParamSpec]
    op_histogram: dict[str, int]
    program: Program | None = None  # the program IR the source was written from
    layers: dict | None = None  # the repeated-layer grouping (graphconv/compiler/layers.py), for the report
    partition: "partition_.Partition | None" = None  # prologue, layers, epilogue (graphconv/compiler/partition.py)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


class Lowering:
    """Implements node_context.Scope: the operand table, constants and Parameters, and the builder."""

    def __init__(self, model: ir.Model, class_name: str = "Network", param_names: dict[str, str] | None = None,
                 scopes: "layers.Scopes | None" = None, lazy_inline: bool = True):
        self.model = model
        self.lazy_inline = lazy_inline
        # initializer name -> Parameter name (graphconv.frontend.param_names; unique); absent: the ONNX name.
        self.param_names = dict(param_names or {})
        self._taken_names = set(self.param_names.values())
        self.scopes = scopes  # where each ONNX node came from (graphconv/compiler/layers.py)
        self.graph = model.graph
        self.class_name = class_name
        self.opsets = {canonical_domain(d): v for d, v in model.opset_imports.items()}
        self.used_attrs: set[str] = set(codegen.RESERVED)
        self.operands: dict[ir.Value, Operand] = {}
        self.attrs: list[Attr] = []
        self.params: list[ParamSpec] = []
        self.helpers: list[str] = []
        self.histogram: dict[str, int] = {}
        self.body = Body()
        self.builder = Builder(self.body)
        self._folded_params: dict[str, np.ndarray] = {}
        self._unnamed = 0
        self._constants: dict[tuple, Attr] = {}

    # --- node_context.Scope ---------------------------------------------------------------------------
    def use_helper(self, name: str) -> None:
        if name in self.helpers:
            return
        fn = getattr(helper_lib, name)
        for dep in helper_lib.dependencies(fn):
            self.use_helper(dep)
        self.helpers.append(name)

    def is_dense_weight(self, value: ir.Value) -> bool:
        return value in self.dense_weights

    def is_qint4x2(self, value: ir.Value) -> bool:
        return value in self.qint4x2_weights

    def constant(self, value: np.ndarray, hint: str) -> AttrValue:
        key = (value.dtype.str, value.shape, value.tobytes()) if value.size <= PARAM_MIN_ELEMENTS else None
        if key is not None and key in self._constants:  # one attribute per small constant value
            return AttrValue(self._constants[key])
        name = py_name(f"c_{hint}", self.used_attrs)
        while name in self._taken_names or name in self.graph.initializers:  # it is a Parameter name too
            name = py_name(f"c_{hint}", self.used_attrs)
        attr = Attr(name, tuple(value.shape), np.dtype(value.dtype).name, value=value)
        if value.size > PARAM_MIN_ELEMENTS:
            # Folded constants too big for a literal are Parameters as well, bound by attribute name.
            attr.as_parameter = True
            self.params.append(ParamSpec(name, name, tuple(value.shape), _np_name(value.dtype)))
            self._folded_params[name] = value
        self.attrs.append(attr)
        if key is not None:
            self._constants[key] = attr
        return AttrValue(attr)

    def const_value(self, value: ir.Value) -> np.ndarray | None:
        op = self.operands.get(value)
        if op is None:
            return None
        if op.const is None and op.initializer is not None and op.initializer.const_value is not None:
            op.const = op.initializer.const_value.numpy()
        return op.const

    def value_of(self, value: ir.Value) -> Value:
        op = self.operands.get(value)
        if op is None:
            raise UnsupportedError(f"value {value.name!r} is used before it is defined")
        if op.value is None:
            if op.initializer is not None:
                init = op.initializer  # also when `value` aliases it (an identity Cast, see _try_fold)
                t = init.const_value
                shape = tuple(int(d) for d in t.shape)
                size = int(np.prod(shape, dtype=np.int64))
                # Weights stay Parameters under the model's names (the .ckpt and fine-tuning need them);
                # scalars and tiny integer tables (shapes, axes) are written as literals. A branch's own
                # initializer (folded there) is no weight of the model's: a folded constant.
                main = self.graph.initializers.get(init.name) is init
                if main and (size > PARAM_MIN_ELEMENTS or (len(shape) > 0 and t.dtype.is_floating_point())):
                    name = self.param_names.get(init.name, init.name)
                    dtype = t.dtype.numpy()
                    transposed = init in self.dense_weights
                    if transposed:
                        shape = shape[::-1]
                    dtype_name = QINT4X2 if init in self.qint4x2_weights else _np_name(dtype)
                    spec = ParamSpec(py_name(name, self.used_attrs, "p"), init.name, shape, dtype_name,
                                     transposed, name)
                    self.params.append(spec)
                    attr = Attr(spec.attr, shape, spec.dtype, param=spec)
                    self.attrs.append(attr)
                    op.value = AttrValue(attr)
                    return op.value
            op.value = self.constant(self.const_value(value), py_name(value.name, set(), "c"))
        return op.value

    def bind(self, value: ir.Value, item) -> None:
        self.operands[value] = Operand(value=None, const=item) if isinstance(item, np.ndarray) \
            else Operand(value=item)

    def lower_graph(self, graph: ir.Graph) -> list:
        for v in graph.initializers.values():  # (a branch's own: constant folding leaves its results there)
            self.operands.setdefault(v, Operand(value=None, initializer=v))
        for node in graph:
            self.lower_node(node)
        out = []
        for v in graph.outputs:
            c = self.const_value(v)
            out.append(c if c is not None else self.value_of(v))
        return out

    # --- the walk -----------------------------------------------------------------------------------
    def run(self) -> LoweredNetwork:
        for v in self.graph.inputs:
            arg = Value(hint=v.name, onnx_name=v.name)
            self.body.inputs.append(arg)
            self.operands[v] = Operand(value=arg)
        for v in self.graph.initializers.values():
            self.operands[v] = Operand(value=None, initializer=v)
        self.dense_weights = dense_weights(self.graph)
        self.qint4x2_weights = qint4x2_weights(self.graph)
        for node in self.graph:
            key = f"{node.domain + '::' if node.domain else ''}{node.op_type}"
            self.histogram[key] = self.histogram.get(key, 0) + 1
            self.lower_node(node)
        self.body.outputs = [self.value_of(v) for v in self.graph.outputs]
        program = Program(self.class_name, self.body, self.attrs, self.helpers)
        codegen.eliminate_dead(program.body)  # (before the partition, whose blocks hold the body's nodes)
        grouping = layers.group(program, self.scopes)
        return LoweredNetwork(
            source=codegen.render(program, helper_lib, self.lazy_inline),
            class_name=self.class_name,
            input_names=[v.name for v in self.graph.inputs],
            output_names=[v.name for v in self.graph.outputs],
            params=self.params,
            op_histogram=dict(sorted(self.histogram.items())),
            program=program,
            layers=grouping.summary,
            partition=grouping.partition,
        )

    def lower_node(self, node: ir.Node) -> None:
        domain = canonical_domain(node.domain)
        opset = self.opsets.get(domain, 1)
        if node.op_type == "Constant" and domain == "":
            self._set_const(node.outputs[0], _constant_node_value(node))
            return
        if self._try_fold(node, opset):
            return
        handler = opmap.lookup(domain, node.op_type, opset)
        if handler is None:
            raise UnsupportedError(f"no lowering for {_op_label(node)} at opset {opset}")
        outer = self.builder.origin
        if not node.name:  # (names the values it makes: stable from run to run)
            self._unnamed += 1
        self.builder.origin = node.name or f"{node.op_type.lower()}_{self._unnamed}"
        try:
            result = handler.fn(NodeContext(self, node, opset))
        finally:
            self.builder.origin = outer
        results = (result,) if isinstance(result, (Value, np.ndarray)) else tuple(result)
        for value, item in zip(node.outputs, results):
            if not value.name:
                continue
            if isinstance(item, np.ndarray):  # the handler resolved the output at compile time
                self._set_const(value, item)
                continue
            if not isinstance(item, Value):
                raise TypeError(f"the {node.op_type} handler returned {type(item).__name__}, not a program Value")
            if item.producer is not None and item.hint is None:
                item.hint = value.name  # the ONNX name names the variable
            if item.onnx_name is None and not isinstance(item, (Ref, AttrValue)):
                item.onnx_name = value.name  # (an Identity's output holds its input's value: the first name stays)
            self.operands[value] = Operand(value=item)
        for value in node.outputs[len(results):]:
            if value.name and (value.uses() or value.is_graph_output()):
                raise UnsupportedError(f"node {node.name!r} ({node.op_type}): output {len(results)} is not supported")

    def _set_const(self, value: ir.Value, array: np.ndarray) -> None:
        self.operands[value] = Operand(value=None, const=np.asarray(array))

    def _try_fold(self, node: ir.Node, opset: int) -> bool:
        """Evaluate a node whose inputs are all compile-time constants (shape arithmetic, mostly)."""
        if not foldable(node.domain, node.op_type, _has_subgraph(node)):
            return False
        if any(v in self.dense_weights for v in node.outputs):
            return False  # (the Cast of a weight stored transposed: it stays a Cast of the Parameter)
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
        if outs is None:
            return False
        for value, arr in zip(node.outputs, outs):
            self._set_const(value, arr)
        return True


def _evaluate(node: ir.Node, inputs: list, opset: int) -> list[np.ndarray] | None:
    """constant_fold.evaluate on a copy of the node whose inputs are named by position (every output requested)."""
    in_names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    proto = onnx.helper.make_node(node.op_type, in_names, [f"o{k}" for k in range(len(node.outputs))],
                                  domain=node.domain)
    for attr in node.attributes.values():
        proto.attribute.append(ir.serde.serialize_attribute(attr))
    return evaluate(proto, {n: a for n, a in zip(in_names, inputs) if a is not None}, opset, FOLD_MAX_ELEMENTS)


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
    return op_key(node)


def _np_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name



def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Every op of the model (main graph and functions) that opmap cannot lower, as 'domain::Op (opset N)'."""
    opsets = {canonical_domain(i.domain): i.version for i in model.opset_import}
    local_functions = {(f.domain, f.name) for f in model.functions}
    missing = set()

    def visit(nodes):
        for n in nodes:
            domain = canonical_domain(n.domain)
            if (n.domain, n.op_type) in local_functions:
                continue
            if n.op_type == "Constant" and domain == "":
                continue
            if opmap.lookup(domain, n.op_type, opsets.get(domain, 1)) is None:
                label = f"{domain}::{n.op_type}" if domain else n.op_type
                why = refusals.reason(n.op_type, domain)
                missing.add(f"{label} (opset {opsets.get(domain, '?')}{': ' + why if why else ''})" if domain in opsets
                            else f"{label} (domain {domain!r} is not imported)")

    visit(model.graph.node)
    for f in model.functions:
        visit(f.node)
    return sorted(missing)


def dense_weights(graph: ir.Graph) -> set[ir.Value]:
    """2-D float initializers read only as the weight (input 1) of MatMuls whose data has rank >= 2, directly or
    through a Cast to a float type (a bf16/fp16 checkpoint exported with `--dtype auto`, a `--precision` cpu
    twin): they are stored transposed, in Linear's [out, in] layout, and those MatMuls lower to ops.dense
    (x @ w.T). The set holds the initializers and those Casts' outputs (an elementwise Cast is the same on the
    transposed layout).

    Why: MindSpore 2.10's ops.matmul of an N-d input by a 2-d weight broadcasts the weight over the batch,
    and its CPU kernel keeps packed copies: running a 0.4 GB Llama at two shapes took 5 GB; ops.dense reads
    the [out, in] weight as is (measured: 8 weights of 16 MB, +900 MB with ops.matmul, +23 MB with dense).
    Under dynamic shapes ops.matmul is also some 20 times slower (benchmarks/cpu_matmul_forms.py).
    """

    def weight_of_matmuls(value: ir.Value) -> bool:
        uses = list(value.uses())
        return bool(uses) and all(
            u.node.op_type == "MatMul" and is_default_domain(u.node.domain) and u.idx == 1
            and u.node.inputs[0] is not None and u.node.inputs[0].shape is not None
            and len(u.node.inputs[0].shape) >= 2 for u in uses)

    def float_cast(node: ir.Node) -> bool:
        return node.op_type == "Cast" and is_default_domain(node.domain) and len(node.outputs) == 1 and \
            "to" in node.attributes and ir.DataType(node.attributes["to"].value).is_floating_point() and \
            not node.outputs[0].is_graph_output()

    picked = set()
    for v in graph.initializers.values():
        t = v.const_value
        if (t is None or len(t.shape) != 2 or not t.dtype.is_floating_point() or t.size <= PARAM_MIN_ELEMENTS
                or v.is_graph_output()):
            continue
        if weight_of_matmuls(v):
            picked.add(v)
            continue
        casts = [u.node for u in v.uses()]
        if casts and all(u.idx == 0 and float_cast(u.node) and weight_of_matmuls(u.node.outputs[0])
                         for u in v.uses()):
            picked.add(v)
            picked.update(c.outputs[0] for c in casts)
    return picked


def qint4x2_weights(graph: ir.Graph) -> set[ir.Value]:
    """int8 initializers read only as the 4-bit weight (input 1, weight_bits 4) of mindspore::WeightQuantBatchMatmul
    nodes: their Parameters are qint4x2 (the same bytes; opmap/fused/weight_quant_batch_matmul.py). An 8-bit
    weight (weight_bits 8) stays the int8 Parameter it is."""
    def as_qint4x2(use) -> bool:
        node = use.node
        return node.op_type == "WeightQuantBatchMatmul" and node.domain == "mindspore" and use.idx == 1 \
            and node.attributes.get_int("weight_bits", 4) == 4

    picked = set()
    for v in graph.initializers.values():
        uses = list(v.uses())
        if v.const_value is not None and v.const_value.dtype == ir.DataType.INT8 and uses and not v.is_graph_output() \
                and all(as_qint4x2(u) for u in uses):
            picked.add(v)
    return picked


def lower(model: ir.Model, class_name: str = "Network", param_names: dict[str, str] | None = None,
          scopes: "layers.Scopes | None" = None,
          lazy_inline: bool = True) -> tuple[LoweredNetwork, dict[str, np.ndarray]]:
    """Returns the network and the folded constants that became Parameters (name -> value).
    `param_names`: initializer name -> Parameter name (graphconv.frontend.param_names); others keep their ONNX name.
    `scopes`: where each node came from (graphconv/compiler/layers.py), for grouping repeated layers; `lazy_inline`:
    see codegen.render."""
    low = Lowering(model, class_name, param_names, scopes, lazy_inline)
    net = low.run()
    return net, low._folded_params


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
