"""mindspore::RotaryPositionEmbedding(x, cos, sin; mode) -> y, MindSpore's `ops.rotary_position_embedding`
(docs/fused_ops.md).

x is 4-D (BNSD, BSND or SBND), D = x.shape[-1] even; cos and sin broadcast to x (the pass checks the shapes
the primitive accepts). In fp32, cast back to x's dtype:
    y = x * cos + rot(x) * sin
    mode 0 (rotate_half, NeoX/Llama):  x1, x2 = the two halves of the last axis;  rot = concat(-x2, x1)
    mode 1 (interleaved, GPT-J):       rot[2i] = -x[2i+1],  rot[2i+1] = x[2i]
cos and sin are used elementwise over the full length D (MindSpore's and CANN's equivalent small-op code:
`x * cos + rotate_half(x) * sin`), so nothing is assumed about how their halves or pairs repeat.

The body writes both modes as one computation, a signed permutation of the last axis:
rot = Gather(x, idx, axis=-1) * sign, with idx = i + D/2 (mod D) and sign = -1 on the first half in mode 0,
idx = i xor 1 and sign = -1 at even i in mode 1 (i = 0 .. D-1). idx and sign are computed from D and the
`mode` attribute only, so once inlined with D static (from opset 15, Shape's start attribute reads D alone)
they fold into two constant vectors and the cpu lowering is one gather and one multiply, with no run-time
shape arithmetic. A gather and a multiplication by +-1, so it is exact. Below opset 11 (no Range) the pass
does not fuse.
`ApplyRotaryPosEmb` (q and k together) is not defined here: its semantics are unconfirmed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from opmap.fused.record import Constraint, FusedOp, attr_constant, define, fp32_island, int64_constant, to_fp32
from opmap.registry import register

_INT64_MAX = np.iinfo(np.int64).max



def _body(opset: int) -> list[onnx.NodeProto]:
    """In an fp32 island (record.island_casts: not before opset 15, where the fusion only takes fp32;
    passes/fuse_rope.py checks it). Nor does Shape take `start` before opset 15, so D is then sliced from x's
    whole shape (exact, but then only known at run time)."""

    def node(op: str, inputs: list[str], output: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], **attrs)

    if opset >= 15:
        d_vec = [node("Shape", ["x"], "d_vec", start=-1)]                          # [D]
    else:
        d_vec = [node("Shape", ["x"], "shape"), int64_constant("cm1", [-1]), int64_constant("cmax", [_INT64_MAX]),
                 node("Slice", ["shape", "cm1", "cmax"], "d_vec")]
    squeeze = [int64_constant("ax0", [0]), node("Squeeze", ["d_vec", "ax0"], "d")] if opset >= 13 else \
        [node("Squeeze", ["d_vec"], "d", axes=[0])]
    return fp32_island(opset, [
        to_fp32(opset, "cos", "cos32"), to_fp32(opset, "sin", "sin32"),
        attr_constant("m", "value_int", "mode"), int64_constant("zero", 0), int64_constant("one", 1),
        int64_constant("two", 2),
        *d_vec, *squeeze,
        node("Div", ["d", "two"], "h"),                                     # D/2
        node("Range", ["zero", "d", "one"], "i"),                          # 0 .. D-1
        node("Sub", ["one", "m"], "not_m"),
        # mode 0, rotate_half: rot[i] = -x[i + D/2] on the first half, x[i - D/2] on the second
        node("Add", ["i", "h"], "i_h"), node("Mod", ["i_h", "d"], "idx_half"),
        node("Less", ["i", "h"], "first_half"), node("Cast", ["first_half"], "first_half_i", to=TensorProto.INT64),
        node("Mul", ["first_half_i", "two"], "first_half_2"), node("Sub", ["one", "first_half_2"], "sign_half"),
        # mode 1, interleaved: rot[2j] = -x[2j + 1], rot[2j + 1] = x[2j]
        node("Mod", ["i", "two"], "odd"), node("Mul", ["odd", "two"], "odd_2"),
        node("Add", ["i", "one"], "i_1"), node("Sub", ["i_1", "odd_2"], "idx_pair"),
        node("Sub", ["odd_2", "one"], "sign_pair"),
        node("Mul", ["not_m", "idx_half"], "idx_0"), node("Mul", ["m", "idx_pair"], "idx_1"),
        node("Add", ["idx_0", "idx_1"], "idx"),
        node("Mul", ["not_m", "sign_half"], "sign_0"), node("Mul", ["m", "sign_pair"], "sign_1"),
        node("Add", ["sign_0", "sign_1"], "sign_i"), node("Cast", ["sign_i"], "sign", to=TensorProto.FLOAT),
        node("Gather", ["x32", "idx"], "x_perm", axis=-1),
        node("Mul", ["x_perm", "sign"], "rot"),
        node("Mul", ["x32", "cos32"], "x_cos"),
        node("Mul", ["rot", "sin32"], "rot_sin"),
        node("Add", ["x_cos", "rot_sin"], "y32"),
    ])



_DOCSTRING = "mindspore 2.10 ops.rotary_position_embedding docstring"
CONSTRAINTS = (
    Constraint("D even and < 896", _DOCSTRING, ("D",), lambda D: D % 2 == 0 and D < 896),
    Constraint("B < 1000", _DOCSTRING, ("B",), lambda B: B < 1000),
    Constraint("N < 1000", _DOCSTRING, ("N",), lambda N: N < 1000),
    Constraint("B·N < 1000 in mode 1 (interleaved)", "CANN's aclnnRotaryPositionEmbedding page", ("B", "N"),
               lambda B, N: B * N < 1000, when=(("mode", 1),)),
)

ROTARY_POSITION_EMBEDDING = define(FusedOp(
    name="RotaryPositionEmbedding", inputs=("x", "cos", "sin"), outputs=("y",), attributes=("mode",),
    body=_body, primitive="RotaryPositionEmbedding", doc=__doc__, producer="fuse-rope", family="rotary",
    likely_causes="rotary direction (rotate_half vs interleaved), the cos/sin layout, a partial rotary's slice",
    constraints=CONSTRAINTS))


@register("RotaryPositionEmbedding", since=1, domain="mindspore")
def lower_rotary_position_embedding(n):
    mode = int(n.attr("mode"))
    if mode not in (0, 1):
        n.fail(f"mode {mode} is neither 0 (rotate_half) nor 1 (interleaved)")
    return n.call("ops.rotary_position_embedding", n.x(0), n.x(1), n.x(2), mode)
