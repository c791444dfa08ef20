"""Layer-streamed verification (graphconv/runtime/blocks.py): the generated network run block by block
(prologue, one layer Cell at a time with only its weights, epilogue), each block's boundary values compared
with onnxruntime's. Forced on small models with CompileOptions.layer_streamed=True (the default threshold,
options.THRESHOLD_BYTES, is 2 GiB of weights)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx
import pytest

import graphconv
from graphconv.errors import VerificationError
from graphconv.compiler import export_task

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
    # the layer blocks read only their own layer's weights, the same amount each
    assert blocks[1]["weight_bytes"] == blocks[2]["weight_bytes"] > 0
    # layer 1 runs on layer 0's compiled Cell (one class) with its own weights set: its output agreeing with
    # onnxruntime's shows the weights took effect
    assert [b["compiled_again"] for b in blocks[1:3]] == [True, False]
    final = [o["max_abs"] for c in streamed["validation"]["cases"] for o in c["outputs"]]
    assert final == _final(whole)  # the same statements on the same kernels: the same numbers


def test_broken_layer_is_named(tmp_path, monkeypatch):
    """One weight of layer 1 of the cpu twin scaled: layer 0 still agrees with onnxruntime, layer 1 does not."""
    prepare = export_task.prepare

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

    monkeypatch.setattr(export_task, "prepare", corrupting)
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
    (onnx.helper names only, as an exporter that writes no module stack), external weights: its layers are
    placed by the weights they read, their residual adds with the projections they add (layers._assign's
    "producers" placement; placed with what reads them, every add of the residual stream that the final norm
    ends in would go outside the layers), so the four layers are one Cell class; layer-streamed and
    whole-network give the same outputs."""
    path, cfg = _scale_model(tmp_path, scopes=False)
    whole = _compile(path, tmp_path / "w.mindir", layer_streamed=False)
    streamed = _compile(path, tmp_path / "s.mindir", layer_streamed=True)
    grouping = next(s for s in streamed.stages if s.name == "lower").detail["layers"]
    assert (grouping["grouped"], grouping["classes"], grouping["placed_by"]) == (cfg.layers, 1, "producers")
    blocks = streamed.validation["layer_streamed"]["blocks"]
    assert [b["block"] for b in blocks] == ["prologue"] + [f"layers[{k}]" for k in range(cfg.layers)] + ["epilogue"]
    layers = blocks[1:-1]
    assert all(b["kind"] == "layer" for b in layers)
    # each layer's output is the residual stream, which the generator names l<k>_residual_mlp
    assert all(b["values"] == [f"l{k}_residual_mlp"] and b["max_abs"] < 1e-4 for k, b in enumerate(layers))
    assert layers[1]["weight_bytes"] == layers[2]["weight_bytes"] > 0
    assert [b["compiled_again"] for b in layers] == [True, False, False, False]
    # each block's weights in files were read by a second thread while the block before it ran (the prologue's
    # while the graph exported): the embedding; the 6 of a Llama layer's 8 that are in files (q, k, v, o, the
    # merged gate/up, down; the two RMSNorm gammas are small, in memory); the head
    assert streamed.scheduling["block_weights_read_ahead"] == [1, 6, 6, 6, 6, 1]
    assert _final(streamed) == _final(whole)


def test_compile_scale_model_with_dynamos_scopes_runs_its_layer_class(tmp_path):
    """The same generator with each node's module stack as dynamo writes it (`namespace` metadata): the four
    decoder layers become one Cell class, and the layer-streamed run takes each layer as one call of that
    class: compiled once, each layer's output compared with onnxruntime's, the final outputs those of the
    whole-network run."""
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
    assert streamed.scheduling["block_weights_read_ahead"] == [1, 6, 6, 6, 6, 1]
    assert _final(streamed) == _final(whole)


