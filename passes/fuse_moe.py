"""fuse-moe: an MoE router's TopK(Softmax(logits)) -> mindspore::MoeGatingTopKSoftmax (opmap/fused/moe_gating.py).

transformers' Mixtral, Qwen2-MoE and Qwen3-MoE routers all compute softmax(router_logits.float(), -1), then
topk(k, -1) (Mixtral and Qwen3-MoE with norm_topk_prob then divide by the sum of the k values: that division
stays as exported, as do Qwen2-MoE's shared expert and the experts themselves). MoeGatingTopKSoftmax is exactly
the softmax in fp32 followed by the sorted top k with ties in index order, so the pair fuses when:
the softmax and the top-k run over the last axis of a 2-D or 3-D float tensor (MoeGatingTopKSoftmax's ranks),
the top-k takes the k largest, sorted, with a constant 1 <= k <= min(experts, 1024), and the probabilities are
read by nothing else (the primitive does not return them).

The top-k-first spelling (GPT-OSS, GraniteMoE, Aria, Cohere2-MoE: topk(logits), then a softmax over the k chosen
logits) fuses too, as MoeGatingTopKSoftmax followed by a renormalisation y / sum(y): softmax is monotonic, so
topk(logits) picks topk(softmax(logits))'s experts, and with m = max(logits) (the largest chosen logit) and
S = sum(exp(logits - m)), softmax over the k chosen l_i is exp(l_i - m) / sum_k exp(l_j - m) = p_i / sum_k p_j.
Equal up to rounding (a few ulp), and the same experts but where two distinct logits give equal fp32
probabilities (ones that underflow to 0, about 88 or more below the largest logit, or round to one float): the
index order then decides among the tied probabilities, not the logits, with weights equal to the ulp. Only
fp32 logits (through Casts to fp32 before the softmax): in fp16/bf16 the primitive's y is rounded to x's dtype
before the division, which the unfused graph does not do.

Coverage family "moe" (passes/coverage.py): every TopK whose scores are a Softmax or a Sigmoid (through Casts),
or whose values go on to a Softmax (top-k first, then a softmax over the chosen logits), or whose scores are a
Sigmoid or Softmax plus an expert bias (through a masked_fill's Where: DeepSeek-V3's group-limited choice) with
its indices gathering the chosen experts' weights (AFMoE, DeepSeek-V3, GLM-4-MoE), or whose values go on to a
Sigmoid (through a Cast or a ScatterElements back over the experts: Llama 4); and every ArgMax of router
logits whose index gathers from a Softmax (PhiMoE's sparsemixer). What does not fuse says why: a sigmoid
router, another axis, smallest-k, ...
Not fused (MoE primitives' semantics unconfirmed): the sigmoid + bias routers' FusedAddTopKDiv (docs/fused_ops.md,
"Sigmoid routers"), MoeInitRouting(V2), GroupedMatmul, MoeFinalizeRouting; the experts stay as exported
(batched_mm: each token's expert weights gathered, then a batched matmul).
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


_CHOICE_OPS = ("Add", "Where", "Cast")  # the expert bias, DeepSeek-V3's group mask (masked_fill), casts


def _biased_activation(value: ir.Value | None, hops: int = 4) -> tuple[ir.Node, list[ir.Node]] | None:
    """(the Sigmoid or Softmax, the Add/Where/Cast nodes above it) when `value` is those scores plus an
    expert bias, possibly masked (a Where's either branch: dynamo writes Where(~mask, -inf, s), onnxsim
    Where(mask, s, -inf)): the choice scores of a biased router."""
    p = value.producer() if value is not None else None
    if p is None or not is_default_domain(p.domain) or hops == 0:
        return None
    if p.op_type in ("Sigmoid", "Softmax"):
        return p, []
    if p.op_type not in _CHOICE_OPS:
        return None
    sources = {"Cast": p.inputs[:1], "Where": p.inputs[1:3], "Add": p.inputs[:2]}[p.op_type]
    for src in sources:
        found = _biased_activation(src, hops - 1)
        if found is not None:
            return found[0], [p, *found[1]]
    return None


def _biased_router(topk: ir.Node) -> tuple[ir.Node, list[ir.Node]] | None:
    """A TopK choosing experts by sigmoid/softmax scores plus a bias or masked to the top groups (an Add or a
    Where on the way: onnxsim folds a zero bias away), whose indices gather the chosen experts' weights:
    AFMoE's, DeepSeek-V3's and ERNIE-4.5-MoE's routers. (DeepSeek-V3's group selection TopKs gather nothing:
    one candidate per router.)"""
    found = _biased_activation(topk.inputs[0])
    if found is None or not any(n.op_type in ("Add", "Where") for n in found[1]):
        return None
    return found if match.users(topk.outputs[1], "GatherElements") else None


def _softmax_after(topk: ir.Node) -> tuple[ir.Node, list[ir.Node]] | None:
    """(the Softmax, the Casts between) reading the top-k's values: a softmax over the k chosen logits."""
    value, casts = topk.outputs[0], []
    for _ in range(3):
        uses = [u.node for u in value.uses()]
        if len(uses) != 1 or value.is_graph_output() or not is_default_domain(uses[0].domain):
            return None
        if uses[0].op_type == "Softmax":
            return uses[0], casts
        if uses[0].op_type != "Cast":
            return None
        casts.append(uses[0])
        value = uses[0].outputs[0]
    return None


