"""transformers models built from configs with random weights (nothing is downloaded).

Their sizes equal the plain-torch models' defaults (models.llama, models.gpt2, models.bert), so a plain
model's state dict loads into its transformers twin; the tests use that to check both against each other.
Each model is wrapped to take keyword args input_ids, attention_mask and return one tensor, because
transformers returns ModelOutput objects (and caches) that an ONNX export contract cannot carry.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import BATCH, SEQ, left_padded_mask, randomize_norms, token_ids

# transformers initialises with std 0.02, which leaves attention almost uniform and the outputs tiny in a
# 64-wide model: a wrong mask or a misplaced scale would then stay under the comparison tolerance. A larger
# std gives outputs of order 1 and attention that actually depends on the scores.
INITIALIZER_RANGE = 0.2


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"{__name__} needs the 'transformers' package (pip install transformers)") from exc
    return transformers


class OutputOnly(nn.Module):
    """Calls a transformers model without a cache and returns the single output tensor named `output`."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
        return out[self.output]


def _finish(model: nn.Module, output: str, vocab_size: int, batch: int, seq: int):
    randomize_norms(model)
    module = OutputOnly(model, output).eval()
    inputs = {"input_ids": token_ids(batch, seq, vocab_size), "attention_mask": left_padded_mask(batch, seq)}
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return module, inputs, axes


def _config(seed: int, cls, sizes: dict, overrides: dict):
    """`cls` (a transformers config class) at the tiny `sizes` with INITIALIZER_RANGE and eager attention,
    `overrides` last; torch's global generator seeded for the weights the model then draws."""
    torch.manual_seed(seed)
    return cls(**{**sizes, "initializer_range": INITIALIZER_RANGE, "attn_implementation": "eager", **overrides})


def build_llama(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, **config):
    """LlamaForCausalLM: hidden 64, 2 layers, 4 heads / 2 kv heads (head_dim 16), vocab 128 -> logits.
    `config` overrides LlamaConfig arguments."""
    tf = _transformers()
    cfg = _config(seed, tf.LlamaConfig, {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }, config)
    return _finish(tf.LlamaForCausalLM(cfg), "logits", cfg.vocab_size, batch, seq)


def build_gpt2(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, **config):
    """GPT2LMHeadModel: hidden 64, 2 layers, 4 heads of 16, vocab 128, 128 positions -> logits.
    `config` overrides GPT2Config arguments."""
    tf = _transformers()
    cfg = _config(seed, tf.GPT2Config, {
        "vocab_size": 128,
        "n_positions": 128,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "bos_token_id": 127,  # the default 50256 lies outside the tiny vocabulary
        "eos_token_id": 127,
    }, config)
    return _finish(tf.GPT2LMHeadModel(cfg), "logits", cfg.vocab_size, batch, seq)


def build_bert(*, seed: int = 0, batch: int = BATCH, seq: int = SEQ, **config):
    """BertModel without pooler: hidden 64, 2 layers, 4 heads of 16, vocab 128 -> last_hidden_state.
    `config` overrides BertConfig arguments."""
    tf = _transformers()
    cfg = _config(seed, tf.BertConfig, {
        "vocab_size": 128,
        "max_position_embeddings": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }, config)
    return _finish(tf.BertModel(cfg, add_pooling_layer=False), "last_hidden_state", cfg.vocab_size, batch, seq)
