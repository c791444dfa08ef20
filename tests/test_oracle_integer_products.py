"""The oracle's integer products (graphconv/verify/integer_products.py): onnxruntime's u8s8 kernel adds each pair
of u8 x s8 products in a saturating int16 on x86 without VNNI, so the oracle hands onnxruntime a copy of the
model with those nodes rewritten to exact int32 arithmetic. The inputs here make adjacent pairs exceed 32767
(255 * 127 + 255 * 127); the expected values are numpy's, in int64. On a CPU with VNNI onnxruntime's own kernel
is exact too: what fails here if the rewrite goes is the check that onnxruntime was handed no saturating op."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphconv.verify import integer_products, reference

INT16_MAX = 32767


def _model(node, inputs, initializers, opset=17, microsoft=False):
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if microsoft else [])
    graph = helper.make_graph([node], "g", inputs, [onnx.ValueInfoProto(name="y")], initializers)
    return helper.make_model(graph, opset_imports=imports, ir_version=9)


def _run(m, feeds, monkeypatch):
    """The oracle's output `y`, and the ops of every model the oracle handed onnxruntime."""
    handed = []
    session = reference.ort_session

    def spy(model):
        handed.append(onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model))
        return session(model)

    monkeypatch.setattr(reference, "ort_session", spy)
    oracle = reference.Oracle(m)
    out = oracle.run([reference.ReferenceCase("c", feeds)])[0]["y"]
    assert oracle.name == "onnxruntime" and handed
    return out, oracle, {(n.domain, n.op_type) for h in handed for n in h.graph.node}


def _max_pair(a_rows: np.ndarray, b_cols: np.ndarray) -> int:
    """The largest |a[k] * b[k] + a[k + 1] * b[k + 1]| over the even pairs along K (the int16 sums of VPMADDUBSW)."""
    p = a_rows.astype(np.int64)[:, :, None] * b_cols.astype(np.int64)[None, :, :]  # [M, K, N]
    k = p.shape[1] // 2 * 2
    return int(np.abs(p[:, 0:k:2] + p[:, 1:k:2]).max())


def test_matmul_integer_is_exact_where_int16_pair_sums_would_saturate(monkeypatch):
    rng = np.random.default_rng(0)
    k, n = 32, 6
    a = rng.integers(0, 256, (4, k)).astype(np.uint8)
    a[0] = 255  # row 0 against column 0 (all 127) and column 1 (all -128): every pair beyond int16
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    b[:, 0], b[:, 1] = 127, -128
    a_zp, b_zp = np.uint8(0), np.int8(0)
    assert _max_pair(a, b) > INT16_MAX
    m = _model(helper.make_node("MatMulInteger", ["a", "b", "a_zp", "b_zp"], ["y"]),
               [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", k])],
               [numpy_helper.from_array(b, "b"), numpy_helper.from_array(a_zp, "a_zp"),
                numpy_helper.from_array(b_zp, "b_zp")])
    before = m.SerializeToString()
    y, oracle, ops = _run(m, {"a": a}, monkeypatch)
    exact = (a.astype(np.int64) - int(a_zp)) @ (b.astype(np.int64) - int(b_zp))
    assert y.dtype == np.int32 and np.array_equal(y, exact)
    assert exact[0, 0] == 255 * 127 * k  # (what saturating pairs could not give: 32767 * k / 2 at most)
    assert ("", "MatMulInteger") not in ops and ("", "MatMul") in ops
    assert oracle.exact == {"MatMulInteger": 1}
    assert reference.exact_note(oracle.exact) == ("MatMulInteger (1 node) computed exactly in int32 by the oracle "
                                                  "(onnxruntime's u8s8 kernel can saturate on x86 without VNNI)")
    assert m.SerializeToString() == before  # the user's model is not changed


def test_matmul_integer_zero_points_per_column_and_batched(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (2, 3, 16)).astype(np.uint8)
    b = rng.integers(-128, 128, (16, 5)).astype(np.int8)
    b_zp = rng.integers(-5, 5, 5).astype(np.int8)
    m = _model(helper.make_node("MatMulInteger", ["a", "b", "a_zp", "b_zp"], ["y"]),
               [helper.make_tensor_value_info("a", TensorProto.UINT8, ["n", "m", 16])],
               [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.uint8(100), "a_zp"),
                numpy_helper.from_array(b_zp, "b_zp")])
    y, _, _ = _run(m, {"a": a}, monkeypatch)
    assert np.array_equal(y, (a.astype(np.int64) - 100) @ (b.astype(np.int64) - b_zp))


