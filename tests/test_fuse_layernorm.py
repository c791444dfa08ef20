"""fuse-layernorm: the native node and every decomposed spelling fuse once and keep their numerics; near misses
don't fuse (with the reason reported); on real exports the ascend MindIR holds 2N+1 LayerNorm primitives carrying
the model's epsilon, and the cpu twin verifies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.frontend.param_names import made_records
from fusion_utils import assert_same_numerics, fuse, fused_nodes, run_refused, spelling_id
from fusion_zoo import assert_verified, primitive_args, zoo_compile

H = 16
EPS = 1e-5


def _ln_graph(square="pow", normalize="div", opset=14, dtype=TensorProto.FLOAT, cast_island=False,
              affine_first=False, axes=(-1,), axes2=None, keepdims=1, eps=EPS, eps_shape=(), gamma_shape=(H,),
              beta_shape=(H,), bias=True):
    """A decomposed LayerNorm over x[batch, seq, H], spelled as the arguments say."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.full(eps_shape, eps, np.float32), "eps"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(gamma_shape)).astype(np_dtype), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(beta_shape)).astype(np_dtype), "beta"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes = []
    x = "x"
    if cast_island:
        nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT))
        x = "x32"

    def mean(src, dst, ax):
        if opset >= 18:
            inits.append(numpy_helper.from_array(np.array(ax, np.int64), f"axes_{dst}"))
            return helper.make_node("ReduceMean", [src, f"axes_{dst}"], [dst], keepdims=keepdims)
        return helper.make_node("ReduceMean", [src], [dst], axes=list(ax), keepdims=keepdims)

    nodes += [mean(x, "mu", axes), helper.make_node("Sub", [x, "mu"], ["d"]),
              helper.make_node("Pow", ["d", "two"], ["d2"]) if square == "pow" else
              helper.make_node("Mul", ["d", "d"], ["d2"]),
              mean("d2", "var", axes2 or axes),
              helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["std"])]
    if normalize == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["std"], ["r"]), helper.make_node("Mul", ["d", "r"], ["n"])]
    elif normalize == "div-one":
        nodes += [helper.make_node("Div", ["one", "std"], ["r"]), helper.make_node("Mul", ["r", "d"], ["n"])]
    else:
        nodes += [helper.make_node("Div", ["d", "std"], ["n"])]
    n = "n"
    if cast_island:
        nodes.append(helper.make_node("Cast", ["n"], ["n16"], to=dtype))
        n = "n16"
    nodes.append(helper.make_node("Mul", ["gamma", n] if affine_first else [n, "gamma"], ["s" if bias else "y"]))
    if bias:
        nodes.append(helper.make_node("Add", ["beta", "s"] if affine_first else ["s", "beta"], ["y"]))
    else:
        inits = [i for i in inits if i.name != "beta"]
    g = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _native_graph(opset=17, dtype=TensorProto.FLOAT, bias=True, axis=-1, eps=EPS, extra_outputs=False,
                  stash_type=None, gamma_shape=(H,)):
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(gamma_shape)).astype(np_dtype), "gamma")]
    ins = ["x", "gamma"]
    if bias:
        inits.append(numpy_helper.from_array((0.1 * rng.standard_normal(gamma_shape)).astype(np_dtype), "beta"))
        ins.append("beta")
    attrs = dict(axis=axis, epsilon=eps)
    if stash_type is not None:
        attrs["stash_type"] = stash_type
    outs = ["y", "mean", "istd"] if extra_outputs else ["y"]
    node = helper.make_node("LayerNormalization", ins, outs, **attrs)
    graph_outs = [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])]
    if extra_outputs:
        graph_outs.append(helper.make_tensor_value_info("istd", TensorProto.FLOAT, None))
    g = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])],
                          graph_outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


