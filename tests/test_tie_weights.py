"""tie-weights: a weight stored twice (as is, or transposed) becomes one initializer; exports keep ties."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.verify import census
from tests.fusion_utils import assert_same_numerics, fuse

VOCAB, HIDDEN = 128, 64


def _tied_lm(duplicate_too: bool = True) -> onnx.ModelProto:
    """ids -> Gather(wte) -> MatMul(lm_head = wte^T, stored pre-transposed) [+ a second, exact copy of a
    projection weight] -> logits; plus a near-copy (one element differs) that must stay separate."""
    rng = np.random.default_rng(0)
    wte = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    proj = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    near = proj.copy()
    near[3, 5] += 1e-3
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["h0"]),
             helper.make_node("MatMul", ["h0", "proj"], ["h1"]),
             helper.make_node("MatMul", ["h1", "proj_copy" if duplicate_too else "proj"], ["h2"]),
             helper.make_node("MatMul", ["h2", "near"], ["h3"]),
             helper.make_node("MatMul", ["h3", "val_12"], ["logits"])]
    inits = [numpy_helper.from_array(wte, "transformer.wte.weight"), numpy_helper.from_array(proj, "proj"),
             numpy_helper.from_array(near, "near"), numpy_helper.from_array(np.ascontiguousarray(wte.T), "val_12")]
    if duplicate_too:
        inits.append(numpy_helper.from_array(proj.copy(), "proj_copy"))
    nodes[0].input[0] = "transformer.wte.weight"
    g = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_duplicates_and_transposed_copies_are_tied():
    model = _tied_lm()
    count, tied = fuse(model, "tie-weights")
    assert count == 2  # val_12 (transposed embedding) and proj_copy
    names = {t.name for t in tied.graph.initializer}
    assert names == {"transformer.wte.weight", "proj", "near"}  # state_dict names kept, the near-copy too
    transpose = [n for n in tied.graph.node if n.op_type == "Transpose"]
    assert len(transpose) == 1 and list(transpose[0].input) == ["transformer.wte.weight"]
    assert_same_numerics(model, tied, atol=0, rtol=0)


def test_nothing_to_tie_fires_zero_times():
    count, tied = fuse(_tied_lm(duplicate_too=False), "tie-weights")
    assert count == 1
    count, _ = fuse(tied, "tie-weights")
    assert count == 0


@pytest.mark.parametrize("exporter,opset", [("dynamo", 18), ("torchscript", 17)])
def test_gpt2_export_keeps_the_embedding_tied(exporter, opset, export_cache, tmp_path):
    """Both exporters write GPT-2's tied lm_head as a second, transposed copy of the embedding; the export
    re-ties it, and the compiled MindIR holds the embedding once."""
    path = export_cache("gpt2", opset, exporter)
    model = onnx.load(str(path))
    _assert_no_weight_twice([numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 2])
    # compile: the MindIR's parameters hold the embedding once
    report = graphconv.compile(path, tmp_path / "g.mindir", target="cpu")
    assert report.status == "verified"
    weights = [np.frombuffer(p.raw_data, np.float32).reshape(list(p.dims))
               for p in census.read_mindir(tmp_path / "g.mindir").graph.parameter
               if len(p.dims) == 2 and len(p.raw_data) == 4 * int(np.prod(list(p.dims)))]
    assert len(weights) >= 8  # the weights were read back (embeddings, attention and MLP matrices)
    _assert_no_weight_twice(weights)


def _assert_no_weight_twice(arrays):
    for i, a in enumerate(arrays):
        for b in arrays[i + 1:]:
            assert not (a.shape == b.shape and np.array_equal(a, b))
            assert not (a.shape == b.T.shape and np.array_equal(a, b.T))


def test_export_notes_the_tie(tmp_path):
    from graphconv.frontend.export import zoo_export
    from models import load_factory

    result = zoo_export(load_factory("gpt2"), tmp_path / "g.onnx", opset=18, exporter="dynamo")
    assert any("tied parameters" in w and "1 duplicate" in w for w in result.warnings), result.warnings
    ir_model = ir.load(tmp_path / "g.onnx")
    inits = ir_model.graph.initializers
    assert "lm_head.weight" not in inits or "transformer.wte.weight" not in inits


def test_external_weights_are_tied_as_in_memory_without_asking_ahead(tmp_path, monkeypatch):
    """With the weights in a file, the pass fingerprints every 2-D weight that has a partner of its shape and
    finds the ties of the in-memory model; it asks the kernel for no pages itself (a pass reads what it
    compares; reading ahead is the compile's schedule: graphconv/runtime/scheduling.py)."""
    import os

    from passes import tie_weights

    path = tmp_path / "lm.onnx"
    onnx.save(_tied_lm(), str(path), save_as_external_data=True, location="lm.onnx.data", size_threshold=0)
    model = ir.load(str(path))
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: asked.append(args))
    sampled = []
    fingerprint = tie_weights._fingerprint
    monkeypatch.setattr(tie_weights, "_fingerprint", lambda arr: sampled.append(arr.shape) or fingerprint(arr))
    assert tie_weights.tie_weights(model) == 2
    # every 2-D weight has a partner of its shape here (wte and val_12; proj, proj_copy and near): all are sampled
    assert len(sampled) == 5
    assert asked == []
    in_memory = ir.from_proto(_tied_lm())
    assert tie_weights.tie_weights(in_memory) == 2
    assert set(model.graph.initializers) == set(in_memory.graph.initializers) == {"transformer.wte.weight", "proj",
                                                                                   "near"}
