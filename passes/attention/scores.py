"""Stage 1 of fuse-attention: the exporters' softmax attention (and opset 23's Attention) -> graphconv::SDPA.

The rule anchors on MatMul(P, v), P the Softmax(logits, axis=-1) — also inside the fp32 Cast island fp16/bf16
models put around it, as torch's SDPA "safe softmax" Where(IsNaN(p), 0, p), or reshaped back to (B·N, S1, S2)
(Bloom). `probabilities` follows the chain down from the Softmax; `analyze` reads the producers of `logits`,
because the exporters spell the rest in too many ways for a product of pattern alternatives (and dynamo's kᵀ
reshapes read the repeated key's Shape, a use outside any pattern):
  mask   Add(scores, mask) either order, Where(keep, scores, fill), Where(discard, fill, scores), or none:
         taken as it is (stage mask.py proves it is a mask);
  scale  any chain of Mul/Div by scalar constants on the scores, on q, on kᵀ, or on q and kᵀ (torch's SDPA
         export scales q and kᵀ by sqrt(scale) each); none at all is scale 1;
  kᵀ     Transpose(k, perm) of any 4-D perm swapping into (B, N, D, S); Reshape(Transpose(Reshape(k, (-1, S,
         D)), 021), (B, N, D, S)) (dynamo's SDPA decomposition); or any other (B, N, D, S) value (a
         Transpose is added);
  flat   Bloom: q/k/v BNSD reshaped to (B·N, S, D), scores Reshape(scale · q3 @ Transpose(k3, 021) + alibi,
         (B, N, S1, S2)), P reshaped back to 3-D for the bmm with v3: SDPA gets the BNSD sources, the ALiBi
         (B·N, 1|S1, S2) as its bias (B, N, 1|S1, S2), and its output is reshaped back to (B·N, S1, D).
Refused here: opset < 13, a Softmax not over the last axis, probabilities used elsewhere, an MoE router's
Softmax (its result goes to TopK), soft-capped scores c·tanh(s/c) (Gemma-2: FlashAttentionScore has no
soft-capping argument), a scale that is not a positive finite constant, q/k/v not 4-D; opset 23's Attention
with past key/value, used present/qk outputs, is_causal, softcap, a window, or 3-D inputs.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes import match
from passes.attention.sdpa import Sdpa


class Refused(Exception):
    """A candidate that must not fuse; the message is the skip reason."""


def _peel_scales(value: ir.Value) -> tuple[ir.Value, float]:
    """Strip Mul/Div by scalar constants off `value`; returns the source and the product of the factors."""
    scale = 1.0
    while True:
        mul, div = match.producer(value, "Mul"), match.producer(value, "Div")
        if mul is not None:
            a, b = mul.inputs
            if match.scalar(b) is not None:
                scale, value = scale * match.scalar(b), a
                continue
            if match.scalar(a) is not None:
                scale, value = scale * match.scalar(a), b
                continue
        if div is not None and match.scalar(div.inputs[1]) is not None and match.scalar(div.inputs[1]) != 0:
            scale, value = scale / match.scalar(div.inputs[1]), div.inputs[0]
            continue
        return value, scale


def _scores(value: ir.Value):
    """(q, kᵀ, scale) when `value` is a scaled MatMul(q, kᵀ), else None."""
    raw, scale = _peel_scales(value)
    mm = match.producer(raw, "MatMul")
    if mm is None:
        return None
    q, sq = _peel_scales(mm.inputs[0])
    kt, sk = _peel_scales(mm.inputs[1])
    return q, kt, scale * sq * sk


def _unflatten(x3: ir.Value) -> ir.Value | None:
    """x (B, N, S, D) when x3 = Reshape(x) to (B·N, S, D): N and D static, S the same dim on both sides (so
    the first axis can only be B·N); else None. (TorchScript's Reshape(x, Concat(Shape(.)[0]·N, -1, D)) has
    x's S only once refine-shapes proved it from the shape arithmetic.)"""
    r = match.producer(x3, "Reshape")
    src = r.inputs[0] if r is not None else None
    sd, od = match.dims(src), match.dims(x3)
    if sd is None or od is None or len(sd) != 4 or len(od) != 3:
        return None
    if not (isinstance(sd[1], int) and isinstance(sd[3], int) and od[2] == sd[3] and od[1] == sd[2]
            and od[1] is not None):
        return None
    if isinstance(od[0], int) and isinstance(sd[0], int) and od[0] != sd[0] * sd[1]:
        return None
    return src


@dataclasses.dataclass
class FlatScores:
    """Bloom's scores over a flattened batch·heads axis: Reshape(scale · q3 @ Transpose(k3, 021) [+ bias],
    (B, N, S1, S2)), q3 and k3 (B·N, S, D) reshapes of BNSD q and k; `bias` (B·N, 1|S1, S2) is ALiBi."""

    q: ir.Value
    k: ir.Value
    scale: float
    bias: ir.Value | None


def _flat_scores(value: ir.Value) -> FlatScores | None:
    view = match.producer(value, "Reshape")
    if view is None or match.rank(view.inputs[0]) != 3 or match.rank(value) != 4:
        return None
    inner, bias = view.inputs[0], None
    add = match.producer(inner, "Add")
    if add is not None:
        for s, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            if _scores(s) is not None:
                inner, bias = s, b
                break
    found = _scores(inner)
    if found is None:
        return None
    q3, kt3, scale = found
    tr = match.producer(kt3, "Transpose")
    if tr is None or match.perm(tr, 3) != [0, 2, 1]:
        return None
    q, k = _unflatten(q3), _unflatten(tr.inputs[0])
    if q is None or k is None or match.dims(value)[1] != match.dims(q)[1]:
        return None
    return FlatScores(q, k, scale, bias)


def _untranspose(kt: ir.Value) -> tuple[ir.Value, list[int] | None]:
    """The BNSD key whose last two axes kᵀ swaps: (value, None) when `value` is it, or (value, perm) when
    Transpose(value, perm) is."""
    tr = match.producer(kt, "Transpose")
    src_dims = match.dims(tr.inputs[0]) if tr is not None else None
    if tr is not None and src_dims is not None and len(src_dims) == 4:
        p = match.perm(tr, 4)
        k_perm = [p[0], p[1], p[3], p[2]]
        return tr.inputs[0], None if k_perm == [0, 1, 2, 3] else k_perm
    # dynamo's SDPA: Reshape(Transpose(Reshape(k, (-1, S, D)), (0, 2, 1)), (B, N, D, S))
    outer = match.producer(kt, "Reshape")
    mid = match.producer(outer.inputs[0], "Transpose") if outer is not None else None
    inner = match.producer(mid.inputs[0], "Reshape") if mid is not None else None
    if inner is not None and match.perm(mid, 3) == [0, 2, 1]:
        k, k_dims = inner.inputs[0], match.dims(inner.inputs[0])
        in_dims, out_dims = match.dims(inner.outputs[0]), match.dims(kt)
        if (k_dims is not None and in_dims is not None and out_dims is not None and len(k_dims) == 4
                and len(in_dims) == 3 and len(out_dims) == 4 and isinstance(k_dims[3], int)
                and isinstance(k_dims[1], int) and in_dims[2] == k_dims[3] and out_dims[1] == k_dims[1]
                and out_dims[2] == k_dims[3] and match.may_equal(in_dims[1], k_dims[2])
                and match.may_equal(out_dims[3], k_dims[2]) and match.may_equal(out_dims[0], k_dims[0])):
            return k, None
    return kt, [0, 1, 3, 2]


def _single_use(value: ir.Value, uses: int = 1) -> bool:
    return len(value.uses()) == uses and not value.is_graph_output()


def probabilities(softmax: ir.Node) -> tuple[ir.Value, ir.Value, bool]:
    """Follow Softmax's result down to the MatMul with v: through the fp32 Cast island of fp16/bf16 models
    (Cast(Softmax(Cast(x, fp32)), back)) and the "safe softmax" of torch's SDPA export
    (Where(IsNaN(p), 0, p): a fully masked row gives 0 instead of NaN). Returns (the probabilities as the
    MatMul reads them, v, whether the softmax is safe) or raises Refused saying where the chain leaves the
    attention shape."""
    probs = softmax.outputs[0]
    uses = [u.node for u in probs.uses()]
    cast = uses[0] if len(uses) == 1 and uses[0].op_type == "Cast" else None
    if cast is not None and match.producer(softmax.inputs[0], "Cast") is not None:
        probs, uses = cast.outputs[0], [u.node for u in cast.outputs[0].uses()]
    isnan = next((n for n in uses if n.op_type == "IsNaN"), None)
    if isnan is not None:  # safe softmax: Where(IsNaN(p), 0, p)
        where = [u.node for u in isnan.outputs[0].uses()]
        w = where[0] if len(where) == 1 and where[0].op_type == "Where" else None
        if w is None or w.inputs[0] is not isnan.outputs[0] or w.inputs[2] is not probs \
                or match.scalar(w.inputs[1]) != 0.0 or not _single_use(probs, 2):
            raise Refused("the Softmax result goes to IsNaN but not into Where(IsNaN(p), 0, p) (a safe softmax)")
        probs, uses = w.outputs[0], [u.node for u in w.outputs[0].uses()]
    elif not _single_use(probs):
        raise Refused("the attention probabilities are used elsewhere")
    if any(n.op_type == "TopK" for n in uses):
        raise Refused("an MoE router's Softmax (its result goes to TopK), not attention")
    if len(uses) == 1 and uses[0].op_type == "Reshape" and match.rank(uses[0].outputs[0]) == 3:
        # Bloom: the 4-D probabilities back to the flattened (B·N, S1, S2) layout of its bmm with v
        if not _single_use(probs):
            raise Refused("the attention probabilities are used elsewhere")
        probs, uses = uses[0].outputs[0], [u.node for u in uses[0].outputs[0].uses()]
    if len(uses) != 1 or uses[0].op_type != "MatMul" or uses[0].inputs[0] is not probs:
        raise Refused(f"the probabilities go to {', '.join(sorted({n.op_type for n in uses})) or 'no node'}, "
                      "not into MatMul(probabilities, v)")
    if not _single_use(probs):
        raise Refused("the attention probabilities are used elsewhere")
    return probs, uses[0].inputs[1], isnan is not None


def _soft_capped(value: ir.Value) -> bool:
    """Whether `value` is soft-capped scores c * tanh(s / c) (Gemma-2's logit soft-capping)."""
    return match.producer(_peel_scales(value)[0], "Tanh") is not None


@dataclasses.dataclass
class Found:
    """An SDPA to build: `k_perm` a Transpose still to apply to sdpa.k; `flat` Bloom's (B·N, ...) layout
    (the bias and the output are reshaped)."""

    sdpa: Sdpa
    k_perm: list[int] | None = None
    flat: bool = False


def _check_bnsd(*values: ir.Value) -> None:
    ranks = [match.rank(x) for x in values]
    if any(r != 4 for r in ranks):
        raise Refused(f"q/k/v are not 4-D BNSD (ranks {ranks})")


def analyze(logits: ir.Value, v: ir.Value, softmax: ir.Node, opset: int) -> Found:
    """Read the attention subgraph behind Softmax(logits); raise Refused with the reason if it is none."""
    if opset < 13:
        raise Refused(f"opset {opset} < 13")
    ld = match.dims(logits)
    axis = softmax.attributes.get("axis")
    axis = -1 if axis is None else axis.value
    rank = len(ld) if ld is not None else 4
    if axis % rank != rank - 1:
        raise Refused(f"Softmax over axis {axis}, not the last")
    # The structure: which operand of the Add / Where is the (scaled) MatMul of q and kᵀ, which the mask?
    found, mask = None, {}
    scores = _flat_scores if match.rank(v) == 3 else _scores  # (B·N, S, D) v: Bloom's flattened layout
    add, where = match.producer(logits, "Add"), match.producer(logits, "Where")
    if add is not None:
        for s, m in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            found = scores(s)
            if found is not None:
                mask = dict(mask_kind="additive", mask=m)
                break
    elif where is not None:
        c, x, y = where.inputs
        for s, f, kind in ((x, y, "keep_bool"), (y, x, "discard_bool")):
            found = scores(s)
            if found is not None:
                fill = match.scalar(f)
                if fill is None:
                    raise Refused("Where's fill is not a scalar constant: not a mask")
                mask = dict(mask_kind=kind, mask=c, fill=fill)
                break
    if found is None:
        found = scores(logits)
        if found is None:
            operands = add.inputs if add is not None else where.inputs[1:] if where is not None else [logits]
            if any(_soft_capped(x) for x in operands):
                raise Refused("soft-capped scores (c·tanh(s/c), logit soft-capping): FlashAttentionScore has no "
                              "soft-capping argument")
            if scores is _flat_scores:
                raise Refused("attention over a flattened batch·heads axis (B·N, S, D) whose scores are not "
                              "Reshape(scale · q @ kᵀ [+ bias]) of BNSD q and k")
            raise Refused("the Softmax input is not a (scaled, masked) MatMul of q and kᵀ")
    if isinstance(found, FlatScores):
        v4 = _unflatten(v)
        if v4 is None:
            raise Refused("the flattened (B·N, S, D) v is not a reshape of a BNSD value")
        q, k, k_perm, scale, bias, v = found.q, found.k, None, found.scale, found.bias, v4
        if bias is not None:
            bd = match.dims(bias)
            if bd is None or len(bd) != 3 or bias.dtype != q.dtype or bd[1] not in (1, match.dims(q)[2]) \
                    or not match.may_equal(bd[2], match.dims(found.k)[2]):
                raise Refused(f"the bias added to the flattened scores (shape {bd}) is not (B·N, 1|S1, S2) in "
                              "the scores' dtype (ALiBi)")
    else:
        q, kt, scale = found
        (k, k_perm), bias = _untranspose(kt), None
    if not (scale > 0 and math.isfinite(scale)):
        raise Refused(f"scale {scale} is not a positive finite number")
    _check_bnsd(q, k, v)
    n1 = match.dims(q)[1]
    kd = match.dims(k)
    n2 = kd[k_perm[1]] if k_perm is not None else kd[1]
    for heads in (n2, match.dims(v)[1]):  # MatMul broadcasts a head count of 1 only (SDPA would read GQA)
        if isinstance(n1, int) and isinstance(heads, int) and heads not in (1, n1):
            raise Refused(f"query heads {n1} and kv heads {heads} do not match (no kv-head repeat found)")
    return Found(Sdpa(q, k, v, scale, bias=bias, **mask), k_perm, flat=isinstance(found, FlatScores))


def analyze_native(node: ir.Node, opset: int) -> Found:
    """opset 23's Attention(Q, K, V[, attn_mask]) as an SDPA, or Refused."""
    q, k, v = node.inputs[:3]
    attrs = node.attributes
    extra = [x for x in node.inputs[4:] if x is not None and x.name]
    if extra:
        raise Refused("Attention with past key/value or nonpad lengths")
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        raise Refused("Attention's present key/value or qk outputs are used")
    if attrs.get("is_causal") is not None and attrs["is_causal"].value:
        raise Refused("Attention with is_causal=1 (the causal mask is not built here)")
    if attrs.get("softcap") is not None and attrs["softcap"].value:
        raise Refused("Attention with softcap")
    for window in ("left_window_size", "right_window_size"):  # later opsets' sliding window
        if attrs.get(window) is not None and attrs[window].value != -1:
            raise Refused(f"Attention with {window}")
    qd = match.dims(q)
    if qd is None or len(qd) != 4:
        raise Refused("Attention with 3-D (BSH) inputs")
    _check_bnsd(q, k, v)
    if attrs.get("scale") is None and not isinstance(qd[3], int):
        raise Refused(f"Attention without a scale and with a symbolic head dim (shape {qd})")
    scale = attrs["scale"].value if attrs.get("scale") is not None else 1.0 / math.sqrt(qd[3])
    if not (scale > 0 and math.isfinite(scale)):
        raise Refused(f"scale {scale} is not a positive finite number")
    found = Sdpa(q, k, v, scale)
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] is not None and node.inputs[3].name else None
    if mask is not None:  # a bool mask keeps where True; ONNX fills the rest with -inf
        found.mask = mask
        found.mask_kind = "keep_bool" if mask.dtype == ir.DataType.BOOL else "additive"
    return Found(found)


