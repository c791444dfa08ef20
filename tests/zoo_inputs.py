"""Inputs for the zoo's models (models/) at a second shape, shared by tests/test_models_zoo.py and
tests/test_arch_zoo.py."""

from __future__ import annotations

import torch

from models._common import left_padded_mask

VOCAB = 128  # every zoo model's vocabulary
# Sizes for the second shape: none equals an example size, so a specialised dim cannot pass unnoticed.
SECOND_SIZES = {"batch": 3, "seq": 5, "height": 24, "width": 12}


def second_inputs(example: dict, dynamic_axes: dict, seed: int = 1) -> dict:
    """New inputs with every dynamic dim at its SECOND_SIZES size; masks left-padded in row 0 like the examples."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, tensor in example.items():
        shape = list(tensor.shape)
        for axis, dim in dynamic_axes.get(name, {}).items():
            shape[axis] = SECOND_SIZES[dim]
        if "mask" in name:
            inputs[name] = left_padded_mask(*shape)
        elif tensor.dtype.is_floating_point:
            inputs[name] = torch.randn(shape, generator=gen, dtype=tensor.dtype)
        else:
            inputs[name] = torch.randint(0, VOCAB, shape, generator=gen, dtype=tensor.dtype)
    return inputs
