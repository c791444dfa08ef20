"""Tests for the reference model zoo (models/): the factory contract, each model's semantics against an
independent computation, and a dynamo ONNX export checked with onnxruntime at a second shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import PLAIN_TORCH, ZOO, load_factory
from zoo_inputs import VOCAB, second_inputs

HF = [name for name in ZOO if name.startswith("hf-")]
# Exports that take clearly longer than ~5 s each on the 2-core dev machine.
SLOW_EXPORTS = {"llama", "llama-sdpa", "hf-llama", "hf-gpt2", "hf-bert"}


def output_shape(name: str, inputs: dict) -> tuple:
    if name in ("mlp", "cnn"):
        return (next(iter(inputs.values())).shape[0], 10)
    if name in ("bert", "hf-bert"):
        return (*inputs["input_ids"].shape, 64)
    return (*inputs["input_ids"].shape, VOCAB)  # decoders: logits


def build(name: str, **overrides):
    if name in HF:
        pytest.importorskip("transformers")
    return load_factory(name)(**overrides)


def run(module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return module(**inputs)


# --- registry ----------------------------------------------------------------------------------------------


def test_registry():
    assert set(PLAIN_TORCH) <= set(ZOO)
    assert set(ZOO) - set(PLAIN_TORCH) == set(HF) == {"hf-llama", "hf-gpt2", "hf-bert"}
    from models import mlp

    assert load_factory("models.mlp:build") is mlp.build
    assert load_factory("mlp") is mlp.build
    with pytest.raises(ValueError):
        load_factory("models.mlp")
    with pytest.raises(ValueError):
        load_factory("models.mlp:no_such_factory")


# --- contract: every factory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ZOO))
def test_factory_contract(name):
    module, inputs, axes = build(name)
    assert not module.training
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert set(axes) <= set(inputs)
    for input_name, input_axes in axes.items():
        sizes = {dim: inputs[input_name].shape[axis] for axis, dim in input_axes.items()}
        assert all(size >= 2 for size in sizes.values()), sizes
    if "input_ids" in inputs:
        batch, seq = inputs["input_ids"].shape
        assert batch >= 2 and seq >= 3 and batch != seq
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"]
        assert mask.dtype == torch.int64
        assert mask[0, :2].eq(0).all() and mask[0, 2:].eq(1).all() and mask[1:].eq(1).all()

    out = run(module, inputs)
    assert isinstance(out, torch.Tensor)
    assert out.shape == output_shape(name, inputs)
    assert torch.isfinite(out).all()

    # Seeded: a second build gives the same weights, inputs and outputs.
    module2, inputs2, axes2 = build(name)
    assert axes2 == axes
    assert all(torch.equal(inputs[k], inputs2[k]) for k in inputs)
    assert torch.equal(run(module2, inputs2), out)

    # Works at another batch/seq/spatial size.
    other = second_inputs(inputs, axes)
    out2 = run(module, other)
    assert out2.shape == output_shape(name, other) != out.shape
    assert torch.isfinite(out2).all()


# --- semantics, each against an independent computation --------------------------------------------------


def test_mlp_matches_manual_formula():
    module, inputs, _ = build("mlp")
    x = inputs["x"]
    for i, layer in enumerate(module.layers):
        x = x @ layer.weight.T + layer.bias
        x = x.clamp_min(0) if i < len(module.layers) - 1 else x
    torch.testing.assert_close(run(module, inputs), x)


def test_cnn_matches_functional_recomputation():
    module, inputs, _ = build("cnn")
    conv1, bn1, _, conv2, bn2, _ = module.features
    x = inputs["image"]
    for conv, bn in ((conv1, bn1), (conv2, bn2)):
        x = F.conv2d(x, conv.weight, stride=conv.stride, padding=conv.padding)
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        x = torch.relu((x - bn.running_mean[:, None, None]) * scale[:, None, None] + bn.bias[:, None, None])
    x = x.sum(dim=(2, 3)) / (x.shape[2] * x.shape[3])
    expected = x @ module.classifier.weight.T + module.classifier.bias
    torch.testing.assert_close(run(module, inputs), expected)


def test_llama_rmsnorm_matches_formula():
    module, _, _ = build("llama")
    norm = module.model.norm
    x = torch.randn(3, 5, 64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 64 + norm.eps) * norm.weight
    torch.testing.assert_close(run(norm, {"x": x}), expected)


def test_llama_rope_is_a_rotation_of_half_pairs():
    """rotate_half RoPE rotates the pair (x[i], x[i + d/2]) by angle pos * theta^(-2i/d): check it as complex
    multiplication by exp(i * angle)."""
    from models.llama import RotaryEmbedding, apply_rotary

    d, seq = 16, 6
    x = torch.randn(2, 3, seq, d)
    cos, sin = RotaryEmbedding(d, 10000.0)(seq)
    angle = torch.arange(seq)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(apply_rotary(x, cos, sin), torch.cat((z.real, z.imag), dim=-1))


def test_llama_gqa_repeat_kv():
    from models.llama import repeat_kv

    kv = torch.randn(2, 2, 5, 16)
    torch.testing.assert_close(repeat_kv(kv, 2), kv.repeat_interleave(2, dim=1))


def test_llama_sdpa_matches_explicit_attention():
    module, inputs, _ = build("llama")
    sdpa, _, _ = build("llama", sdpa=True)
    torch.testing.assert_close(run(sdpa, inputs), run(module, inputs))


def test_llama_num_layers_override():
    module, inputs, _ = build("llama", num_layers=3)
    assert len(module.model.layers) == 3
    assert run(module, inputs).shape == (2, 7, VOCAB)


@pytest.mark.parametrize("name", ["llama", "llama-sdpa", "gpt2", "hf-llama", "hf-gpt2"])
def test_causal_future_token_does_not_change_earlier_logits(name):
    module, inputs, _ = build(name)
    changed = inputs["input_ids"].clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    before, after = run(module, inputs), run(module, {**inputs, "input_ids": changed})
    # Left-padded positions attend to nothing (a fully masked row): their outputs are undefined, skip them.
    valid = inputs.get("attention_mask", torch.ones_like(changed)).bool()
    valid[:, -1] = False
    torch.testing.assert_close(after[valid], before[valid], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, -1], before[:, -1])


@pytest.mark.parametrize("name", ["llama", "llama-sdpa", "bert", "hf-llama", "hf-gpt2", "hf-bert"])
def test_padded_tokens_do_not_change_valid_outputs(name):
    module, inputs, _ = build(name)
    mask = inputs["attention_mask"]
    changed = inputs["input_ids"].clone()
    changed[mask == 0] = (changed[mask == 0] + 1) % VOCAB
    valid = mask.bool()
    before, after = run(module, inputs), run(module, {**inputs, "input_ids": changed})
    torch.testing.assert_close(after[valid], before[valid], rtol=0, atol=1e-6)
    # Without the mask the same change is visible: the mask, not the model, hides the padded tokens.
    unmasked = torch.ones_like(mask)
    before = run(module, {**inputs, "attention_mask": unmasked})
    after = run(module, {"input_ids": changed, "attention_mask": unmasked})
    assert not torch.allclose(after[valid], before[valid])


# --- plain models against their transformers twins -----------------------------------------------------------

BERT_NAMES = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "ffn_in": "intermediate.dense",
    "ffn_out": "output.dense",
    "ffn_norm": "output.LayerNorm",
}


def gpt2_to_hf(state: dict) -> dict:
    """transformers' GPT-2 stores its projections as Conv1D, whose weight is the transposed Linear weight."""
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    return {k: v.T if k.endswith(conv1d) else v for k, v in state.items()}


