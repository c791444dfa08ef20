"""The real-architecture zoo (models/architectures.py): every factory builds tiny transformers models with the
default attention implementation, runs in PyTorch at the example shape and at a second shape, and the registry's
expected census is self-consistent. No export here except in the slow test."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import ZOO, load_factory  # noqa: E402
from models.architectures import (  # noqa: E402
    ARCHITECTURES,
    CI_SLICE,
    FUSED_PRIMITIVES,
    GROUPS,
    names,
)
from zoo_inputs import VOCAB, second_inputs  # noqa: E402

NAMES = list(ARCHITECTURES)
HIDDEN = 64
# Classes without sdpa support in transformers 5.24 (their default is eager): Gemma-2 (soft-capping) and Bloom
# (ALiBi, own attention code).
EAGER_ONLY = {"gemma2", "bloom"}
# The named architectures the zoo was asked to cover.
REQUIRED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "gpt2", "gptj",
            "gpt_neox", "stablelm", "starcoder2", "olmo2", "cohere", "granite", "smollm3", "glm4", "opt", "bloom",
            "bert", "roberta", "distilbert", "modernbert", "clip_text", "vit", "whisper_encoder", "mixtral",
            "qwen2_moe"}


def build(name: str, **overrides):
    return load_factory(ARCHITECTURES[name].factory)(**overrides)


def inner(module):
    return getattr(module, "model", None) or module.encoder


def expected_shape(name: str, inputs: dict) -> tuple:
    arch = ARCHITECTURES[name]
    if name == "vit":
        return (inputs["pixel_values"].shape[0], 17, HIDDEN)  # (32 / 8)^2 patches + CLS
    if name == "whisper_encoder":
        return (inputs["input_features"].shape[0], 8, HIDDEN)  # 16 frames, conv2 stride 2
    if arch.kind == "encoder":
        return (*inputs["input_ids"].shape, HIDDEN)
    return (*inputs["input_ids"].shape, VOCAB)  # decoders and MoE: logits


# --- registry ---------------------------------------------------------------------------------------------------


def test_registry_covers_the_architectures():
    assert REQUIRED <= set(NAMES)
    assert set(CI_SLICE) <= set(NAMES)
    assert names("ci") == CI_SLICE and names() == NAMES
    assert set(names("decoder")) | set(names("encoder")) | set(names("moe")) == set(NAMES)
    assert names("moe") == ["mixtral", "qwen2_moe", "qwen3_moe"]
    with pytest.raises(ValueError):
        names("no-such-group")
    # kept out of models.ZOO (the opset matrix); names like "llama" exist there too but mean the plain-torch
    # models, so architectures are loaded by their factory spec
    assert not any(spec.startswith("models.architectures:") for spec in ZOO.values())
    assert set(GROUPS["mixed-layers"]) == {"gemma3", "smollm3", "modernbert"}


@pytest.mark.parametrize("name", NAMES)
def test_registry_entry_is_consistent(name):
    arch = ARCHITECTURES[name]
    assert arch.name == name and arch.factory == f"models.architectures:build_{name}"
    assert arch.kind in ("decoder", "encoder", "moe")
    assert set(arch.census) <= set(FUSED_PRIMITIVES), arch.census
    assert all(v >= 0 for v in arch.census.values())
    assert arch.why and arch.facts
    # census totals = sum over layer kinds, for every primitive the kinds mention
    assert arch.layer_kinds
    for kind, counts in arch.layer_kinds.items():
        assert set(counts) <= set(FUSED_PRIMITIVES) | {"attention"}, (kind, counts)
        assert counts.get("FlashAttentionScore", 0) <= counts.get("attention", 0), (kind, counts)
    mentioned = {k for counts in arch.layer_kinds.values() for k in counts if k != "attention"}
    for prim in mentioned:
        assert sum(c.get(prim, 0) for c in arch.layer_kinds.values()) == arch.census.get(prim, 0), prim
    # every attention computation is either fused or refused
    candidates = sum(c["attention"] for c in arch.layer_kinds.values())
    assert arch.census.get("FlashAttentionScore", 0) + sum(
        n for why, n in arch.refused.items() if why.startswith("attention")) == candidates
    if arch.kind == "moe":  # routing lowers (TopK) and each layer's router fuses; the MoE share is in the census
        assert not arch.unsupported
        assert arch.census["MoeGatingTopKSoftmax"] == arch.moe_census["MoeGatingTopKSoftmax"] == 2
        assert all(arch.census.get(p, 0) >= n for p, n in arch.moe_census.items()), arch.moe_census
    assert arch.dynamic == (("batch",) if name in ("vit", "whisper_encoder") else ("batch", "seq"))


def test_softcapped_attention_is_refused():
    gemma2 = ARCHITECTURES["gemma2"]
    assert gemma2.layer_kinds["softcapped"] == {"attention": 2, "FlashAttentionScore": 0,
                                                "RotaryPositionEmbedding": 4}
    assert gemma2.refused == {"attention: soft-capped scores": 2}
    assert gemma2.census["FlashAttentionScore"] == 0


# --- factories ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_factory_builds_and_runs_at_two_shapes(name):
    module, inputs, axes = build(name)
    assert not module.training
    assert set(axes) <= set(inputs)
    arch = ARCHITECTURES[name]
    assert sorted({d for a in axes.values() for d in a.values()}) == sorted(arch.dynamic)
    for key, a in axes.items():
        for ax in a:
            assert inputs[key].shape[ax] >= 2  # dynamo would specialise a size-1 dim
    if "input_ids" in inputs:
        assert inputs["input_ids"].shape[0] != inputs["input_ids"].shape[1]
        assert inputs["attention_mask"].dtype == torch.int64 and inputs["attention_mask"][0, 0] == 0
        assert int(inputs["input_ids"].max()) < VOCAB
    for feed in (inputs, second_inputs(inputs, axes)):
        with torch.no_grad():
            out = module(**feed)
        assert isinstance(out, torch.Tensor)
        assert tuple(out.shape) == expected_shape(name, feed)
        assert torch.isfinite(out).all()
        assert out.std() > 1e-2  # outputs of a useful size (a wrong scale or mask must show)


@pytest.mark.parametrize("name", NAMES)
def test_default_attention_is_sdpa(name):
    module, _, _ = build(name)
    model = inner(module)
    impl = model.config._attn_implementation
    if name in EAGER_ONLY:
        assert not type(model)._supports_sdpa and impl == "eager"
    else:
        assert type(model)._supports_sdpa and impl == "sdpa"


@pytest.mark.parametrize("name", ["llama", "gemma3", "bert", "vit", "whisper_encoder"])
def test_eager_variant_matches_sdpa(name):
    sdpa, inputs, _ = build(name)
    eager, _, _ = build(name, attn_implementation="eager")
    assert inner(eager).config._attn_implementation == "eager"
    with torch.no_grad():
        a, b = sdpa(**inputs), eager(**inputs)
    if "attention_mask" in inputs:  # left-padded positions are undefined
        keep = inputs["attention_mask"].bool()
        a, b = a[keep], b[keep]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_config_overrides_and_seed():
    module, inputs, _ = build("qwen3", num_hidden_layers=3, seed=1)
    assert len(module.model.model.layers) == 3
    other, _, _ = build("qwen3", seed=2)
    w1 = module.model.model.embed_tokens.weight
    assert not torch.equal(w1, other.model.model.embed_tokens.weight)


def test_layer_kinds_are_in_the_configs():
    """The layer kinds the census counts are what the tiny configs really build."""
    cfg = lambda name: inner(build(name)[0]).config  # noqa: E731
    assert cfg("gemma2").layer_types == ["sliding_attention", "full_attention"]
    assert cfg("gemma2").attn_logit_softcapping == 50.0
    assert cfg("gemma3").layer_types == ["sliding_attention", "full_attention"]
    assert cfg("gemma3").sliding_window == 4
    assert cfg("mistral").sliding_window == 4
    assert cfg("smollm3").no_rope_layers == [1, 0]
    assert cfg("modernbert").layer_types == ["full_attention", "sliding_attention"]
    assert cfg("mixtral")._experts_implementation == "batched_mm"
    assert cfg("qwen2_moe")._experts_implementation == "batched_mm"
    assert cfg("qwen3_moe")._experts_implementation == "batched_mm" and cfg("qwen3_moe").norm_topk_prob


# --- export (slow) ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", CI_SLICE)
def test_ci_slice_exports_at_opset_18(name, tmp_path):
    from graphconv.frontend.export import zoo_export

    result = zoo_export(load_factory(ARCHITECTURES[name].factory), tmp_path / f"{name}.onnx", opset=18,
                        exporter="dynamo")
    assert result.opset == 18 and all(c["ok"] for c in result.checks)
