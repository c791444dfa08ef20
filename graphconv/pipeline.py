"""The compile pipeline: its stages in order, each a Compiler method that takes what it needs and returns a
typed result (docs/design.md says where each stage's code lives):

load -> reference cases -> simplify (onnxsim) -> validate (onnxruntime) -> passes (fuse) -> precision
-> lower (opmap; the cpu twin too) -> emit (mindspore.export and the verification run, in one child)
-> verify (outputs; block by block in layer-streamed mode) -> bundle -> commit (all artifacts or none).

When work runs (the oracle beside the emit, priorities, reading ahead, the exit) is graphconv/runtime/
scheduling.py's business, not a stage's. `compile()` is the Python API behind `graphconv compile`; it returns
the Report and raises a GraphconvError (with the report attached as `.report`) when the run cannot succeed.
"""

from __future__ import annotations

import dataclasses
import resource
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

import opmap.fused
import passes
from graphconv.errors import (CacheNotHeld, DiskFullError, GraphconvError, InputError, InternalError, UnsupportedError,
                              VerificationError)
from graphconv.frontend import param_names, weights
from graphconv.frontend.contrib import gqa, quant
from graphconv.frontend.load import LoadedModel, infer_shapes, load
from graphconv.options import THRESHOLD_BYTES, CompileOptions
from graphconv.version import tool_versions
from graphconv.progress import SILENT, Progress
from graphconv.report import Report, model_info, op_histogram
from graphconv.runtime import child, scheduling
from graphconv.compiler import layers, lowering, targets
from graphconv.verify import census, compare, quantized_census, reference
from graphconv.stage_context import StageContext, lower
from graphconv.stage_results import Emitted, Loaded
from graphconv import oracle_stage, verification
from graphconv.verification import Verification
from graphconv.deploy.profiles import collect_dims
from graphconv.workspace import Workspace
from passes import dim_bounds, precision, stateful_cache


@dataclasses.dataclass
class ModelPaths:
    """The model a compile reads: the user's file, or with --quantize its quantized copy in the workspace, the
    user's float model then kept for the error against it (the quantize stage sets both)."""

    compiled: Path
    float_model: Path | None = None


