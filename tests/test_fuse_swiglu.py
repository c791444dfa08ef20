"""fuse-swiglu: SiLU(x @ Wg) * (x @ Wu) becomes one MatMul over the merged [gate ; up] weight and
mindspore::Swiglu(dim=-1), with the numerics kept (the first half is the gate); the sources are freed; near
misses and GeGLU don't merge; on real Llama exports the ascend MindIR holds N Swiglu and no Sigmoid, and the cpu
twin verifies."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import opmap.fused
import passes
from fusion_utils import assert_same_numerics, fused_nodes, spelling_id
from fusion_zoo import assert_verified, primitive_args, zoo_compile

H, I = 16, 32  # noqa: E741


def _mlp_graph(act="sigmoid", sigmoid_first=False, up_first=False, bias=False, opset=17, dtype=TensorProto.FLOAT,
               const_weights=True, shared_x=True, up_shape=(H, I), stored=None):
    """down(act(x @ Wg [+ bg]) * (x @ Wu [+ bu])) over x[batch, seq, H]. `stored` (a low ONNX dtype): the
    projection weights are stored so and read through Cast(to=dtype), as a `--dtype auto` export writes them."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    weights = {"wg": rng.standard_normal((H, I)) * 0.3, "wu": rng.standard_normal(up_shape) * 0.3,
               "wd": rng.standard_normal((I, H)) * 0.3, "bg": rng.standard_normal(I) * 0.1,
               "bu": rng.standard_normal(I) * 0.1}
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in weights.items()
             if (bias or k[0] != "b") and (const_weights or k != "wg")]
    casts = []
    if stored is not None:
        low = helper.tensor_dtype_to_np_dtype(stored)
        inits = [numpy_helper.from_array(weights[t.name].astype(low), f"{t.name}_stored") if t.name[0] == "w" else t
                 for t in inits]
        casts = [helper.make_node("Cast", [f"{w}_stored"], [w], to=dtype) for w in ("wg", "wu", "wd")]
    inputs = [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])]
    if not const_weights:
        inputs.append(helper.make_tensor_value_info("wg", dtype, [H, I]))
    if not shared_x:
        inputs.append(helper.make_tensor_value_info("x2", dtype, ["batch", "seq", H]))
    nodes = casts + [helper.make_node("MatMul", ["x", "wg"], ["g0" if bias else "g"]),
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
@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: spelling_id(s, "plain"))
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


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("spelling", [dict(stored=TensorProto.BFLOAT16),
                                      dict(stored=TensorProto.FLOAT16, up_first=True),
                                      dict(stored=TensorProto.BFLOAT16, sigmoid_first=True)],
                         ids=lambda s: spelling_id(s, "plain"))
def test_weights_read_through_casts_merge_as_stored(spelling, pipeline):
    """MatMul(x, Cast(Wg)) and MatMul(x, Cast(Wu)) with bf16/fp16 initializers (a `--dtype auto` export of a bf16
    checkpoint, at sizes where onnxsim leaves the Casts): one merged weight in the stored dtype, read through
    one Cast, then Swiglu; the same numerics."""
    original = _mlp_graph(**spelling)
    counts, _, fused = _run(original, pipeline)
    assert counts["fuse-swiglu"] == 1
    ops = [n.op_type for n in fused.graph.node if n.op_type != "Constant"]
    assert sorted(ops) == sorted(["Cast", "Cast", "MatMul", "Swiglu", "MatMul"])  # (the merged one's, down's)
    inits = {i.name: i for i in fused.graph.initializer}
    assert "wg_stored" not in inits and "wu_stored" not in inits
    merged = inits["wg_stored_gate_up"]
    assert merged.data_type == spelling["stored"]
    src = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(merged),
                                  np.concatenate([src["wg_stored"], src["wu_stored"]], axis=1))
    assert_same_numerics(original, fused, 1e-5, 1e-5)


