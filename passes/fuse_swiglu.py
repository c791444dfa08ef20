"""fuse-swiglu: SwiGLU MLP -> mindspore::Swiglu(h, dim=-1), MindSpore's Swiglu applying SiLU to the FIRST half of h.

Spellings matched (Mul/Add operands in either order):
  separate gate and up projections -> one MatMul over the merged [gate ; up] weight, then Swiglu:
    gate, up    MatMul(x, Wg) and MatMul(x, Wu) on the same x, Wg and Wu constant 2-D weights of one shape (what
                nn.Linear exports: TorchScript's MatMul by a transposed initializer, dynamo's by a val_NN one);
                with bias: Add(MatMul(x, W), b) on both, b constant 1-D; and a 3-D nn.Linear with bias as onnxsim
                leaves it, Reshape(Add(MatMul(x2d, W), b), shape) with one shape value for gate and up (its Gemm
                made MatMul + Add by canonicalize)
    activation  Mul(gate, Sigmoid(gate)) | mindspore::SiLU(gate) (fuse-silu runs first in the default pipeline)
    product     Mul(activation, up)
    Rewritten to Swiglu(MatMul(x, concat([Wg, Wu], axis=1)) [+ concat([bg, bu])], dim=-1) [then Reshape(., shape)]:
    the gate weight comes first. The merged weight is a new initializer named after the gate weight + "_gate_up";
    the two sources are dropped once nothing else uses them.
    weights read through Casts (no bias): MatMul(x, Cast(Wg)) and MatMul(x, Cast(Wu)), Wg and Wu initializers of
    one low dtype, as a `--dtype auto` export of a bf16 checkpoint writes every projection (onnxsim folds such
    Casts only below its size limit, so real models keep them): merged as stored, then read through one Cast,
    Swiglu(MatMul(x, Cast(concat([Wg, Wu], axis=1))), dim=-1).
  one merged projection split into halves (Phi-3's and GLM-4's gate_up_proj(x).chunk(2, dim=-1), then
  up * silu(gate): transformers' Phi3MLP / Glm4MLP take gate = the FIRST chunk):
    halves      gate, up = Split(h) into two along the last axis (opset 18's num_outputs=2 over an even static
                size, equal `split` sizes [n, n], or before 18 an equal Split without sizes), or a Slice pair
                h[..., 0:n] and h[..., n:2n] (end 2n, INT64_MAX or -0-style clamped ends; step 1) of a static
                last axis of size 2n
    activation  Mul(gate, Sigmoid(gate)) | mindspore::SiLU(gate);  product  Mul(activation, up)
    Rewritten to Swiglu(h, dim=-1) when the gate is the first half: no weight merge, nothing else changes.
    When SiLU gates the SECOND half and h = MatMul(x, W) [+ b] with constant W (and b) used only here, the
    halves are swapped in the weight instead: Swiglu(MatMul(x, W') [+ b'], dim=-1), W' = W's output columns
    [n:2n] then [0:n] (a new initializer, W's name + "_halves_swapped"), so silu(second) * first is computed
    exactly; otherwise it is refused.
Refused (the report's check reasons): weights that are not constants, not 2-D or not of one shape and dtype,
biases that are not constant 1-D of the output size, dtypes Swiglu does not take (fp32/fp16/bf16),
fp16/bf16 below opset 15 (the reference body's CastLike), an input of unknown rank; unequal halves ("Split into
halves of sizes 96 and 160"), a split along another axis than the last, halves of a non-static size, SiLU on
the second half of a tensor that is not a MatMul by a constant weight.
  2-D nn.Linear projections as dynamo writes them, Gemm(x, W, [b], transB=1) with W in [out, in] layout (an MoE's
    shared expert on the flattened tokens): merged along W's rows, Swiglu(Gemm(x, [Wg ; Wu], [bg ; bu], transB=1)).
Not matched: Gemm between Reshapes when canonicalize did not run; the gate and up projections on different
inputs.

GeGLU (Gelu(gate) * up) has no fused MindSpore primitive: it stays mindspore::Gelu / GeluTanh (fuse-gelu) times
the up projection, and its weights are not merged.

Coverage candidates (family "gated_mlp", with fuse-silu; passes/coverage.py): every Mul of an activation
(x*sigmoid(x), mindspore::SiLU, a GELU: Gelu / mindspore::Gelu / GeluTanh / FastGelu) with something other than
the activation's own input and not a constant: silu(gate) * up, gelu(gate) * up. `explain` below gives the
reason for a candidate no check recorded one for: a GELU gate ("MindSpore has no GeGLU primitive"), swapped or
unequal halves, gate and up projections of different inputs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.frontend.param_names import record_made
from passes import coverage, match
from passes.manager import rewrite_pass


class SwigluFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, bias: bool, up_first: bool, reshaped: bool = False, cast: bool = False):
        super().__init__(name)
        self._bias, self._up_first, self._reshaped, self._cast = bias, up_first, reshaped, cast
        self._graph: ir.Graph | None = None
        self._sources: list[ir.Value] = []

    def pattern(self, op, x, wg, wu, bg, bu, shape):
        if self._cast:  # weights stored low, read through a Cast (a `--dtype auto` export of a bf16 checkpoint)
            gate, up = op.MatMul(x, op.Cast(wg, _outputs=["wg_read"])), op.MatMul(x, op.Cast(wu, _outputs=["wu_read"]))
        else:
            gate, up = op.MatMul(x, wg), op.MatMul(x, wu)
        if self._bias:
            gate, up = match.add(op, gate, bg), match.add(op, up, bu)
        if self._reshaped:  # both back to one shape (the same shape value)
            gate, up = op.Reshape(gate, shape, _outputs=["gate_3d"]), op.Reshape(up, shape)
        act = pattern.OrValue([match.mul(op, gate, op.Sigmoid(gate)), op.SiLU(gate, _domain="mindspore")])
        # The root's operand order is a rule variant (a pattern's root is a node, not alternatives).
        return op.Mul(up, act) if self._up_first else op.Mul(act, up)

    def check(self, context, x, wg, wu, bg=None, bu=None, wg_read=None, wu_read=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in match.FLOATS:
            return result.fail(f"dtype {x.dtype}: Swiglu takes float32, float16 or bfloat16", x)
        if x.shape is None or x.shape.rank() is None or x.shape.rank() < 2:
            return result.fail("the input rank is unknown or below 2", x)
        if self._cast and (wg.const_value is None or wu.const_value is None):  # (merged as stored: initializers)
            return result.fail("the gate/up weights read through Casts are not initializers (nothing to merge)", wg)
        g, u = match.const_value(wg), match.const_value(wu)
        if g is None or u is None:
            return result.fail("the gate/up weights are not constants (nothing to merge)", wg if g is None else wu)
        if g.ndim != 2 or g.shape != u.shape:
            return result.fail(f"gate/up weights of shapes {g.shape} and {u.shape}: not one 2-D shape", wg)
        read = (wg_read.dtype, wu_read.dtype) if self._cast else (wg.dtype, wu.dtype)
        if read != (x.dtype, x.dtype) or wg.dtype != wu.dtype:
            return result.fail(f"dtypes x={x.dtype}, gate={wg.dtype}, up={wu.dtype}"
                               f"{f' read as {read[0]}, {read[1]}' if self._cast else ''}: not one dtype", wg)
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
        w_name = match.unique_initializer_name(graph, f"{wg.name}_gate_up")
        w = match.concatenated(w_name, [wg, wu], axis=1, stored=self._cast)  # [gate ; up] along the output dim
        merged = op.initializer(w, name=w_name)
        h = op.MatMul(x, op.Cast(merged, to=x.dtype) if self._cast else merged)
        record_made(graph, w_name, [wg.name, wu.name], "concat axis 1", made_by="fuse-swiglu")
        self._sources += [wg, wu]
        if bg is not None:
            b = np.concatenate([match.const_value(bg), match.const_value(bu)])
            b_name = match.unique_initializer_name(graph, f"{bg.name}_gate_up")
            h = op.Add(h, op.initializer(ir.tensor(b, name=b_name), name=b_name))
            record_made(graph, b_name, [bg.name, bu.name], "concat axis 0", made_by="fuse-swiglu")
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
        _free_sources(self._sources)
        self._sources = []


class SwigluGemmFusion(pattern.RewriteRuleClassBase):
    """The same SwiGLU with 2-D nn.Linear projections as dynamo writes them: Gemm(x, W, [b], transB=1), W in
    Linear's [out, in] layout (an MoE's shared expert on the flattened tokens, Qwen2-MoE's). Rewritten to
    Swiglu(Gemm(x, concat([Wg, Wu], axis=0), [concat([bg, bu])], transB=1), dim=-1): the gate rows first."""

    def __init__(self, name: str, bias: bool, up_first: bool):
        super().__init__(name)
        self._bias, self._up_first = bias, up_first
        self._graph: ir.Graph | None = None
        self._sources: list[ir.Value] = []

    def pattern(self, op, x, wg, wu, bg, bu):
        gate = op.Gemm(x, wg, bg, _outputs=["gate"]) if self._bias else op.Gemm(x, wg, _outputs=["gate"])
        up = op.Gemm(x, wu, bu, _outputs=["up"]) if self._bias else op.Gemm(x, wu, _outputs=["up"])
        act = pattern.OrValue([match.mul(op, gate, op.Sigmoid(gate)), op.SiLU(gate, _domain="mindspore")])
        return op.Mul(up, act) if self._up_first else op.Mul(act, up)

    def check(self, context, x, wg, wu, gate, up, bg=None, bu=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        for v in (gate, up):
            a = {k: attr.value for k, attr in v.producer().attributes.items()}
            if (a.get("transA", 0), a.get("transB", 0), a.get("alpha", 1.0), a.get("beta", 1.0)) != (0, 1, 1.0, 1.0):
                return result.fail("a gate/up Gemm other than x @ W^T (+ b): transA, alpha or beta set", v)
        g, u = match.const_value(wg), match.const_value(wu)
        if g is None or u is None:
            return result.fail("the gate/up weights are not constants (nothing to merge)", wg if g is None else wu)
        if g.ndim != 2 or g.shape != u.shape or wg.dtype != x.dtype or wu.dtype != x.dtype:
            return result.fail(f"gate/up weights of shapes {g.shape} and {u.shape}: not one 2-D shape and dtype", wg)
        if self._bias:
            b1, b2 = match.const_value(bg), match.const_value(bu)
            if b1 is None or b2 is None or b1.shape != (g.shape[0],) or b2.shape != (g.shape[0],):
                return result.fail(f"gate/up biases are not constant 1-D of the output size {g.shape[0]}", bg)
        if not match.float_guard(context, result, x, "Swiglu"):
            return result
        self._graph = context.graph_or_function
        return result

    def rewrite(self, op, x, wg, wu, bg=None, bu=None, **_):
        graph = self._graph
        w_name = match.unique_initializer_name(graph, f"{wg.name}_gate_up")
        w = match.concatenated(w_name, [wg, wu], axis=0)  # [gate ; up] output rows
        args = [x, op.initializer(w, name=w_name)]
        record_made(graph, w_name, [wg.name, wu.name], "concat axis 0", made_by="fuse-swiglu")
        self._sources += [wg, wu]
        if bg is not None:
            b = np.concatenate([match.const_value(bg), match.const_value(bu)])
            b_name = match.unique_initializer_name(graph, f"{bg.name}_gate_up")
            args.append(op.initializer(ir.tensor(b, name=b_name), name=b_name))
            record_made(graph, b_name, [bg.name, bu.name], "concat axis 0", made_by="fuse-swiglu")
            self._sources += [bg, bu]
        return op.Swiglu(op.Gemm(*args, transB=1), dim=-1, _domain="mindspore")

    def setup(self):
        self._sources = []

    def cleanup(self):
        _free_sources(self._sources)
        self._sources = []


def _free_sources(sources: list[ir.Value]) -> None:
    """Drop the initializers (or Constant nodes) in `sources` that nothing uses any more."""
    for v in sources:
        if v is None or v.uses() or (v.graph is not None and v in v.graph.outputs):
            continue
        if v.is_initializer() and v.graph is not None and v.name in v.graph.initializers:
            del v.graph.initializers[v.name]
        elif v.producer() is not None and v.producer().op_type == "Constant":
            node = v.producer()
            node.graph.remove(node, safe=True)


# --- gate and up as two WeightQuantBatchMatmuls (MatMulNBits, graphconv/frontend/contrib/quant.py) -------------


class SwigluQuantFusion(pattern.RewriteRuleClassBase):
    """silu(WQBMM(x, Wg, sg, og)) * WQBMM(x, Wu, su, ou), one group size and one weight form -> Swiglu(WQBMM(x,
    [Wg ; Wu], [sg | su], [og | ou])): the weights (qint4x2 [N, K/2] or int8 [N, K]) concatenated along N (axis
    0), the scales and offsets ((K/g, N), or (N,) per channel) along N (their last axis): each output column
    keeps its own bytes, scale and offset, so it is exact."""

    def __init__(self, name: str, up_first: bool):
        super().__init__(name)
        self._up_first = up_first
        self._graph: ir.Graph | None = None
        self._sources: list[ir.Value] = []

    def pattern(self, op, x, wg, sg, og, wu, su, ou):
        gate = op.WeightQuantBatchMatmul(x, wg, sg, og, _domain="mindspore", _outputs=["gate"])
        up = op.WeightQuantBatchMatmul(x, wu, su, ou, _domain="mindspore", _outputs=["up"])
        act = pattern.OrValue([match.mul(op, gate, op.Sigmoid(gate)), op.SiLU(gate, _domain="mindspore")])
        return op.Mul(up, act) if self._up_first else op.Mul(act, up)

    def check(self, context, x, gate, up, **operands) -> pattern.MatchResult:
        result = pattern.MatchResult()
        wg = operands["wg"]
        groups = [v.producer().attributes.get_int("antiquant_group_size") for v in (gate, up)]
        if groups[0] != groups[1]:
            return result.fail(f"gate/up group sizes {groups[0]} and {groups[1]}: not one WeightQuantBatchMatmul", gate)
        bits = [v.producer().attributes.get_int("weight_bits", 4) for v in (gate, up)]
        if bits[0] != bits[1]:
            return result.fail(f"gate/up weights of {bits[0]} and {bits[1]} bits: not one WeightQuantBatchMatmul", gate)
        held = [operands[k].const_value for k in ("wg", "sg", "og", "wu", "su", "ou")]
        if any(h is None for h in held):
            return result.fail("the gate/up quantized weights are not initializers (nothing to merge)", wg)
        if held[0].shape[1:] != held[3].shape[1:] or held[1].shape[:-1] != held[4].shape[:-1]:
            return result.fail(f"gate/up weights of shapes {held[0].shape} and {held[3].shape}: not one K", wg)
        if len(list(gate.uses())) > 2 or len(list(up.uses())) > 1:
            return result.fail("the projections' results are used elsewhere too", gate)
        if x.dtype not in match.FLOATS:
            return result.fail(f"dtype {x.dtype}: Swiglu takes float32, float16 or bfloat16", x)
        from opmap.fused.weight_quant_batch_matmul import WEIGHT_QUANT_BATCH_MATMUL

        k, n = held[0].shape[1] * 8 // bits[0], held[0].shape[0] + held[3].shape[0]
        broken = WEIGHT_QUANT_BATCH_MATMUL.broken({"K": k, "N": n, "G": groups[0], "bits": bits[0]})
        if broken is not None:
            return result.fail(f"the merged WeightQuantBatchMatmul would break: {broken.text} ({broken.source}) "
                               f"at N={n}", wg)
        self._graph = context.graph_or_function
        return result

    def rewrite(self, op, x, gate, **operands):
        graph = self._graph
        merged = []
        for parts, axis in ((("wg", "wu"), 0), (("sg", "su"), -1), (("og", "ou"), -1)):  # [N, .]; (K/g, N) | (N,)
            g, u = (operands[k] for k in parts)
            name = match.unique_initializer_name(graph, f"{g.name}_gate_up")
            tensor = ir.tensor(np.concatenate([g.const_value.numpy(), u.const_value.numpy()], axis=axis), name=name)
            merged.append(op.initializer(tensor, name=name))
            record_made(graph, name, [g.name, u.name], f"concat axis {axis}", made_by="fuse-swiglu")
            self._sources += [g, u]
        attrs = gate.producer().attributes
        h = op.WeightQuantBatchMatmul(x, *merged, antiquant_group_size=attrs.get_int("antiquant_group_size"),
                                      weight_bits=attrs.get_int("weight_bits", 4), _domain="mindspore")
        return op.Swiglu(h, dim=-1, _domain="mindspore")

    def setup(self):
        self._sources = []

    def cleanup(self):
        _free_sources(self._sources)
        self._sources = []


class SwigluQuantBatchFusion(pattern.RewriteRuleClassBase):
    """silu(QBMM(xq, Wg, sg, bg)) * QBMM(xq, Wu, su, bu) on one int8 xq (one QuantV2: passes/fuse_qdq_matmul.py)
    -> Swiglu(QBMM(xq, [Wg ; Wu], [sg | su], [bg | bu])): the int8 weights [N, K], the dequantization scales
    and the int32 biases [N] concatenated along N; each output column keeps its own weights, scale and bias,
    so it is exact."""

    def __init__(self, name: str, up_first: bool):
        super().__init__(name)
        self._up_first = up_first
        self._graph: ir.Graph | None = None
        self._sources: list[ir.Value] = []

    def pattern(self, op, x, wg, sg, bg, wu, su, bu):
        gate = op.QuantBatchMatmul(x, wg, sg, bg, _domain="mindspore", _outputs=["gate"])
        up = op.QuantBatchMatmul(x, wu, su, bu, _domain="mindspore", _outputs=["up"])
        act = pattern.OrValue([match.mul(op, gate, op.Sigmoid(gate)), op.SiLU(gate, _domain="mindspore")])
        return op.Mul(up, act) if self._up_first else op.Mul(act, up)

    def check(self, context, x, gate, up, **operands) -> pattern.MatchResult:
        result = pattern.MatchResult()
        dtypes = [v.producer().attributes.get_int("dtype") for v in (gate, up)]
        if dtypes[0] != dtypes[1]:
            return result.fail(f"gate/up output dtypes {dtypes[0]} and {dtypes[1]}: not one QuantBatchMatmul", gate)
        held = [operands[k].const_value for k in ("wg", "sg", "bg", "wu", "su", "bu")]
        if any(h is None for h in held):
            return result.fail("the gate/up quantized weights are not initializers (nothing to merge)", operands["wg"])
        if held[0].shape[1:] != held[3].shape[1:]:
            return result.fail(f"gate/up weights of shapes {held[0].shape} and {held[3].shape}: not one K",
                               operands["wg"])
        if len(list(gate.uses())) > 2 or len(list(up.uses())) > 1:
            return result.fail("the projections' results are used elsewhere too", gate)
        self._graph = context.graph_or_function
        return result

    def rewrite(self, op, x, gate, **operands):
        graph = self._graph
        merged = []
        for parts in (("wg", "wu"), ("sg", "su"), ("bg", "bu")):  # all along N (axis 0)
            g, u = (operands[k] for k in parts)
            name = match.unique_initializer_name(graph, f"{g.name}_gate_up")
            tensor = ir.tensor(np.concatenate([g.const_value.numpy(), u.const_value.numpy()]), name=name)
            merged.append(op.initializer(tensor, name=name))
            record_made(graph, name, [g.name, u.name], "concat axis 0", made_by="fuse-swiglu")
            self._sources += [g, u]
        dtype = gate.producer().attributes.get_int("dtype")
        h = op.QuantBatchMatmul(x, *merged, dtype=dtype, _domain="mindspore")
        return op.Swiglu(h, dim=-1, _domain="mindspore")

    def setup(self):
        self._sources = []

    def cleanup(self):
        _free_sources(self._sources)
        self._sources = []


# --- one tensor split into its two halves: silu(first half) * second half -------------------------------------


def halves(gate: ir.Value, up: ir.Value) -> tuple[ir.Value, int] | str | None:
    """(h, gate_index) when `gate` and `up` are the two equal halves of one tensor h along its last axis (a Split
    into two, or a pair of Slices), gate_index 0 when `gate` is the first half; the reason they are not when
    they are parts of one tensor; None when they are not parts of one tensor at all."""
    split = match.producer(gate, "Split")
    if split is not None and split is match.producer(up, "Split"):
        return _split_halves(split, gate)
    sg, su = match.producer(gate, "Slice"), match.producer(up, "Slice")
    if sg is not None and su is not None and sg.inputs[0] is su.inputs[0]:
        return _slice_halves(sg, su)
    return None


def _not_last_axis(h: ir.Value, axis: int, what: str) -> str | None:
    rank = match.rank(h)
    if rank is None:
        return f"the rank of the {what} input is unknown"
    if not match.last_axis(axis, rank):
        return f"{what} along axis {axis}, not the last: Swiglu is fused over the last axis only"
    return None


def _split_halves(node: ir.Node, gate: ir.Value) -> tuple[ir.Value, int] | str:
    h = node.inputs[0]
    if len(node.outputs) != 2:
        return f"Split into {len(node.outputs)} parts, not two halves"
    attr = node.attributes.get("axis")
    reason = _not_last_axis(h, 0 if attr is None else attr.value, "Split")
    if reason:
        return reason
    size = match.dims(h)[-1]
    sizes = match.input_at(node, 1)
    if sizes is not None:
        split = match.ints(sizes)
        if split is None or len(split) != 2:
            return "the Split sizes are not two constants"
        if split[0] != split[1]:
            return f"Split into halves of sizes {split[0]} and {split[1]}: Swiglu splits into two equal halves"
    elif node.attributes.get("num_outputs") is not None:
        # opset >= 18: num_outputs=2 cuts ceil(n/2) and floor(n/2), equal halves only for an even size. (Before 18
        # a Split without sizes cuts equal parts or fails.)
        if not isinstance(size, int):
            return f"Split(num_outputs=2) of an axis of non-static size {size}: equal halves are not provable"
        if size % 2:
            return (f"Split(num_outputs=2) of an axis of odd size {size} makes halves of {size // 2 + 1} and "
                    f"{size // 2}: Swiglu splits into two equal halves")
    return h, list(node.outputs).index(gate)


def _slice_range(node: ir.Node, size) -> tuple[int, int] | str:
    starts, ends = match.ints(match.input_at(node, 1)), match.ints(match.input_at(node, 2))
    axes_in, steps_in = match.input_at(node, 3), match.input_at(node, 4)
    axes = match.ints(axes_in) if axes_in is not None else list(range(len(starts or [])))
    steps = match.ints(steps_in) if steps_in is not None else [1]
    if starts is None or ends is None or axes is None or steps is None:
        return "the Slice bounds are not constants"
    if len(starts) != 1 or len(ends) != 1 or len(axes) != 1:
        return "a Slice cuts more than one axis"
    if steps != [1]:
        return f"a Slice has step {steps[0]}, not 1"
    reason = _not_last_axis(node.inputs[0], axes[0], "Slice")
    if reason:
        return reason
    if not isinstance(size, int):
        return f"Slices of an axis of non-static size {size}: equal halves are not provable"

    def clamp(v: int) -> int:
        return min(max(v + size if v < 0 else v, 0), size)

    return clamp(starts[0]), clamp(ends[0])


def _slice_halves(sg: ir.Node, su: ir.Node) -> tuple[ir.Value, int] | str:
    h = sg.inputs[0]
    size = (match.dims(h) or [None])[-1]
    g, u = _slice_range(sg, size), _slice_range(su, size)
    for r in (g, u):
        if isinstance(r, str):
            return r
    n = size // 2
    if size % 2 == 0 and {g, u} == {(0, n), (n, size)}:
        return h, 0 if g == (0, n) else 1
    return (f"Slices [{g[0]}, {g[1]}) (gate) and [{u[0]}, {u[1]}) (up) of an axis of size {size} are not its two "
            "equal halves")


_SWAP_NEEDS = ("SiLU gates the second half, Swiglu the first: swapping the halves needs h = MatMul(x, W) [+ b] by "
               "a constant weight, used only by the split")


class SwigluHalvesFusion(pattern.RewriteRuleClassBase):
    """silu(gate) * up where gate, up are the halves of one tensor h -> Swiglu(h, dim=-1); with the halves
    swapped in a constant projection weight when SiLU gates the second half (source "matmul"/"matmul-bias")."""

    def __init__(self, name: str, split: str, gate_index: int, source: str, up_first: bool):
        super().__init__(name)
        self._split, self._gate_index, self._source, self._up_first = split, gate_index, source, up_first
        self._graph: ir.Graph | None = None
        self._sources: list[ir.Value] = []

    def pattern(self, op, x, w, b, gs, ge, gax, us, ue, uax):
        if self._source == "any":
            h = x
        elif self._source == "matmul":
            h = op.MatMul(x, w)
        else:
            h = match.add(op, op.MatMul(x, w), b)
        if self._split == "split":
            names = ["gate", "up"] if self._gate_index == 0 else ["up", "gate"]
            parts = op.Split(h, _allow_other_inputs=True, _outputs=names)
            gate, up = (parts[0], parts[1]) if self._gate_index == 0 else (parts[1], parts[0])
        else:  # which Slice is the first half is the check's to find out
            gate = op.Slice(h, gs, ge, gax, _allow_other_inputs=True, _outputs=["gate"])
            up = op.Slice(h, us, ue, uax, _allow_other_inputs=True, _outputs=["up"])
        act = pattern.OrValue([match.mul(op, gate, op.Sigmoid(gate)), op.SiLU(gate, _domain="mindspore")])
        return op.Mul(up, act) if self._up_first else op.Mul(act, up)

    def check(self, context, gate, up, w=None, b=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        found = halves(gate, up)
        if not isinstance(found, tuple):
            return result.fail(found or "the gate and up operands are not two halves of one tensor", gate)
        h, gate_index = found
        if self._source == "any" and gate_index == 1:
            return result.fail(_SWAP_NEEDS, gate)
        if self._source != "any":
            size = match.dims(h)[-1]
            wv = match.const_value(w)
            if wv is None:
                return result.fail(f"{_SWAP_NEEDS}: the weight is not a constant", w)
            if wv.ndim != 2 or wv.shape[1] != size or w.dtype != h.dtype:
                return result.fail(f"{_SWAP_NEEDS}: the weight of shape {wv.shape} is not 2-D [K, {size}] in "
                                   f"h's dtype", w)
            if b is not None:
                bv = match.const_value(b)
                if bv is None or bv.shape != (size,) or b.dtype != h.dtype:
                    return result.fail(f"{_SWAP_NEEDS}: the bias is not a constant 1-D of size {size}", b)
        if not match.float_guard(context, result, h, "Swiglu"):
            return result
        self._graph = context.graph_or_function
        return result

    def rewrite(self, op, gate, up, x=None, w=None, b=None, **_):
        h, gate_index = halves(gate, up)
        if self._source == "any":
            return op.Swiglu(h, dim=-1, _domain="mindspore")
        if gate_index == 0:  # nothing to swap: the projection as it was
            h = op.MatMul(x, w)
            return op.Swiglu(h if b is None else op.Add(h, b), dim=-1, _domain="mindspore")
        n = match.dims(h)[-1] // 2
        w_name = match.unique_initializer_name(self._graph, f"{w.name}_halves_swapped")

        def swapped():
            wv = match.const_value(w)
            return np.concatenate([wv[:, n:], wv[:, :n]], axis=1)

        hs = op.MatMul(x, op.initializer(match.made_weight(w_name, swapped, [w]), name=w_name))
        record_made(self._graph, w_name, [w.name], "swap the halves of axis 1", "suffix:_halves_swapped",
                    made_by="fuse-swiglu")
        self._sources.append(w)
        if b is not None:
            bv = match.const_value(b)
            b_name = match.unique_initializer_name(self._graph, f"{b.name}_halves_swapped")
            hs = op.Add(hs, op.initializer(ir.tensor(np.concatenate([bv[n:], bv[:n]]), name=b_name), name=b_name))
            record_made(self._graph, b_name, [b.name], "swap the halves", "suffix:_halves_swapped",
                        made_by="fuse-swiglu")
            self._sources.append(b)
        return op.Swiglu(hs, dim=-1, _domain="mindspore")

    def setup(self):
        self._sources = []

    def cleanup(self):
        _free_sources(self._sources)
        self._sources = []


# --- coverage: why a gated-MLP candidate was not fused ----------------------------------------------------------

_GELU_GATES = {
    "Gelu": "GELU (exact erf)", "GeluTanh": "GELU (tanh approximation)",
    "FastGelu": "quick GELU x * sigmoid(1.702 x)",
}


def _gate_activation(value: ir.Value | None) -> tuple[str, ir.Value] | None:
    """(kind, x) when `value` is an activation of x: kind "silu" or a GELU's description."""
    p = value.producer() if value is not None else None
    if p is None:
        return None
    if p.domain == "mindspore" and p.op_type == "SiLU":
        return "silu", p.inputs[0]
    if p.domain == "mindspore" and p.op_type in _GELU_GATES:
        return _GELU_GATES[p.op_type], p.inputs[0]
    if match.producer(value, "Gelu") is not None:
        approximate = p.attributes.get("approximate")
        tanh = approximate is not None and approximate.value == "tanh"
        return _GELU_GATES["GeluTanh" if tanh else "Gelu"], p.inputs[0]
    if match.producer(value, "Mul") is not None and len(p.inputs) == 2:
        for x, s in ((p.inputs[0], p.inputs[1]), (p.inputs[1], p.inputs[0])):
            sig = match.producer(s, "Sigmoid")
            if sig is not None and sig.inputs[0] is x:
                return "silu", x
    return None


