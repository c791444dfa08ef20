"""fuse-silu: x * Sigmoid(x) (either operand order) -> mindspore::SiLU.

Refused (the report's check reasons): dtypes other than fp32/fp16/bf16, fp16/bf16 below opset 15 (the
reference body's CastLike). Not matched: Swish with a slope (x * sigmoid(b * x)), HardSwish.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.manager import rewrite_pass

_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


class SiLUFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, sigmoid_first: bool):
        super().__init__(name)
        self._sigmoid_first = sigmoid_first

    def pattern(self, op, x):
        return op.Mul(op.Sigmoid(x), x) if self._sigmoid_first else op.Mul(x, op.Sigmoid(x))

    def check(self, context, x, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS:
            return result.fail(f"dtype {x.dtype}: SiLU takes float32, float16 or bfloat16", x)
        opset = context.model.opset_imports.get("", context.model.opset_imports.get("ai.onnx", 0))
        if opset < 15 and x.dtype != ir.DataType.FLOAT:
            return result.fail("below opset 15 SiLU's reference body can only express fp32", x)
        return result

    def rewrite(self, op, x, **_):
        return op.SiLU(x, _domain="mindspore")


RULES = [SiLUFusion.rule("SiLU", False), SiLUFusion.rule("SiLU-sigmoid-first", True)]
PASS = rewrite_pass("fuse-silu", "x * Sigmoid(x) -> mindspore::SiLU", pattern.RewriteRuleSet(RULES))
