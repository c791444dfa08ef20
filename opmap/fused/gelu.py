"""mindspore::Gelu(x) -> y (exact, erf) and mindspore::GeluTanh(x) -> y (tanh approximation) (docs/fused_ops.md).

Gelu      y = 0.5 * x * (1 + erf(x / sqrt(2)))                                  ascend: GeluExt(x, 'none')
GeluTanh  y = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))        ascend: GeLU(x)
Both computed in fp32 (cast back to x's dtype). MindSpore's `GeLU` primitive IS the tanh approximation despite
its docstring; the exact GELU has no fused primitive but `GeluExt` (mint.nn.functional.gelu, Ascend only).
FastGeLU (x * sigmoid(1.702 x)) is a different function and never emitted.

Two op names rather than one Gelu with an `approximate` attribute: the table attaches one function body per
op name, and an ONNX function body cannot branch on a string attribute before opset 20 (its Gelu op), while
graphconv fuses at opsets 13 and up.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

from opmap.fused.record import FusedOp, define, fp32_island
from opmap.registry import register

SQRT1_2 = 1.0 / math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBE_COEFF = 0.044715


def _const(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value_float=value)


def _half_x_one_plus(t: str) -> list[onnx.NodeProto]:
    """y32 = 0.5 * x32 * (1 + t)"""
    return [_const("half", 0.5), _const("one", 1.0),
            helper.make_node("Add", [t, "one"], ["one_plus"]),
            helper.make_node("Mul", ["x32", "half"], ["half_x"]),
            helper.make_node("Mul", ["half_x", "one_plus"], ["y32"])]


def _exact_body(opset: int) -> list[onnx.NodeProto]:
    return fp32_island(opset, [
        _const("sqrt1_2", SQRT1_2),
        helper.make_node("Mul", ["x32", "sqrt1_2"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
    ] + _half_x_one_plus("erf"))


def _tanh_body(opset: int) -> list[onnx.NodeProto]:
    return fp32_island(opset, [
        _const("coeff", TANH_CUBE_COEFF), _const("sqrt_2_pi", SQRT_2_OVER_PI),
        helper.make_node("Mul", ["x32", "x32"], ["x2"]),
        helper.make_node("Mul", ["x2", "x32"], ["x3"]),
        helper.make_node("Mul", ["x3", "coeff"], ["cx3"]),
        helper.make_node("Add", ["x32", "cx3"], ["inner"]),
        helper.make_node("Mul", ["inner", "sqrt_2_pi"], ["arg"]),
        helper.make_node("Tanh", ["arg"], ["tanh"]),
    ] + _half_x_one_plus("tanh"))


GELU = define(FusedOp(
    name="Gelu", inputs=("x",), outputs=("y",), attributes=(), body=_exact_body, primitive="GeluExt",
    doc="exact GELU: 0.5 * x * (1 + erf(x / sqrt(2))), fp32 compute", producer="fuse-gelu", family="gelu",
    likely_causes="exact vs tanh GELU confused (GeluExt 'none' vs GeLU), the erf scale 1/sqrt(2)"))
GELU_TANH = define(FusedOp(
    name="GeluTanh", inputs=("x",), outputs=("y",), attributes=(), body=_tanh_body, primitive="GeLU",
    doc="tanh GELU: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), fp32 compute",
    producer="fuse-gelu", family="gelu",
    likely_causes="tanh vs exact GELU confused, the 0.044715 / sqrt(2/pi) constants (Bloom's factored form)"))


@register("Gelu", since=1, domain="mindspore")
def lower_gelu(n):
    # GeluExt takes approximate as a string (an enum in the MindIR: 'none' = 0).
    return n.call(n.call("ops.auto_generate.GeluExt"), n.x(0), "none")


@register("GeluTanh", since=1, domain="mindspore")
def lower_gelu_tanh(n):
    return n.call(n.call("ops.GeLU"), n.x(0))
