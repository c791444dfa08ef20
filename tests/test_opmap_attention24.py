"""Attention at opsets 24 and 25 (opmap/attention_general.py): nonpad_kv_seqlen (an external KV cache of a static
size whose valid length differs per batch row; the causal frontier and the window move with it), the sliding
window (left/right_window_size) with and without a past cache, GQA, 3-D and 4-D forms, composed with masks.

Hand-built one-node graphs through graphconv.tools.backend (one MindSpore child for all), compared with
onnxruntime 1.32, which implements Attention 24/25; one whole compile checks that fuse-attention leaves such a node
to the lowering (FlashAttentionScore has no per-row kv length or window argument here) and still verifies.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper as oh

import graphconv
from graphconv.tools import backend
from graphconv.verify.compare import compare

F, F16, I64, BOOL = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64, onnx.TensorProto.BOOL
_NP = {F: np.float32, F16: np.float16, I64: np.int64, BOOL: np.bool_}


def _attention(inputs, attrs, opset, outs=("y",)):
    """inputs: [(name, elem, shape) or None for an absent optional input] in Attention's order; outs: output names
    ("" for one not asked for)."""
    names = [i[0] if i else "" for i in inputs]
    node = oh.make_node("Attention", names, list(outs), **attrs)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info(*i) for i in inputs if i],
                          [onnx.ValueInfoProto(name=o) for o in outs if o])
    return onnx.shape_inference.infer_shapes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)]))


def _feeds(model, seed, nonpad=None):
    rng = np.random.default_rng(seed)
    feeds = []
    for vi in model.graph.input:
        elem = vi.type.tensor_type.elem_type
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "nonpad_kv_seqlen":
            feeds.append(np.asarray(nonpad, np.int64))
        elif elem == BOOL:
            feeds.append(rng.random(shape) < 0.7)
        else:
            feeds.append(rng.standard_normal(shape).astype(_NP[elem]))
    return feeds


B, H, KVH, S, L, D = 3, 4, 2, 2, 6, 8  # an external cache of 6 slots, 2 new queries; GQA 4:2
Q4, K4 = ("Q", F, [B, H, S, D]), ("K", F, [B, KVH, L, D])
V4 = ("V", F, [B, KVH, L, D])
NONPAD = ("nonpad_kv_seqlen", I64, [B])
CASES = {
    # opset 24: per-row valid lengths, with and without the causal frontier (offset nonpad[b] - S)
    "nonpad_gqa": (_attention([Q4, K4, V4, None, None, None, NONPAD], {}, 24), [6, 3, 4]),
    "nonpad_gqa_causal": (_attention([Q4, K4, V4, None, None, None, NONPAD], {"is_causal": 1}, 24), [6, 2, 5]),
    "nonpad_causal_bool_mask": (_attention([Q4, K4, V4, ("attn_mask", BOOL, [B, 1, S, L]), None, None, NONPAD],
                                           {"is_causal": 1}, 24), [4, 6, 3]),
    "nonpad_causal_fp16_decode": (_attention([("Q", F16, [B, H, 1, D]), ("K", F16, [B, KVH, L, D]),
                                              ("V", F16, [B, KVH, L, D]), None, None, None, NONPAD],
                                             {"is_causal": 1}, 24), [1, 6, 4]),
    "nonpad_3d_float_mask_qk_mode2": (_attention(
        [("Q", F, [B, S, H * D]), ("K", F, [B, L, KVH * D]), ("V", F, [B, L, KVH * D]),
         ("attn_mask", F, [S, L]), None, None, NONPAD],
        {"q_num_heads": H, "kv_num_heads": KVH, "qk_matmul_output_mode": 2}, 24, ("y", "", "", "qk")), [5, 6, 2]),
    # opset 25: sliding windows
    "window_left_causal": (_attention([Q4, K4, V4], {"is_causal": 1, "left_window_size": 2}, 25), None),
    "window_both_no_causal_mask": (_attention([Q4, K4, V4, ("attn_mask", F, [L])],
                                              {"left_window_size": 1, "right_window_size": 1}, 25), None),
    "window_with_past_present": (_attention(
        [Q4, ("K", F, [B, KVH, S, D]), ("V", F, [B, KVH, S, D]), None, ("past_key", F, [B, KVH, 4, D]),
         ("past_value", F, [B, KVH, 4, D])], {"is_causal": 1, "left_window_size": 3}, 25,
        ("y", "present_key", "present_value")), None),
    "window_nonpad_causal": (_attention([Q4, K4, V4, None, None, None, NONPAD],
                                        {"is_causal": 1, "left_window_size": 1}, 25), [6, 3, 2]),
    "window_3d_right_only": (_attention([("Q", F, [B, S, H * D]), ("K", F, [B, L, KVH * D]),
                                         ("V", F, [B, L, KVH * D])],
                                        {"q_num_heads": H, "kv_num_heads": KVH, "right_window_size": 2}, 25), None),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    items = [(m, [_feeds(m, k, nonpad)]) for k, (m, nonpad) in enumerate(CASES.values())]
    return dict(zip(CASES, backend.run_batch(items, tmp_path_factory.mktemp("attention24"))))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_onnxruntime(name, results):
    model, nonpad = CASES[name]
    res = results[name]
    assert res.error is None, f"{res.error}\n{res.source or ''}"
    feeds = _feeds(model, list(CASES).index(name), nonpad)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = dict(zip([i.name for i in model.graph.input], feeds))
    expected = sess.run(None, feed)
    if name.endswith("_qk_mode2"):  # onnxruntime writes the masked QK+bias entries as float's lowest, the ONNX
        from onnx.reference import ReferenceEvaluator  # reference (and the spec, and graphconv) as -inf

        assert np.isinf(ReferenceEvaluator(model).run(None, feed)[1]).any()
        expected[1] = ReferenceEvaluator(model).run(None, feed)[1]
    fp16 = model.graph.input[0].type.tensor_type.elem_type == F16
    tol = 2e-3 if fp16 else 1e-5
    assert len(res.outputs[0]) == len(expected)
    for j, (a, e) in enumerate(zip(res.outputs[0], expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, (j, a.shape, e.shape, a.dtype, e.dtype)
        cmp = compare(a, e, atol=tol, rtol=tol)
        assert cmp.ok, f"output {j}: {cmp.reason} (max_abs {cmp.max_abs:g})"


def test_padding_rows_are_really_hidden(results):
    """Not a tautology of the oracle: with nonpad_kv_seqlen = 3 for row 1, keys 3.. of that row must not matter."""
    model, nonpad = CASES["nonpad_gqa"]
    feeds = _feeds(model, 0, nonpad)
    changed = [f.copy() for f in feeds]
    changed[1][:2, :, 3:] += 5.0  # keys 3.. of rows 0 and 1
    changed[2][:2, :, 3:] -= 5.0
    (out,) = backend.run_batch([(model, [changed])], backend._STATE.dir() / "hidden")[0].outputs[0]
    np.testing.assert_allclose(out[1], results["nonpad_gqa"].outputs[0][0][1], atol=1e-6)
    assert not np.allclose(out[0], results["nonpad_gqa"].outputs[0][0][0], atol=1e-3)  # row 0 sees all 6 keys


def test_nonpad_with_a_past_cache_is_refused_in_one_line():
    model = _attention([Q4, ("K", F, [B, KVH, S, D]), ("V", F, [B, KVH, S, D]), None,
                        ("past_key", F, [B, KVH, 4, D]), ("past_value", F, [B, KVH, 4, D]), NONPAD], {}, 24,
                       ("y", "present_key", "present_value"))
    with pytest.raises(graphconv.errors.UnsupportedError, match="nonpad_kv_seqlen together with past_key"):
        backend.specialise(backend.load_model(model, backend._STATE.dir() / "refused"), {})


def test_compile_leaves_it_to_the_lowering_and_verifies(tmp_path):
    """fuse-attention refuses Attention with nonpad lengths (0 fusions, with the reason); the lowered network
    verifies against onnxruntime on the inputs given (valid lengths in range)."""
    model, nonpad = CASES["nonpad_gqa_causal"]
    path = tmp_path / "attn24.onnx"
    onnx.save(model, path)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **dict(zip([i.name for i in model.graph.input], _feeds(model, 7, nonpad))))
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu", inputs=(inputs,))
    assert report.status == "verified"
    assert report.fusions.get("fuse-attention", 0) == 0
    assert any("nonpad" in r for r in report.skipped_fusions.get("fuse-attention", [])), report.skipped_fusions
