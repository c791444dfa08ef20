"""fuse-swiglu: SwiGLU MLP -> one MatMul over the merged [gate ; up] weight, then mindspore::Swiglu(h, dim=-1).

Spelling matched (Mul/Add operands in either order):
  gate, up    MatMul(x, Wg) and MatMul(x, Wu) on the same x, Wg and Wu constant 2-D weights of one shape (what
              nn.Linear exports: TorchScript's MatMul by a transposed initializer, dynamo's by a val_NN one);
              with bias: Add(MatMul(x, W), b) on both, b constant 1-D; and a 3-D nn.Linear with bias as onnxsim
              leaves it, Reshape(Add(MatMul(x2d, W), b), shape) with one shape value for gate and up (its Gemm
              made MatMul + Add by canonicalize)
  activation  Mul(gate, Sigmoid(gate)) | mindspore::SiLU(gate) (fuse-silu runs first in the default pipeline)
  product     Mul(activation, up)
Rewritten to Swiglu(MatMul(x, concat([Wg, Wu], axis=1)) [+ concat([bg, bu])], dim=-1) [then Reshape(., shape)]:
MindSpore's Swiglu applies SiLU to the FIRST half of its input (FUSED_OPS.md), so the gate weight comes first.
The merged weight is a new initializer named after the gate weight + "_gate_up"; the two sources are dropped
once nothing else uses them.
Refused (the report's check reasons): weights that are not constants, not 2-D or not of one shape and dtype,
biases that are not constant 1-D of the output size, dtypes Swiglu does not take (fp32/fp16/bf16),
fp16/bf16 below opset 15 (the reference body's CastLike), an input of unknown rank.
Not matched: Gemm between Reshapes when canonicalize did not run; the gate and up projections on different
inputs.

GeGLU (Gelu(gate) * up) has no fused MindSpore primitive: it stays mindspore::Gelu (fuse-gelu) times the up
projection, and its weights are not merged.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes import match
from passes.manager import rewrite_pass


class SwigluFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, bias: bool, up_first: bool, reshaped: bool = False):
        super().__init__(name)
        self._bias, self._up_first, self._reshaped = bias, up_first, reshaped
        self._graph: ir.Graph | None = None
        self._sources: list[ir.Value] = []

    def pattern(self, op, x, wg, wu, bg, bu, shape):
        gate = op.MatMul(x, wg)
        up = op.MatMul(x, wu)
        if self._bias:
            gate, up = match.add(op, gate, bg), match.add(op, up, bu)
        if self._reshaped:  # both back to one shape (the same shape value)
            gate, up = op.Reshape(gate, shape, _outputs=["gate_3d"]), op.Reshape(up, shape)
        act = pattern.OrValue([match.mul(op, gate, op.Sigmoid(gate)), op.SiLU(gate, _domain="mindspore")])
        # The root's operand order is a rule variant (a pattern's root is a node, not alternatives).
        return op.Mul(up, act) if self._up_first else op.Mul(act, up)

    def check(self, context, x, wg, wu, bg=None, bu=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in match.FLOATS:
            return result.fail(f"dtype {x.dtype}: Swiglu takes float32, float16 or bfloat16", x)
        if x.shape is None or x.shape.rank() is None or x.shape.rank() < 2:
            return result.fail("the input rank is unknown or below 2", x)
        g, u = match.const_value(wg), match.const_value(wu)
        if g is None or u is None:
            return result.fail("the gate/up weights are not constants (nothing to merge)", wg if g is None else wu)
        if g.ndim != 2 or g.shape != u.shape:
            return result.fail(f"gate/up weights of shapes {g.shape} and {u.shape}: not one 2-D shape", wg)
        if wg.dtype != x.dtype or wu.dtype != x.dtype:
            return result.fail(f"dtypes x={x.dtype}, gate={wg.dtype}, up={wu.dtype}: not one dtype", wg)
        if self._bias:
            b1, b2 = match.const_value(bg), match.const_value(bu)
            if b1 is None or b2 is None:
                return result.fail("the gate/up biases are not constants", bg if b1 is None else bu)
            if b1.shape != (g.shape[1],) or b2.shape != (g.shape[1],) or bg.dtype != x.dtype or bu.dtype != x.dtype:
                return result.fail(f"gate/up biases of shapes {b1.shape}, {b2.shape}: not 1-D of the output size "
                                   f"{g.shape[1]} in x's dtype", bg)
        if not match.float_guard(context, result, x, "Swiglu"):
            return result
        self._graph = context.graph_or_function
        return result

    def rewrite(self, op, x, wg, wu, bg=None, bu=None, shape=None, gate_3d=None, **_):
        graph = self._graph
        w = np.concatenate([match.const_value(wg), match.const_value(wu)], axis=1)  # [gate ; up] along the output dim
        w_name = match.unique_initializer_name(graph, f"{wg.name}_gate_up")
        h = op.MatMul(x, op.initializer(ir.tensor(w, name=w_name), name=w_name))
        self._sources += [wg, wu]
        if bg is not None:
            b = np.concatenate([match.const_value(bg), match.const_value(bu)])
            b_name = match.unique_initializer_name(graph, f"{bg.name}_gate_up")
            h = op.Add(h, op.initializer(ir.tensor(b, name=b_name), name=b_name))
            self._sources += [bg, bu]
        y = op.Swiglu(h, dim=-1, _domain="mindspore")
        if shape is not None:
            # Swiglu's output has the 2-D gate's shape: the gate's Reshape restores the original one.
            y = op.Reshape(y, shape, **{k: a.value for k, a in gate_3d.producer().attributes.items()})
        return y

    def setup(self):
        self._sources = []

    def cleanup(self):
        """Free the merged weights' sources once the rewrites have removed their last uses."""
        for v in self._sources:
            if v.uses() or (v.graph is not None and v in v.graph.outputs):
                continue
            if v.is_initializer() and v.graph is not None and v.name in v.graph.initializers:
                del v.graph.initializers[v.name]
            elif v.producer() is not None and v.producer().op_type == "Constant":
                node = v.producer()
                node.graph.remove(node, safe=True)
        self._sources = []


RULES = [SwigluFusion.rule(f"Swiglu{'-bias' if bias else ''}{'-reshaped' if reshaped else ''}"
                          f"{'-up-first' if up_first else ''}", bias, up_first, reshaped)
         for bias, reshaped in ((False, False), (True, False), (True, True)) for up_first in (False, True)]
PASS = rewrite_pass("fuse-swiglu", "SiLU(x @ Wg [+ bg]) * (x @ Wu [+ bu]) -> mindspore::Swiglu over one MatMul "
                    "with the merged [gate ; up] weight", pattern.RewriteRuleSet(RULES))
