"""graphconv.frontend.export_rewrites: the real-valued spellings traced in place of code dynamo cannot export
equal transformers' own code (Llama 4's complex-number rotary), and are swapped back after the trace."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graphconv.frontend import export_rewrites  # noqa: E402


def test_llama4_rotary_as_pairs_equals_the_complex_product():
    from transformers import Llama4TextConfig
    from transformers.models.llama4 import modeling_llama4 as m

    config = Llama4TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})
    rotary = m.Llama4TextRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 9, 4, 16, generator=g), torch.randn(2, 9, 2, 16, generator=g)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 4, 5, 6]])  # (a left-padded row)
    want = m.apply_rotary_emb(q, k, rotary(q, positions))
    original = (m.Llama4TextRotaryEmbedding.forward, m.apply_rotary_emb)
    with export_rewrites.exportable("llama4_text"):
        assert m.apply_rotary_emb is not original[1]
        freqs = rotary(q, positions)
        assert not freqs.is_complex() and freqs.shape == (2, 9, 8, 2)
        got = m.apply_rotary_emb(q, k, freqs)
    assert (m.Llama4TextRotaryEmbedding.forward, m.apply_rotary_emb) == original
    for a, b in zip(got, want):
        assert not b.is_complex() and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_other_types_trace_unchanged():
    assert export_rewrites.names("llama") is None
    with export_rewrites.exportable("llama"):
        pass
