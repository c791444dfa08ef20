"""GPT-2-style decoder in plain PyTorch: learned positions, pre-LayerNorm blocks, fused qkv, tanh GELU.

Module names follow transformers' GPT2LMHeadModel (`transformer.h.0.attn.c_attn`, ...), and lm_head is tied
to the token embedding as in GPT-2, so the export holds one initializer used by both Gather and MatMul.
transformers stores these projections as Conv1D (weight transposed); the tests transpose when they load
this state dict into GPT2LMHeadModel as a reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import BATCH, SEQ, additive_mask, randomize_norms, token_ids


@dataclass
class GPT2Config:
    vocab_size: int = 128
    max_positions: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must divide by num_heads")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x, mask):
        b, s, h = x.shape
        q, k, v = (
            t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in self.c_attn(x).split(h, dim=2)
        )
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5 + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, h))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.c_proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # The tied lm_head makes logits scale with the embedding std: N(0, 1) would give logits of ~8.
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.2)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        causal = (positions[None, :] <= positions[:, None])[None, None]  # (1, 1, seq, seq)
        mask = additive_mask(causal, x.dtype)
        for block in self.h:
            x = block(x, mask)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 (batch, seq), seq <= max_positions -> logits (batch, seq, vocab)."""
        return self.lm_head(self.transformer(input_ids))


def build(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, **config):
    """Tiny GPT-2 (hidden 64, 4 heads of 16, 2 layers, vocab 128); `config` overrides GPT2Config fields."""
    torch.manual_seed(seed)
    cfg = GPT2Config(**config)
    module = GPT2LMHeadModel(cfg)
    randomize_norms(module)
    module.eval()
    return module, {"input_ids": token_ids(batch, seq, cfg.vocab_size)}, {"input_ids": {0: "batch", 1: "seq"}}
