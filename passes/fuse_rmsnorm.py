"""fuse-rmsnorm: decomposed RMSNorm -> mindspore::RmsNorm.

Spellings matched (each with Mul/Add operands in either order):
  square      Pow(x, 2) | Mul(x, x)
  mean        ReduceMean over the last axis, keepdims=1 (axes as attribute before opset 18, input from 18)
  normalise   Mul(x, Reciprocal(Sqrt(m + eps))) | Mul(x, Div(1, Sqrt(m + eps))) | Div(x, Sqrt(m + eps))
  precision   optional Cast to fp32 before and Cast back after (fp16/bf16 islands)
  scale       Mul(normed, gamma) with gamma of rank 1 (a Gemma-style (1 + w) is folded into gamma by onnxsim),
              or none: an all-ones gamma's `* 1` is removed by onnxsim (fused with a ones gamma; needs the
              normalised size static)
  native      opset 23's RMSNormalization over the last axis, stash_type fp32
Refused (the report's check reasons): a mean over another axis or keepdims=0, a non-scalar or non-positive
epsilon, a gamma that is not 1-D of the normalised size, dtypes MindSpore's RmsNorm does not take.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes import match
from passes.manager import rewrite_pass


def _is_centered(x: ir.Value) -> bool:
    """x = Sub(y, ReduceMean(y)) (through an optional Cast): the inside of a decomposed LayerNorm."""
    node = x.producer()
    if node is not None and node.op_type == "Cast":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.op_type != "Sub" or len(node.inputs) != 2:
        return False
    mean = node.inputs[1].producer() if node.inputs[1] is not None else None
    return mean is not None and mean.op_type == "ReduceMean" and mean.inputs[0] is node.inputs[0]


class RmsNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, normalize: str, cast_out: bool | None = None):
        super().__init__(name)
        self._normalize = normalize
        self._cast_out = cast_out

    def pattern(self, op, x, gamma, epsilon, compute_dtype, target_dtype):
        return op.Mul(self._normed(op, x, epsilon, compute_dtype, target_dtype), gamma)

    def _normed(self, op, x, epsilon, compute_dtype, target_dtype):
        xc = pattern.OrValue([op.Cast(x, to=compute_dtype), x], tag_var="cast_in", tag_values=[True, False])
        square = pattern.OrValue([op.Pow(xc, 2.0), op.Mul(xc, xc)])
        mean = op.ReduceMean(square, _allow_other_inputs=True, _outputs=["mean"])
        rms = op.Sqrt(op.Add(mean, epsilon))
        if self._normalize == "reciprocal":
            normed = op.Mul(xc, op.Reciprocal(rms))
        elif self._normalize == "div-one":
            normed = op.Mul(xc, op.Div(1.0, rms))
        else:
            normed = op.Div(xc, rms)
        if self._cast_out is not None:  # a pattern's output cannot be a choice: one rule per form
            return op.Cast(normed, to=target_dtype) if self._cast_out else normed
        return pattern.OrValue([op.Cast(normed, to=target_dtype), normed], tag_var="cast_out",
                               tag_values=[True, False])

    def check(self, context, x, gamma, epsilon, mean, cast_in, cast_out, **_) -> pattern.MatchResult:
        result = self._check_normed(context, x, epsilon, mean, cast_in, cast_out)
        if not result:
            return result
        if gamma.dtype != x.dtype:  # x's own dtype was checked with the rest of the norm
            return result.fail(f"dtypes x={x.dtype}, gamma={gamma.dtype}: RmsNorm needs one float dtype", gamma)
        if gamma.shape is None or gamma.shape.rank() != 1:
            return result.fail("gamma is not 1-D", gamma)
        last = x.shape[x.shape.rank() - 1]
        if isinstance(last, int) and gamma.shape[0] != last:
            return result.fail(f"gamma has {gamma.shape[0]} elements, the normalised axis {last}", gamma)
        return result

    def _check_normed(self, context, x, epsilon, mean, cast_in, cast_out) -> pattern.MatchResult:
        result = pattern.MatchResult()
        reduce = mean.producer()
        rank = x.shape.rank() if x.shape is not None else None
        axes = match.axes(reduce)
        if rank is None:
            return result.fail("the input rank is unknown", x)
        if axes is None or [a % rank for a in axes] != [rank - 1]:
            return result.fail(f"ReduceMean is over axes {axes}, not the last axis", reduce)
        keep = reduce.attributes.get("keepdims")
        if keep is not None and keep.value != 1:
            return result.fail("ReduceMean drops the reduced axis (keepdims=0)", reduce)
        eps = match.const_value(epsilon)
        if eps is None or eps.size != 1 or eps.dtype.kind != "f" or not 0 < float(eps.reshape(-1)[0]) <= 1:
            return result.fail("epsilon is not a constant scalar in (0, 1]", epsilon)
        if cast_in != cast_out:
            return result.fail("a Cast on one side of the precision island only", x)
        if _is_centered(x):
            return result.fail("x is x' - mean(x'): this is a LayerNorm (left to fuse-layernorm)", x)
        return match.float_guard(context, result, x, "RmsNorm")

    def rewrite(self, op, x, gamma, epsilon, **_):
        eps = float(match.const_value(epsilon).reshape(-1)[0])
        return op.RmsNorm(x, gamma, epsilon=eps, _domain="mindspore")


class UnitGammaRmsNormFusion(RmsNormFusion):
    """The same without the gamma Mul: a norm whose weight is all ones (a fresh model) loses its `* 1` to
    onnxsim. Fused with a ones gamma; refused where a gamma Mul follows (the rule above takes that)."""

    def pattern(self, op, x, epsilon, compute_dtype, target_dtype):
        return self._normed(op, x, epsilon, compute_dtype, target_dtype)

    def check(self, context, x, epsilon, mean, cast_in, **_) -> pattern.MatchResult:
        result = self._check_normed(context, x, epsilon, mean, cast_in, self._cast_out)
        if not result:
            return result
        last = x.shape[x.shape.rank() - 1]
        if not isinstance(last, int):
            return result.fail("without a gamma the normalised size must be static (for a ones gamma)", x)
        for use in context.output_values[0].uses():
            other = use.node.inputs[1 - use.idx] if use.node.op_type == "Mul" and len(use.node.inputs) == 2 else None
            if other is not None and other.shape is not None and other.shape.rank() == 1 and \
                    match.const_value(other) is not None:
                return result.fail("a gamma Mul follows (fused by the rule with gamma)", x)
        return result

    def rewrite(self, op, x, epsilon, **_):
        eps = float(match.const_value(epsilon).reshape(-1)[0])
        last = x.shape[x.shape.rank() - 1]
        ones = op.Constant(value=ir.tensor(np.ones(last, dtype=x.dtype.numpy()), name="rmsnorm_unit_gamma"))
        return op.RmsNorm(x, ones, epsilon=eps, _domain="mindspore")


class NativeRmsNormalization(pattern.RewriteRuleClassBase):
    """Opset 23's RMSNormalization (what dynamo emits for an RMSNorm formula at opset 23)."""

    def pattern(self, op, x, gamma):
        return op.RMSNormalization(x, gamma, _outputs=["y"])

    def check(self, context, x, gamma, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        attrs = y.producer().attributes
        get = lambda k, d: attrs[k].value if k in attrs else d  # noqa: E731
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None or get("axis", -1) % rank != rank - 1:
            return result.fail("RMSNormalization over more than the last axis", x)
        if get("stash_type", 1) != 1:
            return result.fail("stash_type is not fp32 (RmsNorm computes its statistics in fp32)", x)
        if x.dtype not in match.FLOATS or gamma.dtype != x.dtype:
            return result.fail(f"dtypes x={x.dtype}, gamma={gamma.dtype}: RmsNorm needs one float dtype", gamma)
        if gamma.shape is None or gamma.shape.rank() != 1:
            return result.fail("gamma is not 1-D", gamma)
        if not 0 < get("epsilon", 1e-5) <= 1:
            return result.fail("epsilon is not in (0, 1]", x)
        return result

    def rewrite(self, op, x, gamma, y, **_):
        attrs = y.producer().attributes
        eps = float(attrs["epsilon"].value) if "epsilon" in attrs else 1e-5
        return op.RmsNorm(x, gamma, epsilon=eps, _domain="mindspore")


RULES = [RmsNormFusion.rule(f"RmsNorm-{v}", v) for v in ("reciprocal", "div-one", "div")]
RULES += [UnitGammaRmsNormFusion.rule(f"RmsNorm-unit-gamma-{v}{'-cast' if c else ''}", v, c)
          for v in ("reciprocal", "div-one", "div") for c in (False, True)]
RULES.append(NativeRmsNormalization.rule("RmsNorm-native"))
PASS = rewrite_pass("fuse-rmsnorm", "decomposed RMSNorm (Pow/Mul, Sqrt, Reciprocal/Div, Cast islands) -> "
                    "mindspore::RmsNorm", pattern.RewriteRuleSet(RULES, commute=True))
