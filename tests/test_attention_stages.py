"""fuse-attention's stages (passes/attention/): each stage rewrites graphconv::SDPA without changing what the
graph computes. Proved by running the stages up to one of them, expanding every SDPA back into standard ONNX
(sdpa.expand_leftovers, the same expansion a refused attention gets) and comparing with the original in
onnxruntime; and a candidate refused at a late stage leaves a graph that computes as before, with the
stage's reason in the coverage."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto

import passes
from fusion_utils import assert_same_numerics
from graphconv.verify import compare
from passes.attention import flash, head_repeat, mask, scores, sdpa
from passes.manager import apply_rules
from test_fuse_attention import _attention_graph, _flat_alibi_graph, _native, _ort_run

STAGES = [("scores", scores.rules), ("head_repeat", head_repeat.rules), ("mask", mask.rules)]


def _sdpa_nodes(m: ir.Model) -> list[ir.Node]:
    return [n for n in m.graph if sdpa.is_sdpa(n)]


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every node named, as real exports have them (the coverage judges candidates by name)."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    for k, n in enumerate(inferred.graph.node):
        n.name = f"n{k}"
    return inferred


def _run_stages(model: onnx.ModelProto, upto: int) -> ir.Model:
    m = ir.from_proto(_named(model))
    m.candidates = [n.name for n in m.graph if n.op_type in ("Softmax", "Attention")]
    for _, rules in STAGES[:upto]:
        apply_rules(rules(), m)
    return m


SPELLINGS = {
    "eager, GQA by Expand, additive Where mask": dict(gqa="expand"),
    "dynamo SDPA: sqrt-scales on q and kT, reshaped kT, safe softmax": dict(scale_on="qk", kt="reshape3d",
                                                                            safe_softmax=0.0),
    "keep-Where bool mask, GQA by Tile": dict(mask="keep", gqa="tile"),
    "discard-Where bool mask, MQA": dict(mask="discard", gqa="mqa"),
    "fp16 with an fp32 softmax island": dict(dtype=TensorProto.FLOAT16, softmax_fp32=True, gqa="expand"),
}


@pytest.mark.parametrize("upto", [1, 2, 3])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_each_stage_keeps_what_the_graph_computes(spelling, upto):
    original = _attention_graph(**SPELLINGS[spelling])
    m = _run_stages(original, upto)
    nodes = _sdpa_nodes(m)
    assert len(nodes) == 1, [n.op_type for n in m.graph]
    s = sdpa.Sdpa.read(nodes[0])
    assert [s.source] == m.candidates  # the SDPA carries its Softmax's name (the coverage candidate)
    if upto >= 2 and SPELLINGS[spelling].get("gqa") in ("expand", "tile"):
        assert ir.Shape(s.k.shape)[1] == 2 and ir.Shape(s.v.shape)[1] == 2  # the un-repeated kv heads
    if upto >= 3:
        assert s.mask_proven
    sdpa.expand_leftovers(m)
    assert not _sdpa_nodes(m) and sdpa.DOMAIN not in m.opset_imports
    tol = 2e-3 if "fp16" in spelling else 1e-5
    assert_same_numerics(original, onnx.shape_inference.infer_shapes(ir.to_proto(m)), tol, tol)


def test_bloom_flattened_stage_keeps_numerics():
    original = _flat_alibi_graph()
    m = _run_stages(original, 3)
    (node,) = _sdpa_nodes(m)
    assert sdpa.Sdpa.read(node).bias is not None  # ALiBi, as (B, N, 1, S2)
    sdpa.expand_leftovers(m)
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((2, 4, 5, 16)).astype(np.float32) for x in "qkv"}
    feeds["attention_mask"] = np.ones((2, 5), np.int64)
    feeds["alibi"] = rng.uniform(-3, 0, (8, 1, 5)).astype(np.float32)  # (B·N, 1, S): its dim is B·N
    want, got = _ort_run(original, feeds), _ort_run(ir.to_proto(m), feeds)
    assert compare.compare(got, want, 1e-5, 1e-5).ok


def test_native_attention_stage_keeps_numerics():
    original = _native()
    m = _run_stages(original, 3)
    assert len(_sdpa_nodes(m)) == 1
    sdpa.expand_leftovers(m)
    assert_same_numerics(original, onnx.shape_inference.infer_shapes(ir.to_proto(m)))


@pytest.mark.parametrize("kwargs,stage,reason", [
    (dict(d=8, gqa="expand"), "flash", "D a multiple of 16 and at most 512 (mindspore 2.10 "
                                       "ops.flash_attention_score docstring) at D=8"),
    (dict(bias_input=True), "mask", "not provably 0 or a large negative"),
])
def test_a_late_refusal_is_expanded_back_and_explained(kwargs, stage, reason):
    """The SDPA reached the stage that refuses it: the whole pass leaves no graphconv op, the graph computes
    as before, and the coverage item names the refusing stage's reason at the candidate."""
    original = _attention_graph(**kwargs)
    inferred = _named(original)
    m = ir.from_proto(inferred)
    pm = passes.PassManager("fuse-attention")
    assert pm.run(m)["fuse-attention"] == 0
    assert not [n for n in m.graph if n.domain in (sdpa.DOMAIN, "mindspore")]
    c = pm.coverage["attention"]
    softmax = next(n.name for n in inferred.graph.node if n.op_type == "Softmax")
    assert c["candidates"] == 1 and c["fused"] == 0
    assert c["items"][0]["node"] == softmax and reason in c["items"][0]["reason"], c
    assert_same_numerics(original, onnx.shape_inference.infer_shapes(ir.to_proto(m)))
    # stage 1 took the candidate (the refusal is the later stage's), and that stage alone refuses it
    staged = _run_stages(original, 2)
    assert len(_sdpa_nodes(staged)) == 1
    rules = {"flash": flash.rules, "mask": mask.rules}[stage]
    result = apply_rules(rules(), staged)
    assert result.count == 0 and any(reason in r for r in result.refusals), result.refusals


def test_head_repeat_stage_leaves_an_unrepeated_sdpa_alone():
    m = _run_stages(_attention_graph(), 1)
    before = sdpa.Sdpa.read(_sdpa_nodes(m)[0])
    assert apply_rules(head_repeat.rules(), m).count == 0
    after = sdpa.Sdpa.read(_sdpa_nodes(m)[0])
    assert after.k is before.k and after.v is before.v