def _conv_int64(x, w, pads, strides, dilations, group):
    """numpy's convolution of int64 arrays [N, C, H, W] * [M, C / group, kh, kw], pads [top, left, bottom, right]."""
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    m, cg, kh, kw = w.shape
    oh = (x.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (x.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.zeros((x.shape[0], m, oh, ow), np.int64)
    mg = m // group
    for i in range(kh):
        for j in range(kw):
            r, c = i * dilations[0], j * dilations[1]
            patch = x[:, :, r:r + strides[0] * (oh - 1) + 1:strides[0], c:c + strides[1] * (ow - 1) + 1:strides[1]]
            for g in range(group):
                out[:, g * mg:(g + 1) * mg] += np.einsum("nchw,mc->nmhw", patch[:, g * cg:(g + 1) * cg],
                                                         w[g * mg:(g + 1) * mg, :, i, j])
    return out


@pytest.mark.parametrize("w_type", [np.uint8, np.int8])
def test_conv_integer_is_exact_where_int16_pair_sums_would_saturate(w_type, monkeypatch):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (2, 4, 7, 6)).astype(np.uint8)
    x[0] = 255
    high = 255 if w_type == np.uint8 else 127
    w = rng.integers(np.iinfo(w_type).min, high + 1, (5, 4, 3, 3)).astype(w_type)
    w[0] = high  # output channel 0 at image 0: every product 255 * high
    assert 255 * high * 2 > INT16_MAX
    m = _model(helper.make_node("ConvInteger", ["x", "w", "x_zp"], ["y"], pads=[1, 1, 1, 1]),
               [helper.make_tensor_value_info("x", TensorProto.UINT8, ["n", 4, "h", "w"])],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.uint8(0), "x_zp")])
    y, oracle, ops = _run(m, {"x": x}, monkeypatch)
    exact = _conv_int64(x.astype(np.int64), w.astype(np.int64), [1, 1, 1, 1], [1, 1], [1, 1], 1)
    assert y.dtype == np.int32 and np.array_equal(y, exact)
    assert exact[0, 0, 3, 3] == 255 * high * 4 * 9
    assert ("", "ConvInteger") not in ops and ("", "MatMul") in ops
    assert oracle.exact == {"ConvInteger": 1}


