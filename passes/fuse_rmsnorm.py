"""fuse-rmsnorm: decomposed RMSNorm -> mindspore::RmsNorm.

Spellings matched (each with Mul/Add operands in either order):
  square      Pow(x, 2) | Mul(x, x)
  mean        ReduceMean over the last axis, keepdims=1 (axes as attribute before opset 18, input from 18)
  normalise   Mul(x, Reciprocal(Sqrt(m + eps))) (torch.rsqrt) | Mul(x, Div(1, Sqrt(m + eps)))
              | Div(x, Sqrt(m + eps)) | Mul(x, Pow(m + eps, -0.5))
  precision   optional Cast to fp32 before and Cast back after (fp16/bf16 islands: Llama's
              weight * x.to(input_dtype)); or Cast before only, the Cast back after the gamma Mul (Gemma's and
              OLMo-2's (x * w).to(input_dtype)): then RmsNorm runs on Cast(x) in fp32 and the Cast back stays
  scale       Mul(normed, gamma) with gamma of the normalised axis' shape (H,): a weight, Gemma's (1 + w)
              folded into a constant by onnxsim or left as Add(1, w) (any value of shape (H,)), or a constant of
              shape (1, ..., 1, H) (taken as (H,)); or none: an all-ones gamma's `* 1` is removed by onnxsim (fused
              with a ones gamma; needs the normalised size static)
  native      opset 23's RMSNormalization and onnxruntime's SimplifiedLayerNormalization over the last axis,
              stash_type fp32
The normalised axis is x's last, whatever x's rank: a model norm on (B, S, H), Qwen3's / Gemma-3's per-head
q_norm/k_norm on (B, S, N, D) or (B, N, S, D) with gamma (D,), OLMo-2's q_norm/k_norm over the whole projection
(B, S, N*D) with gamma (N*D,).
Refused (the report's check reasons): a mean over another axis or keepdims=0, a non-scalar or non-positive
epsilon, a gamma not of the normalised axis' shape (e.g. per-head (N, D): the norm then fuses with a ones gamma
and the Mul stays), dtypes MindSpore's RmsNorm does not take, a Cast back without a Cast of x.

Coverage candidates (family "norm", shared with fuse-layernorm, passes/coverage.py): every second-moment
reduction, i.e. every ReduceMean of a square (Mul(x, x) or Pow(x, 2)), and every LayerNormalization /
RMSNormalization / SimplifiedLayerNormalization node. A candidate left unfused with no check reason is
explained by `explain` below for RMSNorm-shaped candidates (mean over the wrong axis, keepdims=0, no or a
non-constant epsilon, epsilon outside the square root, no square root, another tensor normalised than the one
squared); LayerNorm-shaped ones (the square of x - mean(x)) are left to fuse-layernorm.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes import coverage, match
from passes.manager import rewrite_pass


def _is_centered(x: ir.Value) -> bool:
    """x = Sub(y, ReduceMean(y)) (through an optional Cast): the inside of a decomposed LayerNorm."""
    node = x.producer()
    if node is not None and node.op_type == "Cast":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.op_type != "Sub" or len(node.inputs) != 2:
        return False
    mean = node.inputs[1].producer() if node.inputs[1] is not None else None
    return mean is not None and mean.op_type == "ReduceMean" and mean.inputs[0] is node.inputs[0]


class RmsNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, normalize: str, cast_out: bool | None = None):
        super().__init__(name)
        self._normalize = normalize
        self._cast_out = cast_out

    def pattern(self, op, x, gamma, epsilon, compute_dtype, target_dtype):
        return op.Mul(self._normed(op, x, epsilon, compute_dtype, target_dtype), gamma)

    def _normed(self, op, x, epsilon, compute_dtype, target_dtype):
        xc = pattern.OrValue([op.Cast(x, to=compute_dtype), x], tag_var="cast_in", tag_values=[True, False])
        square = pattern.OrValue([op.Pow(xc, 2.0), op.Mul(xc, xc)])
        mean = op.ReduceMean(square, _allow_other_inputs=True, _outputs=["mean"])
        if self._normalize == "pow":  # (mean + eps) ** -0.5
            normed = op.Mul(xc, op.Pow(op.Add(mean, epsilon), _RSQRT_EXPONENT))
            return self._cast_back(op, normed, target_dtype)
        rms = op.Sqrt(op.Add(mean, epsilon))
        if self._normalize == "reciprocal":
            normed = op.Mul(xc, op.Reciprocal(rms))
        elif self._normalize == "div-one":
            normed = op.Mul(xc, op.Div(1.0, rms))
        else:
            normed = op.Div(xc, rms)
        return self._cast_back(op, normed, target_dtype)

    def _cast_back(self, op, normed, target_dtype):
        if self._cast_out is not None:  # a pattern's output cannot be a choice: one rule per form
            return op.Cast(normed, to=target_dtype) if self._cast_out else normed
        return pattern.OrValue([op.Cast(normed, to=target_dtype), normed], tag_var="cast_out",
                               tag_values=[True, False])

    def check(self, context, x, gamma, epsilon, mean, cast_in, cast_out, compute_dtype=None,
              **_) -> pattern.MatchResult:
        result = self._check_normed(context, x, epsilon, mean, cast_in, cast_out, compute_dtype)
        if not result:
            return result
        why = _gamma_reason(gamma, x, _input_dtype(x, cast_in, cast_out, compute_dtype))
        return result.fail(why, gamma) if why else result

    def _check_normed(self, context, x, epsilon, mean, cast_in, cast_out, compute_dtype) -> pattern.MatchResult:
        result = pattern.MatchResult()
        reduce = mean.producer()
        rank = x.shape.rank() if x.shape is not None else None
        axes = match.axes(reduce)
        if rank is None:
            return result.fail("the input rank is unknown", x)
        if axes is None or not match.last_axes(axes, rank):
            return result.fail(f"ReduceMean is over axes {axes}, not the last axis", reduce)
        keep = reduce.attributes.get("keepdims")
        if keep is not None and keep.value != 1:
            return result.fail("ReduceMean drops the reduced axis (keepdims=0)", reduce)
        eps = match.const_value(epsilon)
        if eps is None or eps.size != 1 or eps.dtype.kind != "f" or not 0 < float(eps.reshape(-1)[0]) <= 1:
            return result.fail("epsilon is not a constant scalar in (0, 1]", epsilon)
        if cast_out and not cast_in:
            return result.fail("the norm is cast to another dtype at its end only (no Cast of x at its start)", x)
        if _is_centered(x):
            return result.fail("x is x' - mean(x'): this is a LayerNorm (left to fuse-layernorm)", x)
        if cast_in and not cast_out:
            # Gemma's and OLMo-2's order: x cast up, normalised and scaled in the island's dtype, cast back after
            # the gamma Mul (outside the match): RmsNorm runs on Cast(x), in that dtype.
            if _dtype(compute_dtype) != ir.DataType.FLOAT:
                return result.fail(f"the norm computes in {_dtype(compute_dtype)}, not float32", x)
            return result
        return match.float_guard(context, result, x, "RmsNorm")

    def rewrite(self, op, x, gamma, epsilon, cast_in=False, cast_out=False, compute_dtype=None, **_):
        eps = float(match.const_value(epsilon).reshape(-1)[0])
        flat = _flat_gamma(gamma, x) if gamma.shape is not None and gamma.shape.rank() != 1 else None
        if flat is not None:
            gamma = op.Constant(value=ir.tensor(flat, name=None))
        return op.RmsNorm(_island_input(op, x, cast_in, cast_out, compute_dtype), gamma, epsilon=eps,
                          _domain="mindspore")


_RSQRT_EXPONENT = -0.5


def _dtype(attr) -> ir.DataType | None:
    """A Cast's `to` as bound by the matcher (an ir.Attr, or its int value), or None."""
    value = getattr(attr, "value", attr)
    return None if value is None else ir.DataType(value)


