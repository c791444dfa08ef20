"""fuse-attention: scaled-dot-product attention -> mindspore::FlashAttentionScore (BNSD, MHA and GQA, masks).

The rule anchors on MatMul(P, v), P the Softmax(logits, axis=-1) — also inside the fp32 Cast island fp16/bf16
models put around it, as torch's SDPA "safe softmax" Where(IsNaN(p), 0, p) (transformers' default sdpa
attention exported by dynamo), or reshaped back to (B·N, S1, S2) (Bloom) — and on the opset-23 native
`Attention` op; `probabilities` follows the chain down from the Softmax, check()
then reads the producers of `logits` itself, because the exporters spell the rest in too many ways for a
product of pattern alternatives (and dynamo's kᵀ reshapes read the repeated key's Shape, a use outside any
pattern). Spellings understood, after onnxsim:
  mask      Add(scores, mask) either order (an additive float mask whose values provably are 0 or a large
            negative: built by Where(c, 0, neg) / Where(c, neg, 0), (1 - Cast(bool)) * neg, constants, and
            Add/Min of such, through Expand/Reshape/Unsqueeze/Squeeze/Slice/Transpose/Tile/Identity/float
            Cast; an integer mask input cast to float is not provably 0/1 and is refused);
            Where(keep, scores, fill) and Where(discard, fill, scores) with a bool condition and a scalar fill
            <= -1e4 or -inf (the fused op then gets the additive Where(keep, 0, fill) / Where(discard, fill,
            0): see opmap/fused/flash_attention.py); or no mask. The mask subgraph (Trilu, Range/compare,
            padding) stays as it is; only its use is matched.
  scale     any chain of Mul/Div by positive scalar constants on the scores, on q, on kᵀ, or on q and kᵀ
            (torch's SDPA export scales q and kᵀ by sqrt(scale) each); none at all is scale 1.
  kᵀ        Transpose(k, perm) of any 4-D perm swapping into (B, N, D, S) (Transpose(k_bnsd, 0132), or
            onnxsim's merged Transpose(k_bsnd, 0231)); Reshape(Transpose(Reshape(k, (-1, S, D)), 021),
            (B, N, D, S)) (dynamo's SDPA decomposition); or any other (B, N, D, S) value (a Transpose is added).
  GQA       the kv heads repeated before the attention by Reshape(Expand(Unsqueeze(x, 2) | Reshape(x, 5-D)))
            (HF repeat_kv, dynamo and TorchScript) or Reshape(Tile(Unsqueeze(x, 2), [1,1,r,1,1]))
            (repeat_interleave): the un-repeated k/v go to the fused op (FlashAttentionScore does GQA
            itself); a kv head count of 1 broadcast by the MatMul (MQA) too.
  flat      Bloom: q/k/v BNSD reshaped to (B·N, S, D), scores Reshape(scale · q3 @ Transpose(k3, 021) + alibi,
            (B, N, S1, S2)), P reshaped back to 3-D for the bmm with v3: the BNSD sources go to the fused op,
            the ALiBi bias (B·N, 1|S1, S2) becomes real_shift = alibi / scale as (B, N, 1|S1, S2) (added
            before the scale: opmap/fused/flash_attention.py), the output is reshaped back to (B·N, S1, D).
  opset 23  Attention(q, k, v[, mask]) with 4-D inputs, no past kv, no causal flag, no softcap (a bool mask
            keeps where True, the rest -inf; kv heads repeat as np.repeat, i.e. n // rep, as above).
The rule does not remove what it matched: the producers that only fed the attention (scales, kᵀ, the kv
repeat, the dynamo Shape arithmetic) die with it and the rule set's dead-node removal takes them.
Refused (the report's skip reasons): head dim not a multiple of 16 or > 512, q heads not a multiple of kv
heads, k/v head counts or head dims that disagree, q/k/v not 4-D BNSD, dtypes other than fp32/fp16/bf16,
a mask that is not a mask (dtype, shape not (.., S1|1, S2), values not provably 0 / large negative), a
non-scalar or non-positive scale, a Softmax not over the last axis, attention probabilities used elsewhere,
soft-capped scores c·tanh(s/c) (Gemma-2: FlashAttentionScore has no soft-capping argument), an MoE router's
Softmax (its result goes to TopK).

Coverage candidates (passes/coverage.py, family "attention"): every Softmax and every opset-23 Attention node.
A candidate no rule matched is explained by `explain`, which runs `probabilities` and `analyze` from it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes import coverage, match
from passes.manager import rewrite_pass

# An additive mask value at or below this discards a position: exp(-1e4 + s - max) is 0 in fp32 for any
# score |s| < 9000, so the softmax equals FlashAttentionScore's discard.
LARGE_NEGATIVE = -1e4
_PASS_THROUGH = {"Expand", "Reshape", "Unsqueeze", "Squeeze", "Slice", "Transpose", "Tile", "Identity", "Flatten"}


class Refused(Exception):
    """A candidate that must not fuse; the message is the skip reason."""


# --- pieces of the attention subgraph --------------------------------------------------------------------


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
    the first axis can only be B·N); else None."""
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


