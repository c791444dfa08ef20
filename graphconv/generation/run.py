"""`graphconv generate GEN_DIR`: greedy decoding (or sampling) with a compiled prefill + decode pair.

GEN_DIR holds what `graphconv compile X` writes for an `export --task text-generation-with-past` folder X:
prefill.mindir + decode.mindir (the --target's MindIRs), prefill.cpu.mindir + decode.cpu.mindir (MindSpore
CPU) and generation.json (X's, with "source_dir" pointing at X). The prompts are batched with left padding
(pad id: pad_token_id, else the first eos, else 0; attention mask 0 on the padding; position_ids =
cumsum(mask) - 1, padded positions 0, as generation.json says); the prefill runs once, then one decode step
per new token, present.* fed back as past_key_values.* and a 1 appended to the mask. A row that produced an
eos is finished: it is fed the pad id from then on (its mask keeps growing, as transformers' generate does)
and its sequence ends at the eos. The loop ends when every row is finished or max_new_tokens were made.
With sampling, each token is drawn as transformers' generate(do_sample=True) draws it (runtime/decoding.sampler),
with the checkpoint's temperature, top_k and top_p unless given.

A GEN_DIR compiled with --stateful-cache holds its cache in the MindIR's Parameters (generation.json's
graphs.<step>.state): each call then takes ids, mask and positions only, within the capacity it states.

MindSpore runs in a child process (graphconv.runtime.worker's "generate" task: both GraphCells loaded once,
the whole loop there); this parent checks the arguments and, with check=True, runs onnxruntime on the ONNX
pair through the same loop with MindSpore's tokens forced (graphconv/generation/check.py) and compares every
step's logits: a mismatch is a VerificationError (exit 2).

The ONNX pair for the check: `onnx_dir` if given, else generation.json's "source_dir", else GEN_DIR/onnx/;
file names from generation.json's graphs.{prefill,decode}.file.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from graphconv.errors import InputError, UnsupportedError, VerificationError
from graphconv.frontend import tokenizer
from graphconv.frontend.contained import inside
from graphconv.generation import check as checking
from graphconv.generation import schema
from graphconv.generation.schema import GRAPHS, Generation, cache_dtype
from graphconv.progress import SILENT, Progress
from graphconv.runtime import decoding

DEVICES = ("auto", "ascend", "cpu")
ATOL = 1e-4
# MindSpore's CPU backend running a whole decoder graph holds its weights, the fp32 casts of weights stored in
# bf16/fp16 and the activations: measured 1.97 times the weights' fp32 bytes on a 4-layer model of the 1.1B's
# shape (docs/performance.md; it was over 5.6 while those weights' MatMuls went through ops.matmul). A cpu run
# with less memory available per fp32 weight byte than this is refused rather than started and killed.
CPU_BYTES_PER_WEIGHT_BYTE = 3


@dataclasses.dataclass
class GenerationResult:
    sequences: list[list[int]]  # the new ids of each prompt (up to and including its eos)
    prompt_lengths: list[int]
    finish_reasons: list[str]  # "eos" | "length"
    device: str  # "cpu" | "ascend"
    steps: list[dict]  # with check: {"step", "max_abs", "argmax_match"} per step (0 = prefill)
    timings: dict = dataclasses.field(default_factory=dict)  # seconds: load, prefill, decode per step
    notes: list[str] = dataclasses.field(default_factory=list)
    texts: list[str] | None = None  # with text prompts: each prompt's new tokens decoded (special tokens skipped)
    sampling: dict | None = None  # with do_sample: temperature, top_k, top_p and the seed drawn with
    # with check: each step's last-position logits [batch, vocab] (Python API only, not in the JSON)
    step_logits: list | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "step_logits"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def ascend_available() -> bool:
    """An Ascend NPU on this host: the driver's /dev/davinciN device files."""
    return any(Path("/dev").glob("davinci[0-9]*"))


