"""Stage 2 of fuse-attention: SDPA(q, repeat(k), repeat(v)) -> SDPA(q, k, v), the kv heads un-repeated.

A repeat is Reshape(Expand(Unsqueeze(x, 2) | Reshape(x, 5-D))) (HF repeat_kv, dynamo and TorchScript) or
Reshape(Tile(Unsqueeze(x, 2), [1,1,r,1,1])) (repeat_interleave), turning (B, N2, S, D) into (B, N1, S, D)
with head n reading head n // (N1 / N2): exactly SDPA's own GQA rule (passes/attention/sdpa.py), so the
rewrite changes nothing the graph computes. Both k and v must be repeats of the same factor. Nothing is
refused here: an SDPA whose heads are not repeated stays as it is.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes import match
from passes.attention.sdpa import Sdpa, SdpaRule


def unrepeat(x: ir.Value) -> tuple[ir.Value, int] | None:
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
                                and match.may_equal(five_dims[0], src_dims[0])
                                and match.may_equal(five_dims[3], src_dims[2])):
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


class UnrepeatHeads(SdpaRule):
    def __init__(self):
        super().__init__("SDPA-unrepeat-kv-heads")

    def check(self, context, q, k, v, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        k_src, v_src = unrepeat(k), unrepeat(v)
        qd = match.dims(q)
        if k_src is None or v_src is None or qd is None or not k_src[1] == v_src[1] == qd[1] \
                or match.dims(k_src[0])[1] != match.dims(v_src[0])[1]:
            return result.fail()  # (not a repeat: nothing to do, no refusal)
        self._sources = k_src[0], v_src[0]
        return result

    def rewrite(self, op, out, **_):
        s = Sdpa.read(out.producer())
        s.k, s.v = self._sources
        return s.build(op, out)


def rules() -> pattern.RewriteRuleSet:
    """The stage's rules, new for each application (why: passes.manager.rewrite_pass); a check hands its
    analysis to its rewrite on the rule instance."""
    return pattern.RewriteRuleSet([UnrepeatHeads.rule()])
