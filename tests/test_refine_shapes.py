"""refine-shapes: static dims proved by onnxruntime's symbolic shape inference (a -1 head count)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import passes
from passes import match


def _heads_behind_minus_one() -> onnx.ModelProto:
    """x (batch, seq, 64) @ w -> Reshape to Concat(Shape(x)[0:2], [-1, 16]) -> Transpose: 4 heads, which onnx's
    shape inference cannot see through the -1."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["x"], ["bs"], start=0, end=2),
        helper.make_node("Concat", ["bs", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["y"], perm=[0, 2, 1, 3]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.eye(64, dtype=np.float32), "w"),
                           numpy_helper.from_array(np.array([-1, 16], np.int64), "tail")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]),
                                             data_prop=True)


def test_head_count_behind_minus_one_becomes_static():
    model = ir.from_proto(_heads_behind_minus_one())
    heads = next(n for n in model.graph if n.op_type == "Reshape").outputs[0]
    assert not isinstance(heads.shape[2], int)  # onnx's inference leaves it open
    counts = passes.PassManager("refine-shapes").run(model)
    assert counts["refine-shapes"] >= 1
    assert list(heads.shape)[2:] == [4, 16]
    y = model.graph.outputs[0]
    assert y.shape is None or y.shape[1] == 4
    # symbolic dims stay symbolic: batch and seq are not turned into numbers
    assert not isinstance(heads.shape[0], int) and not isinstance(heads.shape[1], int)


def test_torchscript_transformers_llama_fuses_attention(export_cache, tmp_path):
    """transformers' Llama through the TorchScript exporter reshapes q/k/v with -1 heads: attention fuses
    only with the refined dims, and the compile verifies."""
    report = graphconv.compile(export_cache("hf-llama", 17, "torchscript"), tmp_path / "m.mindir")
    assert report.status == "verified"
    assert report.fusions["refine-shapes"] > 0
    assert report.census.get("FlashAttentionScore") == 2
    off = graphconv.compile(export_cache("hf-llama", 17, "torchscript"), tmp_path / "n.mindir",
                            disable_passes=("refine-shapes",))
    assert off.census.get("FlashAttentionScore", 0) == 0  # the refinement is what makes the difference


def _torchscript_style_heads(other_batch: bool = False) -> onnx.ModelProto:
    """TorchScript's spelling: h = Reshape(x @ w, Concat(Shape(x)[0:2], [64])), then Reshape(h, Concat(
    Unsqueeze(Gather(Shape(x), 0)), Unsqueeze(Gather(Shape(x), 1)), [-1], [16])), Transpose, Mul by a scale.
    With `other_batch` the target's first piece comes from another input's Shape: nothing is provable."""
    first = "z" if other_batch else "x"
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Shape", [first], ["fs"]),
        helper.make_node("Slice", ["xs", "zero", "two"], ["bs"]),
        helper.make_node("Concat", ["bs", "width"], ["flat"], axis=0),
        helper.make_node("Reshape", ["mm", "flat"], ["h"]),
        helper.make_node("Gather", ["fs", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["xs", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Unsqueeze", ["s", "zero"], ["s1"]),
        helper.make_node("Concat", ["b1", "s1", "minus_one", "d"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["t", "scale"], ["y"]),
    ]
    ints = {"zero": [0], "two": [2], "width": [64], "minus_one": [-1], "d": [16]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    inits += [numpy_helper.from_array(np.array(0, np.int64), "i0"),
              numpy_helper.from_array(np.array(1, np.int64), "i1"),
              numpy_helper.from_array(np.eye(64, dtype=np.float32), "w"),
              numpy_helper.from_array(np.array(0.25, np.float32), "scale")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64]),
              helper.make_tensor_value_info("z", TensorProto.FLOAT, ["other", "seq"])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]),
                                             data_prop=True)


def test_minus_one_solved_from_the_shape_arithmetic(monkeypatch):
    """Where onnxruntime's symbolic inference gives up (simulated: it proves nothing), the -1 is solved from
    the Shape pieces themselves and carried through the Transpose and the scaling."""
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    model = ir.from_proto(_torchscript_style_heads())
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert not isinstance(values["heads"].shape[2], int)
    passes.PassManager("refine-shapes").run(model)
    assert values["heads"].shape[2] == 4 and values["t"].shape[1] == 4 and values["y"].shape[1] == 4
    assert not isinstance(values["heads"].shape[0], int)  # batch stays symbolic


