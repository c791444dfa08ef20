"""mindspore::LayerNorm(x, gamma, beta; epsilon) -> y, MindSpore's `ops.LayerNorm` primitive (docs/fused_ops.md).

y = (f32(x) - mean) / sqrt(var + eps) * f32(gamma) + f32(beta), cast back to x's dtype, with mean and the
population variance over the last axis. graphconv fuses only the last-axis form with gamma and beta of that
axis' size (gamma.shape == beta.shape == x.shape[-1:]); MindSpore's own default epsilon (1e-7) differs from
ONNX's (1e-5), so the lowering always passes the model's.
"""

from __future__ import annotations

import onnx
from onnx import helper

from opmap.fused.record import FusedOp, attr_constant, define, fp32_island, to_fp32
from opmap.registry import register


def _body(opset: int) -> list[onnx.NodeProto]:
    """In an fp32 island (record.island_casts: not before opset 15, where the fusion only takes fp32 inputs;
    passes/fuse_layernorm.py checks it)."""

    def mean(src: str, dst: str) -> list[onnx.NodeProto]:
        if opset >= 18:
            return [helper.make_node("ReduceMean", [src, "axes"], [dst], keepdims=1)]
        return [helper.make_node("ReduceMean", [src], [dst], axes=[-1], keepdims=1)]

    nodes = []
    if opset >= 18:
        nodes.append(helper.make_node("Constant", [], ["axes"], value_ints=[-1]))
    nodes += mean("x32", "mu")
    nodes += [helper.make_node("Sub", ["x32", "mu"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"])]
    nodes += mean("d2", "var")
    nodes += [
        attr_constant("eps", "value_float", "epsilon"),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["d", "std"], ["normed"]),
        to_fp32(opset, "gamma", "gamma32"),
        to_fp32(opset, "beta", "beta32"),
        helper.make_node("Mul", ["normed", "gamma32"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta32"], ["y32"]),
    ]
    return fp32_island(opset, nodes)


LAYER_NORM = define(FusedOp(
    name="LayerNorm", inputs=("x", "gamma", "beta"), outputs=("y",), attributes=("epsilon",), body=_body,
    primitive="LayerNorm", doc=__doc__, producer="fuse-layernorm", family="norm",
    likely_causes="epsilon (MindSpore's nn.LayerNorm defaults to 1e-7), the normalised axes, the zero beta of a "
                  "bias-free LayerNorm, gamma converted to x's dtype from an fp32 island"))


@register("LayerNorm", since=1, domain="mindspore")
def lower_layer_norm(n):
    eps = float(n.attr("epsilon"))
    # begin_norm_axis = begin_params_axis = -1: normalise the last axis, gamma/beta of its size.
    return n.getitem(n.call(n.call("ops.LayerNorm", -1, -1, eps), n.x(0), n.x(1), n.x(2)), 0)
