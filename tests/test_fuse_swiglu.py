"""fuse-swiglu: SiLU(x @ Wg) * (x @ Wu) becomes one MatMul over the merged [gate ; up] weight and
mindspore::Swiglu(dim=-1), with the numerics kept (the first half is the gate); the sources are freed; near
misses and GeGLU don't merge; on real Llama exports the ascend MindIR holds N Swiglu and no Sigmoid, and the cpu
twin verifies."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import opmap.fused
import passes
from fusion_utils import assert_same_numerics, fused_nodes
from fusion_zoo import assert_verified, primitive_args, zoo_compile

H, I = 16, 32  # noqa: E741


def _mlp_graph(act="sigmoid", sigmoid_first=False, up_first=False, bias=False, opset=17, dtype=TensorProto.FLOAT,
               const_weights=True, shared_x=True, up_shape=(H, I)):
    """down(act(x @ Wg [+ bg]) * (x @ Wu [+ bu])) over x[batch, seq, H]."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    weights = {"wg": rng.standard_normal((H, I)) * 0.3, "wu": rng.standard_normal(up_shape) * 0.3,
               "wd": rng.standard_normal((I, H)) * 0.3, "bg": rng.standard_normal(I) * 0.1,
               "bu": rng.standard_normal(I) * 0.1}
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in weights.items()
             if (bias or k[0] != "b") and (const_weights or k != "wg")]
    inputs = [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])]
    if not const_weights:
        inputs.append(helper.make_tensor_value_info("wg", dtype, [H, I]))
    if not shared_x:
        inputs.append(helper.make_tensor_value_info("x2", dtype, ["batch", "seq", H]))
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g0" if bias else "g"]),
             helper.make_node("MatMul", ["x" if shared_x else "x2", "wu"], ["u0" if bias else "u"])]
    if bias:
        nodes += [helper.make_node("Add", ["g0", "bg"], ["g"]), helper.make_node("Add", ["bu", "u0"], ["u"])]
    if act == "sigmoid":
        nodes += [helper.make_node("Sigmoid", ["g"], ["s"]),
                  helper.make_node("Mul", ["s", "g"] if sigmoid_first else ["g", "s"], ["a"])]
    else:  # GeGLU: exact GELU of the gate
        inits += [numpy_helper.from_array(np.array(v, np_dtype), k)
                  for k, v in (("sqrt2", np.sqrt(2)), ("one", 1.0), ("half", 0.5))]
        nodes += [helper.make_node("Div", ["g", "sqrt2"], ["ga"]), helper.make_node("Erf", ["ga"], ["ge"]),
                  helper.make_node("Add", ["ge", "one"], ["g1"]), helper.make_node("Mul", ["g", "g1"], ["gg"]),
                  helper.make_node("Mul", ["gg", "half"], ["a"])]
    nodes += [helper.make_node("Mul", ["u", "a"] if up_first else ["a", "u"], ["h"]),
              helper.make_node("MatMul", ["h", "wd"], ["y"])]
    g = helper.make_graph(nodes, "mlp", inputs, [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, spec: str):
    """The pipeline `spec` on `model`: (pass -> count, skip reasons, fused model with function bodies)."""
    m = ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True))
    pm = passes.PassManager(spec)
    counts = pm.run(m)
    fused = opmap.fused.attach_functions(ir.to_proto(m))
    return counts, pm.skipped, onnx.shape_inference.infer_shapes(fused, data_prop=True)


