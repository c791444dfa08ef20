"""fuse-gelu: every exact (erf) and tanh spelling (also Bloom's factored one), and opset 20's Gelu, fuse once into
mindspore::Gelu / mindspore::GeluTanh, and quick GELU x*sigmoid(1.702x) into mindspore::FastGelu, keeping their
numerics; near misses (other constants, sigmoid(2x)*x, a sigmoid gate of another tensor, bf16 quick GELU) don't
fuse and the coverage report names the cause; on real exports the ascend MindIR holds N GeLU (tanh: gpt2, Bloom,
Gemma), N GeluExt(approximate='none') (erf: bert, ModernBERT) or N FastGeLU (CLIP), and the cpu twin verifies."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import passes
from fusion_utils import (assert_fuses_to_one, assert_same_numerics, fuse, fused_equals_unfused, fused_nodes,
                          spelling_id)
from fusion_zoo import assert_verified, primitive_args, zoo_compile

H = 16


def _gelu_graph(kind="erf", erf_op="div", cube="pow", outer="x*(half*(1+t))", swap=False, one_first=False,
                opset=14, dtype=TensorProto.FLOAT, half=0.5, scale=None, coeff=0.044715):
    """GELU of x[batch, seq, H], spelled as the arguments say; swap flips the root Mul's operands."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    if scale is None:
        scale = (math.sqrt(2) if erf_op == "div" else 1 / math.sqrt(2)) if kind == "erf" else math.sqrt(2 / math.pi)
    consts = {"half": half, "one": 1.0, "scale": scale, "coeff": coeff, "three": 3.0}
    inits = [numpy_helper.from_array(np.array(v, np_dtype), k) for k, v in consts.items()]
    nodes = []
    if kind == "erf":
        nodes += [helper.make_node("Div" if erf_op == "div" else "Mul", ["x", "scale"], ["arg"]),
                  helper.make_node("Erf", ["arg"], ["t"])]
    else:
        if cube == "pow":
            nodes.append(helper.make_node("Pow", ["x", "three"], ["x3"]))
        elif cube == "x*(x*x)":
            nodes += [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x", "x2"], ["x3"])]
        else:
            nodes += [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x2", "x"], ["x3"])]
        nodes += [helper.make_node("Mul", ["coeff", "x3"], ["cx3"]), helper.make_node("Add", ["x", "cx3"], ["in"]),
                  helper.make_node("Mul", ["scale", "in"], ["arg"]), helper.make_node("Tanh", ["arg"], ["t"])]
    nodes.append(helper.make_node("Add", ["one", "t"] if one_first else ["t", "one"], ["op"]))
    if outer == "x*(half*(1+t))":
        nodes.append(helper.make_node("Mul", ["half", "op"], ["b"]))
        a, b = "x", "b"
    elif outer == "(x*(1+t))*half":
        nodes.append(helper.make_node("Mul", ["x", "op"], ["a"]))
        a, b = "a", "half"
    elif outer == "x*(1+t)":  # the 0.5 folded into the next layer's weight: then y = 2 * GELU(x)
        a, b = "x", "op"
    else:
        nodes.append(helper.make_node("Mul", ["x", "half"], ["a"]))
        a, b = "a", "op"
    nodes.append(helper.make_node("Mul", [b, a] if swap else [a, b], ["y"]))
    g = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _native_graph(approximate="none", opset=20):
    g = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)], "gelu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


