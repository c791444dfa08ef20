"""The layer-by-layer oracle (graphconv/verify/piecewise.py): onnxruntime runs a model one piece at a time
(prologue, each layer, epilogue) with only that piece's weights mapped. The pieces are cut at the values the
compiled network's blocks pass on (graphconv/compiler/partition.py), and the outputs must be exactly
onnxruntime's on the whole model: the same nodes on the same kernels. In a compile it runs beside the
MindSpore child (graphconv/runtime/scheduling.both)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import psutil
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.frontend import weights
from graphconv.frontend.load import load
from graphconv.runtime import scheduling
from graphconv.compiler import layers, lowering
from graphconv.verify import piecewise, reference

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "examples" / "tiny_llama.onnx"


def _whole_and_pieces(model, pieces):
    cases = reference.make_cases(model)
    whole = reference.Oracle(model).run(cases)
    got, kept, rows = piecewise.run(model, pieces, cases)
    return whole, got, kept, rows


def _block_boundaries(model):
    """The boundaries the compile cuts the oracle at: the lowered network's blocks and the ONNX names of the
    values they pass on."""
    import onnx_ir as ir

    net, _ = lowering.lower(ir.from_proto(model), scopes=layers.record_scopes(model))
    return [(b.name, names) for b, names in zip(net.partition.blocks, net.partition.onnx_boundaries())]


def test_tiny_llama_runs_in_its_layers_with_onnxruntimes_numbers():
    """The shipped tiny Llama (dynamo export, 2 decoder layers: models/examples/make_examples.py), cut where
    its lowered network's blocks are: a prologue, one piece per layer, an epilogue."""
    model = load(TINY).proto
    pieces = piecewise.cut(model, _block_boundaries(model))
    assert [p.name for p in pieces] == ["prologue", "layers[0]", "layers[1]", "epilogue"]
    whole, got, kept, rows = _whole_and_pieces(model, pieces)
    for w, g in zip(whole, got):
        assert set(w) == set(g) == {"output"}
        assert np.array_equal(w["output"], g["output"])
    # what the layers pass on is kept: the residual stream after layer 0 is read by layer 1
    assert any(name in kept[0] for name in pieces[2].reads)
    assert sum(len(p.nodes) for p in pieces) == len(model.graph.node)  # (no dead node in this graph)


def _scale_model(tmp_path, layers_=3):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_scale
    finally:
        sys.path.pop(0)
    cfg = compile_scale.Config(hidden=64, layers=layers_, intermediate=128, heads=4, kv_heads=2, vocab=128)
    path, manifest = compile_scale.build_model(cfg, tmp_path / "model", seed=0, gamma="random")
    return path, manifest, cfg


def test_external_weights_are_mapped_one_layer_at_a_time(tmp_path):
    """The benchmark generator's model (state-dict weight names, external data): each layer piece maps its own
    layer's weights and nothing else; the lm_head and the final norm are the epilogue's."""
    path, manifest, cfg = _scale_model(tmp_path)
    model = load(path).proto
    # the generator's names: the embedding, then each layer's residual stream (benchmarks/compile_scale.py)
    boundaries = [("prologue", ["embedding"])] + [(f"layer {k}", [f"l{k}_residual_mlp"]) for k in range(cfg.layers)]
    pieces = piecewise.cut(model, boundaries + [("epilogue", [])])
    assert [p.name for p in pieces] == ["prologue"] + [f"layer {k}" for k in range(cfg.layers)] + ["epilogue"]
    whole, got, _, rows = _whole_and_pieces(model, pieces)
    for w, g in zip(whole, got):
        assert np.array_equal(w["logits"], g["logits"])
    size = {n: ref.length for n, ref in weights.external_refs(model).items()}  # (load keeps tiny ones in memory)
    assert set(size) <= {w["name"] for w in manifest}
    layer = sum(v for k, v in size.items() if k.startswith("model.layers.0."))
    assert [r["weight_bytes"] for r in rows[1:-1]] == [layer] * cfg.layers
    assert rows[0]["weight_bytes"] == size["model.embed_tokens.weight"]
    assert rows[-1]["weight_bytes"] == size["lm_head.weight"]