def _reshape_tail(op, x: ir.Value, head: list[int], start: int, end: int) -> ir.Value:
    """Reshape(x, head + Shape(x)[start:end])."""
    target = op.Concat(op.Constant(value=ir.tensor(head, ir.DataType.INT64)),
                       op.Slice(op.Shape(x), op.Constant(value=ir.tensor([start], ir.DataType.INT64)),
                                op.Constant(value=ir.tensor([end], ir.DataType.INT64))), axis=0)
    return op.Reshape(x, target)


def _build(op, found: Found, like: ir.Value) -> ir.Value:
    s = dataclasses.replace(found.sdpa)
    if found.k_perm is not None:
        k = op.Transpose(s.k, perm=found.k_perm)
        k.dtype, k.shape = s.k.dtype, ir.Shape([s.k.shape[p] for p in found.k_perm])  # (the stages read them)
        s.k = k
    if not found.flat:
        return s.build(op, like)
    if s.bias is not None:  # (B·N, 1|S1, S2) -> (B, N, 1|S1, S2)
        bias = _reshape_tail(op, s.bias, [-1, match.dims(s.q)[1]], 1, 3)
        bias.dtype = s.bias.dtype
        s.bias = bias
    return _reshape_tail(op, s.build(op, s.q), [-1], 2, 4)  # back to the (B·N, S1, D) the bmm with v gave