SPELLINGS = [
    # exact: the dynamo, TorchScript and transformers spellings, both erf scalings, both root orders
    dict(kind="erf", erf_op="div", outer="x*(half*(1+t))"),
    dict(kind="erf", erf_op="div", outer="(x*(1+t))*half"),
    dict(kind="erf", erf_op="mul", outer="(x*half)*(1+t)"),
    dict(kind="erf", erf_op="mul", outer="x*(half*(1+t))", swap=True, one_first=True),
    dict(kind="erf", erf_op="div", outer="(x*(1+t))*half", swap=True, opset=18),
    dict(kind="erf", erf_op="div", outer="x*(half*(1+t))", opset=17, dtype=TensorProto.FLOAT16),
    # tanh
    dict(kind="tanh", cube="pow", outer="x*(half*(1+t))"),
    dict(kind="tanh", cube="x*(x*x)", outer="(x*(1+t))*half"),
    dict(kind="tanh", cube="(x*x)*x", outer="(x*half)*(1+t)", swap=True),
    dict(kind="tanh", cube="pow", outer="(x*half)*(1+t)", one_first=True, opset=18),
    dict(kind="tanh", cube="x*(x*x)", outer="x*(half*(1+t))", swap=True, opset=17, dtype=TensorProto.FLOAT16),
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=spelling_id)
def test_each_spelling_fuses_once_and_keeps_numerics(spelling):
    original = _gelu_graph(**spelling)
    count, fused = fuse(original, "fuse-gelu")
    assert count == 1
    expected = "Gelu" if spelling["kind"] == "erf" else "GeluTanh"
    assert [n.op_type for n in fused_nodes(fused)] == [expected]
    assert not any(n.op_type in ("Erf", "Tanh", "Mul", "Add", "Pow", "Div") for n in fused.graph.node)
    tol = 1e-2 if spelling.get("dtype") == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)


@pytest.mark.parametrize("approximate,expected", [("none", "Gelu"), ("tanh", "GeluTanh")])
@pytest.mark.parametrize("opset", [20, 23])
def test_native_gelu_fuses_by_its_approximation(approximate, expected, opset):
    original = _native_graph(approximate, opset)
    count, fused = fuse(original, "fuse-gelu")
    assert count == 1
    assert [n.op_type for n in fused_nodes(fused)] == [expected]
    assert_same_numerics(original, fused)


def test_exact_and_tanh_bodies_differ():
    """The two fused ops carry different reference bodies (a swapped table entry would pass the per-op tests
    above only if both bodies were equal)."""
    x = np.linspace(-4, 4, 64, dtype=np.float32)
    import onnxruntime as ort

    outs = {}
    for kind in ("erf", "tanh"):
        _, fused = fuse(_gelu_graph(kind=kind), "fuse-gelu")
        sess = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
        outs[kind] = sess.run(None, {"x": x.reshape(2, 2, H)})[0].reshape(-1)
    erf_ref = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    tanh_ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(outs["erf"], erf_ref, atol=1e-6)
    np.testing.assert_allclose(outs["tanh"], tanh_ref, atol=1e-6)
    assert np.abs(outs["erf"] - outs["tanh"]).max() > 1e-4


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """Stable node names, as the pipeline gives them (coverage keys its check reasons by node name)."""
    for k, n in enumerate(model.graph.node):
        n.name = n.name or f"{n.op_type}_{k}"
    return model


def _coverage(model: onnx.ModelProto, spec: str = "fuse-gelu"):
    """(pass -> count, the coverage report, the skip reasons) of running `spec` on `model`."""
    m = ir.from_proto(onnx.shape_inference.infer_shapes(_named(model), data_prop=True))
    pm = passes.PassManager(spec)
    counts = pm.run(m)
    return counts, pm.coverage, pm.skipped


def _refusals(coverage: dict, family: str) -> list[str]:
    return [item["reason"] for item in coverage[family]["items"]]


# --- every operand order ------------------------------------------------------------------------------------