class Compiler:
    """The stages of one compile. Its attributes are set once, here; stages hand each other typed results and
    write only their own sections of the report."""

    def __init__(self, model_path: Path, options: CompileOptions, progress: Progress):
        self.paths = ModelPaths(Path(model_path))
        self.opt = options
        self.progress = progress
        self.report = Report()
        self.schedule = scheduling.Schedule.from_env()
        plugins = passes.load_plugins(options.plugins)
        self.pass_manager = passes.PassManager(options.passes, options.disable_passes)
        self.target = targets.get(options.target)
        self.output = Path(options.output) if options.output else self.paths.compiled.with_suffix(".mindir")
        self.report.provenance = {"tools": tool_versions(), "passes": self.pass_manager.names, "plugins": plugins,
                                  "target": options.target, "precision": options.precision}
        self.ctx = StageContext(options, self.report, progress, self.target, self.schedule, self.output)

    # --- the stages ---------------------------------------------------------------------------------
    def quantize(self, ws: Workspace) -> None:
        """--quantize: the float model quantized by onnxruntime's tools into the workspace (graphconv/quantize.py);
        the stages after it compile the quantized model, and the oracle runs it."""
        from graphconv import quantize

        scheme = quantize.Scheme.parse(self.opt.quantize)
        self.progress.info(f"quantize {scheme.text()} (onnxruntime)")
        with self.report.stage("quantize") as st:
            directory = ws.path("quantized")
            directory.mkdir()
            name = Path(self.opt.save_quantized).name if self.opt.save_quantized else "quantized.onnx"
            done = quantize.quantize(self.paths.compiled, scheme, self.opt.calibration, directory / name, ws.dir)
            st.detail = {"scheme": scheme.text(), "linears": done.info["linears"]}
        self.report.quantization = done.info
        self.paths.float_model, self.paths.compiled = self.paths.compiled, done.path

    def quantization_error(self, loaded: Loaded, cases) -> None:
        """The quantized model's error against the float model on the reference cases (both by onnxruntime),
        into the report's `quantization` section; why not, where the float model cannot run them."""
        from graphconv import quantize

        info = self.report.quantization
        if loaded.layer_streamed:
            info["error_vs_float"] = "not computed: the model is verified layer by layer (past the whole-network " \
                                     "threshold); the float model is not run whole"
            return
        try:
            info["error_vs_float"] = quantize.error_vs_float(self.paths.float_model, self.paths.compiled, cases)
        except UnsupportedError as e:
            info["error_vs_float"] = f"not computed: the float model does not take these cases ({e})"

    def load(self, ws: Workspace | None = None) -> Loaded:
        """The model loaded, with its KV cache held in place where asked (its zeros a hole of a file in `ws`)."""
        self.progress.info(f"load {self.paths.compiled}")
        with self.report.stage("load") as st:
            # (external weights stay on disk for the whole compile; quantized ones re-laid for a low-bit
            # primitive go to a file of the workspace)
            relaid = weights.SpillFile(ws.path("relaid-weights.bin")) if ws is not None else None
            model = load(self.paths.compiled, relaid)
            cache = None
            if self.opt.cache_capacity is not None:
                model, cache = self.hold_cache(model, ws)
            st.nodes_after = len(model.proto.graph.node)
            if model.external_bytes:
                st.detail = {"external_weight_bytes": model.external_bytes, "weights": "read in place"}
            if cache is not None:
                st.detail = {**(st.detail or {}), "cache_held_in_place": cache}
            if model.upgraded_from is not None:
                st.detail["upgraded_from_opset"] = model.upgraded_from
                self.report.warnings.append(f"opset {model.upgraded_from} upgraded to {model.opset} with "
                                            "onnx.version_converter; the oracle runs the model as given")
            if model.decomposed:
                st.detail["onnxruntime_contrib_ops_decomposed"] = model.decomposed
            if model.quantized_weights:
                st.detail["quantized_weights"] = model.quantized_weights
            self.report.quantized_linears = quantized_census.at_load(model.proto)
            self.report.warnings.extend(model.warnings())
        self.report.model = model_info(model.proto)
        self.report.op_histogram = op_histogram(model.proto)
        missing = lowering.unsupported_ops(model.proto)
        if missing:
            self.report.unsupported_ops = missing
            raise UnsupportedError(f"{len(missing)} unsupported op(s): {', '.join(missing)}")
        streamed = self.opt.layer_streamed if self.opt.layer_streamed is not None \
            else model.external_bytes > THRESHOLD_BYTES
        if self.opt.tp is not None and self.opt.verify:  # (the ranks run whole under msrun: the oracle must too)
            streamed = False
        return Loaded(model, layers.record_scopes(model.proto), param_names.WeightNames.record(model.proto), streamed)

    def hold_cache(self, model: LoadedModel, ws: Workspace | None) -> tuple[LoadedModel, dict]:
        """The with-past graph with its KV cache held in place (passes/stateful_cache.py), and what was done.
        The cache's zeros are a hole of a file in `ws` (no memory, no disk, and no bytes for the MindIR writer
        to copy: graphconv.frontend.weights.is_zeros); without `ws`, in the proto."""
        max_batch, max_seq = self.opt.cache_capacity
        if model.upgraded_from is not None:
            raise CacheNotHeld(f"not in a graph upgraded from opset {model.upgraded_from} yet")
        zeros = weights.SpillFile(ws.path("cache-zeros.bin")).zeros if ws is not None else None
        try:
            proto, layout = stateful_cache.make_stateful(model.proto, max_batch, max_seq,
                                                         presents=gqa.gqa_presents(model.as_given), zeros=zeros)
        except stateful_cache.NotStateful as e:
            raise CacheNotHeld(str(e)) from None
        detail = {"max_batch": max_batch, "max_seq": max_seq, "layout": "[max_batch, kv_heads, max_seq, head_dim]",
                  "caches": {past: cache for past, (cache, *_) in layout.caches.items()}, "bytes": layout.nbytes}
        if model.as_given is not None:
            # The oracle cannot run the contrib ops' graph without its cache inputs: it runs the decomposition,
            # rewritten (a prompt); the cached steps are checked against onnxruntime's kernels on the graph as
            # given by generating (graphconv/generation/build.py).
            detail["oracle"] = "the decomposed graph with its cache held in place (prompt calls); the contrib " \
                               "ops' kernels as given: the cached-steps check"
            held = "with the KV cache held in place, the oracle runs the decomposition at the prompt calls, and " \
                   "onnxruntime on the model as given checks the cached steps"
            note = dataclasses.replace(model.contrib, oracle=held) if model.contrib is not None else None
            model = dataclasses.replace(model, as_given=None, as_shipped=None, case_dims={}, contrib=note)
        return dataclasses.replace(model, proto=infer_shapes(proto, self.paths.compiled)), detail

    def reference_cases(self, loaded: Loaded) -> list[reference.ReferenceCase]:
        model = loaded.model.proto
        if self.opt.inputs:
            return reference.load_npz_cases(list(self.opt.inputs), model, self.opt.mask_inputs)
        # the sizes contrib kernels accept (graphconv.frontend.contrib.cases); the user's --dim win
        cases = reference.make_cases(model, self.opt.mask_inputs, self.opt.dims, pad_masks=loaded.model.pad_masks,
                                     preferred_dims=loaded.model.case_dims)
        for name, value in reference.selector_inputs(model).items():
            self.report.warnings.append(
                f"input {name!r} is {value} in every reference case (the graph compares it with {value}): what the "
                f"model computes at another value of it is compiled but not verified (--inputs with one verifies it)")
        return cases

    def simplify(self, loaded: LoadedModel, ws: Workspace) -> onnx.ModelProto:
        model = loaded.proto
        if not self.opt.simplify:
            return model
        self.progress.info("simplify (onnxsim)")
        with self.report.stage("simplify") as st:
            st.nodes_before = len(model.graph.node)
            src, dst = ws.path("input.onnx"), ws.path("simplified.onnx")
            # External weights are stripped (graph inputs instead): onnxsim sees only the graph, never reads
            # or re-embeds them, and they come back as the same external references (graphconv.frontend.weights).
            bare, refs = weights.stripped(model)
            # Held out of onnxsim: packed quantized weights (it would fold their dequantization) and caches held
            # in place (it would merge them: their zeros are equal, their states are not).
            keep = [*loaded.packed, *stateful_cache.cache_names(model)]
            if keep:
                bare, held = quant.held_out(bare, keep)
                refs = {**refs, **held}
            onnx.save(bare, src)
            try:
                child.run_task("simplify", {"input": str(src), "output": str(dst)}, ws.dir, "onnxsim")
                simplified = weights.restore(onnx.load(str(dst)), model, refs)
                simplified = onnx.shape_inference.infer_shapes(simplified, data_prop=True)
            except (InternalError, onnx.shape_inference.InferenceError) as e:
                self.report.warnings.append(f"simplification skipped: {e}")
                st.nodes_after = st.nodes_before
                return model
            st.nodes_after = len(simplified.graph.node)
        return simplified

    def fuse(self, model: onnx.ModelProto, cases, expected, spill: weights.SpillFile | None) -> onnx.ModelProto:
        """The pass pipeline; the result carries the function bodies of the fused ops it uses. With `spill`
        (a model whose weights are in files), weights a pass made leave memory before the next pass."""
        self.progress.info(f"passes ({', '.join(self.pass_manager.names) or 'none'})")
        with self.report.stage("passes") as st:
            st.nodes_before = len(model.graph.node)
            ir_model = ir.from_proto(model)
            dims = collect_dims(self.report.model["inputs"], cases or [], self.opt.shape_ranges)
            dim_bounds.declare(ir_model, dims.ranges, dims.ref_sizes)
            tracker = self.progress.track("passes", len(self.pass_manager.names), "passes")
            spilled = 0

            def after_each(p, m, k):
                nonlocal spilled
                if spill is not None:
                    spilled += weights.spill_new_tensors(m, spill)
                    weights.release_mapped(m)
                if self.opt.verify_each and expected is not None:
                    self._check_pass(p, m, cases, expected)
                tracker.update(tracker.done + 1)

            self.report.fusions = self.pass_manager.run(ir_model, after_each=after_each)
            self.report.coverage = self.pass_manager.coverage
            self.report.skipped_fusions = passes.skipped_fusions(self.pass_manager)
            if spill is not None:  # (merged weights of weights in files are written nowhere: made from their parts)
                st.detail = {"spilled_bytes": spilled, "concatenated_bytes": spill.concatenated_bytes}
            if self.pass_manager.notes:
                st.detail["notes"] = self.pass_manager.notes
            fused = opmap.fused.attach_functions(ir.to_proto(ir_model))
            fused = onnx.shape_inference.infer_shapes(fused, data_prop=True)
            st.nodes_after = len(fused.graph.node)
        return fused

    def _check_pass(self, p, ir_model: ir.Model, cases, expected) -> None:
        """--verify-each: the graph after pass `p` must still match the oracle (run by onnxruntime with the
        fused ops' function bodies)."""
        got = reference.Oracle(opmap.fused.attach_functions(ir.to_proto(ir_model))).run(cases)
        for case, exp, act in zip(cases, expected, got):
            for name, ref in exp.items():
                c = compare.compare(act[name], ref, *self.ctx.tolerance(), case.valid_positions(ref))
                if not c.ok:
                    raise VerificationError(f"pass {p.name!r} broke equivalence: output {name!r} at "
                                            f"{case.shape_text()}: {c.reason}")

    def apply_precision(self, fused: onnx.ModelProto, spill: weights.SpillFile | None) -> onnx.ModelProto:
        """--precision fp16|bf16: weights and compute in the low dtype, the keep set in fp32."""
        self.progress.info(f"precision {self.opt.precision}")
        with self.report.stage("precision") as st:
            st.nodes_before = len(fused.graph.node)
            try:
                low, summary = precision.apply_precision(fused, self.opt.precision,
                                                         precision.parse_keep(self.opt.keep_fp32), spill=spill)
            except precision.PrecisionError as e:
                raise UnsupportedError(str(e)) from e
            st.nodes_after = len(low.graph.node)
        info = summary.as_dict()
        if precision.CPU_EMULATED[self.opt.precision]:
            info["cpu_emulation"] = precision.emulation_note(self.opt.precision)
        self.report.validation["precision"] = info
        return low

    def write_bundle(self, model, emitted: Emitted, cases, expected, ws: Workspace) -> dict[Path, Path]:
        """The Ascend deploy bundle, built in the workspace and moved into place with the other artifacts."""
        from graphconv import deploy

        self.progress.info("bundle")
        with self.report.stage("bundle"):
            directory = ws.path("bundle")
            directory.mkdir()
            variables = next((f for f in emitted.files if f.is_dir() and f.name.endswith("_variables")), None)
            ctx = deploy.BundleContext(
                name=self.output.stem, mindir=emitted.mindir, variables=variables, onnx_model=model,
                source=ws.path("network.py"), checkpoint=ws.path("network.ckpt"),
                inputs=self.report.model["inputs"], outputs=self.report.model["outputs"],
                cases=cases, expected=expected, precision=self.opt.precision,
                target=self.opt.target, soc=self.opt.soc, cann=self.opt.cann, shape_ranges=self.opt.shape_ranges,
                census=self.report.census, tools=self.report.provenance["tools"])
            written = deploy.write_bundle(directory, ctx)
        self.report.artifacts["bundle"] = str(self.opt.bundle)
        self.report.warnings.extend(ctx.warnings)
        self.report.validation.setdefault("bundle_files", written)
        return {directory: Path(self.opt.bundle)}

    # --- the run ------------------------------------------------------------------------------------
    def run(self) -> Report:
        self.check_output()
        with Workspace(self.output) as ws, child.children(ws.dir):
            if self.opt.quantize is not None:
                self.quantize(ws)
            loaded = self.load(ws)
            self.check_against_model(loaded)
            self.report.scheduling = {"switches": self.schedule.as_dict()}
            try:
                self._run_in(loaded, ws)
            except VerificationError as e:  # the report is still written, and says how the run ended
                self.report.status, self.report.error, self.report.exit_code = "failed", str(e), e.exit_code
                self._commit(ws, {}, report_only=True)
                raise
        return self.report

    def check_output(self) -> None:
        """What a compile of one model needs of its options and paths, checked before any work: no flag that
        only a generation folder takes, and outputs that can be written (the options are valid already:
        CompileOptions.validate)."""
        given = self.opt.generation.given()
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise InputError(f"{', '.join(given)} {verb} to a generation folder (an export with --task "
                             "text-generation-with-past) or, with --stateful-cache, to a with-past .onnx graph")
        if self.opt.tp is not None:
            if self.output.exists():
                raise InputError(f"-o {self.output} already exists (--tp writes a new directory)")
        elif self.output.suffix != ".mindir":
            raise InputError(f"output {self.output} must end in .mindir")
        if not self.output.parent.absolute().is_dir():
            raise InputError(f"output directory {self.output.parent} does not exist")
        for flag, path in (("--emit-source", self.opt.emit_source), ("--bundle", self.opt.bundle)):
            if path is not None and Path(path).exists():
                raise InputError(f"{flag} {path} already exists")

    def check_against_model(self, loaded: Loaded) -> None:
        """What the options need of the loaded model, checked before the long work: the --shape-range dims are
        its symbolic dims, the bundle's options suit its inputs, and its output's disk can hold its weights."""
        collect_dims(self.report.model["inputs"], [], self.opt.shape_ranges)
        if self.opt.bundle:
            from graphconv import deploy

            deploy.check_options(self.report.model["inputs"], self.opt.shape_ranges, self.opt.cann)
        self._check_space(loaded)

    def _check_space(self, loaded: Loaded) -> None:
        """Refuse now, with the numbers, an output whose filesystem cannot hold even the MindIR's weights (a
        lower bound: at --precision fp16/bf16 half the model's bytes; under --tp, a model's weights in files
        twice: the shards go to the spill file first), rather than fail when it fills up; the
        7B benchmark checks the same way (benchmarks/compile_scale.py). A disk that fills later is still one
        line (graphconv.errors.disk_full)."""
        weight_bytes = loaded.model.external_bytes + loaded.model.proto.ByteSize()
        needed = weight_bytes // 2 if self.opt.precision != "fp32" else weight_bytes
        if self.opt.tp is not None and loaded.model.external_bytes:  # (the shards in the spill file, then the ranks')
            needed += loaded.model.external_bytes
        free = shutil.disk_usage(self.output.parent.absolute()).free
        if free < needed:
            raise DiskFullError(f"no space left on device for {self.output.absolute()}: {free / 2**20:.1f} MiB "
                                f"free, its weights alone need {needed / 2**20:.1f} MiB ({needed} bytes)")

    def _run_in(self, loaded: Loaded, ws: Workspace) -> None:
        cases = self.reference_cases(loaded)
        if self.paths.float_model is not None:
            self.quantization_error(loaded, cases)
        checked = oracle_stage.validate(self.ctx, loaded, self.simplify(loaded.model, ws), cases)
        cases = checked.cases or cases
        checked = oracle_stage.observed_ranks(self.ctx, loaded, checked, cases)
        spill = weights.SpillFile(ws.path("made-weights.bin")) if loaded.model.external_bytes else None
        fused = self.fuse(checked.model, cases, checked.expected, spill)
        if self.opt.precision != "fp32":
            fused = self.apply_precision(fused, spill)
        if self.opt.tp is not None:
            from graphconv.parallel.tensor_parallel import TensorParallel

            self._commit(ws, TensorParallel(self.ctx).run(loaded, checked, fused, cases, ws, spill))
            return
        cpu_form = opmap.fused.inline_fused(fused)
        network = lower(self.ctx, self.target.network_graph(fused, cpu_form), loaded, ws)
        self.target.check_network(network.net.program)
        if not self.opt.verify:
            try:
                emitted, expected = Verification(self.ctx).emit(network, ws), checked.expected
            except InternalError as e:
                raise verification.refusal(e, loaded, checked) from None
            self.report.census = census.primitive_census(emitted.mindir)
            self.report.validation["status"] = self.report.status = "unverified"
        else:
            emitted, expected = Verification(self.ctx).run(loaded, checked, fused, cpu_form, network, cases, spill, ws)
        if self.report.quantized_linears is not None:
            quantized_census.finish(self.report.quantized_linears, emitted.mindir, self.report.census,
                                    self.report.coverage)
        moves = self._artifacts(emitted.files, ws)
        if self.opt.bundle:
            moves.update(self.write_bundle(checked.model, emitted, cases, expected, ws))
        if self.opt.save_fused:
            target = Path(self.opt.save_fused)
            staged = ws.path("fused")
            staged.mkdir()
            # Named as the final file already: a `.data` file beside it is referenced by that name.
            for written in weights.save_self_contained(fused, staged / target.name):
                moves[written] = target.with_name(written.name)
            self.report.artifacts["fused_onnx"] = str(self.opt.save_fused)
        if self.opt.save_quantized:
            target = Path(self.opt.save_quantized)
            for written in self.paths.compiled.parent.iterdir():  # (the model and its weights file, if any)
                moves[written] = target.with_name(written.name)
            self.report.artifacts["quantized_onnx"] = str(target)
        self._commit(ws, moves)

    def _artifacts(self, files: list[Path], ws: Workspace) -> dict[Path, Path]:
        """temporary path -> final path for every artifact of this run."""
        moves: dict[Path, Path] = {}
        for f in files:
            if f.suffix == ".mindir":
                moves[f] = self.output
                self.report.artifacts["mindir"] = str(self.output)
            elif f.is_dir() and f.name == f"{self.output.stem}_variables":
                moves[f] = self.output.with_name(f.name)
                self.report.artifacts["variables"] = str(moves[f])
        if self.opt.emit_source:
            src_dir = ws.path("source")
            src_dir.mkdir()
            for name, key in (("network.py", "source"), ("network.ckpt", "checkpoint"),
                              ("network.names.json", "parameter_names")):
                shutil.copy(ws.path(name), src_dir / name)
                self.report.artifacts[key] = str(Path(self.opt.emit_source) / name)
            moves[src_dir] = Path(self.opt.emit_source)
        return moves

    def _commit(self, ws: Workspace, moves: dict[Path, Path], report_only: bool = False) -> None:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        self.report.peak_rss_bytes = max(own, kids) * 1024  # (this process or its largest child; Linux: KiB)
        if self.opt.report_path:
            self.report.artifacts["report"] = str(self.opt.report_path)
            if report_only:
                self.report.artifacts = {"report": str(self.opt.report_path)}
            tmp = ws.path("report.json")
            tmp.write_text(self.report.to_json())
            moves = {**moves, tmp: Path(self.opt.report_path)}
        if moves:
            ws.commit(moves)