def _projection(value: ir.Value) -> ir.Node | None:
    """The MatMul behind value = MatMul(x, W) [+ b] [then Reshape], else None."""
    v = value
    reshape = match.producer(v, "Reshape")
    if reshape is not None:
        v = reshape.inputs[0]
    add = match.producer(v, "Add")
    if add is not None:
        v = next((i for i in add.inputs if match.producer(i, "MatMul") is not None), v)
    return match.producer(v, "MatMul")


def _swap_blocker(h: ir.Value) -> str:
    """Why the halves of h could not be swapped in its projection weight."""
    p = h.producer()
    add = match.producer(h, "Add")
    mm = match.producer(h, "MatMul")
    if add is not None:
        mm = next((match.producer(i, "MatMul") for i in add.inputs if match.producer(i, "MatMul")), None)
    if mm is None:
        return f"h is computed by {p.op_type if p is not None else 'a graph input'}, not a MatMul"
    if match.const_value(mm.inputs[1]) is None:
        return "the projection weight is not a constant"
    if len(list(h.uses())) > 2 or (add is not None and len(list(mm.outputs[0].uses())) > 1):
        return "the projection's result is used elsewhere too"
    return "the projection is not MatMul(x, W) [+ b] of a 2-D weight and 1-D bias of h's width"


