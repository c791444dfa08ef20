"""A zoo of real transformers architectures: tiny models built from configs with random weights, exported the
way users export them (default settings, so attention is transformers' default "sdpa" wherever the class
supports it), each with the fused-operator census a perfect compiler produces for it.

Every factory is `build_<name>(*, seed=0, batch=2, seq=7, attn_implementation=None, **config)
-> (module, example_inputs, dynamic_axes)` (the models/ contract, see models/__init__.py). `attn_implementation`
None leaves transformers' default; "eager" (or any other name) is passed to the config. `config` overrides the
config arguments. Sizes: hidden 64, 2 layers (both kinds where an architecture alternates layer kinds),
4 heads, head_dim 16 (32 for the Gemma family, whose heads are wider than hidden/heads), 2 kv heads where the
architecture has GQA, vocab 128, 128 positions, special token ids inside the vocabulary. Weights are drawn with
std `models.hf.INITIALIZER_RANGE` (0.2); norm parameters (`randomize_norms`; Gemma's (1 + w) norms around 0,
so their effective gamma is 1 + N(0, 0.1) too) and linear/conv biases (here) are randomised, so a dropped gamma,
beta or bias changes the outputs. Decoders take input_ids and a left-padded
int64 attention_mask and return logits; text encoders return last_hidden_state; ViT takes pixel_values and
Whisper's encoder input_features (only batch dynamic).

The expected census is written down per architecture (`ARCHITECTURES`) from reading the modeling code of
transformers 5.24 (transformers/models/<arch>/modeling_<arch>.py), not from running graphconv. Counts are
call-weighted, per MindSpore fused primitive: FlashAttentionScore (one per attention computation that a perfect
compiler fuses), RmsNorm, LayerNorm, RotaryPositionEmbedding (one per rotated tensor: q and k), Swiglu,
GeLU (tanh approximation), GeluExt (exact erf GELU), FastGeLU (x * sigmoid(1.702 x)).

These names are deliberately not in models.ZOO (that would change what the opset matrix runs): load them with
`models.load_factory(ARCHITECTURES[name].factory)` (f"{__name__}:build_<name>").
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._common import BATCH, SEQ, left_padded_mask, randomize_norms, token_ids
from .hf import INITIALIZER_RANGE, _finish, _transformers

VOCAB = 128
HIDDEN = 64
POSITIONS = 128
SLIDING_WINDOW = 4  # < the example seq (7) and the second shapes (5, 8, 9 ...): the window really cuts
IMAGE, PATCH = 32, 8  # ViT: (32/8)^2 = 16 patches + CLS = 17 tokens
MEL_BINS, SOURCE_POSITIONS = 16, 8  # Whisper encoder input: [batch, 16, 2 * 8]


# --- wrappers and helpers -------------------------------------------------------------------------------------


class EncoderOutput(nn.Module):
    """Calls a transformers encoder on keyword inputs (no cache arguments) and returns one output tensor."""

    def __init__(self, model: nn.Module, output: str = "last_hidden_state"):
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)[self.output]


class PixelEncoderOutput(nn.Module):
    """ViT-style image encoder: pixel_values -> last_hidden_state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values, return_dict=True).last_hidden_state