def parse_input_ids(text: str) -> list[list[int]]:
    """'1,2,3;4,5' -> [[1, 2, 3], [4, 5]]."""
    prompts = []
    for i, part in enumerate(text.split(";")):
        items = [s.strip() for s in part.split(",")]
        if items == [""]:
            raise InputError(f"--input-ids: prompt {i + 1} is empty")
        try:
            prompts.append([int(s) for s in items])
        except ValueError:
            raise InputError(f"--input-ids: prompt {i + 1} ({part.strip()!r}) is not comma-separated integers") \
                from None
    return prompts


def read_input_ids_file(path: Path) -> list[list[int]]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"--input-ids-file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise InputError(f"--input-ids-file {path}: not JSON ({e})") from None
    return data


def _prompts(input_ids, vocab_size: int | None) -> list[list[int]]:
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (list, tuple)) and input_ids and all(_is_int(x) for x in input_ids):
        input_ids = [input_ids]  # one prompt
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise InputError("input_ids: expected a non-empty list of prompts (lists of token ids)")
    prompts = []
    for i, p in enumerate(input_ids):
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not all(_is_int(x) for x in p):
            raise InputError(f"prompt {i + 1}: expected a list of integer token ids")
        if not p:
            raise InputError(f"prompt {i + 1} is empty")
        bad = [int(x) for x in p if x < 0 or (vocab_size is not None and x >= vocab_size)]
        if bad:
            raise InputError(f"prompt {i + 1}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
                             if vocab_size is not None else f"prompt {i + 1}: negative token id {bad[0]}")
        prompts.append([int(x) for x in p])
    return prompts


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _load_generation(gen_dir: Path) -> Generation:
    """GEN_DIR's generation.json through the schema's reader, and the names in it that must stay inside
    GEN_DIR checked: generate reads those files."""
    if not gen_dir.is_dir():
        raise InputError(f"{gen_dir}: no such directory")
    path = gen_dir / schema.FILE
    if not path.is_file():
        raise InputError(f"{gen_dir}: no generation.json (compile a `graphconv export --task {schema.TASK}` folder)")
    gen = schema.read(gen_dir)
    for g in GRAPHS:  # the files generate reads from GEN_DIR
        if "mindir" in gen["graphs"][g]:
            inside(gen_dir, gen["graphs"][g]["mindir"], path, f"graphs.{g}.mindir")
    tp = gen.get("tensor_parallel")
    if tp is not None and not (isinstance(tp, dict) and _is_int(tp.get("tp")) and tp["tp"] >= 2):
        raise InputError(f"{path}: tensor_parallel.tp must be an integer >= 2 (the ranks' count)")
    if gen.get("tokenizer") is not None:
        inside(gen_dir, gen["tokenizer"], path, "tokenizer", directory=True)
    return gen


def _resolve_device(device: str) -> tuple[str, list[str]]:
    if device not in DEVICES:
        raise InputError(f"device {device!r}: choose from {', '.join(DEVICES)}")
    have = ascend_available()
    if device == "ascend" and not have:
        raise InputError("--device ascend: no Ascend device on this host (no /dev/davinci*); use --device cpu")
    if device == "auto":
        if have:
            return "ascend", []
        note = "no Ascend device on this host: running the cpu MindIRs (*.cpu.mindir)"
        return "cpu", [note]
    return device, []


def mindir_files(gen: dict, device: str) -> list[str]:
    """The prefill's and the decode's MindIR file names: graphs.<g>.mindir (default <g>; one file when one
    graph serves both), `.cpu.mindir` for the cpu ones."""
    suffix = ".cpu.mindir" if device == "cpu" else ".mindir"
    if gen.get("tensor_parallel"):  # (rank 0's: every rank runs its own, rank_files)
        return [rank_files(gen, device)[0]] * len(GRAPHS)
    return [gen["graphs"][g].get("mindir", g) + suffix for g in GRAPHS]


def all_files(gen: dict, device: str) -> list[str]:
    """Every MindIR a generate run on `device` loads: the steps', or each rank's."""
    return rank_files(gen, device) if gen.get("tensor_parallel") else mindir_files(gen, device)