def _any_order_graph(kind: str, outer: int, flips: list[bool]) -> onnx.ModelProto:
    """A GELU of x[batch, H] whose every binary Mul/Add takes its operands in the order `flips` says: kind
    "erf" (x * 1/sqrt(2)), "tanh" (x * (x * x) cube) or "factored" (Bloom), outer 0: x * (0.5 * (1 + T)),
    1: (x * (1 + T)) * 0.5, 2: (x * 0.5) * (1 + T)."""
    consts = dict(half=0.5, one=1.0, s=1 / math.sqrt(2) if kind == "erf" else math.sqrt(2 / math.pi), c=0.044715,
                  one_in=1.0)
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    order = iter(flips)

    def binary(op, a, b, out):
        return helper.make_node(op, [b, a] if next(order) else [a, b], [out])

    if kind == "erf":
        nodes = [binary("Mul", "x", "s", "arg")]
    elif kind == "tanh":
        nodes = [binary("Mul", "x", "x", "xx"), binary("Mul", "x", "xx", "x3"), binary("Mul", "c", "x3", "cx3"),
                 binary("Add", "x", "cx3", "in"), binary("Mul", "s", "in", "arg")]
    else:
        nodes = [binary("Mul", "x", "c", "xc"), binary("Mul", "xc", "x", "cxx"), binary("Add", "cxx", "one_in", "in"),
                 binary("Mul", "x", "s", "xs"), binary("Mul", "xs", "in", "arg")]
    nodes += [helper.make_node("Erf" if kind == "erf" else "Tanh", ["arg"], ["t"]), binary("Add", "t", "one", "op")]
    nodes += [[binary("Mul", "half", "op", "b"), binary("Mul", "x", "b", "y")],
              [binary("Mul", "x", "op", "a"), binary("Mul", "a", "half", "y")],
              [binary("Mul", "x", "half", "a"), binary("Mul", "a", "op", "y")]][outer]
    g = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("kind", ["erf", "tanh", "factored"])
@pytest.mark.parametrize("outer", [0, 1, 2])
def test_every_operand_order_fuses(kind, outer):
    """Mul and Add commute: 24 random operand orders of every binary node (seeded) each fuse once, and a few
    keep the numbers (the rest are the same function)."""
    rng = np.random.default_rng(100 * outer + len(kind))
    for trial in range(24):
        original = _any_order_graph(kind, outer, list(rng.random(12) < 0.5))
        count, fused = fuse(original, "fuse-gelu")
        assert count == 1, (trial, [list(n.input) for n in original.graph.node])
        if trial < 3:
            assert_same_numerics(original, fused)


# --- Bloom's factored tanh GELU ------------------------------------------------------------------------------

