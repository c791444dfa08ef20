"""What a contrib-op decomposition writes with: standard nodes replacing one contrib node.

Nodes are named `<contrib node>::<op>_<k>` and new values `<contrib node>::<what>`, so the report,
`graphconv debug` and the layer grouping still see which contrib node they compute. The replaced node's
outputs keep their names: the rest of the graph is untouched.
"""

from __future__ import annotations


import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphconv.errors import UnsupportedError
from graphconv.onnx_domains import domain_name
from graphconv.frontend.shapes import symbolic_inference


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[list, int]]:
    """(dims, elem type) of every value, contrib ops' outputs included, from onnxruntime's symbolic shape
    inference (which knows them; onnx's does not). Dims are ints or symbol names. Empty when it fails: the
    decompositions then use what the attributes and runtime Shape ops give."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for t in bare.graph.initializer:  # the weights' bytes are not needed, only their dims
        if t.data_location == onnx.TensorProto.EXTERNAL or t.raw_data and len(t.raw_data) > 1 << 16:
            t.ClearField("raw_data")
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    shapes = {}
    for t in model.graph.initializer:
        shapes[t.name] = (list(t.dims), t.data_type)
    ssi = symbolic_inference(bare, auto_merge=True, guess_output_rank=True)
    if ssi is not None:
        ssi._update_output_from_vi()
        inferred = ssi.out_mp_
        _add_declared(shapes, list(inferred.graph.input) + list(inferred.graph.value_info)
                      + list(inferred.graph.output))
    # What inference left unknown, the model's own declarations give (the dynamo exporter declares every value;
    # onnxruntime's inference stops past a GroupQueryAttention whose total_sequence_length it cannot read).
    declared = {}
    _add_declared(declared, list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output))
    return {**declared, **shapes}


def _add_declared(shapes: dict, infos) -> None:
    for vi in infos:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape") and tt.elem_type:
            shapes[vi.name] = ([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                for d in tt.shape.dim], tt.elem_type)


def read_values(model: onnx.ModelProto) -> set[str]:
    """Every value some node reads (in subgraphs too) or the graph outputs: an output named but read by nothing
    (onnxscript's fusions name every output of the contrib nodes they write) is not the model's to compute."""
    read = {o.name for o in model.graph.output}
    todo = [model.graph]
    while todo:
        graph = todo.pop()
        for n in graph.node:
            read.update(n.input)
            for a in n.attribute:
                todo.extend([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))
        read.update(o.name for o in graph.output)
    read.discard("")
    return read


class Rewrite:
    def __init__(self, node: onnx.NodeProto, shapes: dict, opset: int, taken: set[str],
                 read: set[str] | None = None, initializers: dict[str, onnx.TensorProto] | None = None,
                 spill=None):
        """`read`: the values the model reads (read_values); an output of the node outside it counts as unused.
        None: every named output is used. `initializers`: the model's, by name (`array` reads them). `spill`
        (a weights.SpillFile, for a model whose weights are in files): where large new initializers go, and
        then `array` reads external initializers too."""
        self.node = node
        self._spill = spill
        self._initializers = initializers or {}
        self._read = read
        self.opset = opset
        self._shapes = shapes
        self._taken = taken
        self._nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []  # new initializers (`initializer`), added to the model
        self._attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.name = node.name or f"{node.op_type}_{id(node)}"

    # --- reading the contrib node ---
    def attr(self, name: str, default=None):
        v = self._attrs.get(name, default)
        return v.decode() if isinstance(v, bytes) else v

    def has(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])

    def input(self, i: int) -> str:
        return self.node.input[i] if self.has(i) else ""

    def output(self, i: int) -> str:
        """The i-th output's name, or '' when the model does not use it."""
        name = self.node.output[i] if i < len(self.node.output) else ""
        return name if self._read is None or name in self._read else ""

    def shape(self, value: str) -> list | None:
        s = self._shapes.get(value)
        return None if s is None else s[0]

    def dtype(self, value: str) -> int | None:
        s = self._shapes.get(value)
        return None if s is None else s[1]

    def array(self, value: str) -> np.ndarray | None:
        """The value of an initializer: held in the model, or in an external file where new weights can leave
        memory too (`spill`); None for anything else."""
        from graphconv.frontend import weights

        t = self._initializers.get(value)
        if t is None or (t.data_location == onnx.TensorProto.EXTERNAL and self._spill is None):
            return None
        return weights.to_array(t)

    def static_dim(self, value: str, axis: int) -> int | None:
        s = self.shape(value)
        if s is None or not -len(s) <= axis < len(s):
            return None
        d = s[axis]
        return d if isinstance(d, int) and d > 0 else None

    def fail(self, why: str):
        raise UnsupportedError(f"{domain_name(self.node.domain)}::{self.node.op_type} node {self.name!r}: {why}")

    # --- writing the replacement ---
    def fresh(self, what: str) -> str:
        name = f"{self.name}::{what}"
        while name in self._taken:
            name += "_"
        self._taken.add(name)
        return name

    def op(self, op_type: str, *inputs: str, outputs: list[str] | int = 1, **attrs):
        """Append a node; returns its output name (or the list of them when outputs is a list or > 1)."""
        if isinstance(outputs, int):
            names = [self.fresh(f"{op_type}_{len(self._nodes)}_{k}" if outputs > 1 else f"{op_type}_{len(self._nodes)}")
                     for k in range(outputs)]
            single = outputs == 1
        else:
            names = [o or self.fresh(f"{op_type}_{len(self._nodes)}_unused{k}") for k, o in enumerate(outputs)]
            single = False
        self._nodes.append(helper.make_node(op_type, list(inputs), names,
                                            name=self.fresh(f"{op_type}_{len(self._nodes)}"), **attrs))
        return names[0] if single else names

    def const(self, value, dtype=None) -> str:
        """A Constant node holding `value` (numpy dtype `dtype`, default from the value)."""
        arr = np.asarray(value, dtype=dtype)
        out = self.fresh(f"const_{len(self._nodes)}")
        self._nodes.append(helper.make_node("Constant", [], [out], name=self.fresh(f"Constant_{len(self._nodes)}"),
                                            value=numpy_helper.from_array(arr, out)))
        return out

    def initializer(self, value: np.ndarray, what: str) -> str:
        """A new initializer holding `value` (a weight: an initializer stays a Parameter, a Constant node would be
        folded into the source); named `<contrib node>::<what>`."""
        from graphconv.frontend import weights

        name = self.fresh(what)
        self.initializers.append(weights.made_initializer(value, name, self._spill))
        return name

    def identity(self, src: str, dst: str) -> None:
        """Make output `dst` (a contrib node's output name) the value `src`."""
        if dst:
            self._nodes.append(helper.make_node("Identity", [src], [dst],
                                                name=self.fresh(f"Identity_{len(self._nodes)}")))

    def finish(self) -> list[onnx.NodeProto]:
        produced = {o for n in self._nodes for o in n.output}
        missing = [o for i, o in enumerate(self.node.output) if self.output(i) and o not in produced]
        if missing:
            self.fail(f"the decomposition does not compute output(s) {missing} (a graphconv bug)")
        return self._nodes
