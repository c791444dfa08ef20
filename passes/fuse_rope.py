"""fuse-rope: the application of rotary position embeddings -> mindspore::RotaryPositionEmbedding, one fused node
per rotated tensor (q and k separately). The cos/sin computation stays as it is (computed on the fly from
inv_freq and positions, or gathered from a cache); only `x * cos + rot(x) * sin` is fused.

Spellings matched (Add and both Muls with their operands in either order):
  rotate_half  (mode 0)  rot = Concat(Neg(x2), x1) on the last axis, x1 = x[..., :D/2], x2 = x[..., D/2:] taken
                         by two Slices or by one Split (halves, or num_outputs=2)
  interleaved  (mode 1)  rot = Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1), Unsqueeze(x[..., 0::2], -1),
                         axis=-1)) back to x's shape: GPT-J's rotate_every_two (two step-2 Slices, torch.stack,
                         flatten); the Reshape's target a constant [0, 0, 0, -1 or D], TorchScript's
                         Concat(Shape(stacked)[:3], [-1]), or any target whose result provably has x's shape
  partial rotary         x = x_full[..., :rot_dim] is rotated with D = rot_dim; the Slice and the Concat with
                         the pass-through part stay around the fused node (NeoX, Phi, GPT-J)
cos/sin of rank < 4 (e.g. (S, D) from models/llama.py) broadcast exactly like their Unsqueeze to rank 4, which
the rewrite inserts (one per cos/sin value, shared by every fused node that reads it). cos/sin may come from
anywhere: computed from inv_freq and positions (transformers' default), or gathered by position ids from a
constant cos/sin cache (GPT-J's embed_positions sincos table, older Llama's cos_cached[position_ids]).

Mode 1 also needs cos[2i] = cos[2i+1] (and the same for sin; docs/fused_ops.md), which is proved from the graph
(`repeated_pairs`) or the fusion is refused: a constant is compared; repeat_interleave(f, 2, -1) as the exporters
write it (Unsqueeze(-1), Expand of the new size-1 axis to 2 -- or TorchScript's Tile by [1, .., 1, 2] --, Reshape
merging the last two axes) creates the property; elementwise ops (Cos, Sin, Cast, Mul by a scalar or by another
such value), reshapes to an even last dim, a Tile of an even last axis, Gather/GatherND/Slice/Split/Transpose/Concat
that keep the last axis or cut it at even offsets keep it.
GPT-J (sincos table gathered, split into sin and cos, each repeat_interleaved: Expand through dynamo, Tile through
TorchScript), Cohere (repeat_interleave of the frequencies) and GLM-4 (cos[..., :half].repeat_interleave(2)) are
proved this way; cat(f, f) or Tile(f, [1, 2]) (the rotate_half layout) or a graph input is refused with the reason.

Refused (the report's check reasons): x not 4-D, D not static, odd, or >= 896; a dtype other than fp16/bf16/fp32
or cos/sin of another dtype than x (fp16/bf16 also below opset 15, where the reference body has no CastLike);
mode 1 with cos/sin whose pairs are not provably equal;
Slice/Split/Concat/Reshape parameters that do not take exactly the halves or pairs of the last axis; cos/sin
shapes RotaryPositionEmbedding does not accept: with x read as BNSD, cos/sin must be 11SD, B1SD or BNSD in mode
0 and 11SD only in mode 1 (BSND: 1S1D, BS1D, BSND / mode 1 1S1D; SBND: S11D, SB1D, SBND / mode 1 S11D), and a
statically known B or N must be < 1000.

Dims are compared by value where static and by symbol otherwise. TorchScript exports give every unknown dim a
fresh name (cos's seq and q's seq are then `unk__0` and `unk__14`); for those, onnxruntime's symbolic shape
inference (no auto-merge) is run once on a weight-less copy of the graph and its symbols are compared instead:
they are equal when the dims derive from the same shape arithmetic (or the model could not run otherwise).

Coverage candidates (family "rotary", passes/coverage.py): every Neg whose result reaches a Concat within two
shape-only ops (rotate_half's concat(-x2, x1), the interleaved stack(-x[1::2], x[0::2])), every opset-23
RotaryEmbedding, and every Concat of a Sub and an Add of two products each (the half-length form; the rules'
checks give the reasons). One left unfused with no check reason is explained by `explain` below: the rotation the other
way (concat(x1, -x2), stack(x[0::2], -x[1::2])), halves from different tensors, a negated value that is no slice
of x, no rot(x) * sin, a Sub instead of the Add, x * cos of another tensor.

Opset 23's RotaryEmbedding (what dynamo writes at opset 23 for rotate_half models) fuses too: 4-D (B, N, S, D)
or 3-D (B, S, N*D) x, halves (mode 0) or pairs (mode 1, cos/sin batch static 1), full or partial
(rotary_embedding_dim), cos/sin given or gathered by position_ids (NativeRotaryEmbedding below).
The half-length form (transformers 5's gpt-oss and DeepSeek: cat(x1*cos - x2*sin, x2*cos + x1*sin) with cos/sin
of D/2 angles, halves by Slices or Split) fuses as mode 0 with cos/sin doubled (cat(cos, cos)), which is the
same rotation. With pairs instead of halves (x1 = x[..., 0::2], x2 = x[..., 1::2]: DeepSeek-V3's
rope_interleave, the output de-interleaved) it is the same rotation of cat(x1, x2), which the fused node takes.
Llama 4's rotary as graphconv exports it (its complex product on the pairs (a, b) of x viewed as (..., D/2, 2),
stacked back: stack(a*c - b*s, a*s + b*c)) is the half-length form of cat(a, b) with its halves stacked into
pairs, which the rewrite writes around a mode-0 node (StackedPairs). Not matched: complex-number RoPE itself.
MindSpore's `ApplyRotaryPosEmb` (q and k together) is never emitted.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphconv.onnx_domains import is_default_domain
from opmap.fused.rotary import ROTARY_POSITION_EMBEDDING
from passes import coverage, dim_bounds, match
from passes.manager import rewrite_pass
from passes.shapes import _snapshot, _symbolic_shapes  # (tests patch them here)

# The cos/sin shapes RotaryPositionEmbedding accepts, as the axes among x's first three where cos/sin have size
# 1 (every other axis has x's size): (0, 1) 11SD of BNSD, (1,) B1SD of BNSD, () x's own shape, (0, 2) 1S1D of
# BSND, (2,) BS1D of BSND or SB1D of SBND, (1, 2) S11D of SBND. The primitive takes no layout argument: it reads
# the layout from the shapes, and every reading consistent with them broadcasts the same way.
_LAYOUTS = {0: [(0, 1), (1,), (), (0, 2), (2,), (1, 2)], 1: [(0, 1), (0, 2), (1, 2)]}
_ACCEPTED = {0: "11SD, B1SD or BNSD for x as BNSD (BSND: 1S1D, BS1D, BSND; SBND: S11D, SB1D, SBND)",
             1: "11SD for x as BNSD (BSND: 1S1D; SBND: S11D)"}
# Where B and N sit in x for the layout a cos/sin shape implies (for the record's B and N constraints).
_BN_AXES = {(0, 1): (0, 1), (1,): (0, 1), (): (0, 1), (0, 2): (0, 2), (2,): (0, 2), (1, 2): (1, 2)}


# --- what can be proved about dims: passes/shapes.py ---------------------------------------------------------
class _ShapeFacts:
    """Dim proofs for the graph one rewrite walk works on, and the walk's shared Unsqueezes of cos/sin.

    One per application of the pass (`rules`), shared by its rules. The rewriter calls every rule's setup()
    before a walk (reset) and each check() before the rewrite it guards, so the first check of a walk sees
    the graph before this pass changed anything: the weight-less snapshot for symbolic shape inference is
    taken then, and inferred only if some comparison needs it. Unbound (no check ran), it knows the IR's dims.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._graph = None
        self._snapshot = None
        self._symbolic: dict[str, list] | None = None
        self.unsqueezed: dict[int, ir.Value] = {}  # id(cos or sin) -> its Unsqueeze to rank 4

    def bind(self, model: ir.Model) -> None:
        if self._graph is not model.graph:
            self.reset()
            self._graph = model.graph
            self._snapshot = _snapshot(model)

    def _sym(self, value: ir.Value, k: int):
        if self._symbolic is None:
            self._symbolic = _symbolic_shapes(self._snapshot) if self._snapshot is not None else {}
        dims = self._symbolic.get(value.name) if value.name else None
        if dims is None or value.shape is None or len(dims) != value.shape.rank():
            return None
        return dims[k]

    def static(self, value: ir.Value, k: int, deep: bool = True) -> int | None:
        """The dim's size if known; `deep` asks the symbolic shape inference when the IR does not know."""
        d = value.shape[k]
        if isinstance(d, int) or not deep:
            return d if isinstance(d, int) else None
        s = self._sym(value, k)
        return s if isinstance(s, int) else None

    def same(self, v: ir.Value, i: int, w: ir.Value, j: int, deep: bool = True) -> bool:
        a, b = v.shape[i], w.shape[j]
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        if isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and a.value is not None:
            if a.value == b.value:
                return True
        if not deep:
            return False
        sa, sb = self._sym(v, i), self._sym(w, j)
        if sa is None or sb is None:
            return False
        return sa == sb if type(sa) is type(sb) else False