def _input_dtype(x: ir.Value, cast_in: bool, cast_out: bool, compute_dtype) -> ir.DataType:
    """The dtype RmsNorm's x has: x's own, or the island's when only x is cast (the Cast back comes after the
    gamma Mul)."""
    return _dtype(compute_dtype) if cast_in and not cast_out else x.dtype


def _island_input(op, x: ir.Value, cast_in: bool, cast_out: bool, compute_dtype):
    return op.Cast(x, to=_dtype(compute_dtype)) if cast_in and not cast_out else x


def _gamma_reason(gamma: ir.Value, x: ir.Value, dtype: ir.DataType) -> str | None:
    """Why `gamma` cannot be RmsNorm's gamma for x (None when it can): one float dtype, and the normalised axis'
    shape (H,) (or a constant (1, ..., 1, H), taken as (H,))."""
    if gamma.dtype != dtype:
        return f"dtypes x={dtype}, gamma={gamma.dtype}: RmsNorm needs one float dtype"
    last = x.shape[x.shape.rank() - 1]
    if gamma.shape is None or gamma.shape.rank() != 1:
        if _flat_gamma(gamma, x) is None:
            return (f"gamma {_shape_text(gamma)} is not of the normalised axis' shape ({last},) (RmsNorm's gamma has "
                    "the normalised axes' shape)")
        return None
    if isinstance(last, int) and gamma.shape[0] != last:
        return f"gamma has {gamma.shape[0]} elements, the normalised axis {last}"
    return None


