"""Weight names (graphconv.frontend.param_names): Parameters and .ckpt keys carry the PyTorch state_dict names where the
ONNX lets them be recovered, pass-made weights get derived names, and the mapping file and `graphconv inspect`
say where each comes from. The expected names come from hand-built graphs and from PyTorch, never from
graphconv's own output."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.frontend import param_names
from graphconv.tools.inspect import inspect, read_checkpoint_index, summary
from graphconv.compiler.lowering import ParamSpec

RNG = np.random.default_rng(0)


def _w(name, *shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _model(nodes, inits, n_in=4, n_out=3, opset=18):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])
    g = helper.make_graph(nodes, "g", [x], [y], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _simplify(model):
    import onnxsim

    simplified, _ = onnxsim.simplify(model, check_n=0)
    return simplified


def _names(model, made=None):
    return {n: o for n, o in param_names.WeightNames.record(model).assign(
        [t.name for t in model.graph.initializer], made).items()}


def _folded_transpose_model():
    """MatMul(x, Transpose(lin.weight)) as dynamo writes it without its optimizer: onnxsim folds the Transpose
    into a new initializer named after its output."""
    return _model([helper.make_node("Transpose", ["lin.weight"], ["val_9"], perm=[1, 0]),
                   helper.make_node("MatMul", ["x", "val_9"], ["y"])], [_w("lin.weight", 3, 4)])


def test_a_folded_transpose_gets_its_source_name_recorded_before_onnxsim():
    model = _folded_transpose_model()
    names = param_names.WeightNames.record(model)
    simplified = _simplify(model)
    assert [t.name for t in simplified.graph.initializer] == ["val_9"]  # what onnxsim does with the name
    origin = names.assign(["val_9"])["val_9"]
    assert origin.name == "lin.weight" and origin.source == ["lin.weight"]
    assert origin.transform == ["transpose [1, 0]"]
    # Stored in Linear's [out, in] layout (ops.dense), the value is lin.weight itself.
    entry = param_names.mapping([ParamSpec("lin_weight", "val_9", (3, 4), "float32", True, "lin.weight")],
                                {"val_9": origin})["lin.weight"]
    assert entry["transform"] is None and entry["layout"] == "same" and entry["source"] == ["lin.weight"]


def test_a_dtype_changed_in_place_is_in_the_transform():
    # --precision fp16 lowers a weight in place (same name): the mapping records the cast.
    origin = _names(_folded_transpose_model())["lin.weight"]
    entry = param_names.mapping([ParamSpec("a", "lin.weight", (3, 4), "float16", False)],
                                {"lin.weight": origin})["lin.weight"]
    assert entry["transform"] == "cast float16" and entry["layout"] == "cast float16"


def test_a_torchscript_matmul_weight_is_named_by_its_node_scope():
    model = _model([helper.make_node("MatMul", ["x", "onnx::MatMul_5"], ["y"], name="/encoder/layers.0/fc/MatMul")],
                   [_w("onnx::MatMul_5", 4, 3)])
    origin = _names(model)["onnx::MatMul_5"]
    assert origin.name == "encoder.layers.0.fc.weight"
    entry = param_names.mapping([ParamSpec("a", "onnx::MatMul_5", (3, 4), "float32", True, origin.name)],
                                {"onnx::MatMul_5": origin})[origin.name]
    assert entry["transform"] == "transpose [1, 0]" and entry["layout"] == "same"


def _dynamo_linear(weight: str, placeholder: str, scopes: list[str]):
    node = helper.make_node("MatMul", ["x", weight], ["y"], name="node_linear")
    for key, value in (("pkg.torch.onnx.fx_node", "%linear : [num_users=1] = call_function[target=torch.ops.aten."
                        f"linear.default](args = (%x, %{placeholder}), kwargs = {{}})"),
                       ("pkg.torch.onnx.name_scopes", repr(scopes))):
        node.metadata_props.add(key=key, value=value)
    return _model([node], [_w(weight, 4, 3)])


def test_dynamo_metadata_names_a_linear_weight_its_exporter_folded():
    model = _dynamo_linear("val_76", "p_blocks_0_proj_weight", ["", "blocks", "blocks.0", "blocks.0.proj", "linear"])
    assert _names(model)["val_76"].name == "blocks.0.proj.weight"


@pytest.mark.parametrize("placeholder, scopes", [
    ("p_other_weight", ["", "blocks.0.proj", "linear"]),  # the argument is not this module's
    ("p_blocks_0_proj_weight", ["", "blocks.0", "linear"]),  # leaf "proj_weight": proj.weight or proj_weight?
])
def test_dynamo_metadata_that_does_not_prove_the_name_keeps_the_onnx_name(placeholder, scopes):
    assert _names(_dynamo_linear("val_76", placeholder, scopes))["val_76"].name == "val_76"


def _mul_reading(weight: str, name: str, fx_args: str | None, scopes: list[str] | None):
    node = helper.make_node("Mul", ["x", weight], ["y"], name=name)
    if fx_args is not None:
        node.metadata_props.add(key="pkg.torch.onnx.fx_node", value="%mul_98 : [num_users=1] = call_function["
                                f"target=torch.ops.aten.mul.Tensor](args = ({fx_args}), kwargs = {{}})")
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr(scopes))
    return _model([node], [_w(weight, 4)], n_out=4)


@pytest.mark.parametrize("weight, node, fx_args, scopes, expected", [
    # Gemma's (1 + w), folded by the exporter: no state_dict name, qualified by its readers' module.
    ("add_127", "node_mul_98", "%mul_94, %add_127", ["", "blk", "blk.norm", "mul_98"], "blk.norm.add_127"),
    ("onnx::Mul_741", "/blk/norm/Mul_1", None, None, "blk.norm.Mul_741"),
    # A real top-level name that no reader takes as an FX value stays as it is.
    ("cls_token", "node_mul_98", "%mul_94, %p_cls_token", ["", "mul_98"], "cls_token"),
])
def test_values_the_exporter_folded_are_named_by_their_module(weight, node, fx_args, scopes, expected):
    assert _names(_mul_reading(weight, node, fx_args, scopes))[weight].name == expected


def test_ambiguous_names_keep_the_onnx_names():
    # Two weights in one scope claim the same name; a weight read in two scopes has no single name; a name
    # that another initializer already has is not taken.
    nodes = [helper.make_node("MatMul", ["x", "onnx::MatMul_1"], ["a"], name="/blk/fc/MatMul"),
             helper.make_node("MatMul", ["x", "onnx::MatMul_2"], ["b"], name="/blk/fc/MatMul_1"),
             helper.make_node("MatMul", ["x", "onnx::MatMul_3"], ["c"], name="/one/MatMul"),
             helper.make_node("MatMul", ["x", "onnx::MatMul_3"], ["d"], name="/two/MatMul"),
             helper.make_node("MatMul", ["x", "onnx::MatMul_4"], ["e"], name="/head/MatMul"),
             helper.make_node("Sum", ["a", "b", "c", "d", "e", "head.weight"], ["y"])]
    inits = [_w(f"onnx::MatMul_{k}", 4, 3) for k in range(1, 5)] + [_w("head.weight", 3)]
    names = _names(_model(nodes, inits))
    assert {n: o.name for n, o in names.items()} == {n: n for n in names}
    assert "not unique" in names["onnx::MatMul_1"].recovered
    assert "disagree" in names["onnx::MatMul_3"].recovered


def test_a_pass_made_weight_gets_a_derived_name():
    model = _model([helper.make_node("MatMul", ["x", "onnx::MatMul_1"], ["g"], name="/mlp/gate_proj/MatMul"),
                    helper.make_node("MatMul", ["x", "onnx::MatMul_2"], ["u"], name="/mlp/up_proj/MatMul"),
                    helper.make_node("Add", ["g", "u"], ["y"])],
                   [_w("onnx::MatMul_1", 4, 3), _w("onnx::MatMul_2", 4, 3)])
    names = param_names.WeightNames.record(model)
    graph = ir.from_proto(model).graph
    param_names.record_made(graph, "merged", ["onnx::MatMul_1", "onnx::MatMul_2"], "concat axis 1",
                            made_by="fuse-swiglu")
    param_names.record_made(graph, "swapped", ["merged"], "swap the halves", "suffix:_halves_swapped")
    made = param_names.made_records(dict(graph.metadata_props))
    origins = names.assign(["merged", "swapped", "onnx::MatMul_1__fp16"], made)
    assert origins["merged"].name == "mlp.gate_up_proj.weight"
    assert origins["merged"].source == ["onnx::MatMul_1", "onnx::MatMul_2"]
    assert origins["merged"].derived_from == ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    assert origins["swapped"].name == "mlp.gate_up_proj.weight_halves_swapped"
    assert origins["swapped"].transform == ["concat axis 1 of onnx::MatMul_1, onnx::MatMul_2", "swap the halves"]
    # Made by a stage that did not record it: named after the known name it extends.
    assert origins["onnx::MatMul_1__fp16"].name == "mlp.gate_proj.weight__fp16"
    # The record travels with the model (to_proto/from_proto, as between the pipeline's stages).
    again = ir.from_proto(ir.to_proto(ir.Model(graph, ir_version=10)))
    assert param_names.made_records(dict(again.graph.metadata_props)) == made


@pytest.mark.parametrize("names, merged", [
    (["a.b.gate_proj.weight", "a.b.up_proj.weight"], "a.b.gate_up_proj.weight"),
    (["m.w1.weight", "m.w3.weight"], "m.w1_w3.weight"),
    (["a.q.weight", "b.k.weight"], None),  # two components differ
])
def test_merged_names(names, merged):
    assert param_names._merged_name(names) == merged


_LOAD_INTO_NET = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy as np
    import mindspore as ms
    src = sys.argv[1]
    spec = importlib.util.spec_from_file_location("network", src + "/network.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    net = mod.Network()  # Parameters as zeros, then the checkpoint
    ckpt = ms.load_checkpoint(src + "/network.ckpt")
    not_loaded, unused = ms.load_param_into_net(net, ckpt)
    values = {k: v.asnumpy() for k, v in ckpt.items()}
    np.savez(sys.argv[2], **values)
    print(json.dumps({"net": [p.name for p in net.get_parameters()], "missing": not_loaded, "unexpected": unused}))
""")


