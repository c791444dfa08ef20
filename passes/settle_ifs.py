"""settle-ifs: an If whose branches give different ranks, where the graph itself rules one branch out.

PyTorch traces `if x.shape[i] == 1: x = x.squeeze(i)` as an If whose branches return ranks 2 and 3
(silero-vad's decoder), and what follows tests the rank again (its LSTM cell's batched/unbatched Ifs). The
lowering needs one rank per value. Where taking one branch leaves the graph ill-typed (onnx's strict shape
inference fails once the rank tests that follow are folded: an LSTM given rank 5, an Unsqueeze past the rank),
no input that takes that branch runs in the model at all, so the If becomes the other branch. Only when exactly
one branch passes: where both do (or neither), the If stays. The choice is reported: on an input the original
model refuses, the compiled network may run the kept branch instead.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass
from onnxscript import optimizer

from passes.manager import PassResult, register_pass


def _ifs(graph: ir.Graph):
    """Every If node of `graph` and of its subgraphs, enclosing ones first."""
    for node in graph:
        if node.op_type != "If":
            continue
        yield node
        for name in ("then_branch", "else_branch"):
            if name in node.attributes:
                yield from _ifs(node.attributes[name].as_graph())


def _rank(value: ir.Value) -> int | None:
    return value.shape.rank() if value.shape is not None else None


def _ranks_differ(node: ir.Node) -> bool:
    """Some output whose two branches give known, different ranks."""
    if "then_branch" not in node.attributes or "else_branch" not in node.attributes:
        return False
    then, other = (node.attributes[k].as_graph().outputs for k in ("then_branch", "else_branch"))
    return any(None not in (_rank(a), _rank(b)) and _rank(a) != _rank(b) for a, b in zip(then, other))


def _condition_known(node: ir.Node) -> bool:
    return node.inputs[0] is not None and node.inputs[0].const_value is not None


def _constant(node: ir.Node, array) -> ir.Value:
    """A Constant node inserted before `node`, and its value."""
    value = ir.Value(name=f"{node.name}__settled", const_value=ir.tensor(array))
    node.graph.insert_before(node, ir.node("Constant", [], attributes={"value": value.const_value},
                                           outputs=[value]))
    return value


def _fold_ranks(model: ir.Model) -> int:
    """Size(Shape(x)) -> x's rank, wherever shape inference knows it (the rank tests PyTorch traces as
    `x.dim() == 2`); how many were folded. onnxscript's folding leaves them: x's shape is not all static."""
    folded = 0
    for graph in model.graphs():
        for node in list(graph):
            shape = node.inputs[0].producer() if node.op_type == "Size" and node.inputs else None
            if shape is None or shape.op_type != "Shape" or "start" in shape.attributes or "end" in shape.attributes:
                continue
            rank = _rank(shape.inputs[0])
            if rank is not None:
                node.outputs[0].replace_all_uses_with(_constant(node, np.array(rank, np.int64)))
                folded += 1
    return folded


def _fold(model: ir.Model) -> None:
    """onnxscript's constant folding (an If with a constant condition becomes its branch) and the rank tests
    that shape inference then answers, until neither changes anything."""
    log = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = log.level
    log.setLevel(logging.ERROR)  # (its warnings that an If's branches differ in rank: what this pass settles)
    try:
        while True:
            optimizer.fold_constants(model)
            ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
            if not _fold_ranks(model):
                return
    finally:
        log.setLevel(level)


def _assume(model: ir.Model, index: int, taken: bool) -> ir.Model:
    """`model` with its If number `index` (in _ifs order) given the constant condition `taken`, folded."""
    node = list(_ifs(model.graph))[index]
    node.replace_input_with(0, _constant(node, np.array(taken)))
    _fold(model)
    return model


def _well_typed(model: ir.Model) -> bool:
    """onnx's strict shape inference accepts `model` (False also where it cannot run: past protobuf's 2 GiB,
    ValueError, where the If then stays)."""
    try:
        onnx.shape_inference.infer_shapes(ir.to_proto(model), check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError):
        return False
    return True


def _settle_next(model: ir.Model) -> str | None:
    """Settles the first If that can be (tried on copies of `model`, then done to it); what was chosen, or
    None if none can be."""
    for k, node in enumerate(_ifs(model.graph)):
        if _condition_known(node) or not _ranks_differ(node):
            continue
        passing = [taken for taken in (True, False)
                   if _well_typed(_assume(ir.from_proto(ir.to_proto(model)), k, taken))]
        if len(passing) == 1:
            kept = passing[0]
            name = node.name
            _assume(model, k, kept)
            return (f"If {name!r} keeps its {'then' if kept else 'else'} branch: with the other branch's rank the "
                    "graph is ill-typed (onnx's strict shape inference fails), so no input the model runs takes it")
    return None


@register_pass("settle-ifs", "an If whose branches differ in rank becomes the one branch the graph's types allow")
def settle_ifs(model: ir.Model) -> PassResult:
    notes = []
    while (why := _settle_next(model)) is not None:
        notes.append(why)
    return PassResult(len(notes), notes=notes)