SPELLINGS = [
    dict(),
    dict(sigmoid_first=True),
    dict(up_first=True),
    dict(bias=True),
    dict(bias=True, up_first=True, sigmoid_first=True),
    dict(opset=14),
    dict(opset=18),
    dict(opset=23, up_first=True),
    dict(dtype=TensorProto.FLOAT16),
]
PIPELINES = ["fuse-swiglu", "fuse-silu,fuse-swiglu"]  # the decomposed gate, and the one fuse-silu fused first


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "plain")
def test_each_spelling_merges_and_keeps_numerics(spelling, pipeline):
    original = _mlp_graph(**spelling)
    counts, _, fused = _run(original, pipeline)
    assert counts["fuse-swiglu"] == 1
    ops = [n.op_type for n in fused.graph.node if n.op_type != "Constant"]
    assert ops == ["MatMul"] + (["Add"] if spelling.get("bias") else []) + ["Swiglu", "MatMul"]
    swiglu = fused_nodes(fused, "Swiglu")[0]
    assert helper.get_attribute_value(swiglu.attribute[0]) == -1
    # One merged weight [gate ; up] replaces its two sources.
    inits = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    assert "wg" not in inits and "wu" not in inits
    src = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    np.testing.assert_array_equal(inits["wg_gate_up"], np.concatenate([src["wg"], src["wu"]], axis=1))
    if spelling.get("bias"):
        assert "bg" not in inits and "bu" not in inits
        np.testing.assert_array_equal(inits["bg_gate_up"], np.concatenate([src["bg"], src["bu"]]))
    tol = 1e-2 if spelling.get("dtype") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


def _reshaped_linear_graph():
    """A SwiGLU MLP with biased gate/up projections as torch exports it (dynamo and TorchScript alike) after
    onnxsim: Reshape(x, (-1, H)), Gemm, Reshape back to (batch, seq, I) by one shape computed from Shape(x)."""
    rng = np.random.default_rng(1)
    w = {"wg": rng.standard_normal((H, I)) * 0.3, "wu": rng.standard_normal((H, I)) * 0.3,
         "bg": rng.standard_normal(I) * 0.1, "bu": rng.standard_normal(I) * 0.1, "wd": rng.standard_normal((I, H)) * 0.3}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
              (("flat", [-1, H]), ("zero", [0]), ("two", [2]), ("width", [I]))]
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Slice", ["sh", "zero", "two", "zero"], ["bs"]),
             helper.make_node("Concat", ["bs", "width"], ["shape"], axis=0),
             helper.make_node("Gemm", ["x2", "wg", "bg"], ["g2"]), helper.make_node("Reshape", ["g2", "shape"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["a"]),
             helper.make_node("Gemm", ["x2", "wu", "bu"], ["u2"]), helper.make_node("Reshape", ["u2", "shape"], ["u"]),
             helper.make_node("Mul", ["a", "u"], ["h"]), helper.make_node("MatMul", ["h", "wd"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_biased_linears_between_reshapes_merge(tmp_path):
    original = _reshaped_linear_graph()
    counts, _, fused = _run(original, "canonicalize,fuse-silu,fuse-swiglu")
    assert counts["fuse-swiglu"] == 1
    compute = [n.op_type for n in fused.graph.node if n.op_type not in ("Constant", "Shape", "Slice", "Concat")]
    assert compute == ["Reshape", "MatMul", "Add", "Swiglu", "Reshape", "MatMul"]
    assert {"wg_gate_up", "bg_gate_up"} <= {i.name for i in fused.graph.initializer}
    assert not {"wg", "wu", "bg", "bu"} & {i.name for i in fused.graph.initializer}
    assert_same_numerics(original, fused)
    # The ascend lowering exports (Swiglu on the 2-D product, then the gate's Reshape) and its cpu twin verifies.
    p = tmp_path / "mlp.onnx"
    onnx.save(original, p)
    report = graphconv.compile(p, tmp_path / "mlp.mindir", simplify=False)
    assert report.fusions["fuse-swiglu"] == 1 and report.census.get("Swiglu") == 1
    assert [c[1] for c in primitive_args(tmp_path / "mlp.mindir", "Swiglu")] == [-1]
    assert_verified(report, 1e-5)


def test_swapping_the_halves_would_be_caught():
    """The reference body applies SiLU to the first half: with [up ; gate] the numbers differ, so the numerics
    check above does pin the half order."""
    original = _mlp_graph()
    _, _, fused = _run(original, "fuse-swiglu")
    for init in fused.graph.initializer:
        if init.name == "wg_gate_up":
            w = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(np.concatenate([w[:, I:], w[:, :I]], axis=1), init.name))
    with pytest.raises(AssertionError):
        assert_same_numerics(original, fused)


def test_a_weight_used_elsewhere_is_kept():
    original = _mlp_graph()
    original.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, None))
    original.graph.node.append(helper.make_node("ReduceSum", ["wu"], ["extra"], keepdims=0))
    counts, _, fused = _run(original, "fuse-swiglu")
    assert counts["fuse-swiglu"] == 1
    names = {i.name for i in fused.graph.initializer}
    assert "wu" in names and "wg" not in names and "wg_gate_up" in names
    assert_same_numerics(original, fused)