def _sigmoid_after(topk: ir.Node) -> ir.Node | None:
    """The Sigmoid of the top-k's values, scattered back over the experts or not (Llama 4: topk(logits), the
    k values scattered into a -inf tensor, sigmoid: the chosen experts' sigmoid, the others 0)."""
    value = topk.outputs[0]
    for _ in range(3):
        uses = [u.node for u in value.uses() if is_default_domain(u.node.domain)]
        if len(uses) != 1:
            return None
        if uses[0].op_type == "Sigmoid":
            return uses[0]
        if uses[0].op_type not in ("Cast", "ScatterElements"):
            return None
        value = uses[0].outputs[0]
    return None


def _reads_softmax_values(topk: ir.Node) -> bool:
    return any(u.node.op_type == "Softmax" or (u.node.op_type == "Cast" and match.users(u.node.outputs[0], "Softmax"))
               for u in topk.outputs[0].uses() if is_default_domain(u.node.domain))


def _sparsemixer(node: ir.Node) -> bool:
    """PhiMoE's sparsemixer: an ArgMax of the router logits (a MatMul or Gemm) over the last axis whose index
    gathers from a Softmax (the masked softmax's weight of the chosen expert); its second choice (an ArgMax of
    the logits with the first masked out) is part of the same router."""
    if match.producer(node.inputs[0], "MatMul", "Gemm") is None:
        return False
    gathers = [g for u in node.outputs[0].uses() for g in [u.node, *match.users(u.node.outputs[0], "GatherElements")]
               if is_default_domain(g.domain) and g.op_type == "GatherElements"]
    return any(match.producer(g.inputs[0], "Softmax") is not None for g in gathers)


def moe_candidates(graph: ir.Graph) -> list[ir.Node]:
    """The routers: a TopK over softmax or sigmoid scores, or whose values go to a Softmax, or over biased
    sigmoid/softmax scores gathering the chosen weights; PhiMoE's sparsemixer ArgMax (module docstring)."""
    found = []
    for n in graph:
        if not is_default_domain(n.domain):
            continue
        if n.op_type == "ArgMax" and _sparsemixer(n):
            found.append(n)
        if n.op_type != "TopK":
            continue
        scores = _through_casts(n.inputs[0])
        if scores is not None and is_default_domain(scores.domain) and scores.op_type in ("Softmax", "Sigmoid"):
            found.append(n)
        elif _reads_softmax_values(n) or _biased_router(n) is not None or _sigmoid_after(n) is not None:
            found.append(n)
    return found


def _k_refusal(topk: ir.Node, x: ir.Value) -> str | None:
    """The top-k's own conditions (last axis, largest, sorted, constant k within the primitive's limits)."""
    rank = match.rank(x)
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
    return None


def _renormalised_refusal(topk: ir.Node, softmax: ir.Node, casts: list[ir.Node], opset: int) -> str | None:
    """Why topk(logits) -> softmax over the k is not MoeGatingTopKSoftmax + y / sum(y), or None."""
    if opset < 13:
        return "top-k before the softmax below opset 13: the renormalisation is written with opset 13's ReduceSum"
    x = topk.inputs[0]
    rank = match.rank(x)
    if rank not in (2, 3):
        return f"rank {rank} router logits: MoeGatingTopKSoftmax takes 2-D or 3-D"
    if x.dtype != ir.DataType.FLOAT or any(c.outputs[0].dtype != ir.DataType.FLOAT for c in casts):
        return (f"top-k before the softmax on {x.dtype} logits: MoeGatingTopKSoftmax followed by y / sum(y) is "
                "proven equal for float32 only (y is rounded to x's dtype before the division)")
    if not _last_axis(softmax, -1, match.rank(softmax.inputs[0])):
        return "the softmax over the top-k values is not over their last axis"
    return _k_refusal(topk, x)


