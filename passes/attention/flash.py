"""Stage 4 of fuse-attention: graphconv::SDPA -> mindspore::FlashAttentionScore, where the primitive can take it;
attention over a KV cache (keys and values a Concat of a graph input, the past, and the new ones along the
sequence axis: a decode-step graph) -> mindspore::FusedInferAttentionScore (opmap/fused/fused_infer_attention.py),
the primitive whose query-length-1 branch is IncreFlashAttention, when it has no position bias, N1/N2 <= 64 and a
mask of one of its documented shapes (no per-head mask).

FlashAttentionScore (opmap/fused/flash_attention.py) takes BNSD q/k/v of one float dtype with a static head
dim that is a multiple of 16 and at most 512, N1 a multiple of N2 (it does GQA itself), an additive mask
(the SDPA's, proven by stage mask.py; a scalar 0 for none) and an additive position bias `real_shift` added
BEFORE the scale: the SDPA's bias (added after it) goes in as bias / scale.
Values of a smaller static head dim than the query's and key's (MLA: DeepSeek-V2/V3, MiniCPM3, Kimi; q and k
carry 128 + 64 rotary dims, v 128) are padded with zeros to it, and the output cut back: the padded columns of
the output are zeros, the others exactly the attention over the values given. This is what transformers does
for its flash-attention path (`F.pad(value_states, [0, qk_head_dim - v_head_dim])`) and what vLLM's DeepSeek-V2
and MiniCPM3 attention do without an MLA kernel.
Refused here: dtypes other than one of fp32/fp16/bf16 (below opset 15, fp32 only: the reference body cannot
express the others), a non-static head count or head dim, a head dim not a multiple of 16 or > 512, q/k head
dims that disagree, a value head dim larger than theirs, head counts that disagree, batch or key lengths that
disagree, q heads not a multiple of kv heads, a mask not proven (stage mask.py gave the reason).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.onnx_domains import is_default_domain
from opmap.fused.flash_attention import FLASH_ATTENTION_SCORE
from opmap.fused.fused_infer_attention import FUSED_INFER_ATTENTION_SCORE
from passes import dim_bounds, manager, match, stateful_cache
from passes.attention.scores import Refused
from passes.attention.sdpa import Sdpa, SdpaRule


def call_sizes(s: Sdpa, model: ir.Model | None = None) -> tuple[dict, dict]:
    """The largest B, N1, N2, S1, S2, D of the call (passes/dim_bounds.py), and each as a refusal shows it."""
    sizes, shown = dim_bounds.sizes(model, s.q, {"B": 0, "N1": 1, "S1": 2, "D": 3})
    more, more_shown = dim_bounds.sizes(model, s.k, {"N2": 1, "S2": 2})
    return {**sizes, **more}, {**shown, **more_shown}


def check(s: Sdpa, opset: int, model: ir.Model | None = None) -> tuple[int, int]:
    """(N1, N2) when FlashAttentionScore can compute the SDPA, else Refused. `model` carries the dims' bounds
    for the record's constraints (without it, the static sizes are checked)."""
    dtypes = {s.q.dtype, s.k.dtype, s.v.dtype}
    if len(dtypes) != 1 or not dtypes <= match.FLOATS:
        raise Refused(f"q/k/v dtypes {sorted(str(d) for d in dtypes)}: FlashAttentionScore takes one float dtype "
                      "(fp32 inputs are cast to fp16)")
    if opset < 11:
        raise Refused("below opset 11 the reference body cannot be written (it needs Range)")
    if opset < match.MIN_LOW_PRECISION_OPSET and s.q.dtype != ir.DataType.FLOAT:
        raise Refused(f"below opset {match.MIN_LOW_PRECISION_OPSET} the reference body can only express fp32")
    qd, kd, vd = match.dims(s.q), match.dims(s.k), match.dims(s.v)
    n1, d = qd[1], qd[3]
    if not isinstance(n1, int) or not isinstance(d, int):
        raise Refused(f"the query's head count and head dim must be static (shape {qd})")
    if kd[3] != d or not isinstance(vd[3], int) or vd[3] > d:
        raise Refused(f"head dims q={d}, k={kd[3]}, v={vd[3]}: q and k differ or v is larger"
                      if isinstance(vd[3], int) else f"head dims q={d}, k={kd[3]}, v={vd[3]}: v's is not static")
    if not (match.may_equal(qd[0], kd[0]) and match.may_equal(qd[0], vd[0]) and match.may_equal(kd[2], vd[2])):
        raise Refused(f"batch or key length of q {qd}, k {kd}, v {vd} disagree")
    n2 = kd[1]
    if not isinstance(n2, int) or n2 != vd[1]:
        raise Refused(f"key and value head counts differ ({n2} vs {vd[1]})")
    sizes, shown = call_sizes(s, model)
    broken = FLASH_ATTENTION_SCORE.broken(sizes)
    if broken:
        raise Refused(dim_bounds.refusal("FlashAttentionScore", broken, shown))
    if s.mask is not None and not s.mask_proven:
        raise Refused("the mask is not proven 0 / large negative")
    return n1, n2