SPELLINGS = [
    dict(square="pow", normalize="div"),
    dict(square="mul", normalize="div"),
    dict(square="pow", normalize="reciprocal"),
    dict(square="mul", normalize="div-one"),
    dict(square="pow", normalize="div", affine_first=True),
    dict(square="pow", normalize="div", opset=17),
    dict(square="mul", normalize="reciprocal", opset=18),
    dict(square="pow", normalize="div", opset=18, axes=(2,)),
    dict(square="pow", normalize="div", eps_shape=(1,)),
    dict(square="pow", normalize="div", eps=1e-12),
    dict(square="pow", normalize="div", opset=17, dtype=TensorProto.FLOAT16, cast_island=True),
    dict(square="pow", normalize="div", bias=False),
    dict(square="mul", normalize="reciprocal", bias=False, affine_first=True),
]
# fuse-layernorm alone, and behind the passes that run before it in the default pipeline (fuse-rmsnorm takes the
# inner part of a decomposed LayerNorm for an RMSNorm of the centred input; fuse-layernorm then takes it back).
PIPELINES = ["fuse-layernorm", "canonicalize,fuse-rmsnorm,fuse-layernorm"]


def fuse_through(model: onnx.ModelProto, spec: str) -> tuple[int, onnx.ModelProto, dict]:
    """fusion_utils.fuse for a pipeline: the fuse-layernorm count, the fused model, and the skip reasons."""
    import onnx_ir as ir

    import opmap.fused
    import passes

    m = ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True))
    pm = passes.PassManager(spec)
    count = pm.run(m)["fuse-layernorm"]
    fused = opmap.fused.attach_functions(ir.to_proto(m))
    return count, onnx.shape_inference.infer_shapes(fused, data_prop=True), pm.skipped


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("spelling", SPELLINGS, ids=spelling_id)
def test_each_decomposed_spelling_fuses_once_and_keeps_numerics(spelling, pipeline):
    original = _ln_graph(**spelling)
    count, fused, _ = fuse_through(original, pipeline)
    assert count == 1
    ln = fused_nodes(fused)
    assert [n.op_type for n in ln] == ["LayerNorm"]
    assert helper.get_attribute_value(ln[0].attribute[0]) == pytest.approx(spelling.get("eps", EPS))
    assert not any(n.op_type in ("Pow", "Sqrt", "ReduceMean", "Sub", "Add") for n in fused.graph.node)
    tol = 1e-2 if spelling.get("dtype") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


NATIVE = [
    dict(),
    dict(opset=18, eps=1e-12),
    dict(bias=False),
    dict(axis=2),
    dict(dtype=TensorProto.FLOAT16),
    dict(opset=23),
]


@pytest.mark.parametrize("spelling", NATIVE, ids=spelling_id)
def test_native_layernormalization_fuses_and_keeps_numerics(spelling):
    original = _native_graph(**spelling)
    count, fused = fuse(original, "fuse-layernorm")
    assert count == 1
    ln = fused_nodes(fused)
    assert [n.op_type for n in ln] == ["LayerNorm"]
    assert helper.get_attribute_value(ln[0].attribute[0]) == pytest.approx(spelling.get("eps", EPS))
    assert not any(n.op_type == "LayerNormalization" for n in fused.graph.node)
    tol = 1e-2 if spelling.get("dtype") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


