"""End to end: zoo models exported by PyTorch compile to a MindIR that matches onnxruntime on CPU.

The reference inputs use shapes other than the export shape (batch 2, seq 7): batch 3/5, seq 5/11.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import graphconv
from graphconv.verify import census

EXPORT_SHAPE = {"batch": 2, "seq": 7}


def _check_verified(report, max_abs=1e-5):
    assert report.status == "verified"
    assert report.validation["oracle"] == "onnxruntime"
    cases = report.validation["cases"]
    assert len(cases) == 2
    for case in cases:
        for out in case["outputs"]:
            assert out["ok"], out
            assert out["max_abs"] <= max_abs, out
            assert out["cosine"] > 0.99999
    shapes = [tuple(tuple(s) for s in c["inputs"].values()) for c in cases]
    assert shapes[0] != shapes[1]
    for case in cases:
        for shape in case["inputs"].values():
            assert shape[0] != EXPORT_SHAPE["batch"]


# dynamo exports at 18 and its down-conversion to 17 fails on Reduce* axes inputs (cnn, llama), so the
# opset-17 graphs come from the TorchScript exporter: genuinely opset 17, and a second exporter's spelling.
@pytest.mark.parametrize("opset,exporter", [(17, "torchscript"), (18, "dynamo")])
@pytest.mark.parametrize("name", ["mlp", "cnn", "llama"])
def test_zoo_model_compiles_and_matches_onnxruntime(name, opset, exporter, export_cache, tmp_path):
    onnx_path = export_cache(name, opset, exporter)
    out = tmp_path / f"{name}.mindir"
    report = graphconv.compile(onnx_path, out, target="cpu", report_path=tmp_path / "report.json")
    _check_verified(report)
    assert out.is_file() and out.stat().st_size > 0
    saved = json.loads((tmp_path / "report.json").read_text())
    for key in ("graphconv_version", "provenance", "model", "stages", "fusions", "census", "validation",
                "artifacts", "warnings"):
        assert key in saved
    assert saved["model"]["opset_imports"]["ai.onnx"] == opset
    # The census is read back from the written file, not from the compiler's memory.
    assert saved["census"] == census.primitive_census(out)
    # Symbolic dims survive: every graph input keeps its named dims.
    for inp in saved["model"]["inputs"]:
        assert any(isinstance(d, str) for d in inp["shape"])


def test_tiny_transformers_llama_matches_on_valid_positions(export_cache, tmp_path):
    pytest.importorskip("transformers")
    report = graphconv.compile(export_cache("hf-llama", 18), tmp_path / "llama.mindir", target="cpu")
    _check_verified(report)
    # Left padding is in the reference inputs, and padded positions were excluded from the comparison.
    case = report.validation["cases"][0]
    b, s = case["inputs"]["attention_mask"]
    assert case["outputs"][0]["compared"] == (b * s - 2) * 128


def test_ascend_target_writes_the_same_network_for_now(export_cache, tmp_path):
    report = graphconv.compile(export_cache("mlp", 18), tmp_path / "a.mindir")
    assert report.provenance["target"] == "ascend"
    _check_verified(report)


def test_emit_source_keeps_a_runnable_network_and_checkpoint(export_cache, tmp_path):
    src = tmp_path / "src"
    graphconv.compile(export_cache("mlp", 18), tmp_path / "m.mindir", target="cpu", emit_source=src)
    text = (src / "network.py").read_text()
    assert "class Network(nn.Cell)" in text
    # Parameters keep the ONNX initializer names (PyTorch state_dict names for Gemm weights).
    assert "'net.0.weight'" in text or "'layers.0.weight'" in text or "weight'" in text
    assert (src / "network.ckpt").stat().st_size > 0


def test_no_verify_reports_unverified(export_cache, tmp_path):
    report = graphconv.compile(export_cache("mlp", 18), tmp_path / "m.mindir", verify=False)
    assert report.status == "unverified"
    assert report.validation["status"] == "unverified"
    assert (tmp_path / "m.mindir").is_file()


def test_user_inputs_from_npz(export_cache, tmp_path):
    x = np.random.default_rng(3).standard_normal((6, 32)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    report = graphconv.compile(export_cache("mlp", 18), tmp_path / "m.mindir", inputs=(tmp_path / "in.npz",))
    assert [c["inputs"]["x"] for c in report.validation["cases"]] == [[6, 32]]
    assert report.status == "verified"


def test_cli_compiles_the_shipped_example(tmp_path):
    from models import EXAMPLES_DIR

    example = EXAMPLES_DIR / "tiny_llama.onnx"
    out = tmp_path / "tiny_llama.mindir"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(example), "-o", str(out),
                           "--target", "cpu", "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout
    assert out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "tiny_llama.mindir"]


def test_lstm_over_a_dynamic_sequence_compiles_for_both_targets(tmp_path):
    """A PyTorch LSTM exported with a dynamic sequence (what silero-vad and ddddocr's recognizers ship): the cpu
    target runs MindSpore's LSTM primitive, the ascend target DynamicRNN (fuse-lstm; its cpu twin the LSTM
    primitive), one call per direction; both verify at two sequence lengths. Without fuse-lstm the ascend
    target refuses in one line: the LSTM primitive has no Ascend kernel."""
    import torch

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 8, bidirectional=True).eval()
    path = tmp_path / "lstm.onnx"
    torch.onnx.export(lstm, (torch.randn(6, 2, 4),), str(path), input_names=["x"], output_names=["y", "h", "c"],
                      dynamic_axes={"x": {0: "seq", 1: "batch"}}, dynamo=False)
    for target, primitive in (("cpu", "LSTM"), ("ascend", "DynamicRNN")):
        report = graphconv.compile(path, tmp_path / f"{target}.mindir", target=target)
        _check_verified(report)
        assert len({c["inputs"]["x"][0] for c in report.validation["cases"]}) == 2
        assert report.census.get(primitive) == 2, report.census
    assert report.coverage["recurrent"]["fused"] == 1
    assert report.validation["ascend_precision"]["status"] == "ok"
    with pytest.raises(graphconv.UnsupportedError, match=r"MindSpore's LSTM primitive, which has CPU and GPU kernels "
                                                         r"only .*; --target cpu compiles this model"):
        graphconv.compile(path, tmp_path / "plain.mindir", target="ascend", disable_passes=("fuse-lstm",))
