"""`generate --check`: onnxruntime on the ONNX graphs follows the tokens MindSpore chose, through the same decode
loop (graphconv/runtime/decoding.decode_loop, with those tokens forced as its choice), and every step's
last-position logits are compared on the rows still generating at that step: max_abs beyond the tolerance, or
an argmax that differs from MindSpore's (unless the two are tied within the tolerance in onnxruntime's
logits), is the failure."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from graphconv.generation.schema import GRAPHS, Generation, cache_dtype, input_specs
from graphconv.progress import Progress
from graphconv.runtime import decoding


@dataclasses.dataclass
class Checked:
    """A batch's check: each step's comparison, the first failure (None: none), MindSpore's logits."""

    steps: list[dict]
    failure: str | None
    ms_logits: list


def oracle_session(path: Path):
    """onnxruntime on the graph as the compile's oracle ran it (graphconv.frontend.load: as given, except
    MatMulNBits at accuracy_level 0, the op's exact semantics; integer products exact, as
    reference.exact_integer_products writes them), and the memory-mapped weights to feed."""
    import onnxruntime as ort

    from graphconv.frontend import load, weights
    from graphconv.verify import reference

    loaded = load.load(path)
    model = loaded.as_given if loaded.as_given is not None else loaded.proto
    bare, refs = weights.stripped(model)
    bare = reference.exact_integer_products(bare)[0]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(bare.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    # (bf16 weights, a --dtype auto export's, as OrtValues: onnxruntime's numpy bridge does not know ml_dtypes)
    return session, {name: reference.ort_feed(a) for name, a in weights.feeds(refs).items()}


def _step(session_and_weights, graph: dict, gen: Generation):
    """One step's call of onnxruntime, as decode_loop calls a step: (ids, mask, positions, cache) ->
    (logits, cache), its own cache fed back by name."""
    session, weight_feeds = session_and_weights
    by_name = {sp["name"]: sp for sp in input_specs(graph["inputs"], cache_dtype(gen))}
    specs = [by_name[i.name] for i in session.get_inputs() if i.name in by_name]
    names = [o.name for o in session.get_outputs()]

    def call(ids, mask, positions, cache=None):
        feed = decoding.step_feed(specs, ids, mask, positions, cache, bool(graph.get("empty_cache")))
        out = session.run(None, {**{sp["name"]: v for sp, v in zip(specs, feed)}, **weight_feeds})
        return decoding.split_outputs(names, out, gen.get("cache_feeds"))

    return call


def replay(onnx_pair: tuple[Path, Path], gen: Generation, ids, mask, tokens) -> list[np.ndarray]:
    """onnxruntime's last-position logits at every step, the prompt then the tokens MindSpore chose (`tokens`
    [batch, steps], forced as decode_loop's choice, so onnxruntime's cache follows the same feed)."""
    sessions = {p: oracle_session(p) for p in set(onnx_pair)}
    prefill, decode = (_step(sessions[onnx_pair[k]], gen["graphs"][g], gen) for k, g in enumerate(GRAPHS))
    forced = iter(tokens.T)
    seen: list[np.ndarray] = []
    decoding.decode_loop(prefill, decode, lambda logits: logits[:, -1], ids, mask, tokens.shape[1],
                         decoding.eos_ids(gen), decoding.pad_id(gen), on_step=lambda step, last: seen.append(last),
                         choose=lambda last: next(forced))
    return seen


def compare(step: int, ref: np.ndarray, got: np.ndarray, rows: np.ndarray, atol: float) -> tuple[dict, str | None]:
    """One step's comparison on `rows` (those still generating): its entry and why it fails (None: it does
    not)."""
    diff = np.abs(ref[rows].astype(np.float64) - got[rows])
    max_abs = float(diff.max()) if diff.size and np.isfinite(diff).all() else float("inf") if diff.size else 0.0
    ort_tokens = ref[rows].argmax(-1)
    chosen = got[rows].argmax(-1)  # (what greedy decoding chose; a sampled token may be another)
    match = bool((ort_tokens == chosen).all())
    entry = {"step": step, "max_abs": max_abs, "argmax_match": match}
    if not max_abs <= atol:
        return entry, (f"--check: step {step} ({'prefill' if step == 0 else 'decode'}): logits differ from "
                       f"onnxruntime by max_abs {max_abs:.3g} > {atol:g}")
    for r, o, c in zip(rows, ort_tokens, chosen):
        gap = float(ref[r, o] - ref[r, c])
        if o != c and gap > atol:  # not a tie within the tolerance
            return entry, (f"--check: step {step}, prompt {r + 1}: MindSpore's highest logit is token {c}, "
                           f"onnxruntime's {o} (its logits {gap:.3g} apart)")
    return entry, None


def check(onnx_pair: tuple[Path, Path], gen: Generation, ids, mask, tokens, ms_logits: list, atol: float,
          progress: Progress) -> Checked:
    """MindSpore's steps of one batch (its tokens and each step's last-position logits) against onnxruntime
    following the same tokens."""
    progress.info(f"check: onnxruntime on {onnx_pair[0].name} + {onnx_pair[1].name}")
    t0 = time.perf_counter()
    reference = replay(onnx_pair, gen, ids, mask, tokens)
    steps, failure = [], None
    running = np.ones(ids.shape[0], bool)
    eos = decoding.eos_ids(gen)
    for k, (ref, got) in enumerate(zip(reference, ms_logits)):
        entry, why = compare(k, ref, got, np.flatnonzero(running), atol)
        steps.append(entry)
        failure = failure or why
        running &= ~np.isin(tokens[:, k], eos)
    progress.info(f"check: {len(steps)} steps in {time.perf_counter() - t0:.1f}s, max_abs "
                  f"{max((s['max_abs'] for s in steps), default=0):.3g}")
    return Checked(steps, failure, ms_logits)
