"""compile --tp N (graphconv/parallel/sharding.py, graphconv/parallel/tensor_parallel.py).

1. The plan of a hand-built fused graph (one attention block with GQA and a bias, one SwiGLU MLP): each
   weight's split is the one Megatron's scheme gives, worked out by hand below, and the ranks' graphs, run by
   onnxruntime with their partial sums added where the AllReduce sits (tests/tp_simulate.py), compute the
   unsharded graph's outputs.
2. Bad inputs: N not dividing the heads, a graph with no recognised block, N = 1.
3. End to end: transformers' tiny Llama (GQA) exported as users export it, `compile --tp 2` verified under
   msrun on CPU; a bad N through the command line: one line, exit 1, nothing written. --tp 4 and Qwen2 /
   GPT-2 are slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opmap.fused
from graphconv.parallel import sharding
from graphconv.progress import SILENT
from tp_simulate import run_ranks

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INNER = 16, 4, 2, 4, 32


def _block(heads: int = HEADS, kv_heads: int = KV_HEADS, vocab: int = 0, tied: bool = False) -> onnx.ModelProto:
    """x -> attention (q [16, 16], k and v [16, 8] with a v bias; GQA 4/2 heads of 4) -> output projection
    [16, 16] + x -> SwiGLU MLP (gate/up merged [16, 64], down [32, 16]) + residual [-> LM head [16, vocab]; tied:
    x = x_in + E[ids] and the head reads E transposed]."""
    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    def c(name, values):
        return numpy_helper.from_array(np.array(values, np.int64), name)

    q, kv = heads * HEAD_DIM, kv_heads * HEAD_DIM
    inits = [w("Wq", HIDDEN, q), w("Wk", HIDDEN, kv), w("Wv", HIDDEN, kv), w("bv", kv), w("Wo", q, HIDDEN),
             w("Wgu", HIDDEN, 2 * INNER), w("Wd", INNER, HIDDEN),
             c("q_shape", [0, 0, heads, HEAD_DIM]), c("kv_shape", [0, 0, -1, HEAD_DIM]),
             c("v_shape", [0, 0, kv_heads, HEAD_DIM]), c("merge", [0, 0, q]),
             numpy_helper.from_array(np.array(0, np.float32), "no_shift"),
             numpy_helper.from_array(np.zeros((1, 1, 1, 1), np.float32), "mask")]
    t = dict(perm=[0, 2, 1, 3])
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q0"], name="q_proj"),
        helper.make_node("Reshape", ["q0", "q_shape"], ["q1"], name="q_view"),
        helper.make_node("Transpose", ["q1"], ["q"], name="q_t", **t),
        helper.make_node("MatMul", ["x", "Wk"], ["k0"], name="k_proj"),
        helper.make_node("Reshape", ["k0", "kv_shape"], ["k1"], name="k_view"),
        helper.make_node("Transpose", ["k1"], ["k"], name="k_t", **t),
        helper.make_node("MatMul", ["x", "Wv"], ["v0"], name="v_proj"),
        helper.make_node("Add", ["v0", "bv"], ["v0b"], name="v_bias"),
        helper.make_node("Reshape", ["v0b", "v_shape"], ["v1"], name="v_view"),
        helper.make_node("Transpose", ["v1"], ["v"], name="v_t", **t),
        helper.make_node("FlashAttentionScore", ["q", "k", "v", "mask", "no_shift"], ["a"], name="attention",
                         domain="mindspore", scale=HEAD_DIM ** -0.5, head_num=heads, kv_head_num=kv_heads,
                         mask_kind="additive",
                         input_layout="BNSD", sparse_mode=0),
        helper.make_node("Transpose", ["a"], ["a1"], name="a_t", **t),
        helper.make_node("Reshape", ["a1", "merge"], ["a2"], name="a_view"),
        helper.make_node("MatMul", ["a2", "Wo"], ["o"], name="o_proj"),
        helper.make_node("Add", ["x", "o"], ["h"], name="residual_1"),
        helper.make_node("MatMul", ["h", "Wgu"], ["gu"], name="gate_up_proj"),
        helper.make_node("Swiglu", ["gu"], ["act"], name="swiglu", domain="mindspore", dim=-1),
        helper.make_node("MatMul", ["act", "Wd"], ["d"], name="down_proj"),
        helper.make_node("Add", ["h", "d"], ["y"], name="residual_2"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", HIDDEN]) for n in ("x", "y")]
    if tied:
        inits.append(w("E", vocab, HIDDEN))
        nodes[:0] = [helper.make_node("Gather", ["E", "ids"], ["e"], name="embed"),
                     helper.make_node("Add", ["x_in", "e"], ["x"], name="add_embed")]
        nodes += [helper.make_node("Transpose", ["E"], ["Et"], name="tie", perm=[1, 0]),
                  helper.make_node("MatMul", ["y", "Et"], ["logits"], name="lm_head")]
        io[0] = helper.make_tensor_value_info("x_in", TensorProto.FLOAT, ["B", "S", HIDDEN])
        io.insert(0, helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"]))
    elif vocab:
        inits.append(w("Wlm", HIDDEN, vocab))
        nodes.append(helper.make_node("MatMul", ["y", "Wlm"], ["logits"], name="lm_head"))
    if vocab:
        io[-1] = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", vocab])
    graph = helper.make_graph(nodes, "block", io[:-1], io[-1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(model), data_prop=True)


def _columns(*ranges):
    return [list(r) for r in ranges]


# By hand, Megatron's scheme for HEADS=4, KV_HEADS=2, HEAD_DIM=4, INNER=32. A MatMul weight is [in, out]:
# column-parallel splits axis 1, row-parallel axis 0.
EXPECTED = {
    2: {  # q heads {0,1} | {2,3}; kv heads {0} | {1}; MLP hidden [0, 16) | [16, 32)
        "Wq": (1, [[(0, 8)], [(8, 16)]]),
        "Wk": (1, [[(0, 4)], [(4, 8)]]),
        "Wv": (1, [[(0, 4)], [(4, 8)]]),
        "bv": (0, [[(0, 4)], [(4, 8)]]),
        "Wo": (0, [[(0, 8)], [(8, 16)]]),
        "Wgu": (1, [[(0, 16), (32, 48)], [(16, 32), (48, 64)]]),  # the gate's columns and the up's
        "Wd": (0, [[(0, 16)], [(16, 32)]]),
    },
    4: {  # q head r; 2 kv heads over 4 ranks: ranks 0, 1 hold kv head 0, ranks 2, 3 kv head 1
        "Wq": (1, [[(0, 4)], [(4, 8)], [(8, 12)], [(12, 16)]]),
        "Wk": (1, [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]),
        "Wv": (1, [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]),
        "bv": (0, [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]),
        "Wo": (0, [[(0, 4)], [(4, 8)], [(8, 12)], [(12, 16)]]),
        "Wgu": (1, [[(0, 8), (32, 40)], [(8, 16), (40, 48)], [(16, 24), (48, 56)], [(24, 32), (56, 64)]]),
        "Wd": (0, [[(0, 8)], [(8, 16)], [(16, 24)], [(24, 32)]]),
    },
}


@pytest.mark.parametrize("tp", [2, 4])
def test_plan_of_a_block_is_megatrons(tp):
    model = _block()
    plan = sharding.plan(model, tp)
    got = {n: (w.axis, w.slices) for n, w in plan.weights.items() if w.axis is not None}
    assert got == {n: (axis, [list(s) for s in slices]) for n, (axis, slices) in EXPECTED[tp].items()}
    assert plan.heads == {"attention": (HEADS // tp, max(KV_HEADS // tp, 1))}
    assert sorted(plan.reduces) == ["down_proj", "o_proj"]
    # the reshapes naming a head count or the merged width get the rank's; the -1 one is left alone
    assert plan.reshapes == {"q_view": (2, [HEADS // tp] * tp), "v_view": (2, [max(KV_HEADS // tp, 1)] * tp),
                             "a_view": (2, [HIDDEN // tp] * tp)}
    json.dumps(plan.as_json())  # (plan.json)


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_summed_equal_the_unsharded_block(tp):
    model = _block()
    plan = sharding.plan(model, tp)
    ranks = [sharding.shard(model, plan, r) for r in range(tp)]
    for r, m in enumerate(ranks):
        onnx.checker.check_model(m)
        weights = {t.name: list(t.dims) for t in m.graph.initializer}
        assert weights["Wq"] == [HIDDEN, 16 // tp] and weights["Wd"] == [INNER // tp, HIDDEN]
        assert sum(n.op_type == sharding.ALL_REDUCE for n in m.graph.node) == 2
    x = np.random.default_rng(1).standard_normal((3, 5, HIDDEN)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    for got in run_ranks(ranks, {"x": x}):
        np.testing.assert_allclose(got[0], expected, atol=1e-5, rtol=1e-5)
    # one rank alone (the AllReduce as its identity) is not the model: the sums matter
    alone = ort.InferenceSession(ranks[0].SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(alone - expected).max() > 1e-2


def _with_repeat_by_one(model: onnx.ModelProto) -> onnx.ModelProto:
    """The block with a repeat_kv by 1 on k and v after their transposes, in BNSD, as compile_scale's graph spells
    it when the kv heads are the heads: Unsqueeze(axis 2) -> [B, kv, 1, S, D], Reshape back to [B, kv, S, D]
    (the heads entry a constant: each rank's must be its own)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    g.initializer.extend([numpy_helper.from_array(np.array([2], np.int64), "unit_axis"),
                          numpy_helper.from_array(np.array([0, KV_HEADS, -1, HEAD_DIM], np.int64), "kv_back")])
    fa = next(n for n in g.node if n.op_type == "FlashAttentionScore")
    nodes = []
    for n in g.node:
        if n is fa:
            for k, x in ((1, "k"), (2, "v")):
                nodes += [helper.make_node("Unsqueeze", [x, "unit_axis"], [f"{x}5"], name=f"{x}_unsqueeze"),
                          helper.make_node("Reshape", [f"{x}5", "kv_back"], [f"{x}_rep"], name=f"{x}_repeated")]
                fa.input[k] = f"{x}_rep"
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return onnx.shape_inference.infer_shapes(out, data_prop=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_bnsd_reshape_between_transpose_and_attention_keeps_each_ranks_heads(tp):
    """A Reshape in BNSD layout (heads on axis 1) on the k/v chain: its heads entry is the rank's kv heads
    (2 kv heads: 1 per rank over 2 ranks; over 4, each rank holds one), and the ranks together compute the
    unsharded block."""
    model = _with_repeat_by_one(_block())
    plan = sharding.plan(model, tp)
    per_rank = max(KV_HEADS // tp, 1)
    assert plan.reshapes["k_repeated"] == (1, [per_rank] * tp) and plan.reshapes["v_repeated"] == (1, [per_rank] * tp)
    ranks = sharding.shard_all(model, plan)
    x = np.random.default_rng(2).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    _simulate(model, ranks, {"x": x})


def test_bnsd_reshape_moving_the_heads_is_refused():
    """A Reshape after the transpose whose input does not hold the heads on axis 1 is not followed: an error
    naming it, never a guess."""
    model = _with_repeat_by_one(_block())
    for t in model.graph.initializer:
        if t.name == "unit_axis":
            t.CopyFrom(numpy_helper.from_array(np.array([1], np.int64), "unit_axis"))  # [B, 1, kv, S, D]
    del model.graph.value_info[:]
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    with pytest.raises(sharding.ShardingError, match="k_unsqueeze|k_repeated"):
        sharding.plan(model, 2)


def _weights_to_file(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """A copy of `model` whose float matrices are in the file `path`, referenced by absolute location, as
    graphconv's loader leaves a model with external data (graphconv.frontend.weights.take_over_external)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    with open(path, "wb") as f:
        for t in out.graph.initializer:
            if t.data_type == TensorProto.FLOAT and len(t.dims) == 2:
                data = numpy_helper.to_array(t).tobytes()
                offset = f.tell()
                f.write(data)
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", str(path)), ("offset", str(offset)), ("length", str(len(data)))):
                    t.external_data.add(key=k, value=v)
    return out


def _in_memory(model: onnx.ModelProto) -> onnx.ModelProto:
    from graphconv.frontend import weights

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(np.array(weights.to_array(t)), t.name))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_of_weights_in_files_go_to_the_spill_file(tp, tmp_path):
    """A model whose weights are in files (how large models arrive): each rank's shards are appended to the
    compile's spill file and the rank graph refers to them there (no weight bytes in its protobuf); replicated
    weights stay in the model's own file. The shards are Megatron's (EXPECTED), and the ranks together compute
    the unsharded block."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    from graphconv.frontend import weights

    model = _block()
    on_disk = _weights_to_file(model, tmp_path / "model.data")
    spill = weights.SpillFile(tmp_path / "spill.bin")
    plan = sharding.plan(on_disk, tp)
    ranks = sharding.shard_all(on_disk, plan, spill)  # (each weight read once for every rank)
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for r, m in enumerate(ranks):
        split = {t.name: t for t in m.graph.initializer if t.name in EXPECTED[tp]}
        for name, (axis, slices) in EXPECTED[tp].items():
            t = split[name]
            want = np.concatenate([np.take(original[name], np.arange(a, b), axis=axis) for a, b in slices[r]], axis)
            if name == "bv":  # (a 1-D bias is inline in the model: its shard stays inline)
                assert not uses_external_data(t)
            else:
                assert uses_external_data(t) and not t.raw_data
                assert ExternalDataInfo(t).location == str(tmp_path / "spill.bin")
            np.testing.assert_array_equal(weights.to_array(t), want)
        assert ExternalDataInfo(next(t for t in m.graph.initializer if t.name == "Wq")).location != \
            ExternalDataInfo(next(t for t in on_disk.graph.initializer if t.name == "Wq")).location
        assert m.ByteSize() < on_disk.ByteSize() + 4096  # (the shards' bytes are not in it)
        alone = sharding.shard(on_disk, plan, r, spill)  # (rank by rank: the same graph and values)
        assert [n.SerializeToString() for n in alone.graph.node] == [n.SerializeToString() for n in m.graph.node]
        assert all(np.array_equal(weights.to_array(a), weights.to_array(b))
                   for a, b in zip(alone.graph.initializer, m.graph.initializer, strict=True))
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    _simulate(model, [_in_memory(m) for m in ranks], {"x": x})


def test_tp_oracle_runs_the_whole_model_past_the_layer_threshold(tmp_path, monkeypatch):
    """--tp verifies the ranks whole under msrun, so the oracle's outputs are needed whole: a model past the
    layer-streamed threshold is not left to the layer-by-layer oracle (which --tp never runs)."""
    from graphconv import pipeline
    from graphconv.options import CompileOptions
    from graphconv.progress import Progress

    path = tmp_path / "block.onnx"
    onnx.save_model(_block(), path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="block.onnx.data", size_threshold=0)
    monkeypatch.setattr(pipeline, "THRESHOLD_BYTES", -1)  # (any model is past it)
    streamed = {}
    for tp, verify in ((None, True), (2, True), (2, False)):
        opt = CompileOptions(output=tmp_path / f"out-{tp}-{verify}", tp=tp, verify=verify)
        streamed[tp, verify] = pipeline.Compiler(path, opt, Progress(quiet=True)).load().layer_streamed
    assert streamed == {(None, True): True, (2, True): False, (2, False): True}


def _simulate(model, ranks, feeds, atol=1e-5):
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    for got in run_ranks(ranks, feeds):
        np.testing.assert_allclose(got[0], expected, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_lm_head_is_vocab_parallel(tp):
    """Wlm [16, 24] column-parallel over the vocab (axis 1 of a MatMul's [in, out]): rank r its 24/N columns,
    the logits gathered along their last axis (axis 2 of [B, S, vocab])."""
    model = _block(vocab=24)
    plan = sharding.plan(model, tp)
    part = 24 // tp
    assert (plan.weights["Wlm"].axis, plan.weights["Wlm"].slices) == (1, [[(r * part, (r + 1) * part)]
                                                                          for r in range(tp)])
    assert plan.gathers == {"lm_head": (2, [part] * tp)} and not plan.notes
    assert plan.blocks[-1]["kind"] == "lm_head"
    ranks = [sharding.shard(model, plan, r) for r in range(tp)]
    for m in ranks:
        onnx.checker.check_model(m)
        assert [list(t.dims) for t in m.graph.initializer if t.name == "Wlm"] == [[HIDDEN, part]]
        assert [n.op_type for n in m.graph.node if n.domain == sharding.DOMAIN].count(sharding.ALL_GATHER) == 1
        assert m.graph.output[0].type.tensor_type.shape.dim[2].dim_value == 24  # (the body's shape: gathered)
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    _simulate(model, ranks, {"x": x})
    # the one-rank bodies are the rank's part at its offset, zeros elsewhere
    alone = ort.InferenceSession(ranks[1].SerializeToString()).run(None, {"x": x})[0]
    assert not alone[..., :part].any() and alone[..., part:2 * part].any()


def test_lm_head_vocab_not_divisible_stays_replicated():
    model = _block(vocab=25)
    plan = sharding.plan(model, 2)
    assert plan.weights["Wlm"].axis is None and not plan.gathers
    assert plan.notes == ["Wlm: LM head replicated, 2 ranks do not divide its vocab of 25"]
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    _simulate(model, [sharding.shard(model, plan, r) for r in range(2)], {"x": x})


def test_tied_head_stays_replicated():
    model = _block(vocab=24, tied=True)
    plan = sharding.plan(model, 2)
    assert plan.weights["E"].axis is None and plan.weights["E"].role == "embedding and tied LM head (replicated)"
    assert not plan.gathers and any("tied" in n for n in plan.notes)
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, 24, (2, 3)), "x_in": rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    _simulate(model, [sharding.shard(model, plan, r) for r in range(2)], feeds)


E, K, MOE_INNER = 4, 2, 8


def _experts() -> onnx.ModelProto:
    """x [T, 16] -> router [16, 4] -> Softmax -> TopK 2 -> each token's 2 experts as transformers' batched_mm
    exports them: the stacked gate/up [4, 16, 16] ([E, 2 x 8 inner, hidden]) and down [4, 16, 8] ([E, hidden,
    inner]) gathered per (token, expert) by GatherND, W[e] @ x, Swiglu between, weighted by the top-k values,
    summed over the 2 experts + x."""
    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    def c(name, values):
        return numpy_helper.from_array(np.array(values, np.int64), name)

    inits = [w("Wr", HIDDEN, E), w("Wgu", E, 2 * MOE_INNER, HIDDEN), w("Wd", E, HIDDEN, MOE_INNER), c("k", [K]),
             c("tok", [-1, 1, HIDDEN]), c("fan", [1, K, 1]), c("col", [-1, HIDDEN, 1]), c("idx", [-1, 1]),
             c("last", [2]), c("per_token", [-1, K, HIDDEN]), c("experts_axis", [1])]
    nodes = [
        helper.make_node("MatMul", ["x", "Wr"], ["logits"], name="router"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
        helper.make_node("TopK", ["probs", "k"], ["top", "which"], name="topk", axis=-1),
        helper.make_node("Reshape", ["x", "tok"], ["x1"], name="x_tok"),
        helper.make_node("Expand", ["x1", "fan"], ["x2"], name="x_fan"),
        helper.make_node("Reshape", ["x2", "col"], ["x3"], name="x_col"),
        helper.make_node("Reshape", ["which", "idx"], ["e"], name="experts_index"),
        helper.make_node("GatherND", ["Wgu", "e"], ["wgu"], name="gather_gate_up"),
        helper.make_node("MatMul", ["wgu", "x3"], ["gu"], name="gate_up_bmm"),
        helper.make_node("Squeeze", ["gu", "last"], ["gu1"], name="gate_up_squeeze"),
        helper.make_node("Swiglu", ["gu1"], ["act"], name="swiglu", domain="mindspore", dim=-1),
        helper.make_node("Unsqueeze", ["act", "last"], ["act1"], name="act_col"),
        helper.make_node("GatherND", ["Wd", "e"], ["wd"], name="gather_down"),
        helper.make_node("MatMul", ["wd", "act1"], ["d"], name="down_bmm"),
        helper.make_node("Squeeze", ["d", "last"], ["d1"], name="down_squeeze"),
        helper.make_node("Reshape", ["top", "idx"], ["weights"], name="weights_col"),
        helper.make_node("Mul", ["d1", "weights"], ["dw"], name="weighted"),
        helper.make_node("Reshape", ["dw", "per_token"], ["dw1"], name="per_token"),
        helper.make_node("ReduceSum", ["dw1", "experts_axis"], ["moe"], name="experts_sum", keepdims=0),
        helper.make_node("Add", ["x", "moe"], ["y"], name="residual"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", HIDDEN]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "experts", io[:1], io[1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(model), data_prop=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_split_like_a_gated_mlp(tp):
    """By hand: each expert's 8 inner features over the ranks, 8/N each: gate/up [E, 16, 16] on axis 1 (the
    gate's rows and the up's, 8 apart), down [E, 16, 8] on axis 2; the router replicated; one AllReduce,
    after the experts' sum."""
    model = _experts()
    plan = sharding.plan(model, tp)
    part = MOE_INNER // tp
    got = {n: (w.axis, w.slices) for n, w in plan.weights.items() if w.axis is not None}
    assert got == {"Wgu": (1, [[(r * part, (r + 1) * part), (8 + r * part, 8 + (r + 1) * part)] for r in range(tp)]),
                   "Wd": (2, [[(r * part, (r + 1) * part)] for r in range(tp)])}
    assert plan.weights["Wr"].role == "MoE router (replicated)" and not plan.notes
    assert plan.reduces == ["experts_sum"]
    assert plan.blocks == [{"kind": "moe_experts", "down": "down_bmm", "hidden": MOE_INNER, "per_rank": part,
                            "up": ["Wgu"], "down_weight": "Wd", "all_reduce_after": "experts_sum", "experts": E}]
    ranks = [sharding.shard(model, plan, r) for r in range(tp)]
    for m in ranks:
        onnx.checker.check_model(m)
        assert {t.name: list(t.dims) for t in m.graph.initializer if t.name in ("Wgu", "Wd")} == {
            "Wgu": [E, 2 * part, HIDDEN], "Wd": [E, HIDDEN, part]}
    x = np.random.default_rng(1).standard_normal((7, HIDDEN)).astype(np.float32)
    _simulate(model, ranks, {"x": x})


def test_heads_not_divisible():
    with pytest.raises(sharding.ShardingError, match=r"3 ranks do not divide the 4 attention heads of 'attention'"):
        sharding.plan(_block(), 3)


def test_kv_heads_neither_divisible_nor_multiple():
    with pytest.raises(sharding.ShardingError, match="3 ranks do not divide the 32 hidden features of the MLP"):
        sharding.plan(_block(6, 3), 3)  # (3 kv heads over 3 ranks split; the MLP cannot be)
    with pytest.raises(sharding.ShardingError, match="2 ranks neither divide the 3 kv heads of 'attention'"):
        sharding.plan(_block(6, 3), 2)


def test_no_recognised_layers():
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
                               helper.make_node("Relu", ["m"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    with pytest.raises(sharding.ShardingError, match="no attention or MLP block found"):
        sharding.plan(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), 2)


def test_one_rank_is_refused():
    with pytest.raises(sharding.ShardingError, match="at least 2 ranks"):
        sharding.plan(_block(), 1)


# --- end to end -------------------------------------------------------------------------------------------

TINY = {"vocab_size": 128}


def _checkpoint(kind: str, path: Path) -> Path:
    import torch
    import transformers as tf

    from models.hf import INITIALIZER_RANGE

    tiny = {**TINY, "initializer_range": INITIALIZER_RANGE}
    decoder = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)
    models = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**tiny, **decoder, bos_token_id=1, eos_token_id=2)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**tiny, **decoder)),
        # (transformers' defaults but for the sizes: no norm_topk_prob, experts as batched_mm)
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**tiny, **decoder, num_experts=8,
                                                                        num_experts_per_tok=2,
                                                                        moe_intermediate_size=32)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**tiny, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                                         bos_token_id=127, eos_token_id=127)),
    }
    torch.manual_seed(0)
    models[kind]().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tp")
    cache = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            src = _checkpoint(kind, root / f"{kind}-ckpt")
            out = root / f"{kind}-exp"
            r = subprocess.run([sys.executable, "-m", "graphconv", "export", str(src), "-o", str(out), "--task",
                                "text-generation", "-q"], capture_output=True, text=True, cwd=ROOT)
            assert r.returncode == 0, r.stderr
            cache[kind] = out / "model.onnx"
        return cache[kind]

    return get