class AudioEncoderOutput(nn.Module):
    """Whisper's encoder: input_features (log-mel, [batch, mel bins, 2 * max_source_positions]) ->
    last_hidden_state."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features=input_features, return_dict=True).last_hidden_state


@torch.no_grad()
def randomize_biases(module: nn.Module, std: float = 0.1) -> None:
    """Give every non-norm bias (Linear, Conv, GPT-2's Conv1D ...) random values: transformers initialises them to
    zero, which would hide a dropped or misplaced bias (Qwen2's qkv bias, OPT's, Bloom's ...)."""
    for m in module.modules():
        if "norm" in type(m).__name__.lower():
            continue  # randomize_norms does those
        bias = getattr(m, "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.normal_(0.0, std)


def _config(tf, cls: str, defaults: dict, overrides: dict, attn_implementation: str | None):
    kwargs = {**defaults, **overrides}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return getattr(tf, cls)(**kwargs)


@torch.no_grad()
def _center_offset_norms(module: nn.Module, std: float = 0.1) -> None:
    """Gemma's RMSNorms scale by (1 + weight): draw their weights around 0, so the effective gamma is 1 + N(0, 0.1)
    like every other model's (randomize_norms' N(1, 0.1) would double every Gemma norm)."""
    for m in module.modules():
        if type(m).__name__.startswith("Gemma") and type(m).__name__.endswith("RMSNorm"):
            m.weight.normal_(0.0, std)


def _causal_lm(config_cls: str, model_cls: str, defaults: dict, *, seed: int, batch: int, seq: int,
               attn_implementation: str | None, config: dict, experts: str | None = None):
    tf = _transformers()
    torch.manual_seed(seed)
    cfg = _config(tf, config_cls, defaults, config, attn_implementation)
    if experts is not None:
        # transformers' default experts implementation is the `grouped_mm` custom op, which torch.onnx cannot
        # translate; "batched_mm" is plain gather + bmm.
        cfg._experts_implementation = experts
    model = getattr(tf, model_cls)(cfg)
    randomize_biases(model)
    module, inputs, axes = _finish(model, "logits", cfg.vocab_size, batch, seq)
    _center_offset_norms(module)
    return module, inputs, axes


def _text_encoder(config_cls: str, model_cls: str, defaults: dict, *, seed: int, batch: int, seq: int,
                  attn_implementation: str | None, config: dict, model_kwargs: dict | None = None):
    tf = _transformers()
    torch.manual_seed(seed)
    cfg = _config(tf, config_cls, defaults, config, attn_implementation)
    model = getattr(tf, model_cls)(cfg, **(model_kwargs or {}))
    randomize_biases(model)
    randomize_norms(model)
    module = EncoderOutput(model).eval()
    inputs = {"input_ids": token_ids(batch, seq, cfg.vocab_size), "attention_mask": left_padded_mask(batch, seq)}
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return module, inputs, axes


def _causal_lm_factory(config_cls: str, model_cls: str, defaults: dict, doc: str, experts: str | None = None):
    """A `build_<name>` factory (the models/ contract) for a causal LM built from `config_cls` with `defaults`."""

    def build(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, attn_implementation: str | None = None,
              **config):
        return _causal_lm(config_cls, model_cls, defaults, seed=seed, batch=batch, seq=seq,
                          attn_implementation=attn_implementation, config=config, experts=experts)

    build.__doc__ = doc
    return build


def _text_encoder_factory(config_cls: str, model_cls: str, defaults: dict, doc: str,
                          model_kwargs: dict | None = None):
    """A `build_<name>` factory for a text encoder returning last_hidden_state."""

    def build(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, attn_implementation: str | None = None,
              **config):
        return _text_encoder(config_cls, model_cls, defaults, seed=seed, batch=batch, seq=seq,
                             attn_implementation=attn_implementation, config=config, model_kwargs=model_kwargs)

    build.__doc__ = doc
    return build


# The Llama-like decoder skeleton most architectures share; each factory overrides what differs.
_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": POSITIONS,
    "initializer_range": INITIALIZER_RANGE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


# --- decoders -------------------------------------------------------------------------------------------------


build_llama = _causal_lm_factory(
    "LlamaConfig", "LlamaForCausalLM", _DECODER,
    """LlamaForCausalLM: RMSNorm, rotate_half RoPE, GQA 4/2 (head_dim 16), SwiGLU -> logits.""")


build_mistral = _causal_lm_factory(
    "MistralConfig", "MistralForCausalLM", {**_DECODER, "sliding_window": SLIDING_WINDOW},
    """MistralForCausalLM: Llama + a sliding window (4 here, 4096 by default) on every layer -> logits.""")


build_qwen2 = _causal_lm_factory(
    "Qwen2Config", "Qwen2ForCausalLM", _DECODER,
    """Qwen2ForCausalLM: Llama with q/k/v biases (sliding window off, as by default) -> logits.""")


build_qwen3 = _causal_lm_factory(
    "Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 16},
    """Qwen3ForCausalLM: Llama + per-head q_norm/k_norm RMSNorms before RoPE -> logits.""")


_GEMMA = {**_DECODER, "head_dim": 32}  # 4 heads x 32 = 128 != hidden 64, as in the real Gemmas


build_gemma = _causal_lm_factory(
    "GemmaConfig", "GemmaForCausalLM", _GEMMA,
    """GemmaForCausalLM: (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), tied lm_head,
head_dim 32 -> logits.""")


build_gemma2 = _causal_lm_factory(
    "Gemma2Config", "Gemma2ForCausalLM", {**_GEMMA, "sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 64},
    """Gemma2ForCausalLM: layer 0 sliding (window 4), layer 1 global, attention logits soft-capped (50) and final
logits soft-capped (30), sandwich norms, query_pre_attn_scalar 64 (scale 1/8, not 1/sqrt(32)) -> logits.
Gemma-2 does not support sdpa: its default attention is eager.""")


build_gemma3 = _causal_lm_factory(
    "Gemma3TextConfig", "Gemma3ForCausalLM",
    {**_GEMMA, "sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 32,
     "layer_types": ["sliding_attention", "full_attention"]},
    """Gemma3ForCausalLM (text only): layer 0 sliding (window 4, local rope theta 1e4), layer 1 global (theta 1e6),
per-head (1 + w) q_norm/k_norm, sandwich norms, GeGLU -> logits.""")


build_phi = _causal_lm_factory(
    "PhiConfig", "PhiForCausalLM", _DECODER,
    """PhiForCausalLM: parallel block (one LayerNorm feeds attention and MLP), partial rotary (0.5 of 16),
gelu_new MLP, biases everywhere -> logits.""")


build_phi3 = _causal_lm_factory(
    "Phi3Config", "Phi3ForCausalLM", _DECODER,
    """Phi3ForCausalLM: merged qkv_proj (sliced) and gate_up_proj (chunked), RMSNorm, SwiGLU -> logits.""")


build_gpt2 = _causal_lm_factory(
    "GPT2Config", "GPT2LMHeadModel",
    {"vocab_size": VOCAB, "n_positions": POSITIONS, "n_embd": HIDDEN, "n_layer": 2, "n_head": 4, "n_inner": 128,
     "bos_token_id": 1, "eos_token_id": 2, "initializer_range": INITIALIZER_RANGE},
    """GPT2LMHeadModel: learned positions, Conv1D c_attn split in three, LayerNorm, gelu_new, tied lm_head.""")


build_gptj = _causal_lm_factory(
    "GPTJConfig", "GPTJForCausalLM",
    {"vocab_size": VOCAB, "n_positions": POSITIONS, "n_embd": HIDDEN, "n_layer": 2, "n_head": 4, "n_inner": 128,
     "rotary_dim": 8, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": INITIALIZER_RANGE},
    """GPTJForCausalLM: parallel block, interleaved (rotate_every_two) partial rotary on 8 of 16 dims, applied in
[batch, seq, heads, dim] layout; gelu_new; lm_head with bias.""")


build_gpt_neox = _causal_lm_factory(
    "GPTNeoXConfig", "GPTNeoXForCausalLM", {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"},  # no GQA
    """GPTNeoXForCausalLM: parallel residual with two LayerNorms, fused query_key_value viewed per head and
chunked, partial rotary 0.25 (4 of 16 dims), exact GELU.""")


build_stablelm = _causal_lm_factory(
    "StableLmConfig", "StableLmForCausalLM", _DECODER,
    """StableLmForCausalLM: LayerNorm (with bias), partial rotary 0.25, SwiGLU, sequential residual -> logits.""")


build_starcoder2 = _causal_lm_factory(
    "Starcoder2Config", "Starcoder2ForCausalLM", _DECODER,
    """Starcoder2ForCausalLM: LayerNorm, biases, full rotary, tanh-GELU MLP (c_fc/c_proj), tied lm_head.""")


build_olmo2 = _causal_lm_factory(
    "Olmo2Config", "Olmo2ForCausalLM", _DECODER,
    """Olmo2ForCausalLM: post-norm (norm after attention and after MLP, none before), q_norm/k_norm RMSNorms over
the whole q/k projection (64 and 32 wide) before the head split.""")


build_cohere = _causal_lm_factory(
    "CohereConfig", "CohereForCausalLM", {**_DECODER, "bos_token_id": 5},
    """CohereForCausalLM: parallel block, bias-free LayerNorm, interleaved RoPE (repeat_interleave cos/sin),
logits scaled by logit_scale 0.0625, tied lm_head.""")


build_granite = _causal_lm_factory(
    "GraniteConfig", "GraniteForCausalLM", {**_DECODER, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0625, "logits_scaling": 8.0},
    """GraniteForCausalLM: Llama with Granite-3-like multipliers (the defaults are all 1.0): embeddings x12,
residual branches x0.22, attention scale 1/head_dim (0.0625) instead of 1/sqrt(head_dim), logits / 8.""")


build_smollm3 = _causal_lm_factory(
    "SmolLM3Config", "SmolLM3ForCausalLM", {**_DECODER, "no_rope_layers": [1, 0]},
    """SmolLM3ForCausalLM: layer 0 with RoPE, layer 1 NoPE (no_rope_layers [1, 0]; by default every 4th layer is
NoPE), tied lm_head.""")


build_glm4 = _causal_lm_factory(
    "Glm4Config", "Glm4ForCausalLM", {**_DECODER, "head_dim": 16},
    """Glm4ForCausalLM: four RMSNorms per layer (sandwich), qkv biases, interleaved partial rotary (0.5),
merged gate_up_proj chunked in two.""")


build_opt = _causal_lm_factory(
    "OPTConfig", "OPTForCausalLM",
    {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 128,
     "max_position_embeddings": POSITIONS, "word_embed_proj_dim": HIDDEN, "pad_token_id": 1, "bos_token_id": 2,
     "eos_token_id": 2, "init_std": INITIALIZER_RANGE},
    """OPTForCausalLM: learned positions from the mask's cumsum (offset 2), q pre-scaled before the attention call
(scale 1.0 there), pre-LayerNorm, ReLU MLP, tied lm_head.""")


build_bloom = _causal_lm_factory(
    "BloomConfig", "BloomForCausalLM",
    {"vocab_size": VOCAB, "hidden_size": HIDDEN, "n_layer": 2, "n_head": 4, "bos_token_id": 1, "eos_token_id": 2,
     "pad_token_id": 3, "initializer_range": INITIALIZER_RANGE},
    """BloomForCausalLM: ALiBi (slopes x mask-cumsum positions, added through baddbmm), fused query_key_value
viewed as [.., heads, 3, dim], embedding LayerNorm, Bloom's factored tanh GELU. Bloom has only its own
attention code (no sdpa).""")


# --- encoders -------------------------------------------------------------------------------------------------


_BERT = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": POSITIONS, "initializer_range": INITIALIZER_RANGE}


build_bert = _text_encoder_factory(
    "BertConfig", "BertModel", _BERT,
    """BertModel without pooler: post-LayerNorm, exact GELU, bidirectional padding mask -> last_hidden_state.""",
    model_kwargs={"add_pooling_layer": False})


build_roberta = _text_encoder_factory(
    "RobertaConfig", "RobertaModel", {**_BERT, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
    """RobertaModel without pooler: BERT with positions counted from input_ids != pad (1), starting at pad + 1.""",
    model_kwargs={"add_pooling_layer": False})


build_distilbert = _text_encoder_factory(
    "DistilBertConfig", "DistilBertModel",
    {"vocab_size": VOCAB, "dim": HIDDEN, "hidden_dim": 128, "n_layers": 2, "n_heads": 4,
     "max_position_embeddings": POSITIONS, "initializer_range": INITIALIZER_RANGE},
    """DistilBertModel: BERT without token types, post-LayerNorm, exact GELU -> last_hidden_state.""")


build_modernbert = _text_encoder_factory(
    "ModernBertConfig", "ModernBertModel",
    {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "max_position_embeddings": POSITIONS, "local_attention": SLIDING_WINDOW,
     "layer_types": ["full_attention", "sliding_attention"], "initializer_range": INITIALIZER_RANGE,
     "pad_token_id": 0, "bos_token_id": 1, "cls_token_id": 1, "eos_token_id": 2, "sep_token_id": 2},
    """ModernBertModel: layer 0 global (no attn_norm: Identity), layer 1 sliding (local_attention 4: |i - j| <= 2),
bias-free LayerNorm, fused Wqkv unbound in three, RoPE, GeGLU with exact GELU on the first chunk.""")


build_clip_text = _text_encoder_factory(
    "CLIPTextConfig", "CLIPTextModel",
    {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "max_position_embeddings": POSITIONS, "initializer_range": INITIALIZER_RANGE,
     "initializer_factor": 4.0, "pad_token_id": 1, "bos_token_id": 126, "eos_token_id": 127},
    """CLIPTextModel: causal + padding mask, pre-LayerNorm, quick_gelu -> last_hidden_state (the pooled EOS
output is not returned). initializer_factor 4 scales CLIP's own init (its std does not read
initializer_range).""")


def build_vit(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, attn_implementation: str | None = None,
              **config):
    """ViTModel without pooler: 32x32 image, patch 8 (16 patches + CLS = 17 tokens), pre-LayerNorm, exact GELU,
    no mask. Input pixel_values [batch, 3, 32, 32], only batch dynamic (`seq` is unused)."""
    tf = _transformers()
    torch.manual_seed(seed)
    defaults = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "image_size": IMAGE, "patch_size": PATCH, "initializer_range": INITIALIZER_RANGE}
    cfg = _config(tf, "ViTConfig", defaults, config, attn_implementation)
    model = tf.ViTModel(cfg, add_pooling_layer=False)
    randomize_biases(model)
    randomize_norms(model)
    inputs = {"pixel_values": torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size)}
    return PixelEncoderOutput(model).eval(), inputs, {"pixel_values": {0: "batch"}}


def build_whisper_encoder(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ,
                          attn_implementation: str | None = None, **config):
    """WhisperModel's encoder (model.get_encoder()): two GELU convs (the second stride 2), sinusoidal positions,
    pre-LayerNorm, q pre-scaled (k_proj without bias), exact GELU. Input input_features [batch, 16 mel bins, 16],
    only batch dynamic (`seq` is unused: Whisper requires exactly 2 * max_source_positions frames)."""
    tf = _transformers()
    torch.manual_seed(seed)
    defaults = {"vocab_size": VOCAB, "num_mel_bins": MEL_BINS, "d_model": HIDDEN, "encoder_layers": 2,
                "encoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_layers": 1,
                "decoder_attention_heads": 4, "decoder_ffn_dim": 128, "max_source_positions": SOURCE_POSITIONS,
                "max_target_positions": 16, "init_std": INITIALIZER_RANGE, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2, "decoder_start_token_id": 1, "begin_suppress_tokens": None}
    cfg = _config(tf, "WhisperConfig", defaults, config, attn_implementation)
    encoder = tf.WhisperModel(cfg).get_encoder()
    randomize_biases(encoder)
    randomize_norms(encoder)
    frames = 2 * cfg.max_source_positions
    inputs = {"input_features": torch.randn(batch, cfg.num_mel_bins, frames)}
    return AudioEncoderOutput(encoder).eval(), inputs, {"input_features": {0: "batch"}}


# --- mixture of experts ---------------------------------------------------------------------------------------


build_mixtral = _causal_lm_factory(
    "MixtralConfig", "MixtralForCausalLM",
    {**_DECODER, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    """MixtralForCausalLM: Mistral attention (sliding window off, as by default), 4 experts top-2 (softmax, top-k,
renormalised), experts as batched_mm -> logits.""",
    experts="batched_mm")


build_qwen2_moe = _causal_lm_factory(
    "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
    {**_DECODER, "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
     "num_experts": 4, "num_experts_per_tok": 2},
    """Qwen2MoeForCausalLM: Qwen2 attention (qkv bias), 4 routed experts top-2 (not renormalised) plus a shared
SwiGLU expert gated by sigmoid(linear), experts as batched_mm -> logits.""",
    experts="batched_mm")


build_qwen3_moe = _causal_lm_factory(
    "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
    {**_DECODER, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
     "norm_topk_prob": True},
    """Qwen3MoeForCausalLM: Qwen3 attention (per-head q_norm/k_norm), 4 routed experts top-2 renormalised
(norm_topk_prob True, as Qwen3-30B-A3B's config; transformers' default is False), no shared expert, experts as
batched_mm -> logits.""",
    experts="batched_mm")


# --- the registry: expected census per architecture -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One zoo architecture and the census a perfect compiler produces for its tiny config (sdpa default).

    census: expected call-weighted count per MindSpore fused primitive (primitives not listed: 0).
    layer_kinds: per attention-layer kind (global, sliding, softcapped, alibi, nope, bidirectional, ...), its
        share of the per-layer primitives; key "attention" is the number of attention computations of that
        kind (the candidates), the other keys are census primitives and sum over the kinds to the census.
    refused: candidates a perfect compiler must refuse, with why, e.g. {"attention: soft-capped scores": 2}.
    unsupported: ops graphconv cannot lower yet that the architecture needs (op -> count), so the compile
        cannot be complete (MoE routing's TopK was one until it got a lowering: none now).
    moe_census: the share of `census` inside the MoE blocks (router and experts): MoeGatingTopKSoftmax per
        router, the experts' SwiGLU (batched_mm: silu(first half) * second half of the gathered gate_up).
    exporter_failures: "dynamo-<opset>" -> PyTorch's error (measured; empty: all of 17, 18 and 23 export).
    """

    name: str
    factory: str
    kind: str  # "decoder" | "encoder" | "moe"
    census: dict[str, int]
    layer_kinds: dict[str, dict[str, int]]
    why: str
    facts: str = ""
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    unsupported: dict[str, int] = dataclasses.field(default_factory=dict)
    moe_census: dict[str, int] = dataclasses.field(default_factory=dict)
    exporter_failures: dict[str, str] = dataclasses.field(default_factory=dict)
    dynamic: tuple[str, ...] = ("batch", "seq")


FUSED_PRIMITIVES = ("FlashAttentionScore", "RmsNorm", "LayerNorm", "RotaryPositionEmbedding", "Swiglu", "GeLU",
                    "GeluExt", "FastGeLU", "MoeGatingTopKSoftmax")

_FA, _RMS, _LN, _ROPE = "FlashAttentionScore", "RmsNorm", "LayerNorm", "RotaryPositionEmbedding"
_MOE = "MoeGatingTopKSoftmax"


def _rope_kind(layers: int, fused: int | None = None) -> dict[str, int]:
    """A kind of `layers` attention layers with RoPE on q and k (FlashAttentionScore expected `fused`)."""
    return {"attention": layers, _FA: layers if fused is None else fused, _ROPE: 2 * layers}


def _plain_kind(layers: int) -> dict[str, int]:
    """A kind of `layers` attention layers without rotary embedding."""
    return {"attention": layers, _FA: layers}


_ARCHS = [
    Architecture(
        "llama", f"{__name__}:build_llama", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "LlamaDecoderLayer: input_layernorm + post_attention_layernorm (2 RMSNorm/layer) + model.norm = 5; "
        "apply_rotary_pos_emb rotates q and k; LlamaMLP down(act(gate) * up) with hidden_act silu.",
        "RMSNorm (x*rsqrt(mean(x^2)+eps), cast, then weight*); rotate_half RoPE, cos/sin = cat(freqs, freqs) "
        "computed in-graph from inv_freq x position_ids; causal + padding mask; GQA 4/2 via repeat_kv "
        "(sdpa: enable_gqa or expand); separate q/k/v/o and gate/up/down projections, no biases."),
    Architecture(
        "mistral", f"{__name__}:build_mistral", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"sliding": _rope_kind(2)},
        "Llama's layer structure (2 RMSNorm/layer + final norm, q/k rotated, silu-gated MLP); "
        "MistralModel builds create_sliding_window_causal_mask for every layer since config.sliding_window is set.",
        "As Llama; every layer sliding: causal AND kv_idx > q_idx - 4 (window 4 here, 4096 by default) AND padding."),
    Architecture(
        "qwen2", f"{__name__}:build_qwen2", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "Qwen2DecoderLayer = Llama's (2 RMSNorm/layer + final); use_sliding_window False -> all layer_types "
        "full_attention; silu-gated Qwen2MLP.",
        "As Llama, plus biases on q_proj/k_proj/v_proj (o_proj none); causal + padding mask (sliding window off)."),
    Architecture(
        "qwen3", f"{__name__}:build_qwen3", "decoder",
        {_RMS: 9, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "Qwen3DecoderLayer: 2 RMSNorm + Qwen3Attention.q_norm and k_norm (RMSNorm over head_dim) = 4/layer, "
        "+ final norm = 9; RoPE on the normed q and k.",
        "qk-norm per head: q_norm(q_proj(x).view(B,S,H,D)) before transpose and RoPE (width head_dim 16); "
        "no qkv bias; otherwise Llama."),
    Architecture(
        "gemma", f"{__name__}:build_gemma", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 4, "GeLU": 2},
        {"global": _rope_kind(2)},
        "GemmaDecoderLayer: 2 GemmaRMSNorm/layer + final norm = 5; GemmaMLP down(gelu_pytorch_tanh(gate) * up) "
        "= one tanh GeLU per MLP (the Mul stays); q/k rotated.",
        "GemmaRMSNorm computes in fp32 and scales by (1 + w) before the cast; embeddings x sqrt(hidden) (a "
        "buffer, = 8); GeGLU with gelu tanh (approximate='tanh'); head_dim 32 with 4 heads (q width 128 != "
        "hidden 64); tied lm_head; causal + padding mask."),
    Architecture(
        "gemma2", f"{__name__}:build_gemma2", "decoder",
        {_RMS: 9, _FA: 0, _ROPE: 4, "GeLU": 2},
        {"softcapped": _rope_kind(2, fused=0)},
        "Gemma2DecoderLayer: input/post_attention/pre_feedforward/post_feedforward RMSNorms (4/layer) + final = "
        "9; both layers pass softcap=attn_logit_softcapping (50) -> tanh-capped scores that FlashAttentionScore "
        "cannot express, so 0 fused of 2 candidates (layer 0 sliding, layer 1 global); GeGLU tanh GeLU per MLP.",
        "(1 + w) RMSNorm, sandwich norms; attention scale query_pre_attn_scalar^-0.5 = 1/8 (not 1/sqrt(32)); "
        "scores = tanh(s/50)*50 before the mask; final logits tanh(l/30)*30; layer 0 sliding window 4, layer 1 "
        "global; _supports_sdpa = False: default attention is eager (matmul/softmax, no sdpa); tied lm_head.",
        refused={"attention: soft-capped scores": 2}),
    Architecture(
        "gemma3", f"{__name__}:build_gemma3", "decoder",
        {_RMS: 13, _FA: 2, _ROPE: 4, "GeLU": 2},
        {"sliding": _rope_kind(1), "global": _rope_kind(1)},
        "Gemma3DecoderLayer: 4 sandwich RMSNorms + q_norm and k_norm = 6/layer, + final = 13; "
        "attn_logit_softcapping None (not passed); layer_types [sliding, full]; GeGLU tanh GeLU per MLP.",
        "(1 + w) RMSNorm; per-head qk-norm on [B,H,S,D] after transpose, before RoPE; two RoPE tables (local "
        "theta 1e4 for sliding, 1e6 for global); sliding window 4 (kv_idx > q_idx - 4) on layer 0; scale "
        "query_pre_attn_scalar^-0.5; embeddings x sqrt(hidden); tied lm_head."),
    Architecture(
        "phi", f"{__name__}:build_phi", "decoder",
        {_LN: 3, _FA: 2, _ROPE: 4, "GeLU": 2},
        {"global": _rope_kind(2)},
        "PhiDecoderLayer: one input_layernorm feeding both attention and MLP (parallel) + final_layernorm = 3 "
        "LayerNorm; PhiMLP fc1 -> gelu_new (tanh) -> fc2; partial rotary on q_rot/k_rot.",
        "LayerNorm with bias; parallel block out = attn + mlp + residual; partial rotary 0.5: first 8 of 16 dims "
        "rotated (rotate_half), rest concatenated back; biases on q/k/v/dense/fc1/fc2 and lm_head."),
    Architecture(
        "phi3", f"{__name__}:build_phi3", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "Phi3DecoderLayer: 2 RMSNorm/layer + final; Phi3MLP gate, up = gate_up_proj(x).chunk(2) then "
        "up * silu(gate) (a SwiGLU with the product commuted).",
        "merged qkv_proj split by slicing [:q], [q:q+kv], [q+kv:] (GQA 4/2); merged gate_up_proj chunked "
        "(gate first); full rotary (partial_rotary_factor 1.0) rotate_half; no biases; sliding_window None."),
    Architecture(
        "gpt2", f"{__name__}:build_gpt2", "decoder",
        {_LN: 5, _FA: 2, "GeLU": 2},
        {"global": _plain_kind(2)},
        "GPT2Block: ln_1 + ln_2 per layer + ln_f = 5 LayerNorm; GPT2MLP c_fc -> gelu_new (tanh) -> c_proj; "
        "learned absolute positions (no rotary).",
        "Conv1D c_attn (x @ W + b, W stored [in, out]) split(hidden, dim=2) into q, k, v; scale 1/sqrt(16); "
        "causal + padding mask; MHA; tied lm_head."),
    Architecture(
        "gptj", f"{__name__}:build_gptj", "decoder",
        {_LN: 3, _FA: 2, _ROPE: 4, "GeLU": 2},
        {"global": _rope_kind(2)},
        "GPTJBlock: one ln_1 feeding attention and MLP (parallel) + ln_f = 3; rotary on q_rot and k_rot "
        "(rotary_dim 8); GPTJMLP fc_in -> gelu_new -> fc_out.",
        "interleaved RoPE (rotate_every_two: stack(-x[1::2], x[::2]).flatten) on the first 8 of 16 dims, applied "
        "in [B,S,H,D] layout before the transpose; sin/cos gathered from a sinusoid table buffer by position_ids "
        "and repeat_interleave(2); no q/k/v biases; lm_head with bias."),
    Architecture(
        "gpt_neox", f"{__name__}:build_gpt_neox", "decoder",
        {_LN: 5, _FA: 2, _ROPE: 4, "GeluExt": 2},
        {"global": _rope_kind(2)},
        "GPTNeoXLayer: input_layernorm + post_attention_layernorm (both on the layer input: parallel residual) "
        "+ final_layer_norm = 5; hidden_act 'gelu' (exact); q/k partially rotated.",
        "query_key_value viewed [B,S,H,3*D], transposed, chunk(3, -1) (per-head interleaved q|k|v); partial "
        "rotary 0.25 = 4 of 16 dims, rotate_half; biases on qkv and dense; MHA."),
    Architecture(
        "stablelm", f"{__name__}:build_stablelm", "decoder",
        {_LN: 5, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "StableLmDecoderLayer (use_parallel_residual False): input_layernorm + post_attention_layernorm "
        "(nn.LayerNorm) + final norm = 5; silu-gated StableLmMLP; qk_layernorm False.",
        "LayerNorm with bias; partial rotary 0.25 (4 of 16 dims) rotate_half + concat pass-through; no qkv bias "
        "(use_qkv_bias False); GQA 4/2."),
    Architecture(
        "starcoder2", f"{__name__}:build_starcoder2", "decoder",
        {_LN: 5, _FA: 2, _ROPE: 4, "GeLU": 2},
        {"global": _rope_kind(2)},
        "Starcoder2DecoderLayer: 2 nn.LayerNorm/layer + final = 5; Starcoder2MLP c_fc -> gelu_pytorch_tanh -> "
        "c_proj; full rotary.",
        "biases everywhere (use_bias); rotate_half full RoPE; sliding_window None by default (causal only); "
        "GQA 4/2; tied lm_head."),
    Architecture(
        "olmo2", f"{__name__}:build_olmo2", "decoder",
        {_RMS: 9, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "Olmo2DecoderLayer: post_attention_layernorm + post_feedforward_layernorm + Olmo2Attention.q_norm + "
        "k_norm = 4 RMSNorm/layer, + final norm = 9.",
        "post-norm only (residual + norm(attn(x)), no pre-norm); qk-norm over the full projection before the "
        "head split (q_norm width 64 = H*D, k_norm width 32 = KV*D); Olmo2RMSNorm casts after the weight "
        "multiply; rotate_half RoPE."),
    Architecture(
        "cohere", f"{__name__}:build_cohere", "decoder",
        {_LN: 3, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "CohereDecoderLayer: one input_layernorm feeding attention and MLP (parallel) + final norm = 3 "
        "CohereLayerNorm (mean-subtracting, weight only, no bias); silu-gated MLP; use_qk_norm False.",
        "bias-free LayerNorm computed in fp32; interleaved RoPE: cos/sin = repeat_interleave(freqs, 2), "
        "rotate_half = stack(-x[1::2], x[::2]).flatten; logits x logit_scale 0.0625; tied lm_head."),
    Architecture(
        "granite", f"{__name__}:build_granite", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "GraniteDecoderLayer = Llama's (2 RMSNorm/layer + final); attention scaling = attention_multiplier.",
        "scale 0.0625 (= 1/head_dim here, not 1/sqrt); embeddings x12, residual branches x0.22, logits / 8; "
        "otherwise Llama."),
    Architecture(
        "smollm3", f"{__name__}:build_smollm3", "decoder",
        {_RMS: 5, _FA: 2, _ROPE: 2, "Swiglu": 2},
        {"global": _rope_kind(1), "nope": {"attention": 1, _FA: 1, _ROPE: 0}},
        "SmolLM3Attention applies RoPE only where config.no_rope_layers[i] is 1 ([1, 0]: layer 1 is NoPE), "
        "so 2 rotated tensors; 2 RMSNorm/layer + final; silu-gated MLP.",
        "Llama-like; NoPE layer attends without position information (same causal mask); rope theta 2e6; "
        "tied lm_head."),
    Architecture(
        "glm4", f"{__name__}:build_glm4", "decoder",
        {_RMS: 9, _FA: 2, _ROPE: 4, "Swiglu": 2},
        {"global": _rope_kind(2)},
        "Glm4DecoderLayer: input_layernorm, post_self_attn_layernorm, post_attention_layernorm, "
        "post_mlp_layernorm = 4 RMSNorm/layer, + final = 9; Glm4MLP gate_up_proj chunk(2), up * silu(gate).",
        "interleaved partial RoPE: cos[..., :half].repeat_interleave(2) over the first 8 of 16 dims, "
        "rotate_half = stack(-x[1::2], x[::2]).flatten, rest concatenated; qkv biases; sandwich norms; "
        "merged gate_up_proj chunked (gate first)."),
    Architecture(
        "opt", f"{__name__}:build_opt", "decoder",
        {_LN: 5, _FA: 2},
        {"global": _plain_kind(2)},
        "OPTDecoderLayer (do_layer_norm_before): self_attn_layer_norm + final_layer_norm per layer + "
        "decoder.final_layer_norm = 5; activation relu (no GELU primitive).",
        "q_proj(x) * head_dim^-0.5 before the attention call (scaling=1.0 there); learned positions "
        "cumsum(mask)*mask - 1 + offset 2; biases; ReLU MLP; MHA; tied lm_head."),
    Architecture(
        "bloom", f"{__name__}:build_bloom", "decoder",
        {_LN: 6, _FA: 2, "GeLU": 2},
        {"alibi": _plain_kind(2)},
        "BloomModel: word_embeddings_layernorm + (input_layernorm + post_attention_layernorm) per layer + ln_f "
        "= 6; BloomGelu -> GeLUFunction.apply -> bloom_gelu_forward x*0.5*(1+tanh(0.79788456*x*(1+0.044715*x*x))) "
        "= tanh GeLU; attention with an "
        "ALiBi bias: FlashAttentionScore through its pse (additive bias) input.",
        "own attention code (no sdpa): scores = alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(16)) then + mask, "
        "fp32 softmax; alibi = slopes[h] * ((cumsum(mask) - 1) * mask); query_key_value viewed [B,S,H,3,D]; "
        "biases; tied lm_head."),
    Architecture(
        "bert", f"{__name__}:build_bert", "encoder",
        {_LN: 5, _FA: 2, "GeluExt": 2},
        {"bidirectional": _plain_kind(2)},
        "BertEmbeddings.LayerNorm + BertSelfOutput.LayerNorm + BertOutput.LayerNorm per layer = 5; "
        "BertIntermediate hidden_act 'gelu' (exact erf).",
        "post-LayerNorm (LN(x + sublayer)); bidirectional padding mask (create_bidirectional_mask); word + "
        "position + token-type (zeros buffer) embeddings; biases; no pooler."),
    Architecture(
        "roberta", f"{__name__}:build_roberta", "encoder",
        {_LN: 5, _FA: 2, "GeluExt": 2},
        {"bidirectional": _plain_kind(2)},
        "Same layer structure as BERT: embedding LayerNorm + 2 LayerNorm/layer = 5; exact GELU intermediate.",
        "positions = cumsum(input_ids != pad) * (input_ids != pad) + pad (pad id 1), from the ids, not the "
        "mask; otherwise BERT."),
    Architecture(
        "distilbert", f"{__name__}:build_distilbert", "encoder",
        {_LN: 5, _FA: 2, "GeluExt": 2},
        {"bidirectional": _plain_kind(2)},
        "Embeddings.LayerNorm + sa_layer_norm + output_layer_norm per TransformerBlock = 5; FFN activation "
        "'gelu' (exact).",
        "post-LayerNorm, eps 1e-12; bidirectional padding mask; no token types; learned positions."),
    Architecture(
        "modernbert", f"{__name__}:build_modernbert", "encoder",
        {_LN: 5, _FA: 2, _ROPE: 4, "GeluExt": 2},
        {"bidirectional": _rope_kind(1), "sliding": _rope_kind(1)},
        "embeddings.norm + layer 0 mlp_norm (its attn_norm is nn.Identity) + layer 1 attn_norm and mlp_norm + "
        "final_norm = 5 LayerNorm; ModernBertMLP input, gate = Wi(x).chunk(2), Wo(gelu(input) * gate): exact "
        "GELU on the first chunk (GeGLU).",
        "bias-free LayerNorm (norm_bias False); Wqkv viewed [B,S,3,H,D] and unbound; rotate_half RoPE with two "
        "tables (global theta 160000, local 10000); layer 1 bidirectional sliding window |q - k| <= "
        "local_attention/2 = 2, layer 0 bidirectional; no biases."),
    Architecture(
        "clip_text", f"{__name__}:build_clip_text", "encoder",
        {_LN: 5, _FA: 2, "FastGeLU": 2},
        {"global": _plain_kind(2)},
        "CLIPEncoderLayer: layer_norm1 + layer_norm2 per layer + final_layer_norm = 5; CLIPMLP activation "
        "quick_gelu = x * sigmoid(1.702 x).",
        "causal + padding mask (create_causal_mask) in an encoder; pre-LayerNorm; learned positions; biases; the "
        "pooled EOS gather (argmax) is dead code for last_hidden_state."),
    Architecture(
        "vit", f"{__name__}:build_vit", "encoder",
        {_LN: 5, _FA: 2, "GeluExt": 2},
        {"bidirectional": _plain_kind(2)},
        "ViTLayer: layernorm_before + layernorm_after per layer + ViTModel.layernorm = 5; ViTIntermediate "
        "'gelu' (exact).",
        "Conv2d patch embedding (8x8 stride 8) + CLS concat + learned positions; no mask; pre-LayerNorm; qkv "
        "biases; static 17 tokens, only batch dynamic.",
        dynamic=("batch",)),
    Architecture(
        "whisper_encoder", f"{__name__}:build_whisper_encoder", "encoder",
        {_LN: 5, _FA: 2, "GeluExt": 4},
        {"bidirectional": _plain_kind(2)},
        "WhisperEncoder: gelu(conv1), gelu(conv2) (nn.functional.gelu, exact) + per layer fc1 'gelu' = 4 "
        "GeluExt; self_attn_layer_norm + final_layer_norm per layer + encoder layer_norm = 5 LayerNorm.",
        "q_proj(x) * head_dim^-0.5 before attention (scaling 1.0); k_proj without bias; no mask; sinusoidal "
        "position embedding added to all 8 positions; Conv1d stem (k3, second stride 2); only batch dynamic.",
        dynamic=("batch",)),
    Architecture(
        "mixtral", f"{__name__}:build_mixtral", "moe",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 2, _MOE: 2},
        {"global": _rope_kind(2)},
        "Dense part = Mistral's attention half: 2 RMSNorm/layer + final, q/k rotated; every MLP is a "
        "MixtralSparseMoeBlock: softmax(router logits) -> topk(2) = 1 MoeGatingTopKSoftmax/layer, then "
        "renormalised (the division stays); experts via batched_mm with silu(gate) * up after the gate_up chunk "
        "= 1 Swiglu/layer (moe_census).",
        "experts as gathered [S, 2I, H] weights + bmm (batched_mm); top-2 of 4 experts, weights renormalised; "
        "GQA 4/2; sliding window None; rope theta 1e6.",
        moe_census={"Swiglu": 2, _MOE: 2}),
    Architecture(
        "qwen2_moe", f"{__name__}:build_qwen2_moe", "moe",
        {_RMS: 5, _FA: 2, _ROPE: 4, "Swiglu": 4, _MOE: 2},
        {"global": _rope_kind(2)},
        "Dense part: 2 RMSNorm/layer + final, q/k rotated; each Qwen2MoeSparseMoeBlock: the router softmax -> "
        "topk(2), not renormalised = 1 MoeGatingTopKSoftmax/layer; routed experts via batched_mm with silu(gate) "
        "* up after the gate_up chunk = 1 Swiglu/layer; the shared_expert (a silu-gated Qwen2MoeMLP on the "
        "flattened tokens: 2-D Gemm projections) = 1 Swiglu/layer, scaled by sigmoid(shared_expert_gate(x)).",
        "qkv biases; shared expert always on, gated by a sigmoid of a 1-wide linear; routed experts batched_mm; "
        "layer_types full (sliding window 0 = off).",
        moe_census={"Swiglu": 4, _MOE: 2}),
    Architecture(
        "qwen3_moe", f"{__name__}:build_qwen3_moe", "moe",
        {_RMS: 9, _FA: 2, _ROPE: 4, "Swiglu": 2, _MOE: 2},
        {"global": _rope_kind(2)},
        "Qwen3's attention half: 2 RMSNorm + q_norm and k_norm per layer + final = 9, q/k rotated; each "
        "Qwen3MoeSparseMoeBlock: router softmax -> topk(2) = 1 MoeGatingTopKSoftmax/layer, renormalised "
        "(norm_topk_prob); routed experts via batched_mm, silu(gate) * up = 1 Swiglu/layer; no shared expert.",
        "qk-norm per head before RoPE; no qkv bias; top-2 of 4 experts (moe_intermediate_size 32); every layer "
        "sparse (decoder_sparse_step 1, mlp_only_layers empty).",
        moe_census={"Swiglu": 2, _MOE: 2}),
]

# Measured with torch 2.13 / transformers 5.24 / onnx 1.23 through graphconv.frontend.export.zoo_export (dynamo, the
# default sdpa attention, checked against PyTorch at two shapes). Opsets 18 and 23 export for every architecture.
_SPLIT_17 = ("PyTorch's dynamo exporter produced an invalid ONNX model at opset 17: Unrecognized attribute: "
             "num_outputs for operator Split")
_DOWNGRADE_17 = ("the dynamo exporter produced opset 18, not the requested 17: its 18 -> 17 conversion (onnx C API) "
                 "fails, axes_input_to_attribute.h: 'No initializer or constant input to node found' (the "
                 "ReduceMean of RMSNorm / Cohere's LayerNorm, whose axes are an input at 18); the file is opset 18")
_EXPORTER_FAILURES: dict[str, dict[str, str]] = {
    **{name: {"dynamo-17": _SPLIT_17} for name in ("gpt2", "gptj", "gpt_neox", "modernbert")},
    **{name: {"dynamo-17": _DOWNGRADE_17} for name in (
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "cohere", "granite",
        "smollm3", "glm4", "mixtral", "qwen2_moe", "qwen3_moe")},
}
_ARCHS = [dataclasses.replace(a, exporter_failures=_EXPORTER_FAILURES.get(a.name, {})) for a in _ARCHS]

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ARCHS}

# The slice a CI run covers: one of each family that matters most for fusion work.
CI_SLICE = ["llama", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "bert", "vit"]

GROUPS: dict[str, list[str]] = {
    "all": list(ARCHITECTURES),
    "ci": CI_SLICE,
    "decoder": [a.name for a in _ARCHS if a.kind == "decoder"],
    "encoder": [a.name for a in _ARCHS if a.kind == "encoder"],
    "moe": [a.name for a in _ARCHS if a.kind == "moe"],
    # architectures that alternate attention-layer kinds (sliding/global, NoPE) in their 2 layers
    "mixed-layers": [a.name for a in _ARCHS if len(a.layer_kinds) > 1],
}


def names(group: str = "all") -> list[str]:
    """Architecture names of a group ("all", "ci", "decoder", "encoder", "moe", "mixed-layers")."""
    try:
        return list(GROUPS[group])
    except KeyError:
        raise ValueError(f"unknown group {group!r} (choose from {', '.join(GROUPS)})") from None
