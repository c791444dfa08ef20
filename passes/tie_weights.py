"""tie-weights: one copy of each weight that the exporter (or onnxsim) stored twice.

PyTorch models tie weights (GPT-2's lm_head is the token embedding); both ONNX exporters then store the
embedding once for the Gather and again, pre-transposed, for the lm_head MatMul, and onnxsim folds any
Transpose of a weight into another copy. A 2-D initializer that equals another one, or its transpose, is
replaced by that one (through a Transpose node in the second case), so the MindIR holds a single parameter.
`graphconv export` applies the same function to the file it writes.

Candidates are found by a fingerprint that a transpose does not change and that reads a dozen elements
(shape multiset, dtype, corners, diagonal samples), and confirmed by an exact comparison: never a near-equal
pair.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphconv.dtypes import FLOATS
from passes.manager import PassResult, register_pass

# Weights smaller than this are not worth a Transpose node (and small constants repeat by chance).
MIN_ELEMENTS = 4096
_GENERATED_PREFIXES = ("val_", "onnx::", "_")  # names exporters make up: a state_dict name is kept instead


def _sampled(shape: tuple) -> tuple[list, list]:
    """The elements a fingerprint reads: the four corners and a few diagonal elements (W[i, i] is W^T[i, i])."""
    rows, cols = shape
    n = min(rows, cols)
    return [(0, 0), (0, cols - 1), (rows - 1, 0), (rows - 1, cols - 1)], \
        [(i, i) for i in sorted({0, n // 3, n // 2, 2 * n // 3, n - 1})]


def _fingerprint(arr: np.ndarray) -> tuple:
    """Equal for a tensor and its transpose, exactly, and read from a dozen elements (a memory-mapped weight
    is not read whole: a 7B model's would be 13 GB): the shapes, the dtype, the four corners as a multiset
    and a few diagonal elements."""
    corners, diagonal = _sampled(arr.shape)
    return (tuple(sorted(arr.shape)), str(arr.dtype), tuple(sorted(float(arr[ij]) for ij in corners)),
            tuple(float(arr[ij]) for ij in diagonal))


def _release(t) -> None:
    """Unmap an external weight after reading it (its pages would otherwise stay resident)."""
    if isinstance(t, ir.ExternalTensor):
        t.release()


def _equal(a, b, transposed: bool) -> bool:
    x, y = a.numpy(), b.numpy()
    if transposed:
        x = x.T
    same = x.shape == y.shape and bool(np.array_equal(x, y))
    del x, y
    _release(a)
    _release(b)
    return same


def _rank(value: ir.Value) -> tuple[int, str]:
    return (1 if (value.name or "").startswith(_GENERATED_PREFIXES) else 0, value.name or "")


def tie_weights(model: ir.Model) -> int:
    """Replace duplicate and transposed-duplicate 2-D initializers; returns how many were removed."""
    graph = model.graph
    graph_inputs = {v.name for v in graph.inputs}
    by_shape: dict[tuple, list[ir.Value]] = {}  # (a weight no other one could equal is not read at all)
    for value in list(graph.initializers.values()):
        t = value.const_value
        if (t is None or value.name in graph_inputs or value.is_graph_output() or len(t.shape) != 2
                or t.dtype not in FLOATS or t.size < MIN_ELEMENTS):
            continue
        by_shape.setdefault((tuple(sorted(t.shape)), t.dtype), []).append(value)
    candidates = [v for values in by_shape.values() if len(values) > 1 for v in values]
    groups: dict[tuple, list[ir.Value]] = {}
    for value in candidates:
        t = value.const_value
        groups.setdefault(_fingerprint(t.numpy()), []).append(value)
        _release(t)
    removed = 0
    for values in groups.values():
        if len(values) < 2:
            continue
        values.sort(key=_rank)
        kept: list[ir.Value] = []
        for value in values:
            match = next(((k, transposed) for k in kept for transposed in (False, True)
                          if _equal(k.const_value, value.const_value, transposed)), None)
            if match is None:
                kept.append(value)
                continue
            original, transposed = match
            replacement = original
            if transposed:
                node = ir.node("Transpose", [original], attributes={"perm": [1, 0]},
                               name=f"{value.name}_tied_transpose")
                node.outputs[0].name = f"{value.name}_tied"
                node.outputs[0].dtype = value.dtype
                node.outputs[0].shape = value.shape
                if graph.num_nodes():
                    graph.insert_before(graph.node(0), node)
                else:
                    graph.append(node)
                replacement = node.outputs[0]
            value.replace_all_uses_with(replacement)
            graph.initializers.pop(value.name)
            removed += 1
    return removed


@register_pass("tie-weights", "one copy of weights stored twice (tied embeddings: W and W^T -> W + Transpose)")
def tie_weights_pass(model: ir.Model) -> PassResult:
    return PassResult(tie_weights(model))