def _compile(model: Path, out: Path, tp: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", "compile", str(model), "--tp", str(tp), "-o", str(out),
                           "--report", str(out.with_suffix(".json")), "-q", *extra], capture_output=True, text=True,
                          cwd=ROOT)


def _check_compiled(out: Path, tp: int, all_gathers: int = 1) -> dict:
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"rank_{r}.mindir" for r in range(tp)] + ["plan.json", "launch_ascend.sh", "run_rank.py"])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["status"] == "verified"
    rows = report["validation"]["tensor_parallel"]["ranks"]
    assert [r["rank"] for r in rows] == list(range(tp))
    for row in rows:
        assert row["max_abs"] < 1e-4 and row["share"] < 1.0
        # each rank's own peak (ru_maxrss): MindSpore and the rank's weights at least
        assert row["peak_rss_bytes"] > max(row["weight_bytes"], 100 * 2**20)
        assert row["streamed"] is False  # (tiny: below emit.STREAM_MIN_BYTES, mindspore.export writes it)
    assert report["census"]["AllReduce"] == 4  # 2 layers x (attention out, MLP down)
    assert report["census"].get("AllGather", 0) == all_gathers  # the vocab-parallel LM head's logits
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp"] == tp and [b["kind"] for b in plan["blocks"]].count("attention") == 2
    assert "UNVERIFIED ON ASCEND" in (out / "launch_ascend.sh").read_text()
    return plan


