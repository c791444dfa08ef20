"""Equal spellings of model code that PyTorch's dynamo exporter cannot write to ONNX with dynamic axes.

- ONNX has no complex dtype, and torch 2.13's exporter has no ONNX function for the complex ops some
  transformers models compute their rotary embedding with (Llama 4: `torch.polar`, `view_as_complex`, a complex
  product, `view_as_real`): traced as the same arithmetic on (real, imaginary) pairs.
- The gated delta rule of linear-attention layers (Qwen 3.5, Qwen3-Next, OLMo-Hybrid, Lara: Gated DeltaNet) loops
  over chunks of 64 tokens in Python, so the trace fixes the number of chunks and with it the sequence length.
  Without a carried state (the prompt's whole sequence, no cache) the chunked algorithm is exact for any chunk
  size, so it is traced as one chunk of the whole sequence: the intra-chunk terms over all positions, and the
  inverse of the unit lower-triangular system (I + A) as the product of (I + (-A)^(2^i)), which ends once 2^i
  reaches the sequence length (A is strictly lower triangular, so its powers from the sequence length on are
  exactly zero): ceil(log2(max_position_embeddings)) factors. The cost is quadratic in the sequence, like
  attention. A call with a carried state runs transformers' own code.

While a graph is traced, such code is swapped for the rewrite. Nothing else changes, and the export's check runs
the unchanged transformers model, so that check proves the rewrite equal to transformers' own outputs.
"""

from __future__ import annotations

import contextlib
import importlib
import math


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


def _whole_sequence_rule(original, l2norm, factors: int):
    """transformers' torch_chunk_gated_delta_rule without a carried state, as one chunk (module docstring)."""
    import torch

    def rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is not None:
            return original(query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        dtype = query.dtype
        k_heads, v_heads = key.shape[2], value.shape[2]
        if k_heads != v_heads:
            query = query.repeat_interleave(v_heads // k_heads, dim=2)
            key = key.repeat_interleave(v_heads // k_heads, dim=2)
        query, key, value, beta, decay = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
        if use_qk_l2norm_in_kernel:
            query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
        query = query * query.shape[-1] ** -0.5
        k_beta, v_beta = key * beta.unsqueeze(-1), value * beta.unsqueeze(-1)
        cum = decay.cumsum(dim=-1)
        n = cum.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
        power = -((k_beta @ key.transpose(-1, -2)) * pairwise).tril(-1)  # -A
        inverse = torch.eye(n, dtype=power.dtype, device=power.device) + power
        for _ in range(factors - 1):
            power = power @ power
            inverse = inverse + inverse @ power
        new_values = inverse @ v_beta
        out = ((query @ key.transpose(-1, -2)) * pairwise) @ new_values
        state = None
        if output_final_state:
            state = (key * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ new_values
        return out.transpose(1, 2).contiguous().to(dtype), state

    return rule


def _gated_delta(module: str):
    def swaps(config):
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        text = config.get_text_config(decoder=True)
        longest = max(2, int(getattr(text, "max_position_embeddings", 0) or 0))
        factors = max(1, math.ceil(math.log2(longest)))
        rule = _whole_sequence_rule(mod.torch_chunk_gated_delta_rule, mod.l2norm, factors)
        return [(mod, "torch_chunk_gated_delta_rule", rule)]

    return swaps


# model_type -> (what the export note says, config -> the (owner, attribute, replacement) triples to swap in)
REWRITES = {
    **{t: ("its complex-number rotary (torch.polar, view_as_complex: no ONNX form) traced as the same arithmetic "
           "on real (cos, sin) pairs", lambda _config: _llama4()) for t in ("llama4_text", "llama4")},
    **{t: ("its gated delta rule (linear attention) traced as one chunk of the whole sequence: transformers' "
           "chunks of 64 tokens would fix the sequence length", _gated_delta(m))
       for t, m in (("qwen3_5_text", "qwen3_5"), ("qwen3_5", "qwen3_5"), ("qwen3_5_moe_text", "qwen3_5_moe"),
                    ("qwen3_5_moe", "qwen3_5_moe"), ("qwen3_next", "qwen3_next"), ("olmo_hybrid", "olmo_hybrid"),
                    ("lara_mini", "lara_mini"))},
}


def names(model_type: str) -> str | None:
    """What the export note says of the rewrite for `model_type`, if there is one."""
    return REWRITES[model_type][0] if model_type in REWRITES else None


@contextlib.contextmanager
def exportable(config):
    """Swap in the exportable spelling of the code of `config`'s model type for the duration of a trace."""
    swaps = REWRITES[config.model_type][1](config) if config.model_type in REWRITES else []
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in swaps]
    try:
        for owner, attr, new in swaps:
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, old in saved:
            setattr(owner, attr, old)