def _shape_text(value: ir.Value) -> str:
    dims = match.dims(value)
    return "(rank unknown)" if dims is None else "(" + ", ".join(str(d) for d in dims) + ")"


def _flat_gamma(gamma: ir.Value, x: ir.Value) -> np.ndarray | None:
    """A constant gamma of shape (1, ..., 1, H) (rank <= x's, H = x's static last dim) as its (H,) values:
    multiplying by it broadcasts exactly like the 1-D gamma. Else None."""
    c = match.const_value(gamma)
    rank = x.shape.rank() if x.shape is not None else None
    last = x.shape[rank - 1] if rank else None
    if c is None or rank is None or c.ndim > rank or not isinstance(last, int) or c.ndim == 0:
        return None
    if c.shape[-1] != last or any(d != 1 for d in c.shape[:-1]):
        return None
    return c.reshape(-1)


class UnitGammaRmsNormFusion(RmsNormFusion):
    """The same without the gamma Mul: a norm whose weight is all ones (a fresh model) loses its `* 1` to
    onnxsim. Fused with a ones gamma; refused where a gamma Mul follows (the rule above takes that)."""

    def pattern(self, op, x, epsilon, compute_dtype, target_dtype):
        return self._normed(op, x, epsilon, compute_dtype, target_dtype)

    def check(self, context, x, epsilon, mean, cast_in, compute_dtype=None, **_) -> pattern.MatchResult:
        result = self._check_normed(context, x, epsilon, mean, cast_in, self._cast_out, compute_dtype)
        if not result:
            return result
        last = x.shape[x.shape.rank() - 1]
        if not isinstance(last, int):
            return result.fail("without a gamma the normalised size must be static (for a ones gamma)", x)
        dtype = _input_dtype(x, cast_in, self._cast_out, compute_dtype)
        for use in context.output_values[0].uses():
            if use.node.op_type == "Cast" and cast_in and not self._cast_out:
                return result.fail("the Cast back follows (fused by the rule with the Cast)", x)
            other = use.node.inputs[1 - use.idx] if use.node.op_type == "Mul" and len(use.node.inputs) == 2 else None
            if other is not None and _gamma_reason(other, x, dtype) is None:
                return result.fail("a gamma Mul follows (fused by the rule with gamma)", x)
        return result

    def rewrite(self, op, x, epsilon, cast_in=False, compute_dtype=None, **_):
        eps = float(match.const_value(epsilon).reshape(-1)[0])
        last = x.shape[x.shape.rank() - 1]
        dtype = _input_dtype(x, cast_in, self._cast_out, compute_dtype)
        ones = op.Constant(value=ir.tensor(np.ones(last, dtype=dtype.numpy()), name="rmsnorm_unit_gamma"))
        return op.RmsNorm(_island_input(op, x, cast_in, self._cast_out, compute_dtype), ones, epsilon=eps,
                          _domain="mindspore")


