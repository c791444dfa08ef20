"""fuse-gelu: GELU -> mindspore::Gelu (exact, erf) or mindspore::GeluTanh (tanh approximation); quick GELU
x * sigmoid(1.702 x) -> mindspore::FastGelu.

Spellings matched (each with Mul/Add operands in either order), T being the inner term below:
  outer       Mul(x, Mul(0.5, 1 + T))  (dynamo)  |  Mul(Mul(x, 1 + T), 0.5)  (TorchScript)
              | Mul(Mul(x, 0.5), 1 + T)  (transformers' NewGELU / gelu_new, Bloom)
  exact       T = Erf(Div(x, 1.4142135)) | Erf(Mul(x, 0.70710678))
  tanh        T = Tanh(Mul(0.7978845608, Add(x, Mul(0.044715, cube)))), cube = Pow(x, 3) | Mul(x, Mul(x, x))
  factored    T = Tanh(Mul(Mul(0.7978845608, x), Add(1, square))) | Tanh(Mul(0.7978845608, Mul(x, Add(1, square)))),
              square = Mul(Mul(0.044715, x), x) | Mul(0.044715, Mul(x, x)): transformers' bloom_gelu_forward
              x * 0.5 * (1.0 + tanh(0.79788456 * x * (1 + 0.044715 * x * x))), which dynamo writes as
              Mul(Mul(x, 0.5), Add(Tanh(Mul(Mul(x, 0.79788456), Add(Mul(Mul(x, 0.044715), x), 1))), 1)).
              It is the tanh GELU: sqrt(2/pi) * x * (1 + 0.044715 x^2) = sqrt(2/pi) * (x + 0.044715 x^3) by
              distributing x (exact in real arithmetic; in fp32 the two orders differ by rounding only), and
              Bloom's 0.79788456 is sqrt(2/pi) = 0.7978845608... to 1e-9 (both round to the same fp32 value).
  folded 0.5  x * (1 + T) with no 0.5 anywhere: onnxsim folded the 0.5 into the next Conv/MatMul's weight
              (Whisper's conv stem through TorchScript) -> 2 * GELU(x), exact (a power of two)
  native      opset 20's Gelu(x, approximate="none" | "tanh")
  quick       Mul(x, Sigmoid(Mul(x, 1.702))) -> mindspore::FastGelu (MindSpore's FastGeLU is exactly
              x * sigmoid(1.702 x), docs/fused_ops.md): CLIP's quick_gelu, transformers' QuickGELUActivation
Constants are compared with a relative tolerance of 1e-5 (exporters print them at fp32 precision), or the
rounding of their dtype (fp16/bf16 constants).
Refused (the report's check reasons): constants of other values (e.g. "coeff is 0.1, GELU's is 0.044715",
"Sigmoid's scale is 2, quick GELU's (FastGeLU) is 1.702"), dtypes other than fp32/fp16/bf16 (GeluExt and GeLU
take those; FastGeLU takes fp32/fp16 only, no bf16), fp16/bf16 below opset 15 (the reference body's CastLike).
FastGeLU is never a target for the exact or the tanh GELU (a different function), nor GeLU for quick GELU.

Coverage candidates (family "gelu", passes/coverage.py): every Erf, every Gelu, every Tanh of a GELU-shaped
argument (a 0.044715, sqrt(2/pi) or 0.044715*sqrt(2/pi) coefficient within four producers), every Sigmoid of x
times a constant other than 1 (quick GELU). A candidate this pass leaves is explained by `explain` below (the
constant that differs from GELU's, or the part of 0.5 * x * (1 + T) / x * sigmoid(1.702 x) that is missing),
when no check recorded a reason.
"""

from __future__ import annotations

import math

import numpy as np

import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.onnx_domains import is_default_domain
from passes import coverage, match
from passes.manager import rewrite_pass

_EXPECTED = {
    "half": 0.5, "one": 1.0, "one_inner": 1.0, "three": 3.0, "coeff": 0.044715,
    "sqrt_2_pi": math.sqrt(2.0 / math.pi), "erf_div": math.sqrt(2.0), "erf_mul": 1.0 / math.sqrt(2.0),
}
QUICK_GELU_SCALE = 1.702
# Where each constant sits, for the reasons.
_WHERE = {
    "half": "the outer 0.5", "one": "the 1 of 1 + T", "scale": None, "coeff": None, "three": "the cube's exponent",
    "one_inner": "the 1 of 1 + 0.044715 x^2",
}


def _times(op, v, c, c_first: bool):
    """Mul(v, c) or Mul(c, v) of a tensor v and a constant c, the order a rule variant. Not match.mul: its
    alternatives backtrack only locally, so where c is visited before v is bound elsewhere (a swapped root),
    Mul(c, x) would bind x to the constant and the match fail later."""
    return op.Mul(c, v) if c_first else op.Mul(v, c)


