"""mindspore::SiLU(x) -> y = x * sigmoid(x), MindSpore's `ops.silu` (primitive SiLU; FUSED_OPS.md).

Computed in fp32 and cast back to x's dtype.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from opmap.fused import FusedOp, define
from opmap.registry import register


def _body(opset: int) -> list[onnx.NodeProto]:
    """Before opset 15 there is no CastLike to return to x's dtype: the body then computes in x's dtype, and
    the fusion only takes fp32 inputs there (passes/fuse_silu.py checks it)."""
    cast = opset >= 15
    return [
        helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT) if cast else
        helper.make_node("Identity", ["x"], ["x32"]),
        helper.make_node("Sigmoid", ["x32"], ["s"]),
        helper.make_node("Mul", ["x32", "s"], ["y32"]),
        helper.make_node("CastLike", ["y32", "x"], ["y"]) if cast else helper.make_node("Identity", ["y32"], ["y"]),
    ]


SILU = define(FusedOp(name="SiLU", inputs=("x",), outputs=("y",), attributes=(), body=_body, primitive="SiLU",
                      doc=__doc__, producer="fuse-silu", family="gated_mlp",
                      likely_causes="a Swish slope (x * sigmoid(b x), b != 1) taken for SiLU"))


@register("SiLU", since=1, domain="mindspore")
def lower_silu(n):
    return f"ops.silu({n.x(0)})"