class NativeRmsNormalization(pattern.RewriteRuleClassBase):
    """Opset 23's RMSNormalization (what dynamo emits for an RMSNorm formula at opset 23), or onnxruntime's
    SimplifiedLayerNormalization (default domain, what ORT's transformer optimizer writes): both
    y = x / sqrt(mean(x², axes axis..-1) + eps) * scale, statistics in stash_type. Fused over the last axis with
    stash_type fp32 and only y used (SimplifiedLayerNormalization's inv_std_var output unused)."""

    def __init__(self, name: str, op_type: str = "RMSNormalization"):
        super().__init__(name)
        self._op_type = op_type

    def pattern(self, op, x, gamma):
        return getattr(op, self._op_type)(x, gamma, _outputs=["y"])

    def check(self, context, x, gamma, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = y.producer()
        attrs = node.attributes
        get = lambda k, d: attrs[k].value if k in attrs else d  # noqa: E731
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None or not match.last_axis(get("axis", -1), rank):
            return result.fail(f"{self._op_type} over more than the last axis", x)
        if get("stash_type", 1) != 1:
            return result.fail("stash_type is not fp32 (RmsNorm computes its statistics in fp32)", x)
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return result.fail(f"{self._op_type}'s inv_std_var output is used (RmsNorm's rstd is not emitted)", x)
        if x.dtype not in match.FLOATS:
            return result.fail(f"dtype x={x.dtype}: RmsNorm takes fp32, fp16 or bf16", x)
        why = _gamma_reason(gamma, x, x.dtype)
        if why:
            return result.fail(why, gamma)
        if not 0 < get("epsilon", 1e-5) <= 1:
            return result.fail("epsilon is not in (0, 1]", x)
        return match.float_guard(context, result, x, "RmsNorm")

    def rewrite(self, op, x, gamma, y, **_):
        attrs = y.producer().attributes
        eps = float(attrs["epsilon"].value) if "epsilon" in attrs else 1e-5
        flat = _flat_gamma(gamma, x) if gamma.shape is not None and gamma.shape.rank() != 1 else None
        if flat is not None:
            gamma = op.Constant(value=ir.tensor(flat, name=None))
        return op.RmsNorm(x, gamma, epsilon=eps, _domain="mindspore")


NORMALIZE = ("reciprocal", "div-one", "div", "pow")


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass)."""
    return pattern.RewriteRuleSet(
        [RmsNormFusion.rule(f"RmsNorm-{v}", v) for v in NORMALIZE]
        + [UnitGammaRmsNormFusion.rule(f"RmsNorm-unit-gamma-{v}{'-cast' if c else ''}", v, c)
           for v in NORMALIZE for c in (False, True)]
        + [NativeRmsNormalization.rule("RmsNorm-native"),
           NativeRmsNormalization.rule("RmsNorm-ort-simplified-layernorm", "SimplifiedLayerNormalization")],
        commute=True)


PASS = rewrite_pass("fuse-rmsnorm", "decomposed RMSNorm (Pow/Mul, Sqrt, Reciprocal/Div, Cast islands) -> "
                    "mindspore::RmsNorm", rules, candidates=coverage.norm_candidates)


# --- fusion coverage: why a norm candidate was left ------------------------------------------------------------
def _through_cast(value: ir.Value | None) -> ir.Value | None:
    cast = match.producer(value, "Cast")
    return cast.inputs[0] if cast is not None else value


def _squared(reduce: ir.Node) -> ir.Value | None:
    """x of the ReduceMean's Pow(x, 2) / Mul(x, x) (through a Cast)."""
    sq = reduce.inputs[0].producer() if reduce.inputs[0] is not None else None
    if sq is not None and sq.op_type == "Cast":
        sq = sq.inputs[0].producer() if sq.inputs[0] is not None else None
    return sq.inputs[0] if sq is not None and sq.op_type in ("Pow", "Mul") else None