@dataclasses.dataclass
class Key:
    value: ir.Value  # the key in BNSD, or the source of `perm`
    perm: list[int] | None = None  # a Transpose to add to get BNSD (None: value is BNSD already)


def _untranspose(kt: ir.Value) -> Key:
    """The BNSD key whose last two axes kᵀ swaps."""
    tr = match.producer(kt, "Transpose")
    src_dims = match.dims(tr.inputs[0]) if tr is not None else None
    if tr is not None and src_dims is not None and len(src_dims) == 4:
        p = match.perm(tr, 4)
        k_perm = [p[0], p[1], p[3], p[2]]
        return Key(tr.inputs[0], None if k_perm == [0, 1, 2, 3] else k_perm)
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
            return Key(k)
    return Key(kt, [0, 1, 3, 2])


def _unrepeat(x: ir.Value) -> tuple[ir.Value, int] | None:
    """(source, N1) of a kv-head repeat (B, N2, S, D) -> (B, N1, S, D) where head n reads source head
    n // (N1 / N2), or None."""
    reshape = match.producer(x, "Reshape")
    grow = match.producer(reshape.inputs[0], "Expand", "Tile") if reshape is not None else None
    if grow is None:
        return None
    five = grow.inputs[0]
    unsq, pre = match.producer(five, "Unsqueeze"), match.producer(five, "Reshape")
    src = (unsq or pre).inputs[0] if (unsq or pre) is not None else None
    src_dims, five_dims, out_dims = (match.dims(src) if src is not None else None), match.dims(five), match.dims(x)
    if src_dims is None or five_dims is None or out_dims is None or len(src_dims) != 4 or len(five_dims) != 5:
        return None
    if unsq is not None and [a % 5 for a in (match.axes(unsq) or [-1])] != [2]:
        return None
    if pre is not None and not (five_dims[2] == 1 and five_dims[1] == src_dims[1] and five_dims[4] == src_dims[3]
                                and match.may_equal(five_dims[0], src_dims[0]) and match.may_equal(five_dims[3], src_dims[2])):
        return None
    n2, d = src_dims[1], src_dims[3]
    if not (isinstance(n2, int) and isinstance(d, int) and len(out_dims) == 4 and isinstance(out_dims[1], int)):
        return None
    n1 = out_dims[1]
    if n1 % n2 or out_dims[3] != d or not match.may_equal(out_dims[0], src_dims[0]) \
            or not match.may_equal(out_dims[2], src_dims[2]):
        return None
    rep = n1 // n2
    grown = match.dims(grow.outputs[0])
    if grow.op_type == "Tile":
        reps = match.const_value(grow.inputs[1])
        if reps is None or [int(r) for r in reps.reshape(-1)] != [1, 1, rep, 1, 1]:
            return None
    elif grown is None or len(grown) != 5 or not match.may_equal(grown[1], n2) or not match.may_equal(grown[2], rep) \
            or not match.may_equal(grown[4], d):
        return None
    return src, n1


