"""graphconv debug names the first divergent node."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import opmap
from graphconv.verify.debug import debug
from models import EXAMPLES_DIR


def _small(path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Relu", ["h"], ["r"], name="act"),
             helper.make_node("Softmax", ["r"], ["p"], name="probs", axis=-1),
             helper.make_node("Mul", ["p", "r"], ["y"], name="scale")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                          [numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32),
                                                   "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_a_wrong_op_mapping_is_named(tmp_path, monkeypatch):
    """Softmax lowered over the wrong axis on purpose: debug must blame `probs`, not its consumers."""
    handler = opmap.registry.lookup("", "Softmax", 18)
    wrong = opmap.registry.Handler("", "Softmax", 13, lambda n: n.call("ops.softmax", n.x(0), 0))
    monkeypatch.setitem(opmap.registry._HANDLERS, ("", "Softmax"), [wrong])
    report = debug(_small(tmp_path / "m.onnx"))
    assert report.first_divergent == "probs"
    by_node = {r.node: r for r in report.rows}
    assert by_node["proj"].status == "ok" and by_node["act"].status == "ok"
    assert by_node["probs"].status in ("fail", "suspicious") and "axis" in by_node["probs"].likely_causes
    assert handler is not None


def test_all_agree_and_json_has_first_divergent_null(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "graphconv", "debug", str(_small(tmp_path / "m.onnx")), "--json",
                           "--save", str(tmp_path / "pairs")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["first_divergent"] is None
    assert [r["node"] for r in out["rows"]] == ["proj", "act", "probs", "scale"]
    a = np.load(tmp_path / "pairs" / "p.onnxruntime.npy")
    b = np.load(tmp_path / "pairs" / "p.mindspore.npy")
    assert a.shape == b.shape and np.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("pass_spec,min_compared", [("", 140), (None, 60)])
def test_tiny_llama_every_node_within_1e_5(pass_spec, min_compared):
    """Unfused (every ONNX node compared) and with the default pipeline (fused ops at their outputs)."""
    report = debug(EXAMPLES_DIR / "tiny_llama.onnx", atol=1e-5, rtol=1e-5, pass_spec=pass_spec)
    assert report.first_divergent is None
    compared = [r for r in report.rows if r.status != "fused"]
    assert len(compared) >= min_compared and all(r.status == "ok" for r in compared)
    assert max(r.max_abs for r in compared) <= 1e-5
    assert any(r.status == "fused" for r in report.rows) == (pass_spec is None)


def test_fp16_overflow_is_named(tmp_path):
    """x in [1, 3] -> proj (identity weights) -> big = proj * 3e4 reaches 9e4, past fp16's 65504: inf in fp16,
    finite in fp32. Then * 1e-4 and Exp bring it back to ordinary values. debug --precision fp16 must blame
    `big`, the node that overflows, and nothing before it."""
    eye = np.eye(8, dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Mul", ["h", "big_c"], ["big"], name="big"),
             helper.make_node("Mul", ["big", "small_c"], ["small"], name="small"),
             helper.make_node("Exp", ["small"], ["y"], name="exp")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                          [numpy_helper.from_array(eye, "w"),
                           numpy_helper.from_array(np.array(3e4, np.float32), "big_c"),
                           numpy_helper.from_array(np.array(1e-4, np.float32), "small_c")])
    path = tmp_path / "overflow.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).uniform(1.0, 3.0, (4, 8)).astype(np.float32))

    at_fp32 = debug(path, tmp_path / "x.npz")
    assert at_fp32.first_divergent is None  # the model itself is fine
    report = debug(path, tmp_path / "x.npz", precision="fp16")
    assert report.first_divergent == "big"
    by_node = {r.node: r for r in report.rows}
    assert by_node["proj"].status == "ok"
    assert by_node["big"].status == "fail" and "inf/NaN" in by_node["big"].reason
    assert "overflow" in by_node["big"].likely_causes
