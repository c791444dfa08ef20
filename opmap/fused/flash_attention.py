"""mindspore::FlashAttentionScore(query, key, value, attn_mask, real_shift; scale, head_num, kv_head_num,
mask_kind, input_layout, sparse_mode[, dtype]) -> attention_out, MindSpore's `ops.flash_attention_score`
(docs/fused_ops.md).

Layout BNSD: query (B, N1, S1, D), key and value (B, N2, S2, D), output (B, N1, S1, D). GQA: N1 is a multiple
of N2 and query head n reads kv head n // (N1 / N2) (repeat_interleave of the kv heads, as HF's repeat_kv).

attn_mask is additive (float, broadcastable to (B, N1, S1, S2)), added to the scaled scores: 0 keeps, a
large negative discards. The pass proved its values are 0 or <= -1e4 (or -inf), so the ascend lowering's
discard mask (FlashAttentionScore's polarity: 1 = discard) is exactly `attn_mask < 0`, broadcast to
(B, 1, S1, S2) (or (B, N1, S1, S2) for a per-head mask), with sparse_mode 0. mask_kind records what the graph
had: "additive" (its own mask), "keep_bool" / "discard_bool" (a Where(c, scores, fill) / Where(c, fill,
scores) on a bool mask: the pass feeds Where(c, 0, fill) / Where(c, fill, 0) instead, which leaves every
partly masked row's softmax bit-identical: S + fill rounds to fill, or underflows in exp like fill), or "none"
(attn_mask is a scalar 0).
(Why not the bool mask itself: one typed function input cannot be a float mask at one call and a bool mask
at another, and an ONNX function body cannot branch on a missing input; two inputs would need placeholders,
and the ascend cost of Where(c, 0, fill) < 0 instead of not(c) is one elementwise op on the mask.)

real_shift (the primitive's `pse`) is an additive position bias, added to Q . K^T BEFORE the scale: docs/fused_ops.md,
and CANN's aclnnFlashAttentionScoreV2, whose pse_type 1 "is the FlashAttentionScore formula" while its other
types "mul first, then add". Any shape broadcastable to (B, N1, S1, S2) here; the ascend lowering expands it
to (B|1, N1, S1, S2), the shapes MindSpore's check takes (full_real_shift). A scalar
0 means none (the ascend lowering passes None). ALiBi (Bloom: scores = inv_norm * Q . K^T + alibi) arrives as
real_shift = alibi / inv_norm.

Reference body, fp32: repeat the kv heads (n -> n // (N1/N2), a Gather whose indices come from the
head-count attributes alone, so the cpu lowering folds them into a constant; Range, so opset 11 and up);
S = (Q . K^T + real_shift) * scale +
max(attn_mask, -1e30); P = Softmax(S, -1); O = P . V; cast back to query's dtype. (-inf in the mask is clamped to -1e30:
the probabilities are the same in every row that keeps a key, and MindSpore's CPU
softmax in graph mode turns other rows to NaN when some row is all -inf, which the cpu twin would otherwise
hit on padded rows.) The ascend-precision body is the same with q/k/v and the output rounded through fp16,
(and real_shift) as the ascend lowering casts them around the fp16-only primitive (the compile measures that
effect at fp16 tolerance). Fully masked rows are undefined on Ascend (never compared).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from opmap.fused.record import (Constraint, FusedOp, attr_constant, define, from_fp32, int64_constant,
                                rounded_to_fp32)
from opmap.registry import register

ATTRIBUTES = ("scale", "head_num", "kv_head_num", "mask_kind", "input_layout", "sparse_mode", "dtype")
MASK_KINDS = ("none", "additive", "keep_bool", "discard_bool")
MASK_FLOOR = -1e30  # where the body clamps -inf mask values
_COMPUTE = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}




def _make_body(round_to: int | None):
    """The body; with round_to (a TensorProto dtype) q/k/v and the output are rounded through that dtype."""

    def body(opset: int) -> list[onnx.NodeProto]:
        nodes: list[onnx.NodeProto] = []

        nodes += rounded_to_fp32("query", "q32", round_to)
        nodes += rounded_to_fp32("key", "k32", round_to)
        nodes += rounded_to_fp32("value", "v32", round_to)
        # (the ascend lowering casts real_shift to the compute dtype as well)
        nodes += rounded_to_fp32("real_shift", "pse32", round_to)
        nodes += [
            attr_constant("n1", "value_int", "head_num"),
            attr_constant("n2", "value_int", "kv_head_num"),
            helper.make_node("Div", ["n1", "n2"], ["rep"]),                   # N1 / N2
            int64_constant("zero", 0), int64_constant("one", 1),
            helper.make_node("Range", ["zero", "n1", "one"], ["heads"]),      # 0 .. N1-1
            helper.make_node("Div", ["heads", "rep"], ["kv_heads"]),          # n // (N1 / N2)
        ]
        for t in ("k", "v"):  # (B, N2, S2, D) -> (B, N1, S2, D): a gather of the kv heads (constant indices)
            nodes.append(helper.make_node("Gather", [f"{t}32", "kv_heads"], [f"{t}_rep"], axis=1))
        nodes += [
            helper.make_node("Transpose", ["k_rep"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q32", "k_t"], ["qk"]),
            helper.make_node("Add", ["qk", "pse32"], ["qk_pse"]),  # (+ 0 when there is no bias: exact)
            attr_constant("scale_v", "value_float", "scale"),
            helper.make_node("Mul", ["qk_pse", "scale_v"], ["scores"]),
            helper.make_node("Cast", ["attn_mask"], ["mask_raw"], to=TensorProto.FLOAT),
            # -inf -> -1e30: finite, so a fully masked row stays finite, and softmax is unchanged. Not fp32's
            # lowest: MindSpore 2.10's CPU maximum against a broadcast constant below about -3e38 returns -inf
            # for -inf inputs (measured), and the NaN of such a row leaks into valid rows as 0 * NaN.
            helper.make_node("Constant", [], ["lowest"], value=numpy_helper.from_array(
                np.array(MASK_FLOOR, np.float32), "lowest")),
            helper.make_node("Max", ["mask_raw", "lowest"], ["mask32"]),
            helper.make_node("Add", ["scores", "mask32"], ["masked"]),
            helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
            helper.make_node("MatMul", ["probs", "v_rep"], ["o32" if round_to is None else "o32_full"]),
        ]
        if round_to is not None:
            nodes += rounded_to_fp32("o32_full", "o32", round_to)
        # (before opset 15 no CastLike back to the query's dtype: the fusion takes fp32 only there)
        nodes.append(from_fp32(opset, "o32", "query", "attention_out"))
        return nodes

    return body


_DOCSTRING = "mindspore 2.10 ops.flash_attention_score docstring"
# Its "Value range" list of B, N1, N2, S1, S2 and D (sizes over q (B, N1, S1, D) and k (B, N2, S2, D)).
CONSTRAINTS = (
    Constraint("D a multiple of 16 and at most 512", _DOCSTRING, ("D",), lambda D: D % 16 == 0 and D <= 512),
    Constraint("N1 at most 256", _DOCSTRING, ("N1",), lambda N1: N1 <= 256),
    Constraint("N2 a factor of N1", _DOCSTRING, ("N1", "N2"), lambda N1, N2: N2 > 0 and N1 % N2 == 0),
    Constraint("B at most 2k (read as 2048)", _DOCSTRING, ("B",), lambda B: B <= 2048),
    Constraint("S1 at most 512k", _DOCSTRING, ("S1",), lambda S1: S1 <= 512 * 1024),
    Constraint("S2 at most 512k", _DOCSTRING, ("S2",), lambda S2: S2 <= 512 * 1024),
)

FLASH_ATTENTION_SCORE = define(FusedOp(
    name="FlashAttentionScore", inputs=("query", "key", "value", "attn_mask", "real_shift"),
    outputs=("attention_out",), attributes=ATTRIBUTES, body=_make_body(None), primitive="FlashAttentionScore",
    doc=__doc__, ascend_body=_make_body(TensorProto.FLOAT16), producer="fuse-attention", family="attention",
    as_is_inputs=(3,), ascend_compute="fp16",
    likely_causes="mask polarity (1 = discard), scale, head counts, real_shift before the scale, fp16 casts of q/k/v",
    constraints=CONSTRAINTS))


def compute_dtype(model_dtype: ir.DataType | None, requested: str | None) -> ir.DataType:
    """The dtype FlashAttentionScore runs in: the node's `dtype` ("fp16" / "bf16") if given, else the model's
    own when it is fp16/bf16, else fp16."""
    if requested is not None:
        return _COMPUTE[requested]
    if model_dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return model_dtype
    return ir.DataType.FLOAT16


def ascend_qkv(n):
    """The checked compute dtype, its MindSpore dtype, and q/k/v cast to it: the primitives of this family take
    fp16/bf16 only (docs/fused_ops.md)."""
    layout, sparse_mode = n.attr("input_layout", "BNSD"), int(n.attr("sparse_mode", 0))
    if layout != "BNSD" or sparse_mode != 0:
        n.fail(f"only input_layout BNSD with sparse_mode 0 is emitted (got {layout}, {sparse_mode})")
    requested = n.attr("dtype", None)
    if requested is not None and requested not in _COMPUTE:
        n.fail(f"dtype must be one of {', '.join(_COMPUTE)}, not {requested!r}")
    model_dt = n.dtype(0)
    compute = compute_dtype(model_dt, requested)
    cdt = n.ms_dtype(compute)
    qkv = [n.x(i) if model_dt == compute else n.call("ops.cast", n.x(i), cdt) for i in range(3)]
    return model_dt, compute, cdt, qkv


def discard_mask(n, head_num: int):
    """The attention mask input (3) as the primitives' uint8 discard mask (1 = discard) broadcast to
    (B, 1, S1, S2), or (B, N1, S1, S2) for a per-head mask; None for mask_kind none.

    A row that discards every key (a left-padded query row of a prompt) keeps every key instead. The kernels'
    output for a fully discarded row is not defined unless inner_precise enables their row-invalid correction,
    which FusedInferAttentionScore supports only for query lengths > 1 (its 2.10 docstring), while one
    generation graph serves both lengths; and a row left undefined (NaN) would reach the valid rows through the
    next layer's P.V. Keeping every key is what the reference body computes for such a row (its mask clamped
    to -1e30 shifts the whole row, which softmax ignores) and what transformers' SDPA path does for padded rows."""
    kind = n.attr("mask_kind", "none")
    if kind not in MASK_KINDS:
        n.fail(f"unknown mask_kind {kind!r}")
    if kind == "none":
        return None
    discard = n.named(n.call("ops.less", n.x(3), 0.0), "discard")  # values proven 0 or <= -1e4 / -inf
    shape = n.shape(3) or []
    heads = head_num if len(shape) >= 3 and shape[-3] == head_num and head_num != 1 else 1
    full = n.call("ops.logical_or", discard, _zeros_like_scores(n, heads, ir.DataType.BOOL))
    dead_rows = n.call("ops.all", full, -1, True)
    full = n.named(n.call("ops.logical_and", full, n.call("ops.logical_not", dead_rows)), "discard_rows_kept")
    return n.call("ops.cast", full, n.ms_dtype(ir.DataType.UINT8))