class GeluDecomposed(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, kind: str, outer: str, swap: bool, orders: tuple = ()):
        super().__init__(name)
        self._kind, self._outer, self._swap = kind, outer, swap
        # the order of each tensor-times-constant Mul: erf ("div" | "x*s" | "s*x"), factored (coeff first,
        # scale first)
        self._orders = orders

    def pattern(self, op, x, half, one, scale, coeff, three, one_inner):
        if self._kind == "erf":
            (arg_form,) = self._orders
            arg = op.Div(x, scale) if arg_form == "div" else _times(op, x, scale, arg_form == "s*x")
            t = op.Erf(arg)
        elif self._kind == "tanh":
            cube = pattern.OrValue([op.Pow(x, three), match.mul(op, x, match.mul(op, x, x))])
            t = op.Tanh(match.mul(op, scale, match.add(op, x, match.mul(op, coeff, cube))))
        else:  # factored (Bloom): sqrt(2/pi) * x * (1 + 0.044715 * x * x)
            coeff_first, scale_first = self._orders
            square = pattern.OrValue([match.mul(op, _times(op, x, coeff, coeff_first), x),
                                      match.mul(op, coeff, match.mul(op, x, x))])
            one_plus_square = match.add(op, one_inner, square)
            t = op.Tanh(pattern.OrValue([match.mul(op, _times(op, x, scale, scale_first), one_plus_square),
                                         match.mul(op, scale, match.mul(op, x, one_plus_square))]))
        one_plus = match.add(op, t, one)
        # The root Mul's operand order is a rule variant (a pattern's root is a node, not alternatives).
        if self._outer == "x*(half*(1+t))":
            a, b = x, match.mul(op, half, one_plus)
        elif self._outer == "(x*(1+t))*half":
            a, b = match.mul(op, x, one_plus), half
        elif self._outer == "x*(1+t)":  # the 0.5 folded into the next layer's weight (onnxsim): 2 * GELU
            a, b = x, one_plus
        else:  # (x*half)*(1+t) | (half*x)*(1+t)
            a, b = _times(op, x, half, self._outer == "(half*x)*(1+t)"), one_plus
        return op.Mul(b, a) if self._swap else op.Mul(a, b)

    def check(self, context, x, half, one, scale, coeff=None, three=None, one_inner=None,
              **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        expected = {"half": (half, _EXPECTED["half"]), "one": (one, _EXPECTED["one"])}
        if self._outer == "x*(1+t)":
            del expected["half"]
            root = context.output_values[0]
            if any(u.node.op_type == "Mul" and any(match.close_to(v, 0.5) for v in u.node.inputs)
                   for u in root.uses()):
                return result.fail("")  # the 0.5 follows: the rule with it takes the whole GELU (no reason)
        if self._kind == "erf":
            expected["scale"] = (scale, _EXPECTED["erf_div" if self._orders == ("div",) else "erf_mul"])
        else:
            expected["scale"] = (scale, _EXPECTED["sqrt_2_pi"])
            expected["coeff"] = (coeff, _EXPECTED["coeff"])
            if three is not None:  # Pow(x, 3); x * x * x has no constant
                expected["three"] = (three, _EXPECTED["three"])
            if one_inner is not None:
                expected["one_inner"] = (one_inner, _EXPECTED["one_inner"])
        for name, (value, want) in expected.items():
            got = match.scalar_with_tolerance(value)
            if got is None or not math.isclose(got[0], want, rel_tol=got[1]):
                found = format(got[0], ".7g") if got is not None else "not a constant scalar"
                return result.fail(f"{name} is {found}, GELU's is {want:.7g} ({self._where(name)})", value)
        return match.float_guard(context, result, x, "GeluExt/GeLU")

    def _where(self, name: str) -> str:
        if name == "scale":
            return {"erf": "the Erf argument's scale of x"}.get(self._kind, "the Tanh argument's sqrt(2/pi)")
        if name == "coeff":
            return ("the Tanh argument's x^2 coefficient in x * (1 + c x^2)" if self._kind == "factored" else
                    "the Tanh argument's x^3 coefficient")
        return _WHERE[name]

    def rewrite(self, op, x, **_):
        y = op.Gelu(x, _domain="mindspore") if self._kind == "erf" else op.GeluTanh(x, _domain="mindspore")
        if self._outer == "x*(1+t)":  # x * (1 + t) = 2 * GELU(x): exact in binary floating point
            return op.Mul(y, op.Constant(value=ir.tensor(np.array(2.0, x.dtype.numpy()))))
        return y


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


def _fast_gelu_dtype(x: ir.Value) -> str | None:
    """FastGeLU's dtype restriction (fp16/fp32: MindSpore 2.10's docstring and CPU kernel), else None."""
    if x.dtype == ir.DataType.BFLOAT16:
        return "dtype BFLOAT16: FastGeLU takes float16 or float32"
    return None


class QuickGelu(pattern.RewriteRuleClassBase):
    """x * sigmoid(1.702 x) -> mindspore::FastGelu."""

    def __init__(self, name: str, sigmoid_first: bool, k_first: bool):
        super().__init__(name)
        self._sigmoid_first, self._k_first = sigmoid_first, k_first

    def pattern(self, op, x, k):
        # Both operand orders as rule variants: with the Sigmoid first, a match.mul alternative binding x to the
        # constant would not be revisited when the root's x then disagrees.
        s = op.Sigmoid(op.Mul(k, x) if self._k_first else op.Mul(x, k))
        return op.Mul(s, x) if self._sigmoid_first else op.Mul(x, s)

    def check(self, context, x, k, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        reason = _fast_gelu_dtype(x)  # first: the dtype rules FastGeLU out whatever the scale
        if reason:
            return result.fail(reason, x)
        got = match.scalar(k)
        if got is None:
            return result.fail("Sigmoid's argument is x times a non-constant: not quick GELU", k)
        if not match.close_to(k, QUICK_GELU_SCALE):
            return result.fail(f"Sigmoid's scale is {got:.7g}, quick GELU's (FastGeLU) is {QUICK_GELU_SCALE}", k)
        return match.float_guard(context, result, x, "FastGeLU")

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain="mindspore")


# --- coverage: why a candidate was not fused ------------------------------------------------------------------

_TANH_CONSTANTS = {"0.044715 (GELU's x^3 / x^2 coefficient)": _EXPECTED["coeff"],
                   "sqrt(2/pi) = 0.7978845608": _EXPECTED["sqrt_2_pi"],
                   "0.044715 * sqrt(2/pi) = 0.0356774081": _EXPECTED["coeff"] * _EXPECTED["sqrt_2_pi"]}


def _subtree_scalars(value: ir.Value | None, depth: int) -> list[float]:
    p = value.producer() if value is not None else None
    if p is None or depth == 0:
        return []
    found = []
    for v in p.inputs:
        c = match.scalar(v)
        if c is not None:
            found.append(c)
        elif v is not None:
            found += _subtree_scalars(v, depth - 1)
    return found



def _dtype_reason(x: ir.Value | None, op_name: str) -> str | None:
    if x is not None and x.dtype is not None and x.dtype not in match.FLOATS:
        return f"dtype {x.dtype}: {op_name} takes float32, float16 or bfloat16"
    return None


def _outer_reason(t: ir.Value, what: str) -> str:
    """Why T (an Erf or Tanh result) is not in 0.5 * x * (1 + T)."""
    adds = match.users(t, "Add")
    ones = [a for a in adds if any(v is not t and match.close_to(v, 1.0) for v in a.inputs)]
    if not ones:
        others = [match.scalar(v) for a in adds for v in a.inputs if v is not t]
        if others and others[0] is not None:
            return f"{what}'s result is added to {others[0]:.7g}, GELU adds 1 (0.5 * x * (1 + {what}))"
        return f"{what}'s result is not in 1 + {what} (GELU's 0.5 * x * (1 + {what}))"
    # The outer factor: a scalar operand of the Muls around 1 + T (x * (half * (1 + T)), (x * half) * (1 + T),
    # (x * (1 + T)) * half).
    outer = [u for a in ones for u in match.users(a.outputs[0], "Mul")]
    around = outer + [u for m in outer for u in match.users(m.outputs[0], "Mul")]
    around += [match.producer(v, "Mul") for m in outer for v in m.inputs if match.producer(v, "Mul") is not None]
    for m in around:
        for v in m.inputs:
            c = match.scalar(v)
            if c is not None and not math.isclose(c, 0.5, rel_tol=1e-5):
                return f"the outer factor is {c:.7g}, GELU's is 0.5 (0.5 * x * (1 + {what}))"
    return f"1 + {what} is not multiplied by 0.5 * x of the x inside {what} (GELU's 0.5 * x * (1 + {what}))"


def _explain_tanh(node: ir.Node) -> str | None:
    reason = _dtype_reason(node.inputs[0], "GeLU")
    if reason:
        return reason
    scalars = [c for c in _subtree_scalars(node.inputs[0], 4) if c not in (1.0, 2.0, 3.0)]
    matched = {name for name, want in _TANH_CONSTANTS.items() for c in scalars
               if math.isclose(c, want, rel_tol=1e-5)}
    for c in scalars:
        if any(math.isclose(c, want, rel_tol=1e-5) for want in _TANH_CONSTANTS.values()):
            continue
        # The GELU constant it stands in for: the nearest one (relatively) that the argument lacks.
        missing = [name for name in _TANH_CONSTANTS if name not in matched] or list(_TANH_CONSTANTS)
        nearest = min(missing, key=lambda name: abs(math.log(abs(c) / _TANH_CONSTANTS[name])) if c else math.inf)
        return f"Tanh argument's coefficient is {c:.7g}, GELU's is {nearest}"
    if not matched:
        return "the Tanh argument holds none of GELU's constants (0.044715, sqrt(2/pi))"
    return _outer_reason(node.outputs[0], "tanh")


def _explain_erf(node: ir.Node) -> str | None:
    reason = _dtype_reason(node.inputs[0], "GeluExt")
    if reason:
        return reason
    arg = node.inputs[0].producer() if node.inputs[0] is not None else None
    if arg is None or not is_default_domain(arg.domain) or arg.op_type not in ("Div", "Mul"):
        return "the Erf argument is not x / sqrt(2) or x * (1/sqrt(2)) (GELU's erf(x / sqrt(2)))"
    want = _EXPECTED["erf_div"] if arg.op_type == "Div" else _EXPECTED["erf_mul"]
    c = match.scalar(arg.inputs[1]) if arg.op_type == "Div" else next(
        (s for s in map(match.scalar, arg.inputs) if s is not None), None)
    if c is None:
        return "the Erf argument's scale is not a constant (GELU's erf(x / sqrt(2)))"
    if not math.isclose(c, want, rel_tol=1e-5):
        inv = "1/" if arg.op_type == "Div" else ""
        return f"the Erf argument's scale is {inv}{c:.7g}, GELU's is {inv}{want:.7g}"
    return _outer_reason(node.outputs[0], "erf")


def _explain_sigmoid(node: ir.Node) -> str | None:
    scaled = match.producer(node.inputs[0], "Mul")
    if scaled is None:
        return None
    x = next((v for v in scaled.inputs if match.scalar(v) is None), None)
    k = next((s for s in map(match.scalar, scaled.inputs) if s is not None), None)
    if x is None or k is None:
        return "Sigmoid(c * x) with no constant c and tensor x"
    if not any(x in u.node.inputs for u in node.outputs[0].uses() if u.node.op_type == "Mul"):
        return f"Sigmoid({k:.7g} * x) is not multiplied by the same x: a sigmoid gate, not quick GELU"
    if not math.isclose(k, QUICK_GELU_SCALE, rel_tol=1e-5):
        return f"Sigmoid's scale is {k:.7g}, quick GELU's (FastGeLU) is {QUICK_GELU_SCALE}"
    return _fast_gelu_dtype(x) or _dtype_reason(x, "FastGeLU")


def explain(node: ir.Node) -> str | None:
    """The reason a gelu-family candidate (coverage.gelu_candidates) was not fused, or None."""
    if node.op_type == "Tanh":
        return _explain_tanh(node)
    if node.op_type == "Erf":
        return _explain_erf(node)
    if node.op_type == "Sigmoid":
        return _explain_sigmoid(node)
    if node.op_type == "Gelu":
        approximate = node.attributes.get("approximate")
        if approximate is not None and approximate.value not in ("none", "tanh"):
            return f"approximate={approximate.value!r}"
        return _dtype_reason(node.inputs[0], "GeluExt/GeLU")
    return None


coverage.set_explain("gelu", explain)

OUTER = ("x*(half*(1+t))", "(x*(1+t))*half", "(x*half)*(1+t)", "(half*x)*(1+t)", "x*(1+t)")
ORDERS = {"erf": [("div",), ("x*s",), ("s*x",)], "tanh": [()],
          "factored": [(c, s) for c in (False, True) for s in (False, True)]}


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass)."""
    return pattern.RewriteRuleSet(
        [GeluNative.rule("Gelu-native")] +
        [GeluDecomposed.rule(f"Gelu-{kind}-{outer}{'-swapped' if swap else ''}"
                             f"{''.join(f'-{o}' for o in orders)}", kind, outer, swap, orders)
         for kind in ("erf", "tanh", "factored") for orders in ORDERS[kind] for outer in OUTER
         for swap in (False, True)] +
        [QuickGelu.rule(f"FastGelu{'-sigmoid-first' if s else ''}{'-k-first' if k else ''}", s, k)
         for s in (False, True) for k in (False, True)])


PASS = rewrite_pass("fuse-gelu", "exact (erf), tanh (also Bloom's factored form) and quick GELU, decomposed or "
                    "opset-20 Gelu -> mindspore::Gelu / mindspore::GeluTanh / mindspore::FastGelu",
                    rules, candidates=coverage.gelu_candidates)