class SoftmaxToSdpa(pattern.RewriteRuleClassBase):
    """MatMul(P, v) with P = Softmax(logits) or the safe softmax Where(IsNaN(s), 0, s) of one; with
    `island`, the fp16/bf16 spelling of torch.softmax(x, dtype=float32) followed by .to(dtype):
    Cast(Softmax(Cast(logits, fp32)), back). `probabilities` checks the chain, `analyze` the rest."""

    def __init__(self, island: bool):
        super().__init__(f"SDPA-softmax{'-fp32-island' if island else ''}", remove_nodes=False)
        self._island = island  # (remove_nodes=False: the producers that die with the match go by DCE)

    def pattern(self, op, logits, value, up, down, zero, flat):
        if self._island:
            sm = op.Cast(op.Softmax(op.Cast(logits, to=up), _outputs=["sm"]), to=down)
        else:
            sm = op.Softmax(logits, _outputs=["sm"])
        probs = pattern.OrValue([op.Where(op.IsNaN(sm), zero, sm), sm, op.Reshape(sm, flat)])
        return op.MatMul(probs, value, _outputs=["attn"])

    def check(self, context, logits, value, attn, sm, up=None, down=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        softmax = sm.producer()
        try:
            if self._island and (up.value != ir.DataType.FLOAT or down.value != logits.dtype or
                                 logits.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)):
                raise Refused(f"a Cast island around Softmax from {logits.dtype} to {up.value} and back to "
                              f"{down.value}")
            _, _, safe = probabilities(softmax)
            self._found = analyze(logits, value, softmax, match.opset(context))
            self._found.sdpa.safe_softmax, self._found.sdpa.fp32_softmax = safe, self._island
            self._found.sdpa.source = softmax.name or ""
        except Refused as e:
            return result.fail(str(e), softmax)
        return result

    def rewrite(self, op, attn, **_):
        return _build(op, self._found, attn)