def _load_into_net(src, tmp_path) -> tuple[dict, dict]:
    """In a MindSpore child: the emitted Cell, load_param_into_net of its .ckpt; the result and the values."""
    out = tmp_path / "ckpt_values.npz"
    proc = subprocess.run([sys.executable, "-c", _LOAD_INTO_NET, str(src), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(out) as values:
        return result, {k: values[k] for k in values.files}


def _two_linears(tmp_path, second: str, second_node: str):
    """A dynamo-style folded transpose (enc.fc.weight read as val_9) and a second Linear weight `second`
    read by the MatMul node `second_node`; saved, with the two initializers."""
    nodes = [helper.make_node("Transpose", ["enc.fc.weight"], ["val_9"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "val_9"], ["h"], name="node_linear"),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", second], ["y"], name=second_node)]
    fc, proj = _w("enc.fc.weight", 16, 8), _w(second, 16, 6)
    path = tmp_path / "m.onnx"
    onnx.save(_model(nodes, [fc, proj], n_in=8, n_out=6), path)
    return path, fc, proj


def _compile_with_source(path, src, **options):
    """A verified compile with --emit-source src; (report, network.names.json) with the two Linears' names."""
    report = graphconv.compile(path, path.with_suffix(".mindir"), emit_source=src, **options)
    assert report.status == "verified"
    mapping = json.loads((src / "network.names.json").read_text())
    assert set(mapping) == {"enc.fc.weight", "head.proj.weight"}
    return report, mapping


def test_compile_names_parameters_writes_the_mapping_and_loads_into_the_net(tmp_path):
    # One dynamo-style folded transpose and one TorchScript-style weight, through the whole compile.
    path, fc, proj = _two_linears(tmp_path, "onnx::MatMul_12", "/head/proj/MatMul")
    src = tmp_path / "src"
    report, mapping = _compile_with_source(path, src, target="cpu")
    assert mapping["enc.fc.weight"]["source"] == ["enc.fc.weight"] and mapping["enc.fc.weight"]["transform"] is None
    assert mapping["head.proj.weight"]["source"] == ["onnx::MatMul_12"]
    assert mapping["head.proj.weight"]["transform"] == "transpose [1, 0]"
    assert report.artifacts["parameter_names"] == str(src / "network.names.json")
    info = inspect(src / "network.ckpt")
    assert {p["name"]: (p["shape"], p["dtype"], p["source"]) for p in info["params"]} == {
        "enc.fc.weight": ([16, 8], "float32", ["enc.fc.weight"]),
        "head.proj.weight": ([6, 16], "float32", ["onnx::MatMul_12"])}
    assert "head.proj.weight [6, 16] float32  <- onnx::MatMul_12 (transpose [1, 0])" in summary(info)
    result, values = _load_into_net(src, tmp_path)
    assert result["missing"] == [] and result["unexpected"] == []
    np.testing.assert_array_equal(values["enc.fc.weight"], numpy_helper.to_array(fc))
    np.testing.assert_array_equal(values["head.proj.weight"], numpy_helper.to_array(proj).T)


def test_read_checkpoint_index_refuses_other_files(tmp_path):
    bad = tmp_path / "x.ckpt"
    bad.write_bytes(b"\x12\x05hello")
    assert read_checkpoint_index(bad) == []  # not a Checkpoint.value field: nothing listed
    bad.write_bytes(b"\x0a\xff\xff")
    with pytest.raises(graphconv.InputError):
        read_checkpoint_index(bad)


def _expected_keys(module) -> tuple[list[set[str]], set[str]]:
    """The state_dict keys grouped by tensor (tied weights: one group of several keys, of which the .ckpt
    holds one, whichever the exporter kept), and the buffers that are not in the state_dict (non-persistent:
    exporters still write them as initializers)."""
    groups: dict[tuple, set[str]] = {}
    sd = module.state_dict(keep_vars=True)
    for k, t in sd.items():
        groups.setdefault((t.data_ptr(), tuple(t.shape)), set()).add(k)
    return list(groups.values()), {n for n, _ in module.named_buffers()} - set(sd)


@pytest.mark.parametrize("exporter, target", [("dynamo", "cpu"),
                                              pytest.param("torchscript", "ascend", marks=pytest.mark.slow)])
def test_transformers_llama_ckpt_keys_are_the_state_dict_keys(exporter, target, tmp_path):
    pytest.importorskip("transformers")
    from graphconv.frontend.export import export_pytorch
    from models import load_factory

    module, example_inputs, dynamic_axes = load_factory("hf/llama")()
    path = tmp_path / "llama.onnx"
    export_pytorch(module, example_inputs, path, dynamic_axes, opset=18, exporter=exporter, check=False)
    src = tmp_path / "src"
    # ascend: fused primitives read the weights; cpu: the fused ops' bodies (RmsNorm's gamma via an Identity).
    graphconv.compile(path, tmp_path / "llama.mindir", target=target, verify=False, emit_source=src)
    mapping = json.loads((src / "network.names.json").read_text())
    groups, non_persistent = _expected_keys(module)
    made = {k: v for k, v in mapping.items() if v.get("made_by")}
    assert made and all(v["made_by"] == "fuse-swiglu" for v in made.values())  # gate_up_proj per layer
    keys = {p["name"] for p in read_checkpoint_index(src / "network.ckpt")}
    assert keys == set(mapping)
    # Modulo the mapping file: a pass-made weight stands for the state_dict keys it was derived from.
    named = keys - set(made) - non_persistent
    covered = named | {s for v in made.values() for s in v["derived_from"]}
    assert all(len(g & covered) == 1 for g in groups), [sorted(g) for g in groups if len(g & covered) != 1]
    assert named <= set().union(*groups)
    result, values = _load_into_net(src, tmp_path)
    assert result["missing"] == [] and result["unexpected"] == [] and set(result["net"]) == keys
    # Each name holds that tensor: stored as in the state_dict (layout "same"), gate_up as cat(gate, up).
    sd = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    for k, entry in mapping.items():
        if k in made:
            np.testing.assert_array_equal(values[k], np.concatenate([sd[s] for s in entry["derived_from"]], 0))
        elif k in sd:
            assert entry["layout"] == "same", k
            np.testing.assert_array_equal(values[k], sd[k])


def test_precision_casts_are_listed_in_the_mapping(tmp_path):
    """--precision fp16: each weight cast to fp16 keeps its name (converted in place), and the mapping beside
    the .ckpt says the precision pass cast it; the .ckpt holds them in fp16."""
    path, _, _ = _two_linears(tmp_path, "head.proj.weight", "node_linear_1")
    src = tmp_path / "src"
    _, mapping = _compile_with_source(path, src, precision="fp16")
    for name in mapping:
        assert mapping[name]["made_by"] == "precision" and "cast to fp16" in mapping[name]["transform"], mapping[name]
    info = {p["name"]: p for p in inspect(src / "network.ckpt")["params"]}
    assert {k: p["dtype"] for k, p in info.items()} == {"enc.fc.weight": "float16", "head.proj.weight": "float16"}