def test_without_read_ahead_the_blocks_read_their_own_weights(tmp_path, monkeypatch):
    """GRAPHCONV_SCHEDULING=-block_read_ahead: every block reads its weights itself, with the same numbers."""
    path, cfg = _scale_model(tmp_path, scopes=True)
    ahead = _compile(path, tmp_path / "a.mindir", layer_streamed=True)
    monkeypatch.setenv("GRAPHCONV_SCHEDULING", "-block_read_ahead")
    alone = _compile(path, tmp_path / "b.mindir", layer_streamed=True)
    assert alone.scheduling["switches"]["block_read_ahead"] is False
    assert ahead.scheduling["block_weights_read_ahead"] == [1, 6, 6, 6, 6, 1]
    assert "block_weights_read_ahead" not in alone.scheduling
    assert _final(alone) == _final(ahead)
    assert ([b.get("max_abs") for b in alone.validation["layer_streamed"]["blocks"]]
            == [b.get("max_abs") for b in ahead.validation["layer_streamed"]["blocks"]])


def test_partition_blocks_carry_the_onnx_names_of_what_they_pass_on():
    """The partition is made at lowering time on the program IR (graphconv/compiler/partition.py): on the
    shipped tiny Llama (2 decoder layers) the prologue, one block per layer and the epilogue; each layer
    block's output is the ONNX value of its residual stream (an Add, read by the next norm); the epilogue
    returns the graph's output. Rendered, each block is a Cell class that binds only its own weights."""
    import onnx_ir as ir

    from graphconv.frontend.load import load
    from graphconv.compiler import codegen, layers, lowering
    from opmap import helpers

    model = load(TINY).proto
    net, _ = lowering.lower(ir.from_proto(model), scopes=layers.record_scopes(model))
    part = net.partition
    assert [(b.kind, b.name) for b in part.blocks] == [("prologue", "prologue"), ("layer", "layers[0]"),
                                                       ("layer", "layers[1]"), ("epilogue", "epilogue")]
    producers = {o: n for n in model.graph.node for o in n.output}
    for b in part.blocks[1:3]:
        (out,) = b.outputs
        assert producers[out.onnx_name].op_type == "Add"
        assert any(out.onnx_name in n.input for n in model.graph.node)
    assert [v.onnx_name for v in part.blocks[-1].outputs] == [o.name for o in model.graph.output]
    plan = part.plan("blocks.py")
    weights = [[w[0] for w in b["weights"]] for b in plan["blocks"]]
    assert len(weights[1]) == len(weights[2]) > 0
    assert "model.layers.1.input_layernorm.weight" in weights[2] and not any("layers.0." in n for n in weights[2])
    text = codegen.render_blocks(net.program, part, helpers)
    assert text.count("class _Block") == 4 and "LAZY_INLINE = False" in text
    assert "self.layer = LlamaDecoderLayer(weights, ('model.layers.1.input_layernorm.weight'" in text


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
    """--target cpu has no twin: the blocks are the exported network's own."""
    report = graphconv.compile(TINY, tmp_path / "c.mindir", target="cpu", layer_streamed=True)
    assert report.status == "verified" and report.validation["mode"] == "layer-streamed"
    blocks = report.validation["layer_streamed"]["blocks"]
    assert [b["block"] for b in blocks] == ["prologue", "layers[0]", "layers[1]", "epilogue"]
    assert all(b["max_abs"] < 1e-4 for b in blocks[:-1])
    assert max(_final(report)) < 1e-4


def test_blocks_that_cannot_be_prepared_fail_the_compile_after_the_export(tmp_path, monkeypatch):
    """The child prepares the layer-streamed run (blocks.Prepared: the block classes' module imported, the
    cases loaded) before it exports the graph; an error there waits for the export and is reported as the
    run's error: a one-line compile error naming it, and nothing written at the output."""
    from graphconv import verification
    from graphconv.errors import GraphconvError

    block_plan = verification.Verification._block_plan

    def unwritable_module(self, loaded, checked_net, ws):
        plan = block_plan(self, loaded, checked_net, ws)
        plan["module"] = str(tmp_path / "no such folder" / "blocks.py")  # Prepared cannot import it
        return plan

    monkeypatch.setattr(verification.Verification, "_block_plan", unwritable_module)
    with pytest.raises(GraphconvError) as caught:
        _compile(TINY, tmp_path / "m.mindir", layer_streamed=True)
    message = str(caught.value)
    # (verify-blocks' message: the emit stage, the export, ended well; an error before the export would fail
    # the export task itself, "mindspore.export rejected the generated network")
    assert "layer-streamed run did not run" in message and "FileNotFoundError" in message
    assert "\n" not in message
    assert not (tmp_path / "m.mindir").exists() and not list(tmp_path.glob("m_variables"))