def _biased_refusal(topk: ir.Node) -> str:
    activation, path = _biased_router(topk)
    ops = {n.op_type for n in path}
    what = (f"{activation.op_type.lower()} router choosing by "
            + ("scores + an expert bias" if "Add" in ops else "its scores")
            + (" within the top groups (group-limited)" if "Where" in ops else ""))
    if activation.op_type == "Softmax":
        return (f"{what}: MoeGatingTopKSoftmax has no bias or groups, and FusedAddTopKDiv is documented for a "
                "sigmoid only (its activate_type values unconfirmed, docs/fused_ops.md)")
    return (f"{what}: MoeGatingTopKSoftmax computes a softmax, and FusedAddTopKDiv (MindSpore 2.10: no "
            "docstring, no MoeGatingTopK) is unconfirmed: which scores it gathers (with the bias or not), the "
            "masked groups' value (0 or -inf), activate_type, its group limits (docs/fused_ops.md)")


def refusal(topk: ir.Node, opset: int) -> str | None:
    """Why this TopK and its Softmax do not make a MoeGatingTopKSoftmax, or None when they do."""
    if topk.op_type == "ArgMax":
        return ("PhiMoE's sparsemixer router (argmax of the logits, a masked softmax per chosen expert, the "
                "second choice with the first masked out): no MindSpore primitive computes it")
    softmax = match.producer(topk.inputs[0], "Softmax")
    if softmax is None:
        scores = _through_casts(topk.inputs[0])
        if scores is not None and scores.op_type == "Sigmoid":
            return "sigmoid router scores: MoeGatingTopKSoftmax computes a softmax over the experts"
        if scores is not None and scores.op_type == "Softmax":
            return "a Cast between the softmax and the top-k (MoeGatingTopKSoftmax ranks the fp32 probabilities)"
        after = _softmax_after(topk)
        if after is not None:
            return _renormalised_refusal(topk, *after, opset)
        if _reads_softmax_values(topk):
            return "the top-k's values are read beyond the softmax over them"
        if _biased_router(topk) is not None:
            return _biased_refusal(topk)
        if _sigmoid_after(topk) is not None:
            return ("top-k before a sigmoid (the k chosen logits' sigmoid as their weights, Llama 4): "
                    "MoeGatingTopKSoftmax's weights are softmax probabilities, and no MindSpore primitive is "
                    "confirmed to compute sigmoid weights (FusedAddTopKDiv: docs/fused_ops.md)")
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
    why = _k_refusal(topk, x)
    if why:
        return why
    others = [u.node for u in softmax.outputs[0].uses() if u.node is not topk]
    if others or softmax.outputs[0].is_graph_output():
        return "the router probabilities are read beyond the top-k (MoeGatingTopKSoftmax returns only the k)"
    return None


def _renormalise(graph: ir.Graph, topk: ir.Node, k: int) -> None:
    """topk(logits) -> [Casts] -> Softmax  =>  MoeGatingTopKSoftmax(logits) -> y / ReduceSum(y, -1)."""
    softmax, casts = _softmax_after(topk)
    fused = ir.Node(_DOMAIN, "MoeGatingTopKSoftmax", [topk.inputs[0]], [ir.AttrInt64("k", k)], num_outputs=2,
                    name=topk.name)
    y, indices = fused.outputs
    y.name, y.shape, y.type = f"{topk.outputs[0].name}_probs", topk.outputs[0].shape, topk.outputs[0].type
    indices.name, indices.shape, indices.type = topk.outputs[1].name, topk.outputs[1].shape, topk.outputs[1].type
    axes = ir.Node("", "Constant", [], [ir.AttrInt64s("value_ints", [-1])], name=f"{topk.name}_axes")
    total = ir.Node("", "ReduceSum", [y, axes.outputs[0]], [ir.AttrInt64("keepdims", 1)], name=f"{topk.name}_sum")
    div = ir.Node("", "Div", [y, total.outputs[0]], name=f"{topk.name}_renorm")
    old = softmax.outputs[0]
    div.outputs[0].name, div.outputs[0].shape, div.outputs[0].type = old.name, old.shape, old.type
    ir.convenience.replace_nodes_and_values(graph, topk, [topk, *casts, softmax], [fused, axes, total, div],
                                            [topk.outputs[1], old], [indices, div.outputs[0]])


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
        k = match.ints(topk.inputs[1])[0]
        if match.producer(topk.inputs[0], "Softmax") is None:  # top-k first: renormalised (docstring)
            _renormalise(graph, topk, k)
            count += 1
            continue
        softmax = topk.inputs[0].producer()
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
    not known here: the fp32-only rule below opset 15 and the renormalised form's opset 13 are left out)."""
    return refusal(node, match.MIN_LOW_PRECISION_OPSET)


coverage.register_family(coverage.Family("moe", ("fuse-moe",), moe_candidates, explain))
register_pass("fuse-moe", "TopK(Softmax(router logits)), or Softmax(TopK(logits)) -> "
                          "mindspore::MoeGatingTopKSoftmax (renormalised)")(apply)
