"""fuse-gelu: every exact (erf) and tanh spelling, and opset 20's Gelu, fuse once into mindspore::Gelu /
mindspore::GeluTanh and keep their numerics; near misses (other constants, FastGELU) don't fuse; on real exports
the ascend MindIR holds N GeLU (tanh, gpt2) or N GeluExt(approximate='none') (erf, bert), and the cpu twin
verifies."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from fusion_utils import assert_same_numerics, fuse, fused_nodes
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


def _id(spelling):
    return "-".join(f"{k}={v}" for k, v in spelling.items())


@pytest.mark.parametrize("spelling", SPELLINGS, ids=_id)
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


def _fast_gelu():
    inits = [numpy_helper.from_array(np.array(1.702, np.float32), "k")]
    nodes = [helper.make_node("Mul", ["x", "k"], ["kx"]), helper.make_node("Sigmoid", ["kx"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"])]
    g = helper.make_graph(nodes, "fast", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


NEAR_MISSES = {
    "half is not 0.5": (lambda: _gelu_graph(half=0.6), "half is 0.6"),
    "erf scale is not 1/sqrt(2)": (lambda: _gelu_graph(erf_op="mul", scale=0.8), "scale is 0.8"),
    "tanh coefficient": (lambda: _gelu_graph(kind="tanh", coeff=0.05), "coeff is 0.05"),
    "tanh scale": (lambda: _gelu_graph(kind="tanh", scale=0.8), "scale is 0.8"),
    "fp16 below opset 15": (lambda: _gelu_graph(dtype=TensorProto.FLOAT16), "below opset 15"),
    "FastGELU x*sigmoid(1.702x)": (_fast_gelu, None),
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_do_not_fuse_and_say_why(name):
    build, reason = NEAR_MISSES[name]
    count, fused = fuse(build(), "fuse-gelu")
    assert count == 0 and not fused_nodes(fused)
    if reason is not None:
        import onnx_ir as ir

        import passes

        pm = passes.PassManager("fuse-gelu")
        pm.run(ir.from_proto(onnx.shape_inference.infer_shapes(build())))
        assert any(reason in r for r in pm.skipped.get("fuse-gelu", [])), pm.skipped


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
