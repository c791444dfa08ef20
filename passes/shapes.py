"""What can be proved about dims beyond ONNX's own shape inference (shared by fuse-rope and refine-shapes).

onnxruntime's symbolic shape inference follows shape arithmetic that onnx's does not: a Reshape to
(batch, seq, -1, 16) of a (batch, seq, 64) tensor has 4 heads, TorchScript exports name each unknown dim
anew, and so on. It runs on a weight-less snapshot of the graph (weights as shaped inputs), so it costs the
same for any model size.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

# Initializers up to this size are kept in the shape-inference copy (shape constants); bigger ones (weights)
# become inputs of the same shape.
_SNAPSHOT_MAX_ELEMENTS = 4096

def _snapshot(model: ir.Model) -> onnx.ModelProto | None:
    """The graph as a proto for shape inference: nodes and small initializers, weights as shaped inputs."""
    try:
        g = model.graph
        inputs = [ir.serde.serialize_value(v) for v in g.inputs]
        names = {v.name for v in g.inputs}
        inits = []
        for name, v in g.initializers.items():
            if name in names:
                continue
            t = v.const_value
            if t is not None and t.size <= _SNAPSHOT_MAX_ELEMENTS:
                proto = ir.serde.serialize_tensor(t)
                proto.name = name
                inits.append(proto)
            else:
                shape = list(t.shape) if t is not None else [d if isinstance(d, int) else d.value for d in v.shape]
                inputs.append(onnx.helper.make_tensor_value_info(name, (t.dtype if t is not None else v.dtype).value,
                                                                 [int(d) if isinstance(d, int) else d for d in shape]))
        outputs = [onnx.helper.make_tensor_value_info(v.name, v.dtype.value if v.dtype else 0, None)
                   for v in g.outputs]
        graph = onnx.helper.make_graph([ir.serde.serialize_node(n) for n in g], "shapes", inputs, outputs, inits)
        opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
        return onnx.helper.make_model(graph, opset_imports=opsets)
    except Exception:  # noqa: BLE001 - only a proof aid: without it dims compare by their IR symbols
        return None


def _symbolic_shapes(proto: onnx.ModelProto) -> dict[str, list]:
    """value name -> dims (int, or a sympy expression as text) from onnxruntime's symbolic shape inference.

    auto_merge is off: two dims get one symbol only where the inference derives them from the same shape
    arithmetic or the model could not run otherwise, never merely because an op broadcasts them. The loop is
    SymbolicShapeInference.infer_shapes' own, minus its failure path that writes a file into the cwd: an op it
    cannot infer (or fails on) leaves its outputs, and what comes after, out of the answer.
    """
    try:
        import opmap.fused
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        proto = _plain_constants(opmap.fused.inline_fused(opmap.fused.attach_functions(proto)))
        ssi = SymbolicShapeInference(int_max=2**31 - 1, auto_merge=False, guess_output_rank=False, verbose=0)
        ssi._preprocess(proto)
    except Exception:  # noqa: BLE001 - see _snapshot
        return {}
    log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        while ssi.run_:
            ssi._infer_impl()
    except Exception:  # noqa: BLE001 - keep what was inferred before the op it could not handle
        pass
    finally:
        log.setLevel(level)
    try:
        dims = {}
        for name, vi in ssi.known_vi_.items():
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                dims[name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        return dims
    except Exception:  # noqa: BLE001 - see _snapshot
        return {}


def _plain_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant nodes with value_float/value_int(s)/value_floats rewritten to a `value` tensor: the only form
    the symbolic shape inference reads (inlined fused-op bodies take their attributes that way)."""
    kinds = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    for node in model.graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        if attr.name in kinds:
            array = np.array(onnx.helper.get_attribute_value(attr), kinds[attr.name])
            del node.attribute[:]
            node.attribute.append(onnx.helper.make_attribute("value", onnx.numpy_helper.from_array(array)))
    return model


def refine_static_dims(model: ir.Model) -> int:
    """Give IR values the static dims that the symbolic shape inference proves where the IR has none;
    returns how many values changed. Only integers are taken: a symbol is never equated with another."""
    snap = _snapshot(model)
    dims = _symbolic_shapes(snap) if snap is not None else {}
    changed = 0
    for node in model.graph:
        for v in node.outputs:
            inferred = dims.get(v.name) if v.name else None
            if v.shape is None or inferred is None or len(inferred) != v.shape.rank():
                continue
            new = [d if isinstance(d, int) or not isinstance(s, int) else s for d, s in zip(v.shape, inferred)]
            if new != list(v.shape):
                v.shape = ir.Shape(new)
                changed += 1
    return changed
