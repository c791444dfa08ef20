"""Bad input: one line naming the problem, exit code 1, no traceback, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import EXAMPLES_DIR


def _model(opset=18, nodes=None, extra_opsets=(), initializers=()):
    nodes = nodes or [helper.make_node("Relu", ["x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "graphconv", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


def assert_clean_failure(proc, directory: Path, before: set[str], *needles: str, code: int = 1):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("graphconv: error:"), lines[0]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert {p.name for p in directory.iterdir()} == before, "the run left files behind"


def compile_fails(path: Path, *needles: str):
    before = {p.name for p in path.parent.iterdir()}
    proc = run_cli("compile", path, "-q")
    assert_clean_failure(proc, path.parent, before, *needles)


def test_missing_file(tmp_path):
    compile_fails(tmp_path / "nope.onnx", "no such file")


def test_zero_byte_file(tmp_path):
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    compile_fails(p, "empty file")


@pytest.mark.parametrize("content", [b"hello, this is not a model\n", bytes(range(256)) * 7],
                         ids=["text", "random-bytes"])
def test_not_an_onnx_file(tmp_path, content):
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    compile_fails(p, "not an ONNX model")


def test_truncated_file(tmp_path):
    data = (EXAMPLES_DIR / "tiny_llama.onnx").read_bytes()
    p = tmp_path / "truncated.onnx"
    p.write_bytes(data[: len(data) // 2])
    compile_fails(p, "truncated.onnx")


def test_unknown_ops_are_all_reported_at_once(tmp_path):
    nodes = [helper.make_node("Frobnicate", ["x"], ["t"], domain="com.example"),
             helper.make_node("Warp", ["t"], ["y"], domain="com.example")]
    p = tmp_path / "custom.onnx"
    onnx.save(_model(nodes=nodes, extra_opsets=[helper.make_opsetid("com.example", 1)]), p)
    compile_fails(p, "2 unsupported op(s)", "com.example::Frobnicate", "com.example::Warp")


@pytest.mark.parametrize("opset", [5, 6])  # 7-12 are upgraded on load (tests/test_old_opsets.py)
def test_opset_below_the_supported_range(tmp_path, opset):
    p = tmp_path / "old.onnx"
    onnx.save(_model(opset=opset), p)
    compile_fails(p, f"opset {opset}", "7-28")


def test_opset_above_the_supported_range(tmp_path):
    p = tmp_path / "new.onnx"
    m = _model(opset=23)
    m.opset_import[0].version = 29
    m.ir_version = 13
    onnx.save(m, p)
    compile_fails(p, "opset 29", "7-28")


def _external_model(tmp_path: Path, location: str) -> Path:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    m = _model(nodes=[helper.make_node("MatMul", ["x", "w"], ["y"])], initializers=[w])
    d = tmp_path / "model"
    d.mkdir()
    p = d / "m.onnx"
    onnx.save(m, p, save_as_external_data=True, location="m.data", size_threshold=0)
    return relocate_external_data(p, location)


def relocate_external_data(path: Path, location: str) -> Path:
    """The model at `path` with its first initializer's external data location rewritten to `location`."""
    m = onnx.load(path, load_external_data=False)
    for entry in m.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(m, path)
    return path


def test_missing_external_data(tmp_path):
    p = _external_model(tmp_path, "m.data")
    (p.parent / "m.data").unlink()
    compile_fails(p, "'w'", "missing")


def test_short_external_data(tmp_path):
    p = _external_model(tmp_path, "m.data")
    (p.parent / "m.data").write_bytes(b"\0" * 10)
    compile_fails(p, "shorter than declared")


def test_external_data_escaping_the_model_folder(tmp_path):
    p = _external_model(tmp_path, "../secret.data")
    (tmp_path / "secret.data").write_bytes(b"\0" * 64)
    compile_fails(p, "'../secret.data' leaves the folder")


def test_external_data_with_an_absolute_location(tmp_path):
    target = tmp_path / "abs.data"
    target.write_bytes(b"\0" * 64)
    p = _external_model(tmp_path, str(target))
    compile_fails(p, "is absolute")