def test_weights_read_as_another_dtype_than_x_do_not_merge_and_say_why():
    model = _mlp_graph(stored=TensorProto.BFLOAT16)
    cast = next(n for n in model.graph.node if n.op_type == "Cast" and n.output[0] == "wu")
    cast.attribute[0].i = TensorProto.FLOAT16
    counts, skipped, _ = _run(model, "fuse-swiglu")
    assert counts["fuse-swiglu"] == 0
    reason = "Mul: dtypes x=FLOAT, gate=BFLOAT16, up=BFLOAT16 read as FLOAT, FLOAT16: not one dtype"
    assert reason in skipped["fuse-swiglu"]


def _reshaped_linear_graph():
    """A SwiGLU MLP with biased gate/up projections as torch exports it (dynamo and TorchScript alike) after
    onnxsim: Reshape(x, (-1, H)), Gemm, Reshape back to (batch, seq, I) by one shape computed from Shape(x)."""
    rng = np.random.default_rng(1)
    w = {"wg": rng.standard_normal((H, I)) * 0.3, "wu": rng.standard_normal((H, I)) * 0.3,
         "bg": rng.standard_normal(I) * 0.1, "bu": rng.standard_normal(I) * 0.1,
         "wd": rng.standard_normal((I, H)) * 0.3}
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
    # ... and the ascend MindIR multiplies by it (stored [out, in] for ops.dense,
    # graphconv.compiler.lowering.dense_weights), a parameter named after its sources' state_dict names
    # (graphconv.frontend.param_names): mlp.gate_up_proj.weight.
    mindir_weights = {a for prim in ("MatMulExt", "Dense") for c in primitive_args(mindir, prim) for a in c
                      if isinstance(a, str)}
    gate_up = sorted(a for a in mindir_weights if "gate_up" in a)
    assert len(gate_up) == n_layers
    assert all(a.endswith(f"layers.{k}.mlp.gate_up_proj.weight") for k, a in enumerate(gate_up)), gate_up
    assert_verified(report)


# --- one merged gate/up projection split into halves (Phi-3, GLM-4) -------------------------------------------

def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """Stable node names, as the pipeline gives them (coverage keys its check reasons by node name)."""
    for k, n in enumerate(model.graph.node):
        n.name = n.name or f"{n.op_type}_{k}"
    return model


