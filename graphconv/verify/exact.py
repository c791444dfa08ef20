"""The model's exact values: its graph evaluated in float64 on its own weights, the reference a low-precision
network is judged against (compare.judge_against_exact).

Why: at fp16, onnxruntime's own run of a deep model is itself off the exact values by more than the fp16
tolerance (a 7B: 100 of 480,000 logits, max 0.017), so a network that rounds differently from onnxruntime
could not pass against onnxruntime even when it is as close to the truth. The exact values judge both.

`upcast` turns every float tensor type of the graph (inputs, outputs, initializers, Constant values,
ConstantOfShape's value, Cast and dtype targets) into double; fp16/bf16 weights become float64 exactly. With
`rounded`, into float (fp32) with each fp16/bf16 result rounded to its dtype: the yardstick (compare.py).
graphconv/verify/piecewise.py runs it as it runs the oracle (one piece, or layer by layer with each layer's
weights upcast as they are read): onnxruntime where it has a double kernel for every node of a piece, else
onnx.reference for that piece (onnxruntime has no double Erf, for one), with the ops it computes in float32
replaced (`reference_ops`: its Erf rounds to float32).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from graphconv.dtypes import FLOATS, LOW_PRECISION

_DTYPE_ATTRS = ("to", "dtype")  # Cast's target; EyeLike's, the Random ops' and Bernoulli's output dtype


@dataclasses.dataclass
class Values:
    """Per case, by value name: the exact values, and those of the graph computed in fp32 with every op's
    fp16/bf16 result rounded (`upcast(..., rounded=, to=FLOAT)`): the distance an ideal fp16 device has from
    the exact values."""

    exact: list[dict]
    rounded: list[dict]

    def of(self, case: int, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        if name in self.exact[case] and name in self.rounded[case]:
            return self.exact[case][name], self.rounded[case][name]
        return None


def float64_bytes(model: onnx.ModelProto, pieces=None) -> int:
    """Bytes of the float weights of the largest of `pieces` (None: the whole graph) once in float64."""
    elements = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer
                if t.data_type in FLOATS}
    groups = [set(p.reads) for p in pieces] if pieces else [set(elements)]
    return 8 * max((sum(elements.get(r, 0) for r in group) for group in groups), default=0)


def computes_in_low_precision(model: onnx.ModelProto) -> bool:
    """Whether the model's outputs are fp16 or bf16: its oracle is onnxruntime's own low-precision run."""
    return any(o.type.tensor_type.elem_type in LOW_PRECISION for o in model.graph.output)


def upcast(model: onnx.ModelProto, rounded: dict[str, int] | None = None,
           to: int = TensorProto.DOUBLE) -> onnx.ModelProto:
    """A copy of `model` computing in `to` (float64; its external weights stay references: cast them as read).
    `rounded` (declared_low_precision of the whole model): each of those node results rounded to its declared
    dtype (and back) before it is used: every op computed in `to` and rounded once, what an ideal fp16 device
    computes for the graph as written (the device accumulates in fp32: `to` FLOAT is that device)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph(out.graph, to)
    for f in out.functions:
        _function(f, to)
    if rounded:
        _round_results(out.graph, rounded, to)
    return out


def declared_low_precision(model: onnx.ModelProto) -> dict[str, int]:
    """The graph's node results declared fp16 or bf16, by name (shape inference's types)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.output)}
    made = {o for n in g.node for o in n.output if o}
    return {name: t for name, t in types.items() if name in made and t in LOW_PRECISION}


def _round_results(g: onnx.GraphProto, declared: dict[str, int], to: int) -> None:
    """After each node result in `declared`: Cast to its declared dtype and back to `to`, under its name."""
    nodes = []
    for n in g.node:
        nodes.append(n)
        for k, name in enumerate(n.output):
            if name in declared:
                unrounded = f"{name}__unrounded"
                n.output[k] = unrounded
                nodes.append(onnx.helper.make_node("Cast", [unrounded], [f"{name}__rounded"], to=declared[name]))
                nodes.append(onnx.helper.make_node("Cast", [f"{name}__rounded"], [name], to=to))
    del g.node[:]
    g.node.extend(nodes)


def as_float(array: np.ndarray, to: int = TensorProto.DOUBLE) -> np.ndarray:
    """A float array (fp16, bf16, fp32, fp64) in `to`'s dtype; any other as it is."""
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return array.astype(onnx.helper.tensor_dtype_to_np_dtype(to))
    return array


def reference_ops() -> list:
    """onnx.reference ops to use instead of its own, which compute in float32 whatever the input (Erf)."""
    from onnx.reference.op_run import OpRun

    class Erf(OpRun):
        op_domain = ""

        def _run(self, x):
            return (np.vectorize(math.erf, otypes=[x.dtype])(x),)

    return [Erf]


def _type(tp: onnx.TypeProto, to: int) -> None:
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type in FLOATS:
        tp.tensor_type.elem_type = to
    elif tp.HasField("sequence_type"):
        _type(tp.sequence_type.elem_type, to)
    elif tp.HasField("optional_type"):
        _type(tp.optional_type.elem_type, to)


def _tensor(t: onnx.TensorProto, to: int) -> None:
    if t.data_type in FLOATS and t.data_type != to and not t.external_data:
        t.CopyFrom(numpy_helper.from_array(as_float(numpy_helper.to_array(t), to), t.name))
    elif t.data_type in FLOATS:  # (an external weight: its reader casts it)
        t.data_type = to


def _graph(g: onnx.GraphProto, to: int) -> None:
    for v in list(g.input) + list(g.output):
        _type(v.type, to)
    del g.value_info[:]  # (the types in it are the model's; onnxruntime infers them again)
    for t in g.initializer:
        _tensor(t, to)
    for n in g.node:
        _node(n, to)


def _function(f: onnx.FunctionProto, to: int) -> None:
    """A function body's nodes, and its Constants whose float value is the calling node's attribute (a fused
    op's epsilon): fp32 whatever the call, so Cast to `to` after them."""
    nodes = []
    for n in f.node:
        _node(n, to)
        nodes.append(n)
        if n.op_type == "Constant" and any(a.ref_attr_name and a.name in ("value_float", "value_floats")
                                           for a in n.attribute):
            name = n.output[0]
            n.output[0] = f"{name}__fp32"
            nodes.append(onnx.helper.make_node("Cast", [n.output[0]], [name], to=to))
    del f.node[:]
    f.node.extend(nodes)


def _node(n: onnx.NodeProto, to: int) -> None:
    for a in list(n.attribute):
        if a.type == onnx.AttributeProto.TENSOR:
            _tensor(a.t, to)
        elif a.type == onnx.AttributeProto.INT and a.name in _DTYPE_ATTRS and a.i in FLOATS:
            a.i = to
        elif a.type == onnx.AttributeProto.GRAPH:
            _graph(a.g, to)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                _graph(g, to)
        elif n.op_type == "Constant" and a.name in ("value_float", "value_floats") and not a.ref_attr_name:
            values = as_float(np.array(a.f if a.name == "value_float" else list(a.floats), np.float32), to)
            n.attribute.remove(a)
            n.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(values)))
