"""generation.json, typed: the one file that says how a folder generates (the export folder `graphconv export
--task text-generation-with-past` writes, and the GEN_DIR `graphconv compile` writes from it or from another
generation source). Its fields are the TypedDicts below; `write` is its one writer, which every producer calls
(graphconv/frontend/hf_export.py, the source readers of graphconv/generation/sources.py, the build, the deploy
bundle), and `read` its reader, which names in one line what a folder written before a field existed lacks.

Kept in the lowest layer (it imports graphconv.errors only): the export (graphconv.frontend) and the deploy
bundle write the file too, and they are below the generation package.

Versions: 1 is the first with `schema_version`; a file without one is version 0, read as long as it holds the
fields the reader needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

from graphconv.dtypes import PRECISION_DTYPES
from graphconv.errors import InputError, InternalError
from graphconv.json_io import read_json

SCHEMA_VERSION = 1
TASK = "text-generation-with-past"
GRAPHS = ("prefill", "decode")  # the two steps of generation, in the order they run
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")  # what a graph with its cache held in place takes
FILE = "generation.json"


class State(TypedDict, total=False):
    """A step's KV cache held in place in its MindIR's Parameters (passes/stateful_cache.py)."""

    max_batch: int
    max_seq_len: int
    inputs: list[str]  # the step inputs the stateful MindIR takes (STEP_INPUTS it has)
    outputs: list[str]  # ["logits"]
    params: dict  # the cache Parameters' names, shapes and dtypes (their bytes stripped, zeros at load)
    cpu_params: dict  # the cpu MindIR's, where a low precision makes them differ


class Graph(TypedDict, total=False):
    """One step's graph: its ONNX file, its MindIR, its inputs and outputs with their dims."""

    file: str  # the ONNX graph, in the source folder
    mindir: str  # the MindIR's stem in GEN_DIR (default: the step's name)
    inputs: dict  # {name: dims}
    outputs: dict  # {name: dims}
    empty_cache: bool  # the prompt runs this graph with empty past inputs
    serves_prompt: bool  # the export checked the decode graph at an empty cache against PyTorch's prompt
    exporter: str
    opset: int
    checks: list  # the export's checks against PyTorch
    state: State


class TensorParallel(TypedDict, total=False):
    """A GEN_DIR compiled with --tp: each rank's MindIR and how they run."""

    tp: int
    target: str
    mindirs: list[str]
    cpu_mindirs: list[str]
    plan: str
    run: str


class CpuTwin(TypedDict):
    """Why a GEN_DIR has no cpu MindIRs."""

    written: bool
    reason: str


class Generation(TypedDict, total=False):
    """The whole file."""

    schema_version: int
    task: str
    model_type: str | None
    source: str  # what the folder was made from, where not `graphconv export`
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    pad_token_id: int | None
    sampling: dict  # temperature, top_k, top_p of the checkpoint's generation config
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    value_head_dim: int
    cache_layers: list  # per layer [kv heads, key head dim, value head dim], where they differ
    vocab_size: int | None
    hidden_size: int | None
    max_position_embeddings: int | None
    dtype: str  # the weights' (fp32 | fp16 | bf16)
    cache_dtype: str
    stored_dtypes: list[str]
    opset: int
    cache_layout: str
    cache_names: dict
    cache_feeds: dict  # {output: the input the next step takes it as}, where not present.* -> past_key_values.*
    position_ids: str
    prompt_padding: str  # "none": prompts of one length run together, unpadded
    tokenizer: str | None  # the folder of tokenizer files, inside this one
    notes: list[str]
    graphs: dict  # {step or graph name: Graph}
    source_dir: str  # GEN_DIR: the source folder, where --check finds the ONNX graphs
    cpu_twin: CpuTwin
    tensor_parallel: TensorParallel


_KINDS = {"graphs": Graph, "state": State, "tensor_parallel": TensorParallel, "cpu_twin": CpuTwin}


