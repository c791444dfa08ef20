"""fuse-rope: every spelling fuses once per rotated tensor and the fused graph equals the unfused one; cos/sin
shapes RotaryPositionEmbedding refuses and near misses don't fuse (with the reason reported); on real exports
the ascend MindIR holds one RotaryPositionEmbedding per rotated q and k, with the mode the fusion extracted, and
its cpu twin verifies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import onnx_ir as ir
import opmap.fused
import passes
from fusion_utils import assert_same_numerics, fuse, fused_nodes, mindir_primitive_inputs
from graphconv.verify import reference

D = 16
N = 4
INT64_MAX = np.iinfo(np.int64).max


# --- hand-built graphs --------------------------------------------------------------------------------------
class _G:
    """A small graph under construction: nodes, initializers, inputs."""

    def __init__(self, opset: int):
        self.opset, self.nodes, self.inits, self.inputs, self.k = opset, [], [], [], 0

    def const(self, values, dtype=np.int64) -> str:
        self.k += 1
        name = f"c{self.k}"
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype), name))
        return name

    def node(self, op, inputs, **attrs) -> str:
        self.k += 1
        out = f"{op.lower()}{self.k}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n_{out}", **attrs))
        return out

    def input(self, name, elem, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def slice(self, x, start, end, axis=-1, step=None) -> str:
        ins = [x, self.const([start]), self.const([end]), self.const([axis])]
        if step is not None:
            ins.append(self.const([step]))
        return self.node("Slice", ins)

    def unsqueeze(self, x, axes) -> str:
        if self.opset >= 13:
            return self.node("Unsqueeze", [x, self.const(axes)])
        return self.node("Unsqueeze", [x], axes=list(axes))

    def model(self, output, elem, shape) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "rope", self.inputs, [helper.make_tensor_value_info(output, elem, shape)],
                              self.inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])


def _rotation(g: _G, x: str, form: str, d: int, axis: int = -1) -> str:
    h = d // 2
    if form in ("slices", "slices-neg-start", "wrong-direction", "slice-other-axis"):
        axis = 2 if form == "slice-other-axis" else axis
        x1 = g.slice(x, 0, h, axis, step=1)
        x2 = g.slice(x, -h if form == "slices-neg-start" else h, INT64_MAX, axis)
        if form == "wrong-direction":  # concat(-x1, x2): the rotation the other way round
            return g.node("Concat", [g.node("Neg", [x1]), x2], axis=-1)
        return g.node("Concat", [g.node("Neg", [x2]), x1], axis=axis)
    if form == "split":
        if g.opset >= 18:
            x1, x2 = f"split_a{g.k}", f"split_b{g.k}"
            g.nodes.append(helper.make_node("Split", [x], [x1, x2], axis=axis, num_outputs=2))
        else:
            x1, x2 = f"split_a{g.k}", f"split_b{g.k}"
            g.nodes.append(helper.make_node("Split", [x, g.const([h, h])], [x1, x2], axis=axis))
        return g.node("Concat", [g.node("Neg", [x2]), x1], axis=-1)
    if form in ("interleaved", "interleaved-shape", "interleaved-flatten", "interleaved-wrong-order"):
        even = g.slice(x, 0, INT64_MAX, -1, step=2)
        odd = g.slice(x, 1, INT64_MAX, -1, step=2)
        pair = [g.unsqueeze(g.node("Neg", [odd]), [-1]), g.unsqueeze(even, [-1])]
        if form == "interleaved-wrong-order":
            pair = [g.unsqueeze(even, [-1]), g.unsqueeze(g.node("Neg", [odd]), [-1])]
        stacked = g.node("Concat", pair, axis=-1)
        if form == "interleaved-shape":  # x's own shape
            target = g.node("Shape", [x])
        elif form == "interleaved-flatten":  # TorchScript's flatten(-2): stacked's first three dims, then -1
            lead = g.node("Slice", [g.node("Shape", [stacked]), g.const([0]), g.const([3]), g.const([0])])
            target = g.node("Concat", [lead, g.const([-1])], axis=0)
        else:
            target = g.const([0, 0, 0, -1])
        return g.node("Reshape", [stacked, target])
    raise ValueError(form)


def _positions_freqs(g: _G, x: str, seq_axis: int, d: int) -> str:
    """(seq, d/2) angles: positions 0..seq-1 from x's shape times inv_freq (transformers' default)."""
    seq = g.node("Gather", [g.node("Shape", [x]), g.const(seq_axis)], axis=0)
    pos = g.node("Cast", [g.node("Range", [g.const(0), seq, g.const(1)])], to=TensorProto.FLOAT)
    inv_freq = g.const(1.0 / 10000 ** (np.arange(0, d, 2) / d), np.float32)
    return g.node("Mul", [g.unsqueeze(pos, [1]), inv_freq])


def _repeat_interleave(g: _G, f: str, width: int, form: str = "expand") -> str:
    """repeat_interleave(f, 2, -1) of a (seq, width) f as the exporters write it: Unsqueeze(-1), Expand of the new
    axis to 2, Reshape merging the last two axes (target [0, 2w], or dynamo's [-1, 2w]). Near misses: "tile"
    (Tile(f, [1, 2]) = cat(f, f)) and "concat" (Concat(f, f), the rotate_half layout)."""
    if form == "tile":
        return g.node("Tile", [f, g.const([1, 2])])
    if form == "concat":
        return g.node("Concat", [f, f], axis=-1)
    pairs = g.node("Expand", [g.unsqueeze(f, [-1]), g.const([1, 1, 2])])
    return g.node("Reshape", [pairs, g.const([0, 2 * width] if form == "expand" else [-1, 2 * width])])


def _to_rank4(g: _G, cos: str, sin: str, shape, seq_axis: int) -> tuple[str, str]:
    """(seq, d) cos/sin unsqueezed to 4-D with seq at x's seq axis, when `shape` asks for rank 4."""
    if shape is not None and len(shape) == 4:
        axes = [k for k in range(3) if k != seq_axis]
        return g.unsqueeze(cos, axes), g.unsqueeze(sin, axes)
    return cos, sin


def _cos_sin(g: _G, *, source: str, shape, elem, d: int, x: str, seq_axis: int, sin_shape=None) -> tuple[str, str]:
    np_elem = helper.tensor_dtype_to_np_dtype(elem)
    if source == "input":
        return g.input("cos", elem, shape), g.input("sin", elem, sin_shape or shape)
    if source in ("computed", "interleaved", "interleaved-dynamo", "interleaved-tile", "interleaved-concat"):
        # angles from positions and inv_freq; widened by Concat(f, f) (rotate_half) or repeat_interleave
        freqs = _positions_freqs(g, x, seq_axis, d)
        if source == "computed":
            emb = g.node("Concat", [freqs, freqs], axis=-1)  # (seq, d)
        else:
            form = {"interleaved": "expand", "interleaved-dynamo": "dynamo", "interleaved-tile": "tile",
                    "interleaved-concat": "concat"}[source]
            emb = _repeat_interleave(g, freqs, d // 2, form)
        cos, sin = _to_rank4(g, g.node("Cos", [emb]), g.node("Sin", [emb]), shape, seq_axis)
        if elem != TensorProto.FLOAT:
            cos, sin = g.node("Cast", [cos], to=elem), g.node("Cast", [sin], to=elem)
        return cos, sin
    if source == "gather":  # Gather(cos_cached, position_ids) -> (batch, seq, d), then the heads axis
        ids = g.input("position_ids", TensorProto.INT64, ["batch", "seq"])
        rng = np.random.default_rng(1)
        cos = g.node("Gather", [g.const(rng.uniform(-1, 1, (64, d)), np_elem), ids], axis=0)
        sin = g.node("Gather", [g.const(rng.uniform(-1, 1, (64, d)), np_elem), ids], axis=0)
        head_axis = 1 if seq_axis == 2 else 2
        return g.unsqueeze(cos, [head_axis]), g.unsqueeze(sin, [head_axis])
    if source in ("table", "table-interleaved", "table-odd-offset", "table-random"):
        # constant cos/sin caches (max_pos, d) indexed by positions 0..seq-1 (older Llama's cos_cached[:seq],
        # the interleaved caches repeat each angle twice)
        seq = g.node("Gather", [g.node("Shape", [x]), g.const(seq_axis)], axis=0)
        pos = g.node("Range", [g.const(0), seq, g.const(1)])
        angles = np.outer(np.arange(64), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
        width = d + 2 if source == "table-odd-offset" else d
        if source == "table":
            table = np.concatenate([angles, angles], -1)
        elif source == "table-random":
            table = np.random.default_rng(2).uniform(0, 3, (64, width))
        else:
            table = np.repeat(np.outer(np.arange(64), 1.0 / 10000 ** (np.arange(0, width, 2) / width)), 2, -1)
        out = []
        for fn in (np.cos, np.sin):
            c = g.node("Gather", [g.const(fn(table), np_elem), pos], axis=0)
            if source == "table-odd-offset":  # cache[:, 1:d+1]: every pair straddles two angles
                c = g.slice(c, 1, d + 1)
            out.append(c)
        return _to_rank4(g, out[0], out[1], shape, seq_axis)
    if source == "gptj":
        # GPT-J: one sincos table (max_pos, d) = cat(sin, cos) of (max_pos, d/2) angles, GatherND by positions,
        # split into sin and cos, each repeat_interleaved to d, then the heads axis (BSND: (1, S, 1, d))
        seq = g.node("Gather", [g.node("Shape", [x]), g.const(seq_axis)], axis=0)
        pos = g.unsqueeze(g.unsqueeze(g.node("Range", [g.const(0), seq, g.const(1)]), [0]), [-1])  # (1, S, 1)
        angles = np.outer(np.arange(64), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
        sincos = g.node("GatherND", [g.const(np.concatenate([np.sin(angles), np.cos(angles)], -1), np_elem), pos])
        sin_h, cos_h = f"gptj_sin{g.k}", f"gptj_cos{g.k}"
        g.nodes.append(helper.make_node("Split", [sincos, g.const([d // 2, d // 2])], [sin_h, cos_h], axis=-1))
        out = []
        for half in (cos_h, sin_h):  # (1, S, d/2) -> (1, S, 1, d/2, 1) -> (1, S, 1, d/2, 2) -> (1, S, 1, d)
            pairs = g.node("Expand", [g.unsqueeze(half, [2, 4]), g.const([1, 1, 1, 1, 2])])
            out.append(g.node("Reshape", [pairs, g.const([1, -1, 1, d])]))
        return out[0], out[1]
    if source in ("gptj-tile", "gptj-tile-wrong-axis"):
        # GPT-J through TorchScript (after onnxsim): the sincos table Gathered by positions (1, S), split into
        # sin and cos, each repeat_interleave(c[:, :, None, :], 2, 3) written as Unsqueeze(axes [2, 4]) to
        # (1, S, 1, d/2, 1), Tile by [1, 1, 1, 1, 2], Reshape to Concat(Shape(tiled)[:3], [-1]) = (1, S, 1, d).
        # "wrong-axis": the new axis before the angles (Unsqueeze [2, 3], Tile [1, 1, 1, 2, 1]): cat(c, c).
        seq = g.node("Gather", [g.node("Shape", [x]), g.const(seq_axis)], axis=0)
        pos = g.unsqueeze(g.node("Range", [g.const(0), seq, g.const(1)]), [0])  # (1, S)
        angles = np.outer(np.arange(64), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
        sincos = g.node("Gather", [g.const(np.concatenate([np.sin(angles), np.cos(angles)], -1), np_elem), pos],
                        axis=0)
        sin_h, cos_h = f"gptj_sin{g.k}", f"gptj_cos{g.k}"
        g.nodes.append(helper.make_node("Split", [sincos, g.const([d // 2, d // 2])], [sin_h, cos_h], axis=-1))
        wrong = source == "gptj-tile-wrong-axis"
        out = []
        for half in (cos_h, sin_h):
            tiled = g.node("Tile", [g.unsqueeze(half, [2, 3] if wrong else [2, 4]),
                                    g.const([1, 1, 1, 2, 1] if wrong else [1, 1, 1, 1, 2])])
            lead = g.slice(g.node("Shape", [tiled]), 0, 3, axis=0)
            out.append(g.node("Reshape", [tiled, g.node("Concat", [lead, g.const([-1])], axis=0)]))
        return out[0], out[1]
    raise ValueError(source)


def _rope_graph(form="slices", *, layout="BNSD", cos_shape=("seq", D), source="input", swap_add=False,
                swap_x_mul=False, swap_rot_mul=False, d=D, rot_dim=None, heads=N, opset=18,
                elem=TensorProto.FLOAT, x_shape=None, sin_shape=None):
    """y = x * cos + rot(x) * sin on x of `layout`, spelled as the arguments say; with rot_dim, only
    x[..., :rot_dim] is rotated and the rest concatenated back unchanged."""
    g = _G(opset)
    shape = x_shape or (["batch", heads, "seq", d] if layout == "BNSD" else ["batch", "seq", heads, d])
    x = g.input("x", elem, shape)
    rd = rot_dim or d
    xr = g.slice(x, 0, rd) if rot_dim else x
    seq_axis = shape.index("seq")
    cos, sin = _cos_sin(g, source=source, shape=cos_shape, elem=elem, d=rd, x=x, seq_axis=seq_axis,
                        sin_shape=sin_shape)
    rot = _rotation(g, xr, form, rd)
    x_cos = g.node("Mul", [cos, xr] if swap_x_mul else [xr, cos])
    rot_sin = g.node("Mul", [sin, rot] if swap_rot_mul else [rot, sin])
    y = g.node("Add", [rot_sin, x_cos] if swap_add else [x_cos, rot_sin])
    if rot_dim:
        y = g.node("Concat", [y, g.slice(x, rd, INT64_MAX)], axis=-1)
    return g.model(y, elem, shape)


def _run(model: onnx.ModelProto, ranges: dict | None = None,
         reference_sizes: dict | None = None) -> tuple[int, list[str], onnx.ModelProto]:
    """fuse-rope alone: (count, skip reasons, fused model with function bodies); `ranges` and `reference_sizes`
    declare the symbolic dims' bounds as the compile does (passes/dim_bounds.py)."""
    from passes import dim_bounds

    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    m = ir.from_proto(model)
    dim_bounds.declare(m, ranges or {}, reference_sizes or {})
    pm = passes.PassManager("fuse-rope")
    count = pm.run(m)["fuse-rope"]
    fused = onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(ir.to_proto(m)), data_prop=True)
    return count, pm.skipped.get("fuse-rope", []), fused


def _modes(model: onnx.ModelProto) -> list[int]:
    return [helper.get_attribute_value(a) for n in fused_nodes(model, "RotaryPositionEmbedding")
            for a in n.attribute if a.name == "mode"]


SPELLINGS = {
    "slices": dict(),
    "slices, (1,1,S,D) cos": dict(cos_shape=(1, 1, "seq", D)),
    "slices, (B,1,S,D) cos": dict(cos_shape=("batch", 1, "seq", D)),
    "slices, full-shape cos": dict(cos_shape=("batch", N, "seq", D)),
    "slices, x2 from -D/2": dict(form="slices-neg-start"),
    "slices, Add and Muls swapped": dict(swap_add=True, swap_x_mul=True, swap_rot_mul=True),
    "slices, x*cos Mul swapped": dict(swap_x_mul=True),
    "slices, opset 14": dict(opset=14),
    "slices, opset 13": dict(opset=13),
    "slices, fp16": dict(elem=TensorProto.FLOAT16),
    "split (num_outputs)": dict(form="split"),
    "split (sizes), opset 17": dict(form="split", opset=17, swap_add=True),
    "split, opset 13": dict(form="split", opset=13, swap_rot_mul=True),
    "BSND, (1,S,1,D) cos": dict(layout="BSND", cos_shape=(1, "seq", 1, D)),
    "BSND, (B,S,1,D) cos": dict(layout="BSND", cos_shape=("batch", "seq", 1, D)),
    "SBND, (S,1,1,D) cos": dict(x_shape=["seq", "batch", N, D], cos_shape=("seq", 1, 1, D)),
    "SBND, (S,B,1,D) cos": dict(x_shape=["seq", "batch", N, D], cos_shape=("seq", "batch", 1, D), form="split"),
    "cos computed from positions": dict(source="computed", cos_shape=None),
    "cos computed, unsqueezed to (1,1,S,D)": dict(source="computed", cos_shape=(1, 1, "seq", D), form="split"),
    "cos computed, opset 14": dict(source="computed", cos_shape=None, opset=14),
    "cos gathered from a cache": dict(source="gather", swap_add=True),
    "partial rotary": dict(rot_dim=8, d=32, cos_shape=("seq", 8)),
    "partial rotary, split, computed cos": dict(form="split", rot_dim=8, d=32, source="computed", cos_shape=None),
    "cos from a constant cache indexed by positions": dict(source="table", cos_shape=None),
    "partial rotary 4 of 16 (NeoX, StableLM rotary 0.25)": dict(rot_dim=4, source="computed",
                                                                cos_shape=(1, 1, "seq", 4)),
    "partial rotary 8 of 16 (Phi 0.5), split": dict(form="split", rot_dim=8, source="computed", cos_shape=None),
    # mode 1: cos/sin built so that cos[2i] = cos[2i+1] is provable (repeat_interleave, a repeated cache)
    "interleaved": dict(form="interleaved", source="interleaved", cos_shape=(1, 1, "seq", D)),
    "interleaved, 2-D cos, Muls swapped": dict(form="interleaved", source="interleaved", cos_shape=None,
                                               swap_x_mul=True, swap_rot_mul=True),
    "interleaved, dynamo's Reshape [-1, D]": dict(form="interleaved", source="interleaved-dynamo",
                                                  cos_shape=(1, 1, "seq", D)),
    "interleaved, Reshape to Shape(x)": dict(form="interleaved-shape", source="interleaved", cos_shape=(1, 1, "seq", D),
                                             swap_add=True),
    "interleaved, flatten(-2) from Shape(stacked)": dict(form="interleaved-flatten", source="interleaved",
                                                         cos_shape=(1, 1, "seq", D)),
    "interleaved, BSND (1,S,1,D)": dict(form="interleaved", source="interleaved", layout="BSND",
                                        cos_shape=(1, "seq", 1, D)),
    "interleaved, SBND (S,1,1,D)": dict(form="interleaved", source="interleaved", x_shape=["seq", "batch", N, D],
                                        cos_shape=("seq", 1, 1, D)),
    "interleaved, partial 8 of 32 (GLM-4, GPT-J rotary_dim)": dict(form="interleaved", rot_dim=8, d=32,
                                                                   source="interleaved", cos_shape=None),
    "interleaved, opset 13": dict(form="interleaved", source="interleaved", opset=13, cos_shape=(1, 1, "seq", D)),
    "interleaved, fp16": dict(form="interleaved", source="interleaved", cos_shape=None, elem=TensorProto.FLOAT16),
    "interleaved, repeated cache indexed by positions": dict(form="interleaved", source="table-interleaved",
                                                             cos_shape=(1, 1, "seq", D)),
    "interleaved, GPT-J sincos table (GatherND, Split, repeat_interleave), BSND": dict(
        form="interleaved", source="gptj", layout="BSND", rot_dim=8, d=16, swap_add=True),
    "interleaved, GPT-J through TorchScript (Gather, Split, Unsqueeze, Tile [1,1,1,1,2], Reshape), BSND": dict(
        form="interleaved-flatten", source="gptj-tile", layout="BSND", rot_dim=8, d=16),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_each_spelling_fuses_once_and_keeps_numerics(name):
    spelling = SPELLINGS[name]
    original = _rope_graph(**spelling)
    count, skipped, fused = _run(original)
    assert (count, skipped) == (1, [])
    assert _modes(fused) == [1 if spelling.get("form", "").startswith("interleaved") else 0]
    left = [n.op_type for n in fused.graph.node]
    assert "Neg" not in left and "Add" not in left  # the whole application went into the fused node
    if spelling.get("rot_dim"):  # partial rotary: the Slices of x (rotated and passed-through parts) and the
        # Concat back stay (other Slices may cut Shapes for cos/sin)
        assert sum(n.op_type == "Slice" and "x" in n.input for n in fused.graph.node) == 2 and "Concat" in left
    tol = 1e-2 if spelling.get("elem") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)
    # fusion_utils.fuse (the shared helper) sees the same
    assert fuse(original, "fuse-rope")[0] == 1


def test_q_and_k_get_one_fused_node_each_and_share_one_unsqueeze_of_cos():
    g = _G(18)
    q = g.input("q", TensorProto.FLOAT, ["batch", N, "seq", D])
    k = g.input("k", TensorProto.FLOAT, ["batch", 2, "seq", D])
    cos, sin = g.input("cos", TensorProto.FLOAT, ["seq", D]), g.input("sin", TensorProto.FLOAT, ["seq", D])
    outs = []
    for x in (q, k):
        rot = _rotation(g, x, "slices", D)
        outs.append(g.node("Add", [g.node("Mul", [x, cos]), g.node("Mul", [rot, sin])]))
    g.nodes.append(helper.make_node("Concat", outs, ["y"], axis=1))
    original = g.model("y", TensorProto.FLOAT, ["batch", N + 2, "seq", D])
    count, _, fused = _run(original)
    assert count == 2 and _modes(fused) == [0, 0]
    assert [n.op_type for n in fused.graph.node].count("Unsqueeze") == 2  # one for cos, one for sin
    ropes = fused_nodes(fused, "RotaryPositionEmbedding")
    assert ropes[0].input[1:] == ropes[1].input[1:]
    assert_same_numerics(original, fused)


REFUSALS = {
    "mode 1 with (B,1,S,D) cos": (dict(form="interleaved", cos_shape=("batch", 1, "seq", D)),
                                  "mode 1 takes cos/sin of 11SD"),
    "mode 1 with cos gathered per batch": (dict(form="interleaved", source="gather"), "mode 1 takes cos/sin of 11SD"),
    "mode 1 with full-shape cos": (dict(form="interleaved", cos_shape=("batch", N, "seq", D)),
                                   "mode 1 takes cos/sin"),
    "(1,N,S,D) cos": (dict(cos_shape=(1, N, "seq", D)), "mode 0 takes cos/sin of 11SD, B1SD or BNSD"),
    "mode 1, SBND with (S,B,1,D) cos": (dict(form="interleaved", x_shape=["seq", "batch", N, D],
                                             cos_shape=("seq", "batch", 1, D)), "mode 1 takes cos/sin"),
    "cos and sin shaped differently": (dict(cos_shape=(1, 1, "seq", D), sin_shape=("batch", 1, "seq", D)),
                                       "broadcast to x differently"),
    "cos seq not provably x's": (dict(cos_shape=("other_seq", D)), "not provably equal"),
    "cos broadcast over the head dim": (dict(cos_shape=("seq", 1)), "not the rotated size 16"),
    "head dim not static": (dict(x_shape=["batch", N, "seq", "head_dim"]), "not static"),
    "head dim 896": (dict(d=896, cos_shape=("seq", 896)), "D even and < 896"),
    "1000 heads": (dict(heads=1000), "N < 1000 (mindspore 2.10"),
    "x of rank 3": (dict(x_shape=["batch", "seq", D]), "takes a 4-D x"),
    "fp16 below opset 15": (dict(opset=14, elem=TensorProto.FLOAT16), "below opset 15"),
    "cos of another dim than the rotated one": (dict(cos_shape=("seq", 8)), "not the rotated size 16"),
    "partial rotary, cos of the full head dim": (dict(rot_dim=8, d=32, cos_shape=("seq", 32)),
                                                  "not the rotated size 8"),
    # mode 1 needs cos[2i] = cos[2i+1] proved from the graph
    "mode 1 with cos/sin as graph inputs": (dict(form="interleaved", cos_shape=(1, 1, "seq", D)),
                                            "cos is a graph input"),
    "mode 1 with cat(f, f) cos (the rotate_half layout)": (dict(form="interleaved", source="computed", cos_shape=None),
                                                           "the rotate_half (mode 0) layout"),
    "mode 1 with Tile(f, [1, 2]) cos": (dict(form="interleaved", source="interleaved-tile", cos_shape=None),
                                       "copies whole rows of its input (last dim 8)"),
    "mode 1 with GPT-J's Tile on the axis before the angles (cat(c, c))": (
        dict(form="interleaved-flatten", source="gptj-tile-wrong-axis", layout="BSND", rot_dim=8, d=16),
        "copies whole rows of its input (last dim 4)"),
    "mode 1 with a cache that does not repeat its pairs": (dict(form="interleaved", source="table-random",
                                                                cos_shape=None), "does not repeat its values in pairs"),
    "mode 1 with a repeated cache sliced at an odd offset": (dict(form="interleaved", source="table-odd-offset",
                                                                  cos_shape=None), "odd offset"),
    "rotation the other way": (dict(form="wrong-direction"), "x[..., :8]"),
    "halves of another axis": (dict(form="slice-other-axis"), "x[..., :8]"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refusals_do_not_fuse_and_say_why(name):
    spelling, reason = REFUSALS[name]
    count, skipped, fused = _run(_rope_graph(**spelling))
    assert count == 0 and not fused_nodes(fused)
    assert skipped and all(reason in r for r in skipped), skipped


def test_stack_in_the_wrong_order_is_not_a_rotation():
    count, skipped, fused = _run(_rope_graph(form="interleaved-wrong-order", source="interleaved"))
    assert count == 0 and not fused_nodes(fused) and skipped == []


# --- mode 1's proof that cos[2i] = cos[2i+1], rule by rule ------------------------------------------------------
def _pairs_of(build) -> str | None:
    """repeated_pairs on the output of a small graph (seq, 8) built by `build(g, f)` from f = angles (seq, 4)."""
    import passes.fuse_rope as fuse_rope

    g = _G(18)
    x = g.input("x", TensorProto.FLOAT, ["batch", N, "seq", D])
    f = _positions_freqs(g, x, 2, 8)
    out = build(g, f)
    model = onnx.shape_inference.infer_shapes(g.model(out, TensorProto.FLOAT, None), data_prop=True)
    graph = ir.from_proto(model).graph
    value = next(v for n in graph for v in n.outputs if v.name == out)
    return fuse_rope.repeated_pairs(value)


PAIRS = {  # -> a part of the reason, or None (proved)
    "repeat_interleave": (lambda g, f: _repeat_interleave(g, f, 4), None),
    "Cos of it times a scalar, Cast": (lambda g, f: g.node("Cast", [g.node("Mul", [
        g.node("Cos", [_repeat_interleave(g, f, 4)]), g.const(0.5, np.float32)])], to=TensorProto.FLOAT), None),
    "cat(p, p) of a repeated p": (lambda g, f: g.slice(g.node("Concat", [_repeat_interleave(g, f, 4)] * 2, axis=-1),
                                                       0, 8), None),
    "Slice [2:6] of it": (lambda g, f: g.node("Concat", [g.slice(_repeat_interleave(g, f, 4), 2, 6)] * 2, axis=-1),
                          None),
    "MatMul by a constant with repeated columns": (
        lambda g, f: g.node("MatMul", [f, g.const(np.repeat(np.eye(4), 2, axis=1), np.float32)]), None),
    "Transpose keeping the last axis": (lambda g, f: g.node("Transpose", [g.unsqueeze(_repeat_interleave(g, f, 4),
                                                                                       [0])], perm=[1, 0, 2]), None),
    "cat(f, f)": (lambda g, f: g.node("Concat", [f, f], axis=-1), "the rotate_half (mode 0) layout"),
    "Tile of the last axis (cat(f, f))": (lambda g, f: g.node("Tile", [f, g.const([1, 2])]),
                                          "copies whole rows of its input (last dim 4)"),
    "Tile of a new last axis of 1 (TorchScript's repeat_interleave)": (lambda g, f: g.node("Reshape", [g.node(
        "Tile", [g.unsqueeze(f, [-1]), g.const([1, 1, 2])]), g.const([0, 8])]), None),
    "Tile of a new axis before the last (cat(f, f))": (lambda g, f: g.node("Reshape", [g.node(
        "Tile", [g.unsqueeze(f, [1]), g.const([1, 2, 1])]), g.const([0, 8])]), "copies whole rows"),
    "Tile of an odd last axis": (lambda g, f: g.node("Tile", [g.slice(f, 0, 3), g.const([1, 2])]),
                                 "repeats its input's last axis (of size 3) as a whole"),
    "Tile along the rows of a repeated value": (lambda g, f: g.node("Tile", [_repeat_interleave(g, f, 4),
                                                                             g.const([2, 1])]), None),
    "Tile of a repeated value's last axis": (lambda g, f: g.node("Tile", [_repeat_interleave(g, f, 4),
                                                                          g.const([1, 2])]), None),
    "Slice [1:9] of a repeated (seq, 10)": (lambda g, f: g.slice(_repeat_interleave(g, g.node("Concat", [
        f, g.slice(f, 0, 1)], axis=-1), 5), 1, 9), "odd offset"),
    "Transpose moving the last axis": (lambda g, f: g.node("Transpose", [g.node("Reshape", [
        _repeat_interleave(g, f, 4), g.const([-1, 2, 4])])], perm=[0, 2, 1]), "moves the last axis"),
    "Expand of a whole row (tile)": (lambda g, f: g.node("Reshape", [g.node("Expand", [
        g.unsqueeze(f, [1]), g.const([1, 2, 1])]), g.const([0, 8])]), "does not repeat its values in pairs"),
}


@pytest.mark.parametrize("name", PAIRS)
def test_repeated_pairs_proof(name):
    build, why = PAIRS[name]
    got = _pairs_of(build)
    if why is None:
        assert got is None, got
    else:
        assert got is not None and why in got, got


# --- fusion coverage: every rotary candidate (a Neg reaching a Concat) is fused or explained -------------------
def _coverage(model: onnx.ModelProto) -> dict:
    m = ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True))
    pm = passes.PassManager("fuse-rope")
    pm.run(m)
    return pm.coverage["rotary"]


def _near_miss(kind: str) -> onnx.ModelProto:
    """x * cos + rot(x) * sin on x (batch, N, seq, D) with one piece of the application wrong, so that no rule
    matches (the rotation's Neg stays, a coverage candidate that `explain` must give a reason for)."""
    g = _G(18)
    x = g.input("x", TensorProto.FLOAT, ["batch", N, "seq", D])
    other = g.input("other", TensorProto.FLOAT, ["batch", N, "seq", D])
    cos, sin = g.input("cos", TensorProto.FLOAT, ["seq", D]), g.input("sin", TensorProto.FLOAT, ["seq", D])
    h = D // 2
    x1, x2 = g.slice(x, 0, h), g.slice(x, h, INT64_MAX)
    if kind == "concat(x1, -x2)":
        rot = g.node("Concat", [x1, g.node("Neg", [x2])], axis=-1)
    elif kind == "halves of two tensors":
        rot = g.node("Concat", [g.node("Neg", [x2]), g.slice(other, 0, h)], axis=-1)
    elif kind == "negated value not a slice":
        rot = g.node("Concat", [g.node("Neg", [g.node("Relu", [x2])]), x1], axis=-1)
    else:
        rot = g.node("Concat", [g.node("Neg", [x2]), x1], axis=-1)
    x_cos = g.node("Mul", [other if kind == "x*cos of another tensor" else x, cos])
    if kind == "rot(x) not multiplied":
        y = g.node("Add", [x_cos, rot])
    else:
        rot_sin = g.node("Mul", [rot, sin])
        y = g.node("Sub" if kind == "Sub" else "Add", [x_cos, rot_sin])
    return g.model(y, TensorProto.FLOAT, ["batch", N, "seq", D])


NEAR_MISS_REASONS = {
    "concat(x1, -x2)": "concat(x1, -x2) is the inverse rotation",
    "halves of two tensors": "come from different tensors",
    "negated value not a slice": "not a Slice or Split of the rotated tensor",
    "x*cos of another tensor": "x * cos multiplies another tensor than the one rotated",
    "Sub": "a Sub",
    "rot(x) not multiplied": "rot(x) is not multiplied by a sin",
}


@pytest.mark.parametrize("kind", NEAR_MISS_REASONS)
def test_unmatched_rotary_candidates_are_explained(kind):
    c = _coverage(_near_miss(kind))
    assert (c["candidates"], c["fused"]) == (1, 0)
    (item,) = c["items"]
    assert item["op"] == "Neg" and item["pass"] == "fuse-rope"
    assert NEAR_MISS_REASONS[kind] in item["reason"], item["reason"]


def test_interleaved_stack_in_the_wrong_order_is_explained():
    c = _coverage(_rope_graph(form="interleaved-wrong-order", source="interleaved"))
    assert (c["candidates"], c["fused"]) == (1, 0)
    assert "stack(x[..., 0::2], -x[..., 1::2]) is the inverse rotation" in c["items"][0]["reason"]


def test_a_check_reason_reaches_the_rotary_coverage_item():
    """A full application refused by a check (mode 1's pairs not provable): the item carries that reason."""
    c = _coverage(_rope_graph(form="interleaved", source="computed", cos_shape=None))
    assert (c["candidates"], c["fused"]) == (1, 0)
    assert "the rotate_half (mode 0) layout" in c["items"][0]["reason"]


def test_fused_candidates_leave_no_items():
    c = _coverage(_rope_graph(form="interleaved", source="interleaved", cos_shape=None))
    assert (c["candidates"], c["fused"], c["items"]) == (1, 1, [])


def test_skipped_fusion_is_in_the_compile_report(tmp_path):
    """The brief's example: exported cos/sin of (B,1,S,D) (gathered per batch) with the interleaved rotation."""
    p = tmp_path / "m.onnx"
    onnx.save(_rope_graph(form="interleaved", source="gather"), p)
    report = graphconv.compile(p, tmp_path / "m.mindir", simplify=False, passes="fuse-rope", verify=False)
    assert report.fusions["fuse-rope"] == 0 and "RotaryPositionEmbedding" not in report.census
    assert any("mode 1 takes cos/sin of 11SD" in r for r in report.skipped_fusions["fuse-rope"])


# --- the fused op's reference body ---------------------------------------------------------------------------
def _numpy_rope(x, cos, sin, mode):
    x32 = x.astype(np.float32)
    if mode == 0:
        h = x.shape[-1] // 2
        rot = np.concatenate([-x32[..., h:], x32[..., :h]], axis=-1)
    else:
        rot = np.empty_like(x32)
        rot[..., 0::2], rot[..., 1::2] = -x32[..., 1::2], x32[..., 0::2]
    return (x32 * cos.astype(np.float32) + rot * sin.astype(np.float32)).astype(x.dtype)


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reference_body_is_the_documented_formula(mode, opset):
    """The function body equals docs/fused_ops.md's formula written in numpy, with arbitrary cos/sin (no structure
    assumed), for both modes and for cos/sin broadcast as (1,1,S,D)."""
    node = helper.make_node("RotaryPositionEmbedding", ["x", "cos", "sin"], ["y"], domain="mindspore", mode=mode)
    g = helper.make_graph([node], "rpe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, "s", D]),
                                          helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, 1, "s", D]),
                                          helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, 1, "s", D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3, "s", D])])
    model = opmap.fused.attach_functions(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, D)).astype(np.float32)
    cos, sin = rng.uniform(-1, 1, (2, 1, 1, 5, D)).astype(np.float32)
    got = reference.Oracle(model).run([reference.ReferenceCase("c", {"x": x, "cos": cos, "sin": sin})])[0]["y"]
    np.testing.assert_allclose(got, _numpy_rope(x, cos, sin, mode), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [0, 1])
def test_cpu_lowering_of_the_body_is_one_gather_with_static_head_dim(mode):
    """Inlined with D static (opset 15+), the body's index and sign vectors fold at compile time: the cpu
    lowering rotates with one gather and one multiply, and computes no shape at run time."""
    import onnx_ir as ir

    from graphconv.compiler import lowering

    node = helper.make_node("RotaryPositionEmbedding", ["x", "cos", "sin"], ["y"], domain="mindspore", mode=mode)
    g = helper.make_graph([node], "rpe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, "s", D]),
                                          helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, 1, "s", D]),
                                          helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, 1, "s", D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3, "s", D])])
    model = opmap.fused.attach_functions(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    net, _ = lowering.lower(ir.from_proto(opmap.fused.inline_fused(model)))
    (gather,) = net.program.calls("ops.gather")
    assert not net.program.calls("ops.dyn_shape") and not net.program.calls("ops.reshape")
    assert not net.program.calls("ops.cast")  # fp32 in, fp32 out: the body's casts are identities


# --- real exports -----------------------------------------------------------------------------------------------
def _mindir_modes(path) -> list[int]:
    """The `mode` argument of every RotaryPositionEmbedding call in a MindIR (read from the protobuf)."""
    modes = []
    for args in mindir_primitive_inputs(path, "RotaryPositionEmbedding"):  # call-weighted, per layer call
        assert len(args) == 4
        modes.append(int(args[3]))
    return modes


def _check_compiled(report, out, fused_path, onnx_path, n_rope):
    assert report.fusions["fuse-rope"] == n_rope and not report.skipped_fusions.get("fuse-rope")
    assert report.census.get("RotaryPositionEmbedding") == n_rope
    # The ascend MindIR's mode arguments are the fused nodes' mode attributes (the argument record).
    fused = onnx.load(fused_path)
    assert sorted(_mindir_modes(out)) == sorted(_modes(fused))
    # Numbers: the cpu twin of the same fused graph matched onnxruntime on the original model.
    assert report.status == "verified" and report.validation["checked"].startswith("cpu twin of")
    for case in report.validation["cases"]:
        assert all(o["max_abs"] <= 1e-4 for o in case["outputs"])
    # The saved fused graph runs in onnxruntime (function bodies attached) and equals the original.
    assert_same_numerics(onnx.load(onnx_path), fused)
    return fused


@pytest.mark.parametrize("exporter,opset", [("dynamo", 18), pytest.param("torchscript", 17, marks=pytest.mark.slow),
                                            pytest.param("torchscript", 14, marks=pytest.mark.slow)])
def test_zoo_llama_gets_one_rope_per_q_and_k(exporter, opset, export_cache, tmp_path):
    n_layers = 2
    onnx_path = export_cache("llama", opset, exporter)
    out = tmp_path / "llama.mindir"
    # Behind the passes that run before it in the default pipeline (their mindspore::RmsNorm nodes are in the
    # graph the symbolic shape inference reads for the TorchScript exports), without the later ones.
    report = graphconv.compile(onnx_path, out, save_fused=tmp_path / "fused.onnx",
                               passes="canonicalize,fuse-rmsnorm,fuse-rope")
    fused = _check_compiled(report, out, tmp_path / "fused.onnx", onnx_path, 2 * n_layers)
    assert _modes(fused) == [0] * (2 * n_layers)
    # models/llama.py's cos/sin are (seq, 16): one Unsqueeze each to (1, 1, seq, 16), shared by every layer.
    ropes = fused_nodes(fused, "RotaryPositionEmbedding")
    assert len({tuple(n.input[1:]) for n in ropes}) == 1


def test_transformers_llama_gets_one_rope_per_q_and_k(export_cache, tmp_path):
    pytest.importorskip("transformers")
    onnx_path = export_cache("hf-llama", 18)
    out = tmp_path / "l.mindir"
    # The default pipeline: fuse-rope does not depend on the passes after it (fuse-attention reads its output).
    report = graphconv.compile(onnx_path, out, save_fused=tmp_path / "fused.onnx")
    _check_compiled(report, out, tmp_path / "fused.onnx", onnx_path, 4)


def test_transformers_gptj_through_torchscript_gets_one_rope_per_q_and_k(export_cache, tmp_path):
    """transformers' GPT-J through TorchScript (opset 17): repeat_interleave(sin/cos, 2, 3) is exported as
    Unsqueeze, Tile by [1, 1, 1, 1, 2] and Reshape; the proof follows the Tile, and every q and k fuses as mode 1
    (the architecture's count: 2 layers x q and k)."""
    pytest.importorskip("transformers")
    from arch_compile import expected_census

    n_rope = expected_census("gptj")["RotaryPositionEmbedding"]
    assert n_rope == 4
    onnx_path = export_cache("hf/gptj", 17, "torchscript")
    assert "Tile" in [n.op_type for n in onnx.load(onnx_path).graph.node]  # the spelling this test is about
    out = tmp_path / "gptj.mindir"
    report = graphconv.compile(onnx_path, out, save_fused=tmp_path / "fused.onnx")
    fused = _check_compiled(report, out, tmp_path / "fused.onnx", onnx_path, n_rope)
    assert _modes(fused) == [1] * n_rope and _mindir_modes(out) == [1] * n_rope
    cov = report.coverage["rotary"]
    assert (cov["candidates"], cov["fused"], cov["refused"]) == (n_rope, n_rope, {}), cov


# --- small PyTorch blocks exported for real: the spellings the exporters produce ---------------------------------
class RotaryBlock:
    """q = Linear(x) split into heads, rotated, returned. style "chunk": BNSD, rotate_half through torch.chunk,
    cos/sin gathered from a cache by position_ids (B,1,S,D). style "gptj": BSND, GPT-J's rotate_every_two
    (interleaved) on the first 8 of 16 dims only (partial rotary), cos/sin of positions 0..S-1 (1,S,1,8)."""

    @staticmethod
    def build(style: str):
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self, heads=2, head_dim=16, rot_dim=None, max_pos=64):
                super().__init__()
                self.heads, self.head_dim, self.rot = heads, head_dim, rot_dim or head_dim
                self.proj = nn.Linear(heads * head_dim, heads * head_dim, bias=False)
                inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rot, 2, dtype=torch.float32) / self.rot))
                freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
                emb = freqs.repeat_interleave(2, -1) if style == "gptj" else torch.cat((freqs, freqs), -1)
                self.register_buffer("cos_cached", emb.cos(), persistent=False)
                self.register_buffer("sin_cached", emb.sin(), persistent=False)

            def forward(self, x, position_ids):
                b, s, _ = x.shape
                q = self.proj(x).view(b, s, self.heads, self.head_dim)
                if style == "gptj":
                    pos = torch.arange(s, device=x.device)[None]
                    cos, sin = self.cos_cached[pos][:, :, None], self.sin_cached[pos][:, :, None]
                    q_rot, q_pass = q[..., : self.rot], q[..., self.rot:]
                    x1, x2 = q_rot[..., ::2], q_rot[..., 1::2]
                    rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
                    return torch.cat((q_rot * cos + rot * sin, q_pass), dim=-1)
                q = q.transpose(1, 2)
                cos, sin = self.cos_cached[position_ids][:, None], self.sin_cached[position_ids][:, None]
                x1, x2 = q.chunk(2, dim=-1)
                return q * cos + torch.cat((-x2, x1), dim=-1) * sin

        torch.manual_seed(0)
        module = Block(rot_dim=8 if style == "gptj" else None).eval()
        inputs = {"x": torch.randn(2, 7, 32), "position_ids": torch.randint(0, 64, (2, 7))}
        axes = {"x": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"}}
        return module, inputs, axes


@pytest.fixture(scope="module")
def block_export(tmp_path_factory):
    from graphconv.frontend.export import export_pytorch

    done = {}

    def get(style, exporter, opset):
        if (style, exporter, opset) not in done:
            path = tmp_path_factory.mktemp("rope") / f"{style}.onnx"
            module, inputs, axes = RotaryBlock.build(style)
            export_pytorch(module, inputs, path, axes, opset=opset, exporter=exporter)
            done[style, exporter, opset] = path
        return done[style, exporter, opset]

    return get


EXPORTS = [("dynamo", 18), ("torchscript", 17), ("torchscript", 14)]


@pytest.mark.parametrize("style", ["chunk", "gptj"])
@pytest.mark.parametrize("exporter,opset", EXPORTS)
def test_exported_spellings_fuse_after_onnxsim(style, exporter, opset, block_export):
    pytest.importorskip("torch")
    import onnxsim

    original = onnx.load(block_export(style, exporter, opset))
    simplified, _ = onnxsim.simplify(original, check_n=0)
    count, skipped, fused = _run(simplified)
    assert (count, skipped) == (1, [])
    assert _modes(fused) == [1 if style == "gptj" else 0]
    if style == "chunk":  # dynamo writes torch.chunk as Split, TorchScript as two Slices
        assert ("Split" in [n.op_type for n in simplified.graph.node]) == (exporter == "dynamo")
    assert_same_numerics(original, fused)


def test_interleaved_export_reads_back_mode_1_from_the_mindir(block_export, tmp_path):
    """GPT-J-style block (TorchScript, whose dims only the symbolic shape inference relates) compiled for
    ascend: one RotaryPositionEmbedding with mode 1 in the MindIR, verified through the cpu twin."""
    pytest.importorskip("torch")
    onnx_path = block_export("gptj", "torchscript", 17)
    out = tmp_path / "gptj.mindir"
    report = graphconv.compile(onnx_path, out, save_fused=tmp_path / "fused.onnx", passes="fuse-rope")
    fused = _check_compiled(report, out, tmp_path / "fused.onnx", onnx_path, 1)
    assert _modes(fused) == [1] and _mindir_modes(out) == [1]


def test_dims_of_torchscript_exports_are_related_by_symbolic_shape_inference(monkeypatch):
    """Without the symbolic shape inference, cos computed from Range(0, Shape(x)[2]) has a seq dim of its own
    name (unk__0): the fusion is then refused, not assumed."""
    import passes.fuse_rope as fuse_rope

    graph = _rope_graph(source="computed", cos_shape=None)
    assert _run(graph)[0] == 1
    monkeypatch.setattr(fuse_rope, "_symbolic_shapes", lambda proto: {})
    count, skipped, _ = _run(graph)
    assert count == 0 and all("not provably equal" in r for r in skipped)


# --- transformers models with other RoPE spellings (slow: export and compile take ~1 min each) -------------------
def _hf_causal_lm(kind: str):
    import torch
    import transformers as tf
    from models.hf import INITIALIZER_RANGE, _finish

    torch.manual_seed(0)
    common = dict(vocab_size=128, initializer_range=INITIALIZER_RANGE, attn_implementation="eager")
    if kind == "gptj":  # interleaved, partial (16 of 32), BSND with cos (1,S,1,16)
        model = tf.GPTJForCausalLM(tf.GPTJConfig(n_embd=64, n_layer=2, n_head=2, rotary_dim=16, n_positions=128,
                                                 **common))
    else:  # GPT-NeoX: rotate_half, partial (rotary_pct 0.5), BNSD with cos (1,1,S,16)
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=128, rotary_pct=0.5,
                                                       max_position_embeddings=128, **common))
    return _finish(model, "logits", 128, 2, 7)


