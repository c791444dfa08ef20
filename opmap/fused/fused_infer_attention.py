"""mindspore::FusedInferAttentionScore(query, key, value, attn_mask, real_shift; scale, head_num, kv_head_num,
mask_kind, input_layout, sparse_mode[, dtype]) -> attention_out, MindSpore's `ops.fused_infer_attention_score`
(docs/fused_ops.md, "Generation-time attention"): attention over a KV cache, one primitive for prefill and decode
(a query of length 1 takes its IncreFlashAttention branch, a longer one PromptFlashAttention's).

The fusion (passes/attention/flash.py) chooses it for an SDPA whose keys and values are a cache: a Concat of
a graph input (the past keys/values) and the new ones along the sequence axis, as every decode-step export
writes it. Same semantics as FlashAttentionScore's reference body (opmap/fused/flash_attention.py), whose
body it shares: BNSD, GQA as query head n -> kv head n // (N1/N2), S = Q.K^T * scale + mask, softmax, P.V.
Only without a position bias (real_shift a scalar 0: where pse_shift enters FIAS is UNCONFIRMED).

Ascend lowering, checked against mindspore 2.10's signature: `fused_infer_attention_score(query, key, value,
atten_mask=, num_heads=N1, scale=, input_layout="BNSD", num_key_value_heads=N2, sparse_mode=0)`; its
pre_tokens/next_tokens keep their defaults (2147483647, no band: unlike PromptFlashAttention's next_tokens
0). The mask is the same uint8 discard mask (1 = discard) as FlashAttentionScore's, (B, 1, S1, S2): for a
query of length 1 that is (B, 1, 1, KV_S), a shape the docstring recommends. Left padding sits at the start
of the cache, so it goes through the mask and actual_seq_lengths(_kv) stay None (the full lengths): a valid
prefix length would be wrong for a left-padded row. q/k/v in fp16 (bf16 models: bf16), as for
FlashAttentionScore; the output is the first of the primitive's two (attention_out, softmax_lse).
"""

from __future__ import annotations

import dataclasses

from opmap.fused.flash_attention import FLASH_ATTENTION_SCORE, ascend_qkv, discard_mask
from opmap.fused.record import Constraint, define
from opmap.registry import register

_DOCSTRING = "mindspore 2.10 ops.fused_infer_attention_score docstring"
# Beyond FlashAttentionScore's (an SDPA reaches this choice only through that record's checks): its "num_heads
# / num_key_value_heads not greater than 64" and the limits it lists for both branches (B at most 65535 in its
# PromptFlashAttention branch, 65536 in IncreFlashAttention's).
CONSTRAINTS = (
    Constraint("N1/N2 at most 64", _DOCSTRING, ("N1", "N2"), lambda N1, N2: N1 // N2 <= 64),
    Constraint("B at most 65535", _DOCSTRING, ("B",), lambda B: B <= 65535),
    Constraint("N1 at most 256", _DOCSTRING, ("N1",), lambda N1: N1 <= 256),
    Constraint("D at most 512", _DOCSTRING, ("D",), lambda D: D <= 512),
    Constraint("S1 and S2 at most 20M (20971520)", _DOCSTRING, ("S1", "S2"),
               lambda S1, S2: max(S1, S2) <= 20971520),
)

# FlashAttentionScore's record with this primitive's name: the same inputs, attributes and reference bodies.
FUSED_INFER_ATTENTION_SCORE = define(dataclasses.replace(
    FLASH_ATTENTION_SCORE, name="FusedInferAttentionScore", primitive="FusedInferAttentionScore", doc=__doc__,
    likely_causes="mask polarity (1 = discard), scale, head counts, the cache's sequence axis, fp16 casts",
    constraints=CONSTRAINTS))


@register("FusedInferAttentionScore", since=1, domain="mindspore")
def lower_fused_infer_attention_score(n):
    model_dt, compute, _, (q, k, v) = ascend_qkv(n)
    shift = n.const(4) if n.has(4) else None
    if shift is None or shift.size != 1 or float(shift.reshape(-1)[0]) != 0.0:
        n.fail("FusedInferAttentionScore is emitted without a position bias (real_shift must be a scalar 0)")
    head_num, kv_heads, scale = int(n.attr("head_num")), int(n.attr("kv_head_num")), float(n.attr("scale"))
    out = n.call("ops.fused_infer_attention_score", q, k, v, atten_mask=discard_mask(n, head_num),
                 num_heads=head_num, scale=scale, input_layout="BNSD", num_key_value_heads=kv_heads,
                 sparse_mode=0)
    out = n.getitem(out, 0)
    if model_dt != compute:
        out = n.call("ops.cast", out, n.ms_dtype(model_dt))
    return out
