"""docs/extending.md's worked examples run through the real mechanisms: the handler and the contrib-op
decomposition are loaded with `plugins=` (what `--plugin` does) and compiled against onnxruntime; the fused-op
walk-through's statements about RmsNorm's record, pass and lowerings hold; the pass snippet runs."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
import opmap
import opmap.fused
import passes
from graphconv.errors import UnsupportedError
from graphconv.frontend.contrib.registry import DECOMPOSITIONS
from graphconv.compiler import lowering
from opmap import registry
from opmap.fused.record import FUSED_OPS, FusedOp
from passes import coverage, manager

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
EXTENDING = (ROOT / "docs" / "extending.md").read_text()
FUSED_DOC = (ROOT / "docs" / "fused_ops.md").read_text()


@pytest.fixture
def examples_importable():
    """docs/examples on sys.path for the test; whatever an example registered is removed afterwards, so the
    registries of later tests in this process are as they were."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLES))
        registry._HANDLERS.pop(("com.example", "SquaredRelu"), None)
        DECOMPOSITIONS.pop(("com.microsoft", "GatedAdd"), None)
        for name in ("squared_relu", "gated_add"):
            sys.modules.pop(name, None)


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


# --- (a) an op handler ------------------------------------------------------------------------------------

def _squared_relu_model(path: Path) -> Path:
    """One com.example::SquaredRelu node, with the op's ONNX function body so that onnxruntime, the oracle,
    can run the model."""
    scale = helper.make_node("Constant", [], ["s"])
    scale.attribute.append(helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT, ref_attr_name="scale"))
    body = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "r"], ["r2"]), scale,
            helper.make_node("Mul", ["r2", "s"], ["y"])]
    function = helper.make_function("com.example", "SquaredRelu", ["x"], ["y"], body,
                                    [helper.make_opsetid("", 18)], ["scale"])
    node = helper.make_node("SquaredRelu", ["x"], ["y"], domain="com.example", scale=0.5)
    graph = helper.make_graph([node], "g", [_vi("x", ["batch", 16])], [_vi("y", ["batch", 16])])
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_handler_example_compiles_and_verifies(tmp_path, examples_importable):
    report = graphconv.compile(_squared_relu_model(tmp_path / "m.onnx"), tmp_path / "m.mindir", target="cpu",
                               plugins=("squared_relu",))
    assert report.status == "verified"
    assert report.op_histogram == {"com.example::SquaredRelu": 1}
    assert report.census.get("ReLU") == 1  # the handler's ops.relu, in the MindIR MindSpore ran
    assert report.provenance["plugins"] == ["squared_relu"]
    handler = opmap.lookup("com.example", "SquaredRelu", 1)
    assert handler is not None and handler.since_version == 1


# --- (d) a contrib-op decomposition -----------------------------------------------------------------------