def test_llama_tp2_under_msrun(exported, tmp_path):
    model = exported("llama")
    out = tmp_path / "llama-tp2"
    r = _compile(model, out, 2, "--bundle", str(tmp_path / "bundle"))
    assert r.returncode == 0, r.stderr
    plan = _check_compiled(out, 2)
    _check_bundle(tmp_path / "bundle", out, model, 2)
    q = plan["weights"]["model.model.layers.0.self_attn.q_proj.weight"]  # [in, out]: 4 heads of 16 -> 2 + 2
    assert q["split"] == "axis" and q["axis"] == 1 and q["slices"] == [[[0, 32]], [[32, 64]]]
    k = plan["weights"]["model.model.layers.0.self_attn.k_proj.weight"]  # 2 kv heads of 16 -> 1 + 1
    assert k["slices"] == [[[0, 16]], [[16, 32]]]
    down = plan["weights"]["model.model.layers.0.mlp.down_proj.weight"]  # row-parallel: [in, out] axis 0
    assert down["axis"] == 0 and down["slices"] == [[[0, 64]], [[64, 128]]]
    embed = plan["weights"]["model.model.embed_tokens.weight"]
    assert embed["split"] == "replicated" and "embedding" in embed["role"]
    head = plan["weights"]["model.lm_head.weight"]  # [hidden, vocab] (the exporter's transpose): vocab 128 -> 64
    assert head["axis"] == 1 and head["slices"] == [[[0, 64]], [[64, 128]]] and "LM head" in head["role"]


