"""Fusion coverage (passes/coverage.py) as a contract: every candidate of a family is fused or listed with its
pass and reason; a disabled pass lists each of its candidates with that reason; skipped_fusions is derived
from the items; `graphconv compile` prints one line per family and `graphconv inspect --fusions` shows the
same analysis without compiling.

Expected counts come from the shipped model's architecture (models/llama.py, 2 layers): 2 attention
Softmaxes, 5 RMSNorms (2 per layer + final), 4 rotated tensors (q and k per layer), 2 SwiGLU MLPs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from graphconv.cli import cli
from graphconv.pipeline import analyze_fusions
from models import EXAMPLES_DIR

LLAMA = EXAMPLES_DIR / "tiny_llama.onnx"
ARCHITECTURE = {"attention": 2, "norm": 5, "rotary": 4, "gated_mlp": 2, "gelu": 0, "moe": 0, "recurrent": 0,
                "quant_matmul": 0, "qdq_matmul": 0}
FAMILY_PASS = {"attention": "fuse-attention", "norm": "fuse-rmsnorm", "rotary": "fuse-rope",
               "gated_mlp": "fuse-swiglu"}


def _ops(path, op_type):
    return [n for n in onnx.load(path).graph.node if n.op_type == op_type]


def test_every_candidate_of_the_shipped_llama_fuses():
    report = analyze_fusions(LLAMA)
    for family, n in ARCHITECTURE.items():
        c = report.coverage[family]
        assert (c["candidates"], c["fused"], c["refused"], c["items"]) == (n, n, {}, []), (family, c)
    assert report.skipped_fusions == {}


@pytest.mark.parametrize("family", ["attention", "rotary"])
def test_a_disabled_pass_lists_each_candidate_with_that_reason(family):
    report = analyze_fusions(LLAMA, disable_passes=(FAMILY_PASS[family],))
    c = report.coverage[family]
    n = ARCHITECTURE[family]
    reason = f"{FAMILY_PASS[family]} not in the pass pipeline (disabled)"
    assert (c["candidates"], c["fused"], c["refused"]) == (n, 0, {reason: n})
    assert [i["reason"] for i in c["items"]] == [reason] * n
    if family == "attention":  # the candidates are the model's own Softmax nodes, by name
        assert sorted(i["node"] for i in c["items"]) == sorted(s.name for s in _ops(LLAMA, "Softmax"))
    assert sorted(report.skipped_fusions[FAMILY_PASS[family]]) == sorted(
        f"{i['node']}: {reason}" for i in c["items"])
    for other, m in ARCHITECTURE.items():  # the other families are unaffected
        if other != family and other != "gated_mlp":
            assert report.coverage[other]["fused"] == m


def test_the_norm_family_judges_after_its_last_pass():
    """norm spans fuse-rmsnorm and fuse-layernorm: an RMSNorm left by a disabled fuse-rmsnorm is refused,
    and fuse-layernorm (still on) does not take it (it is not centred)."""
    report = analyze_fusions(LLAMA, disable_passes=("fuse-rmsnorm",))
    c = report.coverage["norm"]
    assert c["candidates"] == 5 and c["fused"] == 0 and len(c["items"]) == 5
    assert all(i["pass"] in ("fuse-rmsnorm", "fuse-layernorm") for i in c["items"])


def _attention(d: int):
    """One attention over q/k/v (B, 4, S, d) with a constant scale, no mask."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 4, "s", d]) for n in "qkv"]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"], name="scores"),
             helper.make_node("Mul", ["qk", "scale"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["p"], axis=-1, name="the_softmax"),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    graph = helper.make_graph(nodes, "a", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 4, "s", d])],
                              [numpy_helper.from_array(np.array(0.25, np.float32), "scale")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_refused_candidate_carries_the_check_reason(tmp_path):
    path = tmp_path / "a.onnx"
    onnx.save(_attention(40), path)
    report = analyze_fusions(path, simplify=False)
    c = report.coverage["attention"]
    assert c["candidates"] == 1 and c["fused"] == 0
    (item,) = c["items"]
    assert item["node"] == "the_softmax" and item["pass"] == "fuse-attention"
    assert "D a multiple of 16 and at most 512" in item["reason"] and "D=40" in item["reason"]
    assert report.skipped_fusions["fuse-attention"] == [f"the_softmax: {item['reason']}"]


def test_compile_prints_one_line_per_family(tmp_path):
    result = CliRunner().invoke(cli, ["compile", str(LLAMA), "-o", str(tmp_path / "m.mindir"), "--no-verify",
                                      "--disable-pass", "fuse-attention"])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    assert "attention 0/2 fused: 2 × fuse-attention not in the pass pipeline (disabled)" in lines
    assert "norm 5/5 fused" in lines and "rotary 4/4 fused" in lines
    report = json.loads(CliRunner().invoke(cli, [
        "compile", str(LLAMA), "-o", str(tmp_path / "n.mindir"), "--no-verify", "--json"]).output)
    assert report["coverage"]["attention"]["fused"] == 2


def test_inspect_fusions_shows_the_analysis_without_compiling(tmp_path):
    before = set(tmp_path.iterdir())
    result = CliRunner().invoke(cli, ["inspect", str(LLAMA), "--fusions", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert {k: v["fused"] for k, v in info["coverage"].items()} == ARCHITECTURE
    assert info["fusions"]["fuse-attention"] == 2
    text = CliRunner().invoke(cli, ["inspect", str(LLAMA), "--fusions", "--disable-pass", "fuse-rope"]).output
    assert "rotary 0/4 fused: 4 × fuse-rope not in the pass pipeline (disabled)" in text
    assert set(tmp_path.iterdir()) == before


def test_inspect_pass_options_need_fusions():
    result = CliRunner().invoke(cli, ["inspect", str(LLAMA), "--disable-pass", "fuse-rope"])
    assert result.exit_code == 1  # (main() prints the InputError as one line)
    assert "go with --fusions" in str(result.exception)


def test_every_fused_op_record_names_its_pass_and_family():
    """The fused-op table is the one record of each op's facts: its producer is a registered pass that is
    one of its coverage family's passes."""
    import passes
    from opmap.fused import FUSED_OPS
    from passes.coverage import FAMILIES

    registered = {p.name for p in passes.available_passes()}
    for op in FUSED_OPS.values():
        assert op.producer in registered, op.name
        assert op.producer in FAMILIES[op.family].passes, (op.name, op.family)
        assert op.likely_causes, op.name
