"""The fused-op table: each MindSpore fused operator, defined once, as a node of the ONNX domain `mindspore`.

A FusedOp gives the op's inputs and attributes, its reference semantics as an ONNX function body in
standard ops (attached to a fused model as a model-local FunctionProto, so onnxruntime runs the fused graph
and the cpu lowering is "inline the body, lower with opmap"), and its ascend lowering (the MindSpore
primitive), registered in opmap under the `mindspore` domain. Both lowerings read the node's attributes: the
one argument record the fusion extracted.
"""

from __future__ import annotations

import onnx

from graphconv.onnx_domains import default_opset
from opmap.fused.record import (  # noqa: F401  (the table's API, re-exported)
    DOMAIN, DOMAIN_VERSION, FUSED_OPS, READ_ONLY_PRIMITIVES, FusedOp, define, fp16_primitives, fp32_island,
    fused_primitives)


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give `model` the function bodies of the fused ops it uses, and the `mindspore` opset import."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    opset = default_opset(model)
    have = {(f.domain, f.name) for f in model.functions}
    for name in sorted(used):
        if (DOMAIN, name) not in have:
            model.functions.append(FUSED_OPS[name].function(opset))
    if used and not any(i.domain == DOMAIN for i in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model


def ascend_precision_variant(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of a fused model whose function bodies compute in the ascend lowering's precision, or None
    when no fused op of the model differs in precision from its reference body."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    if not any(FUSED_OPS[name].ascend_body for name in used):
        return None
    opset = default_opset(model)
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    others = [f for f in variant.functions if f.domain != DOMAIN]
    del variant.functions[:]
    variant.functions.extend(others)
    for name in sorted(used):
        variant.functions.append(FUSED_OPS[name].function(opset, ascend_precision=True))
    return variant


def inline_fused(model: onnx.ModelProto) -> onnx.ModelProto:
    """The cpu form of a fused model: every `mindspore` node replaced by its function body. Functions of other
    domains stay (graphconv::KVCacheUpdate, a cache written in place, is lowered as it is on both targets)."""
    import onnx.inliner

    if not any(n.domain == DOMAIN for n in model.graph.node):
        return model
    inlined = onnx.inliner.inline_selected_functions(
        model, [(f.domain, f.name) for f in model.functions if f.domain == DOMAIN])
    others = [f for f in inlined.functions if f.domain != DOMAIN]
    del inlined.functions[:]
    inlined.functions.extend(others)
    kept = [i for i in inlined.opset_import if i.domain != DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    _name_bodies(model, inlined)
    for k, node in enumerate(inlined.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{k}"
    return onnx.shape_inference.infer_shapes(inlined, data_prop=True)


def _name_bodies(fused: onnx.ModelProto, inlined: onnx.ModelProto) -> None:
    """Name each inlined body node `<fused node>::<op>_<k>`: which fused op it computes stays readable (and
    graphconv/compiler/layers.py keeps a body in its fused node's layer). The inliner keeps the node order and copies
    each body whole; if the counts do not line up, the nodes keep the generic names."""
    sizes = {f.name: len(f.node) for f in fused.functions if f.domain == DOMAIN}
    expected = sum(sizes.get(n.op_type, 1) if n.domain == DOMAIN else 1 for n in fused.graph.node)
    if expected != len(inlined.graph.node):
        return
    k = 0
    for original in fused.graph.node:
        if original.domain != DOMAIN:
            k += 1
            continue
        base = original.name or f"{original.op_type}_{k}"
        for j in range(sizes[original.op_type]):
            node = inlined.graph.node[k + j]
            if not node.name:
                node.name = f"{base}::{node.op_type}_{j}"
        k += sizes[original.op_type]


from opmap.fused import rms_norm  # noqa: E402,F401  (registers the table entries)
from opmap.fused import layer_norm  # noqa: E402,F401
from opmap.fused import gelu  # noqa: E402,F401
from opmap.fused import silu  # noqa: E402,F401
from opmap.fused import swiglu  # noqa: E402,F401
from opmap.fused import rotary  # noqa: E402,F401
from opmap.fused import flash_attention  # noqa: E402,F401
from opmap.fused import fused_infer_attention  # noqa: E402,F401
from opmap.fused import fast_gelu  # noqa: E402,F401
from opmap.fused import moe_gating  # noqa: E402,F401
from opmap.fused import dynamic_rnn  # noqa: E402,F401
from opmap.fused import weight_quant_batch_matmul  # noqa: E402,F401
from opmap.fused import quant_batch_matmul  # noqa: E402,F401

from graphconv.frontend.contrib.registry import FUSED_TABLE  # noqa: E402  (what the load's decompositions write)

FUSED_TABLE.update(records=FUSED_OPS, attach=attach_functions)
