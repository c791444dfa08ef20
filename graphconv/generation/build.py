"""Compile a generation source into a generation folder: `graphconv compile SOURCE -o GEN_DIR` on one of the
sources graphconv/generation/sources.py reads.

One graph serves both steps where it can: a builder's graph, and an export's decode.onnx where the export
checked it at an empty cache against PyTorch's prompt; it is verified at an empty cache and at a cached step,
and generation.json names it for both (the prompt with `empty_cache`). Otherwise both graphs compile.

GEN_DIR (new; written beside it under a private name and renamed at the end, so a failure leaves nothing):
    decode.mindir [, prefill.mindir]       the --target's MindIRs (ascend: the fused primitives)
    decode.cpu.mindir [, prefill.cpu...]   cpu-target MindIRs, each verified on MindSpore CPU itself: what
                                           `graphconv generate` runs on a host without Ascend (for --target
                                           cpu, the same files as the target's, hard-linked)
    generation.json                        the source's, with `source_dir` (the source folder: the ONNX graphs)
    onnx/                                  with --quantize: the quantized ONNX graphs the MindIRs were compiled
                                           from (each graph's compile quantizes it; source_dir "onnx")
    report.json                            the contract fields, plus `graphs` with each compile's report (and
                                           `cpu_twins` for the cpu ones)
With --bundle DIR (new), the deploy bundle (graphconv/deploy/pair.py). With --tp N, each rank's stateful
MindIR instead (graphconv/generation/ranks.py).

By default (`stateful_cache` None; True: or an error), the one graph is compiled with its KV cache held in
place (passes/stateful_cache.py, applied by the compile's load stage, graphconv.pipeline.Compiler.load): the
MindIRs take ids, mask and positions and give the logits, generation.json's graphs.<step>.state gives the
capacity, and the cached steps are verified by generating against onnxruntime (report.json's `cache`).

Weights: each MindIR holds its own copy. A MindIR cannot reference another file's Parameters, so two graphs
store the weights twice; report.json's `weights` says how many bytes each file holds.

Every graph is compiled by graphconv.pipeline.compile_model under interrupts.nested(): its results go into the
staging folder, not into place, so a signal until the folder's own final moves still interrupts the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from graphconv import interrupts
from graphconv.errors import CacheNotHeld, DiskFullError, InputError, VerificationError
from graphconv.frontend import tokenizer
from graphconv.generation import cache, run, schema
from graphconv.generation.schema import Generation
from graphconv.generation.sources import Source, is_folder_source, read_source, split_inputs, tokenizer_dir
from graphconv.options import CompileOptions, GenerationOptions
from graphconv.progress import SILENT, Progress
from graphconv.workspace import partial_dir, release


def is_generation_source(path: Path, options: CompileOptions) -> bool:
    """Whether `graphconv compile` builds a generation folder from `path`: a folder a source reader takes, or
    a with-past graph given with --stateful-cache."""
    return is_folder_source(path) or bool(options.generation.stateful_cache and path.is_file())


def compile_generation(source: str | Path, options: CompileOptions, progress: Progress | None = None) -> dict:
    """Compile the generation source `source` into the new folder `options.output` (options validated);
    returns the report (the one written to report.json)."""
    return Build.plan(Path(source), options, progress or SILENT).run()


@dataclasses.dataclass
class Build:
    """The compile of one generation folder: the source, the options, the capacity of the cache where it is
    held, and what each graph's compile gave."""

    source: Source
    options: CompileOptions
    progress: Progress
    meta: Generation  # generation.json as the build writes it
    graphs: dict[str, Path]  # the ONNX graphs compiled, by their MindIR's stem
    dims: dict[str, dict]  # per graph, the sizes it is verified at (the user's --dim win)
    shape_ranges: dict[str, tuple[int, int]]
    held: tuple[int, int] | None = None  # (max batch, max seq) of the cache held in place
    not_held: str | None = None  # why the cache is passed in and out
    staging: Path | None = None
    bundle_staging: Path | None = None
    reports: dict[str, dict] = dataclasses.field(default_factory=dict)  # each graph's compile report
    twins: dict[str, dict] = dataclasses.field(default_factory=dict)  # each cpu MindIR's
    weights: dict[str, dict] = dataclasses.field(default_factory=dict)  # each graph's bytes on disk
    inputs: dict[str, tuple[Path, ...]] = dataclasses.field(default_factory=dict)  # each graph's --inputs
    current: str | None = None  # the compile under way, for the report of a failed one
    report_tmp: Path | None = None

    @property
    def gen_dir(self) -> Path:
        return Path(self.options.output)

    @property
    def state(self) -> dict | None:
        """The state entry every step shares, where the cache is held in place."""
        return self.meta["graphs"]["decode"].get("state")

    @classmethod
    def plan(cls, path: Path, options: CompileOptions, progress: Progress) -> "Build":
        """Read the source, check what the folder needs, and decide whether the cache is held in place."""
        cls.check_source(path, options)
        source = read_source(path)
        build = cls(source, options, progress, source.meta, dict(source.graphs),
                    {g: {**source.dims.get(g, {}), **options.dims} for g in source.graphs}, dict(options.shape_ranges))
        build.check()
        build.hold_cache()
        return build

    @staticmethod
    def check_source(path: Path, options: CompileOptions) -> None:
        """What the options need of the source, checked before it is read: an output folder, and a single
        with-past graph only with its cache held in place and without --tp."""
        if options.output is None:
            raise InputError(f"{path} is a generation source: -o GEN_DIR (a new folder) is required")
        if path.is_file() and options.generation.stateful_cache is False:
            raise InputError(f"{path}: a single with-past graph compiles with its cache held in place only "
                             "(--stateful-cache)")
        if options.tp is not None and path.is_file():
            raise InputError("--tp takes a plain .onnx graph or a generation folder in this version (not a "
                             "with-past .onnx graph with --stateful-cache)")

    def check(self) -> None:
        """What the folder needs of the filesystem and of the options given for one model: a new output in a
        folder that exists, a bundle folder that does not, no flag a generation folder does not take, and
        --inputs that name its graphs. (Option against option: CompileOptions.validate.)"""
        out = self.gen_dir
        if out.exists():
            raise InputError(f"-o {out} already exists (a generation pair is written into a new folder)")
        if not out.parent.absolute().is_dir():
            raise InputError(f"output directory {out.parent} does not exist")
        for flag, value in (("--emit-source", self.options.emit_source), ("--save-fused", self.options.save_fused)):
            if value:
                raise InputError(f"{flag} is not supported for a generation pair yet")
        if self.options.bundle is not None and Path(self.options.bundle).exists():
            raise InputError(f"--bundle {self.options.bundle} already exists")
        if self.options.quantize is not None and self.options.quantize.startswith("w8a8"):
            raise InputError("--quantize w8a8 takes one .onnx graph in this version (a generation folder's decode "
                             "graph would need its KV cache in the calibration inputs): use w8a16 or w4a16 here")
        self.inputs = split_inputs(self.options.inputs, tuple(self.graphs))

    def hold_cache(self) -> None:
        """The cache held in place where the source's graph can hold it (a with-past graph: or an error;
        --stateful-cache and --tp: or an error), else passed in and out with the reason."""
        wanted = True if self.source.kind == "graph" else self.options.generation.stateful_cache
        if wanted is False:
            self.not_held = "not asked for (--no-stateful-cache)"
            return
        gen = self.options.generation
        try:
            held = cache.capacity(self.source, gen.max_batch, gen.max_seq_len)
        except CacheNotHeld as e:
            if self.options.tp is not None:
                raise CacheNotHeld(f"--tp: the KV cache cannot be held in place: {e}") from None
            if wanted:
                raise CacheNotHeld(f"--stateful-cache: the KV cache cannot be held in place: {e}") from None
            self.progress.warn(f"the KV cache is passed in and out, not held in place: {e}")
            self.not_held = str(e)
            return
        sizes = cache.sizes(self.meta, held, self.options)
        graph = self.graphs["decode"] if "decode" in self.graphs else next(iter(self.graphs.values()))
        self.meta, name = cache.held_meta(self.meta, held)
        self.held, self.graphs, self.shape_ranges = held, {name: graph}, sizes.ranges
        self.dims = {name: sizes.dims}
        self.inputs = split_inputs(self.options.inputs, (name,))
        total = held[0] * held[1] * cache.bytes_per_position(self.meta, self.options.precision)
        self.progress.info(f"KV cache held in place: {held[0]} rows x {held[1]} positions, {total / 2**30:.2f} GiB "
                           "of device memory at run time (made at load, not stored)")

    def graph_options(self, g: str, **changes) -> CompileOptions:
        """The options of graph `g`'s compile: the folder's, with this graph's inputs and sizes, the cache's
        capacity, and none of what only the folder takes (its report, its generation flags, --tp)."""
        own = {"output": self.staging / f"{g}.mindir" if self.staging else None, "inputs": self.inputs[g],
               "dims": self.dims[g], "shape_ranges": self.shape_ranges, "cache_capacity": self.held, "bundle": None,
               "report_path": None, "generation": GenerationOptions(), "tp": None,
               "save_quantized": self.quantized_graph(g)}
        return dataclasses.replace(self.options, **{**own, **changes})

    def quantized_graph(self, g: str) -> Path | None:
        """With --quantize: where graph `g`'s compile writes the quantized ONNX graph it compiled, GEN_DIR/onnx/
        (generation.json's source_dir then: what the cached steps and `generate --check` run onnxruntime on)."""
        if self.options.quantize is None or self.staging is None:
            return None
        path = self.staging / "onnx" / self.meta["graphs"].get(g, {}).get("file", f"{g}.onnx")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def compile(self, path: Path, options: CompileOptions) -> dict:
        """One graph compiled and verified into the staging folder; its report as a dict. Under the interrupt
        guard: the compile's own final moves do not settle the run."""
        from graphconv.pipeline import compile_model

        with interrupts.nested():
            return compile_model(path, options, self.progress).to_dict()

    def run(self) -> dict:
        """Compile every graph into a staging folder, write generation.json and the report, and put the folder
        (and the bundle) in place; on any failure, nothing is left."""
        self.staging = partial_dir(self.gen_dir)
        bundle = self.options.bundle
        self.bundle_staging = None if bundle is None else partial_dir(Path(bundle))
        try:
            if self.options.tp is not None:
                from graphconv.generation import ranks

                ranks.compile_ranks(self)
            else:
                for g, path in self.graphs.items():
                    self._compile_graph(g, path)
            report = self._finish()
            self._put_in_place(report)
        except BaseException as e:
            self._clean_up(e)
            raise
        return report

    def _compile_graph(self, g: str, path: Path) -> None:
        """Graph `g` for the --target (with its bundle), then its cpu MindIR where one is written."""
        target = self.options.target
        self.progress.info(f"{g}: compile ({target})")
        self.current = g
        graph_bundle = None if self.bundle_staging is None else self.bundle_staging / g
        mindir = self.staging / f"{g}.mindir"
        self.reports[g] = self.compile(path, self.graph_options(g, bundle=graph_bundle))
        if self.held is not None:  # the cache's zeros are made at load, not stored
            self.state["params"] = cache.strip([mindir] + (
                [graph_bundle / "model" / f"{g}.mindir"] if graph_bundle is not None else []))
        twin = self.staging / f"{g}.cpu.mindir"
        unusable = self._twin_unusable(mindir)
        if target == "cpu":
            os.link(mindir, twin)
        elif unusable:
            self.progress.warn(f"{g}: the cpu MindIR is not written: {unusable}")
            self.twins[g] = {"status": "not written", "reason": unusable}
            self.meta = {**self.meta, "cpu_twin": {"written": False, "reason": unusable}}
        else:
            self.progress.info(f"{g}: compile the cpu MindIR")
            self.current = f"{g}.cpu"
            self.twins[g] = self.compile(path, self.graph_options(
                g, output=twin, target="cpu", precision="fp32", keep_fp32=None, save_quantized=None))
            if self.held is not None:
                twin_params = cache.strip([twin])
                if twin_params != self.state["params"]:  # (an fp16/bf16 compile's cache is low, its twin's fp32)
                    self.state["cpu_params"] = twin_params
        self.current = g
        self.weights[g] = {"mindir_bytes": run.mindir_bytes(mindir),
                           "cpu_mindir_bytes": run.mindir_bytes(twin) if twin.exists() else 0}

    def _twin_unusable(self, mindir: Path) -> str | None:
        """Why no cpu MindIR is written beside an ascend one (None: it is): not asked for, or `graphconv
        generate`'s memory rule (run.fits_in_memory, on the weights in fp32) says this host cannot run it."""
        wanted = self.options.generation.cpu_twin
        if self.options.target == "cpu" or wanted:
            return None
        if wanted is False:
            return "not asked for (--no-cpu-twin)"
        low = self.meta.get("dtype") in ("bf16", "fp16") or self.options.precision in ("fp16", "bf16")
        return run.fits_in_memory([mindir], {**self.meta, "dtype": "bf16" if low else "fp32"})

    def _finish(self) -> dict:
        """generation.json written into the staging folder, the cached steps checked, the report and the
        bundle made; returns the report."""
        from graphconv.generation import report

        folder = self.source.folder
        # (quantized: the ONNX graphs the MindIRs were compiled from are GEN_DIR/onnx's, relative to the folder)
        self.meta = {**self.meta, "source_dir": "onnx" if self.options.quantize else str(folder.resolve())}
        if tokenizer.copy(tokenizer_dir(folder, self.meta), self.staging / "tokenizer"):
            self.meta["tokenizer"] = "tokenizer"
        schema.write(self.staging / schema.FILE, self.meta)
        if self.options.tp is not None:
            from graphconv.generation import ranks

            ranks.write_scripts(self)
        checked = check_cached_steps(self.staging, self.meta, self.progress) \
            if self.held is not None and self.options.verify else None
        made = report.assemble(self, checked)
        self._write_bundle(made)
        return made

    def _write_bundle(self, made: dict) -> None:
        """The deploy bundle's top (each graph's bundle is written by its compile)."""
        if self.bundle_staging is None:
            return
        if self.options.tp is not None:
            from graphconv.deploy.tensor_parallel import write_tp_generation_bundle

            write_tp_generation_bundle(self.bundle_staging, self.staging, made)
        else:
            from graphconv.deploy.pair import write_pair_files

            write_pair_files(self.bundle_staging, self.meta, self.reports)
        made["artifacts"]["bundle"] = str(self.options.bundle)

    def _put_in_place(self, made: dict) -> None:
        """report.json, then the renames that put the folder, the bundle and --report in place (the --report
        file written before them: a full disk fails the run with nothing out)."""
        (self.staging / "report.json").write_text(json.dumps(made, indent=2, default=str))
        report_path = self.options.report_path
        if report_path is not None:
            self.report_tmp = Path(report_path).with_name(f".{Path(report_path).name}.partial-{os.getpid()}")
            self.report_tmp.write_text(json.dumps(made, indent=2, default=str))
        with interrupts.final_moves():
            os.replace(release(self.staging), self.gen_dir)
            if self.bundle_staging is not None:
                os.replace(release(self.bundle_staging), self.options.bundle)
            if self.report_tmp is not None:
                os.replace(self.report_tmp, report_path)

    def _clean_up(self, e: BaseException) -> None:
        """Nothing left of a failed run but, for a failed verification, the --report saying how it ended (as
        a plain compile's does: every failed comparison in it); a full disk named at the output."""
        for d in (self.staging, self.bundle_staging):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        if self.report_tmp is not None:
            self.report_tmp.unlink(missing_ok=True)
        failed = getattr(e, "report", None)
        report_path = self.options.report_path
        if report_path is not None and isinstance(e, VerificationError) and failed is not None:
            g = self.current or next(iter(self.graphs), "decode")
            Path(report_path).write_text(json.dumps(
                {"status": "failed", "exit_code": e.exit_code, "error": str(e),
                 "graphs": {**self.reports, g: failed.to_dict()}}, indent=2, default=str))
        if isinstance(e, DiskFullError):  # (a graph's up-front check: named where the user asked for it)
            raise DiskFullError(str(e).replace(str(self.staging), str(self.gen_dir))) from None


def check_cached_steps(gen_dir: Path, meta: Generation, progress: Progress) -> dict:
    """The stateful graph's cached steps against onnxruntime on the ONNX graphs: three prompts of different
    lengths (left-padded), four greedy steps, every step's logits compared (generate's --check)."""
    capacity = meta["graphs"]["decode"]["state"]
    files = run.all_files(meta, "cpu")
    if not all((gen_dir / f).is_file() for f in files):
        return {"skipped": f"no cpu MindIR: {meta.get('cpu_twin', {}).get('reason')}"}
    too_large = run.fits_in_memory([gen_dir / f for f in sorted(set(files))], meta)
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
    result = run.generate(gen_dir, prompts, steps, check=True, device="cpu")
    worst = max(s["max_abs"] for s in result.steps)
    return {"prompts": [len(p) for p in prompts], "steps": len(result.steps), "max_abs": worst,
            "argmax_match": all(s["argmax_match"] for s in result.steps)}
