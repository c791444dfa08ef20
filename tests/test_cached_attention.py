"""Attention over a KV cache (a decode step) -> mindspore::FusedInferAttentionScore (opmap/fused/
fused_infer_attention.py); the same attention without a cache stays FlashAttentionScore. Hand-built decode
steps (MHA and GQA, a left-padded mask row) and a real transformers decode export."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import graphconv
from fusion_utils import assert_same_numerics, fuse, fused_nodes

B, D, SCALE = "batch", 16, 0.25


def _decode_graph(n1=4, n2=4, cache=True):
    """q (B, n1, seq, D); new k/v (B, n2, seq, D) appended to the cache inputs past_k/past_v (B, n2, past, D)
    along the sequence axis (cache=False: attention over the new k/v only); GQA by HF's repeat_kv
    (Unsqueeze, Expand, Reshape); a bool padding mask (B, keys) as Where(mask, scores, -inf)."""
    m = helper.make_node
    keys = "past + seq" if cache else "seq"
    inputs = [helper.make_tensor_value_info("q", T.FLOAT, [B, n1, "seq", D]),
              helper.make_tensor_value_info("k_new", T.FLOAT, [B, n2, "seq", D]),
              helper.make_tensor_value_info("v_new", T.FLOAT, [B, n2, "seq", D]),
              helper.make_tensor_value_info("attention_mask", T.INT64, [B, keys])]
    nodes, inits = [], [numpy_helper.from_array(np.array([1, 2], np.int64), "ax12"),
                        numpy_helper.from_array(np.array(SCALE, np.float32), "scale"),
                        numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")]
    k, v = "k_new", "v_new"
    if cache:
        inputs += [helper.make_tensor_value_info(f"past_{t}", T.FLOAT, [B, n2, "past", D]) for t in "kv"]
        nodes += [m("Concat", ["past_k", "k_new"], ["present_k"], axis=2),
                  m("Concat", ["past_v", "v_new"], ["present_v"], axis=2)]
        k, v = "present_k", "present_v"
    if n1 != n2:
        inits += [numpy_helper.from_array(np.array([2], np.int64), "ax2"),
                  numpy_helper.from_array(np.array([1, 1, n1 // n2, 1, 1], np.int64), "rep"),
                  numpy_helper.from_array(np.array([0, n1, -1, D], np.int64), "back")]
        for t in ("k", "v"):
            src = k if t == "k" else v
            nodes += [m("Unsqueeze", [src, "ax2"], [f"{t}5"]), m("Expand", [f"{t}5", "rep"], [f"{t}5r"]),
                      m("Reshape", [f"{t}5r", "back"], [f"{t}_rep"])]
        k, v = "k_rep", "v_rep"
    nodes += [m("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]), m("MatMul", ["q", "kt"], ["qk"]),
              m("Mul", ["qk", "scale"], ["scores"]),
              m("Cast", ["attention_mask"], ["keep"], to=T.BOOL), m("Unsqueeze", ["keep", "ax12"], ["keep4"]),
              m("Where", ["keep4", "scores", "fill"], ["masked"]), m("Softmax", ["masked"], ["p"], axis=-1),
              m("MatMul", ["p", v], ["o"]), m("Transpose", ["o"], ["out"], perm=[0, 2, 1, 3])]
    outputs = [helper.make_tensor_value_info("out", T.FLOAT, [B, "seq", n1, D])]
    if cache:
        outputs += [helper.make_tensor_value_info(f"present_{t}", T.FLOAT, [B, n2, "past + seq", D]) for t in "kv"]
    g = helper.make_graph(nodes, "decode", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("n1, n2", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_attention_over_a_cache_fuses_to_fused_infer_attention_score(n1, n2):
    original = _decode_graph(n1, n2)
    count, fused = fuse(original, "fuse-attention")
    assert count == 1
    (node,) = fused_nodes(fused)
    assert node.op_type == "FusedInferAttentionScore"
    a = _attrs(node)
    assert (a["head_num"], a["kv_head_num"], a["mask_kind"]) == (n1, n2, b"keep_bool")
    assert a["scale"] == pytest.approx(SCALE)
    assert list(node.input[1:3]) == ["present_k", "present_v"]  # the cache at kv-head width (GQA undone)
    assert_same_numerics(original, fused)  # the generated mask has a left-padded row


def test_attention_without_a_cache_stays_flash_attention_score():
    count, fused = fuse(_decode_graph(4, 2, cache=False), "fuse-attention")
    assert count == 1 and [n.op_type for n in fused_nodes(fused)] == ["FlashAttentionScore"]


def test_ascend_mindir_holds_the_cached_primitive_and_the_twin_verifies(tmp_path):
    path = tmp_path / "decode.onnx"
    onnx.save(_decode_graph(4, 2), path)
    report = graphconv.compile(path, tmp_path / "decode.mindir")
    assert report.fusions["fuse-attention"] == 1
    assert report.census.get("FusedInferAttentionScore") == 1
    assert "FlashAttentionScore" not in report.census and "Softmax" not in report.census
    assert report.status == "verified" and report.validation["checked"].startswith("cpu twin of")
    assert report.validation["ascend_precision"]["status"] == "ok"


@pytest.mark.parametrize("n1, kind", [(128, "FusedInferAttentionScore"), (130, "FlashAttentionScore")])
def test_more_than_64_query_heads_per_kv_head_is_flash_attention_score(n1, kind):
    """FusedInferAttentionScore's docstring limits N1 / N2 to 64: above it the cache is read by
    FlashAttentionScore, which takes any ratio."""
    import onnx_ir as ir

    import passes

    original = _decode_graph(n1, 2)
    count, fused = fuse(original, "fuse-attention")
    assert count == 1 and [n.op_type for n in fused_nodes(fused)] == [kind]
    assert_same_numerics(original, fused)
    # the second choice is said in the pass's notes, with the limit
    manager = passes.PassManager("fuse-attention")
    manager.run(ir.from_proto(onnx.shape_inference.infer_shapes(original, data_prop=True)))
    notes = manager.notes.get("fuse-attention", [])
    if kind == "FusedInferAttentionScore":
        assert notes == []
    else:
        assert len(notes) == 1 and "runs as FlashAttentionScore, not FusedInferAttentionScore" in notes[0]
        assert "N1/N2" in notes[0] or "N1 / N2" in notes[0], notes[0]
        assert "N1=130" in notes[0] and "N2=2" in notes[0], notes[0]


@pytest.mark.parametrize("mask_dims, takes", [(None, True), ([3, 1, 5, 9], True), ([5, 9], True),
                                               ([3, 4, 5, 9], False)])
def test_a_per_head_mask_is_not_given_to_fused_infer_attention_score(mask_dims, takes):
    """Its documented mask shapes have no per-head form ((B|1, 1, S1, S2) and lower ranks)."""
    import onnx_ir as ir

    from passes.attention.flash import infer_attention_refusal

    class Sdpa:  # (the mask, and q and k for the record's size constraints)
        mask = None if mask_dims is None else ir.Value(shape=ir.Shape(mask_dims))
        q, k = ir.Value(shape=ir.Shape([3, 4, 5, 16])), ir.Value(shape=ir.Shape([3, 2, 9, 16]))

    refusal = infer_attention_refusal(Sdpa(), 4, 2)
    assert (refusal is None) is takes
    if not takes:
        assert refusal.startswith("FusedInferAttentionScore needs a mask of a documented shape")
        assert "[3, 4, 5, 9]" in refusal


def test_the_report_says_why_the_cache_is_read_by_flash_attention_score(tmp_path):
    """130 query heads over 2 kv heads: past FusedInferAttentionScore's N1/N2 limit, so the compile's summary
    names the primitive chosen instead and the limit."""
    path = tmp_path / "decode.onnx"
    onnx.save(_decode_graph(130, 2), path)
    report = graphconv.compile(path, tmp_path / "decode.mindir")
    assert report.census.get("FlashAttentionScore") == 1 and "FusedInferAttentionScore" not in report.census
    lines = [x for x in report.summary().splitlines() if "not FusedInferAttentionScore" in x]
    assert len(lines) == 1 and "N1/N2 at most 64" in lines[0] and "N1=130, N2=2" in lines[0], lines