def compile_model(model_path: str | Path, options: CompileOptions, progress: Progress | None = None) -> Report:
    """Compile one ONNX model into a verified MindIR at `options.output` (default: beside the model).

    Raises GraphconvError subclasses (exit_code attribute) with `.report` set to the partial report.
    """
    compiler = Compiler(Path(model_path), options, progress or SILENT)
    try:
        return compiler.run()
    except GraphconvError as e:
        compiler.report.status = "failed" if isinstance(e, VerificationError) else "error"
        compiler.report.error = str(e)
        compiler.report.exit_code = e.exit_code
        e.report = compiler.report
        raise


def compile(model_path: str | Path, output: str | Path | None = None, *, progress: Progress | None = None,
            **options) -> Report:
    """The Python API: compile_model with keyword options that are CompileOptions fields."""
    opts = CompileOptions(output=Path(output) if output else None, **options)
    opts.validate()
    return compile_model(model_path, opts, progress)


def analyze_fusions(model_path: str | Path, *, simplify: bool = True, passes: str | None = None,
                    disable_passes: tuple[str, ...] = (), plugins: tuple[str, ...] = ()) -> Report:
    """A compile's fusion analysis without lowering, emitting or verifying (`graphconv inspect --fusions`):
    load, simplify, the pass pipeline; the report's `fusions` and `coverage` are what a compile would
    report. Works in a private temporary directory under the system's temp dir, writes nothing else."""
    opts = CompileOptions(simplify=simplify, verify=False, passes=passes, disable_passes=tuple(disable_passes),
                          plugins=tuple(plugins))
    compiler = Compiler(Path(model_path), opts, SILENT)
    with Workspace(Path(tempfile.gettempdir()) / "graphconv-inspect.mindir") as ws:
        loaded = compiler.load(ws)
        spill = weights.SpillFile(ws.path("made-weights.bin")) if loaded.model.external_bytes else None
        compiler.fuse(compiler.simplify(loaded.model, ws), None, None, spill)
    compiler.report.status = "analyzed"
    return compiler.report
