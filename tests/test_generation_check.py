"""generate --check's comparison (graphconv/generation/check.py) without MindSpore: a perturbed logit or a
different argmax fails, a tie within the tolerance does not, and the decode loop forced to MindSpore's tokens
feeds the oracle exactly those tokens."""

from __future__ import annotations

import numpy as np

from graphconv.generation import check
from graphconv.runtime import decoding


def test_a_perturbed_logit_fails_and_a_tie_within_the_tolerance_passes():
    ref = np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 1.0]], np.float32)
    rows = np.arange(2)
    entry, why = check.compare(0, ref, ref.copy(), rows, 1e-4)
    assert why is None and entry == {"step": 0, "max_abs": 0.0, "argmax_match": True}
    perturbed = ref.copy()
    perturbed[1, 2] += 1e-3
    entry, why = check.compare(3, ref, perturbed, rows, 1e-4)
    assert "step 3 (decode): logits differ from onnxruntime by max_abs 0.001" in why
    tied = np.array([[0.0, 1.0, 1.0 - 1e-6]], np.float32)  # MindSpore's argmax 2, onnxruntime's 1: a tie
    got = np.array([[0.0, 1.0 - 1e-6, 1.0]], np.float32)
    entry, why = check.compare(1, tied, got, np.arange(1), 1e-4)
    assert why is None and entry["argmax_match"] is False
    entry, why = check.compare(1, tied, got, np.arange(1), 0.0)
    assert why is not None and "max_abs" in why
    # rows that finished are not compared
    assert check.compare(2, ref, perturbed, np.array([0]), 1e-4)[1] is None


def test_the_loop_forced_to_the_chosen_tokens_feeds_them_back():
    """decode_loop with `choose` returning the tokens MindSpore chose: the decode calls get those tokens
    whatever the oracle's logits say, and the loop stops where MindSpore's did (every row at an eos)."""
    tokens = np.array([[4, 7, 2], [5, 2, 0]], np.int64)  # eos 2, pad 0
    fed = []

    def prefill(ids, mask, positions):
        return np.zeros((2, ids.shape[1], 9)), {"step": 0}

    def decode(ids, mask, positions, cache):
        fed.append(ids[:, 0].tolist())
        return np.zeros((2, 1, 9)), cache

    forced = iter(tokens.T)
    seen = []
    got = decoding.decode_loop(prefill, decode, lambda logits: logits[:, -1], np.ones((2, 3), np.int64),
                               np.ones((2, 3), np.int64), 8, [2], 0, on_step=lambda k, last: seen.append(k),
                               choose=lambda last: next(forced))
    np.testing.assert_array_equal(got, tokens)
    assert fed == [[4, 5], [7, 2]] and seen == [0, 1, 2]