def _check_bundle(bundle: Path, out: Path, model: Path, tp: int) -> None:
    """The --tp bundle: the very rank files of the output, the plan and launch script, the reference cases
    holding onnxruntime's outputs of the unsharded model, and a README saying what is unverified on Ascend."""
    for f in out.iterdir():
        assert (bundle / f.name).read_bytes() == f.read_bytes(), f.name
    meta = json.loads((bundle / "reference" / "cases.json").read_text())
    assert len(meta["cases"]) >= 2 and {o["name"] for o in meta["outputs"]} == {"logits"}
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for case in meta["cases"]:
        with np.load(bundle / case["inputs"]) as feeds, np.load(bundle / case["outputs"]) as ref:
            got = session.run(["logits"], dict(feeds))[0]
            np.testing.assert_allclose(ref["logits"], got, atol=1e-5, rtol=1e-5)
    readme = (bundle / "README.md").read_text()
    assert "UNVERIFIED ON ASCEND" in readme and f"over {tp} devices" in readme
    assert f"./launch_ascend.sh {meta['cases'][0]['inputs']}" in readme
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["tensor_parallel"] == tp and [r["rank"] for r in manifest["ranks"]] == list(range(tp))
    assert all(r["max_abs"] < 1e-4 for r in manifest["ranks"]) and "under msrun" in manifest["verified_here"]
    first = meta["cases"][0]
    check = subprocess.run([sys.executable, str(bundle / "compare_outputs.py"), str(bundle / first["outputs"]),
                            "--case", first["name"]], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_llama_bad_tp_one_line_nothing_written(exported, tmp_path):
    out = tmp_path / "llama-tp3"
    r = _compile(exported("llama"), out, 3)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "3 ranks do not divide the 4 attention heads" in r.stderr
    assert not out.exists() and not any(p.name.startswith(".graphconv-tmp") for p in tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,target", [("llama", 4, "ascend"), ("qwen2", 2, "ascend"), ("qwen2", 4, "ascend"),
                                            ("gpt2", 2, "ascend"), ("gpt2", 4, "ascend"), ("llama", 2, "cpu"),
                                            ("qwen3_moe", 2, "ascend"), ("qwen3_moe", 4, "ascend")])
