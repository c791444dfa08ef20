"""A plain MLP: the smallest model in the zoo (Gemm/MatMul, Add, Relu), with a dynamic batch only."""

from __future__ import annotations

import torch
from torch import nn

from ._common import BATCH


class MLP(nn.Module):
    def __init__(self, in_features: int = 32, hidden: int = 64, out_features: int = 10, num_layers: int = 3):
        super().__init__()
        sizes = [in_features] + [hidden] * (num_layers - 1) + [out_features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def build(*, seed: int = 0, batch: int = BATCH, **config):
    """MLP (batch, 32) -> (batch, 10). `config` overrides MLP's constructor arguments."""
    torch.manual_seed(seed)
    module = MLP(**config).eval()
    x = torch.randn(batch, module.layers[0].in_features)
    return module, {"x": x}, {"x": {0: "batch"}}
