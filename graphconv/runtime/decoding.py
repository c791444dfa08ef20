"""The decoding loop over a prefill + decode pair (greedy, or sampling as transformers samples), written once for
`graphconv generate` (graphconv/runtime/generate_task.generate, in the MindSpore child), for its --check's
onnxruntime run (graphconv/generation/check.py, the chosen tokens forced) and for the pair bundle's
generate_mindspore.py (graphconv/deploy/pair.py copies this module's source into the script, so the bundle needs
numpy and MindSpore only).

Imports nothing but numpy: the two graphs come in as callables, so the loop does not know MindSpore.
"""

import numpy as np


def eos_ids(generation):
    """generation.json's eos_token_id (one id, a list, or none) as a list."""
    eos = generation.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def pad_id(generation):
    """The id padding and finished rows get: pad_token_id, else the first eos, else 0; an id outside the
    vocabulary is passed over (a config's default eos 50256 with a small vocabulary: the embedding lookup of the
    padding would fail, and the mask hides the padding's embedding anyway)."""
    vocab = generation.get("vocab_size")
    pad = generation.get("pad_token_id")
    for candidate in ([] if pad is None else [int(pad)]) + eos_ids(generation):
        if 0 <= candidate and (vocab is None or candidate < int(vocab)):
            return candidate
    return 0


def left_pad(prompts, pad):
    """(input_ids, attention_mask) [batch, longest] int64, each prompt right-aligned."""
    length = max(len(p) for p in prompts)
    ids = np.full((len(prompts), length), pad, np.int64)
    mask = np.zeros((len(prompts), length), np.int64)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = p
        mask[r, length - len(p):] = 1
    return ids, mask


def sequences(tokens, eos):
    """Per row the new ids up to and including the first eos, and why it ended ("eos" or "length")."""
    rows, reasons = [], []
    for row in tokens.tolist():
        stop = next((k for k, t in enumerate(row) if t in eos), None)
        rows.append(row if stop is None else row[:stop + 1])
        reasons.append("length" if stop is None else "eos")
    return rows, reasons


def positions(mask):
    """position_ids as transformers' generate computes them: cumsum(mask) - 1, padded positions 0."""
    return (np.cumsum(mask, -1) - 1) * (mask != 0)


def step_feed(specs, ids, mask, positions, cache, empty_cache):
    """One graph's inputs in its order, by name: input_ids, attention_mask, position_ids (when the graph
    takes them) and past_key_values.* from `cache` (the previous step's presents, by past name). With no
    cache (a prompt) and `empty_cache`, the past inputs are empty: [batch, heads, 0, head_dim] zeros of
    `specs`' numpy dtype (one graph serving prompt and decode, like onnxruntime-genai's). Framework tensors
    in `cache` pass through; the rest are numpy arrays."""
    feed = []
    for spec in specs:
        name = spec["name"]
        if name == "input_ids":
            feed.append(ids)
        elif name == "attention_mask":
            feed.append(mask)
        elif name == "position_ids":
            feed.append(positions)
        elif cache is not None:
            feed.append(cache[name])
        elif empty_cache:
            shape = [ids.shape[0]] + [d if isinstance(d, int) else 0 for d in spec["shape"][1:]]
            feed.append(np.zeros(shape, spec.get("np_dtype", "float32")))
        else:
            raise ValueError(f"the prompt graph takes {name!r}, which a prompt does not give")
    return feed


def split_outputs(names, outputs, feeds=None):
    """(logits, cache) of one step's outputs: the cache maps each cache output to the input name the next step
    takes it as: `feeds` {output: input} where generation.json gives cache_feeds, else present.* ->
    past_key_values.*."""
    if feeds:
        cache = {feeds[n]: v for n, v in zip(names, outputs) if n in feeds}
    else:
        cache = {"past_key_values." + n[len("present."):]: v for n, v in zip(names, outputs)
                 if n.startswith("present.")}
    return outputs[list(names).index("logits")], cache


def argmax(logits):
    """Greedy decoding's choice: the highest logit of each row (the first on a tie, as torch's argmax)."""
    return logits.argmax(-1)


# transformers' GenerationConfig defaults for what sampling reads (GenerationConfig._get_default_generation_params)
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def sampling_settings(config):
    """temperature, top_k and top_p where a generation config sets them (transformers' generation_config.json,
    onnxruntime-genai's genai_config.json `search`): what sampling uses unless told otherwise."""
    return {k: config[k] for k in SAMPLING_DEFAULTS if isinstance(config, dict) and config.get(k) is not None}


def sampling_probs(logits, temperature=1.0, top_k=50, top_p=1.0):
    """The distribution transformers' generate(do_sample=True) draws from: its warpers in its order
    (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper; top_k 0 and top_p 1 are off), computed in
    float32 as there, then the softmax of what is left. [batch, vocab] -> [batch, vocab] float64."""
    scores = logits.astype(np.float32) / np.float32(temperature)
    if top_k:
        kth = np.sort(scores, axis=-1)[:, -min(top_k, scores.shape[-1])][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending, as the warper sorts
        cumulative = np.cumsum(softmax(np.take_along_axis(scores, order, -1)), axis=-1)
        drop = cumulative <= np.float32(1 - top_p)
        drop[:, -1] = False  # min_tokens_to_keep = 1
        removed = np.zeros_like(drop)
        np.put_along_axis(removed, order, drop, -1)
        scores = np.where(removed, -np.inf, scores)
    probs = softmax(scores).astype(np.float64)
    return probs / probs.sum(-1, keepdims=True)


def sampler(temperature=1.0, top_k=50, top_p=1.0, seed=None):
    """A choice drawing one token per row from sampling_probs. The draws come from numpy's generator seeded
    with `seed` (an int or a list of ints), not torch's: transformers' distribution, not its draws."""
    rng = np.random.default_rng(seed)

    def choose(logits):
        return np.array([rng.choice(p.size, p=p) for p in sampling_probs(logits, temperature, top_k, top_p)],
                        np.int64)

    return choose


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def decode_loop(prefill, decode, logits_of, ids, mask, max_new_tokens, eos, pad, on_step=None, choose=argmax):
    """prefill(ids, mask, position_ids) and decode(ids, mask, position_ids, cache) each return
    (logits, cache) in the framework's tensors, `cache` passed back as it came (never copied to the host);
    `logits_of(logits)` gives the last position's logits as numpy [batch, vocab]; `choose(logits)` the next
    token of each row (argmax, a sampler, or generate --check's tokens MindSpore chose, forced on the oracle).
    A row that produced one of the `eos` ids is fed `pad` from then on, and its mask keeps growing.
    `on_step(step, logits)` sees every step's logits (step 0 the prefill's).
    Returns the chosen tokens [batch, steps]."""
    finished = np.zeros(ids.shape[0], bool)
    tokens = []
    logits, cache = prefill(ids, mask, positions(mask))
    for step in range(max_new_tokens):
        if step > 0:
            mask = np.concatenate([mask, np.ones((mask.shape[0], 1), mask.dtype)], axis=1)
            logits, cache = decode(tokens[-1][:, None], mask, positions(mask)[:, -1:], cache)
        last = logits_of(logits)
        if on_step is not None:
            on_step(step, last)
        chosen = np.where(finished, pad, choose(last)).astype(np.int64)
        tokens.append(chosen)
        finished |= np.isin(chosen, eos)
        if finished.all():
            break
    return np.stack(tokens, axis=1)
