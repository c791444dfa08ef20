"""BERT-style encoder in plain PyTorch: post-LayerNorm layers, padding mask, exact (erf) GELU.

Output is the last hidden state. The tests map this state dict onto transformers' BertModel (names differ:
`layers.0.query` here is `encoder.layer.0.attention.self.query` there) and compare against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import BATCH, SEQ, additive_mask, left_padded_mask, randomize_norms, token_ids


@dataclass
class BertConfig:
    vocab_size: int = 128
    max_positions: int = 128
    type_vocab_size: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    layer_norm_eps: float = 1e-12

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must divide by num_heads")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        token_types = torch.zeros_like(input_ids)  # single-segment input
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        return self.norm(x + self.position_embeddings(positions))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def _heads(self, t):
        b, s, _ = t.shape
        return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, mask):
        b, s, h = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5) + mask
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, h)
        x = self.attn_norm(x + self.attn_out(ctx))  # post-LN: normalise after the residual add
        return self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask (1 keep, 0 pad): int64 (batch, seq) -> hidden (batch, seq, hidden)."""
        x = self.embeddings(input_ids)
        mask = additive_mask(attention_mask[:, None, None, :].bool(), x.dtype)  # (batch, 1, 1, seq)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def build(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, **config):
    """Tiny BERT (hidden 64, 4 heads of 16, 2 layers, vocab 128); `config` overrides BertConfig fields."""
    torch.manual_seed(seed)
    cfg = BertConfig(**config)
    module = BertModel(cfg)
    randomize_norms(module)
    module.eval()
    inputs = {"input_ids": token_ids(batch, seq, cfg.vocab_size), "attention_mask": left_padded_mask(batch, seq)}
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return module, inputs, axes
