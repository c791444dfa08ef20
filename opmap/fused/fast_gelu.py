"""mindspore::FastGelu(x) -> y = x * sigmoid(1.702 * x), MindSpore's `FastGeLU` primitive (docs/fused_ops.md).

The "quick GELU" of CLIP (transformers' `quick_gelu` / QuickGELUActivation), not the exact or the tanh GELU.
MindSpore 2.10 documents FastGeLU as x / (1 + exp(-1.702|x|)) * exp(0.851 (x - |x|)), which is x * sigmoid(1.702 x)
on both signs (x >= 0: the exp factor is 1; x < 0: x e^{1.702x} / (1 + e^{1.702x})); measured on MindSpore's CPU
kernel: max |FastGeLU(x) - x * sigmoid(1.702 x)| = 1.2e-7 over [-8, 8] in fp32. It takes float16 and float32 only
(no bfloat16; its CPU kernel refuses bf16 too), so passes/fuse_gelu.py refuses bf16 inputs.
Computed in fp32 and cast back to x's dtype. ascend: `ops.FastGeLU()(x)` (primitive FastGeLU; it exports to
MindIR on CPU and has a CPU kernel as well).
"""

from __future__ import annotations

import onnx
from onnx import helper

from opmap.fused.record import FusedOp, define, fp32_island
from opmap.registry import register

QUICK_GELU_SCALE = 1.702


def _body(opset: int) -> list[onnx.NodeProto]:
    return fp32_island(opset, [
        helper.make_node("Constant", [], ["k"], value_float=QUICK_GELU_SCALE),
        helper.make_node("Mul", ["x32", "k"], ["kx"]),
        helper.make_node("Sigmoid", ["kx"], ["s"]),
        helper.make_node("Mul", ["x32", "s"], ["y32"]),
    ])


FAST_GELU = define(FusedOp(name="FastGelu", inputs=("x",), outputs=("y",), attributes=(), body=_body,
                           primitive="FastGeLU", doc=__doc__, producer="fuse-gelu", family="gelu",
                           likely_causes="the scale 1.702 (quick GELU is neither the tanh nor the exact GELU)"))


@register("FastGelu", since=1, domain="mindspore")
def lower_fast_gelu(n):
    return n.call(n.call("ops.FastGeLU"), n.x(0))
