"""fuse-attention: scaled-dot-product attention -> mindspore::FlashAttentionScore (BNSD, MHA and GQA, masks).

Fused in stages through an intermediate op, graphconv::SDPA (passes/attention/sdpa.py gives its exact
semantics), the way onnxscript's ort_fusions stage sdpa -> gqa; each stage is a small rule set in
passes/attention/ whose docstring lists the spellings it understands and what it refuses:
  1. scores       the exporters' MatMul/scale/mask/Softmax/MatMul (eager, torch's SDPA decomposition with its
                  sqrt-scales, safe softmax and reshaped kᵀ, fp16 Cast islands, Bloom's flattened B·N
                  layout with ALiBi) and opset 23's Attention -> SDPA(q, k, v, mask, bias)
  2. head_repeat  SDPA(q, repeat(k), repeat(v)) -> SDPA(q, k, v) (HF repeat_kv, repeat_interleave: GQA)
  3. mask         the mask proven 0 / large negative; bool Where masks made additive
  4. flash        SDPA -> FlashAttentionScore (head dim, dtype and head-count limits of the primitive)
An SDPA no stage took to the end is expanded back into standard ONNX (the candidate is refused with the
reason its stage gave; the graph computes as before). The stages do not remove what they matched: the
producers that only fed the attention (scales, kᵀ, the kv repeat, dynamo's Shape arithmetic) die with it
and the rule sets' dead-node removal takes them.

Coverage candidates (passes/coverage.py, family "attention"): every Softmax and every opset-23 Attention node.
The SDPA node and, when refused, its expansion's Softmax carry the candidate's name, so a reason given at
any stage is the candidate's. A candidate no rule matched is explained by `explain`, which runs stage 1's
analysis from it.
"""

from __future__ import annotations

import onnx_ir as ir

from passes import coverage, match
from passes.attention import flash, head_repeat, mask, scores, sdpa
from passes.manager import staged_rewrite_pass

PASS = staged_rewrite_pass(
    "fuse-attention", "scaled-dot-product attention (MatMul/scale/mask/Softmax/MatMul, MHA and GQA; opset-23 "
    "Attention) -> mindspore::FlashAttentionScore, staged through graphconv::SDPA",
    [scores.rules, head_repeat.rules, mask.rules, flash.rules], finish=sdpa.expand_leftovers)


def explain(node: ir.Node) -> str | None:
    """Why an attention candidate (a Softmax or an opset-23 Attention) was not fused when no stage recorded a
    reason: stage 1's own analysis run from the candidate (passes/coverage.py asks)."""
    opset = match.opset(node.graph) if node.graph is not None else 0
    try:
        if node.op_type == "Attention":
            scores.analyze_native(node, opset)
        else:
            _, v, _ = scores.probabilities(node)
            logits = node.inputs[0]
            island = match.producer(logits, "Cast")
            if island is not None and node.outputs[0].uses() and node.outputs[0].uses()[0].node.op_type == "Cast":
                logits = island.inputs[0]
            scores.analyze(logits, v, node, opset)
    except scores.Refused as e:
        return str(e)
    return None


coverage.set_explain("attention", explain)
