"""The generation sources `graphconv compile` takes, each read into one typed `Source`: generation.json as the
source gives it, the ONNX graphs to compile and the dim sizes to verify them at.

- an export folder (`graphconv export --task text-generation-with-past`: prefill.onnx, decode.onnx,
  generation.json); where the export checked the decode graph at an empty cache against PyTorch's prompt
  (graphs.decode.serves_prompt), that one graph serves both steps;
- an onnxruntime-genai model builder folder (model.onnx + genai_config.json: one graph for prompt and steps);
- a folder transformers' own exporter wrote (prefill.onnx, decode.onnx, export.json);
- one with-past ONNX graph exported by other means (compiled with its cache held in place only).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from graphconv.errors import InputError, UnsupportedError
from graphconv.frontend.contained import inside
from graphconv.frontend.load import FLOAT_TYPE_NAMES, value_dims
from graphconv.json_io import read_json
from graphconv.generation import schema
from graphconv.generation.schema import GRAPHS, TASK, Generation
from graphconv.runtime import decoding

GENAI_CONFIG = "genai_config.json"
EXPORT_MANIFEST = "export.json"  # transformers.exporters' save_pretrained
CACHE_LAYOUT = "BNSD: [batch, kv_heads, seq, head_dim]"
POSITION_IDS = "position_ids = cumsum(attention_mask, -1) - 1, padded positions 0"


@dataclasses.dataclass
class Source:
    """A generation source as read: what generation.json starts from and what the build compiles."""

    kind: str  # "export" | "genai" | "transformers" | "graph"
    meta: Generation  # generation.json as the source gives it (the build adds the capacity, the files)
    graphs: dict[str, Path]  # the ONNX graphs to compile, by their MindIR's stem
    folder: Path  # the folder of the source: its tokenizer files, and --check's ONNX graphs (source_dir)
    dims: dict[str, dict] = dataclasses.field(default_factory=dict)  # per graph, the sizes to verify at

    @property
    def one_graph(self) -> bool:
        """Whether one graph serves the prompt (at an empty cache) and the decode steps."""
        return len(self.graphs) == 1


def is_folder_source(path: Path) -> bool:
    """Whether `path` is a folder `graphconv compile` turns into a generation folder: an export, a builder
    folder, or a folder transformers' exporter wrote."""
    return path.is_dir() and any((path / f).is_file() for f in (schema.FILE, GENAI_CONFIG, EXPORT_MANIFEST))


def read_source(path: Path) -> Source:
    """The Source at `path`, by what it holds: a file is a with-past graph; a folder's generation.json wins
    over a builder's config and over transformers' manifest."""
    if path.is_file():
        return with_past_graph(path)
    if (path / schema.FILE).is_file():
        return export_folder(path)
    if (path / GENAI_CONFIG).is_file():
        return genai_folder(path)
    return transformers_folder(path)


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


def tokenizer_dir(folder: Path, meta: Generation) -> Path:
    """The folder of the tokenizer files the compile copies: generation.json's `tokenizer`, inside the source
    folder; without one, the folder itself (a builder's tokenizer files are at its top)."""
    if meta.get("tokenizer") is None:
        return folder
    return inside(folder, meta["tokenizer"], folder / schema.FILE, "tokenizer", directory=True)


