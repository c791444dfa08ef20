"""Hostile inputs: each ends in a one-line error with a non-zero exit within seconds, no traceback, no output
file, no read outside the model's folder. Plus a property-based fuzz test over mutated small models."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphconv.errors import GraphconvError
from graphconv.frontend.load import load
from graphconv.compiler.lowering import unsupported_ops

F = TensorProto.FLOAT


def _io(name="x"):
    return helper.make_tensor_value_info(name, F, ["n", 4])


def _save_unchecked(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def _graph(nodes, inputs=("x",), outputs=("y",), inits=()):
    g = helper.make_graph(nodes, "g", [_io(i) for i in inputs], [_io(o) for o in outputs], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _corpus(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, a phrase the one-line error must contain)."""
    c = {}
    c["cycle"] = (_save_unchecked(_graph([helper.make_node("Add", ["x", "b"], ["a"]),
                                          helper.make_node("Relu", ["a"], ["b"]),
                                          helper.make_node("Identity", ["a"], ["y"])]), tmp / "cycle.onnx"),
                  "invalid ONNX model")
    c["duplicate-value-names"] = (_save_unchecked(_graph([helper.make_node("Relu", ["x"], ["y"]),
                                                          helper.make_node("Neg", ["x"], ["y"])]),
                                                  tmp / "dup.onnx"), "invalid ONNX model")
    c["dangling-input"] = (_save_unchecked(_graph([helper.make_node("Add", ["x", "ghost"], ["y"])]),
                                           tmp / "dangling.onnx"), "invalid ONNX model")
    huge = TensorProto(name="huge", data_type=F, dims=[1_000_000, 1_000_000])
    huge.raw_data = b"\0" * 16
    c["1e12-elements"] = (_save_unchecked(_graph([helper.make_node("Add", ["x", "huge"], ["y"])], inits=[huge]),
                                          tmp / "huge.onnx"), "declares 1000000000000 elements")
    unknown = _graph([helper.make_node("Mystery", ["x"], ["y"], domain="org.unknown")])
    unknown.opset_import.append(helper.make_opsetid("org.unknown", 1))
    c["unknown-domain"] = (_save_unchecked(unknown, tmp / "unknown.onnx"), "org.unknown::Mystery")
    c["wrong-magic"] = (tmp / "magic.onnx", "not an ONNX model")
    c["wrong-magic"][0].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    bad_name = _graph([helper.make_node("Relu", ["x"], ["y"])])
    data = bad_name.SerializeToString().replace(b"Relu", b"R\xffl\xfe")
    c["non-utf8-names"] = (tmp / "utf8.onnx", "graphconv: error")
    c["non-utf8-names"][0].write_bytes(data)
    return c


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize("name", ["cycle", "duplicate-value-names", "dangling-input", "1e12-elements",
                                  "unknown-domain", "wrong-magic", "non-utf8-names"])
def test_hostile_file_fails_cleanly_and_fast(corpus, name, tmp_path):
    path, phrase = corpus[name]
    out = tmp_path / "out.mindir"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(path), "-o", str(out), "-q"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphconv: error:"), proc.stderr
    assert phrase in lines[0]
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
    assert elapsed < 30


def test_escaping_external_data_is_never_opened(tmp_path):
    """The refusal happens before anything reads the referenced file: a FIFO outside the folder would block
    any reader forever."""
    secret = tmp_path / "fifo"
    os.mkfifo(secret)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    t = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    onnx.external_data_helper.set_external_data(t, location="../fifo", offset=0, length=64)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    path = _save_unchecked(_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], inits=[t]), model_dir / "m.onnx")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(path), "-q"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "location '../fifo' leaves the folder" in proc.stderr


# --- property-based fuzzing --------------------------------------------------------------------------
def _seed_model() -> bytes:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    return _graph(nodes, inits=[w]).SerializeToString()


SEED = _seed_model()
FUZZ_EXAMPLES = int(os.environ.get("GRAPHCONV_FUZZ_EXAMPLES", "300"))


@st.composite
def mutated(draw):
    data = bytearray(SEED)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 8))]
    return bytes(data)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated())
def test_fuzzed_models_only_fail_with_graphconv_errors(tmp_path, data):
    """The front half of compile (load, checks, op support, lowering) on mutated bytes: every failure is a
    GraphconvError (one line, exit code 1 at the CLI), never another exception (a traceback, exit code 3).
    GRAPHCONV_FUZZ_EXAMPLES=5000 runs thousands."""
    from graphconv.compiler.lowering import lower
    import onnx_ir as ir

    path = tmp_path / "fuzz.onnx"
    path.write_bytes(data)
    try:
        loaded = load(path)
        if not unsupported_ops(loaded.proto):
            lower(ir.from_proto(loaded.proto))
    except GraphconvError as e:
        assert "\n" not in str(e).strip()
