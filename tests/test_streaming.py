"""Models with external data compile with their weights left in their files (graphconv.frontend.weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import graphconv
from graphconv.frontend import weights
from graphconv.frontend.load import load
from models import EXAMPLES_DIR


@pytest.fixture(scope="module")
def external_llama(tmp_path_factory):
    """The shipped tiny Llama with every weight over 1 KiB in model.onnx.data."""
    d = tmp_path_factory.mktemp("external")
    onnx.save(onnx.load(EXAMPLES_DIR / "tiny_llama.onnx"), d / "model.onnx", save_as_external_data=True,
              location="model.onnx.data", size_threshold=1024)
    return d / "model.onnx"


def test_load_keeps_weights_in_their_file(external_llama):
    loaded = load(external_llama)
    refs = weights.external_refs(loaded.proto)
    data = external_llama.with_name("model.onnx.data")
    assert refs and all(r.path == str(data.resolve()) for r in refs.values())
    assert loaded.external_bytes == sum(r.length for r in refs.values()) > 200_000
    assert all(not t.raw_data for t in loaded.proto.graph.initializer if t.name in refs)  # nothing read
    # the memory map reads the same values onnx reads
    full = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(external_llama).graph.initializer}
    for name, ref in list(refs.items())[:5]:
        assert np.array_equal(weights.read(ref), full[name])
        assert np.array_equal(weights.read(ref, mmap=False), full[name])


def test_compile_reads_weights_in_place_and_verifies(external_llama, tmp_path):
    fused_path = tmp_path / "fused.onnx"
    report = graphconv.compile(external_llama, tmp_path / "m.mindir", save_fused=fused_path,
                               report_path=tmp_path / "r.json")
    assert report.status == "verified"
    stages = {s["name"]: s for s in json.loads((tmp_path / "r.json").read_text())["stages"]}
    assert stages["load"]["detail"]["external_weight_bytes"] > 200_000
    # the export child read the weights from the model's own file: nothing was copied for it
    assert stages["emit"]["detail"]["weights_read_from_files_bytes"] > 200_000
    assert report.census.get("RmsNorm") == 5 and report.census.get("FlashAttentionScore") == 2
    # --save-fused writes a model that stands on its own (weights copied beside it), and it runs
    import onnxruntime as ort

    assert fused_path.with_name("fused.onnx.data").is_file()
    ort.InferenceSession(str(fused_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.onnx", "fused.onnx.data", "m.mindir", "r.json"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_weights_made_by_passes_leave_memory(external_llama, tmp_path, monkeypatch, precision):
    """fuse-swiglu's merged gate/up weights leave memory after the passes (threshold lowered so the tiny
    model's qualify): made of weights in the model's file, they are written nowhere, only named with their
    parts. The compile still verifies (with --precision fp16 too, which casts them), and --save-fused writes
    the merged weights' values: its model runs and gives the original's outputs."""
    import onnxruntime as ort

    monkeypatch.setattr(weights, "SPILL_MIN_BYTES", 4096)
    fused_path = tmp_path / "fused" / "fused.onnx"
    fused_path.parent.mkdir()
    report = graphconv.compile(external_llama, tmp_path / "m.mindir", precision=precision,
                               report_path=tmp_path / "r.json", save_fused=fused_path)
    assert report.status == "verified"
    stages = {s["name"]: s for s in json.loads((tmp_path / "r.json").read_text())["stages"]}
    assert stages["passes"]["detail"]["concatenated_bytes"] == 2 * 64 * 256 * 4  # two merged [gate; up] weights
    assert stages["passes"]["detail"]["spilled_bytes"] == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".graphconv-tmp")] == []
    if precision == "fp32":
        ids = np.array([[3, 1, 4, 1, 5, 9, 2]], np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        want = ort.InferenceSession(str(external_llama)).run(None, feeds)
        got = ort.InferenceSession(str(fused_path)).run(None, feeds)
        np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=1e-4)


def test_stripped_model_runs_with_memory_mapped_feeds(external_llama):
    loaded = load(external_llama)
    bare, refs = weights.stripped(loaded.proto)
    assert not any(t.name in refs for t in bare.graph.initializer)
    assert {i.name for i in bare.graph.input} >= set(refs)
    assert bare.ByteSize() < 200_000  # the graph alone
    restored = weights.restore(bare, loaded.proto, refs)
    assert {t.name for t in restored.graph.initializer} >= set(refs)


def test_progress_is_silent_off_a_terminal_and_can_be_forced(external_llama, tmp_path):
    def cmd(out):
        return [sys.executable, "-m", "graphconv", "compile", str(external_llama), "-o", str(out), "--no-verify",
                "--no-simplify"]

    quiet = subprocess.run(cmd(tmp_path / "a.mindir"), capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "[" not in quiet.stderr
    forced = subprocess.run(cmd(tmp_path / "b.mindir"), capture_output=True, text=True, timeout=300,
                            env={**os.environ, "GRAPHCONV_PROGRESS": "1"})
    assert forced.returncode == 0
    assert "emit (mindspore.export)" in forced.stderr
    assert "weights into MindSpore:" in forced.stderr and "ETA" in forced.stderr


def test_a_held_progress_line_waits_for_its_event_and_keeps_its_rate():
    """A tracker whose step runs beside another step's line (the emit child beside the oracle) prints nothing
    while `hold` is unset; once set, its line counts the rate from the first unit done, not from the release."""
    import io
    import threading
    import time

    from graphconv.progress import Progress

    stream = io.StringIO()
    tracker = Progress(stream=stream).track("weights into MindSpore", 100, unit="")
    tracker.hold = threading.Event()
    tracker.update(10)
    time.sleep(0.6)
    tracker.update(50)
    assert stream.getvalue() == ""
    tracker.hold.set()
    tracker.update(60)
    line = stream.getvalue().strip()
    assert line.startswith("weights into MindSpore: 60 / 100 (60%)")
    rate = float(line.split(", ")[1].split("/s")[0].replace(",", ""))
    assert rate < 200  # 60 units over >= 0.6 s; counted from the release it would be thousands per second