def explain(node: ir.Node) -> str | None:
    """The reason a gated_mlp candidate Mul (coverage.gated_mlp_candidates) was not fused, or None."""
    if len(node.inputs) != 2:
        return None
    for act, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        found = _gate_activation(act)
        if found is None or other is found[1]:
            continue
        kind, gate = found
        if kind != "silu":
            fused = act.producer().domain == "mindspore"
            quick = "quick" in kind
            alone = f"the {'FastGeLU' if quick else 'GELU'} is fused on its own" if fused else \
                "the GELU itself is left to fuse-gelu"
            return (f"the gate's activation is {kind}: MindSpore has no "
                    f"{'gated FastGeLU' if quick else 'GeGLU'} primitive ({alone})")
        parts = halves(gate, other)
        if isinstance(parts, str):
            return parts
        if isinstance(parts, tuple):
            h, gate_index = parts
            if gate_index == 1:
                return f"{_SWAP_NEEDS}: {_swap_blocker(h)}"
            return _dtype_reason(h)
        rounded = next(((what, q) for what, v in (("gate", gate), ("up", other)) if (q := match.qdq_pair(v))), None)
        if rounded is not None:
            return (f"the {rounded[0]} operand is rounded by a QuantizeLinear -> DequantizeLinear pair "
                    f"({rounded[1].name}): a Swiglu would drop that rounding")
        pg, pu = _projection(gate), _projection(other)
        if pg is not None and pu is not None:
            if pg.inputs[0] is not pu.inputs[0]:
                return "the gate and up projections read different inputs (nothing to merge into one MatMul)"
            if match.const_value(pg.inputs[1]) is None or match.const_value(pu.inputs[1]) is None:
                return "the gate/up weights are not constants (nothing to merge)"
            return _dtype_reason(gate) or ("the gate and up projections differ in form (bias, Reshape, weight "
                                           "shape): not one merged SwiGLU")
        return ("the up operand is neither a projection of the gate's input nor the other half of the gate's "
                "split: not a SwiGLU")
    return None