def rank_files(gen: dict, device: str) -> list[str]:
    """A tensor-parallel GEN_DIR (`compile --tp N`: generation.json's tensor_parallel): each rank's one stateful
    MindIR, rank_<i>.mindir (the --target's) or rank_<i>.cpu.mindir."""
    suffix = ".cpu.mindir" if device == "cpu" else ".mindir"
    return [f"rank_{r}{suffix}" for r in range(int(gen["tensor_parallel"]["tp"]))]


def _state_params(graph: dict, device: str) -> dict | None:
    """The state Parameters the MindIR run on `device` takes zeros for (graphconv/runtime/mindir_state.py): a low
    precision compile's cache is fp16/bf16, its cpu MindIR's fp32 (generation.json's state.cpu_params)."""
    state = graph.get("state") or {}
    return state.get("cpu_params", state.get("params")) if device == "cpu" else state.get("params")


def mindir_io(graph: dict) -> tuple[dict, list[str]]:
    """A step's MindIR inputs {name: dims} and output names: the ONNX graph's, or where its KV cache is held in
    place (graphs.<g>.state, graphconv/generation/build.py), the ones the stateful MindIR takes and gives."""
    state = graph.get("state")
    if state is None:
        return graph["inputs"], list(graph["outputs"])
    return {n: graph["inputs"][n] for n in state["inputs"]}, list(state["outputs"])


def _check_capacity(gen: dict, prompts: list[list[int]], max_new_tokens: int) -> None:
    """A cache held in place holds max_batch rows of max_seq_len positions: refuse what it cannot hold."""
    state = gen["graphs"]["decode"].get("state")
    if state is None:
        return
    if len(prompts) > state["max_batch"]:
        raise InputError(f"{len(prompts)} prompts: the cache holds {state['max_batch']} rows (compile with a larger "
                         "--max-batch)")
    need = max(map(len, prompts)) + max_new_tokens - 1
    if need > state["max_seq_len"]:
        raise InputError(f"the prompts need {need} cache positions (longest prompt {max(map(len, prompts))} + "
                         f"{max_new_tokens} new tokens - 1); the cache holds {state['max_seq_len']} (compile with a "
                         "larger --max-seq-len, or ask fewer tokens)")


def _batches(prompts: list[list[int]], gen: dict) -> list[list[int]]:
    """Indices of the prompts run together. One batch, left padded, unless generation.json says the graph
    takes no padding (GroupQueryAttention reads the mask as lengths): then prompts of one length together."""
    if gen.get("prompt_padding", "left") != "none":
        return [list(range(len(prompts)))]
    groups: dict[int, list[int]] = {}
    for k, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(k)
    return list(groups.values())