def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    return next((v for v in node.inputs if v is not value), None) if len(node.inputs) == 2 else None


def _same_x(a: ir.Value | None, b: ir.Value | None) -> bool:
    return a is not None and b is not None and (a is b or _through_cast(a) is _through_cast(b))


def explain(node: ir.Node) -> str | None:
    """Why a norm candidate (passes/coverage.py: a ReduceMean of a square) is not an RMSNorm this pass fuses,
    read from the graph around it; None for LayerNorm-shaped candidates (fuse-layernorm's) and the native ops
    (their checks give the reasons)."""
    if node.op_type != "ReduceMean":
        return None
    x = _squared(node)
    if x is None or _is_centered(x):
        return None  # a LayerNorm's variance: fuse-layernorm explains it
    rank = x.shape.rank() if x.shape is not None else None
    axes = match.axes(node)
    if rank is None:
        return "the input rank is unknown"
    if axes is None or not match.last_axes(axes, rank):
        return (f"mean(x²) over axes {axes} of a rank-{rank} x, not the last axis: RmsNorm normalises the last "
                "axis (its gamma's shape)")
    keep = node.attributes.get("keepdims")
    if keep is not None and keep.value != 1:
        return "ReduceMean drops the reduced axis (keepdims=0)"
    mean = node.outputs[0]
    sqrts = match.users(mean, "Sqrt")
    if sqrts and not match.users(mean, "Add"):
        for s in sqrts:
            if any(match.const_value(_other(a, s.outputs[0])) is not None for a in match.users(s.outputs[0], "Add")):
                return "epsilon is added outside the square root (sqrt(mean(x²)) + eps); RmsNorm adds it inside"
        return "no epsilon is added to mean(x²) before the square root"
    adds = match.users(mean, "Add")
    if not adds:
        return f"mean(x²) is not followed by + epsilon (it feeds {', '.join(u.node.op_type for u in mean.uses())})"
    add = adds[0]
    eps = _other(add, mean)
    c = match.const_value(eps)
    if c is None:
        return "the epsilon added to mean(x²) is not a constant"
    if c.size != 1 or c.dtype.kind != "f" or not 0 < float(c.reshape(-1)[0]) <= 1:
        return "epsilon is not a constant scalar in (0, 1]"
    ms = add.outputs[0]
    rstd_users = []  # (node, the value it multiplies or divides, kind)
    for s in match.users(ms, "Sqrt"):
        rms = s.outputs[0]
        for d in match.users(rms, "Div"):
            if d.inputs[1] is rms:
                if match.close_to(d.inputs[0], 1.0):
                    rstd_users += [(m, _other(m, d.outputs[0])) for m in match.users(d.outputs[0], "Mul")]
                else:
                    rstd_users.append((d, d.inputs[0]))
        for r in match.users(rms, "Reciprocal"):
            rstd_users += [(m, _other(m, r.outputs[0])) for m in match.users(r.outputs[0], "Mul")]
        if not rstd_users:
            return "sqrt(mean(x²) + eps) is not used as x / rms or x * (1 / rms)"
    for p in match.users(ms, "Pow"):
        exponent = match.scalar(p.inputs[1]) if len(p.inputs) > 1 else None
        if exponent != _RSQRT_EXPONENT:
            return f"(mean(x²) + eps) is raised to {exponent}, not -0.5 (1 / rms)"
        rstd_users += [(m, _other(m, p.outputs[0])) for m in match.users(p.outputs[0], "Mul")]
    if not rstd_users:
        return "(mean(x²) + eps) is not followed by a square root (Sqrt, or Pow(-0.5))"
    if not any(_same_x(v, x) for _, v in rstd_users):
        return "the value normalised (x / rms) is another tensor than the one squared"
    return None


coverage.set_explain("norm", explain)