def test_values_read_across_layers_and_subgraphs():
    """A hand-built graph: a prologue value (a mask) read by both layers, and a layer whose If branch reads
    an outer value: every piece gets what it reads, and the outputs equal the whole model's."""
    rng = np.random.default_rng(0)
    w = {f"layers.{k}.proj.weight": rng.standard_normal((32, 32)).astype(np.float32) * 0.2
         for k in range(2)}  # (>= WEIGHT_ELEMENTS)
    out_then = helper.make_graph([helper.make_node("Mul", ["h0", "mask"], ["then_y"])], "then", [],
                                 [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, None)])
    out_else = helper.make_graph([helper.make_node("Identity", ["h0"], ["else_y"])], "else", [],
                                 [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["mask"], name="prologue_mask"),
        helper.make_node("MatMul", ["x", "layers.0.proj.weight"], ["h0"], name="l0_proj"),
        helper.make_node("ReduceSum", ["h0"], ["s0"], name="l0_sum", keepdims=0),
        helper.make_node("Greater", ["s0", "zero"], ["c0"], name="l0_cond"),
        helper.make_node("If", ["c0"], ["h0b"], name="l0_if", then_branch=out_then, else_branch=out_else),
        helper.make_node("MatMul", ["h0b", "layers.1.proj.weight"], ["h1"], name="l1_proj"),
        helper.make_node("Mul", ["h1", "mask"], ["y"], name="l1_mask"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
        [numpy_helper.from_array(v, k) for k, v in w.items()]
        + [numpy_helper.from_array(np.array(0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    pieces = piecewise.cut(model, [("prologue", ["mask"]), ("layers[0]", ["h0b"]), ("layers[1]", ["y"])])
    assert [p.name for p in pieces] == ["prologue", "layers[0]", "layers[1]"]
    assert [n.name for n in pieces[1].nodes] == ["l0_proj", "l0_sum", "l0_cond", "l0_if"]
    assert "mask" in pieces[1].reads  # (through the If's then-branch)
    whole, got, _, _ = _whole_and_pieces(model, pieces)
    for a, b in zip(whole, got):
        assert np.array_equal(a["y"], b["y"])


def test_bf16_weights_read_through_a_cast_run_piece_by_piece(tmp_path):
    """A checkpoint exported with --dtype bf16: weights stored bf16, each read by a Cast to fp32. The pieces
    take them as onnxruntime's bfloat16 (numpy has no such dtype) and equal the whole model's run."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    w = {f"layers.{k}.proj.weight": (rng.standard_normal((256, 256)) * 0.06).astype(ml_dtypes.bfloat16)
         for k in range(2)}
    inits = []
    for k, v in w.items():
        t = helper.make_tensor(k, TensorProto.BFLOAT16, v.shape, v.view(np.uint16).tobytes(), raw=True)
        inits.append(t)
    nodes = [helper.make_node("Cast", ["layers.0.proj.weight"], ["w0"], to=TensorProto.FLOAT, name="l0_cast"),
             helper.make_node("MatMul", ["x", "w0"], ["h0"], name="l0_proj"),
             helper.make_node("Cast", ["layers.1.proj.weight"], ["w1"], to=TensorProto.FLOAT, name="l1_cast"),
             helper.make_node("MatMul", ["h0", "w1"], ["y"], name="l1_proj")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 256])], inits)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path),
              save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    model = load(path).proto
    assert set(weights.external_refs(model)) == set(w)  # fed to the pieces from the file, as at real size
    pieces = piecewise.cut(model, [("layers[0]", ["h0"]), ("layers[1]", ["y"])])
    whole, got, _, rows = _whole_and_pieces(model, pieces)
    assert [r["piece"] for r in rows] == ["layers[0]", "layers[1]"]
    x = reference.make_cases(model)[0].inputs["x"]
    exact = x @ w["layers.0.proj.weight"].astype(np.float32) @ w["layers.1.proj.weight"].astype(np.float32)
    np.testing.assert_allclose(got[0]["y"], exact, rtol=1e-5, atol=1e-5)
    for a, b in zip(whole, got):  # (the whole model's MatMuls may sum in another order)
        np.testing.assert_allclose(a["y"], b["y"], rtol=1e-5, atol=1e-5)


def test_a_model_not_cut_by_the_boundaries_runs_whole():
    """Boundaries the model does not hold by name (values only the lowering made) join their piece to the
    next; with fewer than two pieces left the model runs whole."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph)
    assert piecewise.cut(model, [("prologue", ["not in the model"]), ("epilogue", [])]) is None
    assert [p.name for p in piecewise.cut(model, [("prologue", ["r"]), ("epilogue", [])])] == ["prologue", "epilogue"]


def test_layer_streamed_compile_uses_the_layer_by_layer_oracle(tmp_path):
    """In layer-streamed mode the compile's oracle is this one (run after lowering, keeping the block
    boundaries' values), and the result is the whole-network oracle's."""
    path, _, _ = _scale_model(tmp_path, layers_=2)
    streamed = graphconv.compile(path, tmp_path / "s.mindir", target="cpu", layer_streamed=True)
    whole = graphconv.compile(path, tmp_path / "w.mindir", target="cpu", layer_streamed=False)
    assert streamed.validation["oracle"] == "onnxruntime (layer by layer)"
    assert whole.validation["oracle"] == "onnxruntime"
    oracle = next(s for s in streamed.stages if s.name == "oracle")
    assert oracle.detail["pieces"] == 4 and oracle.detail["kept_values"] > 0
    assert ([o["max_abs"] for c in streamed.validation["cases"] for o in c["outputs"]]
            == [o["max_abs"] for c in whole.validation["cases"] for o in c["outputs"]])
    assert any("onnxsim's output is not run on its own" in w for w in streamed.warnings)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_compile_cuts_the_oracle_at_every_layer(tmp_path, precision):
    """At --precision bf16/fp16 the network checked on CPU rounds each result (precision.emulate_in_fp32); its
    blocks still pass on values of the model as given, so the oracle runs one layer at a time (never the whole
    model, whose weights would all be mapped at once) and every layer's value is compared."""
    path, _, _ = _scale_model(tmp_path, layers_=2)
    report = graphconv.compile(path, tmp_path / "s.mindir", target="ascend", layer_streamed=True,
                               precision=precision)
    assert report.validation["oracle"] == "onnxruntime (layer by layer)"
    assert _stage(report, "oracle").detail["pieces"] == 4  # prologue, 2 layers, epilogue
    blocks = report.validation["layer_streamed"]["blocks"]
    assert [len(b["values"]) for b in blocks[:-1]] == [1, 1, 1]  # the embedding, then each layer's residual
    assert all(b["max_abs"] > 0 for b in blocks[1:-1])  # (rounded to bf16/fp16: not onnxruntime's fp32 values)
    assert not any("runs the model whole" in w for w in report.warnings)


def test_run_together_interleaves_and_gives_each_models_numbers():
    """run_together runs two models of the same layers piece by piece, the second's pieces beside the
    first's of the same name (the tiny Llama and a variant whose layer-1 output is scaled, so the numbers
    differ): each gets exactly what it gets alone."""
    model = load(TINY).proto
    boundaries = _block_boundaries(model)
    variant = type(model)()
    variant.CopyFrom(model)
    out = variant.graph.output[0].name
    producer = next(n for n in variant.graph.node if out in n.output)
    producer.output[list(producer.output).index(out)] = out + "_unscaled"
    variant.graph.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    variant.graph.node.append(helper.make_node("Mul", [out + "_unscaled", "two"], [out]))
    cases = reference.make_cases(model)
    pieces, variant_pieces = piecewise.cut(model, boundaries), piecewise.cut(variant, boundaries)
    alone = [piecewise.run(m, p, cases)[0] for m, p in ((model, pieces), (variant, variant_pieces))]
    together = piecewise.run_together([(model, pieces, set()), (variant, variant_pieces, set())], cases)
    for a, (t, _, rows) in zip(alone, together):
        assert [r["piece"] for r in rows] == ["prologue", "layers[0]", "layers[1]", "epilogue"]
        for x, y in zip(a, t):
            assert np.array_equal(x[out], y[out])
    assert np.allclose(together[1][0][0][out], 2 * together[0][0][0][out])


def test_layer_streamed_ascend_compile_runs_the_precision_variant_with_the_oracle(tmp_path, monkeypatch):
    """On ascend the fp16-FlashAttention variant runs in the oracle's pass (its pieces beside the model's),
    and measures what the whole-network compile's separate run measures. Its merged gate/up weights (the
    tiny ones made to qualify: weights.SPILL_MIN_BYTES) are made from their parts as its pieces run."""
    from graphconv.frontend import weights

    monkeypatch.setattr(weights, "SPILL_MIN_BYTES", 4096)
    path, _, _ = _scale_model(tmp_path, layers_=2)
    streamed = graphconv.compile(path, tmp_path / "s.mindir", target="ascend", layer_streamed=True)
    whole = graphconv.compile(path, tmp_path / "w.mindir", target="ascend", layer_streamed=False)
    oracle = next(s for s in streamed.stages if s.name == "oracle")
    assert oracle.detail["ascend_precision_variant_pieces"] == 4  # prologue, 2 layers, epilogue
    assert oracle.detail["variant_weights_made_from_parts"] == 2  # one merged gate/up per layer
    check = next(s for s in streamed.stages if s.name == "ascend-precision")
    assert check.detail == {"run": "with the oracle"}
    got = streamed.validation["ascend_precision"]
    ref = whole.validation["ascend_precision"]
    assert got["status"] == ref["status"] and len(got["outputs"]) == len(ref["outputs"]) == 2
    for a, b in zip(got["outputs"], ref["outputs"]):
        assert a["max_abs"] == b["max_abs"] and a["max_abs"] > 0


def _stage(report, name):
    return next(s for s in report.stages if s.name == name)


def _numbers(report):
    return ([o["max_abs"] for c in report.validation["cases"] for o in c["outputs"]],
            [b.get("max_abs") for b in report.validation["layer_streamed"]["blocks"]])


def test_oracle_runs_beside_the_child_with_the_numbers_of_one_after_the_other(tmp_path, monkeypatch):
    """In layer-streamed mode the oracle runs while the MindSpore child exports and runs the blocks
    (scheduling.both; the two are independent until the blocks' values are compared): the same numbers as
    one after the other (GRAPHCONV_SCHEDULING=-oracle_beside_emit), the oracle's stage inside the child's.
    Beside the child, the oracle runs in a thread of its own at ORACLE_NICE lower priority (the child is the
    critical path); the compile's own thread keeps its priority."""
    path, _, _ = _scale_model(tmp_path, layers_=2)
    niceness = []  # (the thread the oracle ran in, its nice value)
    run_together = piecewise.run_together

    def recording(*args, **kwargs):
        niceness.append((threading.get_ident(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return run_together(*args, **kwargs)

    monkeypatch.setattr(piecewise, "run_together", recording)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    beside = graphconv.compile(path, tmp_path / "b.mindir", target="ascend", layer_streamed=True)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    monkeypatch.setenv(scheduling.ENV, "-oracle_beside_emit")
    after = graphconv.compile(path, tmp_path / "a.mindir", target="ascend", layer_streamed=True)
    assert [n for _, n in niceness] == [min(19, own + scheduling.ORACLE_NICE), own]
    assert niceness[0][0] != threading.get_ident() and niceness[1][0] == threading.get_ident()
    assert beside.scheduling["oracle"] == f"beside the emit, at nice +{scheduling.ORACLE_NICE}"
    assert after.scheduling["oracle"] == "before the emit"
    assert beside.status == after.status == "verified"
    emit, oracle = _stage(beside, "emit"), _stage(beside, "oracle")
    assert emit.started <= oracle.started < emit.started + emit.seconds  # the oracle ran while the child did
    assert _stage(after, "oracle").started + _stage(after, "oracle").seconds <= _stage(after, "emit").started + 0.01
    cases, blocks = _numbers(beside)
    assert (cases, blocks) == _numbers(after) and len(blocks) == 4  # prologue, 2 layers, epilogue
    assert sum(b is not None for b in blocks) >= 3  # boundaries compared (the epilogue's: the final outputs)
    assert beside.validation["ascend_precision"]["outputs"] == after.validation["ascend_precision"]["outputs"]


def _workers() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "graphconv.runtime.worker" in " ".join(p.cmdline())}


def test_a_failing_oracle_kills_the_child_and_leaves_no_output(tmp_path, monkeypatch):
    """The oracle fails while the child exports or runs blocks: the child is killed and reaped before the
    compile returns, and nothing is left in the output folder."""
    path, _, _ = _scale_model(tmp_path, layers_=2)
    seen = threading.Event()
    before = _workers()  # (another test's long-lived server child may run beside: only new ones count)
    out = tmp_path / "out"
    out.mkdir()

    def broken_oracle(*args, **kwargs):
        deadline = time.time() + 60
        while time.time() < deadline:  # the child has its task (export, then the blocks)
            if _workers() - before and list(out.glob(".graphconv-tmp-*/task-*-export_and_verify.json")):
                seen.set()
                break
            time.sleep(0.05)
        time.sleep(0.5)
        raise RuntimeError("the oracle broke")

    monkeypatch.setattr(piecewise, "run_together", broken_oracle)
    with pytest.raises(RuntimeError, match="the oracle broke"):
        graphconv.compile(path, out / "m.mindir", target="ascend", layer_streamed=True)
    assert seen.is_set()
    assert _workers() - before == set()  # killed (and reaped) before the compile returned
    assert list(out.iterdir()) == []  # no MindIR, no variables, no private folder
