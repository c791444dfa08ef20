"""Models below opset 13 (the model-zoo era: the CNNs shipped in onnx's own test data, opset 9) are upgraded on
load with onnx.version_converter and compiled; the oracle runs the model as given, so a converter fault is a
failed verification, not a silent difference."""

from __future__ import annotations

from pathlib import Path


import onnx
import pytest
from onnx import TensorProto, helper

import graphconv
from graphconv.errors import UnsupportedError, VerificationError
from graphconv.frontend import load

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
DEFAULT = ["light_squeezenet"]
SLOW = ["light_shufflenet", "light_resnet50", "light_densenet121", "light_inception_v1", "light_inception_v2",
        "light_bvlc_alexnet", "light_zfnet512", "light_vgg19"]


@pytest.mark.parametrize("name", DEFAULT + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_onnx_light_models_at_opset_9_compile_and_verify(name, tmp_path):
    path = LIGHT / f"{name}.onnx"
    assert load.default_opset(onnx.load(path)) == 9
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu")
    assert report.status == "verified"
    stage = next(s for s in report.stages if s.name == "load")
    assert stage.detail["upgraded_from_opset"] == 9
    assert any("opset 9 upgraded to 13" in w for w in report.warnings)
    for case in report.validation["cases"]:
        assert all(o["cosine"] > 0.9999 for o in case["outputs"])


def _relu_model(opset: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_the_oracle_runs_the_model_as_given(tmp_path, monkeypatch):
    """A converter that changed the function (Relu -> Sigmoid) is caught: the reference is the opset-9 model."""
    path = tmp_path / "relu9.onnx"
    onnx.save(_relu_model(9), path)
    assert graphconv.compile(path, tmp_path / "ok.mindir", target="cpu").status == "verified"

    def wrong(model):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        out.graph.node[0].op_type = "Sigmoid"
        out.opset_import[0].version = 13
        return out

    monkeypatch.setattr(load, "upgrade", wrong)
    with pytest.raises(VerificationError):
        graphconv.compile(path, tmp_path / "m.mindir", target="cpu")
    assert not (tmp_path / "m.mindir").exists()


def test_below_opset_7_is_refused_in_one_line(tmp_path):
    path = tmp_path / "relu6.onnx"
    onnx.save(_relu_model(6), path)
    with pytest.raises(UnsupportedError, match=r"opset 6 is outside the supported range 7-28"):
        graphconv.compile(path, tmp_path / "m.mindir")


def test_every_opset_onnx_defines_is_loaded():
    """The supported range ends at the newest opset the installed onnx defines (raise MAX_OPSET with onnx)."""
    assert load.MAX_OPSET == onnx.defs.onnx_opset_version()


@pytest.mark.parametrize("opset", [24, 28])
def test_opsets_above_23_compile_and_verify(tmp_path, opset):
    path = tmp_path / f"relu{opset}.onnx"
    onnx.save(_relu_model(opset), path)
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu")
    assert report.status == "verified"
    assert report.model["opset_imports"] == {"ai.onnx": opset}