def full_real_shift(n, pse, head_num: int):
    """real_shift in a shape MindSpore's FlashAttentionScore accepts: its shape inference (ops/infer/ops_func_impl/
    flash_attention_score.cc) takes (B, N1, S1, S2) and (1, N1, S1, S2) (and S1 = 1024 rows, not used here) and
    throws on any other, though CANN's list also has (B, N1, 1, S2). So a bias broadcast over the query rows
    (Bloom's ALiBi), the heads or part of the batch is expanded, as MindFormers builds its full (B, N, S, S) bias;
    one already full is passed as it is."""
    shape, q = n.shape(4) or [], n.shape(0) or []
    if len(shape) == 4 and len(q) == 4 and shape[0] in (1, q[0]) and shape[0] is not None \
            and shape[1] == head_num and shape[2] is not None and shape[2] == q[2]:
        return pse
    zeros = _zeros_like_scores(n, head_num, n.dtype(4), batch_one=len(shape) == 4 and shape[0] == 1)
    return n.named(n.call("ops.add", pse, zeros), "real_shift")


def _zeros_like_scores(n, heads: int, dtype, batch_one: bool = False):
    """Zeros of the scores' shape (B, heads, S1, S2) (B 1 with `batch_one`), from q's and k's run-time shapes:
    adding them broadcasts a mask or a bias to a shape the primitives take."""
    q_dims, k_dims = n.call("ops.dyn_shape", n.x(0)), n.call("ops.dyn_shape", n.x(1))
    batch = n.const_tensor(np.array([1], np.int64), "one") if batch_one else n.getitem(q_dims, slice(0, 1))
    target = n.call("ops.concat", n.tuple(batch, n.const_tensor(np.array([heads], np.int64), "heads"),
                                          n.getitem(q_dims, slice(2, 3)), n.getitem(k_dims, slice(2, 3))))
    return n.call("ops.zeros", n.call(n.helper("onnx_dims"), target), n.ms_dtype(dtype))


@register("FlashAttentionScore", since=1, domain="mindspore")
def lower_flash_attention_score(n):
    model_dt, compute, cdt, (q, k, v) = ascend_qkv(n)
    head_num, scale = int(n.attr("head_num")), float(n.attr("scale"))
    mask = discard_mask(n, head_num)
    pse = None
    shift = n.const(4) if n.has(4) else np.zeros(())
    if shift is None or shift.size != 1 or float(shift.reshape(-1)[0]) != 0.0:  # not a scalar 0: a real bias
        pse = full_real_shift(n, n.x(4), head_num)
        pse = pse if n.dtype(4) == compute else n.call("ops.cast", pse, cdt)
    out = n.call("ops.flash_attention_score", q, k, v, head_num, real_shift=pse, attn_mask=mask, keep_prob=1.0,
                 scalar_value=scale, input_layout="BNSD", sparse_mode=0)
    if model_dt != compute:
        out = n.call("ops.cast", out, n.ms_dtype(model_dt))
    return out