def _zero_one(value: ir.Value, depth: int = 0) -> bool:
    """Whether `value` provably holds only 0 and 1: a Cast of a bool, 1 - such, through shape-only ops."""
    c = match.const_value(value)
    if c is not None:
        return bool(np.all((c == 0) | (c == 1)))
    p = value.producer()
    if p is None or p.domain not in ("", "ai.onnx") or depth > 12:
        return False
    if p.op_type in _PASS_THROUGH:
        return _zero_one(p.inputs[0], depth + 1)
    if p.op_type == "Cast":
        return p.inputs[0].dtype == ir.DataType.BOOL or _zero_one(p.inputs[0], depth + 1)
    if p.op_type == "Sub":
        return match.scalar(p.inputs[0]) == 1.0 and _zero_one(p.inputs[1], depth + 1)
    return False


def _additive_fill(value: ir.Value, depth: int = 0) -> float | None:
    """For a float mask whose values provably are 0 or <= LARGE_NEGATIVE: its least negative discard value
    (-inf if it has none); else None."""
    if depth > 12:
        return None
    c = match.const_value(value)
    if c is not None:
        if c.dtype.kind != "f" or c.size > 1 << 22:
            return None
        neg = c[c != 0]
        if neg.size and not np.all(neg <= LARGE_NEGATIVE):
            return None
        return float(neg.max()) if neg.size else -math.inf
    p = value.producer()
    if p is None or p.domain not in ("", "ai.onnx"):
        return None
    if p.op_type in _PASS_THROUGH:
        return _additive_fill(p.inputs[0], depth + 1)
    if p.op_type == "Cast":
        src = p.inputs[0]
        return _additive_fill(src, depth + 1) if src.dtype in match.FLOATS | {ir.DataType.DOUBLE} else None
    if p.op_type == "ConstantOfShape":
        attr = p.attributes.get("value")
        v = float(attr.value.numpy().reshape(-1)[0]) if attr is not None else 0.0
        return -math.inf if v == 0 else (v if v <= LARGE_NEGATIVE else None)
    if p.op_type == "Where":
        fills = [_additive_fill(x, depth + 1) for x in p.inputs[1:]]
    elif p.op_type in ("Add", "Min", "Sum"):
        fills = [_additive_fill(x, depth + 1) for x in p.inputs]
    elif p.op_type == "Mul":  # (1 - keep) * -10000 with keep a bool cast to float
        for x, f in ((p.inputs[0], p.inputs[1]), (p.inputs[1], p.inputs[0])):
            neg = match.scalar(f)
            if neg is not None and neg <= LARGE_NEGATIVE and _zero_one(x, depth + 1):
                return neg
        return None
    else:
        return None
    return None if any(f is None for f in fills) else max(fills)


def _check_mask_shape(mask: ir.Value, logits_dims: list, what: str) -> None:
    dims = match.dims(mask)
    if dims is None or not 2 <= len(dims) <= 4:
        raise Refused(f"the {what} is not a mask of rank 2-4 over (.., S1, S2) (shape {dims})")
    for k in range(1, len(dims) + 1):
        m, s = dims[-k], logits_dims[-k]
        if k == 1 and m == 1 and s != 1:
            raise Refused(f"the {what} broadcasts over the key axis: not a (.., S1, S2) mask (shape {dims})")
        if m != 1 and not match.may_equal(m, s):
            raise Refused(f"the {what}'s shape {dims} does not fit the scores' {logits_dims}")


@dataclasses.dataclass
class Attention:
    q: ir.Value
    k: Key
    v: ir.Value
    scale: float
    head_num: int
    kv_head_num: int
    mask_kind: str = "none"  # what the graph had: none | additive | keep_bool | discard_bool
    mask: ir.Value | None = None  # the additive mask, or the bool condition of the Where
    fill: float = -math.inf  # the Where's fill, for the bool kinds
    bias: ir.Value | None = None  # an additive position bias on the scaled scores (ALiBi), (B·N, 1|S1, S2)
    flat: bool = False  # the attention's v and output are (B·N, S, D) (Bloom): the output is reshaped back

    def attributes(self) -> dict:
        return dict(scale=float(self.scale), head_num=self.head_num, kv_head_num=self.kv_head_num,
                    mask_kind=self.mask_kind, input_layout="BNSD", sparse_mode=0)