def _bloom_graph(order="dynamo", coeff=0.044715, scale=0.79788456, one_inner=1.0, opset=18,
                 dtype=TensorProto.FLOAT):
    """transformers' bloom_gelu_forward x * 0.5 * (1.0 + tanh(0.79788456 * x * (1 + 0.044715 * x * x))) over
    x[batch, seq, H]. "dynamo": the exported spelling (measured on BloomForCausalLM, opsets 17/18/23):
    Mul(Mul(x, 0.5), Add(Tanh(Mul(Mul(x, s), Add(Mul(Mul(x, c), x), 1))), 1)); "nested": the other
    association, x * (0.5 * (1 + tanh(s * (x * (1 + c * (x * x)))))) with constants first."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    consts = {"half": 0.5, "one": 1.0, "one_in": one_inner, "s": scale, "c": coeff}
    inits = [numpy_helper.from_array(np.array(v, np_dtype), k) for k, v in consts.items()]
    m = helper.make_node
    if order == "dynamo":
        nodes = [m("Mul", ["x", "half"], ["xh"]), m("Mul", ["x", "s"], ["xs"]), m("Mul", ["x", "c"], ["xc"]),
                 m("Mul", ["xc", "x"], ["cxx"]), m("Add", ["cxx", "one_in"], ["inner"]),
                 m("Mul", ["xs", "inner"], ["arg"]), m("Tanh", ["arg"], ["t"]), m("Add", ["t", "one"], ["op"]),
                 m("Mul", ["xh", "op"], ["y"])]
    else:
        nodes = [m("Mul", ["x", "x"], ["xx"]), m("Mul", ["c", "xx"], ["cxx"]), m("Add", ["one_in", "cxx"], ["inner"]),
                 m("Mul", ["x", "inner"], ["xi"]), m("Mul", ["s", "xi"], ["arg"]), m("Tanh", ["arg"], ["t"]),
                 m("Add", ["one", "t"], ["op"]), m("Mul", ["half", "op"], ["hop"]), m("Mul", ["x", "hop"], ["y"])]
    g = helper.make_graph(nodes, "bloom_gelu", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])],
                          [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


BLOOM = [dict(), dict(order="nested"), dict(opset=17), dict(opset=23, order="nested"), dict(opset=14),
         dict(opset=17, dtype=TensorProto.FLOAT16)]


@pytest.mark.parametrize("spelling", BLOOM, ids=lambda s: spelling_id(s, "dynamo"))
def test_bloom_factored_tanh_gelu_fuses_to_gelu_tanh(spelling):
    assert_fuses_to_one(_bloom_graph(**spelling), "fuse-gelu", "GeluTanh", spelling.get("dtype"))


def test_bloom_formula_is_the_tanh_gelu():
    """sqrt(2/pi) * x * (1 + 0.044715 x^2) = sqrt(2/pi) * (x + 0.044715 x^3) (x distributed), and Bloom's
    0.79788456 is sqrt(2/pi) to 1e-9: in float64 the two GELUs agree to rounding; fp32 constants are equal."""
    x = np.linspace(-10, 10, 20001)
    bloom = x * 0.5 * (1.0 + np.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    exact_factored = x * 0.5 * (1.0 + np.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))
    tanh_gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert np.abs(exact_factored - tanh_gelu).max() < 1e-13
    assert np.abs(bloom - tanh_gelu).max() < 1e-8
    assert np.float32(0.79788456) == np.float32(math.sqrt(2 / math.pi))


# --- quick GELU -> FastGelu --------------------------------------------------------------------------------

def _quick_graph(k=1.702, k_first=False, sigmoid_first=False, opset=17, dtype=TensorProto.FLOAT, gated=False):
    """x * sigmoid(k * x) over x[batch, seq, H] (CLIP's quick_gelu; dynamo writes Mul(x, Sigmoid(Mul(x, 1.702))));
    gated: y * sigmoid(k * x) of a second input y instead (a sigmoid gate, not quick GELU)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inputs = [helper.make_tensor_value_info("x", dtype, ["batch", "seq", H])]
    if gated:
        inputs.append(helper.make_tensor_value_info("g", dtype, ["batch", "seq", H]))
    other = "g" if gated else "x"
    nodes = [helper.make_node("Mul", ["k", "x"] if k_first else ["x", "k"], ["kx"]),
             helper.make_node("Sigmoid", ["kx"], ["s"]),
             helper.make_node("Mul", ["s", other] if sigmoid_first else [other, "s"], ["y"])]
    g = helper.make_graph(nodes, "quick_gelu", inputs, [helper.make_tensor_value_info("y", dtype, ["batch", "seq", H])],
                          [numpy_helper.from_array(np.array(k, np_dtype), "k")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


QUICK = [dict(), dict(k_first=True), dict(sigmoid_first=True), dict(k_first=True, sigmoid_first=True, opset=18),
         dict(opset=14), dict(opset=23), dict(dtype=TensorProto.FLOAT16)]


@pytest.mark.parametrize("spelling", QUICK, ids=lambda s: spelling_id(s, "plain"))
def test_quick_gelu_fuses_to_fast_gelu_and_keeps_numerics(spelling):
    assert_fuses_to_one(_quick_graph(**spelling), "fuse-gelu", "FastGelu", spelling.get("dtype"))


def test_fast_gelu_body_is_quick_gelu_not_a_gelu():
    import onnxruntime as ort

    x = np.linspace(-6, 6, 64, dtype=np.float32)
    _, fused = fuse(_quick_graph(), "fuse-gelu")
    sess = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.reshape(2, 2, H)})[0].reshape(-1)
    np.testing.assert_allclose(got, x / (1 + np.exp(-1.702 * x)), atol=1e-6)
    tanh_gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert np.abs(got - tanh_gelu).max() > 1e-2


def test_ascend_emits_fast_gelu_and_the_cpu_twin_verifies(tmp_path):
    p = tmp_path / "quick.onnx"
    onnx.save(_quick_graph(), p)
    report = graphconv.compile(p, tmp_path / "quick.mindir", passes="fuse-gelu")
    assert report.fusions == {"fuse-gelu": 1}
    assert report.census.get("FastGeLU") == 1 and "Sigmoid" not in report.census
    assert [len(c) for c in primitive_args(tmp_path / "quick.mindir", "FastGeLU")] == [1]  # FastGeLU(x)
    assert_verified(report, 1e-5)


# --- near misses: not fused, and the report says why -------------------------------------------------------

def _other_x_outside(model: onnx.ModelProto) -> onnx.ModelProto:
    """The GELU's outer x replaced by a second input x2: 0.5 * x2 * (1 + T(x)) is not a GELU."""
    model.graph.input.append(helper.make_tensor_value_info("x2", model.graph.input[0].type.tensor_type.elem_type,
                                                           ["batch", "seq", H]))
    root = model.graph.node[-1]
    for i, name in enumerate(root.input):
        if name == "x":
            root.input[i] = "x2"
    return model


# name -> (graph builder, reason in the skip list and the coverage item, or None: coverage reason only)
NEAR_MISSES = {
    "half is not 0.5": (lambda: _gelu_graph(half=0.6), "half is 0.6, GELU's is 0.5"),
    "erf scale is not 1/sqrt(2)": (lambda: _gelu_graph(erf_op="mul", scale=0.8), "scale is 0.8"),
    "tanh coefficient": (lambda: _gelu_graph(kind="tanh", coeff=0.1), "coeff is 0.1, GELU's is 0.044715"),
    "tanh coefficient 0.05": (lambda: _gelu_graph(kind="tanh", coeff=0.05), "coeff is 0.05"),
    "tanh scale": (lambda: _gelu_graph(kind="tanh", scale=0.8), "scale is 0.8"),
    "fp16 below opset 15": (lambda: _gelu_graph(dtype=TensorProto.FLOAT16), "below opset 15"),
    "bloom coefficient": (lambda: _bloom_graph(coeff=0.1),
                          "coeff is 0.1, GELU's is 0.044715 (the Tanh argument's x^2 coefficient"),
    "bloom scale": (lambda: _bloom_graph(scale=0.75), "scale is 0.75, GELU's is 0.7978846"),
    "bloom inner one": (lambda: _bloom_graph(one_inner=2.0), "one_inner is 2, GELU's is 1"),
    "sigmoid(2x)*x": (lambda: _quick_graph(k=2.0), "Sigmoid's scale is 2, quick GELU's (FastGeLU) is 1.702"),
    "sigmoid(1.5x)*x, sigmoid first": (lambda: _quick_graph(k=1.5, sigmoid_first=True), "Sigmoid's scale is 1.5"),
    "quick GELU in bf16": (lambda: _quick_graph(dtype=TensorProto.BFLOAT16, opset=18),
                           "FastGeLU takes float16 or float32"),
    "quick GELU fp16 below opset 15": (lambda: _quick_graph(dtype=TensorProto.FLOAT16, opset=14), "below opset 15"),
}
# Structural misses (no pattern matches): only the coverage explanation can say why.
EXPLAINED = {
    "a sigmoid gate of another tensor": (lambda: _quick_graph(gated=True),
                                         "Sigmoid(1.702 * x) is not multiplied by the same x"),
    "tanh GELU's outer x differs": (lambda: _other_x_outside(_gelu_graph(kind="tanh")),
                                    "1 + tanh is not multiplied by 0.5 * x of the x inside tanh"),
    "erf GELU's outer x differs": (lambda: _other_x_outside(_gelu_graph(kind="erf")),
                                   "1 + erf is not multiplied by 0.5 * x of the x inside erf"),
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_do_not_fuse_and_say_why(name):
    build, reason = NEAR_MISSES[name]
    count, fused = fuse(build(), "fuse-gelu")
    assert count == 0 and not fused_nodes(fused)
    counts, coverage, skipped = _coverage(build())
    assert counts["fuse-gelu"] == 0
    assert any(reason in r for r in skipped.get("fuse-gelu", [])), skipped
    # ... and the gelu family's coverage lists the candidate with that reason.
    assert coverage["gelu"]["candidates"] == 1 and coverage["gelu"]["fused"] == 0
    assert any(reason in r for r in _refusals(coverage, "gelu")), coverage["gelu"]


@pytest.mark.parametrize("name", EXPLAINED)
def test_structural_misses_are_explained(name):
    build, reason = EXPLAINED[name]
    counts, coverage, _ = _coverage(build())
    assert counts["fuse-gelu"] == 0
    assert coverage["gelu"]["candidates"] == 1
    assert any(reason in r for r in _refusals(coverage, "gelu")), coverage["gelu"]


def test_explanation_of_a_tanh_coefficient():
    """explain() itself (what coverage falls back on where no check ran, e.g. unnamed nodes) names the constant."""
    from passes import fuse_gelu

    m = ir.from_proto(onnx.shape_inference.infer_shapes(_gelu_graph(kind="tanh", coeff=0.1)))
    (tanh,) = [n for n in m.graph if n.op_type == "Tanh"]
    assert fuse_gelu.explain(tanh) == "Tanh argument's coefficient is 0.1, GELU's is 0.044715 (GELU's x^3 / x^2 " \
        "coefficient)"
    m = ir.from_proto(onnx.shape_inference.infer_shapes(_quick_graph(k=2.0)))
    (sig,) = [n for n in m.graph if n.op_type == "Sigmoid"]
    assert fuse_gelu.explain(sig) == "Sigmoid's scale is 2, quick GELU's (FastGeLU) is 1.702"


# --- real exports ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,exporter,opset", [
    ("gpt2", "dynamo", 18),  # tanh, dynamo's spelling
    ("bert", "torchscript", 14),  # erf, TorchScript's spelling
    pytest.param("gpt2", "torchscript", 17, marks=pytest.mark.slow),
    pytest.param("gpt2", "torchscript", 14, marks=pytest.mark.slow),
    pytest.param("gpt2", "dynamo", 23, marks=pytest.mark.slow),  # opset-20 Gelu(approximate="tanh")
    pytest.param("bert", "dynamo", 18, marks=pytest.mark.slow),
    pytest.param("bert", "torchscript", 17, marks=pytest.mark.slow),
    pytest.param("bert", "dynamo", 23, marks=pytest.mark.slow),  # opset-20 Gelu(approximate="none")
    pytest.param("hf-gpt2", "dynamo", 18, marks=pytest.mark.slow),  # transformers' gelu_new spelling
    pytest.param("hf-bert", "dynamo", 18, marks=pytest.mark.slow),
])
def test_zoo_gets_n_gelu(model, exporter, opset, export_cache, tmp_path_factory):
    if model.startswith("hf-"):
        pytest.importorskip("transformers")
    n_layers = 2
    tanh = "gpt2" in model
    report, mindir, fused = zoo_compile(export_cache, tmp_path_factory, model, opset, exporter)
    assert report.fusions["fuse-gelu"] == n_layers
    primitive, other = ("GeLU", "GeluExt") if tanh else ("GeluExt", "GeLU")
    assert report.census.get(primitive) == n_layers
    assert not any(k in report.census for k in ("Erf", "Tanh", "FastGeLU", other))
    assert len(fused_nodes(fused, "GeluTanh" if tanh else "Gelu")) == n_layers
    if tanh:  # GeLU(x): the tanh approximation, no argument
        assert [len(c) for c in primitive_args(mindir, "GeLU")] == [1] * n_layers
    else:  # GeluExt(x, approximate): the enum of 'none' is 0
        assert [c[1:] for c in primitive_args(mindir, "GeluExt")] == [[0]] * n_layers
    assert_verified(report)