def sampling_options(gen: dict, temperature=None, top_k=None, top_p=None, seed=None) -> dict:
    """The sampling settings: each given one, else the checkpoint's (generation.json's `sampling`, from its
    generation_config.json), else transformers' default; a seed drawn when none is given (reported, so a run
    can be repeated). InputError on a value transformers refuses."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    saved = gen.get("sampling") or {}
    out = {k: v if v is not None else saved.get(k, decoding.SAMPLING_DEFAULTS[k]) for k, v in given.items()}
    if not isinstance(out["temperature"], (int, float)) or not out["temperature"] > 0:
        raise InputError(f"temperature must be > 0 (got {out['temperature']!r})")
    if not _is_int(out["top_k"]) or out["top_k"] < 0:
        raise InputError(f"top_k must be an integer >= 0 (got {out['top_k']!r}; 0 keeps every token)")
    if not isinstance(out["top_p"], (int, float)) or not 0 < out["top_p"] <= 1:
        raise InputError(f"top_p must be in (0, 1] (got {out['top_p']!r}; 1 keeps every token)")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise InputError(f"seed must be an integer >= 0 (got {seed!r})")
    return {"temperature": float(out["temperature"]), "top_k": int(out["top_k"]), "top_p": float(out["top_p"]),
            "seed": int(np.random.SeedSequence().entropy % 2**32) if seed is None else int(seed)}


def _onnx_pair(gen_dir: Path, gen: dict, onnx_dir: Path | None) -> tuple[Path, Path]:
    """The ONNX pair --check runs: the graph files generation.json records (graphs.<g>.file, each inside its
    folder), in --onnx-dir, else in generation.json's source_dir (the export folder the compile read, recorded
    as an absolute path; nothing but --check reads it), else in GEN_DIR/onnx; InputError unless that folder
    holds them."""
    record = gen_dir / "generation.json"
    if onnx_dir is not None:
        where, how = Path(onnx_dir), "--onnx-dir"
    elif gen.get("source_dir"):
        if not isinstance(gen["source_dir"], str):
            raise InputError(f"{record}: source_dir {gen['source_dir']!r} is not a path (pass --onnx-dir)")
        where, how = Path(gen["source_dir"]), "generation.json's source_dir"
        if not where.is_absolute():
            where = gen_dir / where
    else:
        where, how = gen_dir / "onnx", f"{gen_dir / 'onnx'} (no source_dir in generation.json)"
    files = tuple(inside(where, gen["graphs"][g].get("file", f"{g}.onnx"), record, f"graphs.{g}.file")
                  for g in GRAPHS)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"--check needs the ONNX pair: {', '.join(missing)} not in {where} (from {how}; "
                         "pass --onnx-dir)")
    return files


@dataclasses.dataclass(frozen=True)
class Request:
    """What generate takes besides the folder, the prompts and the count: each field a keyword of generate."""

    onnx_dir: str | Path | None = None  # --check's ONNX graphs (default: generation.json's source_dir)
    atol: float = ATOL  # --check's tolerance on the logits
    progress: Progress | None = None
    text: list[str] | None = None  # text prompts (input_ids None), through the folder's tokenizer
    sampling: dict | None = None  # {temperature, top_k, top_p, seed}, each None for the default


@dataclasses.dataclass
class _Run:
    """A generate call with its arguments checked: the folder, the prompts and the files it runs."""

    gen_dir: Path
    gen: Generation
    prompts: list[list[int]]
    max_new_tokens: int
    device: str
    check: bool
    request: Request
    progress: Progress
    notes: list[str]
    mindirs: list[Path]
    sampling: dict | None = None
    tok: object = None
    onnx_pair: tuple[Path, Path] | None = None


def generate(gen_dir: str | Path, input_ids, max_new_tokens: int, check: bool = False, device: str = "auto",
             **options) -> GenerationResult:
    """Greedy decoding (or, with `sampling` {temperature, top_k, top_p, seed}, each None for the default: see
    sampling_options) of the prompts `input_ids` (a list of token-id lists; one list is one prompt), or of the
    `text` prompts (input_ids None) encoded by the folder's tokenizer, with the compiled model in `gen_dir`.
    The keywords are Request's (onnx_dir, atol, progress, text, sampling). Raises InputError (bad input, exit
    1) or, with check, VerificationError (exit 2; the result is attached as `.result`)."""
    run = _prepare(Path(gen_dir).absolute(), input_ids, max_new_tokens, check, device, Request(**options))
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    n = len(run.prompts)
    sequences, reasons, steps, ms_logits, timings = [None] * n, [None] * n, [], [], {}
    failure = None
    for number, batch in enumerate(_batches(run.prompts, run.gen)):
        tokens, done, checked = _run_batch(run, number, batch)
        if checked is not None:
            ms_logits.append(checked.ms_logits)
            steps += [{**s, "prompts": [k + 1 for k in batch]} if len(batch) < n else s for s in checked.steps]
            failure = failure or checked.failure
        for k, seq, why in zip(batch, *decoding.sequences(tokens, decoding.eos_ids(run.gen))):
            sequences[k], reasons[k] = seq, why
        for key, value in done.get("timings", {}).items():
            timings.setdefault(key, value)
    result = GenerationResult(
        sequences=sequences, prompt_lengths=[len(p) for p in run.prompts], finish_reasons=reasons, device=run.device,
        steps=steps, sampling=run.sampling, timings=timings, notes=run.notes,
        step_logits=(ms_logits[0] if len(ms_logits) == 1 else ms_logits) if check else None,
        texts=None if run.tok is None else [run.tok.decode(s, skip_special_tokens=True) for s in sequences])
    if failure:
        error = VerificationError(failure)
        error.result = result
        raise error
    return result


def _prepare(gen_dir: Path, input_ids, max_new_tokens, check: bool, device: str, request: Request) -> _Run:
    """The arguments checked against the folder before MindSpore starts: the prompts (ids, or text through the
    tokenizer), the cache's capacity, the device and its MindIRs, the memory a cpu run needs, --check's graphs."""
    gen = _load_generation(gen_dir)  # (absolute: the MindSpore child works in another directory)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    tok, text = None, request.text
    if text is not None:
        if input_ids is not None:
            raise InputError("give the prompts as token ids or as text, not both")
        if isinstance(text, str) or not text or not all(isinstance(t, str) and t for t in text):
            raise InputError("text prompts: expected a non-empty list of non-empty strings")
        tok = tokenizer.load(gen_dir, gen)
        input_ids = [tok(t)["input_ids"] for t in text]
    prompts = _prompts(input_ids, gen.get("vocab_size"))
    _check_capacity(gen, prompts, max_new_tokens)
    device, notes = _resolve_device(device)
    sampling = None
    if request.sampling is not None:
        sampling = sampling_options(gen, **request.sampling)
        notes.append("sampling: " + ", ".join(f"{k} {v}" for k, v in sampling.items()))  # (the seed: a rerun)
    _check_files(gen_dir, gen, device)
    onnx_dir = Path(request.onnx_dir) if request.onnx_dir else None
    return _Run(gen_dir, gen, prompts, max_new_tokens, device, check, request, request.progress or SILENT, notes,
                [gen_dir / f for f in mindir_files(gen, device)], sampling, tok,
                _onnx_pair(gen_dir, gen, onnx_dir) if check else None)


def _check_files(gen_dir: Path, gen: Generation, device: str) -> None:
    """Every MindIR the run on `device` loads is there (a tensor-parallel folder: every rank's), and a cpu
    run's weights fit this host's memory."""
    every = [gen_dir / f for f in all_files(gen, device)]
    missing = sorted({m.name for m in every if not m.is_file()})
    if missing and device == "cpu" and gen.get("cpu_twin", {}).get("written") is False:
        raise UnsupportedError(f"{gen_dir}: no cpu MindIR, the compile did not write it: {gen['cpu_twin']['reason']} "
                               "(generate on an Ascend host, or compile with --cpu-twin)")
    if missing:
        raise InputError(f"{gen_dir}: no {', '.join(missing)} (the {device} MindIRs; see `graphconv compile`)")
    too_large = fits_in_memory(sorted(set(every)), gen) if device == "cpu" else None
    if too_large:
        raise UnsupportedError(f"{too_large}: generate on an Ascend host")


def _task(run: _Run, number: int, prompt_path: Path, logits_path: Path | None) -> dict:
    """The MindSpore child's generate task for one batch: its prompt file, each step's MindIR and inputs."""
    gen, sampling = run.gen, run.sampling
    return {"device": run.device, "prompt": str(prompt_path), "max_new_tokens": int(run.max_new_tokens),
            "eos_token_ids": decoding.eos_ids(gen), "pad_token_id": decoding.pad_id(gen),
            "cache_feeds": gen.get("cache_feeds"), "logits": None if logits_path is None else str(logits_path),
            # each batch its own stream of draws, all from the one seed
            "sampling": {**sampling, "seed": [sampling["seed"], number]} if sampling else None,
            **{g: {"mindir": str(m), "inputs": schema.input_specs(mindir_io(gen["graphs"][g])[0], cache_dtype(gen)),
                   "outputs": mindir_io(gen["graphs"][g])[1], "empty_cache": bool(gen["graphs"][g].get("empty_cache")),
                   "state_params": _state_params(gen["graphs"][g], run.device)}
               for g, m in zip(GRAPHS, run.mindirs)}}


def _run_batch(run: _Run, number: int, batch: list[int]):
    """One batch of prompts (left padded) generated in the MindSpore child (or its ranks under msrun); with
    check, its steps compared with onnxruntime. Returns (tokens [batch, steps], the child's result, the check
    or None)."""
    from graphconv.runtime.child import run_task
    from graphconv.workspace import Workspace

    ids, mask = decoding.left_pad([run.prompts[k] for k in batch], decoding.pad_id(run.gen))
    with Workspace(Path(tempfile.gettempdir()) / "graphconv-generate") as ws:
        prompt_path = ws.path("prompt.npz")
        np.savez(prompt_path, input_ids=ids, attention_mask=mask)
        task = _task(run, number, prompt_path, ws.path("logits.npz") if run.check else None)
        tp = run.gen.get("tensor_parallel")
        ranks = f" ({tp['tp']} ranks under msrun)" if tp else ""
        run.progress.info(f"generate: {len(batch)} prompt(s), up to {run.max_new_tokens} new tokens on "
                          f"{run.device}{ranks}")
        if tp:
            done = _run_ranks(run.gen_dir, run.gen, run.device, task, ws.dir)
        else:
            done = run_task("generate", task, ws.dir, f"MindSpore {run.device} generation")
        tokens = np.array(done["tokens"], np.int64).reshape(len(batch), -1)
        if not run.check:
            return tokens, done, None
        with np.load(done["logits"]) as data:
            logits = [data[f"step{k}"] for k in range(tokens.shape[1])]
    return tokens, done, checking.check(run.onnx_pair, run.gen, ids, mask, tokens, logits, run.request.atol,
                                        run.progress)


def _run_ranks(gen_dir: Path, gen: dict, device: str, task: dict, workdir: Path) -> dict:
    """The generate task on every rank of a tensor-parallel GEN_DIR under msrun (graphconv/runtime/msrun.py),
    rank i on its own MindIR: the logits are whole on every rank (the LM head's AllGather), so every rank
    chooses the same tokens; rank 0's result (and logits) are the run's."""
    from graphconv.errors import InternalError
    from graphconv.runtime import msrun

    if device != "cpu":
        raise UnsupportedError(f"{gen_dir}: a tensor-parallel folder runs here on CPU only; on an Ascend host "
                               "launch the ranks with msrun (see docs/cli.md)")
    tasks = []
    for r, name in enumerate(rank_files(gen, device)):
        ranked = {**task, "kind": "generate", "logits": task["logits"] if r == 0 else None}
        for g in GRAPHS:
            ranked[g] = {**task[g], "mindir": str(gen_dir / name)}
        tasks.append(ranked)
    results = msrun.run(tasks, workdir, f"msrun ({len(tasks)} ranks)")
    differ = [r for r, res in enumerate(results) if res["tokens"] != results[0]["tokens"]]
    if differ:
        raise InternalError(f"rank {differ[0]} chose other tokens than rank 0 (its logits are not the whole ones)")
    return {**results[0], "ranks": len(results)}


def mindir_bytes(path: Path) -> int:
    """A MindIR's bytes on disk: the file and its `_variables/` folder (where mindspore.export puts large
    weights)."""
    variables = path.with_name(path.stem + "_variables")
    return path.stat().st_size + sum(f.stat().st_size for f in variables.rglob("*") if f.is_file())


def fits_in_memory(mindirs: list[Path], gen: dict) -> str | None:
    """Why this host's memory cannot hold a cpu run of `mindirs` (it would be killed), or None: checked before
    MindSpore starts."""
    import psutil

    stored = sum(mindir_bytes(m) for m in mindirs)
    fp32 = stored * (2 if gen.get("dtype") in ("bf16", "fp16") else 1)
    need, available = CPU_BYTES_PER_WEIGHT_BYTE * fp32, psutil.virtual_memory().available
    if need > available:
        return (f"the cpu MindIR's weights ({fp32 / 2**30:.1f} GiB in fp32) need about {need / 2**30:.0f} GiB to "
                f"generate on MindSpore CPU ({CPU_BYTES_PER_WEIGHT_BYTE}x, measured); this host has "
                f"{available / 2**30:.1f} GiB available")
    return None
