"""Elementwise ops: unary math, binary arithmetic with numpy broadcasting, comparisons, logic, casts."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphconv.dtypes import FLOATS
from opmap.registry import register

UNARY = {
    "Abs": "ops.abs", "Neg": "ops.neg", "Exp": "ops.exp", "Log": "ops.log", "Sqrt": "ops.sqrt",
    "Reciprocal": "ops.reciprocal", "Floor": "ops.floor", "Ceil": "ops.ceil", "Erf": "ops.erf",
    "Sigmoid": "ops.sigmoid", "Cos": "ops.cos", "Sin": "ops.sin", "Tan": "ops.tan", "Acos": "ops.acos",
    "Asin": "ops.asin", "Atan": "ops.atan", "Cosh": "ops.cosh", "Sinh": "ops.sinh", "Acosh": "ops.acosh",
    "Asinh": "ops.asinh", "Atanh": "ops.atanh", "Relu": "ops.relu", "Not": "ops.logical_not",
    "IsNaN": "ops.isnan", "Sign": "ops.sign", "Round": "ops.round", "Softsign": "ops.softsign",
    "Softplus": "ops.softplus",
}
OPERATORS = {"Add": "+", "Sub": "-", "Mul": "*"}
BINARY = {
    "Pow": "ops.pow", "Equal": "ops.equal", "Less": "ops.less", "LessOrEqual": "ops.less_equal",
    "Greater": "ops.greater", "GreaterOrEqual": "ops.greater_equal", "And": "ops.logical_and",
    "Or": "ops.logical_or", "Xor": "ops.logical_xor", "BitwiseAnd": "ops.bitwise_and",
    "BitwiseOr": "ops.bitwise_or", "BitwiseXor": "ops.bitwise_xor",
}


def _unary(target):
    return lambda n: n.call(target, n.x(0))


@register("Tanh", since=1)
def tanh(n):
    """ops.tanh on CPU is off by up to 1e-4 around |x| = 5; 2 * sigmoid(2x) - 1 stays within 1e-6."""
    return n.binop("-", n.binop("*", 2, n.call("ops.sigmoid", n.binop("*", 2, n.x(0)))), 1)


@register("BitwiseNot", since=18)
def bitwise_not(n):
    return n.call(n.call("ops.Invert"), n.x(0))  # mindspore 2.10 has no ops.bitwise_not


def _is_number(x) -> bool:
    return isinstance(x, (int, float))


def _operator(op):
    """Python operators take a scalar literal on either side (it broadcasts like a 0-d tensor and keeps the
    tensor's dtype), but not on both."""

    def lower(n):
        a, b = n.operand(0), n.operand(1)
        if _is_number(a) and _is_number(b):
            a = n.x(0)
        return n.binop(op, a, b)

    return lower


def _function(target):
    """ops.* functions get tensors, except Pow's exponent."""

    def lower(n):
        b = n.operand(1) if target == "ops.pow" else n.x(1)
        return n.call(target, n.x(0), b)

    return lower


for _op, _t in UNARY.items():
    register(_op, since=1)(_unary(_t))
for _op, _t in OPERATORS.items():
    register(_op, since=1)(_operator(_t))
for _op, _t in BINARY.items():
    if _op != "Pow":
        register(_op, since=1)(_function(_t))


@register("Pow", since=1)
def pow_(n):
    """The result has the base's type: an integer base with a float exponent is computed in float, then cast
    (truncated) like the ONNX reference."""
    y = _function(BINARY["Pow"])(n)
    base, exponent = n.dtype(0), n.dtype(1)
    if base is not None and exponent is not None and base != exponent and base not in FLOATS:
        return n.call("ops.cast", y, n.ms_dtype(base))
    return y


@register("Div", since=1)
def div(n):
    if n.dtype(0) in FLOATS:
        a, b = n.operand(0), n.operand(1)
        return n.binop("/", n.x(0) if _is_number(a) and _is_number(b) else a, b)
    # ONNX integer division truncates toward zero.
    return n.call("ops.div", n.x(0), n.x(1), rounding_mode="trunc")


@register("Mod", since=10)
def mod(n):
    """fmod=1: C's fmod (the sign of the dividend). fmod=0: the sign of the divisor, like Python; for floats
    (allowed from opset 28, run by onnxruntime before) A - floor(A / B) * B with the special cases of opset 28's
    spec. MindSpore's CPU kernels subtract no uint32/uint64: uint32 is computed in int64 (exact)."""
    dtype = n.dtype(0)
    if dtype == ir.DataType.UINT64:
        n.fail("Mod of uint64: MindSpore's CPU kernels have no uint64 subtraction")
    if dtype == ir.DataType.UINT32:
        wide = [n.call("ops.cast", n.x(i), n.ms_dtype(ir.DataType.INT64)) for i in (0, 1)]
        return n.call("ops.cast", n.call("ops.remainder", *wide), n.ms_dtype(dtype))
    if n.attr("fmod", 0):
        return n.call("ops.fmod", n.x(0), n.x(1))
    if dtype not in FLOATS:
        return n.call("ops.remainder", n.x(0), n.x(1))
    return _float_mod(n, n.x(0), n.x(1))


def _float_mod(n, a, b):
    """C's fmod moved to B's sign: fmod gives NaN for an infinite A or a zero B; for an infinite B it returns
    A (ops.fmod gives NaN there, hence the where); adding B where the signs differ gives B for a finite A
    against an infinite B of the other sign, as the spec says."""
    r = n.call("ops.fmod", a, b)
    keep = n.call("ops.logical_and", n.call("ops.isinf", b), n.call("ops.isfinite", a))
    r = n.named(n.call("ops.where", keep, a, r), "fmod")
    flip = n.call("ops.logical_and", n.binop("!=", r, 0),
                  n.call("ops.not_equal", n.binop("<", r, 0), n.binop("<", b, 0)))
    return n.call("ops.where", flip, n.binop("+", r, b), r)


@register("IsInf", since=10)
def isinf(n):
    pos, neg = n.attr("detect_positive", 1), n.attr("detect_negative", 1)
    x = n.x(0)
    if pos and neg:
        return n.call("ops.isinf", x)
    if pos or neg:
        return n.call("ops.logical_and", n.call("ops.isinf", x), n.binop(">" if pos else "<", x, 0))
    return n.method(n.call("ops.zeros_like", x), "astype", n.ms_dtype(ir.DataType.BOOL))


@register("Cast", since=1)
def cast(n):
    to = n.attr("to")
    if n.dtype(0) is not None and n.dtype(0) == ir.DataType(to):
        return n.x(0)  # a Cast to the dtype it already has is an identity (fp32 bodies' islands in fp32 models)
    return n.call("ops.cast", n.x(0), n.ms_dtype(to))


@register("CastLike", since=15)
def cast_like(n):
    if n.dtype(0) is not None and n.dtype(0) == n.dtype(1):
        return n.x(0)
    return n.call("ops.cast", n.x(0), n.ms_dtype(n.dtype(1)))


@register("Where", since=9)
def where(n):
    return n.call("ops.where", n.x(0), n.x(1), n.x(2))


@register("Clip", since=11)
def clip(n):
    x = n.x(0)
    if n.has(1):
        x = n.call("ops.maximum", x, n.x(1))
    if n.has(2):
        x = n.call("ops.minimum", x, n.x(2))
    return x


@register("Max", "Min", "Sum", "Mean", since=8)
def variadic(n):
    fn = {"Max": "ops.maximum", "Min": "ops.minimum", "Sum": None, "Mean": None}[n.node.op_type]
    xs = n.xs()
    acc = xs[0]
    for x in xs[1:]:
        acc = n.call(fn, acc, x) if fn else n.binop("+", acc, x)
    if n.node.op_type == "Mean" and len(xs) > 1:
        acc = n.binop("/", acc, len(xs))
    return acc


def _exp_minus_one(n, x, alpha: float):
    return n.binop("*", alpha, n.binop("-", n.call("ops.exp", x), 1))


@register("LeakyRelu", since=6)
def leaky_relu(n):
    return n.call("ops.leaky_relu", n.x(0), float(n.attr("alpha", 0.01)))


@register("Elu", since=6)
def elu(n):
    x = n.x(0)
    return n.call("ops.where", n.binop(">", x, 0), x, _exp_minus_one(n, x, float(n.attr("alpha", 1.0))))


@register("Selu", since=6)
def selu(n):
    x = n.x(0)
    a, g = float(n.attr("alpha", 1.67326319217681884765625)), float(n.attr("gamma", 1.05070102214813232421875))
    return n.binop("*", g, n.call("ops.where", n.binop(">", x, 0), x, _exp_minus_one(n, x, a)))


@register("HardSigmoid", since=6)
def hard_sigmoid(n):
    a, b = float(n.attr("alpha", 0.2)), float(n.attr("beta", 0.5))
    return n.call("ops.clamp", n.binop("+", n.binop("*", a, n.x(0)), b), 0.0, 1.0)


@register("HardSwish", since=14)
def hard_swish(n):
    x = n.x(0)
    return n.binop("*", x, n.call("ops.clamp", n.binop("+", n.binop("/", x, 6.0), 0.5), 0.0, 1.0))


@register("PRelu", since=9)
def prelu(n):
    x = n.x(0)
    return n.call("ops.where", n.binop("<", x, 0), n.binop("*", x, n.x(1)), x)


@register("ThresholdedRelu", since=10)
def thresholded_relu(n):
    x = n.x(0)
    return n.call("ops.where", n.binop(">", x, float(n.attr("alpha", 1.0))), x, n.call("ops.zeros_like", x))


@register("Gelu", since=20)
def gelu(n):
    approx = n.attr("approximate", "none")
    return n.call("ops.gelu", n.x(0), approximate="tanh" if approx == "tanh" else "none")


@register("Celu", since=12)
def celu(n):
    x, a = n.x(0), float(n.attr("alpha", 1.0))
    neg = n.call("ops.minimum", 0.0, n.binop("*", a, n.binop("-", n.call("ops.exp", n.binop("/", x, a)), 1)))
    return n.binop("+", n.call("ops.maximum", x, 0.0), neg)


@register("Mish", since=18)
def mish(n):
    return n.call("ops.mish", n.x(0))  # not x * tanh(softplus(x)): ops.tanh is off by up to 1e-4 on CPU


@register("Shrink", since=9)
def shrink(n):
    x, bias, lambd = n.x(0), float(n.attr("bias", 0.0)), float(n.attr("lambd", 0.5))
    inner = n.call("ops.where", n.binop(">", x, lambd), n.binop("-", x, bias), n.call("ops.zeros_like", x))
    return n.call("ops.where", n.binop("<", x, -lambd), n.binop("+", x, bias), inner)


# --- opsets 24-28 ---------------------------------------------------------------------------------------------

_UNSIGNED = {ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64}


@register("Swish", since=24)
def swish(n):
    x, alpha = n.x(0), float(n.attr("alpha", 1.0))
    return n.binop("*", x, n.call("ops.sigmoid", x if alpha == 1.0 else n.binop("*", alpha, x)))


_INTEGERS = _UNSIGNED | {ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64}


@register("BitShift", since=11)
def bit_shift(n):
    """A shift by a negative amount or by >= the bit width gives what the sign extension alone gives (0, or -1
    for a negative X shifted right); MindSpore's shifts are only defined within the width, so those lanes are
    shifted by 0 and replaced. Signed right shifts are arithmetic (opset 28 adds the signed types)."""
    dtype = n.dtype(0)
    if dtype not in _INTEGERS:
        n.fail(f"BitShift of {dtype} is not an integer type")
    x, y = n.x(0), n.x(1)
    right = n.attr("direction") == "RIGHT"
    # (a tensor of X's type: MindSpore does not mix an int literal with an unsigned tensor)
    bad = n.binop(">=", y, n.const_tensor(np.array(dtype.bitwidth, dtype.numpy()), "bits"))
    if dtype not in _UNSIGNED:
        bad = n.call("ops.logical_or", bad, n.binop("<", y, 0))
    zero = n.call("ops.zeros_like", y)
    shifted = n.call("ops.bitwise_right_shift" if right else "ops.bitwise_left_shift", x,
                     n.call("ops.where", bad, zero, y))
    fill = n.call("ops.zeros_like", shifted)
    if right and dtype not in _UNSIGNED:
        fill = n.call("ops.where", n.binop("<", x, 0), n.binop("-", fill, 1), fill)
    return n.call("ops.where", bad, fill, shifted)


@register("BitCast", since=26)
def bit_cast(n):
    """The same bits read as another type of the same width. Between integer types of one width (and bool to
    an 8-bit integer) that is a modular integer Cast. Float bits would need a reinterpreting view, and
    MindSpore 2.10's view_dtype has no graph-mode implementation ("infer failed, not impl")."""
    to, src = ir.DataType(n.attr("to")), n.dtype(0)
    if src is None:
        n.fail("the input's dtype is unknown")
    if src.bitwidth != to.bitwidth:
        n.fail(f"BitCast from {src.name} to {to.name}: the bit widths differ")
    if src == to:
        return n.x(0)
    if (src in _INTEGERS or src == ir.DataType.BOOL) and to in _INTEGERS:
        return n.call("ops.cast", n.x(0), n.ms_dtype(to))
    n.fail(f"BitCast from {src.name} to {to.name}: MindSpore 2.10 cannot reinterpret float bits in graph mode "
           "(ops.view_dtype is not implemented there)")
