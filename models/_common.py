"""Helpers shared by the model factories: example inputs, attention masks, norm initialisation."""

from __future__ import annotations

import torch
from torch import nn

# Example shapes: batch != seq and both >= 2, so torch dynamo neither specialises a dim of size 1 nor
# merges two dims that happen to be equal.
BATCH = 2
SEQ = 7
PAD = 2  # left padding of row 0 in example attention masks


def left_padded_mask(batch: int, seq: int, pad: int = PAD) -> torch.Tensor:
    """int64 (batch, seq) mask of ones with row 0 left-padded: its first `pad` positions are 0."""
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, :pad] = 0
    return mask


def token_ids(batch: int, seq: int, vocab_size: int) -> torch.Tensor:
    """Random int64 token ids from the global (seeded) generator."""
    return torch.randint(0, vocab_size, (batch, seq), dtype=torch.int64)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Turn a boolean keep-mask into an additive one: 0 where allowed, the dtype's minimum elsewhere.

    Built with `where` rather than summing several additive masks, so two masked terms never add up to -inf
    (a fully masked row then softmaxes to a finite uniform distribution instead of NaN).
    """
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg)


@torch.no_grad()
def randomize_norms(module: nn.Module, std: float = 0.1) -> None:
    """Give norm layers non-trivial parameters (and BatchNorm non-trivial running statistics).

    Norm weights start at 1 and biases at 0, which would hide a dropped or swapped scale/bias in a
    converter's fusion; a random perturbation makes every such mistake visible in the outputs.
    """
    for m in module.modules():
        if "norm" not in type(m).__name__.lower():
            continue
        weight = getattr(m, "weight", None)
        if isinstance(weight, nn.Parameter):
            weight.normal_(1.0, std)
        bias = getattr(m, "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.normal_(0.0, std)
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            m.running_mean.normal_(0.0, std)
            m.running_var.uniform_(0.5, 1.5)
