"""Layer-streamed verification (graphconv/target/blockwise.py): the generated network run block by block
(prologue, one layer Cell at a time with only its weights, epilogue), each block's boundary values compared
with onnxruntime's. Forced on small models with CompileOptions.layer_streamed=True (the default threshold,
blockwise.THRESHOLD_BYTES, is 2 GiB of Parameters)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx
import pytest

import graphconv
from graphconv.errors import VerificationError
from graphconv.target import blockwise, emit

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "examples" / "tiny_llama.onnx"


def _final(report) -> list[float]:
    return [o["max_abs"] for c in report.validation["cases"] for o in c["outputs"]]


def _compile(path, out, **kw):
    return graphconv.compile(path, out, target="ascend", **kw)


def test_tiny_llama_layer_streamed_matches_whole_network(tmp_path):
    from click.testing import CliRunner

    from graphconv.cli import cli

    whole = _compile(TINY, tmp_path / "w.mindir")  # small: the default is the whole-network check
    assert whole.validation["mode"] == "whole-network" and "layer_streamed" not in whole.validation
    result = CliRunner().invoke(cli, ["compile", str(TINY), "-o", str(tmp_path / "s.mindir"), "--layer-streamed",
                                      "--report", str(tmp_path / "s.json"), "-q"])
    assert result.exit_code == 0, result.output
    streamed = json.loads((tmp_path / "s.json").read_text())
    assert streamed["status"] == "verified" and streamed["validation"]["mode"] == "layer-streamed"
    blocks = streamed["validation"]["layer_streamed"]["blocks"]
    # the tiny Llama has two decoder layers (models/examples/make_examples.py): prologue, 2 layers, epilogue
    assert [b["block"] for b in blocks] == ["prologue", "layers[0]", "layers[1]", "epilogue"]
    assert [b["class"] for b in blocks[1:3]] == ["LlamaDecoderLayer"] * 2
    for b in blocks[1:3]:  # each layer's output (the residual stream) is compared with onnxruntime's
        assert len(b["values"]) == 1 and 0 <= b["max_abs"] < 1e-4
    # the layer blocks read only their own layer's weights, the same amount each, every one of them asked
    # of the kernel ahead (blockwise.weight_names)
    assert blocks[1]["weight_bytes"] == blocks[2]["weight_bytes"] > 0
    assert all(b["not_read_ahead"] == [] for b in blocks[:-1])
    # layer 1 runs on layer 0's compiled Cell with its own weights swapped in (blockwise.structure): its
    # output agreeing with onnxruntime's shows the swap took effect
    assert [b["compiled_again"] for b in blocks[1:3]] == [True, False]
    final = [o["max_abs"] for c in streamed["validation"]["cases"] for o in c["outputs"]]
    assert final == _final(whole)  # the same statements on the same kernels: the same numbers


def test_broken_layer_is_named(tmp_path, monkeypatch):
    """One weight of layer 1 of the cpu twin scaled: layer 0 still agrees with onnxruntime, layer 1 does not."""
    prepare = emit.prepare

    def corrupting(model, directory, name="network", **kw):
        net, task = prepare(model, directory, name, **kw)
        if name == "cpu_twin":
            path = Path(task["weights_onnx"])
            m = onnx.load(str(path))
            t = next(t for t in m.graph.initializer if t.name == "model.layers.1.mlp.down_proj.weight")
            arr = onnx.numpy_helper.to_array(t) * 1.5
            t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
            onnx.save(m, str(path), save_as_external_data=True, location=path.name + ".data")
        return net, task

    monkeypatch.setattr(emit, "prepare", corrupting)
    with pytest.raises(VerificationError, match=r"failed at block layers\[1\] \(LlamaDecoderLayer\): value 'add_695'"):
        _compile(TINY, tmp_path / "b.mindir", layer_streamed=True)


def _scale_model(tmp_path, scopes: bool):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_scale
    finally:
        sys.path.pop(0)
    cfg = compile_scale.Config(hidden=64, layers=4, intermediate=128, heads=4, kv_heads=2, vocab=128)
    path, _ = compile_scale.build_model(cfg, tmp_path / "model", seed=0, gamma="random", scopes=scopes)
    return path, cfg


def test_compile_scale_synthetic_model(tmp_path):
    """The benchmark's generator (benchmarks/compile_scale.py) at a tiny size, without dynamo's scopes
    (onnx.helper names only, as an exporter that writes no module stack), external weights; layer-streamed
    and whole-network give the same outputs."""
    path, cfg = _scale_model(tmp_path, scopes=False)
    whole = _compile(path, tmp_path / "w.mindir", layer_streamed=False)
    streamed = _compile(path, tmp_path / "s.mindir", layer_streamed=True)
    blocks = streamed.validation["layer_streamed"]["blocks"]
    # its layers are not grouped into a Cell class (a shape value of layer 0 is read by the others): each
    # inline layer is its own block, cut out by the weights it reads
    assert [b["block"] for b in blocks] == ["prologue"] + [f"model.layers.{k}" for k in range(cfg.layers)] + ["epilogue"]
    layers = blocks[1:-1]
    assert all(b["kind"] == "inline" for b in layers)
    assert all(len(b["values"]) >= 1 and b["max_abs"] < 1e-4 for b in layers)  # layer outputs have ONNX names
    assert layers[1]["weight_bytes"] == layers[2]["weight_bytes"] > 0
    assert all(b["not_read_ahead"] == [] for b in blocks)  # every weight read was asked ahead
    # the shapes and the mask the exporter computes once in layer 0 for every layer go to the prologue, and the
    # last layer keeps its residual add (blockwise._split_inline): every layer has one structure, and layers
    # 1-3 run on layer 0's compiled Cell with their own weights
    assert [b["compiled_again"] for b in layers] == [True, False, False, False]
    # each block's weights in files were read and transposed by a second thread while the block before it ran
    # (the prologue's while the graph exported; blockwise._Prefetch): the embedding; the 6 of a Llama layer's
    # 8 that are in files (q, k, v, o, the merged gate/up, down; the two RMSNorm gammas are small, in
    # memory); the head. A block compiled for its structure takes them as its Parameters too.
    assert [b["weights_prepared_ahead"] for b in blocks] == [1, 6, 6, 6, 6, 1]
    assert _final(streamed) == _final(whole)
    # the layer-streamed compile, which reads the weights twice after the passes, asked the kernel for the
    # whole weights file from its start (graphconv/frontend/readahead); the whole-network one did not
    load = [next(s for s in r.stages if s.name == "load").detail for r in (whole, streamed)]
    assert "weights_read_ahead_bytes" not in load[0]
    data_file = sum(f.stat().st_size for f in path.parent.iterdir() if f.suffix != ".onnx")
    # (the ranges close the gaps between weights: alignment, and the small tensors load read into the model)
    assert load[1]["external_weight_bytes"] <= load[1]["weights_read_ahead_bytes"] <= data_file


def test_compile_scale_model_with_dynamos_scopes_runs_its_layer_class(tmp_path):
    """The same generator with each node's module stack as dynamo writes it (`namespace` metadata): the four
    decoder layers become one Cell class (codegen's layers), and the layer-streamed run takes each layer as
    one call of that class: compiled once, the later layers' weights read ahead, each layer's output
    compared with onnxruntime's, the final outputs those of the whole-network run."""
    path, cfg = _scale_model(tmp_path, scopes=True)
    whole = _compile(path, tmp_path / "w.mindir", layer_streamed=False)
    streamed = _compile(path, tmp_path / "s.mindir", layer_streamed=True)
    grouping = next(s for s in streamed.stages if s.name == "lower").detail["layers"]
    assert (grouping["grouped"], grouping["classes"]) == (cfg.layers, 1)
    blocks = streamed.validation["layer_streamed"]["blocks"]
    assert [b["block"] for b in blocks] == ["prologue"] + [f"layers[{k}]" for k in range(cfg.layers)] + ["epilogue"]
    layers = blocks[1:-1]
    assert all(b["kind"] == "layer" and b["class"] == "LlamaDecoderLayer" for b in layers)
    assert all(b["values"] == [f"l{k}_residual_mlp"] and b["max_abs"] < 1e-4 for k, b in enumerate(layers))
    assert [b["compiled_again"] for b in layers] == [True, False, False, False]
    assert [b["weights_prepared_ahead"] for b in blocks] == [1, 6, 6, 6, 6, 1]
    assert all(b["not_read_ahead"] == [] for b in blocks)
    assert _final(streamed) == _final(whole)


def test_layer_output_names_map_to_onnx():
    """A layer call's outputs are named <list>_<index>_<ONNX name without its layer path> (graphconv/target/
    layers.group); the map back is exact and unique, for TorchScript-scoped names and dynamo's flat ones."""
    src = '''
class LayerA(nn.Cell):
    pass


class Net(nn.Cell):
    def __init__(self, weights=None):
        super().__init__(auto_prefix=False)
        self.w = _param(weights, 'w', (2,), ms.float32)
        self.layers = nn.CellList([
            LayerA(weights, ('a',)),
            LayerA(weights, ('b',)),
        ], auto_prefix=False)

    def construct(self, x):
        model_embed_Gather_0 = x * self.w
        layers_0_Add_1_0 = self.layers[0](model_embed_Gather_0)
        layers_1_Add_1_0 = self.layers[1](layers_0_Add_1_0)
        y = layers_1_Add_1_0 + 1
        return y
'''
    p = blockwise.plan(src, "Net")
    assert [(b.name, b.inputs, b.outputs) for b in p.blocks] == [
        ("prologue", ["x"], ["model_embed_Gather_0"]),
        ("layers[0]", ["model_embed_Gather_0"], ["layers_0_Add_1_0"]),
        ("layers[1]", ["layers_0_Add_1_0"], ["layers_1_Add_1_0"]),
        ("epilogue", ["layers_1_Add_1_0"], [])]
    graph = ["/model/embed/Gather_output_0", "/model/layers.0/Add_1_output_0", "/model/layers.1/Add_1_output_0"]
    assert blockwise.onnx_names(p, graph, "model.layers") == {
        "model_embed_Gather_0": "/model/embed/Gather_output_0",
        "layers_0_Add_1_0": "/model/layers.0/Add_1_output_0", "layers_1_Add_1_0": "/model/layers.1/Add_1_output_0"}
    # the prologue's block binds only the attribute it uses, a layer block only its own layer instance
    assert "self.w = _param" in blockwise.block_source(p, 0) and "LayerA(weights, ('b',))" in blockwise.block_source(p, 2)
    assert "_param" not in blockwise.block_source(p, 2) and "('a',)" not in blockwise.block_source(p, 2)


def test_network_without_layers_is_checked_whole(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])],
                              "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu", layer_streamed=True)
    assert report.status == "verified" and report.validation["mode"] == "whole-network"
    assert any("no layers found" in w for w in report.warnings)