# transformers architectures built with default settings (models/architectures.py: hidden 64, 2 layers, 4 heads,
# initializer_range 0.2, attention implementation left to transformers), exported by dynamo.
ARCH = "models.architectures:build_{}"
# The passes that run before and in the GELU / gated-MLP families (attention and rotary left out: their fused
# bodies are not what these tests are about).


# arch -> (fused op, MindIR primitive, the GELU primitives that must not appear, gated GELU MLP)
REAL = {
    "clip_text": ("FastGelu", "FastGeLU", ("GeLU", "GeluExt"), False),  # quick_gelu
    "bloom": ("GeluTanh", "GeLU", ("GeluExt", "FastGeLU"), False),  # bloom_gelu_forward, factored
    "gemma": ("GeluTanh", "GeLU", ("GeluExt", "FastGeLU"), True),  # gelu_pytorch_tanh(gate) * up
    "modernbert": ("Gelu", "GeluExt", ("GeLU", "FastGeLU"), True),  # gelu(input) * gate, Wi(x).chunk(2)
}


@pytest.mark.parametrize("arch,opset", [
    ("clip_text", 18),
    pytest.param("clip_text", 17, marks=pytest.mark.slow),
    pytest.param("clip_text", 23, marks=pytest.mark.slow),
    pytest.param("bloom", 18, marks=pytest.mark.slow),
    pytest.param("bloom", 23, marks=pytest.mark.slow),
    pytest.param("gemma", 18, marks=pytest.mark.slow),
    pytest.param("gemma", 23, marks=pytest.mark.slow),  # opset-20 Gelu(approximate="tanh")
    pytest.param("modernbert", 18, marks=pytest.mark.slow),
])
def test_real_export_gets_one_gelu_per_layer(arch, opset, export_cache, tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("models.architectures")
    n_layers = 2  # one MLP activation per layer
    fused_op, primitive, others, gated = REAL[arch]
    counts = fused_equals_unfused(export_cache(ARCH.format(arch), opset, "dynamo"))
    assert counts["fuse-gelu"] == n_layers
    report, mindir, fused = zoo_compile(export_cache, tmp_path_factory, ARCH.format(arch), opset, "dynamo")
    assert report.fusions["fuse-gelu"] == n_layers
    assert len(fused_nodes(fused, fused_op)) == n_layers
    assert report.census.get(primitive) == n_layers
    assert not any(k in report.census for k in ("Erf", "Tanh", "Sigmoid", *others))
    gelu = report.coverage["gelu"]
    assert gelu["candidates"] == gelu["fused"] == n_layers, gelu
    if gated:  # GeGLU: the GELU fuses on its own, the Mul stays, and coverage says why
        mlp = report.coverage["gated_mlp"]
        assert mlp["candidates"] == n_layers and mlp["fused"] == 0
        assert all("MindSpore has no GeGLU primitive (the GELU is fused on its own)" in item["reason"]
                   for item in mlp["items"]), mlp
        assert "Swiglu" not in report.census
    assert_verified(report)



@pytest.mark.parametrize("kind,swap", [("erf", False), ("erf", True), ("tanh", False)])
def test_gelu_whose_half_was_folded_away_fuses_as_twice_gelu(kind, swap):
    """x * (1 + erf(x / sqrt 2)) with no 0.5 (onnxsim folded it into the next Conv's weight: Whisper's conv
    stem through TorchScript) is 2 * GELU(x): the GELU fuses and a Mul by 2 stays."""
    original = _gelu_graph(kind=kind, outer="x*(1+t)", swap=swap, opset=18)
    count, fused = fuse(original, "fuse-gelu")
    assert count == 1
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == [
        "Gelu" if kind == "erf" else "GeluTanh", "Mul"]
    assert_same_numerics(original, fused, 1e-5, 1e-5)


def test_a_full_gelu_is_not_split_into_twice_gelu_times_half():
    """With the 0.5 present the whole GELU fuses as one op (the folded-half rule declines silently)."""
    count, fused = fuse(_gelu_graph(outer="(x*(1+t))*half", opset=18), "fuse-gelu")
    assert count == 1 and [n.op_type for n in fused.graph.node] == ["Gelu"]
    counts, coverage, skipped = _coverage(_gelu_graph(outer="(x*(1+t))*half", opset=18))
    assert skipped.get("fuse-gelu", []) == [] and coverage["gelu"]["fused"] == 1