def _unknown(value: dict, kind: type, where: str) -> list[str]:
    """The keys of `value` its TypedDict does not declare, and those of its nested entries."""
    fields = kind.__annotations__
    odd = [f"{where}{k}" for k in value if k not in fields]
    for key, nested in value.items():
        if key == "graphs" and isinstance(nested, dict):
            odd += [n for g, graph in nested.items() for n in _unknown(graph, Graph, f"graphs.{g}.")]
        elif key in _KINDS and key != "graphs" and isinstance(nested, dict):
            odd += _unknown(nested, _KINDS[key], f"{where}{key}.")
    return odd


def write(path: Path, meta: Generation) -> None:
    """Write `meta` as `path` with the current schema_version. A field the schema does not declare is a
    producer's bug (InternalError), caught here rather than by the reader of an odd file."""
    odd = _unknown(meta, Generation, "")
    if odd or "task" not in meta or not isinstance(meta.get("graphs"), dict):
        raise InternalError(f"{path.name}: fields outside the schema ({', '.join(odd[:4])})" if odd else
                            f"{path.name}: task and graphs are required")
    Path(path).write_text(json.dumps({**meta, "schema_version": SCHEMA_VERSION}, indent=2, default=str) + "\n")


def read(folder: Path, *, compiled: bool = True) -> Generation:
    """The generation.json of `folder`, checked: its version is one this graphconv reads, its task is
    generation's, and it holds what a reader needs (`compiled`: a GEN_DIR's two steps with their inputs and
    outputs; else an export folder's decode graph). InputError names every missing field at once."""
    path = Path(folder) / FILE
    meta = read_json(path)
    version = meta.get("schema_version", 0)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise InputError(f"{path}: schema_version {version!r}: written by a newer graphconv (this one reads up to "
                         f"{SCHEMA_VERSION})")
    if meta.get("task") != TASK:
        raise InputError(f"{path}: task {meta.get('task')!r} is not {TASK}" + (
            "" if compiled else " (compile its model.onnx instead)"))
    missing = lacking(meta, compiled)
    if missing:
        age = "" if version == SCHEMA_VERSION else \
            f" (schema version {version}; this graphconv writes {SCHEMA_VERSION})"
        raise InputError(f"{path}: lacks {', '.join(missing)}{age}: " + (
            "compile the export folder again" if compiled else "export the checkpoint again"))
    return meta


def lacking(meta: dict, compiled: bool = True) -> list[str]:
    """The fields a reader needs that `meta` does not hold, by their dotted names."""
    graphs = meta.get("graphs")
    if not isinstance(graphs, dict):
        return ["graphs"]
    steps = GRAPHS if compiled else ("decode",)
    missing = [f"graphs.{g}" for g in steps if not isinstance(graphs.get(g), dict)]
    if compiled:
        missing += [f"graphs.{g}.{k}" for g in steps if isinstance(graphs.get(g), dict)
                    for k in ("inputs", "outputs") if not graphs[g].get(k)]
    return missing


def cache_dtype(meta: Generation) -> str:
    """The cache's dtype: cache_dtype; in a file written before it existed, `dtype` (then the same)."""
    return meta.get("cache_dtype") or meta.get("dtype", "fp32")


def input_specs(inputs: dict, dtype: str) -> list[dict]:
    """A step's input placeholders (MindSpore's set_inputs, onnxruntime's feed) from generation.json's dims
    ({input: dims}): named dims dynamic, numbers fixed; ids, masks and positions int64, the cache in the
    model's dtype."""
    float_dtype = PRECISION_DTYPES.get(dtype, "float32")
    specs = []
    for name, dims in inputs.items():
        shape = [d if isinstance(d, int) else None for d in dims]
        cache = name not in STEP_INPUTS
        specs.append({"name": name, "shape": shape, "ms_dtype": float_dtype if cache else "int64",
                      "np_dtype": "float32" if cache and dtype == "bf16" else float_dtype if cache else "int64"})
    return specs
