"""The plugin example in docs/ works as documented: --plugin, the entry-point group, verification."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import passes
from passes import manager

DOCS_EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def _model(path: Path) -> Path:
    nodes = [helper.make_node("Mul", ["x", "one"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                          [numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_cli_plugin_lists_and_runs_the_pass(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(DOCS_EXAMPLES)}
    listing = subprocess.run([sys.executable, "-m", "graphconv", "passes", "--plugin", "drop_mul_by_one"],
                             capture_output=True, text=True, env=env)
    assert listing.returncode == 0, listing.stderr
    assert "drop-mul-by-one" in listing.stdout and "[drop_mul_by_one]" in listing.stdout
    model = _model(tmp_path / "m.onnx")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(model), "--plugin", "drop_mul_by_one",
                           "--no-simplify", "--json", "--verify-each"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    import json
    report = json.loads(proc.stdout)
    assert report["fusions"]["drop-mul-by-one"] == 1
    assert report["provenance"]["plugins"] == ["drop_mul_by_one"]
    assert "Mul" not in report["census"]
    assert report["status"] == "verified"


def test_entry_point_group_loads_plugins(tmp_path, monkeypatch):
    sys.path.insert(0, str(DOCS_EXAMPLES))
    try:
        ep = importlib.metadata.EntryPoint("drop-mul-by-one", "drop_mul_by_one", manager.ENTRY_POINT_GROUP)
        real = importlib.metadata.entry_points
        monkeypatch.setattr(importlib.metadata, "entry_points",
                            lambda group=None: [ep] if group == manager.ENTRY_POINT_GROUP else real(group=group))
        assert passes.load_plugins() == ["drop_mul_by_one"]
        assert "drop-mul-by-one" in [p.name for p in passes.available_passes()]
        report = graphconv.compile(_model(tmp_path / "m.onnx"), tmp_path / "m.mindir", simplify=False,
                                   passes="drop-mul-by-one")
        assert report.fusions == {"drop-mul-by-one": 1}
    finally:
        sys.path.remove(str(DOCS_EXAMPLES))
        manager._PASSES.pop("drop-mul-by-one", None)  # keep the default pipeline of later tests unchanged
        sys.modules.pop("drop_mul_by_one", None)


@pytest.mark.parametrize("returned", ["0", "(0, [], {})"])
def test_cli_refuses_a_plugin_pass_that_returns_no_pass_result(tmp_path, returned):
    """A pass's apply returns a passes.PassResult, nothing else: a bare count or the old tuple is the
    plugin's error, in one line naming the pass and its module (exit code 1), never coerced."""
    (tmp_path / "bare_count.py").write_text(
        "from passes import register_pass\n\n\n"
        "@register_pass('bare-count', 'returns what a PassResult should hold')\n"
        f"def bare_count(model):\n    return {returned}\n")
    model = _model(tmp_path / "m.onnx")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(model), "-o", str(tmp_path / "m.mindir"),
                           "--plugin", "bare_count", "--no-simplify", "--quiet"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "'bare-count'" in lines[0] and "'bare_count'" in lines[0] and "PassResult" in lines[0], lines[0]
    assert not (tmp_path / "m.mindir").exists()
