"""mindspore::SiLU(x) -> y = x * sigmoid(x), MindSpore's `ops.silu` (primitive SiLU; docs/fused_ops.md).

Computed in fp32 and cast back to x's dtype.
"""

from __future__ import annotations

import onnx
from onnx import helper

from opmap.fused.record import FusedOp, define, fp32_island
from opmap.registry import register


def _body(opset: int) -> list[onnx.NodeProto]:
    return fp32_island(opset, [helper.make_node("Sigmoid", ["x32"], ["s"]),
                               helper.make_node("Mul", ["x32", "s"], ["y32"])])


SILU = define(FusedOp(name="SiLU", inputs=("x",), outputs=("y",), attributes=(), body=_body, primitive="SiLU",
                      doc=__doc__, producer="fuse-silu", family="gated_mlp",
                      likely_causes="a Swish slope (x * sigmoid(b x), b != 1) taken for SiLU"))


@register("SiLU", since=1, domain="mindspore")
def lower_silu(n):
    return n.call("ops.silu", n.x(0))