def test_conv_integer_groups_strides_dilations_and_zero_points(monkeypatch):
    """The patches (a one-hot float Conv) follow the node's strides, pads and dilations; groups split the kernel."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 4, 9, 8)).astype(np.uint8)
    w = rng.integers(-128, 128, (6, 2, 3, 2)).astype(np.int8)
    attrs = {"group": 2, "strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}
    m = _model(helper.make_node("ConvInteger", ["x", "w", "x_zp", "w_zp"], ["y"], **attrs),
               [helper.make_tensor_value_info("x", TensorProto.UINT8, ["n", 4, "h", "w"])],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.uint8(131), "x_zp"),
                numpy_helper.from_array(np.int8(-3), "w_zp")])
    y, _, _ = _run(m, {"x": x}, monkeypatch)
    # the input is centered, then zero padded: padding with the zero point (onnxruntime's im2col)
    exact = _conv_int64(x.astype(np.int64) - 131, w.astype(np.int64) + 3, attrs["pads"], attrs["strides"],
                        attrs["dilations"], attrs["group"])
    assert np.array_equal(y, exact)


def _requantize(acc, a_scale, b_scale, y_scale, y_zp, dtype):
    """MLAS's requantization in float32: float(acc) * (a_scale * b_scale / y_scale), rounded half to even, plus
    the zero point, saturated."""
    multiplier = np.float32(a_scale) * np.asarray(b_scale, np.float32) / np.float32(y_scale)
    info = np.iinfo(dtype)
    return np.clip(np.rint(acc.astype(np.float32) * multiplier) + int(y_zp), info.min, info.max).astype(dtype)


def test_qlinear_matmul_is_exact_then_requantized(monkeypatch):
    rng = np.random.default_rng(4)
    a = rng.integers(0, 256, (5, 32)).astype(np.uint8)
    a[0] = 255
    b = rng.integers(-128, 128, (32, 4)).astype(np.int8)
    b[:, 0] = 127
    b_scale = np.float32([1e-4, 2e-4, 3e-4, 1e-4])
    assert _max_pair(a, b) > INT16_MAX
    inits = {"a_scale": np.float32(0.02), "a_zp": np.uint8(0), "b": b, "b_scale": b_scale, "b_zp": np.zeros(4, np.int8),
             "y_scale": np.float32(0.5), "y_zp": np.uint8(3)}
    m = _model(helper.make_node("QLinearMatMul", ["a", "a_scale", "a_zp", "b", "b_scale", "b_zp", "y_scale", "y_zp"],
                                ["y"]),
               [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", 32])],
               [numpy_helper.from_array(v, k) for k, v in inits.items()])
    y, oracle, ops = _run(m, {"a": a}, monkeypatch)
    acc = a.astype(np.int64) @ b.astype(np.int64)
    assert np.array_equal(y, _requantize(acc, 0.02, b_scale, 0.5, 3, np.uint8))
    assert ("", "QLinearMatMul") not in ops and oracle.exact == {"QLinearMatMul": 1}


def test_qlinear_conv_is_exact_then_requantized(monkeypatch):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (1, 3, 6, 6)).astype(np.uint8)
    x[0, :, :3] = 255
    w = rng.integers(-128, 128, (4, 3, 3, 3)).astype(np.int8)
    w[1] = 127
    w_scale = np.float32([1e-5, 2e-5, 1e-5, 3e-5])
    bias = np.int32([100, -2000, 0, 7])
    inits = {"x_scale": np.float32(0.03), "x_zp": np.uint8(0), "w": w, "w_scale": w_scale,
             "w_zp": np.zeros(4, np.int8), "y_scale": np.float32(0.01), "y_zp": np.uint8(128), "B": bias}
    m = _model(helper.make_node("QLinearConv", ["x", *inits], ["y"], pads=[1, 1, 1, 1]),
               [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 6, 6])],
               [numpy_helper.from_array(v, k) for k, v in inits.items()])
    y, oracle, ops = _run(m, {"x": x}, monkeypatch)
    acc = _conv_int64(x.astype(np.int64), w.astype(np.int64), [1, 1, 1, 1], [1, 1], [1, 1], 1) + bias[:, None, None]
    assert np.array_equal(y, _requantize(acc, 0.03, w_scale[:, None, None], 0.01, 128, np.uint8))
    assert ("", "QLinearConv") not in ops and oracle.exact == {"QLinearConv": 1}


def test_a_model_file_is_rewritten_too(tmp_path, monkeypatch):
    b = np.full((8, 3), 127, np.int8)
    m = _model(helper.make_node("MatMulInteger", ["a", "b"], ["y"]),
               [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 8])], [numpy_helper.from_array(b, "b")])
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    a = np.full((2, 8), 255, np.uint8)
    y, oracle, ops = _run(path, {"a": a}, monkeypatch)
    assert np.array_equal(y, np.full((2, 3), 255 * 127 * 8)) and ("", "MatMulInteger") not in ops


def test_a_model_without_integer_products_is_handed_over_as_it_is():
    m = _model(helper.make_node("MatMul", ["a", "b"], ["y"]),
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 8])],
               [numpy_helper.from_array(np.ones((8, 3), np.float32), "b")])
    assert reference.exact_integer_products(m) == (m, {})


def test_a_convolution_whose_kernel_shape_is_unknown_is_left_as_it_is():
    m = _model(helper.make_node("ConvInteger", ["x", "w"], ["y"]),
               [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 2, 5, 5]),
                helper.make_tensor_value_info("w", TensorProto.UINT8, None)], [])
    out, counts = integer_products.rewrite(m)
    assert out is m and counts == {}
