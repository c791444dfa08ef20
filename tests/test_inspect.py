"""graphconv inspect reads .onnx and .mindir files (a MindIR is never executed) with the compile report's
census definition."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx

import graphconv
from graphconv.tools.inspect import inspect
from models import EXAMPLES_DIR


def test_inspect_agrees_with_the_compile_report(tmp_path):
    out = tmp_path / "tiny.mindir"
    report = graphconv.compile(EXAMPLES_DIR / "tiny_llama.onnx", out, save_fused=tmp_path / "fused.onnx")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "inspect", str(out), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["primitives"] == report.census
    for prim, count in report.census.items():
        if prim in ("RmsNorm", "FlashAttentionScore", "RotaryPositionEmbedding", "Swiglu"):
            assert info["fused"][prim] == count
    assert [i["name"] for i in info["inputs"]] == ["input_ids", "attention_mask"]
    assert all(i["shape"] == [None, None] and i["dtype"] == "int64" for i in info["inputs"])
    original = onnx.load(EXAMPLES_DIR / "tiny_llama.onnx")
    n_params = sum(int(__import__("numpy").prod(t.dims)) for t in original.graph.initializer)
    assert info["parameters"] >= n_params - 64  # tiny constants may be literals in the network

    fused = inspect(tmp_path / "fused.onnx")
    assert fused["ops"]["mindspore::RmsNorm"] == report.fusions["fuse-rmsnorm"]
    assert fused["fused"]["RmsNorm"] == report.census["RmsNorm"]
    assert fused["opset_imports"]["mindspore"] == 1
    assert fused["inputs"][0]["shape"] == ["batch", "seq"]


def test_inspect_refuses_other_files(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hi")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "inspect", str(p)], capture_output=True, text=True)
    assert proc.returncode == 1 and "expected a .onnx or .mindir" in proc.stderr
    bad = tmp_path / "x.mindir"
    bad.write_bytes(b"\x00\x01garbage")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "inspect", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1 and "not a MindIR" in proc.stderr
