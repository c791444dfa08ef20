"""mindspore::Swiglu(x; dim) -> y, MindSpore's `Swiglu` primitive (ops.auto_generate; docs/fused_ops.md).

a, b = split(x, 2, dim); y = silu(a) * b, computed in fp32 and cast back to x's dtype. The FIRST half goes
through SiLU (MindSpore's golden test and CANN's aclnnSwiGlu agree), so a merged gate/up projection
concatenates its weights as [gate ; up] along the output dim.
"""

from __future__ import annotations

import onnx
from onnx import helper

from opmap.fused.record import FusedOp, define, from_fp32, to_fp32
from opmap.registry import register


def _body(opset: int) -> list[onnx.NodeProto]:
    """The halves in an fp32 island (record.island_casts: not before opset 15, where the fusion only takes
    fp32 inputs; passes/fuse_swiglu.py checks it)."""
    # Split into two equal halves along `dim`: without a `split` input before opset 18, num_outputs from 18.
    split = helper.make_node("Split", ["x"], ["a", "b"], **({"num_outputs": 2} if opset >= 18 else {}))
    split.attribute.append(helper.make_attribute_ref("axis", onnx.AttributeProto.INT, ref_attr_name="dim"))
    return [
        split, to_fp32(opset, "a", "a32"), to_fp32(opset, "b", "b32"),
        helper.make_node("Sigmoid", ["a32"], ["sig"]),
        helper.make_node("Mul", ["a32", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "b32"], ["y32"]),
        from_fp32(opset, "y32", "x", "y"),
    ]


SWIGLU = define(FusedOp(name="Swiglu", inputs=("x",), outputs=("y",), attributes=("dim",), body=_body,
                        primitive="Swiglu", doc=__doc__, producer="fuse-swiglu", family="gated_mlp",
                        likely_causes="the half order (SiLU takes the FIRST half), the merged [gate ; up] weight, "
                                      "the split axis"))


@register("Swiglu", since=1, domain="mindspore")
def lower_swiglu(n):
    return n.call(n.call("ops.auto_generate.Swiglu"), n.x(0), int(n.attr("dim")))