def _gated_add_model(path: Path, projected: bool = False) -> Path:
    inputs = [_vi("x", ["b", "s", 8]), _vi("y", ["b", "s", 8]), _vi("gate", ["b", "s", 1])]
    names = ["x", "y", "gate"]
    if projected:
        inputs[2] = _vi("gate", ["b", "s", 4])
        inputs.append(_vi("gate_weight", [4, 1]))
        names.append("gate_weight")
    node = helper.make_node("GatedAdd", names, ["out"], domain="com.microsoft", name="gated")
    graph = helper.make_graph([node], "g", inputs, [_vi("out", ["b", "s", 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                      helper.make_opsetid("com.microsoft", 1)]), path)
    return path


def test_contrib_example_decomposes_on_load(tmp_path, examples_importable):
    model = _gated_add_model(tmp_path / "m.onnx")
    with pytest.raises(UnsupportedError, match="GatedAdd"):  # without the example: refused, naming the op
        graphconv.compile(model, tmp_path / "m.mindir", target="cpu")
    report = graphconv.compile(model, tmp_path / "m.mindir", target="cpu", plugins=("gated_add",))
    assert report.status == "verified"  # MindSpore on the decomposition vs onnxruntime's own GatedAdd kernel
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["onnxruntime_contrib_ops_decomposed"] == {"com.microsoft::GatedAdd": 1}
    assert report.census.get("Mul") == 1 and report.census.get("Add") == 1


def test_contrib_example_refuses_the_projected_mode(tmp_path, examples_importable):
    with pytest.raises(UnsupportedError, match="gate_weight"):
        graphconv.compile(_gated_add_model(tmp_path / "p.onnx", projected=True), tmp_path / "p.mindir",
                          target="cpu", plugins=("gated_add",))


# --- (b) a fused op: the RmsNorm walk-through --------------------------------------------------------------

# The record fields docs/extending.md names.
DOC_FIELDS = ("name", "inputs", "outputs", "attributes", "body", "primitive", "doc", "ascend_body", "producer",
              "family", "as_is_inputs", "ascend_compute", "likely_causes", "constraints")


def test_the_record_fields_the_doc_names_exist():
    fields = {f.name for f in dataclasses.fields(FusedOp)}
    assert set(DOC_FIELDS) == fields, "docs/extending.md's list of FusedOp fields differs from the record"
    for f in DOC_FIELDS:
        assert f"`{f}`" in EXTENDING, f"docs/extending.md does not describe the field {f}"


def test_every_record_names_a_registered_pass_family_and_lowering():
    builtin = {p.name for p in passes.available_passes()}
    for op in FUSED_OPS.values():
        assert op.producer in builtin, op.name
        assert op.family in coverage.FAMILIES and op.producer in coverage.FAMILIES[op.family].passes, op.name
        assert opmap.lookup("mindspore", op.name, 1) is not None, op.name


def _decomposed_rmsnorm(eps: float, gamma: np.ndarray) -> ir.Model:
    """RMSNorm as dynamo writes it: x * Reciprocal(Sqrt(ReduceMean(x * x) + eps)) * gamma."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["ms_eps"]), helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
             helper.make_node("Reciprocal", ["rms"], ["rstd"]), helper.make_node("Mul", ["x", "rstd"], ["normed"]),
             helper.make_node("Mul", ["normed", "gamma"], ["y"], name="norm_scale")]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(eps, np.float32), "eps"), numpy_helper.from_array(gamma, "gamma")]
    graph = helper.make_graph(nodes, "g", [_vi("x", ["b", gamma.size])], [_vi("y", ["b", gamma.size])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


def test_rmsnorm_walkthrough():
    """The pass makes mindspore::RmsNorm with the epsilon it read; onnxruntime runs the record's body (the
    reference semantics fused_ops.md states); the ascend lowering calls ops.rms_norm with that epsilon."""
    rng = np.random.default_rng(0)
    eps, gamma = 1e-5, rng.standard_normal(8).astype(np.float32)
    model = _decomposed_rmsnorm(eps, gamma)
    pm = passes.PassManager("fuse-rmsnorm")
    assert pm.run(model) == {"fuse-rmsnorm": 1}
    assert pm.coverage["norm"]["fused"] == 1
    fused = opmap.fused.attach_functions(ir.to_proto(model))
    [node] = [n for n in fused.graph.node if n.domain == "mindspore"]
    assert node.op_type == "RmsNorm"
    assert helper.get_attribute_value(node.attribute[0]) == pytest.approx(eps)
    assert [(f.domain, f.name) for f in fused.functions] == [("mindspore", "RmsNorm")]

    x = rng.standard_normal((3, 8)).astype(np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    got = ort.InferenceSession(fused.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + eps) * gamma
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    net, _ = lowering.lower(ir.from_proto(onnx.shape_inference.infer_shapes(fused)))
    assert re.search(r"ops\.rms_norm\(x, self\.\w+, 9\.99999\d*e-06\)\[0\]", net.source), net.source
    cpu = lowering.lower(ir.from_proto(opmap.fused.inline_fused(fused)))[0].source
    assert "rms_norm" not in cpu and "ops.sqrt" in cpu  # the cpu form: the body, op by op


def test_fused_ops_doc_has_a_section_per_record():
    """docs/fused_ops.md has one `## ... mindspore::Name` section per fused op graphconv emits, naming its
    primitive."""
    sections = {}
    for block in re.split(r"^## ", FUSED_DOC, flags=re.M)[1:]:
        heading = block.splitlines()[0]
        for name in re.findall(r"`mindspore::(\w+)`", heading):
            sections[name] = block
    assert set(sections) == set(FUSED_OPS), "docs/fused_ops.md's sections differ from opmap/fused/'s records"
    for name, op in FUSED_OPS.items():
        assert op.primitive in sections[name], f"{name}'s section does not name its primitive {op.primitive}"


# --- (c) a pass ----------------------------------------------------------------------------------------------

def _snippet(marker: str) -> str:
    """The first ```python block after `marker` in docs/extending.md."""
    tail = EXTENDING[EXTENDING.index(marker):]
    return re.search(r"```python\n(.*?)```", tail, re.S).group(1)


def test_register_pass_snippet_runs():
    if not hasattr(passes, "PassResult"):
        pytest.skip("passes.PassResult comes with branch pass-contract")
    namespace: dict = {}
    exec(compile(_snippet("<!-- register_pass example -->"), "extending.md", "exec"), namespace)  # noqa: S102 - the doc's own snippet
    try:
        nodes = [helper.make_node("Identity", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
        graph = helper.make_graph(nodes, "g", [_vi("x", ["n", 4])], [_vi("y", ["n", 4])])
        model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
        assert passes.PassManager("drop-identity").run(model) == {"drop-identity": 1}
        assert [n.op_type for n in model.graph] == ["Relu"]
        assert [f.name for f in dataclasses.fields(passes.PassResult)] == ["count", "refusals", "node_reasons",
                                                                            "notes"]
    finally:
        manager._PASSES.pop("drop-identity", None)


def test_the_examples_the_doc_names_exist():
    named = set(re.findall(r"docs/examples/(\w+\.py)", EXTENDING))
    assert named == {p.name for p in EXAMPLES.glob("*.py")}