def _halves_graph(split="num_outputs", gate_second=False, up_first=False, bias=False, opset=18,
                  dtype=TensorProto.FLOAT, sizes=(I, I), width=2 * I, axis=-1, source="matmul", act="sigmoid",
                  slices=None):
    """down(act(gate) * up) with gate, up = halves of h = x @ W [+ b] (x[batch, seq, H], W[H, width]) as Phi3MLP /
    Glm4MLP write it: `gate, up = gate_up_proj(x).chunk(2, dim=-1)`, `up * silu(gate)` (up_first).
    split: "num_outputs" (dynamo, opset >= 18: Split(h, axis, num_outputs=2)), "sizes" (Split(h, [n, m])),
    "equal" (before 18: Split(h) into two outputs), "slice" (h[..., :n], h[..., n:] with end INT64_MAX),
    "slice-2n" (explicit end 2n and negative start -n); `slices` overrides the Slice pair's (start, end) bounds.
    gate_second: SiLU on the second half. source "matmul", "input" (h is a graph input) or "weight-input" (W a
    graph input, not a constant)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(2)
    # the product's width (the broadcast of the two parts), which the down projection takes
    if split == "sizes":
        p_width = max(sizes)
    elif slices is not None:
        p_width = max(e - s for s, e in slices)
    else:
        p_width = (width + 1) // 2
    w = {"w": rng.standard_normal((H, width)) * 0.3, "b": rng.standard_normal(width) * 0.1,
         "wd": rng.standard_normal((p_width, H)) * 0.3}
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in w.items()
             if (bias or k != "b") and (source == "matmul" or k != "w")]
    inputs = [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])]
    nodes = []
    if source == "input":
        inputs = [helper.make_tensor_value_info("h", dtype, ["batch", "seq", width])]
    else:
        if source == "weight-input":
            inputs.append(helper.make_tensor_value_info("w", dtype, [H, width]))
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["h0" if bias else "h"]))
        if bias:
            nodes.append(helper.make_node("Add", ["h0", "b"], ["h"]))
    first, second = ("a", "b_") if not gate_second else ("b_", "a")  # a = gate
    if split == "num_outputs":
        nodes.append(helper.make_node("Split", ["h"], [first, second], axis=axis, num_outputs=2))
    elif split == "sizes":
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        nodes.append(helper.make_node("Split", ["h", "sizes"], [first, second], axis=axis))
    elif split == "equal":
        nodes.append(helper.make_node("Split", ["h"], [first, second], axis=axis))
    else:
        n = width // 2
        bounds = {"s0": [0], "e0": [n], "s1": [n], "e1": [2**63 - 1], "ax": [axis]}
        if split == "slice-2n":
            bounds.update(s1=[-n], e1=[2 * n])
        if slices is not None:
            (s0, e0), (s1, e1) = slices
            bounds.update(s0=[s0], e0=[e0], s1=[s1], e1=[e1])
        inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in bounds.items()]
        nodes += [helper.make_node("Slice", ["h", "s0", "e0", "ax"], [first]),
                  helper.make_node("Slice", ["h", "s1", "e1", "ax"], [second])]
    if act == "sigmoid":
        nodes += [helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["a", "s"], ["silu"])]
    else:  # GeGLU with the tanh GELU (Gemma-style), dynamo's spelling
        inits += [numpy_helper.from_array(np.array(v, np_dtype), k) for k, v in
                  (("three", 3.0), ("coeff", 0.044715), ("s2pi", math.sqrt(2 / math.pi)), ("one", 1.0),
                   ("half", 0.5))]
        nodes += [helper.make_node("Pow", ["a", "three"], ["a3"]), helper.make_node("Mul", ["coeff", "a3"], ["ca3"]),
                  helper.make_node("Add", ["a", "ca3"], ["in"]), helper.make_node("Mul", ["s2pi", "in"], ["arg"]),
                  helper.make_node("Tanh", ["arg"], ["t"]), helper.make_node("Add", ["t", "one"], ["op"]),
                  helper.make_node("Mul", ["half", "op"], ["hop"]), helper.make_node("Mul", ["a", "hop"], ["silu"])]
    nodes += [helper.make_node("Mul", ["b_", "silu"] if up_first else ["silu", "b_"], ["p"]),
              helper.make_node("MatMul", ["p", "wd"], ["y"])]
    g = helper.make_graph(nodes, "mlp", inputs, [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])],
                          inits)
    return _named(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def _coverage(model: onnx.ModelProto, spec: str):
    """(pass -> count, coverage report, skip reasons, fused model with function bodies) of `spec` on `model`."""
    m = ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True))
    pm = passes.PassManager(spec)
    counts = pm.run(m)
    fused = onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(ir.to_proto(m)), data_prop=True)
    return counts, pm.coverage, pm.skipped, fused


HALVES = [
    dict(),  # dynamo at opset 18+: Split(num_outputs=2), silu(gate) * up
    dict(up_first=True),  # Phi3MLP / Glm4MLP: up * silu(gate)
    dict(split="sizes", opset=17),  # Split(h, [I, I]) (opset 13-17 exports, TorchScript's chunk)
    dict(split="sizes", opset=14, up_first=True),
    dict(split="equal", opset=13),
    dict(split="slice"),
    dict(split="slice-2n", opset=17, up_first=True),
    dict(bias=True),
    dict(opset=23, up_first=True),
    dict(dtype=TensorProto.FLOAT16),
    dict(source="input"),  # any tensor's halves: no projection needed
    dict(axis=2),  # the last axis named positively
]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("spelling", HALVES, ids=lambda s: spelling_id(s, "plain"))
def test_halves_of_one_projection_fuse_without_a_weight_merge(spelling, pipeline):
    original = _halves_graph(**spelling)
    counts, coverage, _, fused = _coverage(original, pipeline)
    assert counts["fuse-swiglu"] == 1
    ops = [n.op_type for n in fused.graph.node if n.op_type != "Constant"]
    projection = [] if spelling.get("source") == "input" else ["MatMul"] + (["Add"] if spelling.get("bias") else [])
    assert ops == projection + ["Swiglu", "MatMul"]
    (swiglu,) = fused_nodes(fused, "Swiglu")
    assert helper.get_attribute_value(swiglu.attribute[0]) == -1
    # Swiglu reads h itself: the graph input, or the projection's (last) output.
    producers = {o: n for n in fused.graph.node for o in n.output}
    assert (swiglu.input[0] == "h" if not projection else producers[swiglu.input[0]].op_type == projection[-1])
    # Nothing merged: the projection's weight is the one it was.
    inits = {i.name for i in fused.graph.initializer}
    assert not any(name.endswith(("_gate_up", "_halves_swapped")) for name in inits)
    assert spelling.get("source") == "input" or "w" in inits
    assert coverage["gated_mlp"]["candidates"] == coverage["gated_mlp"]["fused"] == 1
    tol = 1e-2 if spelling.get("dtype") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


SWAPPED = [dict(), dict(up_first=True), dict(bias=True), dict(split="sizes", opset=17), dict(split="slice"),
           dict(split="slice", bias=True, up_first=True)]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("spelling", SWAPPED, ids=lambda s: spelling_id(s, "plain"))
def test_silu_of_the_second_half_swaps_the_halves_in_the_weight(spelling, pipeline):
    """silu(second) * first = Swiglu over h with its halves swapped: the projection's output columns are
    permuted ([n:2n] then [0:n]) in a new weight, and the numbers stay equal."""
    original = _halves_graph(gate_second=True, **spelling)
    counts, _, _, fused = _coverage(original, pipeline)
    assert counts["fuse-swiglu"] == 1
    inits = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    src = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    assert "w" not in inits
    np.testing.assert_array_equal(inits["w_halves_swapped"], np.concatenate([src["w"][:, I:], src["w"][:, :I]], 1))
    if spelling.get("bias"):
        assert "b" not in inits
        np.testing.assert_array_equal(inits["b_halves_swapped"], np.concatenate([src["b"][I:], src["b"][:I]]))
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == \
        ["MatMul"] + (["Add"] if spelling.get("bias") else []) + ["Swiglu", "MatMul"]
    assert_same_numerics(original, fused)


def test_halves_ascend_lowering_and_cpu_twin(tmp_path):
    """The swapped-halves form through MindSpore: Swiglu(h, -1) in the ascend MindIR, the cpu twin verifies."""
    p = tmp_path / "mlp.onnx"
    onnx.save(_halves_graph(gate_second=True, up_first=True), p)
    report = graphconv.compile(p, tmp_path / "mlp.mindir", simplify=False, passes="fuse-silu,fuse-swiglu")
    assert report.fusions == {"fuse-silu": 1, "fuse-swiglu": 1} and report.census.get("Swiglu") == 1
    assert "Sigmoid" not in report.census and "SiLU" not in report.census
    assert [c[1] for c in primitive_args(tmp_path / "mlp.mindir", "Swiglu")] == [-1]
    assert_verified(report, 1e-5)


# name -> (graph, reason in the skip list and in the coverage item of the candidate Mul)
HALVES_NEAR_MISSES = {
    "unequal Split sizes": (dict(split="sizes", sizes=(1, 2 * I - 1), opset=17),
                            "Split into halves of sizes 1 and 63: Swiglu splits into two equal halves"),
    "odd width, num_outputs=2": (dict(width=3, split="num_outputs"),
                                 "Split(num_outputs=2) of an axis of odd size 3 makes halves of 2 and 1"),
    "Slices that are not the halves": (dict(split="slice", width=2 * I + 8, slices=((0, I), (I, 2 * I))),
                                       "Slices [0, 32) (gate) and [32, 64) (up) of an axis of size 72 are not its "
                                       "two equal halves"),
    "swapped halves of a graph input": (dict(gate_second=True, source="input"),
                                        "SiLU gates the second half, Swiglu the first"),
    "swapped halves, weight not a constant": (dict(gate_second=True, source="weight-input"),
                                              "SiLU gates the second half, Swiglu the first"),
    "fp16 below opset 15": (dict(dtype=TensorProto.FLOAT16, opset=14, split="sizes"), "below opset 15"),
}


@pytest.mark.parametrize("name", HALVES_NEAR_MISSES)
def test_halves_near_misses_do_not_fuse_and_say_why(name):
    kwargs, reason = HALVES_NEAR_MISSES[name]
    counts, coverage, skipped, fused = _coverage(_halves_graph(**kwargs), "fuse-silu,fuse-swiglu")
    assert counts["fuse-swiglu"] == 0 and not fused_nodes(fused, "Swiglu")
    mlp = coverage["gated_mlp"]
    assert mlp["candidates"] == 1 and mlp["fused"] == 0
    assert any(reason in item["reason"] for item in mlp["items"]), mlp


def test_a_split_along_another_axis_is_refused():
    """Swiglu is fused over the last axis only: halves along axis 1 of h[batch, 4, 2I] stay unfused."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((H, 2 * I)) * 0.3).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Split", ["h"], ["a", "b"], axis=1, num_outputs=2),
             helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["a", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "b"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 2 * I])], inits)
    model = _named(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    counts, coverage, _, _ = _coverage(model, "fuse-silu,fuse-swiglu")
    assert counts["fuse-swiglu"] == 0
    assert [i["reason"] for i in coverage["gated_mlp"]["items"]] == [
        "Split along axis 1, not the last: Swiglu is fused over the last axis only"]


@pytest.mark.parametrize("form", ["separate", "halves"])
def test_geglu_is_refused_because_mindspore_has_no_geglu(form):
    """gelu(gate) * up: the tanh GELU fuses to GeluTanh, the Mul stays, and gated_mlp coverage says why."""
    model = _named(_mlp_graph(act="gelu")) if form == "separate" else _halves_graph(act="gelu", up_first=True)
    counts, coverage, _, fused = _coverage(model, "fuse-gelu,fuse-silu,fuse-swiglu")
    assert counts["fuse-gelu"] == 1 and counts["fuse-swiglu"] == 0
    kind = "GELU (exact erf)" if form == "separate" else "GELU (tanh approximation)"
    assert [i["reason"] for i in coverage["gated_mlp"]["items"]] == [
        f"the gate's activation is {kind}: MindSpore has no GeGLU primitive (the GELU is fused on its own)"]
    assert_same_numerics(model, fused)


def test_projections_of_different_inputs_are_explained():
    counts, coverage, _, _ = _coverage(_named(_mlp_graph(shared_x=False)), "fuse-silu,fuse-swiglu")
    assert counts["fuse-swiglu"] == 0
    assert [i["reason"] for i in coverage["gated_mlp"]["items"]] == [
        "the gate and up projections read different inputs (nothing to merge into one MatMul)"]


# --- real exports of merged gate/up projections ----------------------------------------------------------------

ARCH = "models.architectures:build_{}"


@pytest.mark.parametrize("arch,opset", [
    ("phi3", 18),
    pytest.param("phi3", 23, marks=pytest.mark.slow),
    pytest.param("glm4", 18, marks=pytest.mark.slow),
    pytest.param("glm4", 23, marks=pytest.mark.slow),
])
def test_real_export_merged_gate_up_gets_one_swiglu_per_layer(arch, opset, export_cache, tmp_path_factory):
    """Phi-3 / GLM-4: gate_up_proj(x).chunk(2) then up * silu(gate) (the gate is the FIRST chunk, modeling_phi3.py
    / modeling_glm4.py); dynamo writes Split(num_outputs=2) (opsets 17->18, 18, 23). Swiglu over gate_up_proj's
    output, one per layer, the weight untouched."""
    pytest.importorskip("transformers")
    pytest.importorskip("models.architectures")
    from fusion_utils import fused_equals_unfused

    n_layers = 2
    path = export_cache(ARCH.format(arch), opset, "dynamo")
    counts = fused_equals_unfused(path)
    assert counts["fuse-silu"] == counts["fuse-swiglu"] == n_layers
    report, mindir, fused = zoo_compile(export_cache, tmp_path_factory, ARCH.format(arch), opset, "dynamo")
    assert report.fusions["fuse-swiglu"] == n_layers
    assert report.census.get("Swiglu") == n_layers
    assert not any(k in report.census for k in ("Sigmoid", "SiLU", "Split"))
    mlp = report.coverage["gated_mlp"]
    assert mlp["candidates"] == mlp["fused"] == n_layers, mlp
    # No weight was merged or permuted: each Swiglu reads MatMul(x, W) with W [hidden 64, 2 x intermediate 128]
    # of the export.
    assert not any(i.name.endswith(("_gate_up", "_halves_swapped")) for i in fused.graph.initializer)
    producers = {o: n for n in fused.graph.node for o in n.output}
    exported = {i.name for i in onnx.load(path).graph.initializer}
    shapes = {i.name: list(i.dims) for i in fused.graph.initializer}
    for swiglu in fused_nodes(fused, "Swiglu"):
        mm = producers[swiglu.input[0]]
        assert mm.op_type == "MatMul" and mm.input[1] in exported and shapes[mm.input[1]] == [64, 256]
    assert [c[1] for c in primitive_args(mindir, "Swiglu")] == [-1] * n_layers
    assert_verified(report)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma", "modernbert"])
def test_real_export_geglu_is_refused_with_the_reason(arch, export_cache, tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("models.architectures")
    report, _, _ = zoo_compile(export_cache, tmp_path_factory, ARCH.format(arch), 18, "dynamo")
    kind = "GELU (tanh approximation)" if arch == "gemma" else "GELU (exact erf)"
    assert report.coverage["gated_mlp"]["refused"] == {
        f"the gate's activation is {kind}: MindSpore has no GeGLU primitive (the GELU is fused on its own)": 2}
    assert report.fusions["fuse-swiglu"] == 0 and "Swiglu" not in report.census


def _external_mlp(tmp_path, monkeypatch, dtype=TensorProto.FLOAT, **graph):
    """_mlp_graph saved with every weight in mlp.onnx.data, loaded as a compile loads it (none read into the
    proto, though they are small)."""
    from graphconv.frontend import weights
    from graphconv.frontend.load import load

    monkeypatch.setattr(weights, "INLINE_MAX_BYTES", 0)

    original = _mlp_graph(dtype=dtype, **graph)
    path = tmp_path / "mlp.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(original)  # (saving moves the tensors out of the proto it is given)
    onnx.save(saved, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="mlp.onnx.data", size_threshold=0)
    return original, ir.from_proto(load(path).proto)


def test_merged_weight_of_external_sources_is_written_nowhere(tmp_path, monkeypatch):
    """A model whose weights stay in files: the merged [gate ; up] weight is not computed by the pass (a pass
    over 32 layers would hold them all) nor written by the spill after it (0.43 x a Llama's weights): its
    ref names its parts, and every reader makes it from them, in this process (ConcatenatedTensor.numpy,
    weights.read of the proto's ref) and in the export child (the ref's list form)."""
    from graphconv.frontend import weights
    from graphconv.runtime.mindir_stream import Source

    original, m = _external_mlp(tmp_path, monkeypatch)
    passes.PassManager("fuse-swiglu").run(m)
    assert isinstance(m.graph.initializers["wg_gate_up"].const_value, ir.LazyTensor)
    monkeypatch.setattr(weights, "SPILL_MIN_BYTES", 0)  # (this one is small)
    spill = weights.SpillFile(tmp_path / "spill.bin")
    assert weights.spill_new_tensors(m, spill) == 0
    made = m.graph.initializers["wg_gate_up"].const_value
    assert isinstance(made, weights.ConcatenatedTensor) and spill.concatenated_bytes == made.nbytes > 0
    assert not spill.path.exists() and not spill.unwritten.exists()
    src = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    expected = np.concatenate([src["wg"], src["wu"]], axis=1)
    np.testing.assert_array_equal(made.numpy(), expected)
    proto = next(t for t in ir.to_proto(m).graph.initializer if t.name == "wg_gate_up")
    ref = weights.weight_ref(proto)
    assert [p.shape for p in ref.parts] == [src["wg"].shape, src["wu"].shape] and ref.axis == 1
    np.testing.assert_array_equal(weights.read(ref), expected)
    as_json = json.loads(json.dumps(ref.as_list()))  # (what the export child is given)
    np.testing.assert_array_equal(weights.read(as_json, mmap=False), expected)
    np.testing.assert_array_equal(Source.of_ref(as_json).read(), expected)
    with pytest.raises(FileNotFoundError):  # a reader that ignores the parts fails: it reads no zeros
        weights.read(as_json[:5])
    del spill
    import gc

    gc.collect()
    assert weights.weight_ref(proto).parts == ()  # the parts went with their spill file


def test_merged_weight_of_bfloat16_sources_read_through_casts_is_written_nowhere(tmp_path, monkeypatch):
    """The Cast spelling merges bf16 sources as stored (bf16): in files, the merged weight is only named, as an
    fp32 one is, rather than made fp32 and written (twice their bytes)."""
    from graphconv.frontend import weights

    original, m = _external_mlp(tmp_path, monkeypatch, stored=TensorProto.BFLOAT16)
    passes.PassManager("fuse-swiglu").run(m)
    monkeypatch.setattr(weights, "SPILL_MIN_BYTES", 0)
    spill = weights.SpillFile(tmp_path / "spill.bin")
    assert weights.spill_new_tensors(m, spill) == 0
    made = m.graph.initializers["wg_stored_gate_up"].const_value
    assert isinstance(made, weights.ConcatenatedTensor) and made.dtype == ir.DataType.BFLOAT16
    src = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    np.testing.assert_array_equal(made.numpy(), np.concatenate([src["wg_stored"], src["wu_stored"]], axis=1))
    assert not spill.path.exists()


@pytest.mark.parametrize("case", ["in memory", "bfloat16"])
def test_merged_weight_of_bfloat16_or_in_memory_sources_is_spilled(tmp_path, monkeypatch, case):
    """Where a source is in no file, or the merged weight's bytes are not its sources' (bfloat16 sources are
    made float32), the spill writes it."""
    from graphconv.frontend import weights

    original, m = _external_mlp(tmp_path, monkeypatch,
                                TensorProto.BFLOAT16 if case == "bfloat16" else TensorProto.FLOAT)
    if case == "in memory":
        m.graph.initializers["wu"].const_value = ir.tensor(numpy_helper.to_array(
            next(t for t in original.graph.initializer if t.name == "wu")), name="wu")
    passes.PassManager("fuse-swiglu").run(m)
    monkeypatch.setattr(weights, "SPILL_MIN_BYTES", 0)
    spill = weights.SpillFile(tmp_path / "spill.bin")
    moved = weights.spill_new_tensors(m, spill)
    t = m.graph.initializers["wg_gate_up"].const_value
    assert type(t) is ir.ExternalTensor and moved >= t.nbytes and spill.concatenated_bytes == 0
    src = {i.name: numpy_helper.to_array(i).astype(np.float32) for i in original.graph.initializer}
    np.testing.assert_array_equal(t.numpy(), np.concatenate([src["wg"], src["wu"]], axis=1))


def test_bf16_checkpoint_exported_auto_gets_one_swiglu_per_layer(tmp_path):
    """A bf16 checkpoint (save_pretrained) exported `--dtype auto` reads every weight through Cast(to=FLOAT); past
    onnxscript's folding limit (8,192 elements; every real model's weights) the Casts stay, and the gate/up
    projections merge as stored: Swiglu once per decoder layer (2), the compile verified."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    import subprocess
    import sys
    from pathlib import Path

    from graphconv.verify.census import primitive_census

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tf.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    root = Path(__file__).resolve().parent.parent

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "graphconv", *map(str, args)], capture_output=True, text=True,
                              cwd=root)
        assert proc.returncode == 0, proc.stderr
        return proc

    cli("export", tmp_path / "ckpt", "-o", tmp_path / "exp", "--task", "text-generation", "--dtype", "auto", "-q")
    exported = onnx.load(str(tmp_path / "exp" / "model.onnx"), load_external_data=False)
    stored = {t.name for t in exported.graph.initializer if t.data_type == TensorProto.BFLOAT16}
    assert sum(n.op_type == "Cast" and n.input[0] in stored for n in exported.graph.node) >= 7 * 2  # (the spelling)
    report = json.loads(cli("compile", tmp_path / "exp" / "model.onnx", "-o", tmp_path / "m.mindir", "--json").stdout)
    assert report["status"] == "verified" and report["fusions"]["fuse-swiglu"] == 2
    census = primitive_census(tmp_path / "m.mindir")
    assert census.get("Swiglu") == 2 and not census.get("SiLU")