@pytest.mark.slow
@pytest.mark.parametrize("kind,mode", [("gptj", 1), ("neox", 0)])
def test_transformers_partial_rotary_models(kind, mode, tmp_path):
    pytest.importorskip("transformers")
    from graphconv.frontend.export import export_pytorch

    module, inputs, axes = _hf_causal_lm(kind)
    onnx_path = tmp_path / f"{kind}.onnx"
    export_pytorch(module, inputs, onnx_path, axes, opset=18, exporter="dynamo")
    out = tmp_path / f"{kind}.mindir"
    report = graphconv.compile(onnx_path, out, save_fused=tmp_path / "fused.onnx")
    fused = _check_compiled(report, out, tmp_path / "fused.onnx", onnx_path, 4)
    assert _modes(fused) == [mode] * 4


# --- the architectures users bring: tiny transformers models, default settings, dynamo --------------------------
# name -> (mode, rotated size D of each fused node, partial: the rotated part is sliced out of the head and
# concatenated back). Expected RotaryPositionEmbedding count: q and k of each of the 2 layers = 4 (every one of
# these architectures rotates both in every layer). From transformers 5.24's modeling code:
ROPE_ARCHITECTURES = {
    "gptj": (1, 8, True),       # rotate_every_two on rotary_dim 8 of 16, [B, S, N, D]; sincos table gathered by
                                # position ids, split, repeat_interleave(2)
    "glm4": (1, 8, True),       # partial_rotary_factor 0.5, cos[..., :half].repeat_interleave(2), interleaved
    "cohere": (1, 16, False),   # repeat_interleave(freqs, 2), interleaved rotate_half, full head
    "phi": (0, 8, True),        # partial_rotary_factor 0.5 of 16, rotate_half
    "gpt_neox": (0, 4, True),   # rotary_pct 0.25 of 16
    "stablelm": (0, 4, True),   # partial_rotary_factor 0.25 of 16
    "qwen3": (0, 16, False),    # after the per-head q_norm/k_norm
    "olmo2": (0, 16, False),    # after q_norm/k_norm over the whole projection
    "gemma3": (0, 32, False),   # after the (1 + w) q_norm/k_norm, two rope tables (local/global)
}
N_ROPE = 4  # q and k x 2 layers