def test_minus_one_stays_open_when_a_factor_is_not_the_inputs(monkeypatch):
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    model = ir.from_proto(_torchscript_style_heads(other_batch=True))
    heads = next(v for n in model.graph for v in n.outputs if v.name == "heads")
    passes.PassManager("refine-shapes").run(model)
    assert not isinstance(heads.shape[2], int)


@pytest.mark.parametrize("name", ["hf/bert", pytest.param("hf/distilbert", marks=pytest.mark.slow),
                                  pytest.param("hf/clip_text", marks=pytest.mark.slow)])
def test_torchscript_transformers_encoders_fuse_attention(name, export_cache, tmp_path):
    """transformers' BERT through TorchScript: onnxruntime's shape inference stops at the position-id slice
    (Min(128, seq)), the head count hides behind Reshape(q, [b, s, -1, 16]); now proved, attention fuses."""
    pytest.importorskip("transformers")
    report = graphconv.compile(export_cache(name, 17, "torchscript"), tmp_path / "m.mindir")
    assert report.status == "verified"
    assert report.coverage["attention"] == {"candidates": 2, "fused": 2, "refused": {}, "items": []}
    assert report.census.get("FlashAttentionScore") == 2


# --- BERT's first query through TorchScript: no Reshape in front of the -1 -------------------------------------
# After onnxsim, transformers' BERT (zero-initialised biases) has q = MatMul(ln, Wq) with no bias Add, reshaped by
# Concat(Shape(ln)[0], Shape(ln)[1], -1, 16): q's dims are traced only through the MatMul and the LayerNorm to ln's.
HIDDEN, HEADS, HEAD_DIM = 64, 4, 16


class _B:
    def __init__(self):
        self.nodes, self.inits, self.k = [], [], 0
        self.rng = np.random.default_rng(0)

    def const(self, value, dtype=np.int64) -> str:
        self.k += 1
        name = f"c{self.k}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def weight(self, *shape) -> str:
        return self.const(self.rng.normal(0, 0.2, shape), np.float32)

    def op(self, op_type, *inputs, out=None, **attrs) -> str:
        self.k += 1
        out = out or f"{op_type.lower()}{self.k}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"n{self.k}", **attrs))
        return out


