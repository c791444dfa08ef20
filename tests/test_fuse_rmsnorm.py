"""fuse-rmsnorm: every spelling fuses once and the fused graph equals the unfused one; near misses don't fuse;
on real exports the ascend MindIR holds 2N+1 RmsNorm with the extracted epsilon, and its cpu twin verifies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import passes
from fusion_utils import assert_same_numerics, fuse, mindir_primitive_inputs
from graphconv import compare, reference

H = 16
EPS = 1e-5


def _rms_graph(square="pow", normalize="reciprocal", opset=18, dtype=TensorProto.FLOAT, cast_island=False,
               gamma_first=False, axes=(-1,), keepdims=1, eps_shape=(), gamma_shape=(H,), gamma=True):
    """A decomposed RMSNorm over x[batch, seq, H], spelled as the arguments say."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [numpy_helper.from_array(np.full(eps_shape, EPS, np.float32), "eps"),
             numpy_helper.from_array(np.random.default_rng(0).standard_normal(gamma_shape).astype(np_dtype), "gamma"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes = []
    x = "x"
    if cast_island:
        nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT))
        x = "x32"
    nodes.append(helper.make_node("Pow", [x, "two"], ["sq"]) if square == "pow" else
                 helper.make_node("Mul", [x, x], ["sq"]))
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["ms"], axes=list(axes), keepdims=keepdims))
    nodes += [helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"])]
    if normalize == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["rms"], ["r"]), helper.make_node("Mul", [x, "r"], ["n"])]
    elif normalize == "div-one":
        nodes += [helper.make_node("Div", ["one", "rms"], ["r"]), helper.make_node("Mul", ["r", x], ["n"])]
    else:
        nodes += [helper.make_node("Div", [x, "rms"], ["n"])]
    n = "n"
    if cast_island:
        nodes.append(helper.make_node("Cast", ["n"], ["n16"], to=dtype))
        n = "n16"
    if gamma:
        nodes.append(helper.make_node("Mul", ["gamma", n] if gamma_first else [n, "gamma"], ["y"]))
    else:  # an all-ones gamma, whose `* 1` onnxsim removed
        nodes.append(helper.make_node("Identity", [n], ["y"]))
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


