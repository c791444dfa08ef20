"""canonicalize: make the spellings of different exporters converge before the fusions match.

Rules (each exact, so numerics do not change):
  Div(1, x)                        -> Reciprocal(x)
  Pow(x, 2)                        -> Mul(x, x)
  Cast(Cast(x, wide), back)        -> x   when `back` is x's own dtype and `wide` holds every value of it
                                          (fp16/bf16 -> fp32 -> same type: a no-op round trip)
  Gemm(a, b, c) (alpha=beta=1, no transposes) -> Add(MatMul(a, b), c)
and then onnxscript's constant folding for the shape arithmetic onnxsim left behind.
Not rewritten: Gemm with transB=1 (it would need a run-time transpose of the weight; opmap lowers it to
one dense call instead), Div(x, Sqrt(y)) (x * Reciprocal(Sqrt(y)) rounds differently).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass, RemoveUnusedNodesPass
from onnxscript import optimizer
from onnxscript.rewriter import pattern

from passes.manager import PassResult, register_pass

# dtype -> wider dtypes whose round trip back to it is exact
_LOSSLESS_WIDER = {
    ir.DataType.FLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.BFLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.FLOAT: {ir.DataType.DOUBLE},
}


def _scalar(value: ir.Value) -> float | None:
    if value.const_value is None:
        return None
    arr = value.const_value.numpy()
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def _broadcasts_away(x: ir.Value, const: ir.Value) -> bool:
    """True when a constant operand cannot enlarge the result's rank (so dropping it keeps the shape)."""
    return x.shape is not None and const.shape is not None and const.shape.rank() <= x.shape.rank()


class DivOneToReciprocal(pattern.RewriteRuleClassBase):
    def pattern(self, op, one, x):
        return op.Div(one, x)

    def check(self, context, one, x, **_):
        r = pattern.MatchResult()
        if _scalar(one) != 1.0 or x.dtype not in _LOSSLESS_WIDER or not _broadcasts_away(x, one):
            return r.fail("not Div(1, x) on a float tensor")
        return r

    def rewrite(self, op, x, **_):
        return op.Reciprocal(x)


class SquareToMul(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, two):
        return op.Pow(x, two)

    def check(self, context, x, two, **_):
        r = pattern.MatchResult()
        if _scalar(two) != 2.0 or not _broadcasts_away(x, two):
            return r.fail("not Pow(x, 2)")
        return r

    def rewrite(self, op, x, **_):
        return op.Mul(x, x)


class CastRoundTrip(pattern.RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.Cast(op.Cast(x, _outputs=["wide"]), _outputs=["back"])

    def check(self, context, x, wide, back, **_):
        r = pattern.MatchResult()
        if back.dtype != x.dtype or wide.dtype not in _LOSSLESS_WIDER.get(x.dtype, ()):
            return r.fail("the Cast pair is not a lossless round trip")
        return r

    def rewrite(self, op, x, **_):
        return op.Identity(x)


class GemmToMatMulAdd(pattern.RewriteRuleClassBase):
    def pattern(self, op, a, b, c):
        return op.Gemm(a, b, c, _outputs=["y"])

    def check(self, context, a, b, c, y, **_):
        r = pattern.MatchResult()
        attrs = y.producer().attributes
        get = lambda k, d: attrs[k].value if k in attrs else d  # noqa: E731
        if get("transA", 0) or get("transB", 0):
            return r.fail("Gemm with a transposed operand")
        if get("alpha", 1.0) != 1.0 or get("beta", 1.0) != 1.0:
            return r.fail("Gemm with alpha or beta != 1")
        return r

    def rewrite(self, op, a, b, c, **_):
        return op.Add(op.MatMul(a, b), c)


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass)."""
    return pattern.RewriteRuleSet([DivOneToReciprocal.rule(), SquareToMul.rule(), CastRoundTrip.rule(),
                                   GemmToMatMulAdd.rule()])


class _IdentityElimination(IdentityEliminationPass):
    """onnx-ir's pass, except where an Identity is a subgraph's output of a value from an enclosing graph (an If
    branch returning an outer value, silero-vad's): onnx-ir 1.1 removes it, leaving the branch an output that no
    node of it produces, which is invalid ONNX."""

    def _try_eliminate_identity_node(self, node: ir.Node) -> bool:
        source = node.inputs[0] if len(node.inputs) == 1 else None
        if node.outputs and node.outputs[0].is_graph_output() and source is not None:
            producer = source.producer()
            if (producer.graph if producer is not None else source.graph) is not node.graph:
                return False
        return super()._try_eliminate_identity_node(node)


@register_pass("canonicalize", "Div(1,x)->Reciprocal, Pow(x,2)->Mul, lossless Cast pairs, Gemm->MatMul+Add, "
                               "constant folding")
def canonicalize(model: ir.Model) -> PassResult:
    """Counts the rewrites plus the computing nodes (not Constant) that folding and Identity removal took
    away."""
    count = rules().apply_to_model(model)
    before = _computing_nodes(model)
    optimizer.fold_constants(model)
    _IdentityElimination()(model)
    RemoveUnusedNodesPass()(model)
    return PassResult(count + max(before - _computing_nodes(model), 0))


def _computing_nodes(model: ir.Model) -> int:
    return sum(1 for n in model.graph if n.op_type != "Constant")
