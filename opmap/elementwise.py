"""Elementwise ops: unary math, binary arithmetic with numpy broadcasting, comparisons, logic, casts."""

from __future__ import annotations

import onnx_ir as ir

from opmap.registry import register

_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}

UNARY = {
    "Abs": "ops.abs({})", "Neg": "ops.neg({})", "Exp": "ops.exp({})", "Log": "ops.log({})",
    "Sqrt": "ops.sqrt({})", "Reciprocal": "ops.reciprocal({})", "Floor": "ops.floor({})", "Ceil": "ops.ceil({})",
    # ops.tanh on CPU is off by up to 1e-4 around |x| = 5; 2 * sigmoid(2x) - 1 stays within 1e-6.
    "Erf": "ops.erf({})", "Tanh": "(2 * ops.sigmoid(2 * {0}) - 1)", "Sigmoid": "ops.sigmoid({})", "Cos": "ops.cos({})",
    "Sin": "ops.sin({})", "Tan": "ops.tan({})", "Acos": "ops.acos({})", "Asin": "ops.asin({})",
    "Atan": "ops.atan({})", "Cosh": "ops.cosh({})", "Sinh": "ops.sinh({})", "Acosh": "ops.acosh({})",
    "Asinh": "ops.asinh({})", "Atanh": "ops.atanh({})", "Relu": "ops.relu({})", "Not": "ops.logical_not({})",
    "IsNaN": "ops.isnan({})", "Sign": "ops.sign({})", "Round": "ops.round({})", "Softsign": "ops.softsign({})",
    "Softplus": "ops.softplus({})", "BitwiseNot": "ops.Invert()({})",  # mindspore 2.10 has no ops.bitwise_not
}
BINARY = {
    "Add": "{} + {}", "Sub": "{} - {}", "Mul": "{} * {}", "Pow": "ops.pow({}, {})",
    "Equal": "ops.equal({}, {})", "Less": "ops.less({}, {})", "LessOrEqual": "ops.less_equal({}, {})",
    "Greater": "ops.greater({}, {})", "GreaterOrEqual": "ops.greater_equal({}, {})",
    "And": "ops.logical_and({}, {})", "Or": "ops.logical_or({}, {})", "Xor": "ops.logical_xor({}, {})",
    "BitwiseAnd": "ops.bitwise_and({}, {})", "BitwiseOr": "ops.bitwise_or({}, {})",
    "BitwiseXor": "ops.bitwise_xor({}, {})",
}


def _unary(template):
    return lambda n: template.format(n.x(0))


def _is_literal(expr: str) -> bool:
    return expr[0].isdigit() or expr[0] == "-"


def _binary(template):
    """Python operators take a scalar literal on either side (it broadcasts like a 0-d tensor and keeps the
    tensor's dtype); ops.* functions get tensors, except Pow's exponent."""
    is_operator = template.startswith("{} ")

    def lower(n):
        a, b = n.operand(0), n.operand(1)
        if _is_literal(a) and (_is_literal(b) or not is_operator):
            a = n.x(0)
        if _is_literal(b) and not is_operator and n.node.op_type != "Pow":
            b = n.x(1)
        return template.format(a, b)

    return lower


for _op, _t in UNARY.items():
    register(_op, since=1)(_unary(_t))
for _op, _t in BINARY.items():
    if _op != "Pow":
        register(_op, since=1)(_binary(_t))


@register("Pow", since=1)
def pow_(n):
    """The result has the base's type: an integer base with a float exponent is computed in float, then cast
    (truncated) like the ONNX reference."""
    y = _binary(BINARY["Pow"])(n)
    base, exponent = n.dtype(0), n.dtype(1)
    if base is not None and exponent is not None and base != exponent and base not in _FLOATS:
        return f"ops.cast({y}, {n.ms_dtype(base)})"
    return y


@register("Div", since=1)
def div(n):
    if n.dtype(0) in _FLOATS:
        a, b = n.operand(0), n.operand(1)
        return f"{n.x(0) if _is_literal(a) and _is_literal(b) else a} / {b}"
    # ONNX integer division truncates toward zero.
    return f"ops.div({n.x(0)}, {n.x(1)}, rounding_mode='trunc')"


@register("Mod", since=10)
def mod(n):
    if n.attr("fmod", 0):
        return f"ops.fmod({n.x(0)}, {n.x(1)})"  # sign of the dividend, like C
    return f"ops.remainder({n.x(0)}, {n.x(1)})"  # sign of the divisor, like Python