SPELLINGS = [
    dict(square="pow", normalize="reciprocal"),
    dict(square="mul", normalize="reciprocal"),
    dict(square="pow", normalize="div-one"),
    dict(square="pow", normalize="div"),
    dict(square="mul", normalize="div", gamma_first=True),
    dict(square="pow", normalize="reciprocal", opset=17),
    dict(square="pow", normalize="reciprocal", opset=14),
    dict(square="pow", normalize="reciprocal", axes=(2,)),
    dict(square="pow", normalize="reciprocal", eps_shape=(1,)),
    dict(square="pow", normalize="reciprocal", dtype=TensorProto.FLOAT16, cast_island=True),
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_each_spelling_fuses_once_and_keeps_numerics(spelling):
    original = _rms_graph(**spelling)
    count, fused = fuse(original, "fuse-rmsnorm")
    assert count == 1
    rms = [n for n in fused.graph.node if n.domain == "mindspore"]
    assert [n.op_type for n in rms] == ["RmsNorm"]
    assert helper.get_attribute_value(rms[0].attribute[0]) == pytest.approx(EPS)
    assert not any(n.op_type in ("Pow", "Sqrt", "ReduceMean") for n in fused.graph.node)
    tol = 1e-2 if spelling.get("dtype") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


NEAR_MISSES = {
    "mean over another axis": dict(axes=(1,)),
    "keepdims=0": dict(keepdims=0, axes=(-1,)),
    "non-scalar epsilon": dict(eps_shape=(H,)),
}


def test_a_2d_gamma_is_not_taken_into_rmsnorm():
    """gamma (1, H) is not RmsNorm's 1-D gamma: the norm fuses with a ones gamma and the Mul stays."""
    original = _rms_graph(gamma_shape=(1, H))
    count, fused = fuse(original, "fuse-rmsnorm")
    assert count == 1
    mul = [n for n in fused.graph.node if n.op_type == "Mul"]
    assert len(mul) == 1 and "gamma" in mul[0].input
    assert_same_numerics(original, fused)


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_do_not_fuse(name):
    original = _rms_graph(**NEAR_MISSES[name]) if name != "keepdims=0" else _keepdims0()
    count, fused = fuse(original, "fuse-rmsnorm")
    assert count == 0
    assert not any(n.domain == "mindspore" for n in fused.graph.node)


def _keepdims0():
    """keepdims=0 then an Unsqueeze back: the same numbers, but not the pattern's shape contract."""
    m = _rms_graph()
    for n in m.graph.node:
        if n.op_type == "ReduceMean":
            n.attribute[0].i = 0
    return m


def test_pass_can_be_disabled_and_unknown_passes_are_refused():
    assert passes.PassManager(disabled=("fuse-rmsnorm",)).names == [
        p for p in passes.PassManager().names if p != "fuse-rmsnorm"]
    with pytest.raises(graphconv.InputError, match="unknown pass"):
        passes.PassManager("fuse-everything")


def _native_graph(axis=-1, stash_type=1, gamma_shape=(H,)):
    g = helper.make_graph(
        [helper.make_node("RMSNormalization", ["x", "gamma"], ["y"], axis=axis, epsilon=EPS, stash_type=stash_type)],
        "rms23", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])],
        [numpy_helper.from_array(np.random.default_rng(1).standard_normal(gamma_shape).astype(np.float32), "gamma")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def test_opset23_native_rmsnormalization_fuses():
    original = _native_graph()
    count, fused = fuse(original, "fuse-rmsnorm")
    assert count == 1
    (node,) = [n for n in fused.graph.node if n.domain == "mindspore"]
    assert node.op_type == "RmsNorm" and helper.get_attribute_value(node.attribute[0]) == pytest.approx(EPS)
    assert_same_numerics(original, fused, 1e-5, 1e-5)


def test_opset23_native_rmsnormalization_over_two_axes_does_not_fuse():
    count, _ = fuse(_native_graph(axis=-2, gamma_shape=(5, H)), "fuse-rmsnorm")
    assert count == 0


@pytest.mark.parametrize("exporter,opset", [("dynamo", 18), ("torchscript", 17),
                                            pytest.param("torchscript", 14, marks=pytest.mark.slow),
                                            pytest.param("dynamo", 23, marks=pytest.mark.slow)])
def test_zoo_llama_gets_2n_plus_1_rmsnorm(exporter, opset, export_cache, tmp_path):
    n_layers = 2
    onnx_path = export_cache("llama", opset, exporter)
    out = tmp_path / "llama.mindir"
    report = graphconv.compile(onnx_path, out, save_fused=tmp_path / "fused.onnx")
    assert report.fusions["fuse-rmsnorm"] == 2 * n_layers + 1
    assert report.census.get("RmsNorm") == 2 * n_layers + 1
    assert "Pow" not in report.census
    # The ascend MindIR's RmsNorm inputs carry the epsilon the fusion extracted (the argument record).
    fused = onnx.load(tmp_path / "fused.onnx")
    record = [helper.get_attribute_value(n.attribute[0]) for n in fused.graph.node if n.op_type == "RmsNorm"]
    assert sorted(call[-1] for call in mindir_primitive_inputs(out, "RmsNorm")) == pytest.approx(sorted(record))
    # Numbers: the cpu twin of the same fused graph matched onnxruntime on the original model.
    assert report.status == "verified" and report.validation["checked"] == "cpu twin of llama.mindir"
    for case in report.validation["cases"]:
        assert case["outputs"][0]["max_abs"] <= 1e-4
    # The saved fused graph runs in onnxruntime (function bodies attached) and equals the original.
    original = onnx.load(onnx_path)
    cases = reference.make_cases(original)
    for case, exp, got in zip(cases, reference.Oracle(original).run(cases), reference.Oracle(fused).run(cases)):
        assert compare.compare(got["output"], exp["output"], 1e-5, 1e-5, case.valid_positions(exp["output"])).ok


@pytest.mark.parametrize("normalize", ["reciprocal", "div-one", "div"])
@pytest.mark.parametrize("cast_island", [False, True])
def test_unit_gamma_spelling_fuses_with_a_ones_gamma(normalize, cast_island):
    dtype = TensorProto.FLOAT16 if cast_island else TensorProto.FLOAT
    model = _rms_graph(normalize=normalize, cast_island=cast_island, dtype=dtype, gamma=False)
    count, fused = fuse(model, "fuse-rmsnorm")
    assert count == 1
    (node,) = [n for n in fused.graph.node if n.op_type == "RmsNorm"]
    assert_same_numerics(model, fused, **({"atol": 1e-3, "rtol": 1e-3} if cast_island else {}))
    # and where a gamma Mul follows, the gamma rule takes the whole norm (one RmsNorm, no Mul left)
    count, fused = fuse(_rms_graph(normalize=normalize, cast_island=cast_island, dtype=dtype), "fuse-rmsnorm")
    assert count == 1 and [n.op_type for n in fused.graph.node if n.op_type in ("RmsNorm", "Mul")] == ["RmsNorm"]


def test_unit_gamma_real_export_fuses_after_onnxsim(tmp_path):
    """models/llama with its norms left at ones (as a freshly initialised model has them): onnxsim removes the
    `* 1`, and every RMSNorm still fuses."""
    torch = pytest.importorskip("torch")
    from graphconv.export import export_pytorch
    from models import llama

    module, inputs, axes = llama.build()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    path = tmp_path / "unit.onnx"
    export_pytorch(module, inputs, path, axes, opset=18, exporter="dynamo")
    report = graphconv.compile(path, tmp_path / "u.mindir")
    assert report.status == "verified"
    assert report.census.get("RmsNorm") == 5 and report.fusions["fuse-rmsnorm"] == 5


def test_transformers_llama_rmsnorm_count(export_cache, tmp_path):
    pytest.importorskip("transformers")
    report = graphconv.compile(export_cache("hf-llama", 18), tmp_path / "l.mindir")
    assert report.fusions["fuse-rmsnorm"] == 5
    assert report.census.get("RmsNorm") == 5
    assert report.status == "verified"


def test_skipped_fusions_are_reported_with_their_reason(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(_rms_graph(eps_shape=(H,)), p)
    report = graphconv.compile(p, tmp_path / "m.mindir", simplify=False)
    assert report.fusions["fuse-rmsnorm"] == 0
    assert any("epsilon is not a constant scalar" in r for r in report.skipped_fusions["fuse-rmsnorm"])


def test_a_decomposed_layernorm_is_not_taken_for_an_rmsnorm():
    """RMSNorm of (x - mean(x)) is a LayerNorm's inside: fuse-rmsnorm leaves it (with the reason)."""
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mu"], keepdims=1),
             helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["y"])]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(EPS, np.float32), "eps"),
             numpy_helper.from_array(np.ones(H, np.float32), "gamma")]
    g = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])], inits)
    count, _ = fuse(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), "fuse-rmsnorm")
    assert count == 0
