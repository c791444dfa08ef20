"""Compile a generation model: `graphconv compile EXPORT_DIR -o GEN_DIR` on the folder `graphconv export
--task text-generation-with-past` wrote (prefill.onnx, decode.onnx, generation.json), on an onnxruntime-genai
model builder folder (model.onnx + genai_config.json: one graph serving the prompt, with an empty cache, and
each decode step; `genai_generation` translates its config into generation.json, and GEN_DIR then holds
model.mindir + model.cpu.mindir, which generation.json names for both steps), or on a folder transformers' own
exporter wrote (prefill.onnx, decode.onnx, export.json: `transformers_generation`).

One graph serves both steps where it can: a builder's graph, and an export's decode.onnx where the export
checked it at an empty cache against PyTorch's prompt (generation.json's graphs.decode.serves_prompt); it is
verified at an empty cache and at a cached step, and generation.json names it for both (the prompt with
`empty_cache`). Otherwise (an export written before that check, or whose check failed) both graphs compile.

GEN_DIR (new; written beside it under a private name and renamed at the end, so a failure leaves nothing):
    decode.mindir [, prefill.mindir]       the --target's MindIRs (ascend: the fused primitives)
    decode.cpu.mindir [, prefill.cpu...]   cpu-target MindIRs, each verified on MindSpore CPU itself: what
                                           `graphconv generate` runs on a host without Ascend (for --target
                                           cpu, the same files as the target's, hard-linked)
    generation.json                        the export's, with `source_dir` (the export folder: the ONNX pair)
With --bundle DIR (new), the deploy bundle (graphconv/deploy/pair.py): each graph's bundle and a greedy
generation script for an Ascend host.
    report.json                            the contract fields, plus `graphs: {prefill, decode}` with each
                                           compile's report (and `cpu_twins` for the cpu ones)
Each graph is compiled and verified by the one pipeline (graphconv/pipeline.py) with the options given.

By default (`stateful_cache` None; True: or an error), the one graph is first rewritten with its KV cache held in
place (passes/stateful_cache.py, applied by the compile's load stage; a builder's GroupQueryAttention in its
decomposition): the MindIRs take ids, mask and positions and give the logits, generation.json's
graphs.<step>.state gives the capacity, and the cached steps are verified by generating against onnxruntime on
the ONNX pair (report.json's `cache`).

Weights: each MindIR holds its own copy. A MindIR cannot reference another file's Parameters (mindspore.load
reads a graph's weights from the file itself or its own `_variables/` folder), so two graphs store the
weights twice; report.json's `weights` says how many bytes each file holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from graphconv import interrupts
from graphconv.errors import CacheNotHeld, DiskFullError, InputError, UnsupportedError, VerificationError
from graphconv.frontend import tokenizer
from graphconv.frontend.contained import inside
from graphconv.frontend.load import FLOAT_TYPE_NAMES, read_json, value_dims
from graphconv.generation import cache_dtype, mindir_bytes
from graphconv.progress import SILENT, Progress
from graphconv.runtime import decoding, msrun
from graphconv.workspace import partial_dir, release

GRAPHS = ("prefill", "decode")
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")  # what a stateful graph takes
MAX_SEQ_LEN_DEFAULT_CAP = 4096  # --max-seq-len's default: the model's max_position_embeddings, at most this


_GENAI_CONFIG = "genai_config.json"


_EXPORT_MANIFEST = "export.json"  # transformers.exporters' save_pretrained


def is_pair_dir(path: Path) -> bool:
    """A folder `graphconv compile` turns into a generation directory: an export pair, a builder folder, or a
    folder transformers' exporter wrote (`export_for_generation`)."""
    return path.is_dir() and any((path / f).is_file() for f in ("generation.json", _GENAI_CONFIG, _EXPORT_MANIFEST))


def is_generation_source(path: Path, options) -> bool:
    """Whether `graphconv compile` builds a generation folder from `path`: a folder is_pair_dir takes, or a
    with-past graph given with --stateful-cache."""
    return is_pair_dir(path) or bool(options.generation.stateful_cache and path.is_file())


def compile_pair(source: str | Path, options, progress: Progress | None = None) -> dict:
    """Compile the generation source `source` into the new folder `options.output` (CompileOptions, validated)."""
    import dataclasses

    source = Path(source)
    if options.output is None:
        raise InputError(f"{source} is a generation source: -o GEN_DIR (a new folder) is required")
    if options.tp is not None and options.generation.stateful_cache and source.is_file():
        raise InputError("--tp takes a plain .onnx graph or a generation folder in this version (not a "
                         "with-past .onnx graph with --stateful-cache)")
    gen = options.generation
    graph_options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                     if f.name not in ("output", "inputs", "report_path", "generation", "tp", "cache_capacity")}
    return _compile_pair(source, options.output, progress=progress, inputs=options.inputs,
                         report_path=options.report_path, stateful_cache=gen.stateful_cache,
                         max_batch=gen.max_batch, max_seq_len=gen.max_seq_len, cpu_twin=gen.cpu_twin,
                         tp=options.tp, **graph_options)


def split_inputs(inputs: tuple, graphs: tuple[str, ...] = GRAPHS) -> dict[str, tuple[Path, ...]]:
    """`--inputs prefill=F.npz --inputs decode=G.npz` -> per graph (one graph: plain paths too)."""
    per: dict[str, list[Path]] = {g: [] for g in graphs}
    for item in inputs:
        graph, sep, path = str(item).partition("=")
        if len(graphs) == 1 and sep and graph in GRAPHS and graph not in graphs:
            raise InputError(f"--inputs {item}: one graph ({graphs[0]}) serves the prompt and the decode steps here; "
                             f"give {graphs[0]}=FILE.npz")
        if len(graphs) == 1 and (not sep or graph not in graphs):
            per[graphs[0]].append(Path(item))
            continue
        if not sep or graph not in graphs:
            raise InputError(f"--inputs {item}: for a generation pair, name the graph: prefill=FILE.npz or "
                             "decode=FILE.npz")
        per[graph].append(Path(path))
    return {g: tuple(p) for g, p in per.items()}