def _bert_like(layers: int = 2, query_bias: tuple[bool, ...] = (False, True), position_slice: bool = True,
               residual_from: str | None = None) -> onnx.ModelProto:
    """`layers` BERT self-attention layers as TorchScript writes them after onnxsim: ln = LayerNorm(emb);
    q = MatMul(ln, Wq) (+ bias where `query_bias` says), k, v = MatMul + bias; each Reshape(., Concat(
    Unsqueeze(Gather(Shape(ln), 0)), Unsqueeze(Gather(Shape(ln), 1)), [-1], [16])) and Transposed; scores
    * 0.25 + Where(mask, 0, min); softmax; context back to (b, s, 64), output projection, residual, LayerNorm.
    `position_slice`: the position embeddings are Gathered by arange(128)[:, :seq] (what stops onnxruntime's
    symbolic inference). `residual_from`: the first layer's q gets Add(q, that input) (b', s, 64) of its own."""
    b = _B()
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])]
    emb = b.op("Gather", b.weight(128, HIDDEN), "input_ids", axis=0)
    if position_slice:
        seq = b.op("Unsqueeze", b.op("Gather", b.op("Shape", "input_ids"), b.const(1), axis=0), b.const([0]))
        ids = b.op("Slice", b.const(np.arange(128)[None]), b.const([0]), seq, b.const([1]), b.const([1]))
        emb = b.op("Add", emb, b.op("Gather", b.weight(128, HIDDEN), ids, axis=0))
    keep = b.op("Cast", b.op("Unsqueeze", "attention_mask", b.const([1, 2])), to=TensorProto.BOOL)
    mask = b.op("Where", keep, b.const(0.0, np.float32), b.const(np.finfo(np.float32).min, np.float32))
    ln = b.op("LayerNormalization", emb, b.const(np.ones(HIDDEN), np.float32), b.const(np.zeros(HIDDEN), np.float32),
              axis=-1, epsilon=1e-12)
    if residual_from:
        inputs.append(helper.make_tensor_value_info(residual_from, TensorProto.FLOAT, ["other", "seq", HIDDEN]))
    for layer in range(layers):
        shape = b.op("Shape", ln)
        target = b.op("Concat", b.op("Unsqueeze", b.op("Gather", shape, b.const(0), axis=0), b.const([0])),
                      b.op("Unsqueeze", b.op("Gather", shape, b.const(1), axis=0), b.const([0])),
                      b.const([-1]), b.const([HEAD_DIM]), axis=0)
        heads = []
        for which, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
            proj = b.op("MatMul", ln, b.weight(HIDDEN, HIDDEN))
            if which != "q" or query_bias[layer]:
                proj = b.op("Add", b.weight(HIDDEN), proj)
            if which == "q" and layer == 0 and residual_from:
                proj = b.op("Add", proj, residual_from)
            heads.append(b.op("Transpose", b.op("Reshape", proj, target), perm=perm,
                              out=f"q_heads{layer}" if which == "q" else None))
        scores = b.op("Add", b.op("Mul", b.op("MatMul", heads[0], heads[1]), b.const(0.25, np.float32)), mask)
        ctx = b.op("Transpose", b.op("MatMul", b.op("Softmax", scores, axis=-1), heads[2]), perm=[0, 2, 1, 3])
        flat = b.op("Concat", b.op("Slice", b.op("Shape", ctx), b.const([0]), b.const([2])), b.const([HIDDEN]), axis=0)
        out = b.op("Add", b.op("MatMul", b.op("Reshape", ctx, flat), b.weight(HIDDEN, HIDDEN)), ln)
        ln = b.op("LayerNormalization", out, b.const(np.ones(HIDDEN), np.float32),
                  b.const(np.zeros(HIDDEN), np.float32), axis=-1, epsilon=1e-12)
    b.nodes.append(helper.make_node("Identity", [ln], ["y"]))
    g = helper.make_graph(b.nodes, "bert", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          b.inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _query_heads(model: ir.Model) -> list[ir.Value]:
    """Each layer's q after the Transpose to (b, heads, s, 16)."""
    return [v for n in model.graph for v in n.outputs if v.name.startswith("q_heads")]


def test_bert_first_query_without_bias_gets_its_head_count():
    """onnxruntime's symbolic inference gives up at the position-id slice (as on the real export); the first
    query's Reshape has MatMul(ln, Wq) in front, traced through the MatMul and the LayerNorm to ln's dims."""
    proto = onnx.shape_inference.infer_shapes(_bert_like(), data_prop=True)
    model = ir.from_proto(proto)
    qs = _query_heads(model)
    assert len(qs) == 2 and all(not isinstance(q.shape[1], int) for q in qs)  # onnx's inference leaves them open
    passes.PassManager("refine-shapes").run(model)
    assert [list(q.shape)[1:2] + list(q.shape)[3:] for q in qs] == [[HEADS, HEAD_DIM]] * 2
    assert all(not isinstance(q.shape[0], int) and not isinstance(q.shape[2], int) for q in qs)  # b, s symbolic


def test_bert_first_query_is_open_without_following_the_matmul(monkeypatch):
    """Without the trace through the ops that pass a dim on (simulated), the first query's -1 stays open: that
    trace is what proves it."""
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_passed_on", lambda value, axis: None)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(_bert_like(query_bias=(False, False)), data_prop=True))
    qs = _query_heads(model)
    passes.PassManager("refine-shapes").run(model)
    assert not isinstance(qs[0].shape[1], int)


def test_a_residual_of_another_batch_keeps_the_head_count_open():
    """q = MatMul(ln, Wq) + z with z (other, seq, 64) of its own: q's batch is the broadcast of ln's and z's,
    which the shape arithmetic cannot tell apart; the -1 stays unsolved (never guessed)."""
    model = ir.from_proto(onnx.shape_inference.infer_shapes(_bert_like(layers=1, query_bias=(False,),
                                                                       residual_from="z"), data_prop=True))
    (q,) = _query_heads(model)
    passes.PassManager("refine-shapes").run(model)
    assert not isinstance(q.shape[1], int)


def test_bert_like_layers_fuse_attention_with_the_same_numerics():
    """2 layers -> 2 FlashAttentionScore once the heads are proved, and the fused graph equals the original."""
    from fusion_utils import assert_same_numerics, fused_nodes
    import opmap.fused

    original = _bert_like()
    m = ir.from_proto(onnx.shape_inference.infer_shapes(original, data_prop=True))
    counts = passes.PassManager("refine-shapes,fuse-attention").run(m)
    assert counts["fuse-attention"] == 2
    fused = onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(ir.to_proto(m)), data_prop=True)
    assert len(fused_nodes(fused, "FlashAttentionScore")) == 2
    assert_same_numerics(original, fused, 1e-5, 1e-5)
    m = ir.from_proto(onnx.shape_inference.infer_shapes(original, data_prop=True))
    assert passes.PassManager("fuse-attention").run(m)["fuse-attention"] == 0  # without refine-shapes: none