def _rotated_sizes(fused: onnx.ModelProto) -> list:
    known = {v.name: v for v in [*fused.graph.value_info, *fused.graph.input]}
    sizes = []
    for n in fused_nodes(fused, "RotaryPositionEmbedding"):
        v = known.get(n.input[0])
        sizes.append(v.type.tensor_type.shape.dim[-1].dim_value if v is not None else None)
    return sizes


def _check_architecture(compiled, name):
    from arch_compile import check_family, check_verified, expected_census, modes

    mode, d, partial = ROPE_ARCHITECTURES[name]
    report, fused = compiled.report, compiled.fused
    assert expected_census(name)["RotaryPositionEmbedding"] == N_ROPE  # the zoo's registry agrees
    assert report.fusions["fuse-rope"] == N_ROPE and report.census.get("RotaryPositionEmbedding") == N_ROPE
    check_family(compiled, "rotary", N_ROPE)
    assert modes(fused) == [mode] * N_ROPE and sorted(_mindir_modes(compiled.mindir)) == [mode] * N_ROPE
    assert _rotated_sizes(fused) == [d] * N_ROPE
    producers = {o: n for n in fused.graph.node for o in n.output}
    for n in fused_nodes(fused, "RotaryPositionEmbedding"):
        users = [u.op_type for u in fused.graph.node if n.output[0] in u.input]
        if partial:  # the Slice of the rotated part and the Concat with the pass-through part stay around it
            assert producers[n.input[0]].op_type == "Slice" and "Concat" in users, (name, users)
    check_verified(compiled)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "gptj" else pytest.mark.slow)
                                  for n in ROPE_ARCHITECTURES])