def test_tp_under_msrun_slow(exported, tmp_path, kind, tp, target):
    """(--target cpu: the ranks run their MindIRs, loaded by mindspore.load + GraphCell, under msrun.)"""
    out = tmp_path / f"{kind}-tp{tp}"
    r = _compile(exported(kind), out, tp, "--target", target)
    assert r.returncode == 0, r.stderr
    plan = _check_compiled(out, tp, 0 if kind == "gpt2" else 1)  # (GPT-2's head is tied to its embedding)
    if kind == "qwen3_moe":  # each expert's 32 inner features over the ranks; one AllReduce per layer after the sum
        moe = [b for b in plan["blocks"] if b["kind"] == "moe_experts"]
        assert len(moe) == 2 and all(b["experts"] == 8 and b["per_rank"] == 32 // tp for b in moe)
        down = plan["weights"]["model.model.layers.0.mlp.experts.down_proj"]  # [E, hidden, inner]
        assert down["axis"] == 2 and down["slices"][0] == [[0, 32 // tp]]
        assert plan["weights"]["model.model.layers.0.mlp.gate.weight"]["role"] == "MoE router (replicated)"


# --- msrun ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tp2_at_scale_verifies_and_streams_each_rank(tmp_path):
    """compile_scale's 1.1B widths with 12 of its 22 layers (2.6 GB of fp32 weights in one external data file):
    `--tp 2` verifies under msrun; each rank holds the replicated weights (embedding, norms) and half of every
    other (the projections and the LM head), as Megatron's scheme gives from the shapes; each rank's MindIR
    (1.4 GB of Parameters, past emit.STREAM_MIN_BYTES) is written streamed from the files."""
    import dataclasses
    import math

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_scale
    finally:
        sys.path.pop(0)
    cfg = dataclasses.replace(compile_scale.SIZES["default"], layers=12)
    path, _ = compile_scale.build_model(cfg, tmp_path / "model", seed=0, gamma="random")
    out = tmp_path / "tp2"
    r = _compile(path, out, 2)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["status"] == "verified"
    tp = report["validation"]["tensor_parallel"]
    shapes = cfg.weights()
    total = 4 * cfg.n_params()
    # the compile itself holds no rank's shards (they go to its spill file): its peak is onnxruntime's run of
    # the unsharded model on its mapped weights (0.98 x the weights on the 1.1B; 3.5 x with the shards held)
    assert report["peak_rss_bytes"] < 1.5 * total
    replicated = 4 * sum(math.prod(s) for name, s, _ in shapes if "embed" in name or "norm" in name)
    assert tp["unsharded_weight_bytes"] == pytest.approx(total, rel=1e-6)  # (+ a few folded constants)
    for row in tp["ranks"]:
        assert row["weight_bytes"] == pytest.approx(replicated + (total - replicated) / 2, rel=1e-6)
        assert row["share"] <= 0.55 and row["streamed"] is True and row["max_abs"] < 1e-4
        assert row["peak_rss_bytes"] > row["weight_bytes"]
        variables = out / f"rank_{row['rank']}_variables" / "data_0"
        assert variables.stat().st_size == pytest.approx(row["weight_bytes"], rel=1e-3)


def test_tp_disk_check_counts_the_shards_twice(tmp_path, monkeypatch):
    """A model whose weights are in files: under --tp its shards are written to the spill file, then into the
    ranks' MindIRs, so a disk holding the weights once but not twice is refused up front (before any stage),
    where the single-device compile goes ahead."""
    import shutil

    from graphconv import pipeline
    from graphconv.errors import DiskFullError

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")  # (past the loader's inline size)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 64])], [w])
    path = tmp_path / "block.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path,
                    save_as_external_data=True, location="block.onnx.data", size_threshold=0)
    external = (tmp_path / "block.onnx.data").stat().st_size
    real = shutil.disk_usage
    # room for the weights once and a half
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: real(p)._replace(free=external * 3 // 2 + 4096))
    for tp in (None, 2):
        opt = pipeline.CompileOptions(output=tmp_path / (f"out-{tp}" if tp else "out.mindir"), tp=tp)
        compiler = pipeline.Compiler(path, opt, pipeline.SILENT)
        loaded = compiler.load()
        assert loaded.model.external_bytes == external
        if tp is None:
            compiler._check_space(loaded)
        else:
            with pytest.raises(DiskFullError, match="no space left on device"):
                compiler._check_space(loaded)


def test_no_verify_lowers_no_cpu_twins(tmp_path, monkeypatch):
    """`--tp N --no-verify`: the ranks only export their MindIRs under msrun, so no cpu twin is lowered (on the
    7B at --tp 8 the twins took 38 s of a 295 s compile)."""
    from graphconv import pipeline
    from graphconv.runtime import msrun

    class Stop(Exception):
        pass

    seen = {}

    def capture(tasks, workdir, label="msrun", timeout=0):
        seen["tasks"] = tasks
        raise Stop

    monkeypatch.setattr(msrun, "run", capture)
    stages = {}
    for verify in (True, False):
        seen.clear()
        compiler = pipeline.Compiler(ROOT / "models/examples/tiny_llama.onnx",
                                     pipeline.CompileOptions(output=tmp_path / f"out-{verify}", tp=2, verify=verify),
                                     pipeline.SILENT)
        with pytest.raises(Stop):
            compiler.run()
        stages[verify] = [s.name for s in compiler.report.stages]
        kinds = {t["kind"] for t in seen["tasks"]}
        assert kinds == ({"export_and_verify"} if verify else {"export"})
    assert "lower-rank_0_cpu_twin" in stages[True]  # (target ascend: fused primitives have no CPU kernels)
    assert not any("cpu_twin" in name for name in stages[False])


def test_msrun_rank_failure_and_timeout(tmp_path):
    """A rank whose task fails is named; a run past its timeout is killed, msrun's whole group with it."""
    import psutil

    from graphconv.errors import InternalError
    from graphconv.runtime import msrun

    failing = tmp_path / "failing"
    failing.mkdir()
    with pytest.raises(InternalError, match=r"rank \d failed: KeyError"):
        msrun.run([{"kind": "no-such-task"}, {"kind": "no-such-task"}], failing)
    slow = tmp_path / "slow"
    slow.mkdir()
    with pytest.raises(InternalError, match="did not finish within 1 s"):
        msrun.run([{"kind": "no-such-task"}, {"kind": "no-such-task"}], slow, timeout=1)
    spec = str(slow / "msrun-tasks.json")
    left = [p for p in psutil.process_iter(["cmdline"]) if spec in " ".join(p.info["cmdline"] or [])]
    assert not left



def test_msrun_that_cannot_start_is_one_line_exit_1(tmp_path, monkeypatch):
    """msrun's master port taken by another process (a real one, bound here): its scheduler fails ("Failed to
    init the tcp server.") and the ranks would wait for it until their cluster timed out. The run is tried once
    more on another port, then ends in a LaunchError (exit 1) naming the port and the scheduler's error, with
    nothing of msrun left running."""
    import socket

    import psutil

    from graphconv.runtime import msrun

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    monkeypatch.setattr(msrun, "free_port", lambda: port)
    try:
        with pytest.raises(msrun.LaunchError, match=rf"master port {port}\): its scheduler failed: Failed to init "
                                                    "the tcp server") as e:
            msrun.run([{"kind": "no-such-task"}, {"kind": "no-such-task"}], tmp_path, timeout=600)
    finally:
        taken.close()
    assert e.value.exit_code == 1 and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.glob("msrun-logs-*.log")) == ["msrun-logs-1.log", "msrun-logs-2.log"]
    spec = str(tmp_path / "msrun-tasks.json")
    assert not [p for p in psutil.process_iter(["cmdline"]) if spec in " ".join(p.info["cmdline"] or [])]

# --- generation (a cache held in place, split by kv heads) ----------------------------------------------------

CAPACITY = ("--max-batch", "4", "--max-seq-len", "64")


@pytest.fixture(scope="module")
def llama_with_past(tmp_path_factory):
    """(checkpoint, export folder) of the tiny Llama (GQA: 4 heads, 2 kv heads) tests/test_generate.py builds,
    exported with --task text-generation-with-past."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from graphconv.frontend.hf_export import export_checkpoint
    from test_hf_export import _llama, _save

    root = tmp_path_factory.mktemp("tp-gen")
    torch.manual_seed(0)
    src = _save(_llama(), root / "ckpt")
    export_checkpoint(src, root / "exp", "text-generation-with-past", dtype="fp32")
    return src, root / "exp"


def _fused_stateful(export_dir: Path, monkeypatch) -> onnx.ModelProto:
    """The fused stateful graph a `compile EXPORT_DIR --tp N` shards (the compile stopped at the shard stage)."""
    from graphconv.generation.build import Build
    from graphconv.options import CompileOptions, GenerationOptions
    from graphconv.parallel import tensor_parallel
    from graphconv.pipeline import compile_model

    class Stop(Exception):
        pass

    seen = {}

    def stop(self, loaded, checked, fused, cases, ws, spill=None):
        from graphconv.frontend import weights

        # (the caches' zeros are a file in the compile's directory, removed on the way out: read in now)
        for t in fused.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                t.CopyFrom(numpy_helper.from_array(np.array(weights.to_array(t)), t.name))
        seen["fused"] = fused
        raise Stop

    monkeypatch.setattr(tensor_parallel.TensorParallel, "run", stop)
    options = CompileOptions(output=export_dir.parent / "never", target="cpu", tp=2,
                             generation=GenerationOptions(max_batch=4, max_seq_len=64))
    build = Build.plan(export_dir, options, SILENT)
    (g, graph), = build.graphs.items()
    with pytest.raises(Stop):
        compile_model(graph, build.graph_options(g, output=export_dir.parent / "never", tp=2))
    return seen["fused"]


@pytest.mark.parametrize("tp", [2, 4])
def test_stateful_ranks_hold_their_kv_heads_and_sum_to_the_unsharded_prompt(llama_with_past, monkeypatch, tp,
                                                                            tmp_path):
    """Each rank's cache initializers hold its kv heads (2 kv heads: 1 per rank over 2; over 4, ranks 0-1 kv head
    0 and ranks 2-3 kv head 1), its KVCacheUpdates write them, and the ranks run together (tp_simulate) compute
    the unsharded stateful graph's logits at the prompt call (past length 0, where onnxruntime runs it)."""
    fused = _fused_stateful(llama_with_past[1], monkeypatch)
    p = sharding.plan(fused, tp)
    caches = {n: w for n, w in p.weights.items() if n.startswith("cache.")}
    assert len(caches) == 4 and len(p.cache_updates) == 4  # 2 layers x (keys, values)
    want = [[(0, 1)], [(1, 2)]] if tp == 2 else [[(0, 1)], [(0, 1)], [(1, 2)], [(1, 2)]]
    assert all(w.axis == 1 and w.slices == want for w in caches.values())
    ranks = [sharding.shard(fused, p, r) for r in range(tp)]
    for rank in ranks:
        held = [list(t.dims) for t in rank.graph.initializer if t.name.startswith("cache.")]
        assert held == [[4, 1, 64, 16]] * 4
    # a compile's caches are zeros never written (weights.SpillFile.zeros): so are their shards, unread
    from graphconv.frontend import weights

    spill = weights.SpillFile(tmp_path / "spill.bin")
    unwritten = onnx.ModelProto()
    unwritten.CopyFrom(fused)
    for t in unwritten.graph.initializer:
        if t.name.startswith("cache."):
            t.CopyFrom(spill.zeros(t.name, t.data_type, list(t.dims)))
    for r in range(tp):
        held = [t for t in sharding.shard(unwritten, p, r, spill).graph.initializer if t.name.startswith("cache.")]
        assert [list(t.dims) for t in held] == [[4, 1, 64, 16]] * 4
        assert all(weights.is_zeros(weights.weight_ref(t)) for t in held)
    assert spill.path.stat().st_blocks == 0  # (holes only)
    ids = np.array([[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 12, 13, 14]], np.int64)
    mask = (np.arange(7) >= np.array([[0], [4]])).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.clip(mask.cumsum(-1) - 1, 0, None)}
    inline = opmap.fused.inline_fused
    want = ort.InferenceSession(inline(fused).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got in run_ranks([inline(r) for r in ranks], feeds):
        np.testing.assert_allclose(got[0], want[0], atol=1e-5)


def _compile_gen(export_dir: Path, out: Path, tp: int | None, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", "compile", str(export_dir), "-o", str(out), "-q",
                           *CAPACITY, *(["--tp", str(tp)] if tp else []), *extra], capture_output=True, text=True,
                          cwd=ROOT)