def test_torchscript_hf_bert_fuses_both_attentions(export_cache, tmp_path):
    """models/hf.py's plain BERT through TorchScript (opset 17): 2 layers -> 2 FlashAttentionScore, verified."""
    pytest.importorskip("transformers")
    report = graphconv.compile(export_cache("hf-bert", 17, "torchscript"), tmp_path / "m.mindir")
    assert report.status == "verified"
    assert report.coverage["attention"] == {"candidates": 2, "fused": 2, "refused": {}, "items": []}
    assert report.census.get("FlashAttentionScore") == 2


# --- Bloom through TorchScript: a -1 that is one of the input's symbolic dims ----------------------------------
# q3 = Reshape(q (B, 4, S, 16), Concat(Unsqueeze(Mul(Shape(x)[0], 4)), [-1], [16])): B·4 and 16 cancel all of q's
# factors but S, so the -1 is q's S (q's B traced through Transpose, Gather(axis=3) and the (B, S, 4, 3, 16) view
# to the same Shape(x)[0]). tests/test_fuse_attention.py builds the graph and proves the fused numerics.
def _flat_reshapes(first: str = "b*n", d_last: int = 16) -> tuple[ir.Model, list[ir.Value]]:
    from test_fuse_attention import _torchscript_flat_graph

    model = ir.from_proto(_torchscript_flat_graph(first, d_last))
    return model, [n.outputs[0] for n in model.graph if _flattens_a_head(n)]


def _flattens_a_head(node: ir.Node) -> bool:
    """Reshape(Transpose(Gather(the qkv view))): q3, k3 or v3."""
    t = match.producer(node.inputs[0], "Transpose") if node.op_type == "Reshape" else None
    return t is not None and match.producer(t.inputs[0], "Gather") is not None


def _dim1(values):
    return [v.shape[1].value if isinstance(v.shape[1], ir.SymbolicDim) else v.shape[1] for v in values]


def test_bloom_flattening_gets_the_inputs_seq_dim(monkeypatch):
    """onnxruntime's inference simulated away: the shape arithmetic alone gives q3, k3, v3 q's own S."""
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    model, flats = _flat_reshapes()
    assert len(flats) == 3 and all(d != "seq" for d in _dim1(flats))  # onnx's inference: fresh symbols
    passes.PassManager("refine-shapes").run(model)
    assert _dim1(flats) == ["seq"] * 3
    assert all(not isinstance(v.shape[0], int) and v.shape[0].value != "batch" for v in flats)  # B·N: no symbol
    assert all(v.shape[2] == 16 for v in flats)


@pytest.mark.parametrize("first, d_last, want", [
    ("s*n", 16, "batch"),  # Shape(x)[1]·4: the -1 is B, and says so
    ("b", 16, None),  # the -1 is 4·S: no symbol for that
    ("other", 16, None),  # another input's batch cancels nothing
    ("b*n", 8, None),  # the -1 is 2·S
])
def test_bloom_like_flattening_copies_only_what_is_proved(monkeypatch, first, d_last, want):
    import passes.shapes

    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    model, flats = _flat_reshapes(first, d_last)
    before = _dim1(flats)
    passes.PassManager("refine-shapes").run(model)
    assert _dim1(flats) == ([want] * 3 if want else before)
    assert "seq" not in _dim1(flats)


def test_bloom_flattening_needs_the_gather_trace(monkeypatch):
    """Without following q's batch through Gather(axis=3) of the fused qkv view (simulated), nothing is copied."""
    import passes.shapes

    passed_on = passes.shapes._passed_on
    monkeypatch.setattr(passes.shapes, "_symbolic_shapes", lambda proto: {})
    monkeypatch.setattr(passes.shapes, "_passed_on", lambda value, axis: None if value.producer() is not None
                        and value.producer().op_type == "Gather" else passed_on(value, axis))
    model, flats = _flat_reshapes()
    before = _dim1(flats)
    passes.PassManager("refine-shapes").run(model)
    assert _dim1(flats) == before