def _heads(q: ir.Value, k: Key, v: ir.Value, opset: int, native_gqa: bool = False):
    """Check q/k/v (BNSD) and find the un-repeated k/v: returns (key, v, N1, N2)."""
    if opset < 13:
        raise Refused(f"opset {opset} < 13")
    dtypes = {q.dtype, k.value.dtype, v.dtype}
    if len(dtypes) != 1 or not dtypes <= match.FLOATS:
        raise Refused(f"q/k/v dtypes {sorted(str(d) for d in dtypes)}: FlashAttentionScore takes one float dtype "
                      "(fp32 inputs are cast to fp16)")
    if opset < 15 and q.dtype != ir.DataType.FLOAT:
        raise Refused("below opset 15 the reference body can only express fp32")
    qd, vd = match.dims(q), match.dims(v)
    kd = match.dims(k.value)
    if kd is not None and k.perm is not None and len(kd) == 4:
        kd = [kd[p] for p in k.perm]
    if qd is None or kd is None or vd is None or not len(qd) == len(kd) == len(vd) == 4:
        raise Refused(f"q/k/v are not 4-D BNSD (ranks {[None if d is None else len(d) for d in (qd, kd, vd)]})")
    n1, d = qd[1], qd[3]
    if not isinstance(n1, int) or not isinstance(d, int):
        raise Refused(f"the query's head count and head dim must be static (shape {qd})")
    if d % 16 or d > 512:
        raise Refused(f"head dim {d}: FlashAttentionScore needs a multiple of 16, at most 512")
    if kd[3] != d or vd[3] != d:
        raise Refused(f"head dims q={d}, k={kd[3]}, v={vd[3]} differ")
    if not (match.may_equal(qd[0], kd[0]) and match.may_equal(qd[0], vd[0]) and match.may_equal(kd[2], vd[2])):
        raise Refused(f"batch or key length of q {qd}, k {kd}, v {vd} disagree")
    k_src = _unrepeat(k.value) if k.perm is None else None
    v_src = _unrepeat(v)
    if k_src is not None and v_src is not None and k_src[1] == v_src[1] == n1 \
            and match.dims(k_src[0])[1] == match.dims(v_src[0])[1]:
        # the repeated kv heads go to the fused op un-repeated: FlashAttentionScore does GQA itself
        return Key(k_src[0]), v_src[0], n1, match.dims(k_src[0])[1]
    n2 = kd[1]
    if not isinstance(n2, int) or n2 != vd[1]:
        raise Refused(f"key and value head counts differ ({n2} vs {vd[1]})")
    if n2 != n1 and n2 != 1 and not (native_gqa and n1 % n2 == 0):
        raise Refused(f"query heads {n1} and kv heads {n2} do not match (no kv-head repeat found)")
    return k, v, n1, n2


def _single_use(value: ir.Value, uses: int = 1) -> bool:
    return len(value.uses()) == uses and not value.is_graph_output()


def probabilities(softmax: ir.Node) -> tuple[ir.Value, ir.Value]:
    """Follow Softmax's result down to the MatMul with v: through the fp32 Cast island of fp16/bf16 models
    (Cast(Softmax(Cast(x, fp32)), back)) and the "safe softmax" of torch's SDPA export
    (Where(IsNaN(p), 0, p): a fully masked row gives 0 instead of NaN). Returns (the probabilities as the
    MatMul reads them, v) or raises Refused saying where the chain leaves the attention shape."""
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
    return probs, uses[0].inputs[1]


def _soft_capped(value: ir.Value) -> bool:
    """Whether `value` is soft-capped scores c * tanh(s / c) (Gemma-2's logit soft-capping)."""
    return match.producer(_peel_scales(value)[0], "Tanh") is not None