def is_cache(value: ir.Value) -> bool:
    """A KV cache as exports write it: Concat along the sequence axis (2 of BNSD) of a graph input (the past)
    and the new values; or a cache held in place (passes/stateful_cache.py)."""
    node = value.producer()
    if node is not None and (node.domain, node.op_type) == (stateful_cache.DOMAIN, stateful_cache.OP):
        return True
    if node is None or node.op_type != "Concat" or not is_default_domain(node.domain):
        return False
    axis = node.attributes["axis"].value if "axis" in node.attributes else None
    rank = value.shape.rank() if value.shape is not None else None
    if axis is None or rank != 4 or axis % 4 != 2:
        return False
    graph_inputs = set(node.graph.inputs) if node.graph is not None else set()
    return len(node.inputs) == 2 and node.inputs[0] in graph_inputs


def infer_attention_refusal(s: Sdpa, n1: int, n2: int, model: ir.Model | None = None) -> str | None:
    """Why FusedInferAttentionScore cannot take the call, or None: its documented limits beyond
    FlashAttentionScore's (its record's constraints: N1 / N2 at most 64, ...), and a mask of a documented shape,
    which has no per-head form ((B|1, 1, S1, S2) and lower ranks). Refused, FlashAttentionScore, which takes
    both, reads the cache."""
    mask = (match.dims(s.mask) if s.mask is not None else None) or []
    if len(mask) == 4 and mask[1] == n1 and n1 != 1:
        return f"FusedInferAttentionScore needs a mask of a documented shape, (B|1, 1, S1, S2), not the per-head {mask}"
    sizes, shown = call_sizes(s, model)
    shown.update({"N1": f"N1={n1}", "N2": f"N2={n2}"})
    broken = FUSED_INFER_ATTENTION_SCORE.broken({**sizes, "N1": n1, "N2": n2})
    return None if broken is None else dim_bounds.refusal("FusedInferAttentionScore", broken, shown)


class ToFlashAttention(SdpaRule):
    def __init__(self):
        super().__init__("FlashAttentionScore")

    def check(self, context, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        s = Sdpa.read(out.producer())
        try:
            self._heads = check(s, match.opset(context), context.model)
        except Refused as e:
            return result.fail(str(e), out.producer())
        self._sdpa, self._model = s, context.model
        return result

    def rewrite(self, op, out, **_):
        s, (n1, n2) = self._sdpa, self._heads
        zero = op.Constant(value=ir.tensor(np.array(0.0, np.float32)))
        mask = s.mask if s.mask is not None else zero
        # scale·qk + bias = (qk + bias/scale)·scale: FlashAttentionScore's real_shift
        pse = zero if s.bias is None else \
            op.Mul(s.bias, op.Constant(value=ir.tensor(np.array(1.0 / s.scale, s.bias.dtype.numpy()))))
        kind = "FlashAttentionScore"
        if s.bias is None and is_cache(s.k) and is_cache(s.v):
            refusal = infer_attention_refusal(s, n1, n2, self._model)
            if refusal is None:
                kind = "FusedInferAttentionScore"
            elif self._model is not None:
                manager.note(self._model, f"{out.producer().name}: attention over the KV cache runs as "
                                          f"FlashAttentionScore, not FusedInferAttentionScore: {refusal}")
        d, dv = match.dims(s.q)[3], match.dims(s.v)[3]
        v = s.v if dv == d else op.Pad(s.v, op.Constant(value=ir.tensor(np.array([0] * 7 + [d - dv], np.int64))))
        result = getattr(op, kind)(s.q, s.k, v, mask, pse, _domain="mindspore", scale=float(s.scale),
                                   head_num=n1, kv_head_num=n2, mask_kind=s.mask_kind, input_layout="BNSD",
                                   sparse_mode=0)
        result.dtype = out.dtype
        if dv == d:
            result.shape = out.shape
            return result
        result.shape = ir.Shape([*list(out.shape)[:3], d]) if out.shape is not None else None
        cut = op.Slice(result, *(op.Constant(value=ir.tensor(np.array([v], np.int64))) for v in (0, dv, 3)))
        cut.dtype, cut.shape = out.dtype, out.shape
        return cut


def rules() -> pattern.RewriteRuleSet:
    """The stage's rules, new for each application (why: passes.manager.rewrite_pass); a check hands its
    analysis to its rewrite on the rule instance."""
    return pattern.RewriteRuleSet([ToFlashAttention.rule()])