def _pair_sources(export_dir: Path) -> tuple[dict, dict[str, Path]]:
    """generation.json and the graphs to compile. Where the export checked that the decode graph at an empty
    cache computes the prompt (graphs.decode.serves_prompt), that one graph serves both steps, as
    onnxruntime-genai's does: the weights are stored once per target, and `generate` loads them once."""
    meta = read_json(export_dir / "generation.json")
    if meta.get("task") != "text-generation-with-past":
        raise InputError(f"{export_dir}: task {meta.get('task')!r} is not text-generation-with-past (compile its "
                         "model.onnx instead)")
    decode = (meta.get("graphs") or {}).get("decode") or {}
    graphs = ("decode",) if decode.get("serves_prompt") else GRAPHS
    _tokenizer_dir(export_dir, meta)  # (refused now, not after the compile)
    missing = [g for g in graphs if not (export_dir / f"{g}.onnx").is_file()]
    if missing:
        raise InputError(f"{export_dir}: {', '.join(g + '.onnx' for g in missing)} missing")
    if graphs == ("decode",):
        step = {**decode, "mindir": "decode"}
        meta = {**meta, "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step}}
    return meta, {g: export_dir / f"{g}.onnx" for g in graphs}


def _tokenizer_dir(export_dir: Path, meta: dict) -> Path:
    """The folder of the tokenizer files the compile copies: generation.json's `tokenizer`, inside the export
    folder; without one, the folder itself (a builder's tokenizer files are at its top)."""
    if meta.get("tokenizer") is None:
        return export_dir
    return inside(export_dir, meta["tokenizer"], export_dir / "generation.json", "tokenizer", directory=True)


def _prompt_dims(meta: dict, sources: dict, options: dict) -> dict:
    """One graph serving both steps is verified at an empty cache (a prompt) and at a cached step: its past dim
    at sizes 0 and 5, unless --dim sets it."""
    step = meta["graphs"]["prefill"]
    if tuple(sources) == GRAPHS or not step.get("empty_cache"):
        return options
    past = {dims[2] for name, dims in step["inputs"].items()  # [batch, kv heads, past, head dim]
            if name.startswith("past_key_values.") and len(dims) == 4 and isinstance(dims[2], str)}
    given = dict(options.get("dims") or {})
    return {**options, "dims": {**{d: (0, 5) for d in past}, **given}}


def genai_generation(folder: Path) -> tuple[dict, dict[str, Path]]:
    """generation.json for an onnxruntime-genai model builder folder, and its one graph. The builder's graph
    takes input_ids, attention_mask and past_key_values.N.key/value (position ids computed inside, from the
    mask's lengths) and returns logits and present.N.key/value; its cache head dim is symbolic
    (`kv_cache_dim`) and is written here as the head size."""
    import onnx

    config = read_json(folder / _GENAI_CONFIG)
    model = config.get("model") or {}
    decoder = model.get("decoder") if isinstance(model, dict) else None
    where = folder / _GENAI_CONFIG
    if not isinstance(decoder, dict) or not decoder.get("filename"):
        raise InputError(f"{where}: model.decoder.filename is missing")
    path = inside(folder, decoder["filename"], where, "model.decoder.filename")
    names = {**(decoder.get("inputs") or {}), **(decoder.get("outputs") or {})}
    expected = {"input_ids": "input_ids", "attention_mask": "attention_mask", "logits": "logits",
                "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
                "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    odd = sorted(k for k, v in expected.items() if k in names and names[k] != v)
    if odd:
        raise InputError(f"{where}: decoder {odd[0]} is {names[odd[0]]!r}; graphconv generate takes the "
                         f"builder's default names ({expected[odd[0]]!r})")
    if not path.is_file():
        raise InputError(f"{folder}: {decoder['filename']} (model.decoder.filename) missing")
    graph = onnx.load(str(path), load_external_data=False).graph
    head = decoder.get("head_size")
    if not isinstance(head, int) or head < 1:
        raise InputError(f"{where}: model.decoder.head_size must be a positive integer")

    def dims(vi):
        cache = vi.name.startswith(("past_key_values.", "present."))
        return [head if cache and k == 3 and isinstance(d, str) else d for k, d in enumerate(value_dims(vi))]

    inputs = {vi.name: dims(vi) for vi in graph.input}
    outputs = {vi.name: dims(vi) for vi in graph.output}
    past = [vi for vi in graph.input if vi.name.startswith("past_key_values.")]
    dtype = FLOAT_TYPE_NAMES.get(past[0].type.tensor_type.elem_type if past else onnx.TensorProto.FLOAT)
    if dtype is None:
        raise InputError(f"{path}: cache dtype {past[0].type.tensor_type.elem_type} is not fp32, fp16 or bf16")
    step = {"file": decoder["filename"], "mindir": Path(decoder["filename"]).stem, "inputs": inputs,
            "outputs": outputs}
    meta = {
        "model_type": model.get("type"), "task": "text-generation-with-past",
        "source": "onnxruntime-genai model builder (genai_config.json)",
        "bos_token_id": model.get("bos_token_id"), "eos_token_id": model.get("eos_token_id"),
        "pad_token_id": model.get("pad_token_id"), "num_layers": decoder.get("num_hidden_layers"),
        "sampling": decoding.sampling_settings(config.get("search")),
        "num_kv_heads": decoder.get("num_key_value_heads"), "head_dim": head,
        "vocab_size": model.get("vocab_size"), "hidden_size": decoder.get("hidden_size"),
        "max_position_embeddings": model.get("context_length"), "dtype": dtype,
        "cache_dtype": dtype,
        "cache_layout": "BNSD: [batch, kv_heads, seq, head_dim]",
        "cache_names": {"past": "past_key_values.{i}.key|value", "present": "present.{i}.key|value"},
        # GroupQueryAttention reads the mask as lengths (right padding): prompts of one length run together
        "prompt_padding": "none",
        "position_ids": ("position_ids = cumsum(attention_mask, -1) - 1" if "position_ids" in inputs else
                         "computed inside the graph from the attention mask's lengths"),
        "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step},
    }
    return meta, {step["mindir"]: path}


def _step_io(path: Path, graph) -> tuple[dict, dict]:
    """A generation step graph's inputs (initializers left out) and outputs with their dims; InputError unless
    it takes input_ids and attention_mask and gives logits."""
    inits = {t.name for t in graph.initializer}
    inputs = {vi.name: value_dims(vi) for vi in graph.input if vi.name not in inits}
    outputs = {vi.name: value_dims(vi) for vi in graph.output}
    if not {"input_ids", "attention_mask"} <= set(inputs) or "logits" not in outputs:
        raise InputError(f"{path}: takes {sorted(inputs)[:6]} and gives {sorted(outputs)[:3]}…; expected "
                         "input_ids, attention_mask (position_ids) and a cache -> logits and the cache")
    return inputs, outputs


def _checkpoint_config(folder: Path) -> tuple[dict, dict, dict, object]:
    """A checkpoint's config.json (its text config) and generation_config.json in `folder`, each {} where
    absent, and token(key): generation_config's value, else the text config's, else the config's."""
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    generation_config = read_json(folder / "generation_config.json") \
        if (folder / "generation_config.json").is_file() else {}
    text = config.get("text_config") or config
    return config, text, generation_config, lambda key: generation_config.get(key, text.get(key, config.get(key)))


def decode_graph_generation(path: Path) -> tuple[dict, dict[str, Path]]:
    """generation.json for one with-past ONNX graph exported by other means (torch.onnx.export of a wrapper
    taking the cache as tensors, say), and the graph: it takes input_ids, attention_mask (position_ids) and
    its cache inputs, found by the pattern whatever their names (passes/stateful_cache.past_present_pairs), and
    gives logits and the grown caches. Token ids and max_position_embeddings come from a checkpoint's
    config.json and generation_config.json beside the file, where there are."""
    import onnx

    from passes.stateful_cache import past_present_pairs

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inputs, outputs = _step_io(path, graph)
    pairs = past_present_pairs(model)
    if not pairs:
        raise InputError(f"{path}: no cache input (a rank-4 input that a Concat along axis 2 extends, the result "
                         "returned by the graph)")
    first = next(vi for vi in graph.input if vi.name == next(iter(pairs)))
    dtype = FLOAT_TYPE_NAMES.get(first.type.tensor_type.elem_type)
    heads, head_dim = inputs[first.name][1], inputs[first.name][3]
    vocab = outputs["logits"][-1]
    if dtype is None or not isinstance(heads, int) or not isinstance(head_dim, int) or not isinstance(vocab, int):
        raise InputError(f"{path}: cache {first.name} {inputs[first.name]} of {dtype or 'a non-float dtype'} and logits "
                         f"{outputs['logits']}: expected fp32/fp16/bf16 [batch, kv heads, past, head dim] and "
                         "[batch, seq, vocab] with static heads, head dim and vocab")
    config, text, generation_config, token = _checkpoint_config(path.parent)
    step = {"file": path.name, "mindir": "decode", "inputs": inputs, "outputs": outputs}
    meta = {
        "model_type": config.get("model_type"), "task": "text-generation-with-past",
        "source": f"a with-past ONNX graph ({path.name})" + (" beside a checkpoint's config.json" if config else ""),
        "bos_token_id": token("bos_token_id"), "eos_token_id": token("eos_token_id"),
        "pad_token_id": token("pad_token_id"), "sampling": decoding.sampling_settings(generation_config),
        "num_layers": len(pairs) // 2, "num_kv_heads": heads, "head_dim": head_dim, "vocab_size": vocab,
        "hidden_size": text.get("hidden_size"), "max_position_embeddings": text.get("max_position_embeddings"),
        "dtype": dtype, "cache_dtype": dtype, "cache_layout": "BNSD: [batch, kv_heads, seq, head_dim]",
        "cache_feeds": {present: past for past, present in pairs.items()},
        "position_ids": "position_ids = cumsum(attention_mask, -1) - 1, padded positions 0",
        "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step},
    }
    return meta, {"decode": path}


def transformers_generation(folder: Path) -> tuple[dict, dict[str, Path], dict[str, dict]]:
    """generation.json for a folder transformers' exporter wrote (`OnnxExporter().export_for_generation(...)`
    then `save_pretrained`: prefill.onnx, decode.onnx, export.json, config.json), its two graphs, and each
    graph's dim sizes for the verification. Its graphs name every dim apart (the mask's batch and length are
    symbols of their own), so the sizes are given here, related as the graphs compute them: the mask's length
    is the prompt's (prefill) or past + new tokens (decode). The cache: the prefill's `cache.layers.{i}.keys`
    and the decode's `output.cache.layers.{i}.keys` feed the next step's `input.cache.layers.{i}.keys`."""
    import re

    import onnx

    where = folder / _EXPORT_MANIFEST
    manifest = read_json(where)
    components = manifest.get("components") or {}
    if manifest.get("export_format") != "onnx":
        raise InputError(f"{where}: export_format {manifest.get('export_format')!r}, not onnx")
    if set(components) != set(GRAPHS):
        raise InputError(f"{where}: components {sorted(components)}; a generation folder has prefill and decode "
                         "(export_for_generation of a decoder-only model)")
    config, text, generation_config, token = _checkpoint_config(folder)
    graphs, sources, dims, feeds = {}, {}, {}, {}
    for g in GRAPHS:
        if not isinstance(components[g], dict):
            raise InputError(f"{where}: components.{g} is not an object")
        path = inside(folder, components[g].get("file", f"{g}.onnx"), where, f"components.{g}.file")
        if not path.is_file():
            raise InputError(f"{folder}: {path.name} ({where.name}'s {g}) missing")
        graph = onnx.load(str(path), load_external_data=False).graph
        inputs, outputs = _step_io(path, graph)
        if len(inputs["attention_mask"]) != 2:
            static = any(n.endswith(".cumulative_length") for n in inputs) or \
                any(n.op_type == "ScatterND" for n in graph.node)
            raise UnsupportedError(
                f"{path}: its attention_mask is {inputs['attention_mask']}, not [batch, length]"
                + (": a static cache (written by ScatterND at cumulative_length), which is not taken yet; export "
                   "with the default dynamic cache (no cache_implementation='static')" if static else ""))
        for name in outputs:
            found = re.fullmatch(r"(?:output\.)?cache\.layers\.(\d+)\.(keys|values)", name)
            if found:
                feeds[name] = f"input.cache.layers.{found[1]}.{found[2]}"
        graphs[g] = {"file": path.name, "inputs": inputs, "outputs": outputs}
        sources[g] = path
        batch, seq = inputs["input_ids"]
        sizes = {batch: (3, 5), seq: (7, 9) if g == "prefill" else (1, 3)}
        past = [d[2] for n, d in inputs.items() if n.startswith("input.cache.") and len(d) == 4]
        if g == "decode" and (not past or not isinstance(past[0], str)):
            raise InputError(f"{path}: its cache length is fixed ({past[0] if past else 'no input.cache.* inputs'}): "
                             "export with OnnxConfig(dynamic=True) for generation")
        if past:
            sizes[past[0]] = (5, 7)
        mask_batch, mask_length = inputs["attention_mask"]
        sizes[mask_batch] = sizes[batch]
        sizes[mask_length] = tuple(a + b for a, b in zip(sizes[seq], sizes[past[0]] if past else (0, 0)))
        dims[g] = {k: v for k, v in sizes.items() if isinstance(k, str)}
    missing = sorted(set(feeds.values()) - set(graphs["decode"]["inputs"]))
    if missing or not feeds:
        raise InputError(f"{folder}: the decode graph does not take the cache the graphs give "
                         f"({', '.join(missing[:2]) or 'no cache.layers.* outputs'})")
    past = [vi for vi in onnx.load(str(sources["decode"]), load_external_data=False).graph.input
            if vi.name.startswith("input.cache.")]
    dtype = FLOAT_TYPE_NAMES.get(past[0].type.tensor_type.elem_type)
    if dtype is None:
        raise InputError(f"{sources['decode']}: cache dtype {past[0].type.tensor_type.elem_type} is not fp32, fp16 or "
                         "bf16")
    meta = {
        "model_type": config.get("model_type"), "task": "text-generation-with-past",
        "source": f"transformers' exporter ({_EXPORT_MANIFEST})",
        "bos_token_id": token("bos_token_id"), "eos_token_id": token("eos_token_id"),
        "pad_token_id": token("pad_token_id"), "num_layers": len(past) // 2,
        "sampling": decoding.sampling_settings(generation_config),
        "num_kv_heads": value_dims(past[0])[1], "head_dim": value_dims(past[0])[3],
        "vocab_size": graphs["decode"]["outputs"]["logits"][-1], "hidden_size": text.get("hidden_size"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "dtype": dtype, "cache_dtype": dtype, "cache_layout": "BNSD: [batch, kv_heads, seq, head_dim]",
        "cache_feeds": feeds, "position_ids": "position_ids = cumsum(attention_mask, -1) - 1, padded positions 0",
        "graphs": graphs,
    }
    if _rotates_prompt_from_first_row(sources["prefill"]):
        meta["prompt_padding"] = "none"
    return meta, sources, dims


def _rotates_prompt_from_first_row(path: Path) -> bool:
    """Whether the prefill graph holds a GroupQueryAttention (`OnnxConfig(ort_fusions=...)`): onnxruntime's kernel
    rotates every row of a first prompt at position_ids[0, 0] + s, so a left-padded row would be rotated at other
    positions than transformers' (and the cache keeps them); prompts of one length then run together, unpadded."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return any(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in graph.node)


def _cache_capacity(meta: dict, sources: dict, max_batch: int, max_seq_len: int | None) -> tuple[int, int]:
    """(max batch, max seq) of a cache held in place, checked: one graph serving prompt and decode (the
    stateful graph is called at past length 0 for the prompt) and a capacity to hold. CacheNotHeld says why
    not; InputError for a capacity that is no capacity."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise InputError(f"--max-batch {max_batch}: must be an integer >= 1")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 2):
        raise InputError(f"--max-seq-len {max_seq_len}: must be an integer >= 2")
    decode = meta["graphs"]["decode"]
    if str(meta.get("source", "")).startswith("onnxruntime-genai"):
        pass  # one graph for prompt and decode; GroupQueryAttention's decomposition is the pattern the rewrite takes
    elif meta.get("cache_feeds"):  # transformers' exporter: its decode graph serves the prompt if it takes any length
        length = decode["inputs"]["input_ids"][1]
        if isinstance(length, int):
            raise CacheNotHeld(f"the decode graph takes {length} token(s) a call, so it cannot take the prompt "
                               "(export_for_generation(..., multi_token_decode=True) writes one that can)")
    elif tuple(sources) != ("decode",) or not meta["graphs"]["prefill"].get("empty_cache"):
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


def _cache_bytes_per_position(meta: dict, precision: str = "fp32") -> int:
    """Bytes of keys and values one row's position takes over all layers (a low --precision stores the cache low)."""
    itemsize = 4 if cache_dtype(meta) == "fp32" and precision == "fp32" else 2
    if meta.get("cache_layers"):  # (layers of their own shapes: [kv heads, key head dim, value head dim] each)
        return sum(heads * (key + value) for heads, key, value in meta["cache_layers"]) * itemsize
    head_dims = int(meta.get("head_dim") or 0) + int(meta.get("value_head_dim") or meta.get("head_dim") or 0)
    return int(meta.get("num_layers") or 0) * int(meta.get("num_kv_heads") or 0) * head_dims * itemsize


def _stateful_options(meta: dict, capacity: tuple[int, int], options: dict) -> dict:
    """The compile's options for the stateful graph: the capacity, and reference cases at past length 0 (the
    prompt, the one call onnxruntime can run the stateful graph at: passes/stateful_cache.py) whose batch and
    length fit the capacity."""
    max_batch, max_seq = capacity
    inputs = meta["graphs"]["decode"]["inputs"]
    ids = inputs["input_ids"]  # [batch, sequence]
    past = {dims[2] for name, dims in inputs.items()
            if name not in STEP_INPUTS and len(dims) == 4 and isinstance(dims[2], str)}
    sizes = {ids[0]: (min(2, max_batch), min(3, max_batch)), ids[1]: (min(5, max_seq), min(9, max_seq))}
    # past 0, where the step's inputs still name the past's length (the stateful graph takes no cache)
    named = " ".join(str(d) for n in STEP_INPUTS if n in inputs for d in inputs[n])
    sizes.update({d: (0, 0) for d in past if re.search(rf"\b{re.escape(d)}\b", named)})
    # the mask's [batch, past + sequence]: a sum, or (transformers' exporter) names of their own
    for mask, same in zip(inputs["attention_mask"], ids):
        if isinstance(mask, str) and mask.isidentifier() and mask not in sizes:
            sizes[mask] = sizes[same]
    dims = {k: v for k, v in sizes.items() if isinstance(k, str)}
    # the capacity declares the ranges of batch and length (the fusions' constraints are checked at their ends)
    spans = {ids[0]: (1, max_batch), ids[1]: (1, max_seq)}
    spans.update({mask: spans[same] for mask, same in zip(inputs["attention_mask"], ids) if same in spans})
    ranges = {k: v for k, v in spans.items() if isinstance(k, str) and k.isidentifier()}
    return {**options, "cache_capacity": capacity, "dims": {**dims, **(options.get("dims") or {})},
            "shape_ranges": {**ranges, **(options.get("shape_ranges") or {})}}


def _twin_unusable(mindir: Path, meta: dict, precision: str) -> str | None:
    """Why `graphconv generate` could not run the cpu MindIR of the ascend MindIR `mindir` on this host (its
    memory rule, graphconv.generation.fits_in_memory, on the weights in fp32), or None."""
    from graphconv.generation import fits_in_memory

    low = meta.get("dtype") in ("bf16", "fp16") or precision in ("fp16", "bf16")  # (the MindIR's weights: 2 bytes)
    return fits_in_memory([mindir], {**meta, "dtype": "bf16" if low else "fp32"})


def _strip_state(mindirs: list[Path]) -> dict[str, dict]:
    """The cache Parameters' bytes removed from each MindIR (graphconv/runtime/mindir_state.py); their names,
    shapes and dtypes, which every loader gives zeros for."""
    from graphconv.runtime import mindir_state
    from passes.stateful_cache import CACHE_PREFIX

    params = {}
    for mindir in mindirs:
        params = mindir_state.strip(mindir, CACHE_PREFIX) or params
    return params


def _state_bytes(params: dict[str, dict]) -> int:
    """The bytes of the state Parameters (generation.json's state.params) a loader gives zeros for."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}
    return sum(int(np.prod(p["shape"])) * itemsize.get(p["dtype"], 4) for p in params.values())


def _check_cached_steps(gen_dir: Path, meta: dict, progress: Progress) -> dict:
    """The stateful graph's cached steps against onnxruntime on the ONNX pair: three prompts of different lengths
    (left-padded), four greedy steps, every step's logits compared (graphconv.generation's --check)."""
    from graphconv.generation import all_files, fits_in_memory, generate

    capacity = meta["graphs"]["decode"]["state"]
    if not all((gen_dir / f).is_file() for f in all_files(meta, "cpu")):
        return {"skipped": f"no cpu MindIR: {meta.get('cpu_twin', {}).get('reason')}"}
    too_large = fits_in_memory([gen_dir / f for f in sorted(set(all_files(meta, "cpu")))], meta)
    if too_large:
        progress.warn(f"the cached steps are not checked: {too_large}")
        return {"skipped": too_large}
    rng = np.random.default_rng(0)
    vocab = int(meta.get("vocab_size") or 2)
    batch = min(3, capacity["max_batch"])
    steps = min(4, capacity["max_seq_len"] - 7)
    if steps < 1:
        raise InputError(f"--max-seq-len {capacity['max_seq_len']}: too small to check a cached step (at least 8)")
    prompts = [rng.integers(0, vocab, n).tolist() for n in (7, 3, 5)[:batch]]
    progress.info(f"check the cache held in place: {batch} prompts, {steps} steps against onnxruntime")
    result = generate(gen_dir, prompts, steps, check=True, device="cpu")
    worst = max(s["max_abs"] for s in result.steps)
    return {"prompts": [len(p) for p in prompts], "steps": len(result.steps), "max_abs": worst,
            "argmax_match": all(s["argmax_match"] for s in result.steps)}


def _compile_pair(export_dir: str | Path, gen_dir: str | Path, *, progress: Progress | None = None,
                 inputs: tuple = (), report_path: Path | None = None, stateful_cache: bool | None = None,
                 max_batch: int = 8, max_seq_len: int | None = None, cpu_twin: bool | None = None,
                 tp: int | None = None, **options) -> dict:
    """Compile and verify both graphs of a generation pair into the new folder `gen_dir`; returns the report
    (a dict, the one written to report.json). Options are the compile's (CompileOptions fields). The one graph
    serving prompt and decode is compiled with its KV cache held in place (capacity `max_batch` x
    `max_seq_len`, default the model's max_position_embeddings capped at 4,096) where it can be; where it
    cannot (the reason in report.json's `cache.why` and a warning), the folder passes the cache in and out.
    `stateful_cache` True: held in place or an error; False: passed in and out.
    `cpu_twin`: write the cpu MindIRs beside an ascend compile's (None: where this host's memory can run them,
    `graphconv generate`'s own rule).
    `tp`: tensor parallelism over `tp` ranks (graphconv/parallel/tensor_parallel.py): GEN_DIR holds each rank's stateful
    MindIR (rank_<i>.mindir, rank_<i>.cpu.mindir; each rank's cache its own kv heads) and plan.json, and
    `graphconv generate` runs the ranks under msrun."""
    export_dir, gen_dir = Path(export_dir), Path(gen_dir)
    progress = progress or SILENT
    builder = (export_dir / _GENAI_CONFIG).is_file() and not (export_dir / "generation.json").is_file()
    exported = (export_dir / _EXPORT_MANIFEST).is_file() and not (export_dir / "generation.json").is_file()
    graph_dims: dict[str, dict] = {}
    if export_dir.is_file():  # one with-past graph: its cache held in place (the pair route needs an export's checks)
        if stateful_cache is False:
            raise InputError(f"{export_dir}: a single with-past graph compiles with its cache held in place only "
                             "(--stateful-cache)")
        stateful_cache = True
        meta, sources = decode_graph_generation(export_dir)
        export_dir = export_dir.parent
    elif exported:
        meta, sources, graph_dims = transformers_generation(export_dir)
    else:
        meta, sources = genai_generation(export_dir) if builder else _pair_sources(export_dir)
    if gen_dir.exists():
        raise InputError(f"-o {gen_dir} already exists (a generation pair is written into a new folder)")
    if not gen_dir.parent.absolute().is_dir():
        raise InputError(f"output directory {gen_dir.parent} does not exist")
    for key in ("emit_source", "save_fused"):
        if options.get(key):
            raise InputError(f"--{key.replace('_', '-')} is not supported for a generation pair yet")
    bundle = options.pop("bundle", None)
    bundle = Path(bundle) if bundle else None
    if bundle is not None and bundle.exists():
        raise InputError(f"--bundle {bundle} already exists")
    per_inputs = split_inputs(inputs, tuple(sources))
    pair_plan = (meta, sources, options if builder or exported else _prompt_dims(meta, sources, options),
                 graph_dims, None)  # (a builder's graph has its own prompt case: frontend.contrib.cases)
    if stateful_cache is False:
        return _compile_into(gen_dir, bundle, export_dir, *pair_plan, per_inputs, cpu_twin, progress, report_path,
                             "not asked for (--no-stateful-cache)")
    try:
        capacity = _cache_capacity(meta, sources, max_batch, max_seq_len)
        plan = _stateful_plan(meta, sources, options, capacity)
        cache_bytes = capacity[0] * capacity[1] * _cache_bytes_per_position(meta, options.get("precision", "fp32"))
        progress.info(f"KV cache held in place: {capacity[0]} rows x {capacity[1]} positions, "
                      f"{cache_bytes / 2**30:.2f} GiB of device memory at run time (made at load, not stored)")
        if tp is not None:
            return _compile_into(gen_dir, bundle, export_dir, *plan, per_inputs, cpu_twin, progress, report_path,
                                 tp=tp)
        return _compile_into(gen_dir, bundle, export_dir, *plan, per_inputs, cpu_twin, progress, report_path)
    except CacheNotHeld as e:
        if tp is not None:
            raise CacheNotHeld(f"--tp: the KV cache cannot be held in place: {e}") from None
        if stateful_cache:
            raise CacheNotHeld(f"--stateful-cache: the KV cache cannot be held in place: {e}") from None
        why = str(e)
    progress.warn(f"the KV cache is passed in and out, not held in place: {why}")
    return _compile_into(gen_dir, bundle, export_dir, *pair_plan, per_inputs, cpu_twin, progress, report_path, why)


def _stateful_plan(meta: dict, sources: dict, options: dict, capacity: tuple[int, int]) -> tuple:
    """(meta, sources, options, graph dims, state) for the one graph serving prompt and decode with its KV
    cache held in place. The prefill's entry keeps its ONNX graph, which `generate --check` runs for the
    prompt (an export's: the decode graph at an empty cache)."""
    options = _stateful_options(meta, capacity, options)
    decode = meta["graphs"]["decode"]
    state = {"max_batch": capacity[0], "max_seq_len": capacity[1],
             "inputs": [n for n in STEP_INPUTS if n in decode["inputs"]], "outputs": ["logits"]}
    name = decode.get("mindir", "decode")  # (a builder's: its model file's name)
    step = {**decode, "mindir": name, "state": state}
    meta = {**meta, "graphs": {"prefill": {**meta["graphs"]["prefill"], "mindir": name, "state": state},
                               "decode": step}}
    source = sources["decode"] if "decode" in sources else sources[name]
    return meta, {name: source}, options, {}, state  # (_stateful_options sized the dims)


def _compile_into(gen_dir: Path, bundle: Path | None, export_dir: Path, meta: dict, sources: dict, options: dict,
                  graph_dims: dict, state: dict | None, per_inputs: dict, cpu_twin: bool | None, progress: Progress,
                  report_path: Path | None, not_held: str | None = None, tp: int | None = None) -> dict:
    """Compile `sources` into the new folder gen_dir (and the bundle), with the cache held in place where
    `state` is given (else `not_held` says why not); returns the report. CacheNotHeld where the graph cannot
    hold it, with nothing written."""
    from graphconv.pipeline import compile as pipeline_compile

    def compile_graph(*args, **kwargs):
        with interrupts.nested():  # (into the staging folder: the results are not in place yet)
            return pipeline_compile(*args, **kwargs)

    capacity = (state["max_batch"], state["max_seq_len"]) if state else None
    target = options.get("target", "ascend")
    staging = partial_dir(gen_dir)
    bundle_staging = None if bundle is None else partial_dir(bundle)
    report_tmp = None
    g = next(iter(sources), "decode")  # (the graph being compiled, for the report of a failed one)
    try:
        graphs, twins, weights = {}, {}, {}
        if tp is not None:
            meta = _compile_ranks(staging, tp, meta, sources, options, graph_dims, state, per_inputs, progress,
                                  graphs, twins, weights)
        for g, source in ({} if tp is not None else sources).items():
            progress.info(f"{g}: compile ({target})")
            graph_bundle = None if bundle_staging is None else bundle_staging / g
            graph_options = {**options, "dims": {**graph_dims.get(g, {}), **(options.get("dims") or {})}}
            graphs[g] = compile_graph(source, staging / f"{g}.mindir", progress=progress,
                                      inputs=per_inputs[g], bundle=graph_bundle, **graph_options).to_dict()
            if capacity is not None:  # the cache's zeros are made at load, not stored
                state["params"] = _strip_state([staging / f"{g}.mindir"] + (
                    [graph_bundle / "model" / f"{g}.mindir"] if graph_bundle is not None else []))
            twin = staging / f"{g}.cpu.mindir"
            unusable = None if target == "cpu" or cpu_twin else \
                "not asked for (--no-cpu-twin)" if cpu_twin is False else \
                _twin_unusable(staging / f"{g}.mindir", meta, options.get("precision", "fp32"))
            if target == "cpu":
                os.link(staging / f"{g}.mindir", twin)
            elif unusable:
                progress.warn(f"{g}: the cpu MindIR is not written: {unusable}")
                twins[g] = {"status": "not written", "reason": unusable}
                meta = {**meta, "cpu_twin": {"written": False, "reason": unusable}}
            else:
                progress.info(f"{g}: compile the cpu MindIR")
                twins[g] = compile_graph(source, twin, progress=progress, inputs=per_inputs[g],
                                         **{**graph_options, "target": "cpu", "precision": "fp32",
                                            "keep_fp32": None}).to_dict()
                if capacity is not None:
                    twin_params = _strip_state([twin])
                    if twin_params != state["params"]:  # (an fp16/bf16 compile's cache is low, its twin's fp32)
                        state["cpu_params"] = twin_params
            weights[g] = {"mindir_bytes": mindir_bytes(staging / f"{g}.mindir"),
                          "cpu_mindir_bytes": mindir_bytes(twin) if twin.exists() else 0}
        meta = {**meta, "source_dir": str(export_dir.resolve())}
        if tokenizer.copy(_tokenizer_dir(export_dir, meta), staging / "tokenizer"):
            meta["tokenizer"] = "tokenizer"
        (staging / "generation.json").write_text(json.dumps(meta, indent=2))
        if tp is not None:
            _write_rank_scripts(staging, gen_dir.name, meta, next(iter(graphs.values())))
        statuses = [r["status"] for r in [*graphs.values(), *twins.values()] if r["status"] != "not written"]
        cached_steps = _check_cached_steps(staging, meta, progress) if capacity is not None and options.get(
            "verify", True) else None
        report = {
            "graphconv_version": next(iter(graphs.values()))["graphconv_version"],
            "provenance": {**next(iter(graphs.values()))["provenance"], "source_dir": str(export_dir.resolve())},
            "status": "verified" if all(s == "verified" for s in statuses) else "unverified",
            "exit_code": 0,
            "artifacts": {g: str(gen_dir / f"{g}.mindir") for g in sources}
            | {f"{g}_cpu": str(gen_dir / f"{g}.cpu.mindir") for g in sources if (staging / f"{g}.cpu.mindir").exists()}
            if tp is None else {f.name: str(gen_dir / f.name) for f in sorted(staging.glob("rank_*.mindir"))}
            | {"plan": str(gen_dir / "plan.json")},
            "weights": {**weights, "shared": False,
                        "note": "each MindIR holds its own copy of the weights: a MindIR cannot reference another "
                                "file's Parameters"},
            "graphs": graphs, "cpu_twins": twins,
            "steps": {step: meta["graphs"][step].get("mindir", step) for step in GRAPHS},  # the graph each runs
        }
        if capacity is not None:
            held = next(s["detail"]["cache_held_in_place"] for s in next(iter(graphs.values()))["stages"]
                        if s["name"] == "load")
            report["cache"] = {**held, "bytes": _state_bytes(state["params"]),  # (in the ascend MindIR's dtype)
                               "stored": "no: zeros made at load (generation.json's state.params)",
                               "cached_steps_check": cached_steps}
        else:
            report["cache"] = {"held_in_place": False, "why": not_held}
        if tp is not None:
            own = next(iter(graphs.values()))["validation"].get("tensor_parallel") or {}
            report["tensor_parallel"] = {
                "tp": tp, "plan": str(gen_dir / "plan.json"), "ranks": own.get("ranks"),
                "unsharded_weight_bytes": own.get("unsharded_weight_bytes"),
                "cache_bytes_per_rank": _state_bytes(state["params"]),
                "checked": "each rank's prompt call under msrun vs onnxruntime on the unsharded graph (the "
                           "compile's cases); the cached steps by generating under msrun (cache.cached_steps_check)"}
        if bundle_staging is not None and tp is not None:
            from graphconv.deploy.tensor_parallel import write_tp_generation_bundle

            write_tp_generation_bundle(bundle_staging, staging, report)
            report["artifacts"]["bundle"] = str(bundle)
        elif bundle_staging is not None:
            from graphconv.deploy.pair import write_pair_files

            write_pair_files(bundle_staging, meta, graphs)
            report["artifacts"]["bundle"] = str(bundle)
        (staging / "report.json").write_text(json.dumps(report, indent=2, default=str))
        if report_path is not None:  # (written before the renames: a full disk fails the run with nothing out)
            report_tmp = Path(report_path).with_name(f".{Path(report_path).name}.partial-{os.getpid()}")
            report_tmp.write_text(json.dumps(report, indent=2, default=str))
        with interrupts.final_moves():
            os.replace(release(staging), gen_dir)
            if bundle_staging is not None:
                os.replace(release(bundle_staging), bundle)
            if report_tmp is not None:
                os.replace(report_tmp, report_path)
    except BaseException as e:
        for d in (staging, bundle_staging):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        if report_tmp is not None:
            report_tmp.unlink(missing_ok=True)
        failed = getattr(e, "report", None)
        if report_path is not None and isinstance(e, VerificationError) and failed is not None:
            # as a plain compile does: the report says how the run ended, and holds every failed comparison
            Path(report_path).write_text(json.dumps(
                {"status": "failed", "exit_code": e.exit_code, "error": str(e),
                 "graphs": {**graphs, (f"{g}.cpu" if g in graphs else g): failed.to_dict()}}, indent=2, default=str))
        if isinstance(e, DiskFullError):  # (a graph's up-front check: named where the user asked for it)
            raise DiskFullError(str(e).replace(str(staging), str(gen_dir))) from None
        raise
    return report


RANKS_ABOUT = """# Generate with the {n} ranks of {name} on one Ascend host: msrun starts {n} processes, rank i loads
# rank_<i>.mindir (its shards, and its kv heads' cache) and runs generate_mindspore.py's loop; the AllReduce and
# AllGather between them run over HCCL. Rank 0 prints the new ids (msrun_logs/worker_0.log) and writes
# generated.txt, shown at the end.   ./launch_ascend.sh --input-ids '1,2,3;4,5' --max-new-tokens 16
#
# UNVERIFIED ON ASCEND: graphconv ran these ranks' cpu MindIRs (rank_<i>.cpu.mindir) under msrun on CPU
# (MindSpore's CPU collectives) and checked their tokens against onnxruntime, not on Ascend. Not checked here:
# HCCL itself, the rank-to-device binding (msrun's default: rank i on device i), the fused primitives' kernels.
"""


def _write_rank_scripts(staging: Path, name: str, meta: dict, report: dict) -> None:
    """A tensor-parallel GEN_DIR's Ascend launch: launch_ascend.sh (msrun) running generate_mindspore.py (the
    bundle's generation script, which under msrun joins the group and loads its rank's MindIR) on every rank."""
    from graphconv.deploy.pair import generate_script

    inputs = {"rank_0": [{k: s[k] for k in ("name", "dtype", "shape")} for s in report["model"]["inputs"]]}
    script = staging / "generate_mindspore.py"
    script.write_text(generate_script(inputs))
    script.chmod(0o755)
    launch = staging / "launch_ascend.sh"
    n = meta["tensor_parallel"]["tp"]
    launch.write_text(msrun.launch_script(n, RANKS_ABOUT.format(n=n, name=name), "generate_mindspore.py",
                                          "cat generated.txt\n"))
    launch.chmod(0o755)


def _compile_ranks(staging: Path, tp: int, meta: dict, sources: dict, options: dict, graph_dims: dict, state: dict,
                   per_inputs: dict, progress: Progress, graphs: dict, twins: dict, weights: dict) -> dict:
    """The one stateful graph compiled with --tp (graphconv/parallel/tensor_parallel.py: the ranks verified under msrun at
    the prompt call against onnxruntime on the unsharded graph) into staging/rank_<i>.mindir, and for a target
    other than cpu once more for cpu (rank_<i>.cpu.mindir: what generate runs here); the cache's zeros stripped
    from every rank file. Fills graphs, twins and weights; returns generation.json with `tensor_parallel`."""
    from graphconv.pipeline import compile as compile_graph

    (g, source), = sources.items()
    target = options.get("target", "ascend")
    graph_options = {**options, "dims": {**graph_dims.get(g, {}), **(options.get("dims") or {})}}
    forms = [(target, ".mindir")] + ([("cpu", ".cpu.mindir")] if target != "cpu" else [])
    for form, suffix in forms:
        progress.info(f"{g}: compile {tp} ranks ({form})")
        ranks_dir = staging / f"ranks-{form}"
        with interrupts.nested():  # (into the staging folder: a signal until the folder's own moves interrupts)
            report = compile_graph(source, ranks_dir, progress=progress, inputs=per_inputs[g], tp=tp,
                                   **{**graph_options, "target": form}).to_dict()
        if form == target:
            graphs[g] = report
            os.replace(ranks_dir / "plan.json", staging / "plan.json")
        else:
            twins[g] = report
        for r in range(tp):
            if (ranks_dir / f"rank_{r}_variables").exists():
                raise UnsupportedError(f"--tp: rank {r}'s weights are past 1 GiB (a _variables/ folder): a "
                                       "tensor-parallel generation folder takes smaller ranks in this version")
            os.replace(ranks_dir / f"rank_{r}.mindir", staging / f"rank_{r}{suffix}")
        shutil.rmtree(ranks_dir)
    files = [staging / f"rank_{r}.mindir" for r in range(tp)]
    state["params"] = _strip_state(files + ([] if target == "cpu" else
                                            [staging / f"rank_{r}.cpu.mindir" for r in range(tp)]))
    if target == "cpu":  # (after the strip, which replaces the files)
        for r in range(tp):
            os.link(files[r], staging / f"rank_{r}.cpu.mindir")
    ranks = [{"mindir_bytes": mindir_bytes(f), "cpu_mindir_bytes": mindir_bytes(staging / f"rank_{r}.cpu.mindir")}
             for r, f in enumerate(files)]
    weights[g] = {**ranks[0], "ranks": ranks}
    about = {"tp": tp, "target": target, "mindirs": [f.name for f in files],
             "cpu_mindirs": [f"rank_{r}.cpu.mindir" for r in range(tp)], "plan": "plan.json",
             "run": "msrun, rank i on rank_<i>; every rank's logits whole (the LM head's AllGather), rank 0's tokens "
                    "reported"}
    graphs_meta = {k: {**v, "mindir": "rank_0"} for k, v in meta["graphs"].items()}
    return {**meta, "graphs": graphs_meta, "tensor_parallel": about}


def summary(report: dict) -> str:
    from opmap.fused import fused_primitives

    steps = report.get("steps") or {}
    how = f"one graph, {steps['decode']}, for prompt and decode" if len(set(steps.values())) == 1 else \
        "prefill + decode pair"
    tp = report.get("tensor_parallel")
    if tp:
        how = f"tensor-parallel over {tp['tp']} ranks, one stateful graph each"
    lines = [f"graphconv {report['graphconv_version']}: {report['status']} (generation: {how}, target "
             f"{report['provenance'].get('target')})"]
    for g, r in report["graphs"].items():
        twin = report["cpu_twins"].get(g)
        attention = r["coverage"].get("attention", {})
        fused = ", ".join(f"{k} {v}" for k, v in r["census"].items() if k in fused_primitives())
        lines.append(f"  {g}: {r['status']}, attention {attention.get('fused', 0)}/{attention.get('candidates', 0)} "
                     f"fused ({fused or 'no fused primitive'})" + (f"; cpu MindIR {twin['status']}" if twin else ""))
    cache = report.get("cache")
    if cache and cache.get("held_in_place") is False:
        lines.append(f"  KV cache passed in and out, not held in place: {cache['why']}")
    elif cache:
        check = cache.get("cached_steps_check") or {}
        checked = f"; cached steps not checked: {check['skipped']}" if "skipped" in check else \
            f"; {check['steps']} cached steps match onnxruntime (max_abs {check['max_abs']:.2g})" if check else ""
        lines.append(f"  KV cache held in place: {cache['max_batch']} rows x {cache['max_seq']} positions, "
                     f"{len(cache['caches'])} caches, {cache['bytes'] / 2**20:.1f} MiB" + checked)
    w = report["weights"]
    if tp:
        lines.append("  ranks: " + ", ".join(
            f"rank {r['rank']} {r['weight_bytes'] / 2**20:.2f} MiB ({100 * r['share']:.0f}% of the weights), prompt "
            f"max_abs {r.get('max_abs', float('nan')):.2g}" for r in tp["ranks"] or [])
            + f"; cache {tp['cache_bytes_per_rank'] / 2**20:.2f} MiB per rank")
    lines.append("  weights: " + ", ".join(f"{g} {w[g]['mindir_bytes'] / 2**20:.1f} MiB" for g in report["graphs"])
                 + (f" ({w['note']})" if len(report["graphs"]) > 1 else ""))
    lines.append("  wrote: " + ", ".join(Path(p).name for p in report["artifacts"].values())
                 + ", generation.json, report.json")
    return "\n".join(lines)