def analyze(logits: ir.Value, v: ir.Value, softmax: ir.Node, opset: int) -> Attention:
    """Read the attention subgraph behind Softmax(logits); raise Refused with the reason if it must not fuse."""
    ld = match.dims(logits)
    axis = softmax.attributes.get("axis")
    axis = -1 if axis is None else axis.value
    rank = len(ld) if ld is not None else 4
    if axis % rank != rank - 1:
        raise Refused(f"Softmax over axis {axis}, not the last")
    # The structure: which operand of the Add / Where is the (scaled) MatMul of q and kᵀ, which the mask?
    found, mask = None, None
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
                mask = dict(mask_kind=kind, mask=c, fill=f)
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
    bias = None
    if isinstance(found, FlatScores):
        v4 = _unflatten(v)
        if v4 is None:
            raise Refused("the flattened (B·N, S, D) v is not a reshape of a BNSD value")
        q, key, scale, bias, v = found.q, Key(found.k), found.scale, found.bias, v4
        if bias is not None:
            bd = match.dims(bias)
            if bd is None or len(bd) != 3 or bias.dtype != q.dtype or bd[1] not in (1, match.dims(q)[2]) \
                    or not match.may_equal(bd[2], match.dims(found.k)[2]):
                raise Refused(f"the bias added to the flattened scores (shape {bd}) is not (B·N, 1|S1, S2) in "
                              "the scores' dtype (ALiBi)")
    else:
        q, kt, scale = found
        key = _untranspose(kt)
    if not (scale > 0 and math.isfinite(scale)):
        raise Refused(f"scale {scale} is not a positive finite number")
    key, v_val, n1, n2 = _heads(q, key, v, opset)
    if ld is None:
        ld = [match.dims(q)[0], n1, match.dims(q)[2], match.dims(v)[2]]
    if len(ld) != 4:
        raise Refused(f"the Softmax input is not 4-D (B, N, S1, S2) (shape {ld})")
    att = Attention(q, key, v_val, scale, n1, n2, bias=bias, flat=scores is _flat_scores)
    if mask is None:
        return att
    m = mask["mask"]
    if mask["mask_kind"] == "additive":
        if m.dtype != logits.dtype:
            raise Refused(f"the added tensor has dtype {m.dtype}, not the scores' {logits.dtype}: not a mask")
        _check_mask_shape(m, ld, "added tensor")
        if _additive_fill(m) is None:
            raise Refused("the added tensor's values are not provably 0 or a large negative "
                          f"(<= {LARGE_NEGATIVE:g}): not a mask (a bias FlashAttentionScore cannot take)")
    else:
        if m.dtype != ir.DataType.BOOL:
            raise Refused(f"Where's condition has dtype {m.dtype}")
        fill = match.scalar(mask.pop("fill"))
        if fill is None or not fill <= LARGE_NEGATIVE:
            raise Refused(f"Where's fill {fill} is not a scalar <= {LARGE_NEGATIVE:g}: not a mask")
        _check_mask_shape(m, ld, "Where condition")
        att.fill = fill
    att.mask_kind, att.mask = mask["mask_kind"], m
    return att


def _emit(op, a: Attention, out: ir.Value):
    k = a.k.value if a.k.perm is None else op.Transpose(a.k.value, perm=a.k.perm)
    if a.mask_kind == "additive":
        mask = a.mask
    elif a.mask_kind in ("keep_bool", "discard_bool"):
        # the bool mask as the equivalent additive one: Where(c, scores, fill) -> scores + Where(c, 0, fill)
        zero = op.Constant(value=ir.tensor(np.array(0.0, np.float32)))
        fill = op.Constant(value=ir.tensor(np.array(a.fill, np.float32)))
        mask = op.Where(a.mask, zero, fill) if a.mask_kind == "keep_bool" else op.Where(a.mask, fill, zero)
    else:
        mask = op.Constant(value=ir.tensor(np.array(0.0, np.float32)))
    if a.bias is None:
        pse = op.Constant(value=ir.tensor(np.array(0.0, np.float32)))
    else:  # scale·qk + bias = (qk + bias/scale)·scale, as (B, N1, 1|S1, S2): FlashAttentionScore's real_shift
        four = op.Concat(op.Constant(value=ir.tensor(np.array([-1, a.head_num], np.int64))),
                         op.Slice(op.Shape(a.bias), op.Constant(value=ir.tensor(np.array([1], np.int64))),
                                  op.Constant(value=ir.tensor(np.array([3], np.int64)))), axis=0)
        inv = op.Constant(value=ir.tensor(np.array(1.0 / a.scale, a.bias.dtype.numpy())))
        pse = op.Mul(op.Reshape(a.bias, four), inv)
    result = op.FlashAttentionScore(a.q, k, a.v, mask, pse, _domain="mindspore", **a.attributes())
    if a.flat:  # back to the (B·N, S1, D) the bmm with v produced
        three = op.Concat(op.Constant(value=ir.tensor(np.array([-1], np.int64))),
                          op.Slice(op.Shape(result), op.Constant(value=ir.tensor(np.array([2], np.int64))),
                                   op.Constant(value=ir.tensor(np.array([4], np.int64)))), axis=0)
        result = op.Reshape(result, three)
    result.dtype, result.shape = out.dtype, out.shape
    return result


