"""A KV cache held in place (passes/stateful_cache.py): whether a source's graph can hold it, its capacity
against the model's meta, the sizes its compile is verified at, and the cache Parameters' bytes stripped from
the MindIRs (every loader makes them as zeros)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from graphconv.errors import CacheNotHeld
from graphconv.generation.schema import STEP_INPUTS, Generation, State, cache_dtype
from graphconv.generation.sources import Source
from graphconv.options import CompileOptions

MAX_SEQ_LEN_DEFAULT_CAP = 4096  # --max-seq-len's default: the model's max_position_embeddings, at most this


def capacity(source: Source, max_batch: int, max_seq_len: int | None) -> tuple[int, int]:
    """(max batch, max seq) of a cache held in place, checked against the source: one graph serving prompt
    and decode (the stateful graph is called at past length 0 for the prompt) and a length to hold.
    CacheNotHeld says why not. (The flags' own values are CompileOptions.validate's.)"""
    meta = source.meta
    decode = meta["graphs"]["decode"]
    if source.kind == "genai":
        pass  # one graph for prompt and decode; GroupQueryAttention's decomposition is the pattern the rewrite takes
    elif source.kind in ("transformers", "graph"):  # its decode graph serves the prompt if it takes any length
        length = decode["inputs"]["input_ids"][1]
        if isinstance(length, int):
            raise CacheNotHeld(f"the decode graph takes {length} token(s) a call, so it cannot take the prompt "
                               "(export_for_generation(..., multi_token_decode=True) writes one that can)")
    elif not source.one_graph or not meta["graphs"]["prefill"].get("empty_cache"):
        raise CacheNotHeld("it takes one graph serving prompt and decode: a `graphconv export --task "
                           "text-generation-with-past` folder whose decode graph serves the prompt (generation.json's "
                           "graphs.decode.serves_prompt), or a transformers export_for_generation folder")
    if max_seq_len is None:
        configured = meta.get("max_position_embeddings")
        if not isinstance(configured, int) or configured < 1:
            raise CacheNotHeld("--max-seq-len is required: no max_position_embeddings is known (generation.json, or a "
                               "config.json beside the graph)")
        max_seq_len = min(configured, MAX_SEQ_LEN_DEFAULT_CAP)
    return max_batch, max_seq_len


def bytes_per_position(meta: Generation, precision: str = "fp32") -> int:
    """Bytes of keys and values one row's position takes over all layers (a low --precision stores the cache low)."""
    itemsize = 4 if cache_dtype(meta) == "fp32" and precision == "fp32" else 2
    if meta.get("cache_layers"):  # (layers of their own shapes: [kv heads, key head dim, value head dim] each)
        return sum(heads * (key + value) for heads, key, value in meta["cache_layers"]) * itemsize
    head_dims = int(meta.get("head_dim") or 0) + int(meta.get("value_head_dim") or meta.get("head_dim") or 0)
    return int(meta.get("num_layers") or 0) * int(meta.get("num_kv_heads") or 0) * head_dims * itemsize


@dataclasses.dataclass
class Sizes:
    """The sizes a stateful graph's compile is verified at (dims) and the ranges its dims span (shape ranges)."""

    dims: dict[str, tuple[int, int]]
    ranges: dict[str, tuple[int, int]]


def sizes(meta: Generation, held: tuple[int, int], options: CompileOptions) -> Sizes:
    """Reference cases at past length 0 (the prompt, the one call onnxruntime can run the stateful graph at:
    passes/stateful_cache.py) whose batch and length fit the capacity; the capacity declares the ranges of
    batch and length (the fusions' constraints are checked at their ends). The user's --dim and --shape-range
    win."""
    max_batch, max_seq = held
    inputs = meta["graphs"]["decode"]["inputs"]
    ids = inputs["input_ids"]  # [batch, sequence]
    past = {dims[2] for name, dims in inputs.items()
            if name not in STEP_INPUTS and len(dims) == 4 and isinstance(dims[2], str)}
    found = {ids[0]: (min(2, max_batch), min(3, max_batch)), ids[1]: (min(5, max_seq), min(9, max_seq))}
    # past 0, where the step's inputs still name the past's length (the stateful graph takes no cache)
    named = " ".join(str(d) for n in STEP_INPUTS if n in inputs for d in inputs[n])
    found.update({d: (0, 0) for d in past if re.search(rf"\b{re.escape(d)}\b", named)})
    # the mask's [batch, past + sequence]: a sum, or (transformers' exporter) names of their own
    for mask, same in zip(inputs["attention_mask"], ids):
        if isinstance(mask, str) and mask.isidentifier() and mask not in found:
            found[mask] = found[same]
    spans = {ids[0]: (1, max_batch), ids[1]: (1, max_seq)}
    spans.update({mask: spans[same] for mask, same in zip(inputs["attention_mask"], ids) if same in spans})
    return Sizes({**{k: v for k, v in found.items() if isinstance(k, str)}, **options.dims},
                 {**{k: v for k, v in spans.items() if isinstance(k, str) and k.isidentifier()},
                  **options.shape_ranges})


def held_meta(meta: Generation, held: tuple[int, int]) -> tuple[Generation, str]:
    """generation.json with the state of the one graph serving prompt and decode, and that graph's MindIR
    stem. The prefill's entry keeps its ONNX graph, which `generate --check` runs for the prompt."""
    decode = meta["graphs"]["decode"]
    state: State = {"max_batch": held[0], "max_seq_len": held[1],
                    "inputs": [n for n in STEP_INPUTS if n in decode["inputs"]], "outputs": ["logits"]}
    name = decode.get("mindir", "decode")  # (a builder's: its model file's name)
    graphs = {"prefill": {**meta["graphs"]["prefill"], "mindir": name, "state": state},
              "decode": {**decode, "mindir": name, "state": state}}
    return {**meta, "graphs": graphs}, name


def strip(mindirs: list[Path]) -> dict[str, dict]:
    """The cache Parameters' bytes removed from each MindIR (graphconv/runtime/mindir_state.py); their names,
    shapes and dtypes, which every loader gives zeros for."""
    from graphconv.runtime import mindir_state
    from passes.stateful_cache import CACHE_PREFIX

    params = {}
    for mindir in mindirs:
        params = mindir_state.strip(mindir, CACHE_PREFIX) or params
    return params


def state_bytes(params: dict[str, dict]) -> int:
    """The bytes of the state Parameters (generation.json's state.params) a loader gives zeros for."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}
    return sum(int(np.prod(p["shape"])) * itemsize.get(p["dtype"], 4) for p in params.values())
