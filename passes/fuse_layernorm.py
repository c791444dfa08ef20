"""fuse-layernorm: LayerNorm over the last axis -> mindspore::LayerNorm.

Spellings matched (each with Mul/Add operands in either order):
  native      LayerNormalization(x, gamma[, beta]) (opset >= 17: dynamo, and TorchScript at 17+), axis = last
  decomposed  what exports below opset 17 produce:
    mean        ReduceMean(x) over the last axis, keepdims=1 (axes as attribute before opset 18, input from 18)
    centre      d = Sub(x, mean)
    variance    ReduceMean(Pow(d, 2) | Mul(d, d)) over the last axis
    normalise   Div(d, Sqrt(var + eps)) | Mul(d, Reciprocal(Sqrt(var + eps))) | Mul(d, Div(1, Sqrt(var + eps)))
    precision   optional Cast to fp32 before and Cast back after the normalisation (fp16/bf16 islands)
    affine      Add(Mul(normed, gamma), beta), or Mul(normed, gamma) alone (no bias)
    weight inside the island  Cast(Mul(normed, gamma32) [+ beta32], x's dtype) after Cast(x, fp32): transformers'
                CohereLayerNorm (`weight.to(float32) * normed` then `.to(input_dtype)`), as dynamo writes it for an
                fp16/bf16 model; gamma32/beta32 are fp32 constants (onnxsim folds the Cast of the fp16/bf16 weight)
                and are given to LayerNorm in x's dtype, which is exact only when they hold values of that dtype
                (checked). In fp32 the Casts vanish and the spelling is the plain decomposed one (gamma first).
  after fuse-rmsnorm: mindspore::RmsNorm(Sub(x, ReduceMean(x)), gamma) [+ beta] (fuse-rmsnorm, which runs
              first, takes a decomposed LayerNorm's inner part for an RMSNorm of the centred input)
Without beta the fused node gets a zero beta (MindSpore's LayerNorm takes one): bias-free LayerNorms, e.g.
Cohere's CohereLayerNorm (decomposed, weight only) and ModernBERT's nn.LayerNorm(bias=False) (dynamo writes
LayerNormalization(x, gamma) without B at opsets 17 on), fuse to LayerNorm(x, gamma, zeros).
Refused (the report's check reasons): a mean over another axis or keepdims=0, a non-scalar or non-positive
epsilon, gamma/beta that are not 1-D of the normalised size, dtypes MindSpore's LayerNorm does not take, a
native node normalising more than the last axis or computing statistics in fp16 (stash_type 0).
Refused inside an fp32 island: a weight the input's dtype cannot represent exactly, a result cast to another
dtype than the input's, an island computing in another dtype than fp32.
Not matched: a native node whose Mean/InvStdDev outputs are used; a LayerNorm without gamma
(elementwise_affine=False).

Coverage candidates (family "norm", with fuse-rmsnorm; passes/coverage.py): every second-moment reduction,
i.e. every ReduceMean of a square (Mul(x, x) or Pow(x, 2), through a Cast), and every LayerNormalization /
RMSNormalization / SimplifiedLayerNormalization node; a decomposed LayerNorm is judged at its variance's
ReduceMean. A refused candidate carries the check's reason (this pass gives no separate explanation).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.frontend.param_names import record_made
from passes import coverage, match
from passes.manager import rewrite_pass


def _check_affine(result: pattern.MatchResult, x: ir.Value, gamma: ir.Value, beta: ir.Value | None):
    """gamma (and beta) 1-D of the last axis' size, all of one float dtype MindSpore's LayerNorm takes."""
    if x.dtype not in match.FLOATS:
        return result.fail(f"dtype {x.dtype}: LayerNorm takes float32, float16 or bfloat16", x)
    rank = x.shape.rank() if x.shape is not None else None
    if rank is None:
        return result.fail("the input rank is unknown", x)
    last = x.shape[rank - 1]
    for name, v in (("gamma", gamma), ("beta", beta)):
        if v is None:
            continue
        if v.dtype != x.dtype:
            return result.fail(f"dtypes x={x.dtype}, {name}={v.dtype}: LayerNorm needs one dtype", v)
        if v.shape is None or v.shape.rank() != 1:
            return result.fail(f"{name} is not 1-D (only the last axis is normalised)", v)
        if not isinstance(v.shape[0], int) or (isinstance(last, int) and v.shape[0] != last):
            return result.fail(f"{name} has {v.shape[0]} elements, the normalised axis {last}", v)
    return result


def _bias_add_follows(y: ir.Value) -> bool:
    """y's only use is an Add of a 1-D bias: the rule with beta fuses the whole LayerNorm at that Add."""
    uses = list(y.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Add" or uses[0].node.domain != "":
        return False
    other = uses[0].node.inputs[1 - uses[0].idx]
    return other is not None and other.shape is not None and other.shape.rank() == 1


def _check_last_axis_mean(result: pattern.MatchResult, x: ir.Value, values) -> pattern.MatchResult:
    rank = x.shape.rank() if x.shape is not None else None
    if rank is None:
        return result.fail("the input rank is unknown", x)
    for value in values:
        reduce = value.producer()
        axes = match.axes(reduce)
        if axes is None or not match.last_axes(axes, rank):
            return result.fail(f"ReduceMean is over axes {axes}, not the last axis", reduce)
        keep = reduce.attributes.get("keepdims")
        if keep is not None and keep.value != 1:
            return result.fail("ReduceMean drops the reduced axis (keepdims=0)", reduce)
    return result


class LayerNormDecomposed(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, normalize: str, bias: bool, swap: bool, island: str = "outside"):
        super().__init__(name)
        self._normalize, self._bias, self._swap, self._island = normalize, bias, swap, island
        self._graph: ir.Graph | None = None

    def pattern(self, op, x, gamma, beta, epsilon, compute_dtype, target_dtype):
        if self._island == "inside":  # Cast(x, fp32) ... Cast(gamma32 * normed [+ beta32], x's dtype)
            xc = op.Cast(x, to=compute_dtype, _outputs=["x32"])
        else:
            xc = pattern.OrValue([op.Cast(x, to=compute_dtype), x], tag_var="cast_in", tag_values=[True, False])
        mean = op.ReduceMean(xc, _allow_other_inputs=True, _outputs=["mean"])
        d = op.Sub(xc, mean)
        square = pattern.OrValue([op.Pow(d, 2.0), op.Mul(d, d)])
        var = op.ReduceMean(square, _allow_other_inputs=True, _outputs=["var"])
        std = op.Sqrt(match.add(op, var, epsilon))
        if self._normalize == "reciprocal":
            normed = match.mul(op, d, op.Reciprocal(std))
        elif self._normalize == "div-one":
            normed = match.mul(op, d, op.Div(1.0, std))
        else:
            normed = op.Div(d, std)
        if self._island == "inside":
            scaled = match.mul(op, normed, gamma)
            return op.Cast(match.add(op, scaled, beta) if self._bias else scaled, to=target_dtype, _outputs=["y"])
        normed = pattern.OrValue([op.Cast(normed, to=target_dtype), normed], tag_var="cast_out",
                                 tag_values=[True, False])
        # The root's operand order is a rule variant (a pattern's root is a node, not alternatives).
        if not self._bias:
            return op.Mul(gamma, normed, _outputs=["scaled"]) if self._swap else \
                op.Mul(normed, gamma, _outputs=["scaled"])
        scaled = pattern.OrValue([op.Mul(normed, gamma, _outputs=["scaled"]),
                                  op.Mul(gamma, normed, _outputs=["scaled"])])
        return op.Add(beta, scaled) if self._swap else op.Add(scaled, beta)

    def check(self, context, x, gamma, epsilon, mean, var, scaled=None, cast_in=None, cast_out=None, beta=None,
              x32=None, y=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if self._island == "inside":
            return self._check_inside(context, result, x, gamma, epsilon, mean, var, x32, y, beta)
        if not self._bias and _bias_add_follows(scaled):
            return result.fail("a bias Add follows: the LayerNorm is fused with it, at the Add", scaled)
        if not _check_last_axis_mean(result, x, (mean, var)):
            return result
        eps = match.const_value(epsilon)
        if eps is None or eps.size != 1 or eps.dtype.kind != "f" or not 0 < float(eps.reshape(-1)[0]) <= 1:
            return result.fail("epsilon is not a constant scalar in (0, 1]", epsilon)
        if cast_in != cast_out:
            return result.fail("a Cast on one side of the precision island only", x)
        island = mean.producer().inputs[0]
        if cast_in and island.dtype != ir.DataType.FLOAT:
            return result.fail(f"the precision island computes in {island.dtype}, not float32", island)
        if not _check_affine(result, x, gamma, beta):
            return result
        return match.float_guard(context, result, x, "LayerNorm")

    def _check_inside(self, context, result, x, gamma, epsilon, mean, var, x32, y, beta):
        """The affine inside the fp32 island: x cast to fp32, gamma (beta) fp32 constants, the result cast
        back to x's dtype. LayerNorm takes gamma/beta in x's dtype, so they must hold values that dtype
        represents exactly (an exporter's folded Cast(gamma16, fp32) does): then f32(gamma16) == gamma32 and the
        fused body computes the same products."""
        if x32.dtype != ir.DataType.FLOAT:
            return result.fail(f"the precision island computes in {x32.dtype}, not float32", x32)
        if y.dtype != x.dtype:
            return result.fail(f"the result is cast to {y.dtype}, not back to x's {x.dtype}", y)
        if not _check_last_axis_mean(result, x, (mean, var)):
            return result
        eps = match.const_value(epsilon)
        if eps is None or eps.size != 1 or eps.dtype.kind != "f" or not 0 < float(eps.reshape(-1)[0]) <= 1:
            return result.fail("epsilon is not a constant scalar in (0, 1]", epsilon)
        if x.dtype not in match.FLOATS:
            return result.fail(f"dtype {x.dtype}: LayerNorm takes float32, float16 or bfloat16", x)
        last = match.dims(x)[-1]
        for name, v in (("gamma", gamma), ("beta", beta)):
            if v is None:
                continue
            c = match.const_value(v)
            if c is None or c.ndim != 1 or (isinstance(last, int) and c.shape[0] != last):
                return result.fail(f"{name} is not a constant 1-D of the normalised size {last}", v)
            if v.dtype != ir.DataType.FLOAT:
                return result.fail(f"{name} is {v.dtype} inside a float32 island", v)
            if not np.array_equal(c.astype(x.dtype.numpy()).astype(np.float32), c):
                return result.fail(f"{name} (float32) holds values {x.dtype} cannot represent exactly: LayerNorm "
                                   f"takes it in x's dtype", v)
        if not match.float_guard(context, result, x, "LayerNorm"):
            return result
        self._graph = context.graph_or_function
        return result

    def rewrite(self, op, x, gamma, epsilon, beta=None, **_):
        eps = float(match.const_value(epsilon).reshape(-1)[0])
        if self._island == "inside":  # gamma/beta in x's dtype (exact: the check proved it)
            gamma, beta = (None if v is None else self._in_dtype(op, v, x.dtype) for v in (gamma, beta))
        return op.LayerNorm(x, gamma, _zero_beta(op, gamma) if beta is None else beta, epsilon=eps,
                            _domain="mindspore")

    def _in_dtype(self, op, v: ir.Value, dtype: ir.DataType) -> ir.Value:
        if v.dtype == dtype:
            return v
        suffix = f"_{dtype.name.lower()}"
        name = match.unique_initializer_name(self._graph, v.name + suffix)
        record_made(self._graph, name, [v.name], f"cast to {dtype.name.lower()}", "suffix:" + suffix,
                    made_by="fuse-layernorm")
        return op.initializer(ir.tensor(match.const_value(v).astype(dtype.numpy()), name=name), name=name)


class LayerNormFromRmsNorm(pattern.RewriteRuleClassBase):
    """RmsNorm(x - mean(x)) is LayerNorm without beta: mean(d^2) of the centred d is the population variance.
    fuse-rmsnorm runs first and takes the inner part of a decomposed LayerNorm for an RMSNorm of d; this rule
    turns it (and the following bias Add) into the one LayerNorm."""

    def __init__(self, name: str, bias: bool, swap: bool = False):
        super().__init__(name)
        self._bias, self._swap = bias, swap

    def pattern(self, op, x, gamma, beta):
        mean = op.ReduceMean(x, _allow_other_inputs=True, _outputs=["mean"])
        rms = op.RmsNorm(op.Sub(x, mean), gamma, _domain="mindspore", _outputs=["rms"])
        if not self._bias:
            return rms
        return op.Add(beta, rms) if self._swap else op.Add(rms, beta)

    def check(self, context, x, gamma, mean, rms, beta=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not self._bias and _bias_add_follows(rms):
            return result.fail("a bias Add follows: the LayerNorm is fused with it, at the Add", rms)
        if not _check_last_axis_mean(result, x, (mean,)):
            return result
        return _check_affine(result, x, gamma, beta)

    def rewrite(self, op, x, gamma, rms, beta=None, **_):
        eps = float(rms.producer().attributes["epsilon"].value)
        return op.LayerNorm(x, gamma, _zero_beta(op, gamma) if beta is None else beta, epsilon=eps,
                            _domain="mindspore")


def _zero_beta(op, gamma: ir.Value) -> ir.Value:
    return op.Constant(value=ir.tensor(np.zeros(gamma.shape[0], gamma.dtype.numpy())))


class LayerNormNative(pattern.RewriteRuleClassBase):
    """ONNX LayerNormalization (opset >= 17), with or without its bias input."""

    def __init__(self, name: str, bias: bool):
        super().__init__(name)
        self._bias = bias

    def pattern(self, op, x, gamma, beta):
        if self._bias:
            return op.LayerNormalization(x, gamma, beta, _outputs=["y"])
        return op.LayerNormalization(x, gamma, _outputs=["y"])

    def check(self, context, x, gamma, y, beta=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = y.producer()  # (a node whose Mean/InvStdDev outputs are used is not removable: no match)
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None:
            return result.fail("the input rank is unknown", x)
        axis = node.attributes.get("axis")
        axis = -1 if axis is None else axis.value
        if not -rank <= axis < rank:  # (the lowering refuses it; x % rank would make 2**31 the last axis of rank 3)
            return result.fail(f"axis={axis} is out of range for rank {rank}", node)
        if axis % rank != rank - 1:
            return result.fail(f"axis={axis} normalises more than the last axis", node)
        stash = node.attributes.get("stash_type")
        if x.dtype != ir.DataType.FLOAT and stash is not None and stash.value != 1:
            return result.fail("stash_type=0 computes the statistics in the input's precision, LayerNorm in "
                               "fp32", node)
        eps = node.attributes.get("epsilon")
        if eps is not None and not 0 < eps.value <= 1:
            return result.fail(f"epsilon {eps.value} is not in (0, 1]", node)
        return _check_affine(result, x, gamma, beta)

    def rewrite(self, op, x, gamma, y, beta=None, **_):
        eps = y.producer().attributes.get("epsilon")
        eps = 1e-5 if eps is None else float(eps.value)
        return op.LayerNorm(x, gamma, _zero_beta(op, gamma) if beta is None else beta, epsilon=eps,
                            _domain="mindspore")


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass); a check hands its graph
    to its rewrite on the rule instance."""
    return pattern.RewriteRuleSet(
        [LayerNormNative.rule("LayerNorm-native", True), LayerNormNative.rule("LayerNorm-native-nobias", False),
         LayerNormFromRmsNorm.rule("LayerNorm-from-rmsnorm", True),
         LayerNormFromRmsNorm.rule("LayerNorm-from-rmsnorm-swapped", True, True),
         LayerNormFromRmsNorm.rule("LayerNorm-from-rmsnorm-nobias", False)]
        + [LayerNormDecomposed.rule(f"LayerNorm-{v}{'' if bias else '-nobias'}{'-swapped' if swap else ''}",
                                    v, bias, swap)
           for bias in (True, False) for v in ("div", "reciprocal", "div-one") for swap in (False, True)]
        + [LayerNormDecomposed.rule(f"LayerNorm-{v}{'' if bias else '-nobias'}-affine-in-fp32", v, bias, False,
                                    "inside")
           for bias in (True, False) for v in ("div", "reciprocal", "div-one")])


PASS = rewrite_pass("fuse-layernorm", "LayerNormalization and its decomposition (ReduceMean, Sub, Pow/Mul, Sqrt, "
                    "Div/Reciprocal, Cast islands, gamma, beta) -> mindspore::LayerNorm",
                    rules, candidates=coverage.norm_candidates)