NEAR_MISSES = {
    "mean over another axis": (lambda: _ln_graph(axes=(1,)), "not the last axis"),
    "variance over another axis": (lambda: _ln_graph(axes2=(1,)), "not the last axis"),
    "keepdims=0": (lambda: _ln_graph(keepdims=0), "keepdims=0"),
    "non-scalar epsilon": (lambda: _ln_graph(eps_shape=(H,)), "epsilon is not a constant scalar"),
    "2-D gamma": (lambda: _ln_graph(gamma_shape=(1, H)), "gamma is not 1-D"),
    "fp16 below opset 15": (lambda: _ln_graph(dtype=TensorProto.FLOAT16, cast_island=True),
                            "below opset 15"),
    "native over two axes": (lambda: _native_graph(axis=1, gamma_shape=(5, H)), "more than the last axis"),
    "native Mean/InvStdDev used": (lambda: _native_graph(extra_outputs=True), None),  # not removable: no match
    "native fp16 statistics": (lambda: _native_graph(dtype=TensorProto.FLOAT16, stash_type=0), "stash_type=0"),
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_do_not_fuse_and_say_why(name):
    build, reason = NEAR_MISSES[name]
    count, fused, skipped = fuse_through(build(), "fuse-layernorm")
    assert count == 0
    assert not fused_nodes(fused)
    if reason is not None:
        assert any(reason in r for r in skipped.get("fuse-layernorm", [])), skipped


def test_a_2d_bias_stays_an_add_after_the_layernorm():
    original = _ln_graph(beta_shape=(1, H))
    count, fused, skipped = fuse_through(original, "fuse-layernorm")
    assert count == 1
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == ["LayerNorm", "Add"]
    assert_same_numerics(original, fused)


def test_ascend_lowering_of_a_bias_free_layernorm(tmp_path):
    """The zero beta the fusion supplies lowers too: LayerNorm(x, gamma, zeros, -1, -1, eps) in the MindIR."""
    p = tmp_path / "ln.onnx"
    onnx.save(_native_graph(bias=False, eps=1e-6), p)
    report = graphconv.compile(p, tmp_path / "ln.mindir", simplify=False, passes="fuse-layernorm")
    assert report.fusions == {"fuse-layernorm": 1} and report.census.get("LayerNorm") == 1
    (call,) = primitive_args(tmp_path / "ln.mindir", "LayerNorm")
    assert call[1] == "gamma" and call[3:5] == [-1, -1] and call[5] == pytest.approx(1e-6)
    assert_verified(report, 1e-5)


# --- real exports ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,exporter,opset", [
    ("gpt2", "dynamo", 18),  # native LayerNormalization
    ("bert", "torchscript", 14),  # decomposed (TorchScript below 17)
    pytest.param("gpt2", "torchscript", 17, marks=pytest.mark.slow),
    pytest.param("gpt2", "torchscript", 14, marks=pytest.mark.slow),
    pytest.param("gpt2", "dynamo", 23, marks=pytest.mark.slow),
    pytest.param("bert", "dynamo", 18, marks=pytest.mark.slow),
    pytest.param("bert", "torchscript", 17, marks=pytest.mark.slow),
    pytest.param("hf-gpt2", "dynamo", 18, marks=pytest.mark.slow),
    pytest.param("hf-bert", "dynamo", 18, marks=pytest.mark.slow),
])
def test_zoo_gets_2n_plus_1_layernorm(model, exporter, opset, export_cache, tmp_path_factory):
    """bert: embedding LN + 2 per layer; gpt2: 2 per layer + the final one."""
    if model.startswith("hf-"):
        pytest.importorskip("transformers")
    n = 2 * 2 + 1
    report, mindir, fused = zoo_compile(export_cache, tmp_path_factory, model, opset, exporter)
    lns = fused_nodes(fused, "LayerNorm")
    assert report.fusions["fuse-layernorm"] == n
    assert report.census.get("LayerNorm") == n
    assert not any(k in report.census for k in ("Sqrt", "Rsqrt", "ReduceMean", "RmsNorm"))
    # The ascend MindIR's LayerNorm calls carry the epsilon the fusion extracted (the argument record):
    # (x, gamma, beta, begin_norm_axis, begin_params_axis, epsilon), gamma and beta in that order.
    record = sorted(helper.get_attribute_value(node.attribute[0]) for node in lns)
    calls = primitive_args(mindir, "LayerNorm")
    assert [c[3:5] for c in calls] == [[-1, -1]] * n
    assert sorted(tuple(c[1:3]) for c in calls) == sorted(tuple(node.input[1:3]) for node in lns)
    assert sorted(c[5] for c in calls) == pytest.approx(record, rel=1e-6)
    assert record == pytest.approx([1e-5 if "gpt2" in model else 1e-12] * n, rel=1e-6)
    assert_verified(report)


# --- a bias-free LayerNorm computed in an fp32 island with the weight inside (Cohere) -------------------------

