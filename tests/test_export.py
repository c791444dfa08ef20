"""graphconv export: the PyTorch front end and its guards."""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest
import torch

import graphconv
from graphconv.frontend.export import export_pytorch


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2 + x.shape[0]


def test_cli_exports_a_zoo_factory_with_dynamic_dims(tmp_path):
    out = tmp_path / "mlp.onnx"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "export", "models.mlp:build", "-o", str(out),
                           "--opset", "18"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "second shape" in proc.stdout
    model = onnx.load(out)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.onnx"]


def test_result_is_checked_against_pytorch_at_two_shapes(tmp_path):
    result = export_pytorch(Doubler(), {"x": torch.randn(3, 4)}, tmp_path / "d.onnx", {"x": {0: "batch"}},
                            opset=18, exporter="dynamo")
    shapes = {c["shape"]: c["inputs"]["x"] for c in result.checks}
    assert shapes["export shape"] == [3, 4] and shapes["second shape"][0] != 3
    assert all(c["ok"] for c in result.checks)


def test_batch_one_example_is_refused(tmp_path):
    with pytest.raises(graphconv.InputError, match="size 1 on dynamic axis 0"):
        export_pytorch(Doubler(), {"x": torch.randn(1, 4)}, tmp_path / "d.onnx", {"x": {0: "batch"}})
    assert not list(tmp_path.iterdir())


def test_models_returning_dicts_are_refused_with_a_hint(tmp_path):
    class Dicty(torch.nn.Module):
        def forward(self, x):
            return {"y": x}

    with pytest.raises(graphconv.UnsupportedError, match="returns a dict"):
        export_pytorch(Dicty(), {"x": torch.randn(2, 4)}, tmp_path / "d.onnx")


def test_eval_mode_is_forced(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.9)).train()
    result = export_pytorch(m, {"input": torch.randn(3, 4)}, tmp_path / "d.onnx", {"input": {0: "batch"}},
                            exporter="torchscript")
    assert not m.training
    assert all(c["ok"] for c in result.checks)  # with dropout active the comparison would fail


def test_unknown_exporter_and_opset_are_refused(tmp_path):
    with pytest.raises(graphconv.InputError, match="unknown exporter"):
        export_pytorch(Doubler(), {"x": torch.randn(2, 4)}, tmp_path / "d.onnx", exporter="jit")
    with pytest.raises(graphconv.InputError, match="opset 12"):
        export_pytorch(Doubler(), {"x": torch.randn(2, 4)}, tmp_path / "d.onnx", opset=12)


def test_an_exporter_failure_prints_nothing_on_stdout(tmp_path):
    """TorchScript's C++ logger dumps the whole Torch IR graph on fd 1 when it fails (146 KB for this model,
    measured): `--json` output owns stdout, so the dump is dropped and the error is one line."""
    pytest.importorskip("transformers")
    out = tmp_path / "glm4.onnx"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "export", "hf/glm4", "-o", str(out), "--exporter",
                           "torchscript", "--opset", "17", "--json"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Torch IR graph" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("graphconv: error: PyTorch's torchscript exporter")
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_by_torch_onnx_names_its_cause(tmp_path):
    """A rotary embedding on complex tensors (Llama 4's spelling) is refused by torch.onnx's dynamo exporter
    with a first line that says only which step failed ("... Next steps:"); the one-line error carries the
    innermost cause: the op with no ONNX function, and why."""
    from graphconv.errors import UnsupportedError

    class ComplexRotary(torch.nn.Module):
        def forward(self, x):
            c = torch.view_as_complex(x.reshape(x.shape[0], -1, 2))
            return torch.view_as_real(c.unsqueeze(0) * c).flatten(1)

    with pytest.raises(UnsupportedError) as e:
        export_pytorch(ComplexRotary(), {"x": torch.randn(3, 8)}, tmp_path / "m.onnx", exporter="dynamo", opset=18,
                       check=False)
    text = str(e.value)
    assert text.startswith("PyTorch's dynamo exporter refused the model at opset 18: Failed to convert")
    assert "Cause: No ONNX function found for <OpOverload(op='aten.unsqueeze'" in text, text
    assert "\n" not in text and "\x1b" not in text and not (tmp_path / "m.onnx").exists()