def _dtype_reason(x: ir.Value) -> str | None:
    if x.dtype is not None and x.dtype not in match.FLOATS:
        return f"dtype {x.dtype}: Swiglu takes float32, float16 or bfloat16"
    return None


coverage.set_explain("gated_mlp", explain)


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass); a check hands its graph
    to its rewrite, and a walk's merged weights' sources wait for cleanup(), on the rule instance."""
    found = [SwigluFusion.rule(f"Swiglu{'-bias' if bias else ''}{'-reshaped' if reshaped else ''}"
                               f"{'-up-first' if up_first else ''}", bias, up_first, reshaped)
             for bias, reshaped in ((False, False), (True, False), (True, True)) for up_first in (False, True)]
    found += [SwigluFusion.rule(f"Swiglu-cast{'-up-first' if up_first else ''}", False, up_first, cast=True)
              for up_first in (False, True)]
    found += [SwigluQuantFusion.rule(f"Swiglu-weight-quant{'-up-first' if up_first else ''}", up_first)
              for up_first in (False, True)]
    found += [SwigluQuantBatchFusion.rule(f"Swiglu-quant-batch{'-up-first' if up_first else ''}", up_first)
              for up_first in (False, True)]
    found += [SwigluGemmFusion.rule(f"Swiglu-gemm{'-bias' if bias else ''}{'-up-first' if up_first else ''}", bias,
                                    up_first) for bias in (False, True) for up_first in (False, True)]
    found += [SwigluHalvesFusion.rule(f"Swiglu-halves-{split}{'-second' if gate_index else ''}-{source}"
                                      f"{'-up-first' if up_first else ''}", split, gate_index, source, up_first)
              for source in ("any", "matmul", "matmul-bias") for split in ("split", "slice")
              # a Slice pair's order is the check's to find; a Split's is the pattern's (the swapped one fuses
              # only through a constant projection weight, and the plain rule names why not)
              for gate_index in ({"any": (0, 1), "matmul": (1,), "matmul-bias": (1,)}[source] if split == "split"
                                 else (0,))
              for up_first in (False, True)]
    return pattern.RewriteRuleSet(found)


PASS = rewrite_pass("fuse-swiglu", "SiLU(x @ Wg [+ bg]) * (x @ Wu [+ bu]) -> mindspore::Swiglu over one MatMul "
                    "with the merged [gate ; up] weight; silu(first half) * second half of one tensor -> "
                    "mindspore::Swiglu", rules, candidates=coverage.gated_mlp_candidates)
