"""SimplifiedLayerNormalization and com.microsoft SkipSimplifiedLayerNormalization: decomposed on load into
the RMSNorm a PyTorch export writes (graphconv/frontend/contrib/norm.py), fused to mindspore::RmsNorm."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphconv.errors import UnsupportedError
from graphconv.frontend import contrib
from tests.contrib_utils import compile_verified, decomposition_matches, model

H = 16


def _gamma(name="gamma"):
    return numpy_helper.from_array(np.random.default_rng(1).uniform(0.5, 1.5, H).astype(np.float32), name)


def _skip_model(with_bias: bool, read_sum: bool = True):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])
    skip = helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "seq", H])
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])]
    inits = [_gamma()]
    ins = ["x", "skip", "gamma"]
    if with_bias:
        inits.append(numpy_helper.from_array(np.linspace(-1, 1, H).astype(np.float32), "bias"))
        ins.append("bias")
    node_outs = ["y", "", "", "sum" if read_sum else ""]
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ins, node_outs, domain="com.microsoft",
                              epsilon=1e-5, name="skipnorm")]
    if read_sum:
        nodes.append(helper.make_node("SimplifiedLayerNormalization", ["y", "gamma"], ["y2"], epsilon=1e-6,
                                      axis=-1, name="norm"))
        outs += [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["batch", "seq", H]),
                 helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["batch", "seq", H])]
    return model(nodes, [x, skip], outs, inits)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_normalization_decomposes_exactly(with_bias):
    m = _skip_model(with_bias)
    assert len(contrib.contrib_nodes(m)) == 2  # SimplifiedLayerNormalization is onnxruntime's, not onnx's
    _, counts = decomposition_matches(m)
    assert counts == {"com.microsoft::SkipSimplifiedLayerNormalization": 1, "SimplifiedLayerNormalization": 1}


def test_simplified_layer_normalization_over_two_axes_decomposes_exactly():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, H])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, H])
    g = numpy_helper.from_array(np.random.default_rng(2).uniform(0.5, 1.5, (4, H)).astype(np.float32), "g")
    m = model([helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], axis=1, epsilon=1e-5)],
              [x], [y], [g])
    decomposition_matches(m)


def test_a_named_but_unread_mean_is_no_refusal():
    """transformers' exporter with ort_fusions names every output of the norms it writes (mean, inv_std_var)
    and reads none but the first and the sum: an output nothing reads is not the model's to compute."""
    m = _skip_model(False)
    m.graph.node[0].output[1] = "mean"
    _, counts = decomposition_matches(m)
    assert counts == {"com.microsoft::SkipSimplifiedLayerNormalization": 1, "SimplifiedLayerNormalization": 1}


def test_reading_the_mean_of_a_simplified_norm_is_refused():
    m = _skip_model(False)
    m.graph.node[0].output[1] = "mean"
    m.graph.output.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, None))
    with pytest.raises(UnsupportedError, match="mean"):
        contrib.decompose(m)


def test_the_norms_compile_fused_to_rmsnorm_and_verify(tmp_path):
    report = compile_verified(_skip_model(True), tmp_path, target="ascend")
    assert report.fusions.get("fuse-rmsnorm") == 2
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["onnxruntime_contrib_ops_decomposed"] == {
        "com.microsoft::SkipSimplifiedLayerNormalization": 1, "SimplifiedLayerNormalization": 1}
    assert any("No Op registered for SimplifiedLayerNormalization" in w for w in report.warnings)
