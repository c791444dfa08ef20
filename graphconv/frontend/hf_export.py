"""Export a local transformers checkpoint folder (config.json + *.safetensors, as `save_pretrained` writes it)
into ONNX graphs for a task, each checked against PyTorch at two shapes (graphconv.frontend.export).

Tasks:
- `text-generation`: model.onnx, (input_ids, attention_mask) [batch, sequence_length] int64 -> logits.
- `feature-extraction`: model.onnx, the same inputs -> last_hidden_state.
- `text-generation-with-past`: prefill.onnx (input_ids, attention_mask, position_ids -> logits, present.{i}.key,
  present.{i}.value) and decode.onnx (the same plus past_key_values.{i}.key|value -> logits and the grown
  cache). The cache is BNSD: [batch, kv_heads, seq, head_dim]. The caller computes position_ids the way
  transformers' generate does: cumsum(attention_mask) - 1, padded positions set to 0.

The folder is loaded with local_files_only (nothing is downloaded) and without trust_remote_code, at the
default attention implementation (sdpa where the class supports it), in fp32 (bf16/fp16 weights are upcast,
and the notes say so). The output directory appears only when every graph passed its checks: everything is
written into a private temporary directory beside it, renamed at the end.

torch and transformers are imported inside the functions: the compile path never imports this module's
dependencies (tests/test_import_layers.py allows this module by name).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
from pathlib import Path

from graphconv import interrupts
from graphconv.errors import InputError, UnsupportedError, first_line
from graphconv.frontend import export_rewrites, quantized_checkpoint, tasks, tokenizer
from graphconv.frontend.contained import inside
from graphconv.frontend.export import (ExportResult, check_against_torch, exporter_failure, fixed_dynamic_axes,
                                       grown_inputs, require_torch)
from graphconv.frontend.load import FLOAT_TYPE_NAMES, value_dims
from graphconv.json_io import read_json
from graphconv.generation import schema
from graphconv.runtime import decoding
from graphconv.workspace import partial_dir, release

TASKS = ("text-generation", "feature-extraction", "text-generation-with-past")
DTYPES = ("fp32", "auto", "bf16", "fp16")
DEFAULT_OPSET = 18  # dynamo exports at 18; converting a transformers decoder down to 17 fails (Reduce* axes)
CACHE_LAYOUT = "BNSD: [batch, kv_heads, seq, head_dim]"
POSITION_IDS = ("position_ids = cumsum(attention_mask, -1) - 1 with padded positions set to 0 "
                "(transformers 5.24 generate's _prepare_position_ids_for_generation); decode: the last "
                "sequence_length columns of that over the whole mask")
# Symbolic dims of the graphs' inputs and outputs.
BATCH, SEQ, PAST = "batch", "sequence_length", "past_sequence_length"
TOTAL = f"{PAST} + {SEQ}"  # decode's attention_mask and present.*: what torch.export writes for past + seq
_TOTAL_EXPORTED = "total_sequence_length"  # decode's mask dim as exported (Dims cannot be summed), renamed TOTAL

_SAFETENSORS_FLOAT = {"F16": "fp16", "BF16": "bf16", "F32": "fp32", "F64": "fp64", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


@dataclasses.dataclass
class CheckpointExport:
    out_dir: Path
    task: str
    model_type: str
    graphs: dict[str, ExportResult]
    generation: dict  # what generation.json holds


def is_checkpoint_dir(source: str) -> bool:
    return Path(source).is_dir()


# --- the folder -----------------------------------------------------------------------------------------------


def _headers(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint: name -> (dtype, shape), from the safetensors headers (each checked
    there, a file cut short or a header that lies refused: weightless_export.read_header)."""
    from graphconv.frontend.weightless_export import read_header

    return {k: (v["dtype"], v["shape"]) for f in files for k, v in read_header(f).items() if k != "__metadata__"}


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint; every shard the index names must be inside the folder and
    present. Pickle formats (.bin, .pt) are never loaded: unpickling runs code the file names."""
    index = folder / "model.safetensors.index.json"
    named = sorted(folder.glob("quant_model_weight*.safetensors.index.json"))  # (msModelSlim's shards)
    index = index if index.is_file() or len(named) != 1 else named[0]
    if index.is_file():
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{index}: not a safetensors index ({e})") from None
        shards = {}
        for tensor, shard in weight_map.items():
            shards[shard] = inside(folder, shard, index, f"weight_map[{tensor!r}]")
        missing = [s for s in sorted(shards) if not shards[s].is_file()]
        if missing:
            raise InputError(f"{folder}: missing shard(s) {', '.join(missing)} named by {index.name}")
        return [shards[s] for s in sorted(shards)]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" ({', '.join(other)} are not loaded: save with safe_serialization)" if other else ""
        raise InputError(f"{folder}: no *.safetensors weights{hint}")
    return files


_PER_LAYER = object()


def _head_dim(text) -> int | None:
    """The config's head dim: its head_dim, else hidden / heads; None where it varies by layer."""
    head = _attr(text, "head_dim", _PER_LAYER)
    if head is _PER_LAYER:
        return None
    return head or _div(_attr(text, "hidden_size"), _attr(text, "num_attention_heads"))


