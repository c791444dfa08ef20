"""Evaluating an ONNX node whose inputs are all known, with onnx.reference: one definition of what may be
folded, how large a folded value may be and how a node is evaluated, for the lowering's per-node fold
(graphconv/compiler/lowering.py) and the ONNX backend's pass over shape arithmetic (graphconv/backend.fold_static)."""

from __future__ import annotations

import numpy as np
import onnx

from graphconv.onnx_domains import is_default_domain

# The lowering folds values of at most this many elements (inputs and outputs), so that a folded constant
# never costs more than the nodes it replaces.
FOLD_MAX_ELEMENTS = 1 << 16
# Random ops: a folded value would be the same draw at every run.
NEVER_FOLD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                        "Multinomial"})


def foldable(domain: str, op_type: str, has_subgraph: bool) -> bool:
    """Whether a node of this op may be evaluated at compile time at all: standard domain, not random, and
    no subgraph (an If or Loop is the lowering's, not onnx.reference's)."""
    return is_default_domain(domain) and op_type not in NEVER_FOLD and not has_subgraph


def evaluate(node: onnx.NodeProto, inputs: dict[str, np.ndarray], opset: int,
             max_elements: int | None = None) -> list[np.ndarray] | None:
    """The values of `node`'s named outputs, in order, from the values of its named inputs (an absent optional
    input has the name ""); None when onnx.reference cannot evaluate it or an output has more than
    `max_elements` elements."""
    from onnx.reference import ReferenceEvaluator

    graph = onnx.helper.make_graph(
        [node], "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in inputs.items()],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in node.output if n])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        outs = [np.asarray(o) for o in ReferenceEvaluator(model).run(None, dict(inputs))]
    except Exception:  # noqa: BLE001 - not foldable: the caller keeps the node
        return None
    if max_elements is not None and any(o.size > max_elements for o in outs):
        return None
    return outs
