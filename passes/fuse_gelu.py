"""fuse-gelu: GELU -> mindspore::Gelu (exact, erf) or mindspore::GeluTanh (tanh approximation).

Spellings matched (each with Mul/Add operands in either order), T being the inner term below:
  outer       Mul(x, Mul(0.5, 1 + T))  (dynamo)  |  Mul(Mul(x, 1 + T), 0.5)  (TorchScript)
              | Mul(Mul(x, 0.5), 1 + T)  (transformers' NewGELU / gelu_new)
  exact       T = Erf(Div(x, 1.4142135)) | Erf(Mul(x, 0.70710678))
  tanh        T = Tanh(Mul(0.7978845608, Add(x, Mul(0.044715, cube)))), cube = Pow(x, 3) | Mul(x, Mul(x, x))
  native      opset 20's Gelu(x, approximate="none" | "tanh")
Constants are compared with a relative tolerance of 1e-5 (exporters print them at fp32 precision), or the
rounding of their dtype (fp16/bf16 constants).
Refused (the report's check reasons): constants of other values, dtypes other than fp32/fp16/bf16 (GeluExt and
GeLU take those), fp16/bf16 below opset 15 (the reference body's CastLike).
FastGeLU (x * sigmoid(1.702 x)) is a different function and is never a target.
"""

from __future__ import annotations

import math

from onnxscript.rewriter import pattern

from passes import match
from passes.manager import rewrite_pass

_EXPECTED = {
    "half": 0.5, "one": 1.0, "three": 3.0, "coeff": 0.044715, "sqrt_2_pi": math.sqrt(2.0 / math.pi),
    "erf_div": math.sqrt(2.0), "erf_mul": 1.0 / math.sqrt(2.0),
}



class GeluDecomposed(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, kind: str, outer: str, swap: bool):
        super().__init__(name)
        self._kind, self._outer, self._swap = kind, outer, swap

    def pattern(self, op, x, half, one, scale, coeff, three):
        if self._kind == "erf":
            arg = pattern.OrValue([op.Div(x, scale), match.mul(op, x, scale)], tag_var="erf_op",
                                  tag_values=["div", "mul"])
            t = op.Erf(arg)
        else:
            cube = pattern.OrValue([op.Pow(x, three), match.mul(op, x, match.mul(op, x, x))])
            t = op.Tanh(match.mul(op, scale, match.add(op, x, match.mul(op, coeff, cube))))
        one_plus = match.add(op, t, one)
        # The root Mul's operand order is a rule variant (a pattern's root is a node, not alternatives).
        if self._outer == "x*(half*(1+t))":
            a, b = x, match.mul(op, half, one_plus)
        elif self._outer == "(x*(1+t))*half":
            a, b = match.mul(op, x, one_plus), half
        else:
            a, b = match.mul(op, x, half), one_plus
        return op.Mul(b, a) if self._swap else op.Mul(a, b)

    def check(self, context, x, half, one, scale, erf_op=None, coeff=None, three=None,
              **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        expected = {"half": (half, _EXPECTED["half"]), "one": (one, _EXPECTED["one"])}
        if self._kind == "erf":
            expected["scale"] = (scale, _EXPECTED[f"erf_{erf_op}"])
        else:
            expected["scale"] = (scale, _EXPECTED["sqrt_2_pi"])
            expected["coeff"] = (coeff, _EXPECTED["coeff"])
            if three is not None:  # Pow(x, 3); x * x * x has no constant
                expected["three"] = (three, _EXPECTED["three"])
        for name, (value, want) in expected.items():
            got = match.scalar_with_tolerance(value)
            if got is None or not math.isclose(got[0], want, rel_tol=got[1]):
                return result.fail(f"{name} is {got[0] if got is not None else 'not a constant scalar'}, "
                                   f"GELU's is {want:.8g}", value)
        return match.float_guard(context, result, x, "GeluExt/GeLU")

    def rewrite(self, op, x, **_):
        return op.Gelu(x, _domain="mindspore") if self._kind == "erf" else op.GeluTanh(x, _domain="mindspore")


class GeluNative(pattern.RewriteRuleClassBase):
    """ONNX Gelu (opset >= 20)."""

    def pattern(self, op, x):
        return op.Gelu(x, _outputs=["y"])

    def check(self, context, x, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        approximate = y.producer().attributes.get("approximate")
        if approximate is not None and approximate.value not in ("none", "tanh"):
            return result.fail(f"approximate={approximate.value!r}", y.producer())
        return match.float_guard(context, result, x, "GeluExt/GeLU")

    def rewrite(self, op, x, y, **_):
        approximate = y.producer().attributes.get("approximate")
        if approximate is not None and approximate.value == "tanh":
            return op.GeluTanh(x, _domain="mindspore")
        return op.Gelu(x, _domain="mindspore")


OUTER = ("x*(half*(1+t))", "(x*(1+t))*half", "(x*half)*(1+t)")
RULES = [GeluNative.rule("Gelu-native")] + [
    GeluDecomposed.rule(f"Gelu-{kind}-{outer}{'-swapped' if swap else ''}", kind, outer, swap)
    for kind in ("erf", "tanh") for outer in OUTER for swap in (False, True)]
PASS = rewrite_pass("fuse-gelu", "exact (erf) and tanh GELU, decomposed or opset-20 Gelu -> mindspore::Gelu / "
                    "mindspore::GeluTanh", pattern.RewriteRuleSet(RULES))