@register("IsInf", since=10)
def isinf(n):
    pos, neg = n.attr("detect_positive", 1), n.attr("detect_negative", 1)
    x = n.x(0)
    if pos and neg:
        return f"ops.isinf({x})"
    if pos:
        return f"ops.logical_and(ops.isinf({x}), {x} > 0)"
    if neg:
        return f"ops.logical_and(ops.isinf({x}), {x} < 0)"
    return f"ops.zeros_like({x}).astype(ms.bool_)"


@register("Cast", since=1)
def cast(n):
    return f"ops.cast({n.x(0)}, {n.ms_dtype(n.attr('to'))})"


@register("CastLike", since=15)
def cast_like(n):
    return f"ops.cast({n.x(0)}, {n.ms_dtype(n.dtype(1))})"


@register("Where", since=9)
def where(n):
    return f"ops.where({n.x(0)}, {n.x(1)}, {n.x(2)})"


@register("Clip", since=11)
def clip(n):
    lo = n.x(1) if n.has(1) else None
    hi = n.x(2) if n.has(2) else None
    x = n.x(0)
    if lo is not None:
        x = f"ops.maximum({x}, {lo})"
    if hi is not None:
        x = f"ops.minimum({x}, {hi})"
    return x


@register("Max", "Min", "Sum", "Mean", since=8)
def variadic(n):
    fn = {"Max": "ops.maximum", "Min": "ops.minimum", "Sum": None, "Mean": None}[n.node.op_type]
    xs = n.xs()
    acc = xs[0]
    for x in xs[1:]:
        acc = f"{fn}({acc}, {x})" if fn else f"({acc} + {x})"
    if n.node.op_type == "Mean" and len(xs) > 1:
        acc = f"{acc} / {len(xs)}"
    return acc


@register("LeakyRelu", since=6)
def leaky_relu(n):
    return f"ops.leaky_relu({n.x(0)}, {float(n.attr('alpha', 0.01))!r})"


@register("Elu", since=6)
def elu(n):
    x = n.x(0)
    return f"ops.where({x} > 0, {x}, {float(n.attr('alpha', 1.0))!r} * (ops.exp({x}) - 1))"


@register("Selu", since=6)
def selu(n):
    x, a, g = n.x(0), float(n.attr("alpha", 1.67326319217681884765625)), float(n.attr("gamma", 1.05070102214813232421875))
    return f"{g!r} * ops.where({x} > 0, {x}, {a!r} * (ops.exp({x}) - 1))"


@register("HardSigmoid", since=6)
def hard_sigmoid(n):
    a, b = float(n.attr("alpha", 0.2)), float(n.attr("beta", 0.5))
    return f"ops.clamp({a!r} * {n.x(0)} + {b!r}, 0.0, 1.0)"


@register("HardSwish", since=14)
def hard_swish(n):
    x = n.x(0)
    return f"{x} * ops.clamp({x} / 6.0 + 0.5, 0.0, 1.0)"


@register("PRelu", since=9)
def prelu(n):
    x = n.x(0)
    return f"ops.where({x} < 0, {x} * {n.x(1)}, {x})"


@register("ThresholdedRelu", since=10)
def thresholded_relu(n):
    x = n.x(0)
    return f"ops.where({x} > {float(n.attr('alpha', 1.0))!r}, {x}, ops.zeros_like({x}))"


@register("Gelu", since=20)
def gelu(n):
    approx = n.attr("approximate", "none")
    return f"ops.gelu({n.x(0)}, approximate={'tanh' if approx == 'tanh' else 'none'!r})"


@register("Celu", since=12)
def celu(n):
    x, a = n.x(0), float(n.attr("alpha", 1.0))
    return f"ops.maximum({x}, 0.0) + ops.minimum(0.0, {a!r} * (ops.exp({x} / {a!r}) - 1))"


@register("Mish", since=18)
def mish(n):
    return f"ops.mish({n.x(0)})"  # not x * tanh(softplus(x)): ops.tanh is off by up to 1e-4 on CPU


@register("Shrink", since=9)
def shrink(n):
    x, bias, lambd = n.x(0), float(n.attr("bias", 0.0)), float(n.attr("lambd", 0.5))
    return (f"ops.where({x} < {-lambd!r}, {x} + {bias!r}, ops.where({x} > {lambd!r}, {x} - {bias!r}, "
            f"ops.zeros_like({x})))")