def bert_to_hf(state: dict) -> dict:
    renamed = {}
    for key, value in state.items():
        if key.startswith("layers."):
            _, index, module, param = key.split(".")
            key = f"encoder.layer.{index}.{BERT_NAMES[module]}.{param}"
        renamed[key.replace("embeddings.norm.", "embeddings.LayerNorm.")] = value
    return renamed


@pytest.mark.parametrize(
    ("name", "convert"), [("llama", dict), ("gpt2", gpt2_to_hf), ("bert", bert_to_hf)]
)
def test_plain_model_matches_transformers(name, convert):
    module, inputs, _ = build(name)
    twin, _, _ = build(f"hf-{name}")
    twin.model.load_state_dict(convert(module.state_dict()), strict=True)
    hf_inputs = {"attention_mask": torch.ones_like(inputs["input_ids"]), **inputs}
    expected, got = run(twin, hf_inputs), run(module, inputs)
    valid = hf_inputs["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-4, atol=1e-4)


# --- ONNX export ---------------------------------------------------------------------------------------------


def dynamic_shapes(example: dict, dynamic_axes: dict) -> dict:
    """dynamic_axes -> torch.export dynamic_shapes; one named Dim per dim name, shared across inputs."""
    dims: dict[str, torch.export.Dim] = {}
    return {
        name: {axis: dims.setdefault(dim, torch.export.Dim(dim)) for axis, dim in dynamic_axes.get(name, {}).items()}
        for name in example
    }


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:# The axis name.*will not be used:UserWarning")
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXPORTS else n for n in ZOO]
)
def test_onnx_export_matches_torch(name, tmp_path):
    import onnx
    import onnxruntime as ort

    module, example, axes = build(name)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(
        module,
        (),
        str(path),
        kwargs=example,
        dynamo=True,
        opset_version=18,
        dynamic_shapes=dynamic_shapes(example, axes),
        verbose=False,
    )

    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == list(example)
    for graph_input in graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        for axis, dim in axes.get(graph_input.name, {}).items():
            assert dims[axis].dim_param == dim

    inputs = second_inputs(example, axes)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    expected = run(module, inputs).numpy()
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4