def test_architectures_fuse_one_rope_per_q_and_k(name, tmp_path_factory):
    """GPT-J (the default run: interleaved, partial, cos/sin gathered from the sincos table) and the others (slow)
    exported at opset 18: 4 RotaryPositionEmbedding of the architecture's mode and rotated size."""
    pytest.importorskip("transformers")
    from arch_compile import compile_arch

    _check_architecture(compile_arch(tmp_path_factory, name, 18), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi", "gpt_neox", "glm4", "cohere", "gemma3"])
def test_architectures_at_opset_23(name, tmp_path_factory):
    """At opset 23 dynamo writes RotaryEmbedding for the rotate_half models (on the sliced part for the partial
    ones) and leaves the interleaved ones decomposed: the same counts."""
    pytest.importorskip("transformers")
    from arch_compile import compile_arch

    _check_architecture(compile_arch(tmp_path_factory, name, 23), name)


def _native_rope_graph(interleaved=0, rot_dim=0, d=16, positions=None, rank=4, heads=4):
    """Opset 23's RotaryEmbedding as dynamo emits it: x (B, N, S, D), cos/sin (1, S, R/2) computed on the fly
    (R = rot_dim or d). positions "input": caches (64, R/2) indexed by a position_ids input (B, S); "range": by
    positions 0..S-1 of shape (1, S). rank 3: x (B, S, N*D) with num_heads."""
    from onnx import TensorProto as TP, helper as h, numpy_helper as nh

    r = rot_dim or d
    seq_axis = 2 if rank == 4 else 1
    inv = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
    inits = [nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one"),
             nh.from_array(np.array([0, 1], np.int64), "axes01"), nh.from_array(np.array([0], np.int64), "axes0")]
    x_shape = ["batch", heads, "seq", d] if rank == 4 else ["batch", "seq", heads * d]
    inputs = [h.make_tensor_value_info("x", TP.FLOAT, x_shape)]
    nodes = [h.make_node("Shape", ["x"], ["shape"], start=seq_axis, end=seq_axis + 1),
             h.make_node("Squeeze", ["shape"], ["s"]),
             h.make_node("Range", ["zero", "s", "one"], ["pos"])]
    extra = []
    if positions is None:
        inits.append(nh.from_array(inv.reshape(1, 1, r // 2), "inv"))
        nodes += [h.make_node("Cast", ["pos"], ["posf"], to=TP.FLOAT),
                  h.make_node("Unsqueeze", ["posf", "axes01"], ["pos3"]),
                  h.make_node("Transpose", ["pos3"], ["pos3t"], perm=[0, 2, 1]),
                  h.make_node("Mul", ["pos3t", "inv"], ["freqs"]),
                  h.make_node("Cos", ["freqs"], ["cos"]), h.make_node("Sin", ["freqs"], ["sin"])]
    else:
        angles = np.outer(np.arange(64), inv)
        inits += [nh.from_array(np.cos(angles).astype(np.float32), "cos"),
                  nh.from_array(np.sin(angles).astype(np.float32), "sin")]
        if positions == "input":
            inputs.append(h.make_tensor_value_info("position_ids", TP.INT64, ["batch", "seq"]))
        else:
            nodes.append(h.make_node("Unsqueeze", ["pos", "axes0"], ["position_ids"]))
        extra = ["position_ids"]
    attrs = dict(interleaved=interleaved, **({"rotary_embedding_dim": rot_dim} if rot_dim else {}),
                 **({"num_heads": heads} if rank == 3 else {}))
    nodes.append(h.make_node("RotaryEmbedding", ["x", "cos", "sin", *extra], ["y"], **attrs))
    g = h.make_graph(nodes, "rope23", inputs, [h.make_tensor_value_info("y", TP.FLOAT, x_shape)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 23)])


NATIVE_SPELLINGS = {  # -> mode
    "halves": (dict(), 0),
    "pairs (interleaved), cos batch 1": (dict(interleaved=1), 1),
    "partial 8 of 16": (dict(rot_dim=8), 0),
    "partial interleaved 8 of 32": (dict(rot_dim=8, d=32, interleaved=1), 1),
    "caches indexed by position_ids (B, S)": (dict(positions="input"), 0),
    "caches indexed by positions (1, S), interleaved": (dict(positions="range", interleaved=1), 1),
    "3-D x (B, S, N*D) with num_heads": (dict(rank=3), 0),
    "3-D x, partial, position_ids": (dict(rank=3, rot_dim=8, positions="input"), 0),
}


@pytest.mark.parametrize("name", NATIVE_SPELLINGS)
def test_opset23_native_rotary_embedding_fuses(name):
    kwargs, mode = NATIVE_SPELLINGS[name]
    original = _native_rope_graph(**kwargs)
    count, fused = fuse(original, "fuse-rope")
    assert count == 1
    (node,) = [n for n in fused.graph.node if n.domain == "mindspore"]
    assert node.op_type == "RotaryPositionEmbedding"
    assert _modes(fused) == [mode]
    assert "RotaryEmbedding" not in [n.op_type for n in fused.graph.node]
    # onnxruntime 1.32 refuses this RotaryEmbedding at batch != 1: the oracle falls back to onnx.reference.
    assert_same_numerics(original, fused, 1e-5, 1e-5)


# The documented limits with B declared up to `hi`: MindSpore's docstring takes B < 1000 in both modes; CANN's
# aclnnRotaryPositionEmbedding page limits B·N < 1000 in mode 1 (N = 4 here: B up to 249 fits, 250 does not).
BOUNDED_BATCH = {
    "mode 1, B·N = 996": (dict(form="interleaved", source="interleaved", cos_shape=(1, 1, "seq", D)), 249, None),
    "mode 1, B·N = 1000": (dict(form="interleaved", source="interleaved", cos_shape=(1, 1, "seq", D)), 250,
                           "B·N < 1000 in mode 1 (interleaved) (CANN's aclnnRotaryPositionEmbedding page) at "
                           "B up to 250 (declared range batch=1..250), N=4"),
    "mode 0, B·N = 3996": (dict(), 999, None),
    "mode 0, B = 1000": (dict(), 1000, "B < 1000 (mindspore 2.10 ops.rotary_position_embedding docstring) at "
                                       "B up to 1000 (declared range batch=1..1000)"),
}


@pytest.mark.parametrize("name", BOUNDED_BATCH)
def test_the_declared_batch_range_is_checked_against_the_documented_limits(name):
    spelling, hi, refusal = BOUNDED_BATCH[name]
    count, skipped, _ = _run(_rope_graph(**spelling), ranges={"batch": (1, hi)})
    if refusal is None:
        assert (count, skipped) == (1, []), skipped
    else:
        assert count == 0 and len(skipped) == 1 and skipped[0].endswith(refusal), skipped


def test_an_undeclared_dim_is_checked_at_its_reference_sizes():
    """No --shape-range: the largest reference size bounds the dim (and the refusal says so); a dim with neither
    is not checked."""
    spelling = dict(form="interleaved", source="interleaved", cos_shape=(1, 1, "seq", D))
    count, skipped, _ = _run(_rope_graph(**spelling), reference_sizes={"batch": [2, 300]})
    assert count == 0 and skipped[0].endswith("at B up to 300 (reference sizes batch=2,300), N=4"), skipped
    assert _run(_rope_graph(**spelling), reference_sizes={"batch": [2, 3]})[0] == 1
    assert _run(_rope_graph(**spelling))[0] == 1


NATIVE_REFUSALS = {
    "pairs with position_ids of any batch": (dict(interleaved=1, positions="input"),
                                             "mode 1 takes cos/sin of 11SD"),
    "head dim 896": (dict(d=896), "D even and < 896"),
    "3-D x without num_heads": (dict(rank=3, heads=0), "needs num_heads"),
}


@pytest.mark.parametrize("name", NATIVE_REFUSALS)
def test_opset23_native_rotary_embedding_refusals(name):
    kwargs, why = NATIVE_REFUSALS[name]
    model = _native_rope_graph(**kwargs)
    if name == "3-D x without num_heads":  # x of 64 = 4 heads of 16, num_heads left out
        model = _native_rope_graph(rank=3)
        node = next(n for n in model.graph.node if n.op_type == "RotaryEmbedding")
        del node.attribute[[a.name for a in node.attribute].index("num_heads")]
    count, skipped, fused = _run(model)
    assert count == 0 and not fused_nodes(fused)
    assert skipped and all(why in r for r in skipped), skipped


# --- the half-length form: cat(x1*cos - x2*sin, x2*cos + x1*sin), cos/sin of D/2 angles -------------------------
def _half_length_graph(halves="slices", cos_shape=("seq", D // 2), swap=False, opset=18,
                       elem=TensorProto.FLOAT, inverse=False, merged=False):
    """transformers 5's gpt-oss / DeepSeek `_apply_rotary_emb` on x (B, N, S, D); `inverse`: the rotation the
    other way (x1*cos + x2*sin, x2*cos - x1*sin), which is not RoPE's. halves="pairs": x1 = x[..., 0::2], x2 =
    x[..., 1::2] (DeepSeek-V3's apply_rotary_pos_emb_interleave). `merged`: the rotation's Concat merged with the
    one that joins it to a pass-through part p (B, N, S, 8), as onnxsim leaves DeepSeek's query: Concat(p, Sub,
    Add)."""
    g = _G(opset)
    shape = ["batch", N, "seq", D]
    x = g.input("x", elem, shape)
    cos, sin = g.input("cos", elem, list(cos_shape)), g.input("sin", elem, list(cos_shape))
    if halves == "slices":
        x1, x2 = g.slice(x, 0, D // 2), g.slice(x, D // 2, INT64_MAX)
    elif halves == "pairs":
        x1, x2 = g.slice(x, 0, INT64_MAX, step=2), g.slice(x, 1, INT64_MAX, step=2)
    else:
        x1, x2 = "x1", "x2"
        g.nodes.append(helper.make_node("Split", [x], [x1, x2], name="n_split", axis=-1, num_outputs=2))

    def mul(a, b):
        return g.node("Mul", [b, a] if swap else [a, b])

    first = g.node("Add" if inverse else "Sub", [mul(x1, cos), mul(x2, sin)])
    second = g.node("Sub" if inverse else "Add", [mul(x2, cos), mul(x1, sin)])
    if merged:
        passed = g.input("p", elem, ["batch", N, "seq", 8])
        return g.model(g.node("Concat", [passed, first, second], axis=-1), elem, ["batch", N, "seq", D + 8])
    return g.model(g.node("Concat", [first, second], axis=-1), elem, shape)


HALF_LENGTH = {
    "slices": dict(),
    "split": dict(halves="split"),
    "operands swapped": dict(swap=True),
    "(1,1,S,D/2) cos": dict(cos_shape=(1, 1, "seq", D // 2), halves="split"),
    "(B,1,S,D/2) cos": dict(cos_shape=("batch", 1, "seq", D // 2)),
    "fp16": dict(elem=TensorProto.FLOAT16),
    "pairs (DeepSeek-V3's rope_interleave)": dict(halves="pairs"),
    "merged into the Concat with a pass-through part (onnxsim)": dict(merged=True),
    "pairs, merged (DeepSeek-V3's query after onnxsim)": dict(halves="pairs", merged=True),
}


@pytest.mark.parametrize("name", HALF_LENGTH)
def test_the_half_length_form_fuses_once_as_mode_0_and_keeps_numerics(name):
    """The rewrite doubles cos/sin (cat(cos, cos)): the same rotation in rotate_half's layout."""
    spelling = HALF_LENGTH[name]
    original = _half_length_graph(**spelling)
    count, skipped, fused = _run(original)
    assert (count, skipped, _modes(fused)) == (1, [], [0])
    assert not {"Sub", "Add", "Mul"} & {n.op_type for n in fused.graph.node}
    tol = 1e-2 if spelling.get("elem") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


def test_the_half_length_form_is_a_candidate_and_its_refusal_is_said():
    """Before, the form had no rotary candidate: an unfused one was a silent zero. The inverse rotation and
    cos/sin of the full size are refused with a reason in the coverage, merged into a wider Concat too."""
    assert (_coverage(_half_length_graph())["candidates"], _coverage(_half_length_graph())["fused"]) == (1, 1)
    c = _coverage(_half_length_graph(merged=True, inverse=True))
    assert (c["candidates"], c["fused"]) == (0, 0)  # (an inverse pair (Add, Sub) in a wider Concat: no candidate)
    c = _coverage(_half_length_graph(merged=True, cos_shape=("seq", D)))
    assert (c["candidates"], c["fused"]) == (1, 0)
    assert f"last dim is {D}, not {D // 2}" in c["items"][0]["reason"], c["items"]
    c = _coverage(_half_length_graph(inverse=True))
    assert (c["candidates"], c["fused"]) == (1, 0)
    assert "is the inverse rotation" in c["items"][0]["reason"], c["items"][0]["reason"]
    c = _coverage(_half_length_graph(cos_shape=("seq", D)))
    assert (c["candidates"], c["fused"]) == (1, 0)
    assert f"last dim is {D}, not {D // 2}, half the rotated size {D}" in c["items"][0]["reason"], c["items"]


# --- Llama 4's pairs: stack(a*cos - b*sin, a*sin + b*cos) of x viewed as (..., D/2, 2) ----------------------------
def _stacked_pairs_graph(cos_shape=("batch", "seq", 1, D // 2), indices=(0, 1), stack_axis=-1, swap=False):
    """graphconv's export of Llama 4's complex rotary (frontend/export_rewrites.py) on x (B, S, N, D): its
    pairs a, b are Gathers 0 and 1 of x reshaped to (B, S, N, D/2, 2); cos/sin of D/2 angles per row
    (B, S, 1, D/2); the result stacked on a new last axis and reshaped back to (B, S, N, D)."""
    g = _G(18)
    x = g.input("x", TensorProto.FLOAT, ["batch", "seq", N, D])
    cos = g.input("cos", TensorProto.FLOAT, list(cos_shape))
    sin = g.input("sin", TensorProto.FLOAT, list(cos_shape))
    pairs = g.node("Reshape", [x, g.const([0, 0, N, D // 2, 2])])
    a, b = (g.node("Gather", [pairs, g.const(k)], axis=-1) for k in indices)

    def mul(u, v):
        return g.node("Mul", [v, u] if swap else [u, v])

    real = g.node("Sub", [mul(a, cos), mul(b, sin)])
    imag = g.node("Add", [mul(a, sin), mul(b, cos)])
    stacked = g.node("Concat", [g.unsqueeze(real, [stack_axis]), g.unsqueeze(imag, [stack_axis])], axis=stack_axis)
    out = g.node("Reshape", [stacked, g.const([0, 0, N, D])])
    return g.model(out, TensorProto.FLOAT, ["batch", "seq", N, D])


@pytest.mark.parametrize("swap", [False, True])
def test_llama4_stacked_pairs_fuse_once_as_mode_0_and_keep_numerics(swap):
    """The rewrite de-interleaves the pairs (cat(a, b)), rotates them by rotate_half's mode 0 with cat(cos, cos),
    and stacks the halves back into pairs: the same numbers."""
    original = _stacked_pairs_graph(swap=swap)
    count, skipped, fused = _run(original)
    assert (count, skipped, _modes(fused)) == (1, [], [0])
    assert not {"Sub", "Add", "Mul"} & {n.op_type for n in fused.graph.node}
    assert_same_numerics(original, fused, 1e-5, 1e-5)
    assert (_coverage(original)["candidates"], _coverage(original)["fused"]) == (1, 1)


def test_llama4_stacked_pairs_that_are_not_a_rotation_say_why():
    """The pairs swapped (b first) is the inverse rotation; stacked on another axis it is not pairs: each a
    candidate (no silent zero) refused with a reason."""
    c = _coverage(_stacked_pairs_graph(indices=(1, 0)))
    assert (c["candidates"], c["fused"]) == (1, 0)
    assert "is not the pairs' element 0" in c["items"][0]["reason"], c["items"]
    c = _coverage(_stacked_pairs_graph(stack_axis=3))
    assert (c["candidates"], c["fused"]) == (1, 0), c
    assert "not stacked on a new last axis" in c["items"][0]["reason"], c["items"]


def test_gpt_oss_half_length_rotary_fuses_in_a_real_export(tmp_path):
    """transformers' gpt-oss (saved by save_pretrained, exported by `graphconv export`) writes the half-length
    form: 2 layers x (q, k) = 4 RotaryPositionEmbedding, the coverage 4/4, and the network verified."""
    tf = pytest.importorskip("transformers")
    import torch
    from click.testing import CliRunner

    from graphconv.cli import cli

    torch.manual_seed(0)
    config = tf.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=128, sliding_window=8,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tf.GptOssForCausalLM(config).eval().save_pretrained(tmp_path / "ckpt")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "exp"), "--task",
                                      "text-generation", "-q"])
    assert result.exit_code == 0, result.output
    report = graphconv.compile(tmp_path / "exp" / "model.onnx", tmp_path / "m.mindir", target="ascend")
    assert report.fusions["fuse-rope"] == N_ROPE and report.census.get("RotaryPositionEmbedding") == N_ROPE
    rotary = report.coverage["rotary"]
    assert (rotary["candidates"], rotary["fused"]) == (N_ROPE, N_ROPE)
    assert report.status == "verified"