def test_external_data_loads_when_it_is_safe(tmp_path):
    """The positive twin of the tests above: the same model with a proper location compiles."""
    p = _external_model(tmp_path, "m.data")
    proc = run_cli("compile", p, "-q", "--target", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert (p.parent / "m.mindir").is_file()


def test_usage_errors_exit_1(tmp_path):
    proc = run_cli("compile", tmp_path / "x.onnx", "--target", "gpu")
    assert proc.returncode == 1
    assert proc.stderr.startswith("graphconv: error:")


def _compile_with_relu_as_sigmoid(model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`graphconv compile MODEL -q --report tmp_path/r.json` with a wrong lowering (Relu lowered as Sigmoid, a
    plugin module the children import too)."""
    plugin = tmp_path / "wrong_relu.py"
    plugin.write_text("import opmap\nfrom opmap.registry import register\n"
                      "register('Relu', since=1)(lambda n: n.call('ops.sigmoid', n.x(0)))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = "import wrong_relu, sys; from graphconv.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, "compile", str(model), "-q",
                           "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=env)


def test_a_verification_failure_of_many_outputs_is_one_short_line(tmp_path):
    """Every output wrong at both shapes (Relu lowered as Sigmoid), with 6 inputs: the error names the first 3
    failures, each with its first 4 inputs' shapes, and counts the rest; report.json keeps every comparison."""
    xs = [f"x{i}" for i in range(6)]
    nodes = [helper.make_node("Sum", xs, ["s"])] + \
        [helper.make_node("Relu", ["s"], [f"r{k}"]) for k in range(4)] + \
        [helper.make_node("Add", [f"r{k}", xs[k]], [f"y{k}"]) for k in range(4)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", 4]) for x in xs],
                              [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, ["n", 4]) for k in range(4)])
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), p)
    proc = _compile_with_relu_as_sigmoid(p, tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.count("elements exceed") == 3 and "and 5 more outputs or cases" in line, line
    assert "x0[" in line and "x3[" in line and "x4[" not in line and "and 2 more inputs" in line
    saved = json.loads((tmp_path / "r.json").read_text())
    assert sum(not o["ok"] for c in saved["validation"]["cases"] for o in c["outputs"]) == 8


def test_output_directory_must_exist(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(_model(), p)
    before = {x.name for x in tmp_path.iterdir()}
    proc = run_cli("compile", p, "-o", tmp_path / "missing" / "m.mindir")
    assert_clean_failure(proc, tmp_path, before, "does not exist")


def test_verification_failure_exits_2_and_writes_only_the_report(tmp_path, monkeypatch):
    """A wrong lowering (Relu lowered as Sigmoid, patched in a child-visible way) fails verification."""
    p = tmp_path / "m.onnx"
    onnx.save(_model(), p)
    proc = _compile_with_relu_as_sigmoid(p, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "verification failed" in proc.stderr and "'y'" in proc.stderr
    assert not (tmp_path / "m.mindir").exists()
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["status"] == "failed" and saved["exit_code"] == 2 and "verification failed" in saved["error"]
    assert not list(tmp_path.glob(".graphconv-tmp-*"))


def test_the_command_skips_the_teardown_and_keeps_exit_code_and_exit_handlers(tmp_path):
    """graphconv.cli.run (the console script, `python -m graphconv`): main()'s exit code and one-line error,
    exit handlers run, and no module teardown (an object a module holds is never finalized: its release
    took 0.6-0.9 s after a 1.1B compile)."""
    script = ("import atexit, sys\n"
              "from graphconv.cli import run\n"
              "class Held:\n"
              "    def __del__(self): print('torn down', flush=True)\n"
              "held = Held()\n"
              "atexit.register(print, 'exit handler ran')\n"
              "sys.argv = ['graphconv', *sys.argv[1:]]\n"
              "run()\n")
    ok = subprocess.run([sys.executable, "-c", script, "--version"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == ["graphconv, version " + __import__("graphconv").__version__, "exit handler ran"]
    bad = subprocess.run([sys.executable, "-c", script, "compile", str(tmp_path / "missing.onnx")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout.splitlines() == ["exit handler ran"]
    assert bad.stderr.strip().splitlines() == [f"graphconv: error: {tmp_path / 'missing.onnx'}: no such file"]
    # the same script ending as Python ends (main's SystemExit): the teardown finalizes what the module holds
    plain = subprocess.run([sys.executable, "-c", script.replace("run()", "from graphconv.cli import main\nmain()"),
                            "--version"], capture_output=True, text=True)
    assert plain.returncode == 0 and "torn down" in plain.stdout
