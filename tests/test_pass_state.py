"""The passes keep nothing of a compile: once the model is dropped, nothing in a module (a rule's last
match, what a check hands to its rewrite, fuse-rope's dim proofs) still holds its graph, as the rule sets are
made for each application (passes.manager.rewrite_pass)."""

from __future__ import annotations

import gc
import weakref

import onnx
import onnx_ir as ir
import pytest

import passes
from test_fuse_attention import _attention_graph
from test_fuse_layernorm import _cohere_graph
from test_fuse_rope import _rope_graph
from test_fuse_swiglu import _mlp_graph

MODELS = {  # -> the pass that must fire, each keeping something between a check and its rewrite
    "attention, GQA by Expand": (lambda: _attention_graph(gqa="expand"), "fuse-attention"),
    "LayerNorm with its weight in an fp32 island": (_cohere_graph, "fuse-layernorm"),
    "interleaved RoPE with a proved repeat_interleave": (
        lambda: _rope_graph(form="interleaved", source="interleaved"), "fuse-rope"),
    "SwiGLU merging gate and up": (_mlp_graph, "fuse-swiglu"),
}


@pytest.mark.parametrize("name", MODELS)
def test_no_pass_keeps_the_graph_it_rewrote(name):
    build, fired = MODELS[name]
    model = ir.from_proto(onnx.shape_inference.infer_shapes(build(), data_prop=True))
    manager = passes.PassManager()
    assert manager.run(model)[fired] >= 1
    graph = weakref.ref(model.graph)
    del model, manager
    gc.collect()
    assert graph() is None
