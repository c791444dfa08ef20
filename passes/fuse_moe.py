"""fuse-moe: an MoE router's TopK(Softmax(logits)) -> mindspore::MoeGatingTopKSoftmax (opmap/fused/moe_gating.py).

transformers' Mixtral, Qwen2-MoE and Qwen3-MoE routers all compute softmax(router_logits.float(), -1), then
topk(k, -1) (Mixtral and Qwen3-MoE with norm_topk_prob then divide by the sum of the k values: that division
stays as exported, as do Qwen2-MoE's shared expert and the experts themselves). MoeGatingTopKSoftmax is exactly
the softmax in fp32 followed by the sorted top k with ties in index order, so the pair fuses when:
the softmax and the top-k run over the last axis of a 2-D or 3-D float tensor (MoeGatingTopKSoftmax's ranks),
the top-k takes the k largest, sorted, with a constant 1 <= k <= min(experts, 1024), and the probabilities are
read by nothing else (the primitive does not return them).

Coverage family "moe" (passes/coverage.py): every TopK whose scores are a Softmax or a Sigmoid (through Casts),
or whose values go on to a Softmax (top-k first, then a softmax over the chosen logits). What does not fuse
says why: a sigmoid router (DeepSeek-V3's), a softmax after the top-k, another axis, smallest-k, ...
Not fused (MoE primitives' semantics unconfirmed): MoeInitRouting(V2), GroupedMatmul, MoeFinalizeRouting; the
experts stay as exported (batched_mm: each token's expert weights gathered, then a batched matmul).
"""

from __future__ import annotations

import onnx_ir as ir

from graphconv.onnx_domains import is_default_domain
from opmap.fused import moe_gating
from passes import coverage, dim_bounds, match
from passes.manager import PassResult, register_pass

_DOMAIN = "mindspore"


def _through_casts(value: ir.Value | None) -> ir.Node | None:
    p = value.producer() if value is not None else None
    while p is not None and is_default_domain(p.domain) and p.op_type == "Cast":
        value = p.inputs[0]
        p = value.producer() if value is not None else None
    return p


def _last_axis(node: ir.Node, default: int, rank: int | None) -> bool:
    attr = node.attributes.get("axis")
    axis = default if attr is None else int(attr.value)
    return rank is not None and axis in (-1, rank - 1)


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def moe_candidates(graph: ir.Graph) -> list[ir.Node]:
    """TopK-based routers: a TopK over softmax or sigmoid scores, or whose values go to a Softmax."""
    found = []
    for n in graph:
        if not is_default_domain(n.domain) or n.op_type != "TopK":
            continue
        scores = _through_casts(n.inputs[0])
        if scores is not None and is_default_domain(scores.domain) and scores.op_type in ("Softmax", "Sigmoid"):
            found.append(n)
        elif any(u.node.op_type == "Softmax" or (u.node.op_type == "Cast" and match.users(u.node.outputs[0], "Softmax"))
                 for u in n.outputs[0].uses() if is_default_domain(u.node.domain)):
            found.append(n)
    return found


def refusal(topk: ir.Node, opset: int) -> str | None:
    """Why this TopK and its Softmax do not make a MoeGatingTopKSoftmax, or None when they do."""
    softmax = match.producer(topk.inputs[0], "Softmax")
    if softmax is None:
        scores = _through_casts(topk.inputs[0])
        if scores is not None and scores.op_type == "Sigmoid":
            return "sigmoid router scores: MoeGatingTopKSoftmax computes a softmax over the experts"
        if scores is not None and scores.op_type == "Softmax":
            return "a Cast between the softmax and the top-k (MoeGatingTopKSoftmax ranks the fp32 probabilities)"
        if any(u.node.op_type in ("Softmax", "Cast") for u in topk.outputs[0].uses()):
            return ("top-k before the softmax (a softmax over the k chosen logits): MoeGatingTopKSoftmax takes the "
                    "softmax over all experts first")
        return "the top-k's scores are not a Softmax"
    x = softmax.inputs[0]
    rank = match.rank(x)
    if rank not in (2, 3):
        return f"rank {rank} router logits: MoeGatingTopKSoftmax takes 2-D or 3-D"
    if x.dtype not in match.FLOATS:
        return f"dtype {x.dtype}: MoeGatingTopKSoftmax takes float32, float16 or bfloat16"
    if opset < match.MIN_LOW_PRECISION_OPSET and x.dtype != ir.DataType.FLOAT:
        return (f"below opset {match.MIN_LOW_PRECISION_OPSET} MoeGatingTopKSoftmax's reference body can only "
                "express fp32")
    if not _last_axis(softmax, -1, rank):
        return "the softmax is not over the last (experts') axis"
    if not _last_axis(topk, -1, rank):
        return "the top-k is not over the last (experts') axis"
    if not _int_attr(topk, "largest", 1):
        return "smallest-k (largest=0): MoeGatingTopKSoftmax takes the largest"
    if not _int_attr(topk, "sorted", 1):
        return "unsorted top-k (sorted=0): MoeGatingTopKSoftmax returns the k sorted"
    k = match.ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if k is None or len(k) != 1:
        return "k is not a constant"
    experts = (match.dims(x) or [None])[-1]
    sizes = {"k": k[0], "E": experts if isinstance(experts, int) else None}
    broken = moe_gating.MOE_GATING.broken(sizes)
    if broken:
        shown = {name: f"{name}={v}" for name, v in sizes.items() if v is not None}
        return dim_bounds.refusal("MoeGatingTopKSoftmax", broken, shown)
    others = [u.node for u in softmax.outputs[0].uses() if u.node is not topk]
    if others or softmax.outputs[0].is_graph_output():
        return "the router probabilities are read beyond the top-k (MoeGatingTopKSoftmax returns only the k)"
    return None


def apply(model: ir.Model) -> PassResult:
    opset = match.opset(model)
    graph = model.graph
    count, reasons, node_reasons = 0, [], {}
    for topk in moe_candidates(graph):
        why = refusal(topk, opset)
        if why is not None:
            reasons.append(f"{topk.name or 'TopK'}: {why}")
            if topk.name:
                node_reasons[topk.name] = why
            continue
        softmax = topk.inputs[0].producer()
        k = match.ints(topk.inputs[1])[0]
        fused = ir.Node(_DOMAIN, "MoeGatingTopKSoftmax", [softmax.inputs[0]], [ir.AttrInt64("k", k)],
                        num_outputs=2, name=topk.name)
        for new, old in zip(fused.outputs, topk.outputs):
            new.name, new.shape, new.type = old.name, old.shape, old.type
        old_values = list(topk.outputs)
        ir.convenience.replace_nodes_and_values(graph, topk, [softmax, topk], [fused], old_values,
                                                list(fused.outputs))
        count += 1
    if count:
        model.opset_imports.setdefault(_DOMAIN, 1)
    return PassResult(count, sorted(reasons), node_reasons)


def explain(node: ir.Node) -> str | None:
    """The reason a moe candidate TopK was not fused, for a candidate the pass recorded none for (its opset is
    not known here: the fp32-only rule below opset 15 is left out)."""
    return refusal(node, match.MIN_LOW_PRECISION_OPSET)


coverage.register_family(coverage.Family("moe", ("fuse-moe",), moe_candidates, explain))
register_pass("fuse-moe", "TopK(Softmax(router logits)) -> mindspore::MoeGatingTopKSoftmax")(apply)
