"""Zoo of tiny, seeded PyTorch reference models.

Every factory is `build(**overrides) -> (module, example_inputs, dynamic_axes)`:
- module: float32 torch.nn.Module in eval mode, weights seeded by the factory (`seed=` override);
- example_inputs: dict input name -> tensor, passed to the module as keyword arguments in dict order
  (batch 2, seq 7: no dim of size 1 for dynamo to specialise, no two dims equal);
- dynamic_axes: dict input name -> {axis: dim name}.
The forward returns one tensor. Attention masks are int64, 1 = keep, 0 = padding, with row 0 left-padded.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

# Small exported models shipped with the package (regenerate: python -m models.examples.make_examples).
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"

ZOO: dict[str, str] = {
    "mlp": f"{__name__}.mlp:build",
    "cnn": f"{__name__}.cnn:build",
    "llama": f"{__name__}.llama:build",
    "llama-sdpa": f"{__name__}.llama:build_sdpa",
    "gpt2": f"{__name__}.gpt2:build",
    "bert": f"{__name__}.bert:build",
    "hf-llama": f"{__name__}.hf:build_llama",
    "hf-gpt2": f"{__name__}.hf:build_gpt2",
    "hf-bert": f"{__name__}.hf:build_bert",
}

# Names whose factories need nothing beyond torch (the hf-* ones need transformers).
PLAIN_TORCH: list[str] = ["mlp", "cnn", "llama", "llama-sdpa", "gpt2", "bert"]


def load_factory(spec: str) -> Callable:
    """Return the callable named by "package.module:function", by a ZOO name (e.g. "llama"), or by
    "hf/<name>" for a transformers architecture of models/architectures.py (e.g. "hf/qwen3")."""
    if spec.startswith("hf/"):
        from .architectures import ARCHITECTURES

        if spec[3:] not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {spec!r}; choose from "
                             + ", ".join("hf/" + n for n in ARCHITECTURES))
        spec = ARCHITECTURES[spec[3:]].factory
    spec = ZOO.get(spec, spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory spec {spec!r} is neither a zoo name nor 'package.module:function'")
    module = importlib.import_module(module_name)
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no factory {attr!r}") from None
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable")
    return factory