def test_cpu_target_runs_the_network_itself_block_by_block(tmp_path):
    """--target cpu has no twin: the blocks are cut from the exported network's own source."""
    report = graphconv.compile(TINY, tmp_path / "c.mindir", target="cpu", layer_streamed=True)
    assert report.status == "verified" and report.validation["mode"] == "layer-streamed"
    blocks = report.validation["layer_streamed"]["blocks"]
    assert [b["block"] for b in blocks] == ["prologue", "layers[0]", "layers[1]", "epilogue"]
    assert all(b["max_abs"] < 1e-4 for b in blocks[:-1])
    assert max(_final(report)) < 1e-4


def test_plan_segment_is_the_source_of_each_node():
    """Plan.segment (line offsets computed once) gives ast.get_source_segment's text for every node,
    multi-line and non-ASCII ones too (column offsets count UTF-8 bytes)."""
    import ast

    text = ("class Net:\n    def __init__(self):\n        self.w = _param(w, 'é.weight',\n            (2, 3))\n"
            "    def construct(self, x):\n        y = x + 'ü' * 2  # é\n        return y\n")
    p = blockwise.Plan("Net", [], [], text, {}, {})
    nodes = [n for n in ast.walk(ast.parse(text)) if getattr(n, "end_col_offset", None) is not None]
    assert len(nodes) > 20
    for n in nodes:
        assert p.segment(n) == ast.get_source_segment(text, n)


