"""Models below opset 13 (the model-zoo era: the CNNs shipped in onnx's own test data, opset 9) are upgraded on
load with onnx.version_converter and compiled; the oracle runs the model as given, so a converter fault is a
failed verification, not a silent difference."""

from __future__ import annotations

from pathlib import Path


import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.errors import UnsupportedError, VerificationError
from graphconv.frontend import load

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
DEFAULT = ["light_squeezenet"]
SLOW = ["light_shufflenet", "light_resnet50", "light_densenet121", "light_inception_v1", "light_inception_v2",
        "light_bvlc_alexnet", "light_zfnet512", "light_vgg19"]


def randomized(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """The model with informative weights and its logits as output. Its weights are all
    ConstantOfShape(0.02) (its shipped outputs are uniform whatever the input): each becomes a seeded random
    initializer of the same shape, weights of rank >= 2 ~ N(0, 1/fan_in) (He-like, so activations stay of
    order 1), BatchNormalization's scale and variance ~ U(0.5, 1.5) (a valid variance), other 1-D ones
    (biases, BatchNormalization's mean and offset) ~ N(0, 0.1^2), small beside the input's own signal. The final
    Softmax is cut off: a softmax over 1000 near-equal logits hides any difference."""
    rng = np.random.default_rng(seed)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    positive = {n.input[k] for n in model.graph.node if n.op_type == "BatchNormalization" for k in (1, 4)}
    nodes, replaced = [], []
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = [int(d) for d in inits[node.input[0]]]
            if len(shape) >= 2:
                value = rng.standard_normal(shape) / np.sqrt(max(int(np.prod(shape[1:])), 1))
            elif node.output[0] in positive:
                value = rng.uniform(0.5, 1.5, shape)
            else:
                value = 0.1 * rng.standard_normal(shape)
            replaced.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
        else:
            nodes.append(node)
    last = nodes[-1]
    assert len(model.graph.output) == 1
    if last.op_type == "Softmax":
        nodes = nodes[:-1]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(replaced)
    if model.ir_version < 4:  # IR 3: every initializer is also a graph input
        out.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in replaced)
    assert replaced, "the model has no ConstantOfShape weights to replace"
    if last.op_type == "Softmax":
        del out.graph.output[:]
        inferred = onnx.shape_inference.infer_shapes(model)  # the logits' shape, from the model as given
        out.graph.output.append(next(v for v in inferred.graph.value_info if v.name == last.input[0]))
    return out


@pytest.mark.parametrize("name", DEFAULT + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_onnx_light_models_at_opset_9_compile_and_verify(name, tmp_path):
    given = onnx.load(LIGHT / f"{name}.onnx")
    assert load.default_opset(given) == 9
    model = randomized(given)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu", atol=1e-4, rtol=1e-3)
    assert report.status == "verified"
    stage = next(s for s in report.stages if s.name == "load")
    assert stage.detail["upgraded_from_opset"] == 9
    assert any("opset 9 upgraded to 13" in w for w in report.warnings)
    # verified = every output within atol 1e-4 + rtol 1e-3 (the comparison rule) at both shapes
    assert len(report.validation["cases"]) == 2
    for case in report.validation["cases"]:
        assert all(out["cosine"] > 0.9999 for out in case["outputs"])


def test_randomized_weights_make_the_logits_informative():
    """The premise of the test above (onnxruntime): the shipped weights give the same logit for every class,
    the random ones distinct logits that change with the input."""
    import onnxruntime as ort

    given = onnx.load(LIGHT / f"{DEFAULT[0]}.onnx")
    image = next(i.name for i in given.graph.input if i.name not in {t.name for t in given.graph.initializer})
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)

    def logits(model, feed):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {image: feed})[0].reshape(-1)

    shipped = logits(given, x)  # softmax over equal logits
    assert np.ptp(shipped) < 1e-6
    random_weights = randomized(given)
    a, b = logits(random_weights, x), logits(random_weights, 3 * x + 1)
    assert a.std() > 1e-2 and np.abs(a - b).max() > 1e-2


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