class SoftmaxAttentionFusion(pattern.RewriteRuleClassBase):
    """MatMul(P, v) with P = Softmax(logits) or the safe softmax Where(IsNaN(s), 0, s) of one; with
    `island`, the fp16/bf16 spelling of torch.softmax(x, dtype=float32) followed by .to(dtype):
    Cast(Softmax(Cast(logits, fp32)), back). `probabilities` checks the chain, `analyze` the rest."""

    def __init__(self, island: bool):
        super().__init__(f"FlashAttentionScore-softmax{'-fp32-island' if island else ''}", remove_nodes=False)
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
            probabilities(softmax)
            self._found = analyze(logits, value, softmax, match.opset(context))
        except Refused as e:
            return result.fail(str(e), softmax)
        return result

    def rewrite(self, op, attn, **_):
        return _emit(op, self._found, attn)


class NativeAttentionFusion(pattern.RewriteRuleClassBase):
    """opset 23's Attention(Q, K, V[, attn_mask]) with 4-D inputs (torch dynamo at opset 23)."""

    def __init__(self):
        super().__init__("FlashAttentionScore-onnx-attention", remove_nodes=False)

    def pattern(self, op, q, k, v):
        return op.Attention(q, k, v, _allow_other_inputs=True, _outputs=["attn"])

    def check(self, context, q, k, v, attn, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = attn.producer()
        try:
            self._found = self._analyze(node, q, k, v, match.opset(context))
        except Refused as e:
            return result.fail(str(e), node)
        return result

    @staticmethod
    def _analyze(node: ir.Node, q, k, v, opset: int) -> Attention:
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
        key, v_val, n1, n2 = _heads(q, Key(k), v, opset, native_gqa=True)
        scale = attrs["scale"].value if attrs.get("scale") is not None else 1.0 / math.sqrt(qd[3])
        if not (scale > 0 and math.isfinite(scale)):
            raise Refused(f"scale {scale} is not a positive finite number")
        mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] is not None and node.inputs[3].name else None
        found = Attention(q, key, v_val, scale, n1, n2)
        if mask is not None:
            kd = match.dims(k)
            logits = [qd[0], qd[1], qd[2], kd[2] if kd is not None else None]
            _check_mask_shape(mask, logits, "attn_mask")
            if mask.dtype == ir.DataType.BOOL:  # True takes part; ONNX fills the rest with -inf
                found.mask_kind, found.mask, found.fill = "keep_bool", mask, -math.inf
            else:
                if mask.dtype != q.dtype or _additive_fill(mask) is None:
                    raise Refused("attn_mask's values are not provably 0 or a large negative: not a mask")
                found.mask_kind, found.mask = "additive", mask
        return found

    def rewrite(self, op, attn, **_):
        return _emit(op, self._found, attn)


RULES = [SoftmaxAttentionFusion.rule(island=False), SoftmaxAttentionFusion.rule(island=True),
         NativeAttentionFusion.rule()]
PASS = rewrite_pass("fuse-attention", "scaled-dot-product attention (MatMul/scale/mask/Softmax/MatMul, MHA and "
                    "GQA; opset-23 Attention) -> mindspore::FlashAttentionScore", pattern.RewriteRuleSet(RULES))


def explain(node: ir.Node) -> str | None:
    """Why an attention candidate (a Softmax or an opset-23 Attention) was not fused: the rules' own
    analysis run from the candidate (passes/coverage.py asks when no check recorded a reason)."""
    opset = match.opset(node.graph) if node.graph is not None else 0
    try:
        if node.op_type == "Attention":
            q, k, v = node.inputs[:3]
            NativeAttentionFusion._analyze(node, q, k, v, opset)
        else:
            _, v = probabilities(node)
            logits = node.inputs[0]
            island = match.producer(logits, "Cast")
            if island is not None and node.outputs[0].uses() and node.outputs[0].uses()[0].node.op_type == "Cast":
                logits = island.inputs[0]
            analyze(logits, v, node, opset)
    except Refused as e:
        return str(e)
    return None


coverage.set_explain("attention", explain)