def test_blocks_that_cannot_be_prepared_fail_the_compile_after_the_export(tmp_path, monkeypatch):
    """The child prepares the layer-streamed run (blockwise.Prepared: the plan, the block classes' module)
    before it exports the graph; an error there waits for the export and is reported as the run's error:
    a one-line compile error naming it, and nothing written at the output."""
    from graphconv import pipeline
    from graphconv.errors import GraphconvError

    block_plan = pipeline.Compiler._block_plan

    def unwritable_module(self, net, task, run, model, ws):
        plan = block_plan(self, net, task, run, model, ws)
        run["block_module"] = str(tmp_path / "no such folder" / "blocks.py")  # Prepared cannot write it
        return plan

    monkeypatch.setattr(pipeline.Compiler, "_block_plan", unwritable_module)
    with pytest.raises(GraphconvError) as caught:
        _compile(TINY, tmp_path / "m.mindir", layer_streamed=True)
    message = str(caught.value)
    # (verify-blocks' message: the emit stage, the export, ended well; an error before the export would fail
    # the export task itself, "mindspore.export rejected the generated network")
    assert "layer-streamed run did not run" in message and "FileNotFoundError" in message
    assert "\n" not in message
    assert not (tmp_path / "m.mindir").exists() and not list(tmp_path.glob("m_variables"))
