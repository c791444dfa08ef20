"""A graphconv pass plugin: drop `Mul(x, 1)` (a leftover of some exporters' scale handling).

Load it with `graphconv compile model.onnx --plugin drop_mul_by_one` (the module must be importable), or
register it as an entry point of the group `graphconv.passes` in your package's pyproject.toml.
"""

from onnxscript.rewriter import pattern

from passes import rewrite_pass


class DropMulByOne(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, one):
        return op.Mul(x, one)

    def check(self, context, x, one, **_):
        result = pattern.MatchResult()
        value = one.const_value.numpy() if one.const_value is not None else None
        if value is None or value.size != 1 or float(value.reshape(-1)[0]) != 1.0:
            return result.fail("the other operand is not the constant 1", one)
        if x.shape is None or one.shape is None or one.shape.rank() > x.shape.rank():
            return result.fail("multiplying by 1 would broadcast x to a larger rank", one)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


rewrite_pass("drop-mul-by-one", "Mul(x, 1) -> x",
             pattern.RewriteRuleSet([DropMulByOne.rule()], commute=True))
