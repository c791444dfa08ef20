"""Sampling as transformers samples (graphconv/runtime/decoding.sampling_probs, sampler): the distribution equals
what transformers' own warpers leave (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in the order
its generate applies them) followed by its softmax; the draws follow that distribution and repeat with a seed;
the checkpoint's generation_config gives the defaults."""

import json

import numpy as np
import pytest

from graphconv.errors import InputError
from graphconv.generation.run import sampling_options
from graphconv.runtime import decoding

torch = pytest.importorskip("torch")
warpers = pytest.importorskip("transformers.generation.logits_process")


def _transformers_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """What transformers' generate(do_sample=True) draws from: its warpers as its _get_logits_processor
    lists them, then softmax (GenerationMixin._sample)."""
    chain = []
    if temperature != 1.0:
        chain.append(warpers.TemperatureLogitsWarper(temperature))
    if top_k:
        chain.append(warpers.TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        chain.append(warpers.TopPLogitsWarper(top_p=top_p))
    scores = torch.from_numpy(logits)
    for w in chain:
        scores = w(None, scores)
    return torch.softmax(scores, -1).double().numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 50, 1.0),  # transformers' defaults
    (0.7, 0, 0.9),   # top-p alone
    (1.3, 20, 0.8),  # all three
    (0.5, 1, 1.0),   # top_k 1: greedy
    (1.0, 0, 1.0),   # nothing filtered
    (2.0, 5000, 0.5),  # top_k beyond the vocabulary
])
def test_the_distribution_is_transformers(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 1000)) * 3).astype(np.float32)
    ours = decoding.sampling_probs(logits, temperature, top_k, top_p)
    theirs = _transformers_probs(logits, temperature, top_k, top_p)
    assert ((ours > 0) == (theirs > 0)).all()  # the same tokens kept
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-9)
    kept = (ours > 0).sum(-1)
    if top_k == 1:
        assert (kept == 1).all() and (ours.argmax(-1) == logits.argmax(-1)).all()
    elif top_k and top_p == 1.0:
        assert (kept == min(top_k, 1000)).all()


def test_ties_at_the_kth_logit_are_kept_as_transformers_keeps_them():
    logits = np.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], np.float32)
    ours = decoding.sampling_probs(logits, 1.0, 2, 1.0)
    np.testing.assert_allclose(ours, _transformers_probs(logits, 1.0, 2, 1.0), rtol=1e-6)
    assert (ours > 0).sum() == 4  # the top 2 and every logit equal to the 2nd


def test_draws_follow_the_distribution_and_repeat_with_a_seed():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    draws = np.concatenate([decoding.sampler(1.0, 0, 1.0, seed=[3, k])(np.repeat(logits, 500, 0)) for k in range(8)])
    freq = np.bincount(draws, minlength=4) / draws.size
    # 4,000 draws: each frequency within 4 standard errors of its probability
    p = np.array([0.5, 0.3, 0.15, 0.05])
    assert (np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / draws.size)).all(), freq
    again = decoding.sampler(1.0, 0, 1.0, seed=[3, 0])(np.repeat(logits, 500, 0))
    assert (again == draws[:500]).all()
    other = decoding.sampler(1.0, 0, 1.0, seed=[4, 0])(np.repeat(logits, 500, 0))
    assert (other != draws[:500]).any()


def test_the_checkpoints_settings_are_the_defaults_and_flags_win():
    gen = {"sampling": {"temperature": 0.6, "top_p": 0.9}}
    assert sampling_options(gen, seed=1) == {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "seed": 1}
    assert sampling_options(gen, temperature=1.5, top_k=0, seed=2) == {"temperature": 1.5, "top_k": 0,
                                                                        "top_p": 0.9, "seed": 2}
    assert sampling_options({}, seed=0) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "seed": 0}
    drawn = sampling_options({})["seed"]
    assert isinstance(drawn, int) and 0 <= drawn < 2**32


@pytest.mark.parametrize("given, says", [
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"temperature": -1.0}, "temperature must be > 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"seed": -3}, "seed must be an integer >= 0"),
])
def test_values_transformers_refuses_are_refused(given, says):
    with pytest.raises(InputError, match=says.replace("(", r"\(").replace("]", r"\]")):
        sampling_options({}, **given)


def test_the_export_records_the_checkpoints_sampling_settings(tmp_path):
    from types import SimpleNamespace

    from graphconv.frontend.hf_export import _generation_config

    config = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    assert _generation_config(tmp_path, config) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]}))
    assert _generation_config(tmp_path, config) == {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": None,
                                                    "sampling": {"temperature": 0.6, "top_p": 0.9}}
