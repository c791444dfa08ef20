"""The exporter's optimizer (onnxscript.optimizer.optimize_ir, what torch.onnx's dynamo export runs), with the
tiny epsilons a model adds kept.

Why: onnxscript's no-op rules (`x + 0 -> x`, `x - 0 -> x`) compare the constant with 0 at the pattern's
default absolute tolerance, 1e-8, so an RMSNorm epsilon of 1e-8 (Helium's `rms_norm_eps`) is removed as a zero:
the exported graph then computes rsqrt(mean(x²)) without it, and a row of zeros (a pad token's zero embedding)
becomes NaN where PyTorch gives 0. Those Adds and Subs are hidden from the rules while the optimizer runs (a
domain no pass touches) and put back unchanged.
"""

from __future__ import annotations

_PINNED = "graphconv.pinned"
NO_OP_TOLERANCE = 1e-8  # onnxscript.rewriter._pattern_ir's default abs_tol for a constant in a pattern


def _scalar(value) -> float | None:
    """A float constant of one element, or None (never reads a tensor of more than one)."""
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant" and not producer.domain \
            and "value" in producer.attributes:
        tensor = producer.attributes["value"].as_tensor()
    if tensor is None or tensor.size != 1 or not tensor.dtype.is_floating_point():
        return None
    return float(tensor.numpy().reshape(-1)[0])


def tiny_epsilon_nodes(graph) -> list:
    """Adds and Subs of a constant the no-op rules would take for zero: 0 < |c| <= their tolerance."""
    import onnx_ir as ir

    found = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type not in ("Add", "Sub") or node.domain:
            continue
        if any(c is not None and 0 < abs(c) <= NO_OP_TOLERANCE for c in map(_scalar, node.inputs)):
            found.append(node)
    return found


def optimize_ir(model, **options) -> None:
    """onnxscript.optimizer.optimize_ir(model, **options), the tiny epsilons kept."""
    import onnxscript.optimizer

    pinned = tiny_epsilon_nodes(model.graph)
    for node in pinned:
        node.domain = _PINNED
    try:
        onnxscript.optimizer.optimize_ir(model, **options)
    finally:
        for node in pinned:
            node.domain = ""
        model.opset_imports.pop(_PINNED, None)


def exporter_optimize(model) -> None:
    """What torch.onnx's export runs with optimize=True (torch 2.13: onnxscript's torch_2_8 API: optimize_ir,
    then the ONNX fusions), the tiny epsilons kept."""
    import onnxscript.rewriter.onnx_fusions

    optimize_ir(model)
    onnxscript.rewriter.onnx_fusions.fuse(model)
