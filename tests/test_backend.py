"""graphconv.tools.backend as an ONNX backend: onnx's own BackendTest runner on a handful of node tests (MindSpore on
CPU, through the long-lived child), and the Backend API itself (prepare / run / run_model / run_node, caching, opset
upgrade, compile-time inputs, refusals)."""

from __future__ import annotations

import re
import unittest

import numpy as np
import onnx
import pytest
from onnx import helper as oh
from onnx.backend.test import BackendTest

import graphconv.tools.backend as backend
from graphconv.errors import UnsupportedError

# onnx's runner, exactly as for onnxruntime.backend; only these node tests are kept (the full suite is
# `graphconv conformance`). CUDA variants are skipped by supports_device.
_INCLUDE = re.compile(r"^test_(abs|add_bcast|relu|softmax_axis_1|matmul_2d|reduce_sum_keepdims_example|"
                      r"conv_with_strides_padding|and_bcast3v1d|resize_upsample_scales_linear|"
                      r"layer_normalization_2d_axis0|gather_elements_negative_indices|sce_mean_weight)_cpu$")
_backend_test = BackendTest(backend, __name__)
OnnxBackendNodeModelTest = _backend_test.test_cases["OnnxBackendNodeModelTest"]
for _name in [n for n in vars(OnnxBackendNodeModelTest) if n.startswith("test_")]:
    if not _INCLUDE.search(_name):
        delattr(OnnxBackendNodeModelTest, _name)


def test_backend_test_kept_the_selection():
    kept = [n for n in vars(OnnxBackendNodeModelTest) if n.startswith("test_")]
    assert len(kept) == 12, kept


def _model(nodes, inputs, outputs, opset=17, inits=()):
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(inits))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])


def _vi(name, elem, shape):
    return oh.make_tensor_value_info(name, elem, shape)


F = onnx.TensorProto.FLOAT
I64 = onnx.TensorProto.INT64


def test_prepare_run_list_dict_and_cache():
    model = _model([oh.make_node("Add", ["a", "b"], ["y"])], [_vi("a", F, [2, 3]), _vi("b", F, [3])],
                   [_vi("y", F, [2, 3])])
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2, 3], np.float32)
    rep = backend.prepare(model, "CPU")
    (y,) = rep.run([a, b])
    np.testing.assert_array_equal(y, a + b)
    networks = len(backend._STATE.networks)
    y2 = backend.run_model(model, {"a": a, "b": b})  # a new prepare of the same model: nothing compiled again
    np.testing.assert_array_equal(y2["y"], a + b)
    assert len(backend._STATE.networks) == networks


def test_run_node():
    node = oh.make_node("Softmax", ["x"], ["y"], axis=-1)
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    (y,) = backend.run_node(node, [x])
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_supports_device():
    assert backend.supports_device("CPU")
    assert not backend.supports_device("CUDA")


def test_old_opset_is_upgraded():
    """Node tests build each op at its since_version: And is opset 7."""
    model = _model([oh.make_node("And", ["a", "b"], ["y"])], [_vi("a", onnx.TensorProto.BOOL, [4]),
                   _vi("b", onnx.TensorProto.BOOL, [4])], [_vi("y", onnx.TensorProto.BOOL, [4])], opset=7)
    a, b = np.array([1, 0, 1, 0], bool), np.array([1, 1, 0, 0], bool)
    (y,) = backend.run_model(model, [a, b])
    np.testing.assert_array_equal(y, a & b)


def test_opset_above_28_is_refused():
    model = _model([oh.make_node("Abs", ["x"], ["y"])], [_vi("x", F, [2])], [_vi("y", F, [2])], opset=29)
    with pytest.raises(UnsupportedError, match="opset 29 is outside the supported range 7-28"):
        backend.prepare(model)


def test_unsupported_op_is_refused_at_prepare():
    model = _model([oh.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
                   [_vi("x", F, [4])], [_vi("y", F, [4])], opset=17)
    model.opset_import.append(oh.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedError, match="com.example"):
        backend.prepare(model)


def test_compile_time_inputs_are_bound_per_value():
    """ReduceSum's axes come as a graph input: bound to the value given, compiled once per distinct value."""
    model = _model([oh.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
                   [_vi("x", F, [2, 3, 4]), _vi("axes", I64, [1])], [_vi("y", F, ["a", "b"])], opset=13)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    rep = backend.prepare(model)
    for axis in (1, 2, 1):
        (y,) = rep.run([x, np.array([axis], np.int64)])
        np.testing.assert_allclose(y, x.sum(axis=axis), rtol=1e-5, atol=1e-6)
        assert rep.bound == ["axes"]


def test_inputs_are_never_all_bound():
    """Range with every input given at run time lowers as it is: binding would let the lowering fold the node
    (onnx.reference would compute it instead of MindSpore)."""
    model = _model([oh.make_node("Range", ["a", "b", "c"], ["y"])],
                   [_vi("a", I64, []), _vi("b", I64, []), _vi("c", I64, [])], [_vi("y", I64, ["n"])], opset=13)
    rep = backend.prepare(model)
    (y,) = rep.run([np.array(1), np.array(9), np.array(3)])
    np.testing.assert_array_equal(y, np.arange(1, 9, 3))
    assert rep.bound == []


def test_bindable_refuses_when_the_node_would_be_constant():
    model = _model([oh.make_node("Tile", ["x", "r"], ["y"])], [_vi("x", I64, [2]), _vi("r", I64, [1])],
                   [_vi("y", I64, ["n"])], opset=13)
    loaded = backend.load_model(model, backend._STATE.dir() / "bind-check")
    err = UnsupportedError(f"node {loaded.graph.node[0].name!r} (Tile): Tile repeats must be a constant")
    assert backend._bindable(loaded, err, {"x": np.array([1, 2]), "r": np.array([2])}, set()) == ["r"]
    assert backend._bindable(loaded, err, {"x": np.array([1, 2]), "r": np.array([2])}, {"x"}) == []


if __name__ == "__main__":
    unittest.main()