def export_folder(folder: Path) -> Source:
    """An export folder: its generation.json and its graphs. Where the export checked that the decode graph at
    an empty cache computes the prompt (graphs.decode.serves_prompt), that one graph serves both steps, as
    onnxruntime-genai's does: the weights are stored once per target, and `generate` loads them once."""
    meta = schema.read(folder, compiled=False)
    decode = meta["graphs"]["decode"]
    graphs = ("decode",) if decode.get("serves_prompt") else GRAPHS
    tokenizer_dir(folder, meta)  # (refused now, not after the compile)
    missing = [g for g in graphs if not (folder / f"{g}.onnx").is_file()]
    if missing:
        raise InputError(f"{folder}: {', '.join(g + '.onnx' for g in missing)} missing")
    if graphs == ("decode",):
        step = {**decode, "mindir": "decode"}
        meta = {**meta, "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step}}
    source = Source("export", meta, {g: folder / f"{g}.onnx" for g in graphs}, folder)
    if source.one_graph:
        source.dims = {"decode": _prompt_dims(meta)}
    return source


def _prompt_dims(meta: Generation) -> dict:
    """One graph serving both steps is verified at an empty cache (a prompt) and at a cached step: its past dim
    at sizes 0 and 5."""
    return {dims[2]: (0, 5) for name, dims in meta["graphs"]["prefill"]["inputs"].items()
            if name.startswith("past_key_values.") and len(dims) == 4 and isinstance(dims[2], str)}


def _genai_decoder(folder: Path, config: dict) -> tuple[dict, Path]:
    """The builder config's model.decoder and its graph's path, checked: the builder's default names and a head
    size."""
    model = config.get("model") or {}
    decoder = model.get("decoder") if isinstance(model, dict) else None
    where = folder / GENAI_CONFIG
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
    head = decoder.get("head_size")
    if not isinstance(head, int) or head < 1:
        raise InputError(f"{where}: model.decoder.head_size must be a positive integer")
    return decoder, path


def genai_folder(folder: Path) -> Source:
    """An onnxruntime-genai model builder folder and its one graph. The builder's graph takes input_ids,
    attention_mask and past_key_values.N.key/value (position ids computed inside, from the mask's lengths) and
    returns logits and present.N.key/value; its cache head dim is symbolic (`kv_cache_dim`) and is written
    here as the head size."""
    import onnx

    config = read_json(folder / GENAI_CONFIG)
    decoder, path = _genai_decoder(folder, config)
    model, head = config["model"], decoder["head_size"]
    graph = onnx.load(str(path), load_external_data=False).graph

    def dims(vi):
        cache = vi.name.startswith(("past_key_values.", "present."))
        return [head if cache and k == 3 and isinstance(d, str) else d for k, d in enumerate(value_dims(vi))]

    inputs = {vi.name: dims(vi) for vi in graph.input}
    past = [vi for vi in graph.input if vi.name.startswith("past_key_values.")]
    dtype = FLOAT_TYPE_NAMES.get(past[0].type.tensor_type.elem_type if past else onnx.TensorProto.FLOAT)
    if dtype is None:
        raise InputError(f"{path}: cache dtype {past[0].type.tensor_type.elem_type} is not fp32, fp16 or bf16")
    step = {"file": decoder["filename"], "mindir": Path(decoder["filename"]).stem, "inputs": inputs,
            "outputs": {vi.name: dims(vi) for vi in graph.output}}
    meta: Generation = {
        "model_type": model.get("type"), "task": TASK,
        "source": "onnxruntime-genai model builder (genai_config.json)",
        "bos_token_id": model.get("bos_token_id"), "eos_token_id": model.get("eos_token_id"),
        "pad_token_id": model.get("pad_token_id"), "num_layers": decoder.get("num_hidden_layers"),
        "sampling": decoding.sampling_settings(config.get("search")),
        "num_kv_heads": decoder.get("num_key_value_heads"), "head_dim": head,
        "vocab_size": model.get("vocab_size"), "hidden_size": decoder.get("hidden_size"),
        "max_position_embeddings": model.get("context_length"), "dtype": dtype, "cache_dtype": dtype,
        "cache_layout": CACHE_LAYOUT,
        "cache_names": {"past": "past_key_values.{i}.key|value", "present": "present.{i}.key|value"},
        # GroupQueryAttention reads the mask as lengths (right padding): prompts of one length run together
        "prompt_padding": "none",
        "position_ids": ("position_ids = cumsum(attention_mask, -1) - 1" if "position_ids" in inputs else
                         "computed inside the graph from the attention mask's lengths"),
        "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step},
    }
    return Source("genai", meta, {step["mindir"]: path}, folder)  # (its prompt case: frontend.contrib.cases)


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


@dataclasses.dataclass
class _Checkpoint:
    """A checkpoint's config.json (and its text config) and generation_config.json beside a graph, {} where
    absent."""

    config: dict
    text: dict
    generation_config: dict

    @classmethod
    def beside(cls, folder: Path) -> "_Checkpoint":
        config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        generation_config = read_json(folder / "generation_config.json") \
            if (folder / "generation_config.json").is_file() else {}
        return cls(config, config.get("text_config") or config, generation_config)

    def token(self, key: str):
        """A token id: generation_config's, else the text config's, else the config's."""
        return self.generation_config.get(key, self.text.get(key, self.config.get(key)))

    def fields(self) -> Generation:
        """The generation.json fields a checkpoint's configs give."""
        return {"model_type": self.config.get("model_type"), "bos_token_id": self.token("bos_token_id"),
                "eos_token_id": self.token("eos_token_id"), "pad_token_id": self.token("pad_token_id"),
                "sampling": decoding.sampling_settings(self.generation_config),
                "hidden_size": self.text.get("hidden_size"),
                "max_position_embeddings": self.text.get("max_position_embeddings")}


def with_past_graph(path: Path) -> Source:
    """One with-past ONNX graph exported by other means (torch.onnx.export of a wrapper taking the cache as
    tensors, say): it takes input_ids, attention_mask (position_ids) and its cache inputs, found by the pattern
    whatever their names (passes/stateful_cache.past_present_pairs), and gives logits and the grown caches.
    Token ids and max_position_embeddings come from a checkpoint's config.json and generation_config.json
    beside the file, where there are."""
    import onnx

    from passes.stateful_cache import past_present_pairs

    model = onnx.load(str(path), load_external_data=False)
    inputs, outputs = _step_io(path, model.graph)
    pairs = past_present_pairs(model)
    if not pairs:
        raise InputError(f"{path}: no cache input (a rank-4 input that a Concat along axis 2 extends, the result "
                         "returned by the graph)")
    first = next(vi for vi in model.graph.input if vi.name == next(iter(pairs)))
    dtype = FLOAT_TYPE_NAMES.get(first.type.tensor_type.elem_type)
    heads, head_dim = inputs[first.name][1], inputs[first.name][3]
    vocab = outputs["logits"][-1]
    if dtype is None or not isinstance(heads, int) or not isinstance(head_dim, int) or not isinstance(vocab, int):
        raise InputError(f"{path}: cache {first.name} {inputs[first.name]} of {dtype or 'a non-float dtype'} and "
                         f"logits {outputs['logits']}: expected fp32/fp16/bf16 [batch, kv heads, past, head dim] and "
                         "[batch, seq, vocab] with static heads, head dim and vocab")
    checkpoint = _Checkpoint.beside(path.parent)
    step = {"file": path.name, "mindir": "decode", "inputs": inputs, "outputs": outputs}
    meta: Generation = {
        **checkpoint.fields(), "task": TASK,
        "source": f"a with-past ONNX graph ({path.name})" + (" beside a checkpoint's config.json"
                                                             if checkpoint.config else ""),
        "num_layers": len(pairs) // 2, "num_kv_heads": heads, "head_dim": head_dim, "vocab_size": vocab,
        "dtype": dtype, "cache_dtype": dtype, "cache_layout": CACHE_LAYOUT,
        "cache_feeds": {present: past for past, present in pairs.items()}, "position_ids": POSITION_IDS,
        "graphs": {"prefill": {**step, "empty_cache": True}, "decode": step},
    }
    return Source("graph", meta, {"decode": path}, path.parent)


def _transformers_graph(folder: Path, g: str, component, feeds: dict) -> tuple[Path, dict, dict]:
    """One graph of transformers' exporter folder: its path, its generation.json entry and its dim sizes for
    the verification; the cache outputs it gives are added to `feeds`."""
    import onnx

    where = folder / EXPORT_MANIFEST
    if not isinstance(component, dict):
        raise InputError(f"{where}: components.{g} is not an object")
    path = inside(folder, component.get("file", f"{g}.onnx"), where, f"components.{g}.file")
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
    return path, {"file": path.name, "inputs": inputs, "outputs": outputs}, _transformers_dims(path, g, inputs)


def _transformers_dims(path: Path, g: str, inputs: dict) -> dict:
    """The sizes of a transformers exporter graph's dims, related as the graphs compute them: its graphs name
    every dim apart (the mask's batch and length are symbols of their own), and the mask's length is the
    prompt's (prefill) or past + new tokens (decode)."""
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
    return {k: v for k, v in sizes.items() if isinstance(k, str)}


def transformers_folder(folder: Path) -> Source:
    """A folder transformers' exporter wrote (`OnnxExporter().export_for_generation(...)` then
    `save_pretrained`: prefill.onnx, decode.onnx, export.json, config.json). The cache: the prefill's
    `cache.layers.{i}.keys` and the decode's `output.cache.layers.{i}.keys` feed the next step's
    `input.cache.layers.{i}.keys`."""
    import onnx

    where = folder / EXPORT_MANIFEST
    manifest = read_json(where)
    components = manifest.get("components") or {}
    if manifest.get("export_format") != "onnx":
        raise InputError(f"{where}: export_format {manifest.get('export_format')!r}, not onnx")
    if set(components) != set(GRAPHS):
        raise InputError(f"{where}: components {sorted(components)}; a generation folder has prefill and decode "
                         "(export_for_generation of a decoder-only model)")
    graphs, sources, dims, feeds = {}, {}, {}, {}
    for g in GRAPHS:
        sources[g], graphs[g], dims[g] = _transformers_graph(folder, g, components[g], feeds)
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
    meta: Generation = {
        **_Checkpoint.beside(folder).fields(), "task": TASK, "source": f"transformers' exporter ({EXPORT_MANIFEST})",
        "num_layers": len(past) // 2, "num_kv_heads": value_dims(past[0])[1], "head_dim": value_dims(past[0])[3],
        "vocab_size": graphs["decode"]["outputs"]["logits"][-1], "dtype": dtype, "cache_dtype": dtype,
        "cache_layout": CACHE_LAYOUT, "cache_feeds": feeds, "position_ids": POSITION_IDS, "graphs": graphs,
    }
    if _rotates_prompt_from_first_row(sources["prefill"]):
        meta["prompt_padding"] = "none"
    return Source("transformers", meta, sources, folder, dims)


def _rotates_prompt_from_first_row(path: Path) -> bool:
    """Whether the prefill graph holds a GroupQueryAttention (`OnnxConfig(ort_fusions=...)`): onnxruntime's kernel
    rotates every row of a first prompt at position_ids[0, 0] + s, so a left-padded row would be rotated at other
    positions than transformers' (and the cache keeps them); prompts of one length then run together, unpadded."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return any(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in graph.node)