def _attr(config, key: str, per_layer=None):
    """config.key, None where it is absent, `per_layer` where it is not one value: transformers 5's heterogeneous
    configs (Gemma 4's head_dim varies by layer) raise AmbiguousGlobalPerLayerAttributeError, not
    AttributeError, for such a key."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - (its class is private to a transformers version)
        return per_layer


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise InputError(f"{folder}: no config.json (not a transformers checkpoint folder)")
    raw = read_json(path)
    if not raw.get("model_type"):
        raise InputError(f"{path}: no model_type")
    if raw.get("auto_map"):
        raise UnsupportedError(f"{path}: the model needs its own code (auto_map); remote code is not run")
    return raw


# The token embedding's name in transformers' families (rows: the vocabulary; columns: its width), and a layer
# stack's: `<prefix>.layers.<i>.` and the like.
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
_LAYER = re.compile(r"((?:.*?\.)?(?:layers|layer|h|blocks|block))\.(\d+)\.")


def _check_sizes(path: Path, raw: dict, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """config.json's sizes against the checkpoint's tensors, before a model is built from them: a config that
    claims 10**6 layers or a vocabulary of 10**10 (or merely another model's sizes) would have the export build
    and trace that model. Where a layer stack is found, its layers are num_hidden_layers (plus DeepSeek's
    next-token-prediction layers), or HRM's num_layers_per_stack (its num_hidden_layers counts the layers its
    stacks apply in cycles); where a token embedding is, its rows are vocab_size and its columns hidden_size (or
    the config's own embedding width). Otherwise no size may exceed what the checkpoint holds."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw

    def size(*keys: str) -> tuple[str, int | None]:
        for key in keys:
            value = text.get(key, raw.get(key))
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise InputError(f"{path}: {key} {value!r} is not a positive integer")
                return key, value
        return keys[0], None

    def refuse(why: str):
        raise InputError(f"{path}: {why}")

    layers_key, layers = size("num_hidden_layers", "n_layer", "num_layers")
    vocab_key, vocab = size("vocab_size")
    hidden_key, hidden = size("hidden_size", "n_embd", "d_model")
    width_key, width = size("embedding_size", "word_embed_proj_dim")
    if width is None:
        width_key, width = hidden_key, hidden
    stacks: dict[str, set[int]] = {}
    for name in tensors:
        found = _LAYER.match(name)
        if found:
            stacks.setdefault(found[1], set()).add(int(found[2]))
    if layers and stacks:
        extra = text.get("num_nextn_predict_layers", raw.get("num_nextn_predict_layers"))
        counts = {layers, layers + (extra if isinstance(extra, int) and extra > 0 else 0)}
        per_stack = text.get("num_layers_per_stack", raw.get("num_layers_per_stack"))
        if isinstance(per_stack, int) and 0 < per_stack < layers:  # (HRM)
            counts.add(per_stack)
        if not any(ix == set(range(len(ix))) and len(ix) in counts for ix in stacks.values()):
            prefix, ix = max(stacks.items(), key=lambda item: len(item[1]))
            refuse(f"{layers_key} is {layers}, the checkpoint holds {len(ix)} layers ({prefix}.*, numbered "
                   f"{min(ix)} to {max(ix)})")
    elif layers and layers > len(tensors):
        refuse(f"{layers_key} is {layers}, the checkpoint holds {len(tensors)} tensors in all")
    embeddings = {n: shape for n, (_, shape) in tensors.items()
                  if len(shape) == 2 and any(n == e or n.endswith("." + e) for e in _EMBEDDINGS)}
    first = next(iter(embeddings), None)
    if vocab and first and not any(rows == vocab for rows, _ in embeddings.values()):
        refuse(f"{vocab_key} is {vocab}, the checkpoint's {first} has {embeddings[first][0]} rows")
    if width and first and not any(cols == width for _, cols in embeddings.values()):
        refuse(f"{width_key} is {width}, the checkpoint's {first} has {embeddings[first][1]} columns")
    weights = sum(math.prod(shape) for _, shape in tensors.values())
    for key, value in ((vocab_key, vocab), (hidden_key, hidden)):
        if value and not first and value > weights:
            refuse(f"{key} is {value}, the checkpoint holds {weights} weights in all")


def _load_config(folder: Path, raw: dict):
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        first = first_line(e)
        raise UnsupportedError(f"model type {raw['model_type']!r} is unknown to transformers "
                               f"{transformers.__version__}: {first[:200]}") from None


def _model_class(config, task: str):
    """The transformers class for the task; refuse a task the checkpoint cannot do."""
    from transformers.models.auto import modeling_auto

    causal = task != "feature-extraction"
    mapping = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING if causal else modeling_auto.MODEL_MAPPING
    try:
        cls = mapping[type(config)]
    except KeyError:
        kind = "a causal LM (no AutoModelForCausalLM class)" if causal else "a base model (no AutoModel class)"
        raise UnsupportedError(f"model type {config.model_type!r} cannot do {task}: it has no {kind}") from None
    if causal:
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedError(f"model type {config.model_type!r} is an encoder-decoder: {task} exports "
                                   "decoder-only models")
        causal_names = {c.__name__ for c in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING.values()
                        if isinstance(c, type)}
        archs = list(getattr(config, "architectures", None) or [])
        if archs and not any(a in causal_names for a in archs):
            raise UnsupportedError(f"the checkpoint ({', '.join(archs)}) has no language-model head: it cannot do "
                                   f"{task} (feature-extraction exports it)")
    return cls


def _with_past_refusal(config) -> str | None:
    """Why the with-past export cannot keep this model's cache, or None."""
    try:
        _with_past_supported(config)
    except UnsupportedError as e:
        return str(e)
    return None


def _with_past_supported(config) -> None:
    """Full-attention and sliding-window layers. A sliding layer's cache is exported whole, as a full layer's
    (the wrappers' DynamicCache has no config, so no layer crops its cache to the window): the model's sliding
    mask, computed over the whole cache, keeps only the window, so the logits are those of transformers' cropped
    cache, at the cost of a cache that grows with the context. Other layer kinds are refused."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedError(f"text-generation-with-past exports full-attention and sliding-window caches only; "
                               f"model type {config.model_type!r} has {', '.join(other)} layers")


# Weights a base model has and a checkpoint may lack without changing last_hidden_state (BertModel's pooler).
_OFF_PATH = ("pooler.",)


def _experts_kwargs(cls, notes: list[str]) -> dict:
    """transformers' default experts implementation is the grouped_mm custom op, which torch.onnx cannot export;
    batched_mm (gathered expert weights + bmm) exports."""
    if not cls._can_set_experts_implementation():
        return {}
    note = ("mixture of experts: experts exported with experts_implementation='batched_mm' (the default "
            "grouped_mm does not export)")
    if note not in notes:
        notes.append(note)
    return {"experts_implementation": "batched_mm"}


def _load_model(folder: Path, cls, config, task: str, notes: list[str]):
    """The checkpoint loaded by transformers in fp32 (the check's reference; the export's fallback)."""
    import torch
    from transformers.utils import logging as tf_logging

    tf_logging.set_verbosity_error()  # the load report and progress bars: failures are reported here, one line
    tf_logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(str(folder), config=config, local_files_only=True, trust_remote_code=False,
                                          dtype=torch.float32, output_loading_info=True, use_safetensors=True,
                                          **_experts_kwargs(cls, notes))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise InputError(f"{folder}: transformers cannot load the checkpoint as {cls.__name__}: "
                         f"{first_line(e, 300)}") from None
    except ImportError as e:  # (a quantized checkpoint whose format needs a package transformers lacks here)
        raise UnsupportedError(f"{folder}: transformers needs a package to load this checkpoint: "
                               f"{first_line(e, 300)}") from None
    missing = sorted(info.get("missing_keys") or [])
    off_path = [k for k in missing if task == "feature-extraction" and any(p in k for p in _OFF_PATH)]
    if off_path:
        notes.append(f"{', '.join(off_path)} absent from the checkpoint: not on the last_hidden_state path")
        missing = [k for k in missing if k not in off_path]
    if missing:
        raise UnsupportedError(f"{folder}: the checkpoint lacks weights {cls.__name__} needs "
                               f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                               f"{len(missing)} in all)")
    return model.eval()


# --- wrappers: flat tensors in, flat tensors out --------------------------------------------------------------


def _wrappers():
    import torch
    from transformers import DynamicCache

    def flat_cache(cache) -> list:
        out = []
        for layer in cache.layers:
            out += [layer.keys, layer.values]
        return out

    class OneOutput(torch.nn.Module):
        """model(input_ids, attention_mask) without a cache -> one output tensor."""

        def __init__(self, model, output: str):
            super().__init__()
            self.model, self.output = model, output

        def forward(self, input_ids, attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
            return out[self.output]

    class Prefill(torch.nn.Module):
        """No past: an empty DynamicCache without a config (every layer kept whole, sliding ones too:
        _with_past_supported), filled by the model; returns logits and the cache."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=DynamicCache(), use_cache=True, return_dict=True)
            if getattr(out, "cache", None) is None:  # (RWKV returns a recurrent `state`)
                raise UnsupportedError(f"{type(self.model).__name__} returns no KV cache (its outputs: "
                                       f"{', '.join(out.keys())}): text-generation-with-past exports attention "
                                       "caches only")
            return (out.logits, *flat_cache(out.cache))

    class Decode(torch.nn.Module):
        """The past as flat tensors -> DynamicCache(ddp_cache_data=[(key, value) per layer]), whose
        layers concatenate the new keys and values; returns logits and the grown cache. forward's signature is
        generated (one named argument per past tensor): torch.export binds dynamic shapes to argument names."""

        def __init__(self, model, num_layers: int):
            super().__init__()
            self.model, self.num_layers = model, num_layers

        def run(self, input_ids, attention_mask, position_ids, past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True, return_dict=True)
            return (out.logits, *flat_cache(out.cache))

    def decode_class(num_layers: int):
        args = ", ".join(_past_args(num_layers))
        namespace: dict = {}
        exec(f"def forward(self, input_ids, attention_mask, position_ids, {args}):\n"  # noqa: S102 - names only
             f"    return self.run(input_ids, attention_mask, position_ids, ({args},))\n", namespace)
        return type(f"Decode{num_layers}", (Decode,), {"forward": namespace["forward"]})

    return OneOutput, Prefill, decode_class


def _past_args(num_layers: int) -> list[str]:
    return [f"past_{i}_{kv}" for i in range(num_layers) for kv in ("key", "value")]


def cache_names(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def position_ids_from_mask(mask):
    """What transformers' generate computes (torch or numpy): cumsum - 1, padded positions 0."""
    pos = mask.cumsum(-1) - 1
    return pos * (mask != 0)


# --- example inputs -------------------------------------------------------------------------------------------


def _tokens(batch: int, seq: int, vocab: int, seed: int):
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def _left_padded(batch: int, length: int, pad: int):
    import torch

    mask = torch.ones(batch, length, dtype=torch.int64)
    mask[0, :pad] = 0
    return mask


def _pad_id(config) -> int:
    """The id generate pads prompts with (graphconv.runtime.decoding.pad_id on the config's ids)."""
    ids = {key: _attr(config, key) for key in ("pad_token_id", "eos_token_id")}
    return decoding.pad_id({**ids, "vocab_size": _attr(config.get_text_config(decoder=True), "vocab_size")})


def with_pad_ids(inputs: dict, pad: int) -> dict:
    """`inputs` with the ids at the masked positions set to the pad id, as a left-padded batch from generate
    holds them (a pad token's embedding, often zeros, then goes through the model: Helium's epsilon-less norm
    gave NaN there and random ids hid it). The mask covers past + seq positions, the ids the last seq."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None or mask is None or ids.ndim != 2 or mask.ndim != 2:
        return inputs
    ids = ids.clone()
    ids[mask[:, mask.shape[1] - ids.shape[1]:] == 0] = pad
    return {**inputs, "input_ids": ids}


def _decode_inputs(batch: int, past: int, seq: int, vocab: int, layers: list[tuple[int, int, int]],
                   seed: int) -> dict:
    """layers: per layer (kv heads, key head dim, value head dim)."""
    import torch

    mask = _left_padded(batch, past + seq, 2)
    g = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": _tokens(batch, seq, vocab, seed), "attention_mask": mask,
              "position_ids": position_ids_from_mask(mask)[:, past:].contiguous()}
    for name, (heads, key_dim, value_dim) in zip(_past_args(len(layers)), [s for s in layers for _ in "kv"]):
        inputs[name] = torch.randn(batch, heads, past, key_dim if name.endswith("_key") else value_dim, generator=g)
    return inputs


# --- the export -----------------------------------------------------------------------------------------------


def _io(path: Path) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    return {"inputs": {vi.name: value_dims(vi) for vi in model.graph.input if vi.name not in inits},
            "outputs": {vi.name: value_dims(vi) for vi in model.graph.output}}


def _generation_config(folder: Path, config) -> dict:
    """The token ids (generation_config.json's over config.json's) and the sampling settings it gives."""
    ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    gen = folder / "generation_config.json"
    raw = {}
    if gen.is_file():
        try:
            raw = json.loads(gen.read_text())
        except ValueError:
            pass
        for k in ids:
            if isinstance(raw, dict) and raw.get(k) is not None:
                ids[k] = raw[k]
    sampling = decoding.sampling_settings(raw)
    return {**ids, **({"sampling": sampling} if sampling else {})}


def _out_dir_free(out_dir: Path) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        raise InputError(f"-o {out_dir} already exists (a checkpoint export writes a new directory)")
    if not out_dir.parent.is_dir():
        raise InputError(f"-o {out_dir}: the directory {out_dir.parent} does not exist")


def _check_arguments(folder: Path, out_dir: Path, task: str, dtype: str) -> None:
    if task not in tasks.NAMES:
        raise InputError(f"unknown task {task!r} (choose from {', '.join(tasks.NAMES)})")
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if not folder.is_dir():
        raise InputError(f"{folder}: no such checkpoint folder")
    _out_dir_free(out_dir)


def export_checkpoint(source: str | Path, out_dir: str | Path, task: str, *, dtype: str = "fp32",
                      opset: int = DEFAULT_OPSET, progress=None) -> CheckpointExport:
    """Export the checkpoint folder `source` for `task` into the new directory `out_dir`. Task "auto" takes
    the task the config implies (graphconv.frontend.tasks), and says which through `progress`."""
    folder, out_dir = Path(source), Path(out_dir)
    _check_arguments(folder, out_dir, task, dtype)
    raw = _read_config(folder)
    quant = quantized_checkpoint.scheme(folder, raw)  # (a format it does not read: one line, now)
    files = _weight_files(folder)
    tensors = _headers(files)
    _check_sizes(folder / "config.json", raw, tensors)
    stored = {_SAFETENSORS_FLOAT[d] for d, _ in tensors.values() if d in _SAFETENSORS_FLOAT}
    require_torch("graphconv export of a checkpoint folder", transformers=True)
    config = _load_config(folder, raw)
    if task == "auto":
        chosen = tasks.infer(config, _with_past_refusal)
        task = chosen.name
        if progress is not None:
            progress.info(f"task {task} (--task auto): {chosen.why}")
    tasks.check_exported(task, config.model_type)
    cls = _model_class(config, task)
    tasks.check_text_inputs(cls, task)
    if task == "text-generation-with-past":
        _with_past_supported(config)
    notes: list[str] = []
    if quant is not None:
        stored.discard("fp8")  # (dequantized: float32(q) * scale, then stored as --dtype says)
    store = _store_dtype(dtype, stored, notes)
    say = progress.info if progress is not None else (lambda _m: None)

    tmp = partial_dir(out_dir)
    try:
        checkpoint = _checkpoint(files, quant, notes)
        graphs, shapes = _export_and_check(folder, checkpoint, cls, config, task, tmp, opset, store, say, notes)
        text = config.get_text_config(decoder=True)
        generation = {
            "model_type": config.model_type,
            "task": task,
            **_generation_config(folder, config),
            "num_layers": shapes.get("num_layers", _attr(text, "num_hidden_layers")),
            "num_kv_heads": shapes.get("num_kv_heads", _attr(text, "num_key_value_heads")
                                       or _attr(text, "num_attention_heads")),
            "head_dim": shapes.get("head_dim", _head_dim(text)),
            **{k: shapes[k] for k in ("value_head_dim", "cache_layers") if k in shapes},
            "vocab_size": _attr(text, "vocab_size"),
            "hidden_size": _attr(text, "hidden_size"),
            "max_position_embeddings": _attr(text, "max_position_embeddings"),
            "dtype": store,
            "stored_dtypes": sorted(stored),
            "opset": opset,
            "graphs": {name: {"file": r.path.name, "exporter": r.exporter, "opset": r.opset, **_io(r.path),
                              **({} if r.serves_prompt is None else {"serves_prompt": r.serves_prompt}),
                              "checks": [{k: c[k] for k in ("shape", "output", "inputs", "max_abs", "ok", "layers")
                                          if k in c} for c in r.checks]}
                       for name, r in graphs.items()},
            "notes": notes + [n for r in graphs.values() for n in r.warnings],
        }
        if task == "text-generation-with-past":
            generation["cache_layout"] = CACHE_LAYOUT
            generation["position_ids"] = POSITION_IDS
            generation["cache_names"] = {"past": "past_key_values.{i}.key|value", "present": "present.{i}.key|value"}
            generation["cache_dtype"] = _cache_dtype(graphs["decode"].path)
            if tokenizer.copy(folder, tmp / "tokenizer"):
                generation["tokenizer"] = "tokenizer"
        schema.write(tmp / schema.FILE, generation)
        _out_dir_free(out_dir)
        with interrupts.final_moves():
            os.rename(release(tmp), out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for r in graphs.values():
        r.path = out_dir / r.path.name
    return CheckpointExport(out_dir, task, config.model_type, graphs, generation)


def _cache_dtype(path: Path) -> str:
    """fp32 | bf16 | fp16: the decode graph's past_key_values type (the compute's; `dtype` is the weights')."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    past = next(vi for vi in graph.input if vi.name.startswith("past_key_values."))
    return FLOAT_TYPE_NAMES[past.type.tensor_type.elem_type]


def _div(a, b):
    return a // b if a and b else None


def _store_dtype(dtype: str, stored: set[str], notes: list[str]) -> str:
    """fp32 | bf16 | fp16: the dtype the ONNX initializers are stored in (`auto`: the checkpoint's own)."""
    floats = stored & {"fp32", "bf16", "fp16"}
    if dtype == "auto":
        dtype = next(iter(floats)) if len(floats) == 1 else "fp32"
        if len(floats) > 1:
            notes.append(f"--dtype auto: the checkpoint mixes {', '.join(sorted(floats))}; stored as fp32")
    if dtype == "fp32":
        if stored - {"fp32"}:
            notes.append(f"weights stored in {', '.join(sorted(stored - {'fp32'}))} were upcast to fp32 (--dtype fp32)")
        return dtype
    notes.append(f"weights stored as {dtype} with a Cast to fp32 where they are read: the graph computes in fp32 "
                 "(compile --precision brings the compute down)")
    if floats - {dtype}:
        notes.append(f"weights stored in {', '.join(sorted(floats - {dtype}))} were rounded to {dtype}")
    return dtype


# --- the export -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Graph:
    """One graph to write: its wrapper around the model, the inputs it is traced and checked at."""
    name: str
    wrap: object  # model -> torch.nn.Module
    inputs: dict
    second: dict | None
    axes: dict
    input_names: list[str]
    output_names: list[str]
    masked_axes: dict
    rename: tuple[str, str] | None = None
    prompt: dict | None = None  # the decode graph's inputs at an empty cache: a prompt, as the prefill takes it


def _graphs(task: str, config, cache: list[tuple[int, int, int]] | None) -> list[_Graph]:
    """The graphs of `task`; `cache` = per layer (kv heads, key head dim, value head dim) for the with-past pair."""
    OneOutput, Prefill, decode_class = _wrappers()
    vocab = _attr(config.get_text_config(decoder=True), "vocab_size") or 128
    vocab = min(vocab, 1000)  # example ids: any in-vocabulary ids do
    batch, seq = 2, 7
    pad = _pad_id(config)
    plain = with_pad_ids({"input_ids": _tokens(batch, seq, vocab, 0), "attention_mask": _left_padded(batch, seq, 2)},
                         pad)
    plain_axes = {"input_ids": {0: BATCH, 1: SEQ}, "attention_mask": {0: BATCH, 1: SEQ}}
    if task in ("text-generation", "feature-extraction"):
        output = "logits" if task == "text-generation" else "last_hidden_state"
        return [_Graph("model", lambda m: OneOutput(m, output), plain, None, plain_axes, list(plain), [output], {})]
    num_layers = len(cache or [])  # no cache yet: the prefill, to run for its shape
    present = cache_names("present", num_layers)
    masked = {n: (0, 2) for n in present}
    prefill_inputs = {**plain, "position_ids": position_ids_from_mask(plain["attention_mask"])}
    prefill_axes = {**plain_axes, "position_ids": {0: BATCH, 1: SEQ}}
    prefill = _Graph("prefill", Prefill, prefill_inputs, None, prefill_axes, list(prefill_inputs),
                     ["logits", *present], masked)
    if cache is None:
        return [prefill]
    axes = {"input_ids": {0: BATCH, 1: SEQ}, "attention_mask": {0: BATCH, 1: _TOTAL_EXPORTED},
            "position_ids": {0: BATCH, 1: SEQ}, **{n: {0: BATCH, 2: PAST} for n in _past_args(num_layers)}}
    # decode: seq 2 at export (size 1 would be specialised); the second shape changes batch, past and seq
    first = _decode_inputs(2, 5, 2, vocab, cache, 1)
    second = _decode_inputs(3, 8, 1, vocab, cache, 2)
    prompt = with_pad_ids(_decode_inputs(batch, 0, seq, vocab, cache, 3), pad)
    return [prefill,
            _Graph("decode", lambda m: decode_class(num_layers)(m, num_layers), first, second, axes,
                   ["input_ids", "attention_mask", "position_ids", *cache_names("past_key_values", num_layers)],
                   ["logits", *present], masked, (_TOTAL_EXPORTED, TOTAL), prompt)]


def _cache_shape(prefill, inputs: dict, mode, model_type: str) -> list[tuple[int, int, int]]:
    """Per layer (kv heads, key head dim, value head dim), from one prefill run on fake tensors (nothing is
    computed). Layers may differ (Gemma 4's global layers have other head counts and dims than its sliding ones),
    and keys from values: transformers' MLA (DeepSeek-V3, MiniCPM3) caches the compressed latent (kv_lora_rank,
    512 in DeepSeek-V3) as the keys and the rotated key (64) as the values, one head each, and decompresses both
    at every step."""
    import torch

    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
        flat = prefill(**inputs)[1:]
    if len(flat) % 2 or any(t.dim() != 4 for t in flat):
        raise UnsupportedError(f"model type {model_type!r}: the cache is not a [batch, kv heads, seq, head dim] key "
                               "and value per layer")
    layers = []
    for key, value in zip(flat[0::2], flat[1::2]):
        if key.shape[1] != value.shape[1]:
            raise UnsupportedError(f"model type {model_type!r}: a cache layer's keys and values have different head "
                                   f"counts ({key.shape[1]}, {value.shape[1]})")
        layers.append((int(key.shape[1]), int(key.shape[3]), int(value.shape[3])))
    return layers


# The whole model is checked against PyTorch when the fp32 model and onnxruntime's copy fit in this share of
# the available memory; otherwise the architecture truncated to its first CHECK_LAYERS layers, with the
# checkpoint's own weights, is written the same way and checked (the compile verifies every layer).
CHECK_MEMORY_SHARE = 0.5
CHECK_LAYERS = 2
EXTERNAL_DATA_BYTES = 1 << 30  # graphs with more weight bytes keep them in FILE.onnx.data (protobuf stops at 2 GB)


def _checkpoint(files: list[Path], quant, notes: list[str]):
    """The checkpoint's tensors as the export reads them: as stored, or dequantized where the format says
    (`quant`, from quantized_checkpoint.scheme, gives the view, whose note leads `notes`)."""
    from graphconv.frontend import weightless_export as wl

    checkpoint = wl.Checkpoint(files)
    if quant is None:
        return checkpoint
    view = quant.view(checkpoint)
    notes.insert(0, view.note)
    return view


def _export_and_check(folder: Path, checkpoint, cls, config, task: str, tmp: Path, opset: int, store: str, say,
                      notes: list[str]) -> tuple[dict, dict]:
    import psutil

    fp32_bytes = 4 * sum(math.prod(shape) for _f, _d, shape in checkpoint.entries.values())
    full = 2 * fp32_bytes <= CHECK_MEMORY_SHARE * psutil.virtual_memory().available
    layers = _attr(config.get_text_config(decoder=True), "num_hidden_layers")
    graphs, shapes = _write(cls, config, checkpoint, task, tmp, opset, store, say, notes, folder)
    pad = _pad_id(config)
    if full or not layers or layers <= CHECK_LAYERS:
        say("check against PyTorch")
        _check_all(lambda: _reference(folder, cls, config, task, checkpoint), graphs, pad)
    else:
        small = _truncated(config, CHECK_LAYERS)
        say(f"check against PyTorch: the first {CHECK_LAYERS} of {layers} layers, with the checkpoint's weights "
            f"(the whole model's {fp32_bytes / 2**30:.1f} GiB in fp32 twice exceed "
            f"{CHECK_MEMORY_SHARE:.0%} of the available memory)")
        part = tmp / ".check"
        part.mkdir()
        checked, _ = _write(cls, small, checkpoint, task, part, opset, store, lambda _m: None, [], folder)
        _check_all(lambda: _reference(folder, cls, small, task, checkpoint), checked, pad)
        for name, r in graphs.items():
            r.checks = [{**c, "layers": f"first {CHECK_LAYERS} of {layers}"} for c in checked[name].checks]
            r.warnings += checked[name].warnings
            r.serves_prompt = checked[name].serves_prompt
        shutil.rmtree(part)
        notes.append(f"checked against PyTorch on the architecture truncated to its first {CHECK_LAYERS} of "
                     f"{layers} layers with the checkpoint's weights (the fp32 model did not fit in memory "
                     "twice); the compile verifies every layer")
    return graphs, shapes


def _reference(folder: Path, cls, config, task: str, checkpoint):
    """The model the export is checked against: transformers' load of the folder, or, for a weight-only quantized
    checkpoint, the float model holding the format's dequantized weights (frontend/quantized_linears.py)."""
    from graphconv.frontend import quantized_activations, quantized_linears

    if isinstance(checkpoint, quantized_activations.QuantizedCheckpoint):
        return quantized_activations.fake_quantized_model(cls, config, checkpoint)
    if isinstance(checkpoint, quantized_linears.WeightOnlyCheckpoint):
        return quantized_linears.dequantized_model(cls, config, checkpoint)
    return _load_model(folder, cls, config, task, [])


def _truncated(config, layers: int):
    """A copy of `config` with its text model cut to `layers` layers (per-layer lists cut too)."""
    small = copy.deepcopy(config)
    text = small.get_text_config(decoder=True)
    text.num_hidden_layers = layers
    for key in ("layer_types", "mlp_layer_types", "sliding_window_pattern_list"):
        value = _attr(text, key)
        if isinstance(value, list):
            setattr(text, key, value[:layers])
    return small


def _write(cls, config, checkpoint, task: str, tmp: Path, opset: int, store: str, say, notes: list[str],
           folder: Path) -> tuple[dict, dict]:
    """Trace the model with fake weights and write each graph with its weights read from the checkpoint; where
    the checkpoint's tensors are not the parameters one to one, the model is loaded and its weights written."""
    import torch

    from graphconv.frontend import weightless_export as wl

    kwargs = _experts_kwargs(cls, notes)
    model, mode = wl.fake_model(cls, config, torch.float32, **kwargs)
    try:
        keys = wl.plan(model, checkpoint)
        source = checkpoint
    except wl.NotPlain as e:
        if getattr(checkpoint, "linears", None) is not None:  # (transformers would read the integers otherwise)
            raise InputError(f"{folder}: {e}: the quantized checkpoint does not fit {cls.__name__}") from None
        notes.append(f"weights loaded into memory to export: {e} (transformers converts it at load)")
        model, mode = _load_model(folder, cls, config, task, notes), None
        source = wl.ModuleWeights(model)
        keys = {name: name for name in source.entries}
    _traced_notes(cls, config, model, notes)
    graphs = _graphs(task, config, None)
    shapes: dict = {}
    if task == "text-generation-with-past":
        prefill = graphs[0]
        cache = _cache_shape(prefill.wrap(model), prefill.inputs, mode, config.model_type)
        heads, head_dim, value_dim = cache[0]
        shapes = {"num_layers": len(cache), "num_kv_heads": heads, "head_dim": head_dim,
                  **({"value_head_dim": value_dim} if value_dim != head_dim else {}),
                  **({"cache_layers": [list(c) for c in cache]} if len(set(cache)) > 1 else {})}
        graphs = _graphs(task, config, cache)
    results = {}
    for g in graphs:
        say(f"export {g.name}.onnx" + (f" ({shapes['num_layers']} layers, cache [batch, {shapes['num_kv_heads']}, "
                                        f"seq, {shapes['head_dim']}])" if g.name == "prefill" else ""))
        try:
            with export_rewrites.exportable(config):
                ir_model = wl.export_graph(g.wrap(model), g.inputs, g.axes, opset, g.input_names, g.output_names)
        except Exception as e:  # noqa: BLE001 - the exporter's own failure, reported as such
            raise UnsupportedError(f"PyTorch's dynamo exporter refused the model at opset {opset}: "
                                   f"{exporter_failure(e)}") from None
        fixed = fixed_dynamic_axes(ir_model, g.inputs, g.input_names, g.axes)
        if fixed:
            raise UnsupportedError(f"{g.name}.onnx: {fixed}")
        nbytes = _attach(ir_model, source, keys, store, g.name, notes)
        if g.rename:
            wl.rename_dim(ir_model, *g.rename)
        path = tmp / f"{g.name}.onnx"
        wl.save(ir_model, path, external=nbytes > EXTERNAL_DATA_BYTES)
        del ir_model
        results[g.name] = ExportResult(path, "dynamo", opset, [], [])
        results[g.name].graph = g
        results[g.name].serves_prompt = None
    return results, shapes


def _traced_notes(cls, config, model, notes: list[str]) -> None:
    """The notes on how the model was traced: its attention implementation, the export rewrites, tied weights."""
    attn = getattr(model.config, "_attn_implementation", None)
    note = f"{cls.__name__}, attention implementation {attn!r} (transformers' default)"
    if note not in notes:
        notes.append(note)
    rewrite = export_rewrites.names(config.model_type)
    if rewrite and f"traced: {rewrite}" not in notes:
        notes.append(f"traced: {rewrite}")
    tied = _tied(model)
    if tied:
        notes.append(f"tied parameters ({'; '.join(' = '.join(n) for n in tied)}): stored once")


def _attach(ir_model, source, keys: dict, store: str, graph: str, notes: list[str]) -> int:
    """The checkpoint's weights attached (weightless_export.attach_weights); a quantized linear's MatMuls then
    MatMulNBits (frontend/quantized_linears.py), the weights kept in float noted. Returns the bytes the
    initializers take."""
    from graphconv.frontend import quantized_activations, quantized_linears
    from graphconv.frontend import weightless_export as wl

    attached: dict[str, str] = {}
    nbytes = wl.attach_weights(ir_model, source, keys, "model.", store, attached)
    static = getattr(source, "static", None)
    if not getattr(source, "linears", None) and not static:
        return nbytes
    kept = quantized_linears.to_matmul_nbits(ir_model, source.linears, attached)
    qdq = quantized_activations.to_qdq(ir_model, static, attached) if static else 0
    written = sum(1 for n in ir_model.graph if n.op_type == "MatMulNBits")
    line = (f"{graph}.onnx: {written} MatMulNBits carry the checkpoint's integers"
            + (f", {qdq} static W8A8 linears as QDQ (int8 weights, activations quantized)" if static else "")
            + (f"; {len(kept)} quantized weights kept in float ({'; '.join(kept[:3])}"
               f"{' ...' if len(kept) > 3 else ''})" if kept else ""))
    notes.append(line)
    return sum(v.const_value.nbytes for v in ir_model.graph.initializers.values() if v.const_value is not None)


def _tied(model) -> list[list[str]]:
    by_object: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(p), []).append(name)
    return [names for names in by_object.values() if len(names) > 1]


class _Recorded:
    """A model wrapper's outputs at the inputs it was run at, computed up front: the check runs PyTorch at
    every case first and frees the model before onnxruntime loads its copy, so the two are never in memory
    together. `recorded` with the same input tensors gives what export.torch_outputs gave."""

    def __init__(self):
        self._outputs: dict[tuple, object] = {}

    def record(self, module, inputs: dict) -> None:
        from graphconv.frontend.export import torch_outputs

        self._outputs[self._key(inputs)] = torch_outputs(module, inputs)

    @staticmethod
    def _key(inputs: dict) -> tuple:
        return tuple(id(v) for v in inputs.values())

    def recorded(self, inputs: dict) -> tuple[tuple, list[str]]:
        """(outputs, top-k ties) as export.torch_outputs gave them."""
        return self._outputs[self._key(inputs)]


def _check_all(load_model, results: dict, pad: int) -> None:
    """Each written graph against the real model's wrapper at its two shapes (export.check_against_torch); the
    decode graph also at an empty cache, where it computes a prompt as the prefill does: `serves_prompt` says
    whether it did (the compile then writes that one graph for both steps, weights once). `load_model()` gives
    the model, whose outputs are recorded before any onnxruntime session (_Recorded). The masked positions of
    each case hold the pad id (with_pad_ids)."""
    import gc

    from graphconv.frontend.export import check_case
    from graphconv.verify.reference import Oracle

    real = load_model()
    recorded, seconds, prompt_failed = {}, {}, {}
    for name, r in results.items():
        g = r.graph
        module = g.wrap(real).eval()
        seconds[name] = with_pad_ids(g.second if g.second is not None else grown_inputs(g.inputs, g.axes), pad)
        recorded[name] = _Recorded()
        for inputs in (g.inputs, seconds[name]):
            recorded[name].record(module, inputs)
        if g.prompt is not None:
            try:
                recorded[name].record(module, g.prompt)
            except Exception as e:  # noqa: BLE001 - PyTorch refused an empty cache: the prefill serves the prompt
                prompt_failed[name] = e
    del real, module
    gc.collect()
    for name, r in results.items():
        g = r.graph
        graph_names = dict(zip(g.inputs, g.input_names))
        check_against_torch(recorded[name], r, g.inputs, seconds[name], graph_names, g.output_names, g.masked_axes)
        if g.prompt is None:
            continue
        try:
            if name in prompt_failed:
                raise prompt_failed[name]
            r.checks += check_case(recorded[name], Oracle(r.path), "empty cache", g.prompt, graph_names,
                                   g.output_names, g.masked_axes)
            r.serves_prompt = True
        except Exception as e:  # noqa: BLE001 - any failure means: keep the prefill graph for the prompt
            first = first_line(e)
            r.warnings.append(f"{name}.onnx at an empty cache does not compute the prompt ({first[:200]}): the "
                              "compile keeps prefill.onnx for the prompt")
            r.serves_prompt = False