def _generate(gen: Path) -> dict:
    from test_generate import NEW, PROMPTS, _ids_arg

    r = subprocess.run([sys.executable, "-m", "graphconv", "generate", str(gen), "--input-ids", _ids_arg(PROMPTS),
                        "--max-new-tokens", str(NEW), "--check", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("target,tp", [("cpu", 2), ("ascend", 2), ("cpu", 4)])
def test_generate_tp_is_token_exact_with_unsharded_and_transformers(llama_with_past, tmp_path, target, tp):
    """compile EXPORT_DIR --tp N (each rank's stateful MindIR; --tp 4: the 2 kv heads over 4 ranks, each held by
    two; the cached steps checked under msrun against onnxruntime on the unsharded pair), then generate 16
    tokens on three left-padded prompts under msrun: the same tokens as the unsharded GEN_DIR and as
    transformers' greedy generate, every step within 1e-4 of onnxruntime."""
    from test_generate import NEW, PROMPTS, _hf_generate, _ids_arg, _match

    src, export_dir = llama_with_past
    gen, bundle = tmp_path / f"gen-tp{tp}", tmp_path / "bundle"
    r = _compile_gen(export_dir, gen, tp, "--target", target, *(("--bundle", str(bundle)) if target == "cpu" else ()))
    assert r.returncode == 0, r.stderr
    ranks = [f"rank_{r}.mindir" for r in range(tp)] + [f"rank_{r}.cpu.mindir" for r in range(tp)]
    assert sorted(p.name for p in gen.iterdir()) == sorted(ranks + ["plan.json", "generation.json", "report.json",
                                                                    "launch_ascend.sh", "generate_mindspore.py"])
    assert "UNVERIFIED ON ASCEND" in (gen / "launch_ascend.sh").read_text()
    meta = json.loads((gen / "generation.json").read_text())
    assert meta["tensor_parallel"]["tp"] == tp
    assert all(p["shape"] == [4, 1, 64, 16] for p in meta["graphs"]["decode"]["state"]["params"].values())
    report = json.loads((gen / "report.json").read_text())
    check = report["cache"]["cached_steps_check"]
    assert report["status"] == "verified" and check["argmax_match"] and check["max_abs"] <= 1e-4
    plan = json.loads((gen / "plan.json").read_text())
    assert plan["weights"]["cache.past_key_values.0.key"]["slices"] == \
        ([[[0, 1]], [[1, 2]]] if tp == 2 else [[[0, 1]], [[0, 1]], [[1, 2]], [[1, 2]]])
    got = _generate(gen)
    assert all(s["argmax_match"] and s["max_abs"] <= 1e-4 for s in got["steps"])
    plain = tmp_path / "gen"
    r = _compile_gen(export_dir, plain, None, "--target", "cpu")
    assert r.returncode == 0, r.stderr
    assert got["sequences"] == _generate(plain)["sequences"]
    want, ties, _ = _hf_generate(src, PROMPTS, NEW, 2, 2)
    _match(got["sequences"], want, ties)
    assert [len(s) for s in got["sequences"]] == [NEW] * 3
    if target == "cpu" and tp == 2:  # the folder's launch script (msrun, the ranks' generate_mindspore.py) here
        from graphconv.runtime import msrun

        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "MASTER_PORT": str(msrun.free_port())}
        r = subprocess.run([str(gen / "launch_ascend.sh"), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens",
                            str(NEW), "--device", "CPU"], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:]
        assert (gen / "generated.txt").read_text().split("\n")[:3] == [" ".join(map(str, s))
                                                                       for s in got["sequences"]]
    if target == "cpu":  # the bundle: the ranks' MindIRs and what runs them; its launch script gives the tokens
        assert sorted(p.name for p in bundle.iterdir()) == sorted(
            [f"rank_{r}.mindir" for r in range(tp)] + ["plan.json", "generation.json", "launch_ascend.sh",
                                                       "generate_mindspore.py", "README.md"])
        assert all((bundle / f"rank_{r}.mindir").read_bytes() == (gen / f"rank_{r}.mindir").read_bytes()
                   for r in range(tp))
        assert "UNVERIFIED ON ASCEND" in (bundle / "README.md").read_text()
        if tp == 2:
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   "MASTER_PORT": str(msrun.free_port())}
            r = subprocess.run([str(bundle / "launch_ascend.sh"), "--input-ids", _ids_arg(PROMPTS),
                                "--max-new-tokens", str(NEW), "--device", "CPU"], capture_output=True, text=True,
                               env=env, timeout=600)
            assert r.returncode == 0, r.stdout[-2000:]
            assert (bundle / "generated.txt").read_text().split("\n")[:3] == [" ".join(map(str, s))
                                                                              for s in got["sequences"]]