def _rank(value: ir.Value) -> int | None:
    return value.shape.rank() if value.shape is not None else None


def _show(value: ir.Value, k: int | None = None) -> str:
    """The value's shape as text, or dim k's."""
    if value.shape is None:
        return "(rank unknown)"
    dims = [str(d) if isinstance(d, int) else (d.value or "?") for d in value.shape]
    return dims[k] if k is not None else "(" + ", ".join(dims) + ")"


def _cos_layouts(facts: _ShapeFacts, x: ir.Value, c: ir.Value, d: int, mode: int,
                 half: bool = False) -> list[tuple[int, ...]] | str:
    """The accepted 1-positions (see _LAYOUTS) cos/sin value `c` satisfies against x, or why none; `half`: c
    holds D/2 angles (the half-length form)."""
    rank = _rank(c)
    if rank is None or not 1 <= rank <= 4:
        return f"{c.name} is of rank {rank}; RotaryPositionEmbedding takes cos/sin of rank 4 (or fewer, unsqueezed)"
    if facts.static(c, rank - 1) != (d // 2 if half else d):
        wanted = f"{d // 2}, half the rotated size {d}" if half else f"the rotated size {d}"
        return f"{c.name}'s last dim is {_show(c, rank - 1)}, not {wanted}"
    lead = 4 - rank  # axes of x that c broadcasts over implicitly (size 1)
    for deep in (False, True):  # the symbolic shape inference only when the IR's shapes prove nothing
        one = [k < lead or facts.static(c, k - lead, deep) == 1 for k in range(3)]
        match = [k >= lead and (facts.same(c, k - lead, x, k, deep) or (one[k] and facts.static(x, k, deep) == 1))
                 for k in range(3)]
        fits = [ones for ones in _LAYOUTS[mode] if all(one[k] if k in ones else match[k] for k in range(3))]
        if fits:
            return fits
    return (f"{c.name} {_show(c)} against x {_show(x)}: mode {mode} takes cos/sin of {_ACCEPTED[mode]} "
            "(or dims not provably equal to x's)")


def _slice_range(node: ir.Node, rank: int, size: int) -> tuple[int, int, int] | None:
    """(start, stop, step) of a Slice over x's last axis only, normalised to that axis' size; else None."""
    starts, ends = match.ints(match.input_at(node, 1)), match.ints(match.input_at(node, 2))
    axes = match.ints(match.input_at(node, 3)) if match.input_at(node, 3) is not None else None
    steps = match.ints(match.input_at(node, 4)) if match.input_at(node, 4) is not None else [1]
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if (not len(starts) == len(ends) == len(axes) == len(steps) == 1 or not match.last_axis(axes[0], rank)
            or steps[0] < 1):
        return None

    def clamp(v: int) -> int:
        return min(max(v + size if v < 0 else v, 0), size)

    return clamp(starts[0]), clamp(ends[0]), steps[0]


def _count(start: int, stop: int, step: int) -> int:
    return max(0, -(-(stop - start) // step))


def _last_axis(axis: int | None, rank: int) -> bool:
    return axis is not None and match.last_axis(axis, rank)


# --- mode 1's cos/sin: each angle repeated twice along the last axis -------------------------------------------
# RotaryPositionEmbedding mode 1 takes cos/sin with cos[2i] = cos[2i+1] (docs/fused_ops.md); the kernel may read one of
# each pair. That is proved on the graph, never assumed: a value has *repeated pairs* when its last dim is even
# and v[..., 2i] = v[..., 2i+1]. Since the last dim is even, that is the same as flat[2m] = flat[2m+1] in row-major
# order, which every reshape keeps.
_PAIR_UNARY = {"Cos", "Sin", "Cast", "Neg", "Identity", "Sqrt", "Reciprocal", "Exp", "Abs", "Relu", "Sigmoid",
               "Tanh", "Erf", "Floor", "Ceil", "Round", "Sign"}
_PAIR_BINARY = {"Mul", "Add", "Sub", "Div", "Pow", "Max", "Min"}
_PAIR_RESHAPES = {"Reshape", "Squeeze", "Unsqueeze", "Flatten"}
_PAIR_DEPTH = 48


def _last_dim(value: ir.Value, facts: _ShapeFacts) -> int | None:
    rank = _rank(value)
    return None if not rank else facts.static(value, rank - 1)


def _broadcast_over_last(value: ir.Value | None, facts: _ShapeFacts) -> bool:
    """The value is the same along the last axis of the result it takes part in (rank 0, or last dim 1)."""
    if value is None:
        return False
    c = match.const_value(value)
    if c is not None and (c.ndim == 0 or c.shape[-1] == 1):
        return True
    rank = _rank(value)
    return rank == 0 or (rank is not None and facts.static(value, rank - 1) == 1)


def repeated_pairs(value: ir.Value, facts: _ShapeFacts | None = None, memo: dict | None = None,
                   depth: int = _PAIR_DEPTH) -> str | None:
    """None when value[..., 2i] = value[..., 2i+1] is proved from the graph, else why it is not (the value at
    which the proof stopped). The rules: constants are compared; elementwise ops keep the property when each
    operand has it or is constant along the last axis; Expand of a last-dim-1 tensor to an even last dim
    creates it (repeat_interleave: Unsqueeze(-1), Expand(..., 2) or Tile(..., [1, .., 2]), Reshape); a Tile
    of an even last axis keeps it; reshapes to an even last dim, and
    Gather/GatherND/Slice/Split/Transpose/Concat that keep the last axis (or cut it at even offsets) keep it.
    facts: the walk's dim proofs (None: the IR's dims only)."""
    facts = _ShapeFacts() if facts is None else facts
    memo = {} if memo is None else memo
    key = id(value)
    if key not in memo:
        memo[key] = f"{value.name} is too far from where its values are made"  # also breaks cycles
        memo[key] = _repeated_pairs(value, facts, memo, depth)
    return memo[key]


def _repeated_pairs(v: ir.Value, facts: _ShapeFacts, memo: dict, depth: int) -> str | None:
    name = v.name or "a value"
    c = match.const_value(v)
    if c is not None:
        if c.ndim == 0 or c.shape[-1] % 2:
            return f"the constant {name} has an odd last dim"
        return None if np.array_equal(c[..., 0::2], c[..., 1::2]) else \
            f"the constant {name} does not repeat its values in pairs along the last axis"
    last = _last_dim(v, facts)
    if last is None or last % 2:
        return f"{name}'s last dim ({_show(v, _rank(v) - 1) if _rank(v) else '?'}) is not static and even"
    node = v.producer()
    if node is None:
        return f"{name} is a graph input (nothing is known about its values)"
    if not is_default_domain(node.domain):
        return f"{name} is made by {node.domain}::{node.op_type}"
    if depth == 0:
        return f"{name} is too far from where its values are made"
    op, rank_out = node.op_type, _rank(v)

    def rec(x):
        return repeated_pairs(x, facts, memo, depth - 1) if x is not None else f"{op} without an input"

    def keeps_last(axis_attr_or_value, rank):
        return axis_attr_or_value is not None and rank and not match.last_axis(axis_attr_or_value, rank)

    if op in _PAIR_UNARY or op == "CastLike":
        return rec(node.inputs[0])
    if op in _PAIR_BINARY:
        for x in node.inputs:
            if _broadcast_over_last(x, facts):
                continue
            if _last_dim(x, facts) != last:
                return f"{op} {name} broadcasts an operand of last dim {_last_dim(x, facts)} to {last}"
            why = rec(x)
            if why:
                return why
        return None
    if op in _PAIR_RESHAPES:
        return rec(node.inputs[0])  # flat order kept; the output's last dim is even (checked above)
    if op == "Expand":
        if _broadcast_over_last(node.inputs[0], facts):
            return None  # each element copied along an even last axis: repeat_interleave's Expand
        if _last_dim(node.inputs[0], facts) == last:
            return rec(node.inputs[0])
        return f"Expand {name} repeats its input's last axis as a whole (tile), not element by element"
    if op == "Tile":
        # out[..., j] = in[..., j mod L] (L = the input's last dim; the other axes copy whole slices). L = 1: each
        # element copied along the (even) last axis, repeat_interleave as TorchScript writes it (Unsqueeze(-1),
        # Tile by [1, .., 1, 2], Reshape merging the last two axes). An even L: out's pairs are the input's.
        src = node.inputs[0]
        if _broadcast_over_last(src, facts):
            return None
        size = _last_dim(src, facts)
        shown = _show(src, _rank(src) - 1) if _rank(src) else "?"
        if size is None or size % 2:
            return f"Tile {name} repeats its input's last axis (of size {shown}) as a whole, not element by element"
        why = rec(src)
        if why:
            return (f"Tile {name} copies whole rows of its input (last dim {shown}) instead of repeating each "
                    f"element, and the input's pairs are not proved: {why}")
        return None
    if op == "Transpose":
        if match.perm(node, rank_out)[-1] != rank_out - 1:
            return f"Transpose {name} moves the last axis"
        return rec(node.inputs[0])
    if op == "Gather":
        data, idx = node.inputs[0], node.inputs[1]
        r = _rank(data)
        if keeps_last(node.attributes.get_int("axis", 0), r):
            return rec(data)
        ids = match.const_value(idx)
        if ids is not None and ids.ndim and ids.shape[-1] % 2 == 0 and np.array_equal(ids[..., 0::2], ids[..., 1::2]):
            return None
        return f"Gather {name} indexes the last axis by indices not repeated in pairs"
    if op == "GatherND":
        data, idx = node.inputs[0], node.inputs[1]
        r, k = _rank(data), _last_dim(idx, facts)
        if node.attributes.get_int("batch_dims", 0) == 0 and r and k is not None and k < r:
            return rec(data)
        return f"GatherND {name} indexes the last axis"
    if op == "Slice":
        r = _rank(node.inputs[0])
        axes = match.ints(match.input_at(node, 3)) if match.input_at(node, 3) is not None else \
            (list(range(len(match.ints(match.input_at(node, 1)) or []))) if match.input_at(node, 1) is not None
             else None)
        if axes is None or not r:
            return f"Slice {name}'s axes are not constant"
        if all(a % r != r - 1 for a in axes):
            return rec(node.inputs[0])
        size = _last_dim(node.inputs[0], facts)
        rng = _slice_range(node, r, size) if size is not None else None
        if rng is None or rng[2] != 1 or rng[0] % 2:
            return f"Slice {name} cuts the last axis at an odd offset or with a step"
        return rec(node.inputs[0])
    if op == "Split":
        r = _rank(node.inputs[0])
        if keeps_last(node.attributes.get_int("axis", 0), r):
            return rec(node.inputs[0])
        k = list(node.outputs).index(v)
        sizes = [_last_dim(o, facts) for o in node.outputs[:k]]
        if any(s is None or s % 2 for s in sizes):
            return f"Split {name} cuts the last axis at an odd offset"
        return rec(node.inputs[0])
    if op == "Concat":
        # On another axis the parts keep the last axis; on the last axis each part has an even last dim (rec
        # checks it), so the parts' pairs are the result's.
        parts = list(node.inputs)
        for x in parts:
            why = rec(x)
            if why:
                if not keeps_last(node.attributes.get_int("axis", 0), rank_out) and len(parts) > 1 and \
                        all(p is parts[0] for p in parts):
                    return (f"{name} is Concat({parts[0].name}, {parts[0].name}) on the last axis: the rotate_half "
                            "(mode 0) layout cat(f, f), not the interleaved one")
                return why
        return None
    if op == "MatMul":
        b = node.inputs[1]
        if _rank(b) is not None and _rank(b) >= 2:
            return rec(b)
        return f"MatMul {name} by a vector"
    if op == "Where":
        for x in node.inputs[1:]:
            if not _broadcast_over_last(x, facts):
                why = rec(x)
                if why:
                    return why
        cond = node.inputs[0]
        return None if _broadcast_over_last(cond, facts) else rec(cond)
    return f"{name} is made by {op}, which the proof does not follow"


class _RopeFusion(pattern.RewriteRuleClassBase):
    mode = 0
    half_length = False  # cos/sin of D/2 angles (the half-length form below)

    def __init__(self, name: str, facts: _ShapeFacts):
        super().__init__(name)
        self._facts = facts  # shared by the rules of one application (rules())

    def setup(self):
        self._facts.reset()

    def rotation(self, op, x):
        raise NotImplementedError

    def check_rotation(self, x: ir.Value, d: int, bindings: dict) -> str | None:
        """Why the matched rotation is not exactly rot(x) of this mode (None when it is)."""
        raise NotImplementedError

    def pattern(self, op, x, cos, sin):
        return op.Add(op.Mul(x, cos), op.Mul(self.rotation(op, x), sin))

    def rotated(self, x: ir.Value, bindings: dict) -> tuple[ir.Value, int | None, str | None]:
        """(a 4-D value with x's leading dims, the rotated size D, why not): x itself, its last dim."""
        return x, self._facts.static(x, 3) if _rank(x) == 4 else None, None

    def check(self, context, x, cos, sin, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        facts = self._facts
        facts.bind(context.model)
        x, d, why = self.rotated(x, bindings)
        if why:
            return result.fail(why, x)
        if _rank(x) != 4:
            return result.fail(f"x {x.name} is of rank {_rank(x)}; RotaryPositionEmbedding takes a 4-D x", x)
        if match.opset(context) < 11:
            return result.fail("below opset 11 the reference body cannot be written (it needs Range)", x)
        if d is None:
            return result.fail(f"the rotated size (x's last dim) of {x.name} is not static", x)
        why = _broken(context.model, x, {}, d, self.mode)
        if why:
            return result.fail(why, x)
        if x.dtype not in match.FLOATS or cos.dtype != x.dtype or sin.dtype != x.dtype:
            return result.fail(f"dtypes x={x.dtype}, cos={cos.dtype}, sin={sin.dtype}: RotaryPositionEmbedding "
                               "takes one of fp16/bf16/fp32 for all three", x)
        if not match.float_guard(context, result, x, "RotaryPositionEmbedding"):
            return result
        why = self.check_rotation(x, d, bindings)
        if why:
            return result.fail(why, x)
        fits = []
        for c in (cos, sin):
            f = _cos_layouts(facts, x, c, d, self.mode, self.half_length)
            if isinstance(f, str):
                return result.fail(f, c)
            fits.append(f)
        common = [ones for ones in fits[0] if ones in fits[1]]
        if not common:
            return result.fail(f"cos {_show(cos)} and sin {_show(sin)} broadcast to x differently", cos)
        why = _broken(context.model, x, dict(zip("BN", _BN_AXES[common[0]])), d, self.mode)
        if why:
            return result.fail(why, x)
        if self.mode == 1:
            memo: dict = {}
            for c in (cos, sin):
                why = repeated_pairs(c, facts, memo)
                if why:
                    return result.fail(f"mode 1 takes cos/sin that repeat each angle twice (cos[2i] = cos[2i+1]); "
                                       f"not provable for {c.name}: {why}", c)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        shared = self._facts.unsqueezed
        if self.half_length:  # cat(cos, cos): the rotate_half layout of the same angles
            cos, sin = (_doubled(op, c, shared) for c in (cos, sin))
        return op.RotaryPositionEmbedding(x, _rank4(op, cos, shared), _rank4(op, sin, shared), mode=self.mode,
                                          _domain="mindspore")


def _broken(model: ir.Model, x: ir.Value, axes: dict[str, int], d: int, mode: int, n: int | None = None) -> str | None:
    """The refusal of the first of the record's constraints that x's largest sizes break (B and N at `axes` of
    x, or N given; D the rotated size), or None."""
    sizes, shown = dim_bounds.sizes(model, x, axes)
    sizes["D"], shown["D"] = d, f"D={d}"
    if n is not None:
        sizes["N"], shown["N"] = n, f"N={n}"
    c = ROTARY_POSITION_EMBEDDING.broken(sizes, {"mode": mode})
    return dim_bounds.refusal("RotaryPositionEmbedding", c, shown) if c else None


def _int64s(op, *values: int) -> ir.Value:
    """A Constant of the int64 vector `values` (a rewrite's starts, ends, axes, shapes)."""
    return op.Constant(value=ir.tensor(np.array(values, dtype=np.int64)))


def _rank4(op, value: ir.Value, unsqueezed: dict[int, ir.Value]) -> ir.Value:
    """`value` unsqueezed to rank 4 at the front (numpy broadcasting reads it that way already); one
    Unsqueeze per value and walk, shared by the fused nodes after the first (the walk goes in graph order)."""
    rank = _rank(value)
    if rank == 4:
        return value
    key = id(value)
    if key not in unsqueezed:
        axes = op.Constant(value=ir.tensor(np.arange(4 - rank, dtype=np.int64), name=None))
        unsqueezed[key] = op.Unsqueeze(value, axes)
    return unsqueezed[key]


class RotateHalfSlices(_RopeFusion):
    """rot = Concat(Neg(x[..., D/2:]), x[..., :D/2]) with two Slices."""

    def rotation(self, op, x):
        x1 = op.Slice(x, _allow_other_inputs=True, _outputs=["x1"])
        x2 = op.Slice(x, _allow_other_inputs=True, _outputs=["x2"])
        return op.Concat(op.Neg(x2), x1, _outputs=["rot"])

    def check_rotation(self, x, d, b):
        return _halves_by_slices(b, d) or _joined_on_last_axis(b, "(-x2, x1)")


def _halves_by_slices(b: dict, d: int) -> str | None:
    h = d // 2
    if _slice_range(b["x1"].producer(), 4, d) != (0, h, 1):
        return f"the Slice giving x1 does not take x[..., :{h}] (the first half of the last axis)"
    if _slice_range(b["x2"].producer(), 4, d) != (h, d, 1):
        return f"the Slice giving x2 does not take x[..., {h}:] (the second half of the last axis)"
    return None


class RotateHalfSplit(_RopeFusion):
    """rot = Concat(Neg(x2), x1) with x1, x2 = Split(x, 2 halves, last axis)."""

    def rotation(self, op, x):
        x1, x2 = op.Split(x, _allow_other_inputs=True, _outputs=["x1", "x2"])
        return op.Concat(op.Neg(x2), x1, _outputs=["rot"])

    def check_rotation(self, x, d, b):
        return _halves_by_split(b, d) or _joined_on_last_axis(b, "(-x2, x1)")


def _halves_by_split(b: dict, d: int) -> str | None:
    split = b["x1"].producer()
    if not _last_axis(split.attributes.get_int("axis", 0), 4):
        return "the Split is not over the last axis"
    sizes = match.input_at(split, 1)
    if sizes is not None and sizes.name:
        if match.ints(sizes) != [d // 2, d // 2]:
            return f"the Split does not cut the last axis into halves (split {match.ints(sizes)})"
    elif split.attributes.get_int("num_outputs", 2) != 2:
        return "the Split does not cut the last axis into two halves"
    return None


class HalfLengthSlices(_RopeFusion):
    """The half-length form (transformers 5's gpt-oss and DeepSeek): cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    with cos/sin of D/2 angles, x1 = x[..., :D/2], x2 = x[..., D/2:] by two Slices. It is rotate_half's
    x * cat(cos, cos) + rot(x) * cat(sin, sin), which the rewrite gives RotaryPositionEmbedding (mode 0)."""

    half_length = True

    def halves(self, op, x):
        return op.Slice(x, _allow_other_inputs=True, _outputs=["x1"]), \
            op.Slice(x, _allow_other_inputs=True, _outputs=["x2"])

    def pattern(self, op, x, cos, sin):
        x1, x2 = self.halves(op, x)
        return op.Concat(op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin)),
                         _outputs=["rot"])

    def check_rotation(self, x, d, b):
        if _pairs_by_slices(b, d):  # DeepSeek-V3's rope_interleave: de-interleaved by the rewrite
            return _joined_on_last_axis(b, HALF_LENGTH_PARTS)
        return _halves_by_slices(b, d) or _joined_on_last_axis(b, HALF_LENGTH_PARTS)

    def rewrite(self, op, x, cos, sin, x1=None, x2=None, **kw):
        """With pairs (x1 = x[..., 0::2], x2 = x[..., 1::2]: transformers' apply_rotary_pos_emb_interleave, whose
        output is in the de-interleaved order), the rotation is rotate_half's of cat(x1, x2), which is given to
        RotaryPositionEmbedding instead of x: the same numbers, no mode 1 (which needs cos[2i] = cos[2i+1])."""
        d = x.shape[3]
        if x1 is not None and _pairs_by_slices({"x1": x1, "x2": x2}, d):
            pairs = [op.Slice(x, *(_int64s(op, v) for v in (start, d, -1, 2))) for start in (0, 1)]  # (the matched
            for half in pairs:                                                                   # ones go)
                half.shape, half.dtype = ir.Shape([*list(x.shape)[:3], d // 2]), x.dtype
            deinterleaved = op.Concat(*pairs, axis=-1)
            deinterleaved.shape, deinterleaved.dtype = x.shape, x.dtype
            x = deinterleaved
        return super().rewrite(op, x, cos, sin, **kw)


def _pairs_by_slices(b: dict, d: int) -> bool:
    """Whether the Slices giving x1 and x2 take x[..., 0::2] and x[..., 1::2] (interleaved pairs)."""
    x1, x2 = b["x1"].producer(), b["x2"].producer()
    return x1 is not None and x2 is not None and x1.op_type == x2.op_type == "Slice" and \
        _slice_range(x1, 4, d) == (0, d, 2) and _slice_range(x2, 4, d) == (1, d, 2)


class HalfLengthSplit(HalfLengthSlices):
    """The same with x1, x2 = Split(x, 2 halves, last axis)."""

    def halves(self, op, x):
        return op.Split(x, _allow_other_inputs=True, _outputs=["x1", "x2"])

    def check_rotation(self, x, d, b):
        return _halves_by_split(b, d) or _joined_on_last_axis(b, HALF_LENGTH_PARTS)


HALF_LENGTH_PARTS = "(x1 * cos - x2 * sin, x2 * cos + x1 * sin)"


class StackedPairs(_RopeFusion):
    """Llama 4's rotary as graphconv exports it (graphconv/frontend/export_rewrites.py: its complex product on
    real pairs): the pairs (a, b) = x viewed as (..., D/2, 2), Gathers 0 and 1 of the last axis; the result
    stack(a * cos - b * sin, a * sin + b * cos) on a new last axis, with cos/sin of D/2 angles. That is the
    half-length form of the de-interleaved cat(a, b) with its halves stacked back into pairs, which the
    rewrite writes around RotaryPositionEmbedding (mode 0; mode 1 would take cos/sin of one row of positions
    only, 11SD, where Llama 4's are per row)."""

    half_length = True

    def pattern(self, op, x, cos, sin):
        a = op.Gather(x, _allow_other_inputs=True, _outputs=["a"])
        b = op.Gather(x, _allow_other_inputs=True, _outputs=["b"])
        real = op.Unsqueeze(op.Sub(op.Mul(a, cos), op.Mul(b, sin)), _allow_other_inputs=True, _outputs=["real"])
        imag = op.Unsqueeze(op.Add(op.Mul(a, sin), op.Mul(b, cos)), _allow_other_inputs=True, _outputs=["imag"])
        return op.Concat(real, imag, _outputs=["rot"])

    def rotated(self, x, bindings):
        a, b = bindings["a"], bindings["b"]
        if _rank(x) != 5 or self._facts.static(x, 4) != 2:
            return a, None, f"{x.name} is not a 5-D view of pairs (…, D/2, 2)"
        for value, index in ((a, 0), (b, 1)):
            gather = value.producer()
            if not _last_axis(gather.attributes.get_int("axis", 0), 5) or match.ints(gather.inputs[1]) != [index]:
                return a, None, f"{value.name} is not the pairs' element {index} (a Gather of the last axis)"
        for name in ("real", "imag"):
            axes = match.ints(match.input_at(bindings[name].producer(), 1))
            if axes is None or len(axes) != 1 or not _last_axis(axes[0], 5):
                return a, None, "the rotated pairs are not stacked on a new last axis"
        if not _last_axis(bindings["rot"].producer().attributes.get_int("axis", 0), 5):
            return a, None, "the rotated pairs are not stacked on a new last axis"
        half = self._facts.static(x, 3)
        return a, 2 * half if half is not None else None, None

    def check_rotation(self, x, d, b):
        return None  # (checked by rotated)

    def rewrite(self, op, x, cos, sin, a=None, b=None, **kw):
        half = a.shape[3]
        pairs = [op.Gather(x, op.Constant(value=ir.tensor(np.array(k, np.int64))), axis=-1) for k in (0, 1)]
        for part in pairs:  # (the matched Gathers go with the match)
            part.shape, part.dtype = a.shape, a.dtype
        deinterleaved = op.Concat(*pairs, axis=-1)
        deinterleaved.shape, deinterleaved.dtype = ir.Shape([*list(a.shape)[:3], 2 * half]), a.dtype
        y = super().rewrite(op, deinterleaved, cos, sin, **kw)

        parts = [op.Unsqueeze(op.Slice(y, _int64s(op, lo), _int64s(op, hi), _int64s(op, -1)), _int64s(op, -1))
                 for lo, hi in ((0, half), (half, 2 * half))]
        return op.Concat(*parts, axis=-1)


def _joined_on_last_axis(b: dict, parts: str) -> str | None:
    """Why the Concat bound as `rot` (of `parts`) is not on the last axis, or None."""
    if not _last_axis(b["rot"].producer().attributes.get_int("axis"), 4):
        return f"the Concat of {parts} is not on the last axis"
    return None


def _doubled(op, value: ir.Value, shared: dict) -> ir.Value:
    """cat(value, value) on the last axis, one per value and walk (as _rank4's Unsqueeze)."""
    key = ("doubled", id(value))
    if key not in shared:
        doubled = op.Concat(value, value, axis=-1)
        dims = list(value.shape)
        dims[-1] = 2 * dims[-1]  # (static: checked by _cos_layouts)
        doubled.shape, doubled.dtype = ir.Shape(dims), value.dtype
        shared[key] = doubled
    return shared[key]


class InterleavedSlices(_RopeFusion):
    """GPT-J's rotate_every_two: rot = flatten(stack((-x[..., 1::2], x[..., 0::2]), -1), -2)."""

    mode = 1

    def rotation(self, op, x):
        even = op.Slice(x, _allow_other_inputs=True, _outputs=["even"])
        odd = op.Slice(x, _allow_other_inputs=True, _outputs=["odd"])
        stacked = op.Concat(op.Unsqueeze(op.Neg(odd), _allow_other_inputs=True, _outputs=["neg_odd5"]),
                            op.Unsqueeze(even, _allow_other_inputs=True, _outputs=["even5"]), _outputs=["stacked"])
        return op.Reshape(stacked, self.flat_shape(op, stacked), _outputs=["rot"])

    def flat_shape(self, op, stacked):
        return pattern.ANY_VALUE

    def check_rotation(self, x, d, b):
        h = d // 2
        even = _slice_range(b["even"].producer(), 4, d)
        odd = _slice_range(b["odd"].producer(), 4, d)
        if even is None or even[0] != 0 or even[2] != 2 or _count(*even) != h:
            return "the Slice giving the even elements does not take x[..., 0::2]"
        if odd is None or odd[0] != 1 or odd[2] != 2 or _count(*odd) != h:
            return "the Slice giving the odd elements does not take x[..., 1::2]"
        for name in ("neg_odd5", "even5"):
            unsq = b[name].producer()
            axes = match.ints(match.input_at(unsq, 1)) if match.input_at(unsq, 1) is not None else None
            if axes is None and unsq.attributes.get("axes") is not None:
                axes = list(unsq.attributes.get_ints("axes"))
            if axes is None or len(axes) != 1 or axes[0] % 5 != 4:
                return "the halves are not stacked on a new last axis (Unsqueeze axes)"
        if not _last_axis(b["stacked"].producer().attributes.get_int("axis"), 5):
            return "the halves are not stacked on a new last axis (Concat axis)"
        return _flattens_back(b["rot"], x, d, self._facts)


class InterleavedSlicesFlatten(InterleavedSlices):
    """The same, flattened as TorchScript writes torch.flatten(-2): Reshape(stacked, Concat(Shape(stacked)[:3],
    [-1])). The shape arithmetic reads `stacked` a second time, so it must be part of the pattern."""

    def flat_shape(self, op, stacked):
        lead = op.Slice(op.Shape(stacked, _outputs=["stacked_shape"]), _allow_other_inputs=True, _outputs=["lead"])
        return op.Concat(lead, pattern.ANY_VALUE, _outputs=["flat_shape"])


def _flattens_back(rot: ir.Value, x: ir.Value, d: int, facts: _ShapeFacts) -> str | None:
    """The Reshape of the stacked (..., D/2, 2) back to x's shape: its target is [0, 0, 0, D or -1] (copying
    dims), or Concat(Shape(stacked)[:3], [D or -1]), or its output's dims are provably x's. Each merges the last
    two axes, in row-major order."""
    reshape = rot.producer()
    target = match.ints(match.input_at(reshape, 1))
    allowzero = reshape.attributes.get_int("allowzero", 0)
    if target is not None and len(target) == 4:
        lead_ok = all((t == 0 and not allowzero) or t == facts.static(x, k) for k, t in enumerate(target[:3]))
        if lead_ok and target[3] in (d, -1):
            return None
    if _leading_dims_then(reshape.inputs[1], reshape.inputs[0], d):
        return None
    if _rank(rot) == 4 and all(facts.same(rot, k, x, k) for k in range(4)):
        return None
    return f"the Reshape after the stack does not provably give x's shape {_show(x)} (it gives {_show(rot)})"


def _leading_dims_then(target: ir.Value, stacked: ir.Value, d: int) -> bool:
    """target = Concat(Slice(Shape(stacked), 0, 3), [D or -1]): stacked's first three dims, then the rest."""
    concat = target.producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return False
    if concat.attributes.get_int("axis") != 0:
        return False
    if match.ints(concat.inputs[1]) not in ([d], [-1]):
        return False
    lead = concat.inputs[0].producer()
    if lead is None or lead.op_type != "Slice":
        return False
    shape = lead.inputs[0].producer()
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not stacked:
        return False
    if shape.attributes.get_int("start", 0) != 0 or shape.attributes.get("end") is not None:
        return False
    starts, ends = match.ints(match.input_at(lead, 1)), match.ints(match.input_at(lead, 2))
    axes = match.ints(match.input_at(lead, 3)) if match.input_at(lead, 3) is not None else [0]
    steps = match.ints(match.input_at(lead, 4)) if match.input_at(lead, 4) is not None else [1]
    return starts == [0] and ends in ([3], [-2]) and axes in ([0], [-1]) and steps == [1]


class NativeRotaryEmbedding(pattern.RewriteRuleClassBase):
    """Opset 23's RotaryEmbedding(x, cos, sin[, position_ids]; interleaved, rotary_embedding_dim, num_heads).

    ONNX (onnx.reference's rotary_embedding) rotates x[..., :R] (R = rotary_embedding_dim, 0: the head dim D) and
    passes the rest through; cos/sin are (B, S, R/2), or caches (max_pos, R/2) indexed by position_ids (B, S).
    Halves (interleaved=0): [x1*c - x2*s, x2*c + x1*s], which is mode 0 with cos/sin widened to concat(c, c);
    pairs (interleaved=1): out[2i] = x[2i]*c_i - x[2i+1]*s_i, out[2i+1] = x[2i+1]*c_i + x[2i]*s_i, which is mode 1
    with cos/sin widened to repeat_interleave(c, 2) (cos[2i] = cos[2i+1] by construction). x is 4-D (B, N, S, D),
    the widened cos/sin get the head axis: (B, 1, S, R); or 3-D (B, S, N*D) with num_heads, viewed as BSND
    (B, S, N, D) around the fused node, cos/sin (B, S, 1, R). Partial rotation: Slice, fused node, Concat with the
    pass-through part. Mode 1 takes 11SD / 1S1D cos only: B (of cos, or of position_ids) must be static 1.
    """

    def __init__(self, name: str, with_positions: bool):
        super().__init__(name)
        self._positions = with_positions

    def pattern(self, op, x, cos, sin, position_ids):
        if self._positions:
            return op.RotaryEmbedding(x, cos, sin, position_ids, _outputs=["y"])
        return op.RotaryEmbedding(x, cos, sin, _outputs=["y"])

    def check(self, context, x, cos, sin, y, position_ids=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        attrs = y.producer().attributes
        interleaved = attrs.get_int("interleaved", 0)
        rank = _rank(x)
        if rank not in (3, 4):
            return result.fail(f"RotaryEmbedding on a rank-{rank} x; 4-D (B, N, S, D) or 3-D (B, S, N*D) is fused", x)
        heads = attrs.get_int("num_heads", 0)
        if rank == 3:
            hidden = x.shape[2]
            if not heads or not isinstance(hidden, int) or hidden % heads:
                return result.fail(f"a 3-D x {_show(x)} needs num_heads dividing a static hidden size", x)
            d = hidden // heads
        else:
            d = x.shape[3]
        if not isinstance(d, int):
            return result.fail(f"the head dim of {x.name} is not static", x)
        r = attrs.get_int("rotary_embedding_dim", 0) or d
        if r > d:
            return result.fail(f"rotary_embedding_dim {r} exceeds the head dim {d}", x)
        why = _broken(context.model, x, {}, r, interleaved)
        if why:
            return result.fail(why, x)
        if x.dtype not in match.FLOATS:
            return result.fail(f"dtype {x.dtype}: RotaryPositionEmbedding takes fp16/bf16/fp32", x)
        for c in (cos, sin):
            want = 2 if self._positions else 3
            if _rank(c) != want or c.shape[want - 1] != r // 2:
                shape = f"(max_pos, {r // 2})" if self._positions else f"(B, S, {r // 2})"
                return result.fail(f"cos/sin {c.name} {_show(c)} is not {shape}", c)
            if c.dtype != x.dtype:
                return result.fail(f"dtypes x={x.dtype}, {c.name}={c.dtype}", c)
        if self._positions and (_rank(position_ids) != 2 or position_ids.dtype != ir.DataType.INT64):
            return result.fail("position_ids is not a 2-D int64 (B, S)", position_ids)
        batch = (position_ids if self._positions else cos).shape[0]
        if interleaved and batch != 1:
            where = "position_ids" if self._positions else "cos/sin"
            return result.fail(f"interleaved: mode 1 takes cos/sin of 11SD (1S1D) only, and the batch of {where} "
                               f"is {batch if isinstance(batch, int) else 'not static'}, not 1", x)
        why = _broken(context.model, x, {"B": 0, "N": 1}, r, interleaved) if rank == 4 else \
            _broken(context.model, x, {"B": 0}, r, interleaved, n=heads)
        if why:
            return result.fail(why, x)
        return match.float_guard(context, result, x, "RotaryPositionEmbedding")

    def rewrite(self, op, x, cos, sin, y, position_ids=None, **_):
        attrs = y.producer().attributes
        interleaved = attrs.get_int("interleaved", 0)
        rank = _rank(x)

        def ints(*values):
            return _int64s(op, *values)

        if rank == 3:
            heads = attrs.get_int("num_heads", 0)
            d = x.shape[2] // heads
            x4 = op.Reshape(x, ints(0, 0, heads, d))  # (B, S, N, D): BSND
            head_axis = 2
        else:
            d, x4, head_axis = x.shape[3], x, 1
        r = attrs.get_int("rotary_embedding_dim", 0) or d
        full = []
        for c in (cos, sin):
            if self._positions:
                c = op.Gather(c, position_ids, axis=0)  # (B, S, R/2)
            if interleaved:  # repeat_interleave(c, 2, -1)
                last = ints(-1)
                c = op.Reshape(op.Concat(op.Unsqueeze(c, last), op.Unsqueeze(c, last), axis=-1), ints(0, 0, r))
            else:
                c = op.Concat(c, c, axis=-1)
            full.append(op.Unsqueeze(c, ints(head_axis)))
        x_rot = op.Slice(x4, ints(0), ints(r), ints(-1)) if r < d else x4
        out = op.RotaryPositionEmbedding(x_rot, full[0], full[1], mode=1 if interleaved else 0, _domain="mindspore")
        if r < d:
            out = op.Concat(out, op.Slice(x4, ints(r), ints(d), ints(-1)), axis=-1)
        if rank == 3:
            out = op.Reshape(out, op.Shape(x))
        return out


def rules() -> pattern.RewriteRuleSet:
    """The pass's rules, new for each application (why: passes.manager.rewrite_pass), sharing its dim
    proofs."""
    facts = _ShapeFacts()
    return pattern.RewriteRuleSet([
        RotateHalfSlices.rule("RoPE-rotate-half-slices", facts), RotateHalfSplit.rule("RoPE-rotate-half-split", facts),
        InterleavedSlices.rule("RoPE-interleaved-slices", facts),
        InterleavedSlicesFlatten.rule("RoPE-interleaved-slices-flatten", facts),
        HalfLengthSlices.rule("RoPE-half-length-slices", facts), HalfLengthSplit.rule("RoPE-half-length-split", facts),
        StackedPairs.rule("RoPE-stacked-pairs", facts),
        NativeRotaryEmbedding.rule("RoPE-native-opset23", False),
        NativeRotaryEmbedding.rule("RoPE-native-opset23-position-ids", True)], commute=True)


def split_merged_rotations(model: ir.Model) -> None:
    """onnxsim merges a Concat into the Concat that reads it: DeepSeek's query cat(q_pass, cat(x1*cos - x2*sin,
    x2*cos + x1*sin)) becomes one Concat(q_pass, Sub, Add), where the half-length form is no longer a node of its
    own. Each such consecutive (Sub, Add) pair of products on a Concat's last axis is made its own Concat again
    (concatenation is associative: the same values), for the rules and the coverage to see."""
    for node in list(model.graph):
        if not (is_default_domain(node.domain) and node.op_type == "Concat" and len(node.inputs) > 2):
            continue
        rank = node.outputs[0].shape.rank() if node.outputs[0].shape is not None else None
        if rank is None or not _last_axis(node.attributes.get_int("axis"), rank):
            continue
        pair = coverage.rotation_pair(node)
        if pair is None:
            continue
        inputs = list(node.inputs)
        # (the inner one keeps the name: it is the coverage's candidate, fused or refused)
        inner = ir.node("Concat", inputs[pair:pair + 2], attributes={"axis": -1}, name=node.name)
        dims = list(inputs[pair].shape) if inputs[pair].shape is not None else None
        if dims is not None and all(isinstance(d, int) for d in (dims[-1], inputs[pair + 1].shape[-1])):
            dims[-1] = dims[-1] + inputs[pair + 1].shape[-1]
            inner.outputs[0].shape = ir.Shape(dims)
        inner.outputs[0].dtype = inputs[pair].dtype
        inner.outputs[0].name = f"{node.outputs[0].name}_rotation"
        outer = ir.node("Concat", [*inputs[:pair], inner.outputs[0], *inputs[pair + 2:]],
                        attributes={"axis": node.attributes.get_int("axis")}, name=f"{node.name}_outer")
        outer.outputs[0].shape, outer.outputs[0].dtype = node.outputs[0].shape, node.outputs[0].dtype
        model.graph.insert_before(node, [inner, outer])
        name = node.outputs[0].name
        node.outputs[0].replace_all_uses_with(outer.outputs[0], replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
        outer.outputs[0].name = name


PASS = rewrite_pass("fuse-rope", "rotary embedding application x*cos + rot(x)*sin (rotate_half, interleaved, "
                    "partial) -> mindspore::RotaryPositionEmbedding", rules, candidates=coverage.rotary_candidates,
                    prepare=split_merged_rotations)


# --- fusion coverage: why a rotary candidate was left ----------------------------------------------------------



def _sliced_from(value: ir.Value | None) -> ir.Value | None:
    """x when `value` is a Slice or Split output of x (through shape-only ops), else None."""
    while value is not None:
        node = value.producer()
        if node is None or not is_default_domain(node.domain):
            return None
        if node.op_type in ("Slice", "Split"):
            return node.inputs[0]
        if node.op_type not in match.SHAPE_ONLY:
            return None
        value = node.inputs[0]
    return None


def _concat_of(neg: ir.Node) -> tuple[ir.Node, ir.Value, bool] | None:
    """(the Concat the Neg reaches, the Concat input it reaches through, whether an Unsqueeze is on the way)."""
    frontier = [(neg.outputs[0], False)]
    for _ in range(3):
        nxt = []
        for value, unsqueezed in frontier:
            for use in value.uses():
                node = use.node
                if not is_default_domain(node.domain):
                    continue
                if node.op_type == "Concat":
                    return node, value, unsqueezed
                if node.op_type in match.SHAPE_ONLY:
                    nxt.append((node.outputs[0], unsqueezed or node.op_type == "Unsqueeze"))
        frontier = nxt
    return None


def _explain_neg(neg: ir.Node) -> str | None:
    found = _concat_of(neg)
    if found is None:
        return None
    concat, via, stacked = found
    x = _sliced_from(neg.inputs[0])
    if x is None:
        return "the negated value is not a Slice or Split of the rotated tensor (rot(x) takes halves or pairs of x)"
    parts = list(concat.inputs)
    if len(parts) != 2:
        return f"the Concat of the rotation joins {len(parts)} parts, not (-x2, x1)"
    if parts[1] is via:
        if stacked:
            return ("stack(x[..., 0::2], -x[..., 1::2]) is the inverse rotation: rotate_every_two is "
                    "stack(-x[..., 1::2], x[..., 0::2])")
        return "concat(x1, -x2) is the inverse rotation: rotate_half is concat(-x2, x1)"
    if _sliced_from(parts[1]) is not x:
        return "the two halves of the rotation come from different tensors"
    rot = concat.outputs[0]
    if stacked:
        flat = match.users(rot, "Reshape", "Flatten")
        if not flat:
            return "the stacked pairs are not flattened back to x's shape (no Reshape after the stack)"
        rot = flat[0].outputs[0]
    muls = match.users(rot, "Mul")
    if not muls:
        return "rot(x) is not multiplied by a sin: there is no x * cos + rot(x) * sin around this rotation"
    for mul in muls:
        for combine in match.users(mul.outputs[0], "Add", "Sub"):
            other = next((v for v in combine.inputs if v is not mul.outputs[0]), None)
            if combine.op_type == "Sub":
                return "x * cos - rot(x) * sin (a Sub): not RoPE's x * cos + rot(x) * sin"
            p = match.producer(other, "Mul")
            if p is None:
                made = other.producer() if other is not None else None
                return f"rot(x) * sin is added to {made.op_type if made else 'a graph input'}, not to x * cos"
            if x not in p.inputs:
                return "x * cos multiplies another tensor than the one rotated"
            return None  # the whole application is there: the rules' checks give the reasons
    return "rot(x) * sin is not added to x * cos"


def explain(node: ir.Node) -> str | None:
    """Why a rotary candidate (passes/coverage.py: a Neg reaching a Concat, an opset-23 RotaryEmbedding, a
    half-length Concat) was not fused, read from the graph around it (asked only when no check recorded a reason)."""
    if node.op_type == "Neg":
        return _explain_neg(node)
    if node.op_type == "RotaryEmbedding":
        return None  # every RotaryEmbedding matches a rule: its check gives the reason
    if node.op_type == "Concat" and coverage.stacked_rotation(node):
        return ("the stacked products are not stack(a * cos - b * sin, a * sin + b * cos) of Gathers 0 and 1 of the "
                "pairs' last axis (Llama 4's form)")
    if node.op_type == "Concat" and match.producer(node.inputs[0], "Add") is not None:
        return "cat(x1 * cos + x2 * sin, x2 * cos - x1 * sin) is the inverse rotation: RoPE's half-length form is " \
               "cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)"
    return None  # (a half-length Concat in RoPE's order: the rules' checks give the reasons)


coverage.set_explain("rotary", explain)
