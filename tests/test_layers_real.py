"""Repeated layers on real exports: a transformers Llama (default settings) through dynamo and TorchScript
becomes one decoder-layer Cell class instantiated once per layer, verified against onnxruntime, with the
MindIR census still counting every layer's primitives (a lazy_inline layer graph called N times counts N
times). The layer count comes from the model's config, the census from the architecture."""

from __future__ import annotations

import json
import re

import pytest

import graphconv
from graphconv.verify import census


def _layer_count() -> int:
    from models import load_factory

    module, _, _ = load_factory("hf/llama")()
    return module.model.config.num_hidden_layers if hasattr(module, "model") else module.config.num_hidden_layers


@pytest.mark.parametrize("exporter", ["dynamo", pytest.param("torchscript", marks=pytest.mark.slow)])
@pytest.mark.parametrize("target", ["cpu", "ascend"])
def test_transformers_llama_layers_are_one_class(exporter, target, export_cache, tmp_path):
    pytest.importorskip("transformers")
    from models.architectures import ARCHITECTURES

    n_layers = _layer_count()
    path = export_cache("hf/llama", 18, exporter)
    src = tmp_path / "src"
    report = graphconv.compile(path, tmp_path / "m.mindir", target=target, emit_source=src,
                               report_path=tmp_path / "r.json")
    assert report.status == "verified"
    rep = json.loads((tmp_path / "r.json").read_text())
    (lower,) = [s for s in rep["stages"] if s["name"] == "lower"]
    grouping = lower["detail"]["layers"]
    assert grouping["layers"] == n_layers and grouping["grouped"] == n_layers and grouping["classes"] == 1
    assert f"layers: {n_layers} of {n_layers} in 1 Cell class(es)" in report.summary()  # what compile prints
    source = (src / "network.py").read_text()
    classes = re.findall(r"^class (\w+)\(nn\.Cell\):", source, re.M)
    assert classes == ["LlamaDecoderLayer", "Network"] if exporter == "dynamo" else len(classes) == 2
    assert len(re.findall(r"^            \w+\(weights, \(", source, re.M)) == n_layers  # the CellList rows
    assert len(re.findall(r"= self\.layers\[\d+\]\(", source)) == n_layers
    if target == "ascend":  # call-weighted: each layer's fused primitives count
        expected = ARCHITECTURES["llama"].census
        got = census.primitive_census(tmp_path / "m.mindir")
        for primitive in ("FlashAttentionScore", "Swiglu", "RotaryPositionEmbedding"):
            assert got.get(primitive, 0) == expected[primitive], (primitive, got)
