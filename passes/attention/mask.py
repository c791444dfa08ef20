"""Stage 3 of fuse-attention: the SDPA's mask proven a mask (0 keeps, a large negative discards) and made
additive, the form FlashAttentionScore takes (opmap/fused/flash_attention.py).

  additive      a float mask in the scores' dtype whose values provably are 0 or <= LARGE_NEGATIVE: built by
                Where(c, 0, neg) / Where(c, neg, 0), (1 - Cast(bool)) * neg, ConstantOfShape, constants, and
                Add/Min of such, through Expand/Reshape/Unsqueeze/Squeeze/Slice/Transpose/Tile/Identity/
                float Cast, Gather/GatherElements/GatherND of the data (an integer mask input cast to float is
                not provably 0/1 and is refused);
  keep_bool     Where(c, scores, fill), c bool and fill <= LARGE_NEGATIVE: becomes the additive
                Where(c, 0, fill) (S + fill rounds to fill, or underflows in exp like fill: every partly
                masked row's softmax is bit-identical);
  discard_bool  Where(c, fill, scores): Where(c, fill, 0).
The mask's shape must be (.., S1|1, S2) of rank 2-4. The mask subgraph itself stays as it is; only its use
is rewritten. Refused here: anything else in the mask's place (its reason says which check failed).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.onnx_domains import is_default_domain
from passes import match
from passes.attention.scores import Refused
from passes.attention.sdpa import DOMAIN, Sdpa

# An additive mask value at or below this discards a position: exp(-1e4 + s - max) is 0 in fp32 for any
# score |s| < 9000, so the softmax equals FlashAttentionScore's discard.
LARGE_NEGATIVE = -1e4
# Ops whose output holds only values of their first input (shape ops, and gathers: a decomposed
# GroupQueryAttention reads its attention_bias at each key's position with GatherElements).
_PASS_THROUGH = {"Expand", "Reshape", "Unsqueeze", "Squeeze", "Slice", "Transpose", "Tile", "Identity", "Flatten",
                 "Gather", "GatherElements", "GatherND"}


def _zero_one(value: ir.Value, depth: int = 0) -> bool:
    """Whether `value` provably holds only 0 and 1: a Cast of a bool, 1 - such, through shape-only ops."""
    c = match.const_value(value)
    if c is not None:
        return bool(np.all((c == 0) | (c == 1)))
    p = value.producer()
    if p is None or not is_default_domain(p.domain) or depth > 12:
        return False
    if p.op_type in _PASS_THROUGH:
        return _zero_one(p.inputs[0], depth + 1)
    if p.op_type == "Cast":
        return p.inputs[0].dtype == ir.DataType.BOOL or _zero_one(p.inputs[0], depth + 1)
    if p.op_type == "Sub":
        return match.scalar(p.inputs[0]) == 1.0 and _zero_one(p.inputs[1], depth + 1)
    return False


def additive_fill(value: ir.Value, depth: int = 0) -> float | None:
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
    if p is None or not is_default_domain(p.domain):
        return None
    if p.op_type in _PASS_THROUGH:
        return additive_fill(p.inputs[0], depth + 1)
    if p.op_type == "Cast":
        src = p.inputs[0]
        return additive_fill(src, depth + 1) if src.dtype in match.FLOATS | {ir.DataType.DOUBLE} else None
    if p.op_type == "ConstantOfShape":
        attr = p.attributes.get("value")
        v = float(attr.value.numpy().reshape(-1)[0]) if attr is not None else 0.0
        return -math.inf if v == 0 else (v if v <= LARGE_NEGATIVE else None)
    if p.op_type == "Where":
        fills = [additive_fill(x, depth + 1) for x in p.inputs[1:]]
    elif p.op_type in ("Add", "Min", "Sum"):
        fills = [additive_fill(x, depth + 1) for x in p.inputs]
    elif p.op_type == "Mul":  # (1 - keep) * -10000 with keep a bool cast to float
        for x, f in ((p.inputs[0], p.inputs[1]), (p.inputs[1], p.inputs[0])):
            neg = match.scalar(f)
            if neg is not None and neg <= LARGE_NEGATIVE and _zero_one(x, depth + 1):
                return neg
        return None
    else:
        return None
    return None if any(f is None for f in fills) else max(fills)


def _check_shape(mask: ir.Value, scores_dims: list, what: str) -> None:
    dims = match.dims(mask)
    if dims is None or not 2 <= len(dims) <= 4:
        raise Refused(f"the {what} is not a mask of rank 2-4 over (.., S1, S2) (shape {dims})")
    for k in range(1, len(dims) + 1):
        m, s = dims[-k], scores_dims[-k]
        if k == 1 and m == 1 and s != 1:
            raise Refused(f"the {what} broadcasts over the key axis: not a (.., S1, S2) mask (shape {dims})")
        if m != 1 and not match.may_equal(m, s):
            raise Refused(f"the {what}'s shape {dims} does not fit the scores' {scores_dims}")


def prove(s: Sdpa) -> None:
    """Raise Refused unless the SDPA's mask is a mask (this module's docstring)."""
    qd, kd = match.dims(s.q), match.dims(s.k)
    scores_dims = [qd[0], qd[1], qd[2], kd[2]]
    m = s.mask
    if s.mask_kind == "additive":
        what = "added tensor"
        if m.dtype != s.q.dtype:
            raise Refused(f"the {what} has dtype {m.dtype}, not the scores' {s.q.dtype}: not a mask")
        _check_shape(m, scores_dims, what)
        if additive_fill(m) is None:
            raise Refused(f"the {what}'s values are not provably 0 or a large negative "
                          f"(<= {LARGE_NEGATIVE:g}): not a mask (a bias FlashAttentionScore cannot take)")
        return
    if m.dtype != ir.DataType.BOOL:
        raise Refused(f"Where's condition has dtype {m.dtype}")
    if not s.fill <= LARGE_NEGATIVE:
        raise Refused(f"Where's fill {s.fill} is not a scalar <= {LARGE_NEGATIVE:g}: not a mask")
    _check_shape(m, scores_dims, "Where condition")


class ProveMask(pattern.RewriteRuleClassBase):
    def __init__(self):
        super().__init__("SDPA-prove-mask", remove_nodes=False)

    def pattern(self, op, q, k, v, mask):
        return op.SDPA(q, k, v, mask, _allow_other_inputs=True, _domain=DOMAIN, _outputs=["out"])

    def check(self, context, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        s = Sdpa.read(out.producer())
        if s.mask is None or s.mask_proven:
            return result.fail()  # (nothing to prove)
        try:
            prove(s)
        except Refused as e:
            return result.fail(str(e), out.producer())
        self._sdpa = s
        return result

    def rewrite(self, op, out, **_):
        s = self._sdpa
        if s.mask_kind in ("keep_bool", "discard_bool"):
            zero = op.Constant(value=ir.tensor(np.array(0.0, s.q.dtype.numpy())))
            fill = op.Constant(value=ir.tensor(np.array(s.fill, s.q.dtype.numpy())))
            s.mask = op.Where(s.mask, zero, fill) if s.mask_kind == "keep_bool" else op.Where(s.mask, fill, zero)
        s.mask_proven = True
        return s.build(op, out)


def rules() -> pattern.RewriteRuleSet:
    """The stage's rules, new for each application (why: passes.manager.rewrite_pass); a check hands its
    analysis to its rewrite on the rule instance."""
    return pattern.RewriteRuleSet([ProveMask.rule()])
