"""mindspore::RmsNorm(x, gamma; epsilon) -> y, MindSpore's `ops.rms_norm` (docs/fused_ops.md).

rstd = 1 / sqrt(mean(f32(x)^2 over the last axis) + eps); y = cast_out(f32(x) * rstd * f32(gamma)).
graphconv fuses only gamma of rank 1 (the last axis), the form whose semantics are confirmed.
"""

from __future__ import annotations

import onnx
from onnx import helper

from opmap.fused.record import FusedOp, attr_constant, define, fp32_island, to_fp32
from opmap.registry import register


def _body(opset: int) -> list[onnx.NodeProto]:
    """In an fp32 island (record.island_casts: not before opset 15, where the fusion only takes fp32 inputs;
    passes/fuse_rmsnorm.py checks it)."""
    nodes = [helper.make_node("Mul", ["x32", "x32"], ["sq"])]
    if opset >= 18:
        nodes += [helper.make_node("Constant", [], ["axes"], value_ints=[-1]),
                  helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1)]
    else:
        nodes += [helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1)]
    nodes += [
        attr_constant("eps", "value_float", "epsilon"),
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["rstd"]),
        helper.make_node("Mul", ["x32", "rstd"], ["normed"]),
        to_fp32(opset, "gamma", "gamma32"),
        helper.make_node("Mul", ["normed", "gamma32"], ["y32"]),
    ]
    return fp32_island(opset, nodes)


RMS_NORM = define(FusedOp(
    name="RmsNorm", inputs=("x", "gamma"), outputs=("y",), attributes=("epsilon",), body=_body,
    primitive="RmsNorm", doc=__doc__, producer="fuse-rmsnorm", family="norm",
    likely_causes="epsilon, the normalised axis, or the Cast island around it"))


@register("RmsNorm", since=1, domain="mindspore")
def lower_rms_norm(n):
    eps = float(n.attr("epsilon"))
    return n.getitem(n.call("ops.rms_norm", n.x(0), n.x(1), eps), 0)
