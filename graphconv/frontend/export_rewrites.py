"""Exact real-valued spellings of model code that PyTorch's dynamo exporter cannot write to ONNX.

ONNX has no complex dtype, and torch 2.13's exporter has no ONNX function for the complex ops some transformers
models compute their rotary embedding with (Llama 4: `torch.polar`, `view_as_complex`, a complex product,
`view_as_real`). While a graph is traced, such code is swapped for the same arithmetic on (real, imaginary)
pairs. Nothing else changes, and the export's check runs the unchanged transformers model, so that check proves
the rewrite equal to transformers' own outputs.
"""

from __future__ import annotations

import contextlib
import importlib


def _llama4():
    """Llama 4's rotary: freqs_cis = scaling · e^(i·θ) per (position, pair), and x's interleaved pairs (a, b)
    multiplied by it as a + ib. As pairs: freqs holds (scaling·cos θ, scaling·sin θ) in a last axis of 2, and
    (a + ib)(c + is) = (ac - bs) + i(as + bc)."""
    import torch

    mod = importlib.import_module("transformers.models.llama4.modeling_llama4")

    @mod.dynamic_rope_update
    def rotary_forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling

    def apply_rotary_emb(xq, xk, freqs_cis):
        c, s = freqs_cis[:, :, None, :, 0], freqs_cis[:, :, None, :, 1]

        def rotate(x):
            pairs = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(3).type_as(x)

        return rotate(xq), rotate(xk)

    return [(mod.Llama4TextRotaryEmbedding, "forward", rotary_forward), (mod, "apply_rotary_emb", apply_rotary_emb)]


# model_type -> the (owner, attribute, replacement) triples to swap in while tracing
REWRITES = {"llama4_text": _llama4, "llama4": _llama4}


def names(model_type: str) -> str | None:
    """What the export note says of the rewrite for `model_type`, if there is one."""
    if model_type not in REWRITES:
        return None
    return ("its complex-number rotary (torch.polar, view_as_complex: no ONNX form) traced as the same arithmetic "
            "on real (cos, sin) pairs")


@contextlib.contextmanager
def exportable(model_type: str):
    """Swap in the real-valued spelling of `model_type`'s code for the duration of a trace."""
    swaps = REWRITES[model_type]() if model_type in REWRITES else []
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in swaps]
    try:
        for owner, attr, new in swaps:
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, old in saved:
            setattr(owner, attr, old)