def _cohere_graph(dtype=TensorProto.FLOAT16, bias=False, gamma_first=True, opset=18, exact_gamma=True,
                  cast_back=None, eps=EPS):
    """CohereLayerNorm.forward as dynamo writes it for a low-precision model (measured on a bf16
    CohereForCausalLM): Cast(x, fp32); mean; (x - mean)^2 mean; (x - mean) * Reciprocal(Sqrt(var + eps));
    gamma32 * that (gamma32: an fp32 initializer, onnxsim's fold of Cast(gamma16, fp32)); Cast back to x's dtype.
    (ModernBERT's nn.LayerNorm(bias=False) is a native LayerNormalization without B: NATIVE's bias=False.)
    exact_gamma False: gamma32 holds values the low-precision dtype cannot represent."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(4)
    gamma = (1 + 0.1 * rng.standard_normal(H)).astype(np_dtype).astype(np.float32)
    if not exact_gamma:
        gamma = gamma + np.float32(1e-4)
    beta = (0.1 * rng.standard_normal(H)).astype(np_dtype).astype(np.float32)
    inits = [numpy_helper.from_array(gamma, "gamma32"), numpy_helper.from_array(beta, "beta32"),
             numpy_helper.from_array(np.array(eps, np.float32), "eps"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    m = helper.make_node

    def mean(src, dst):
        if opset >= 18:
            return [m("Constant", [], [f"ax_{dst}"], value_ints=[-1]),
                    m("ReduceMean", [src, f"ax_{dst}"], [dst], keepdims=1)]
        return [m("ReduceMean", [src], [dst], axes=[-1], keepdims=1)]

    nodes = [m("Cast", ["x"], ["x32"], to=TensorProto.FLOAT), *mean("x32", "mu"), m("Sub", ["x32", "mu"], ["d"]),
             m("Pow", ["d", "two"], ["d2"]), *mean("d2", "var"), m("Add", ["var", "eps"], ["ve"]),
             m("Sqrt", ["ve"], ["std"]), m("Reciprocal", ["std"], ["r"]), m("Mul", ["d", "r"], ["n"]),
             m("Mul", ["gamma32", "n"] if gamma_first else ["n", "gamma32"], ["s"])]
    if bias:
        nodes.append(m("Add", ["s", "beta32"], ["s2"]))
    else:
        inits = [i for i in inits if i.name != "beta32"]
    nodes.append(m("Cast", ["s2" if bias else "s"], ["y"], to=cast_back or dtype))
    g = helper.make_graph(nodes, "cohere_ln", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", cast_back or dtype, ["batch", "seq", H])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    for k, n in enumerate(model.graph.node):
        n.name = f"{n.op_type}_{k}"
    return model


COHERE = [dict(), dict(gamma_first=False), dict(bias=True), dict(opset=17), dict(dtype=TensorProto.BFLOAT16),
          dict(dtype=TensorProto.BFLOAT16, bias=True, opset=23), dict(dtype=TensorProto.FLOAT)]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("spelling", COHERE, ids=lambda s: spelling_id(s, "fp16"))
def test_weight_inside_the_fp32_island_fuses(spelling, pipeline):
    """LayerNorm takes gamma (beta) in x's dtype: the fp32 weights are converted, exactly (they came from that
    dtype), and beta is zeros when there is none; the numbers equal the unfused graph's."""
    original = _cohere_graph(**spelling)
    count, fused, _ = fuse_through(original, pipeline)
    assert count == 1
    (ln,) = fused_nodes(fused)
    assert ln.op_type == "LayerNorm"
    assert helper.get_attribute_value(ln.attribute[0]) == pytest.approx(EPS)
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == ["LayerNorm"]
    dtype = spelling.get("dtype", TensorProto.FLOAT16)
    inits = {i.name: i for i in fused.graph.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in fused.graph.node if n.op_type == "Constant"}
    src = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    gamma = inits.get(ln.input[1]) or consts[ln.input[1]]
    assert gamma.data_type == dtype
    np.testing.assert_array_equal(numpy_helper.to_array(gamma).astype(np.float32), src["gamma32"])
    beta = numpy_helper.to_array(inits.get(ln.input[2]) or consts[ln.input[2]]).astype(np.float32)
    np.testing.assert_array_equal(beta, src["beta32"] if spelling.get("bias") else np.zeros(H, np.float32))
    # A converted copy is a pass-made weight: its record names the source (graphconv/frontend/param_names.py).
    made = made_records({p.key: p.value for p in fused.graph.metadata_props})
    if dtype != TensorProto.FLOAT:
        assert made[gamma.name] == {"sources": ["gamma32"], "transform": f"cast to {gamma.name.rsplit('_', 1)[1]}",
                                    "naming": f"suffix:_{gamma.name.rsplit('_', 1)[1]}", "made_by": "fuse-layernorm"}
    assert set(made) <= set(inits)
    # Equal up to the low-precision rounding of the output (and fp32 reordering); ORT has no bf16 CPU kernels
    # for some body ops, the oracle falls back to onnx.reference there.
    tol = 1e-5 if dtype == TensorProto.FLOAT else 1e-2
    assert_same_numerics(original, fused, tol, tol)


