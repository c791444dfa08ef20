"""fuse-silu: x * Sigmoid(x) (either operand order) -> mindspore::SiLU.

Refused (the report's check reasons): dtypes other than fp32/fp16/bf16, fp16/bf16 below opset 15 (the
reference body's CastLike). Not matched: Swish with a slope (x * sigmoid(b * x)), HardSwish; quick GELU
x * sigmoid(1.702 x) is fuse-gelu's (mindspore::FastGelu), which runs first.

Coverage: fuse-silu is the first pass of the "gated_mlp" family (passes/coverage.py; candidates and their
explanation: passes/fuse_swiglu.py). A SiLU on its own is no candidate; silu(gate) * up is, and fuse-swiglu
takes the SiLU this pass made into Swiglu.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from passes import match
from passes.manager import rewrite_pass


class SiLUFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, sigmoid_first: bool):
        super().__init__(name)
        self._sigmoid_first = sigmoid_first

    def pattern(self, op, x):
        return op.Mul(op.Sigmoid(x), x) if self._sigmoid_first else op.Mul(x, op.Sigmoid(x))

    def check(self, context, x, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        return match.float_guard(context, result, x, "SiLU")

    def rewrite(self, op, x, **_):
        return op.SiLU(x, _domain="mindspore")


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass)."""
    return pattern.RewriteRuleSet([SiLUFusion.rule("SiLU", False), SiLUFusion.rule("SiLU-sigmoid-first", True)])


PASS = rewrite_pass("fuse-silu", "x * Sigmoid(x) -> mindspore::SiLU", rules)