NEAR_MISSES = {
    "gate weight not a constant": (dict(const_weights=False), "not constants"),
    "gate and up on different inputs": (dict(shared_x=False), None),
    "fp16 below opset 15": (dict(dtype=TensorProto.FLOAT16, opset=14), "below opset 15"),
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_do_not_fuse_and_say_why(name):
    kwargs, reason = NEAR_MISSES[name]
    counts, skipped, fused = _run(_mlp_graph(**kwargs), "fuse-silu,fuse-swiglu")
    assert counts["fuse-swiglu"] == 0 and not fused_nodes(fused, "Swiglu")
    if reason is not None:
        assert any(reason in r for r in skipped.get("fuse-swiglu", [])), skipped


def test_geglu_stays_gelu_times_up_and_merges_nothing():
    original = _mlp_graph(act="gelu")
    counts, _, fused = _run(original, "fuse-gelu,fuse-silu,fuse-swiglu")
    assert counts["fuse-gelu"] == 1 and counts["fuse-swiglu"] == 0
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == [
        "MatMul", "MatMul", "Gelu", "Mul", "MatMul"]
    assert {"wg", "wu"} <= {i.name for i in fused.graph.initializer}
    assert_same_numerics(original, fused)


# --- real exports ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,exporter,opset", [
    ("llama", "dynamo", 18),
    ("llama", "torchscript", 17),
    pytest.param("llama", "torchscript", 14, marks=pytest.mark.slow),
    pytest.param("hf-llama", "dynamo", 18, marks=pytest.mark.slow),
])
def test_zoo_llama_gets_n_swiglu(model, exporter, opset, export_cache, tmp_path_factory):
    if model.startswith("hf-"):
        pytest.importorskip("transformers")
    n_layers = 2
    report, mindir, fused = zoo_compile(export_cache, tmp_path_factory, model, opset, exporter)
    assert report.fusions["fuse-silu"] == n_layers  # the MLP gates, then taken into Swiglu
    assert report.fusions["fuse-swiglu"] == n_layers
    assert report.census.get("Swiglu") == n_layers
    assert "Sigmoid" not in report.census and "SiLU" not in report.census
    dims = sorted(helper.get_attribute_value(n.attribute[0]) for n in fused_nodes(fused, "Swiglu"))
    assert sorted(c[1] for c in primitive_args(mindir, "Swiglu")) == dims == [-1] * n_layers
    # Each merged weight [gate ; up] (hidden 64 -> 2 x intermediate 128) replaced its two sources.
    merged = [i for i in fused.graph.initializer if i.name.endswith("_gate_up")]
    assert len(merged) == n_layers and all(list(i.dims) == [64, 2 * 128] for i in merged)
    matmul_weights = [n.input[1] for n in fused.graph.node if n.op_type == "MatMul"]
    assert all(i.name in matmul_weights for i in merged)
    # ... and the ascend MindIR multiplies by it (the parameter keeps the merged initializer's name; stored
    # [out, in] for ops.dense, graphconv.lower.dense_weights).
    mindir_weights = {a for prim in ("MatMulExt", "Dense") for c in primitive_args(mindir, prim) for a in c
                      if isinstance(a, str)}
    assert {i.name for i in merged} <= mindir_weights
    assert_verified(report)