COHERE_NEAR_MISSES = {
    "gamma not representable in fp16": (dict(exact_gamma=False), "cannot represent exactly"),
    "cast to another dtype than x's": (dict(cast_back=TensorProto.FLOAT), "not back to x's"),
}


@pytest.mark.parametrize("name", COHERE_NEAR_MISSES)
def test_weight_inside_the_island_near_misses(name):
    kwargs, reason = COHERE_NEAR_MISSES[name]
    pm, _ = run_refused(_cohere_graph(**kwargs), "fuse-layernorm")
    norm = pm.coverage["norm"]
    assert norm["candidates"] == 1 and norm["fused"] == 0  # the variance's ReduceMean (of a square)
    assert any(reason in r for r in pm.skipped["fuse-layernorm"]), pm.skipped
    assert any(reason in item["reason"] for item in norm["items"]), norm


# --- real exports of bias-free LayerNorms ---------------------------------------------------------------------

ARCH = "models.architectures:build_{}"


@pytest.mark.slow
@pytest.mark.parametrize("arch,opset,n", [
    ("cohere", 18, 3),  # CohereLayerNorm: input_layernorm per (parallel) layer + final norm, decomposed in fp32
    ("cohere", 23, 3),
    ("modernbert", 18, 5),  # nn.LayerNorm(bias=False): LayerNormalization without B; embeddings + 3 + final
    ("modernbert", 23, 5),
])
def test_real_export_bias_free_layernorm(arch, opset, n, export_cache, tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("models.architectures")
    from fusion_utils import fused_equals_unfused

    path = export_cache(ARCH.format(arch), opset, "dynamo")
    assert fused_equals_unfused(path)["fuse-layernorm"] == n
    report, mindir, fused = zoo_compile(export_cache, tmp_path_factory, ARCH.format(arch), opset, "dynamo")
    assert report.fusions["fuse-layernorm"] == n and report.census.get("LayerNorm") == n
    assert not any(k in report.census for k in ("Sqrt", "Reciprocal", "ReduceMean", "RmsNorm"))
    norm = report.coverage["norm"]
    assert norm["fused"] == norm["candidates"], norm
    # beta = zeros: a constant of the normalised size in every LayerNorm, gamma the model's weight.
    lns = fused_nodes(fused, "LayerNorm")
    consts = {nd.output[0]: numpy_helper.to_array(nd.attribute[0].t) for nd in fused.graph.node
              if nd.op_type == "Constant"}
    inits = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    for ln in lns:
        beta = consts.get(ln.input[2], inits.get(ln.input[2]))
        assert beta is not None and beta.shape == (64,) and not beta.any()
        assert "norm" in ln.input[1] or ln.input[1] in inits
    calls = primitive_args(mindir, "LayerNorm")
    assert [c[3:5] for c in calls] == [[-1, -1]] * n
    assert sorted(c[5] for c in calls) == pytest.approx([1e-5] * n, rel=1e-6)
    assert_verified(report)
