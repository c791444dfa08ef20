"""mindspore::RotaryPositionEmbedding(x, cos, sin; mode) -> y, MindSpore's `ops.rotary_position_embedding`
(FUSED_OPS.md).

x is 4-D (BNSD, BSND or SBND), D = x.shape[-1] even; cos and sin broadcast to x (the pass checks the shapes
the primitive accepts). In fp32, cast back to x's dtype:
    y = x * cos + rot(x) * sin
    mode 0 (rotate_half, NeoX/Llama):  x1, x2 = the two halves of the last axis;  rot = concat(-x2, x1)
    mode 1 (interleaved, GPT-J):       rot[2i] = -x[2i+1],  rot[2i+1] = x[2i]
cos and sin are used elementwise over the full length D (MindSpore's and CANN's equivalent small-op code:
`x * cos + rotate_half(x) * sin`), so nothing is assumed about how their halves or pairs repeat.

The body writes both modes as one computation: x is viewed as (..., P, 2, Q) with P = 1, Q = D/2 in mode 0
(the halves) and P = D/2, Q = 1 in mode 1 (the pairs); rot swaps the two slices of the middle axis and negates
the one moved first, then takes x's shape back. Reshapes and a negation only, so it is exact.
`ApplyRotaryPosEmb` (q and k together) is not defined here: its semantics are unconfirmed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opmap.fused.record import FusedOp, define
from opmap.registry import register

_INT64_MAX = np.iinfo(np.int64).max


def _ints(name: str, values) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name))


def _body(opset: int) -> list[onnx.NodeProto]:
    """Before opset 15 there is no CastLike to return to x's dtype: the body then computes in x's dtype, and
    the fusion only takes fp32 there (passes/fuse_rope.py checks it)."""
    cast = opset >= 15

    def to32(src: str, dst: str) -> onnx.NodeProto:
        return helper.make_node("Cast", [src], [dst], to=TensorProto.FLOAT) if cast else \
            helper.make_node("Identity", [src], [dst])

    mode = helper.make_node("Constant", [], ["mode_v"])  # value_int taken from the caller's `mode`
    mode.attribute.append(helper.make_attribute_ref("value_int", onnx.AttributeProto.INT, ref_attr_name="mode"))
    return [
        to32("x", "x32"), to32("cos", "cos32"), to32("sin", "sin32"),
        mode,
        _ints("c0", [0]), _ints("c1", [1]), _ints("c2", [2]), _ints("cm1", [-1]), _ints("cm2", [-2]),
        _ints("cmax", [_INT64_MAX]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "c0", "cm1"], ["lead"]),       # x.shape[:-1]
        helper.make_node("Slice", ["shape", "cm1", "cmax"], ["d"]),        # [D]
        helper.make_node("Div", ["d", "c2"], ["half"]),                    # [D/2]
        helper.make_node("Sub", ["half", "c1"], ["half_m1"]),
        helper.make_node("Mul", ["mode_v", "half_m1"], ["p_m1"]),
        helper.make_node("Add", ["c1", "p_m1"], ["p"]),                    # mode 0: 1, mode 1: D/2
        helper.make_node("Div", ["half", "p"], ["q"]),                     # mode 0: D/2, mode 1: 1
        helper.make_node("Concat", ["lead", "p", "c2", "q"], ["view_shape"], axis=0),
        helper.make_node("Reshape", ["x32", "view_shape"], ["xv"]),        # (..., P, 2, Q)
        helper.make_node("Slice", ["xv", "c0", "c1", "cm2"], ["first"]),   # x1 (mode 0) / x[2i] (mode 1)
        helper.make_node("Slice", ["xv", "c1", "c2", "cm2"], ["second"]),  # x2 (mode 0) / x[2i+1] (mode 1)
        helper.make_node("Neg", ["second"], ["neg_second"]),
        helper.make_node("Concat", ["neg_second", "first"], ["rot_v"], axis=-2),
        helper.make_node("Reshape", ["rot_v", "shape"], ["rot"]),
        helper.make_node("Mul", ["x32", "cos32"], ["x_cos"]),
        helper.make_node("Mul", ["rot", "sin32"], ["rot_sin"]),
        helper.make_node("Add", ["x_cos", "rot_sin"], ["y32"]),
        helper.make_node("CastLike", ["y32", "x"], ["y"]) if cast else helper.make_node("Identity", ["y32"], ["y"]),
    ]


ROTARY_POSITION_EMBEDDING = define(FusedOp(
    name="RotaryPositionEmbedding", inputs=("x", "cos", "sin"), outputs=("y",), attributes=("mode",),
    body=_body, primitive="RotaryPositionEmbedding", doc=__doc__, producer="fuse-rope", family="rotary",
    likely_causes="rotary direction (rotate_half vs interleaved), the cos/sin layout, a partial rotary's slice"))


@register("RotaryPositionEmbedding", since=1, domain="mindspore")
def lower_rotary_position_embedding(n):
    mode = int(n.attr("mode"))
    if mode not in (0, 1):
        n.fail(f"mode {mode} is neither 0 (rotate_half) nor 1 (interleaved)")
    return n.call("ops.rotary_position_embedding", n.x(0), n.x(1), n.x(2), mode)