def test_sigint_during_the_cpu_ranks_compile_interrupts_it(llama_with_past, tmp_path):
    """Ctrl-C while the cpu ranks of a --tp generation folder compile, after the ascend ranks' compile has put
    its results in the staging folder: the run stops (exit 130, one line), leaves no output folder, no
    temporary directory and no process. (Each graph of a folder is compiled under interrupts.nested(): else the
    first compile's final moves settle the run and the signal is ignored.)"""
    import signal
    import time

    from test_faults import Run, _temporaries

    out, tmp = tmp_path / "gen", tmp_path / "tmp"
    tmp.mkdir()
    run = Run(["compile", llama_with_past[1], "-o", out, *CAPACITY, "--tp", "2"], tmp)
    assert run.wait_for("decode: compile 2 ranks (cpu)", timeout=240), run.lines[-5:]
    start = next(k for k, line in enumerate(run.lines) if "compile 2 ranks (cpu)" in line)
    while not any("simplify" in line for line in run.lines[start:]) and run.proc.poll() is None:
        time.sleep(0.02)  # (the cpu form's own compile is under way)
    os.killpg(run.proc.pid, signal.SIGINT)  # (as Ctrl-C: the whole group)
    sent = time.monotonic()
    code = run.finish(timeout=120)
    took = time.monotonic() - sent
    assert (code, run.outcome_lines()) == (130, ["graphconv: interrupted (SIGINT)"]), run.lines[-8:]
    assert took < 30, f"{took:.0f} s from the signal to the exit"
    assert not out.exists() and _temporaries(tmp_path, tmp) == []
    assert run.session_processes() == []


