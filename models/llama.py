"""Llama-style decoder in plain PyTorch: RMSNorm, RoPE (rotate_half), GQA attention, SwiGLU MLP.

Written out op by op, the way transformers writes it, so the exported ONNX graph holds the decomposed
patterns graphconv re-fuses. Module names follow transformers' LlamaForCausalLM (`model.layers.0.self_attn.
q_proj`, ...): the dynamo export's initializer names then look like a real Llama export, and the state dict
loads unchanged into LlamaForCausalLM, which the tests use as an independent reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import BATCH, SEQ, additive_mask, left_padded_mask, randomize_norms, token_ids


@dataclass
class LlamaConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sdpa: bool = False  # F.scaled_dot_product_attention instead of explicit matmul/softmax

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed on the fly for positions 0..seq-1 (nothing precomputed up to a max length)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = torch.arange(seq_len, device=self.inv_freq.device)
        freqs = position_ids[:, None].float() * self.inv_freq[None, :]  # (seq, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # rotate_half layout: both halves share the angles
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, d) -> (batch, kv_heads * n_rep, seq, d); query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sdpa = cfg.sdpa
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale + mask
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        cos, sin = self.rotary_emb(seq)
        positions = torch.arange(seq, device=input_ids.device)
        allowed = (positions[None, :] <= positions[:, None])[None, None]  # causal: (1, 1, seq, seq)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()  # padding: (batch, 1, seq, seq)
        mask = additive_mask(allowed, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask (1 keep, 0 pad): int64 (batch, seq) -> logits (batch, seq, vocab)."""
        return self.lm_head(self.model(input_ids, attention_mask))


def build(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, **config):
    """Tiny Llama (hidden 64, 4 query / 2 kv heads of 16, 2 layers, vocab 128); `config` overrides LlamaConfig
    fields, e.g. build(num_layers=4) or build(sdpa=True)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**config)
    module = LlamaForCausalLM(cfg)
    randomize_norms(module)
    module.eval()
    inputs = {"input_ids": token_ids(batch, seq, cfg.vocab_size), "attention_mask": left_padded_mask(batch, seq)}
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return module, inputs, axes


def build_sdpa(**overrides):
    """The same model with F.scaled_dot_product_attention: the exporter decomposes it into another pattern."""
    return build(sdpa=True, **overrides)
