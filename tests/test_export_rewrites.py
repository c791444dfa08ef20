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
    with export_rewrites.exportable(config):
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
    from transformers import LlamaConfig

    with export_rewrites.exportable(LlamaConfig()):
        pass


@pytest.mark.parametrize("seq", [7, 130])  # one of transformers' 64-token chunks, and three (padded)
def test_gated_delta_rule_as_one_chunk_equals_the_chunked_rule(seq):
    """Qwen 3.5's Gated DeltaNet rule without a carried state: transformers' chunked loop (its solve_triangular
    path, run eagerly) against the whole-sequence rewrite, with GQA-like value heads and l2-normalised q/k; the
    final state too."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    config = Qwen3_5TextConfig(max_position_embeddings=256)
    g = torch.Generator().manual_seed(seq)
    q, k = torch.randn(2, seq, 2, 16, generator=g), torch.randn(2, seq, 2, 16, generator=g)
    v = torch.randn(2, seq, 4, 8, generator=g)
    beta = torch.rand(2, seq, 4, generator=g)
    decay = -torch.rand(2, seq, 4, generator=g) * 0.5
    args = dict(g=decay, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want = m.torch_chunk_gated_delta_rule(q, k, v, **args)
    with export_rewrites.exportable(config):
        got = m.torch_chunk_gated_delta_rule(q, k, v, **args)
        carried = m.torch_chunk_gated_delta_rule(q, k, v, **args, initial_state=want[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # with a carried state, transformers' own code runs
        torch.testing.assert_close(carried[0], m.torch_chunk_gated_delta_rule(q, k, v, **args,
                                                                               initial_state=want[1])[0])


def test_qwen3_5_exports_compiles_and_verifies_past_one_chunk(tmp_path):
    """Qwen 3.5 (issue 35): before, dynamo fixed its sequence length (transformers' 64-token chunk loop). The
    export traces the one-chunk rule; onnxruntime on it matches transformers at 70 tokens (two of
    transformers' chunks, beyond the export's own check at 7 and 9), and the compile verifies."""
    import numpy as np
    import onnxruntime as ort
    import transformers
    from click.testing import CliRunner

    import graphconv
    from graphconv.cli import cli

    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=300, max_position_embeddings=256, layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "exp"), "--task",
                                      "text-generation", "-q"])
    assert result.exit_code == 0, result.output
    onnx_path = tmp_path / "exp" / "model.onnx"
    ids = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits.numpy()
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (got,) = sess.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    report = graphconv.compile(onnx_path, tmp_path / "m.mindir")
    assert report.status == "verified", report.error
    assert report.census.get("FlashAttentionScore") == 1  # the full-attention layer