def test_generation_tp_bad_input_one_line_nothing_written(llama_with_past, tmp_path):
    export_dir = llama_with_past[1]
    for tp, extra, says in [(3, (), "3 ranks do not divide the 4 attention heads"),
                            (2, ("--no-stateful-cache",), "held in place only")]:
        out = tmp_path / f"gen-tp{tp}"
        r = _compile_gen(export_dir, out, tp, "--target", "cpu", *extra)
        assert r.returncode == 1 and says in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0
        assert not out.exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_generate_on_a_tp_folder_without_msrun_is_one_line(tmp_path, monkeypatch):
    """msrun not found (not beside this Python, not on PATH): an InputError (exit 1) before any rank starts."""
    import graphconv
    from graphconv.errors import InputError

    gen = tmp_path / "gen"
    gen.mkdir()
    step = {"inputs": {"input_ids": ["b", "s"], "attention_mask": ["b", "t"], "position_ids": ["b", "s"]},
            "outputs": {"logits": ["b", "s", 128]}, "mindir": "rank_0",
            "state": {"max_batch": 4, "max_seq_len": 64, "inputs": ["input_ids", "attention_mask", "position_ids"],
                      "outputs": ["logits"], "params": {}}}
    (gen / "generation.json").write_text(json.dumps({
        "task": "text-generation-with-past", "vocab_size": 128, "eos_token_id": 2, "dtype": "fp32",
        "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step}, "tensor_parallel": {"tp": 2}}))
    for r in range(2):
        (gen / f"rank_{r}.cpu.mindir").write_bytes(b"")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InputError, match="msrun .* is not installed") as e:
        graphconv.generate(gen, [[5, 6, 7]], 2, device="cpu")
    assert "\n" not in str(e.value)
