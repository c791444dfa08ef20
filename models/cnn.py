"""A small CNN: Conv2d/BatchNorm2d/ReLU twice, global average pooling, Linear; dynamic batch, height, width."""

from __future__ import annotations

import torch
from torch import nn

from ._common import BATCH, randomize_norms


class CNN(nn.Module):
    def __init__(self, in_channels: int = 3, channels: int = 16, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
        )
        # Global pooling keeps the classifier independent of the (dynamic) spatial size.
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(2 * channels, num_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(image))
        return self.classifier(torch.flatten(x, 1))


def build(*, seed: int = 0, batch: int = BATCH, height: int = 16, width: int = 20, **config):
    """CNN (batch, 3, H, W) -> (batch, 10). H != W in the example so the two dims stay distinct."""
    torch.manual_seed(seed)
    module = CNN(**config)
    randomize_norms(module)
    module.eval()
    image = torch.randn(batch, module.features[0].in_channels, height, width)
    return module, {"image": image}, {"image": {0: "batch", 2: "height", 3: "width"}}
