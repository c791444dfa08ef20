"""The shared contracts: comparison rule, reference inputs, workspace isolation, census."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphconv.verify import compare, reference
from graphconv.workspace import PREFIX, Workspace, remove_stale


# --- comparison rule ---------------------------------------------------------------------------------
def test_rule_is_atol_plus_rtol_times_reference():
    ref = np.array([0.0, 100.0], np.float32)
    assert compare.compare(ref + np.array([0.9e-4, 0.0095], np.float32), ref, 1e-4, 1e-4).ok
    bad = compare.compare(ref + np.array([0.0, 0.0103], np.float32), ref, 1e-4, 1e-4)
    assert not bad.ok and bad.suspicious  # fails at 1x, holds at 100x


def test_rule_flags_far_off_values_as_not_suspicious():
    c = compare.compare(np.array([1.0]), np.array([2.0]), 1e-4, 1e-4)
    assert not c.ok and not c.suspicious
    assert c.max_abs == pytest.approx(1.0)


def test_integers_and_bools_must_match_exactly():
    assert not compare.compare(np.array([1, 2]), np.array([1, 3]), 10.0, 10.0).ok
    assert compare.compare(np.array([True, False]), np.array([True, False])).ok
    assert not compare.compare(np.array([True]), np.array([False])).ok


def test_non_finite_values_must_match_in_kind():
    ref = np.array([np.inf, -np.inf, np.nan, 1.0])
    assert compare.compare(ref.copy(), ref).ok
    assert not compare.compare(np.array([np.inf, np.inf, np.nan, 1.0]), ref).ok
    assert not compare.compare(np.array([np.inf, -np.inf, 0.0, 1.0]), ref).ok


def test_shape_mismatch_fails():
    c = compare.compare(np.zeros((2, 3)), np.zeros((3, 2)))
    assert not c.ok and "shape" in c.reason


def test_valid_mask_skips_padded_positions():
    ref = np.zeros((2, 3, 4))
    got = ref.copy()
    got[0, 0] = 5.0  # garbage at a padded position
    valid = np.ones((2, 3), bool)
    valid[0, 0] = False
    assert not compare.compare(got, ref).ok
    c = compare.compare(got, ref, valid=valid)
    assert c.ok and c.compared == 5 * 4


def test_cosine():
    a = np.array([1.0, 0.0])
    assert compare.compare(a, a).cosine == pytest.approx(1.0)
    assert compare.compare(np.array([0.0, 1.0]), a, 10, 10).cosine == pytest.approx(0.0)


# --- reference inputs --------------------------------------------------------------------------------
def _decoder_like():
    emb = numpy_helper.from_array(np.zeros((50, 8), np.float32), "emb")
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
             helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
             helper.make_node("Mul", ["h", "m3"], ["y"])]
    ax = numpy_helper.from_array(np.array([2], np.int64), "ax")
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])], [emb, ax])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_reference_cases_use_two_shapes_and_keep_dims_consistent():
    cases = reference.make_cases(_decoder_like())
    assert len(cases) == 2
    shapes = [c.inputs["input_ids"].shape for c in cases]
    assert shapes[0] != shapes[1]
    for c in cases:
        assert c.inputs["input_ids"].shape == c.inputs["attention_mask"].shape
        assert c.inputs["input_ids"].shape[0] not in (1, 2)  # not a typical export batch


def test_ids_stay_below_the_table_they_index():
    for c in reference.make_cases(_decoder_like()):
        ids = c.inputs["input_ids"]
        assert ids.min() >= 0 and ids.max() < 50 and ids.dtype == np.int64


def test_attention_mask_has_one_left_padded_row():
    for c in reference.make_cases(_decoder_like()):
        m = c.inputs["attention_mask"]
        assert m[0, 0] == 0 and m[0, -1] == 1
        assert (m[1:] == 1).all()
        out = np.zeros(m.shape + (8,))
        assert c.valid_positions(out).sum() == m.sum()


def test_dim_overrides_and_unknown_names():
    cases = reference.make_cases(_decoder_like(), dim_overrides={"seq": (4, 9)})
    assert [c.inputs["input_ids"].shape[1] for c in cases] == [4, 9]
    from graphconv.errors import InputError
    with pytest.raises(InputError, match="not symbolic dims"):
        reference.make_cases(_decoder_like(), dim_overrides={"sequence": (4, 9)})


def test_oracle_falls_back_to_onnx_reference_and_says_so():
    """A model onnxruntime refuses (an op ORT lacks at this opset) still gets an oracle."""
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 99  # ORT refuses IR versions it does not know; onnx.reference does not care
    oracle = reference.Oracle(m)
    out = oracle.run([reference.ReferenceCase("c", {"x": np.array([-1.0, 2.0], np.float32)})])
    assert oracle.name == "onnx.reference" and "onnxruntime could not run" in oracle.fallback_reason
    np.testing.assert_array_equal(out[0]["y"], [0.0, 2.0])


# --- workspace ---------------------------------------------------------------------------------------
def test_workspace_commits_all_artifacts_and_cleans_up(tmp_path):
    out = tmp_path / "m.mindir"
    with Workspace(out) as ws:
        a, b = ws.path("a"), ws.path("b")
        a.write_text("A")
        b.mkdir()
        (b / "data_0").write_text("B")
        ws.commit({a: out, b: tmp_path / "m_variables"})
    assert out.read_text() == "A" and (tmp_path / "m_variables" / "data_0").read_text() == "B"
    assert not list(tmp_path.glob(PREFIX + "*"))


def test_workspace_rolls_back_when_a_move_fails(tmp_path):
    out = tmp_path / "m.mindir"
    with Workspace(out) as ws:
        a = ws.path("a")
        a.write_text("A")
        with pytest.raises(Exception):
            ws.commit({a: out, ws.path("missing"): tmp_path / "other"})
    assert not out.exists()


def test_stale_workspaces_of_dead_runs_are_removed_but_live_ones_kept(tmp_path):
    live = Workspace(tmp_path / "x.mindir")
    dead = tmp_path / (PREFIX + "dead")
    dead.mkdir()
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (dead / "owner.json").write_text(json.dumps({"pid": int(proc.stdout), "created": 0.0}))
    try:
        removed = remove_stale(tmp_path)
        assert dead in removed and not dead.exists()
        assert live.dir.exists()
    finally:
        live.__exit__(None, None, None)
