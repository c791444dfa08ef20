"""mindspore::Swiglu(x; dim) -> y, MindSpore's `Swiglu` primitive (ops.auto_generate; docs/fused_ops.md).

a, b = split(x, 2, dim); y = silu(a) * b, computed in fp32 and cast back to x's dtype. The FIRST half goes
through SiLU (MindSpore's golden test and CANN's aclnnSwiGlu agree), so a merged gate/up projection
concatenates its weights as [gate ; up] along the output dim.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from opmap.fused.record import FusedOp, define
from opmap.registry import register


def _body(opset: int) -> list[onnx.NodeProto]:
    """Before opset 15 there is no CastLike to return to x's dtype: the body then computes in x's dtype, and
    the fusion only takes fp32 inputs there (passes/fuse_swiglu.py checks it)."""
    cast = opset >= 15
    # Split into two equal halves along `dim`: without a `split` input before opset 18, num_outputs from 18.
    split = helper.make_node("Split", ["x"], ["a", "b"], **({"num_outputs": 2} if opset >= 18 else {}))
    split.attribute.append(helper.make_attribute_ref("axis", onnx.AttributeProto.INT, ref_attr_name="dim"))

    def to32(name: str) -> onnx.NodeProto:
        return (helper.make_node("Cast", [name], [f"{name}32"], to=TensorProto.FLOAT) if cast else
                helper.make_node("Identity", [name], [f"{name}32"]))

    return [
        split, to32("a"), to32("b"),
        helper.make_node("Sigmoid", ["a32"], ["sig"]),
        helper.make_node("Mul", ["a32", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "b32"], ["y32"]),
        helper.make_node("CastLike", ["y32", "x"], ["y"]) if cast else helper.make_node("Identity", ["y32"], ["y"]),
    ]


SWIGLU = define(FusedOp(name="Swiglu", inputs=("x",), outputs=("y",), attributes=("dim",), body=_body,
                        primitive="Swiglu", doc=__doc__, producer="fuse-swiglu", family="gated_mlp",
                        likely_causes="the half order (SiLU takes the FIRST half), the merged [gate ; up] weight, "
                                      "the split axis"))


@register("Swiglu", since=1, domain="mindspore")
def lower_swiglu(n):
    return n.call(n.call("ops.auto_generate.Swiglu"), n.x(0), int(n.attr("dim")))