class NativeToSdpa(pattern.RewriteRuleClassBase):
    """opset 23's Attention(Q, K, V[, attn_mask]) with 4-D inputs (torch dynamo at opset 23)."""

    def __init__(self):
        super().__init__("SDPA-onnx-attention", remove_nodes=False)

    def pattern(self, op, q, k, v):
        return op.Attention(q, k, v, _allow_other_inputs=True, _outputs=["attn"])

    def check(self, context, q, k, v, attn, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = attn.producer()
        try:
            self._found = analyze_native(node, match.opset(context))
            precision = node.attributes.get("softmax_precision")  # (absent: the inputs' precision)
            self._found.sdpa.fp32_softmax = precision is not None and precision.value == ir.DataType.FLOAT
            self._found.sdpa.source = node.name or ""
        except Refused as e:
            return result.fail(str(e), node)
        return result

    def rewrite(self, op, attn, **_):
        return _build(op, self._found, attn)


def rules() -> pattern.RewriteRuleSet:
    """The stage's rules, new for each application (why: passes.manager.rewrite_pass); a check hands its
    analysis to its rewrite on the rule instance."""
    return pattern.RewriteRuleSet([SoftmaxToSdpa.rule(island=False), SoftmaxToSdpa.rule(island=True),
                                   NativeToSdpa.rule()])
