"""mindspore::MoeGatingTopKSoftmax(x; k) -> (y, indices), MindSpore's `MoeGatingTopKSoftmax` primitive
(ops.auto_generate, Ascend only: CANN's aclnnMoeGatingTopKSoftmax).

An MoE router's softmax over the experts followed by the top k:
  p = softmax(f32(x), axis=-1); y, indices = topk(p, k) (largest, sorted, equal values in index order);
  y = cast(y, x's dtype).
Where this comes from (mindspore 2.10 and CANN's own sources):
- MindSpore's docstring (gen_ops_prim.py): "Softmax calculation is done on the output of x, taking topk";
  inputs x (2-D or 3-D, float16/bfloat16/float32), finished (optional bool, x.shape[:-1]), k; outputs y (x's
  dtype), expert_idx (int32), row_idx (int32). Its example (x = [[0.1, 0.2, 0.1, 0.1], ...], k = 4) prints
  softmax values sorted descending.
- CANN's aclnnMoeGatingTopKSoftmax doc (hicann/ops-transformer moe/moe_gating_top_k_softmax/docs): softmaxOut =
  softmax(x, -1); yOut, expertIdxOut = topK(softmaxOut, k); 0 <= k <= x.shape[-1] and k <= 1024; a row with
  finished = True gets expert index = num_experts; deterministic.
- CANN's golden (tests/st/aclnnMoeGatingTopKSoftmax/executor_aclnnMoeGatingTopKSoftmax.py): softmax in float32,
  indices = argsort(-p, kind='stable')[:, :k] (ties: the lower index first, ONNX's TopK rule), y cast to x's
  dtype; the kernel (op_kernel/moe_gating_top_k_softmax_perf.h) casts x to fp32 before the softmax and sorts
  with Sort32/MrgSort, documented to put equal scores in index order.
graphconv passes finished = None and uses neither finished nor row_idx (row_idx = arange(N*k).reshape(k, N).T,
the layout MoeInitRouting reads). The indices output is int64 here (ONNX TopK's); the ascend lowering casts the
primitive's int32 indices to int64.
A router that takes the top k of the logits first and a softmax over those is this op followed by y / sum(y)
(standard ops, passes/fuse_moe.py says why that is exact).
Not covered: MoeInitRouting(V2), GroupedMatmul, MoeFinalizeRouting (the expert path stays as exported).
"""

from __future__ import annotations

import onnx
from onnx import helper

from opmap.fused.record import Constraint, FusedOp, attr_constant, define, fp32_island
from opmap.registry import register

CONSTRAINTS = (  # k: the top-k's k; E: the experts (x's last dim)
    Constraint("1 <= k <= 1024", "CANN's aclnnMoeGatingTopKSoftmax page", ("k",), lambda k: 1 <= k <= 1024),
    Constraint("k at most the experts E", "CANN's aclnnMoeGatingTopKSoftmax page", ("k", "E"), lambda k, E: k <= E),
)


def _body(opset: int) -> list[onnx.NodeProto]:
    """In an fp32 island (record.island_casts: not before opset 15, where the fusion only takes fp32 inputs;
    passes/fuse_moe.py checks it)."""
    return fp32_island(opset, [
        helper.make_node("Softmax", ["x32"], ["p"], axis=-1),
        attr_constant("k0", "value_int", "k"),
        helper.make_node("Constant", [], ["one"], value_ints=[1]),
        helper.make_node("Reshape", ["k0", "one"], ["k1"]),
        helper.make_node("TopK", ["p", "k1"], ["y32", "indices"], axis=-1, largest=1, sorted=1),
    ])


MOE_GATING = define(FusedOp(
    name="MoeGatingTopKSoftmax", inputs=("x",), outputs=("y", "indices"), attributes=("k",), body=_body,
    primitive="MoeGatingTopKSoftmax", doc=__doc__, producer="fuse-moe", family="moe",
    likely_causes="the softmax axis (the experts' axis, last), k, or a router whose softmax comes after the top-k",
    constraints=CONSTRAINTS))


@register("MoeGatingTopKSoftmax", since=1, domain="mindspore")
def lower_moe_gating(n):
    y, index, _ = n.call_n(n.call("ops.auto_generate.MoeGatingTopKSoftmax"), 3, n.x(0), None, int(n.attr("k")))
    return y, n.call("ops.cast", index, n.ms_dtype(onnx.TensorProto.INT64))
