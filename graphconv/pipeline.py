"""The compile pipeline, one Compiler method per stage (docs/architecture.md says where each stage's code lives):
load -> check ops -> simplify (onnxsim) -> validate (onnxruntime) -> passes (fuse) -> precision (fp16/bf16)
-> lower (opmap, the cpu twin too) -> emit (mindspore.export, and the verification run in the same child)
-> verify -> bundle -> commit (artifacts moved into place only when everything succeeded).

`compile()` is the Python API behind `graphconv compile`; it returns the Report and raises a GraphconvError
(with the report attached as `.report`) when the run cannot succeed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import resource
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import psutil

import onnx_ir as ir

import opmap.fused
import passes
from graphconv.frontend import param_names, readahead, weights
from graphconv.frontend.contrib import quant
from graphconv.target import blockwise, emit, layers, lowering, mindir_stream, targets
from graphconv.verify import census, compare, piecewise, reference
from passes import precision
from graphconv.target.child import ChildError, Warm, run_task
from graphconv.errors import GraphconvError, InputError, InternalError, UnsupportedError, VerificationError
from graphconv.frontend.load import LoadedModel, load, zero_sized_inputs
from graphconv.progress import SILENT, Progress
from graphconv.report import Report
from graphconv.workspace import Workspace

# the layer-by-layer oracle runs beside the MindSpore child while the weights take at most this share of the
# available memory (Compiler._oracle_beside_emit)
OVERLAP_MEMORY_SHARE = 0.25
# ... and, beside it, at this much lower scheduling priority (nice), so that the child, the compile's critical
# path, has the cores when both want them (_yielding_the_cores)
ORACLE_NICE = 10


def _yielding_the_cores(call):
    """call() in a thread of its own whose scheduling priority is ORACLE_NICE lower, its value returned or
    its error raised. The layer-by-layer oracle beside the emit: on 2 cores the two compete for the CPU, and
    the MindSpore child is the one the compile waits for (the oracle finished first, 6-8 s against the emit's
    13-16 s on the 1.1B benchmark). Yielding, the oracle takes 9-12 s and the emit 12-14 s; the compile took
    17.5-19.6 s against 19.2-22.5 s in 4 interleaved pairs, and 20.2-21.0 s against 20.0-23.3 s in 3 more (the
    host was slower then). On Linux a nice value is a thread's, and the
    threads it starts (onnxruntime's pools) inherit it: a thread of its own, so that the caller's thread (a
    user's, through the Python API) keeps its priority; unprivileged, a thread cannot take a lowered
    priority back. Elsewhere call() runs as it is."""
    if not sys.platform.startswith("linux"):
        return call()
    outcome: dict = {}

    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + ORACLE_NICE))
        except OSError:  # (a scheduler that refuses: the oracle runs at the priority it has)
            pass
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="oracle", daemon=True)  # (Ctrl-C in join: the compile unwinds)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _Overlap:
    """`call(*args, beside=self, **kwargs)` (Compiler.emit) in a thread while the `with` body (the oracle)
    runs, when `enabled`; else `result()` makes the call after the body, as before. Leaving the body by an
    exception sets `cancel` (emit's child is killed) and waits for the thread; `result()` gives the call's
    value or raises its error."""

    def __init__(self, enabled: bool, call, *args, **kwargs):
        self.call, self.args, self.kwargs = call, args, kwargs
        self.cancel, self.oracle_done = threading.Event(), threading.Event()
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, name="emit", daemon=True) if enabled else None

    @property
    def overlapping(self) -> bool:
        """Whether the body runs beside the call."""
        return self._thread is not None

    def _run(self) -> None:
        try:
            self._value = self.call(*self.args, beside=self, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by result()
            self._error = e

    def __enter__(self) -> "_Overlap":
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.oracle_done.set()
        if self._thread is not None:
            if exc_type is not None:
                self.cancel.set()
            self._thread.join()

    def result(self):
        if self._thread is None:
            return self.call(*self.args, **self.kwargs)
        if self._error is not None:
            raise self._error
        return self._value


@dataclasses.dataclass
class CompileOptions:
    output: Path | None = None
    target: str = "ascend"
    simplify: bool = True
    verify: bool = True
    inputs: tuple[Path, ...] = ()
    dims: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    mask_inputs: tuple[str, ...] = ()
    atol: float | None = None
    rtol: float | None = None
    report_path: Path | None = None
    emit_source: Path | None = None
    passes: str | None = None  # textual pipeline, e.g. "fuse-rmsnorm"; None = the default pipeline
    disable_passes: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    verify_each: bool = False
    save_fused: Path | None = None
    bundle: Path | None = None  # deploy bundle directory (graphconv.deploy)
    soc: str = "Ascend910B"
    cann: str | None = None  # None: the newest version graphconv.deploy knows
    shape_ranges: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # dim -> (min, max)
    precision: str = "fp32"  # fp32 | fp16 | bf16 (passes.precision)
    keep_fp32: str | None = None  # op types computed in fp32; None = passes.precision.KEEP_FP32
    # verify block by block (graphconv/target/blockwise) against onnxruntime run layer by layer
    # (graphconv/verify/piecewise): None = when the model's weights exceed blockwise.THRESHOLD_BYTES (2 GiB);
    # True / False force it either way
    layer_streamed: bool | None = None


def tool_versions() -> dict[str, str]:
    out = {}
    for dist in ("onnx", "onnxruntime", "onnxsim", "onnx-ir", "onnxscript", "mindspore", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _model_info(model: onnx.ModelProto) -> dict:
    return {
        "inputs": [s.as_dict() for s in reference.input_specs(model)],
        "outputs": reference.output_specs(model),
        "opset_imports": {(i.domain or "ai.onnx"): i.version for i in model.opset_import},
        "nodes": len(model.graph.node),
    }


def _histogram(model: onnx.ModelProto) -> dict[str, int]:
    hist: dict[str, int] = {}
    for n in model.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items()))


def _inputs_already_fp16(fused: onnx.ModelProto, ops: set[str]) -> bool:
    """Whether every node of the fused ops `ops` whose ascend lowering computes in fp16 already gets fp16 data
    inputs (its mask aside): its ascend-precision body then rounds nothing its reference body does not."""
    g = fused.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    small = {t.name: t for t in g.initializer if not t.external_data}
    small.update({n.output[0]: a.t for n in g.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"})

    def fp16(name: str) -> bool:  # an fp16 value, or a constant fp16 holds exactly (the rewriter's 0.0 shift)
        if name in small:
            v = onnx.numpy_helper.to_array(small[name])
            return v.dtype.kind == "f" and bool(np.array_equal(v.astype(np.float16).astype(v.dtype), v))
        return types.get(name) == onnx.TensorProto.FLOAT16

    nodes = [n for n in g.node if n.domain == opmap.fused.DOMAIN and n.op_type in ops]
    return bool(nodes) and all(
        opmap.fused.FUSED_OPS[n.op_type].ascend_compute == "fp16"
        and all(fp16(name) for i, name in enumerate(n.input) if name and i not in opmap.fused.FUSED_OPS[n.op_type].as_is_inputs)
        for n in nodes)


def _peak_rss() -> int:
    """Peak resident memory of this process or of its largest child, in bytes (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) * 1024


class Compiler:
    def __init__(self, model_path: Path, options: CompileOptions, progress: Progress):
        self.model_path = Path(model_path)
        self.opt = options
        self.progress = progress
        self.report = Report()
        plugins = passes.load_plugins(options.plugins)
        self.pass_manager = passes.PassManager(options.passes, options.disable_passes)
        self.scopes = layers.Scopes()
        self.case_dims: dict[str, tuple[int, int]] = {}
        self.boundary_values: list[dict] | None = None  # the oracle's values between its pieces, per case
        self.layer_streamed = False
        self._deferred_oracle: tuple[onnx.ModelProto, list] | None = None  # (model, pieces) in layer-streamed mode
        self.block_names: dict[str, str] = {}
        self._warm: Warm | None = None  # the emit stage's child, started with the compile (run)
        self._ahead_ranges: list[tuple[str, int, int]] = []  # the weight files to read ahead (load)
        self._ahead: readahead.Readahead | None = None  # the weights read into the page cache (run)
        self.zero_sized: str | None = None
        self.ort_refused: str | None = None  # why onnxruntime could not run the model (onnx.reference did)
        self.pad_masks = True
        self.report.provenance = {
            "tools": tool_versions(), "passes": self.pass_manager.names, "plugins": plugins,
            "target": options.target, "precision": options.precision,
        }
        self.output = Path(options.output) if options.output else self.model_path.with_suffix(".mindir")

    # --- stages -------------------------------------------------------------------------------------
    def load(self) -> LoadedModel:
        self.progress.info(f"load {self.model_path}")
        with self.report.stage("load") as st:
            loaded = load(self.model_path)
            # External weights stay on disk for the whole compile (graphconv.frontend.weights).
            self.streaming, self._spill = loaded.external_bytes > 0, None
            # Layer by layer (the oracle, graphconv.verify.piecewise, and the MindSpore run, graphconv.target.
            # blockwise) past blockwise.THRESHOLD_BYTES of weights, or as --layer-streamed/--whole-network say.
            self.layer_streamed = (self.opt.layer_streamed if self.opt.layer_streamed is not None
                                   else loaded.external_bytes > blockwise.THRESHOLD_BYTES)
            st.nodes_after = len(loaded.proto.graph.node)
            if loaded.external_bytes:
                st.detail = {"external_weight_bytes": loaded.external_bytes, "weights": "read in place"}
            # the weight files the layer-streamed stages read twice after the passes, asked of the disk from the
            # compile's start (run) while they fit the page cache (graphconv.frontend.readahead)
            if self.layer_streamed and self.opt.verify and _fits_page_cache(loaded.external_bytes):
                self._ahead_ranges = readahead.file_ranges(weights.external_refs(loaded.proto).values())
                st.detail["weights_read_ahead_bytes"] = sum(n for _, _, n in self._ahead_ranges)
            if loaded.upgraded_from is not None:
                st.detail["upgraded_from_opset"] = loaded.upgraded_from
                self.report.warnings.append(
                    f"opset {loaded.upgraded_from} upgraded to {loaded.opset} with onnx.version_converter; the "
                    "oracle runs the model as given")
            if loaded.decomposed:
                st.detail["onnxruntime_contrib_ops_decomposed"] = loaded.decomposed
            self.case_dims, self.pad_masks = loaded.case_dims, loaded.pad_masks
            if loaded.quantized_weights:
                st.detail["quantized_weights"] = loaded.quantized_weights
            self.report.warnings.extend(loaded.notes)
        self.report.model = _model_info(loaded.proto)
        self.zero_sized = zero_sized_inputs(loaded.proto)  # (why MindSpore may refuse the network)
        # Which layer each node is in, from the exporter's module scopes (onnxsim drops dynamo's metadata).
        self.scopes = layers.record_scopes(loaded.proto)
        # Weight names are recovered from the model as loaded: onnxsim folds transposed weights into new
        # initializers and drops what tells whose they were (graphconv.frontend.param_names).
        self.names = param_names.WeightNames.record(loaded.proto)
        self.report.op_histogram = _histogram(loaded.proto)
        missing = lowering.unsupported_ops(loaded.proto)
        if missing:
            self.report.unsupported_ops = missing
            raise UnsupportedError(f"{len(missing)} unsupported op(s): {', '.join(missing)}")
        return loaded

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
            if loaded.packed:
                # Packed quantized weights go in as graph inputs too, so that onnxsim does not fold their
                # dequantization into float weights: the network keeps them packed (frontend/contrib/quant.py).
                bare, held = quant.held_out(bare, loaded.packed)
                refs = {**refs, **held}
            onnx.save(bare, src)
            try:
                run_task("simplify", {"input": str(src), "output": str(dst)}, ws.dir, "onnxsim")
                simplified = weights.restore(onnx.load(str(dst)), model, refs)
                simplified = onnx.shape_inference.infer_shapes(simplified, data_prop=True)
            except (InternalError, onnx.shape_inference.InferenceError) as e:
                self.report.warnings.append(f"simplification skipped: {e}")
                st.nodes_after = st.nodes_before
                return model
            st.nodes_after = len(simplified.graph.node)
        return simplified

    def reference_cases(self, model: onnx.ModelProto) -> list[reference.ReferenceCase]:
        if self.opt.inputs:
            return reference.load_npz_cases(list(self.opt.inputs), model, self.opt.mask_inputs)
        # the sizes contrib kernels accept (graphconv.frontend.contrib.cases); the user's --dim win
        return reference.make_cases(model, self.opt.mask_inputs, self.opt.dims, pad_masks=self.pad_masks,
                                    preferred_dims=self.case_dims)

    def validate(self, original: onnx.ModelProto, simplified: onnx.ModelProto,
                 cases: list[reference.ReferenceCase], as_given: onnx.ModelProto | None = None,
                 shipped: LoadedModel | None = None) -> tuple[list[dict], onnx.ModelProto]:
        """Oracle outputs of the original model (`as_given`, the user's, where loading upgraded its opset: a
        converter fault is then caught too), and the model to compile: the simplified one if it agrees with
        the original, else the original (with a warning)."""
        self.progress.info("validate (reference outputs)")
        with self.report.stage("validate") as st:
            oracle_model = as_given if as_given is not None else original
            if self.layer_streamed and not self.opt.verify_each:
                oracle_model = self._exact_products(oracle_model)
            pieces = self._oracle_pieces(oracle_model)
            if pieces is not None:
                # Run once the block boundaries are known (oracle_by_layers), with their values kept.
                self._deferred_oracle = (oracle_model, pieces)
                st.detail = {"oracle": "layer by layer, after lowering"}
                if simplified is not original:
                    self.report.warnings.append(
                        "onnxsim's output is not run on its own at this size (a second pass over the weights): the "
                        "verification of the compiled network checks it; if that fails, try --no-simplify")
                return None, simplified
            oracle = reference.Oracle(oracle_model)
            try:
                expected = oracle.run(cases)
            except UnsupportedError as e:
                if self.opt.inputs or oracle.load_failed:  # (onnxruntime refused the model, not its inputs)
                    raise
                # Generated inputs: dims the graph relates but neither names nor implies are the likely cause.
                raise UnsupportedError(f"{e}; the generated inputs had {reference.dims_text(original, cases[0])}: "
                                       "if some of these dims are related, give --dim NAME=A,B for each free one "
                                       "or --inputs") from None
            self.report.validation["oracle"] = oracle.name
            if oracle.exact:
                self.report.validation["oracle_exact"] = reference.exact_note(oracle.exact)
            if oracle.fallback_reason:
                self.report.warnings.append(oracle.fallback_reason + "; using onnx.reference instead")
                self.ort_refused = oracle.fallback_reason
            if shipped is not None and shipped.as_shipped is not None:
                self._accuracy_level_difference(shipped, cases, expected)
            if simplified is original and as_given is None:
                return expected, original
            got = reference.Oracle(simplified).run(cases)
            atol, rtol = self._tolerance()
            for case, exp, act in zip(cases, expected, got):
                for name, ref in exp.items():
                    c = compare.compare(act[name], ref, atol, rtol, case.valid_positions(ref))
                    if not c.ok:
                        self.report.warnings.append(
                            f"onnxsim changed output {name!r} at {case.shape_text()} ({c.reason}); "
                            "compiling the unsimplified model")
                        return expected, original
        return expected, simplified

    def _exact_products(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """`model` with its integer products exact (reference.exact_integer_products), for the layer-by-layer
        oracle, which runs in onnxruntime what it is given; the report says so."""
        model, counts = reference.exact_integer_products(model)
        if counts:
            self.report.validation["oracle_exact"] = reference.exact_note(counts)
        return model

    def _oracle_pieces(self, model: onnx.ModelProto) -> list[piecewise.Piece] | None:
        """The pieces the oracle runs one at a time in layer-streamed mode (None: it runs the model whole, as
        it does under --verify-each, which needs its outputs before the passes)."""
        if not self.layer_streamed or self.opt.verify_each:
            return None
        pieces = piecewise.partition(model, self.scopes.nodes)
        if pieces is None:
            self.report.warnings.append("the oracle runs the model whole: no layers found in its weight names or "
                                        "scopes to run it layer by layer")
        return pieces

    def oracle_by_layers(self, cases, keep: set[str], variant=None,
                         beside_emit: bool = False) -> tuple[list[dict], list[dict] | None]:
        """The deferred oracle (validate): onnxruntime runs the model piece by piece (graphconv.verify.piecewise);
        the values the layer-streamed check compares (`keep`) are kept in self.boundary_values. With `variant`
        (ascend_precision_variant), that graph runs too, its pieces beside the model's of the same layer (one
        read of the weights from disk): its outputs are returned second (else None). `beside_emit`: the
        MindSpore child runs meanwhile, and the oracle yields it the cores (_yielding_the_cores)."""
        model, pieces = self._deferred_oracle
        runs = [(model, pieces, keep)]
        variant_model = reference.exact_integer_products(variant[0])[0] if variant else None
        variant_pieces = piecewise.partition(variant_model, self.scopes.nodes) if variant else None
        if variant_pieces:
            runs.append((variant_model, variant_pieces, set()))
        self.progress.info(f"oracle (onnxruntime, layer by layer: {len(pieces)} pieces"
                           + (", with the ascend-precision variant's)" if variant_pieces else ")"))
        with self.report.stage("oracle") as st:
            asked_ahead = self._ahead.asked if self._ahead is not None else None  # (graphconv.frontend.readahead)
            def run():
                return piecewise.run_together(runs, cases, progress=self.progress)

            results = _yielding_the_cores(run) if beside_emit else run()
            expected, self.boundary_values, rows = results[0]
            self.report.validation["oracle"] = "onnxruntime (layer by layer)"
            st.detail = {"pieces": len(rows), "largest_piece_weight_bytes": max(r["weight_bytes"] for r in rows),
                         "kept_values": len(self.boundary_values[0])}
            if asked_ahead:
                st.detail["weights_asked_of_the_disk_before_bytes"] = asked_ahead
            if beside_emit:
                st.detail["beside_emit_at_nice"] = ORACLE_NICE
            if variant_pieces:
                st.detail["ascend_precision_variant_pieces"] = len(results[1][2])
                # merged weights, made from the pages the model's piece has just read (weights.read)
                st.detail["variant_weights_made_from_parts"] = sum(r["weights_made_from_parts"] for r in results[1][2])
        return expected, results[1][0] if variant_pieces else None

    def _accuracy_level_difference(self, loaded: LoadedModel, cases, expected) -> None:
        """MatMulNBits at accuracy_level 4 lets onnxruntime quantize the activations to int8, so the model as
        given only approximates the op; the oracle ran it at level 0 (graphconv.frontend.load). The report
        states how far the model as given is from that reference (worst case over the reference shapes)."""
        got = reference.Oracle(loaded.as_shipped).run(cases)
        diff: dict[str, dict] = {}
        for case, exp, act in zip(cases, expected, got):
            for name, ref in exp.items():
                c = compare.compare(act[name], ref, valid=case.valid_positions(ref))
                d = diff.setdefault(name, {"max_abs": 0.0, "mean_abs": 0.0, "cosine": 1.0})
                d["max_abs"], d["mean_abs"] = max(d["max_abs"], c.max_abs), max(d["mean_abs"], c.mean_abs)
                d["cosine"] = min(d["cosine"], c.cosine)
        levels = ", ".join(map(str, loaded.accuracy_levels))
        self.report.validation[f"accuracy_level_{levels}_vs_0"] = diff
        worst = max((d["max_abs"] for d in diff.values()), default=0.0)
        self.report.warnings.append(
            f"MatMulNBits accuracy_level {levels}: onnxruntime may quantize the activations there; the oracle runs "
            f"the model at accuracy_level 0 (the op's exact semantics), from which the model as given differs by "
            f"max abs {worst:.3g}")

    def fuse(self, model: onnx.ModelProto, cases, expected, ws: Workspace) -> onnx.ModelProto:
        """Run the pass pipeline; the result carries the function bodies of the fused ops it uses."""
        self.progress.info(f"passes ({', '.join(self.pass_manager.names) or 'none'})")
        with self.report.stage("passes") as st:
            st.nodes_before = len(model.graph.node)
            ir_model = ir.from_proto(model)
            check = self._check_pass if self.opt.verify_each and expected is not None else None
            tracker = self.progress.track("passes", len(self.pass_manager.names), "passes")

            spilled = 0

            def after_each(p, m, k):
                nonlocal spilled
                if self.streaming:  # weights a pass made (merged gate/up) leave memory before the next pass
                    spilled += weights.spill_new_tensors(m, self.spill(ws))
                    weights.release_mapped(m)
                if check:
                    check(p, m, cases, expected)
                tracker.update(tracker.done + 1)

            self.report.fusions = self.pass_manager.run(ir_model, after_each=after_each)
            self.report.coverage = self.pass_manager.coverage
            self.report.skipped_fusions = passes.skipped_fusions(self.pass_manager)
            if self.streaming:  # (merged weights of weights in files are written nowhere: made from their parts)
                st.detail = {"spilled_bytes": spilled, "concatenated_bytes": self.spill(ws).concatenated_bytes}
            fused = opmap.fused.attach_functions(ir.to_proto(ir_model))
            fused = onnx.shape_inference.infer_shapes(fused, data_prop=True)
            st.nodes_after = len(fused.graph.node)
        return fused

    def _check_pass(self, p, ir_model: ir.Model, cases, expected) -> None:
        """--verify-each: the graph after pass `p` must still match the oracle (run by onnxruntime with
        the fused ops' function bodies)."""
        candidate = opmap.fused.attach_functions(ir.to_proto(ir_model))
        got = reference.Oracle(candidate).run(cases)
        atol, rtol = self._tolerance()
        for case, exp, act in zip(cases, expected, got):
            for name, ref in exp.items():
                c = compare.compare(act[name], ref, atol, rtol, case.valid_positions(ref))
                if not c.ok:
                    raise VerificationError(f"pass {p.name!r} broke equivalence: output {name!r} at "
                                            f"{case.shape_text()}: {c.reason}")

    def lower(self, model: onnx.ModelProto, ws: Workspace, name: str = "network") -> tuple[lowering.LoweredNetwork, dict]:
        self.progress.info(f"lower (opmap{', cpu twin' if name != 'network' else ''})")
        with self.report.stage("lower" if name == "network" else f"lower-{name}") as st:
            st.nodes_before = st.nodes_after = len(model.graph.node)
            # lazy_inline (graphconv/codegen.render) for the target's MindIR where the target says so
            # (graphconv/target/targets.py); never for the cpu twin, which runs directly.
            lazy = name == "network" and self.target.lazy_inline
            net, task = emit.prepare(model, ws.dir, name, names=self.names, scopes=self.scopes, lazy_inline=lazy)
            st.detail = {"parameters": len(net.params), "source_lines": net.source.count("\n"),
                         "layers": net.layers,
                         "parameter_names": param_names.name_summary(ws.path(f"{name}.names.json"))}
        return net, task

    def emit(self, task: dict, ws: Workspace, checkpoint: bool = False, run: dict | None = None,
             twin: dict | None = None, beside=None) -> tuple[list[Path], dict | None]:
        """mindspore.export in a child; with `run` (the verification cases) the same child then runs them, on
        the MindIR (cpu target) or on the cpu twin task `twin` built from the exported network's Parameters
        (graphconv/worker.export_and_verify). Returns the files and that run's result (None without run).
        `beside` (an _Overlap): called from its thread while the oracle runs; its progress line waits for the
        oracle's to end, and the child is killed when the oracle fails."""
        self.progress.info("emit (mindspore.export)" + (" and the verification run, in one process" if run else "")
                           + (", beside the oracle" if beside else ""))
        with self.report.stage("emit") as st:
            out_dir = ws.path("out")
            out_dir.mkdir()
            task = {**task, "file_base": str(out_dir / self.output.stem),
                    "checkpoint": str(ws.path("network.ckpt")) if checkpoint else None}
            tracker = self._weights_tracker(task)
            st.detail = {"weights_read_from_files_bytes": tracker.total if tracker else 0}
            warm_free = self._warm is not None and not self._warm.taken
            cancel = None
            if beside is not None:
                cancel = beside.cancel
                st.detail["beside_oracle"] = True
                if tracker is not None:
                    tracker.hold = beside.oracle_done
            try:
                if run is None:
                    result = run_task("export", task, ws.dir, "mindspore.export", tracker, cancel, self._warm)
                else:
                    result = run_task("export_and_verify", {"export": task, "run": run, "twin": twin}, ws.dir,
                                      "mindspore.export", tracker, cancel, self._warm)
                st.detail["child_started_with_compile"] = warm_free and self._warm.taken
                if "warm_up" in result:  # (graphconv.target.worker._warm_up: its seconds, or the error it met)
                    st.detail["child_warm_up"] = result["warm_up"]
                st.detail.update({k: result[k] for k in ("build_seconds", "export_seconds", "streamed", "graph_seconds",
                                                       "weights_seconds", "weights_put_by_verification_bytes") if k in result})
            except ChildError as e:
                raise self._mindspore_refused(f"mindspore.export rejected the generated network: {e.error}") from e
        done = None
        if run is not None:
            done = result.get("verify") or {"error": result.get("verify_error", "no result")}
        return [Path(p) for p in result["files"]], done

    def _case_run(self, model: onnx.ModelProto, cases, ws: Workspace) -> dict:
        """The verification cases as files, and what a MindSpore child needs to run them."""
        input_placeholders = emit.placeholders(model)
        case_files, out_files = [], []
        for k, case in enumerate(cases):
            p = ws.path(f"case{k}.npz")
            np.savez(p, **case.inputs)
            case_files.append(str(p))
            out_files.append(str(ws.path(f"case{k}.out.npz")))
        return {"cases": case_files, "outputs": out_files, "input_names": [s["name"] for s in input_placeholders],
                "inputs": input_placeholders}

    def verify(self, mindir: Path | None, model: onnx.ModelProto, cases, expected, output_names: list[str],
               ws: Workspace, network_task: dict | None = None, run: dict | None = None,
               done: dict | None = None) -> None:
        """Compare the MindSpore outputs of every case with the oracle: `done` when the export child already
        ran them (emit's `run`), else run here the MindIR (or, with network_task, the network built from its
        source) on CPU."""
        what = "the emitted MindIR" if mindir is not None else "the cpu twin"
        self.progress.info("verify (MindSpore CPU vs oracle" + (", cpu twin)" if mindir is None else ")"))
        with self.report.stage("verify") as st:
            run = run or self._case_run(model, cases, ws)
            if done is None:
                try:
                    if network_task is None:
                        done = run_task("run_mindir", {**run, "mindir": str(mindir)}, ws.dir, "MindSpore CPU run")
                    else:
                        done = run_task("run_network", {**network_task, **run}, ws.dir, "MindSpore CPU run",
                                        self._weights_tracker(network_task))
                except ChildError as e:
                    raise self._mindspore_refused(_cpu_run_error(what, e.error, model)) from e
            elif "error" in done:
                raise self._mindspore_refused(_cpu_run_error(what, done["error"], model))
            else:
                st.detail = {"in_export_process": True}
            st.detail = {**(st.detail or {}),
                         **{k: done[k] for k in ("build_seconds", "case_seconds", "shared_parameters") if k in done}}
            out_files = run["outputs"]
            atol, rtol = self._tolerance(compiled=True)
            results, failures, overflows = [], [], []
            for case, exp, out_file in zip(cases, expected, out_files):
                with np.load(out_file) as got:
                    outs = []
                    for i, name in enumerate(output_names):
                        ref = exp[name]
                        atol, rtol = self._tolerance(True, ref)
                        c = compare.compare(reference.typed(got[f"out{i}"]), ref, atol, rtol, case.valid_positions(ref))
                        outs.append({"name": name, "shape": list(ref.shape), **c.as_dict()})
                        if not c.ok:
                            failures.append(f"output {name!r} at {case.shape_text()}: {c.reason} "
                                            f"(max abs {c.max_abs:.3g})")
                            overflows.append(c.overflow)
                results.append({"name": case.name, "inputs": {k: list(v.shape) for k, v in case.inputs.items()},
                                "outputs": outs})
            self.report.validation.update({
                "status": "failed" if failures else "verified",
                "atol": atol, "rtol": rtol, "cases": results,
            })
            if failures and all(overflows):
                # Both sides overflowed, differently: where inf meets -inf (a NaN) depends on the order of
                # the arithmetic, which neither runtime promises. Nothing can be verified on these inputs.
                self.report.validation["status"] = "unverifiable"
                raise UnsupportedError(f"cannot verify: the model overflows on the reference inputs ({failures[0]}, "
                                       "and onnxruntime's and MindSpore's values there are all inf or NaN, or at the end "
                                       "of float32's range, where rounding is beyond any tolerance: which way they go "
                                       "depends on the order of the arithmetic)")
            if failures:
                raise VerificationError("verification failed: " + "; ".join(failures))

    def _block_plan(self, net: lowering.LoweredNetwork, task: dict, run: dict, model: onnx.ModelProto,
                    ws: Workspace):
        """The blocks to verify one at a time (graphconv/target/blockwise), or None for the whole-network check:
        past blockwise.THRESHOLD_BYTES of weights, or as CompileOptions.layer_streamed says; a network
        without repeated layers is checked whole. Adds the block files to `run`, and sets self.block_names
        (generated boundary value -> the ONNX value of `model` it holds)."""
        size = sum(int(np.prod(p.shape, dtype=np.int64)) * mindir_stream.numpy_dtype(p.dtype).itemsize
                   for p in net.params)
        self.report.validation["mode"] = "whole-network"
        if not self.layer_streamed:
            return None
        plan = blockwise.plan(Path(task["source"]).read_text(), task["class_name"], (net.layers or {}).get("prefix"))
        if not plan.layers:
            self.report.warnings.append(f"no layers found ({(net.layers or {}).get('reason', '')}): the network is"
                                        f" verified as a whole ({size / 2**30:.2f} GiB of Parameters)")
            return None
        self.report.validation["mode"] = "layer-streamed"
        run["block_values"] = [str(ws.path(f"case{k}.blocks.npz")) for k in range(len(run["cases"]))]
        run["block_module"] = str(ws.path(f"{Path(task['source']).stem}_blocks.py"))
        run["block_prefix"] = (net.layers or {}).get("prefix")  # (the child cuts the same blocks)
        graph_names = {o for n in model.graph.node for o in n.output if o}
        self.block_names = blockwise.onnx_names(plan, graph_names, run["block_prefix"])
        return plan

    def verify_blocks(self, plan, net: lowering.LoweredNetwork, model: onnx.ModelProto, cases, run: dict,
                      done: dict | None) -> None:
        """The layer-streamed run's values at every block boundary against onnxruntime's values of the same
        ONNX values (kept by the layer-by-layer oracle, else one run with them exposed), by the comparison
        rule; the first failing block is named."""
        self.progress.info("verify blocks (layer-streamed: boundary values vs oracle)")
        with self.report.stage("verify-blocks") as st:
            if not done or "blocks" not in done:
                raise self._mindspore_refused(f"the layer-streamed run did not run on CPU: {(done or {}).get('error', 'no result')}")
            names = self.block_names
            if self.boundary_values is not None:  # kept by the layer-by-layer oracle
                expected = self.boundary_values
            else:
                expected = blockwise.oracle_values(model, sorted(set(names.values())), cases)
            rows, failure = blockwise.check(done["blocks"], names, cases, expected, run["block_values"],
                                            lambda ref: self._tolerance(True, ref))
            st.detail = {"blocks": len(rows), "compared_values": sum(len(r["values"]) for r in rows[:-1]),
                         "child_peak_rss_after_block": max(b["rss_after"] for b in done["blocks"]),
                         "child_peak_rss": done.get("peak_rss")}
            self.report.validation["layer_streamed"] = {"threshold_bytes": blockwise.THRESHOLD_BYTES, "blocks": rows}
            if failure is not None:
                self.report.validation["status"] = "failed"
                raise VerificationError(f"layer-streamed verification failed at {failure}")

    def _mindspore_refused(self, error: "str | GraphconvError") -> GraphconvError:
        """MindSpore refusing the network is graphconv's fault (internal), unless onnxruntime refused the model
        too (onnx.reference was the oracle): two runtimes refusing it point at the model (an invalid Reshape
        target of -5, say, which onnx.reference's numpy reshape accepts); or unless a graph input is zero-sized,
        which some MindSpore kernels refuse (frontend.load.zero_sized_inputs)."""
        if isinstance(error, GraphconvError) and not isinstance(error, InternalError):
            return error
        if self.zero_sized:
            return UnsupportedError(f"{str(error).splitlines()[0][:300]}; {self.zero_sized}")
        if self.ort_refused:
            return UnsupportedError(f"{str(error).splitlines()[0][:300]}; {self.ort_refused}")
        return error if isinstance(error, GraphconvError) else InternalError(error)

    def _oracle_beside_emit(self, task: dict) -> bool:
        """Whether the layer-by-layer oracle (onnxruntime, in this process) runs while the MindSpore child
        exports and runs the blocks: the two are independent until verify_blocks compares their values, and
        on 2 cores the child's start-up (MindSpore's import, the graph export, the first compiles: single-
        threaded) leaves the oracle a core. Both read every weight: only while the weights take at most
        OVERLAP_MEMORY_SHARE of the available memory do they stay in the page cache from one read to the other
        (beside both processes' working sets); past that the two would read the disk twice and compete for it
        (a 7B), and they run one after the other, as before."""
        return _fits_page_cache(_external_bytes(task))

    def _weights_tracker(self, task: dict):
        """Progress of a MindSpore child reading the weights that stay in files (graphconv.frontend.weights), or None."""
        external = _external_bytes(task)
        return self.progress.track("weights into MindSpore", external) if external else None

    def apply_precision(self, fused: onnx.ModelProto, ws: Workspace) -> onnx.ModelProto:
        """--precision fp16|bf16: weights and compute in the low dtype, the keep set in fp32."""
        self.progress.info(f"precision {self.opt.precision}")
        with self.report.stage("precision") as st:
            st.nodes_before = len(fused.graph.node)
            try:
                low, summary = precision.apply_precision(fused, self.opt.precision,
                                                         precision.parse_keep(self.opt.keep_fp32),
                                                         spill=self.spill(ws))
            except precision.PrecisionError as e:
                raise UnsupportedError(str(e)) from e
            st.nodes_after = len(low.graph.node)
        info = summary.as_dict()
        if precision.CPU_EMULATED[self.opt.precision]:
            info["cpu_emulation"] = precision.emulation_note(self.opt.precision)
        self.report.validation["precision"] = info
        return low

    def profile_precision(self, model: onnx.ModelProto, fused: onnx.ModelProto, twin: onnx.ModelProto,
                          case: reference.ReferenceCase, ws: Workspace) -> None:
        """Per-layer error growth: the error of the low-precision network against the fp32 oracle at every
        normalization output (two per transformer layer; matmul outputs for models without norms)."""
        from graphconv.verify import debug

        names = _checkpoints(fused, model)
        if not names:
            return
        self.progress.info(f"precision profile ({len(names)} checkpoints)")
        with self.report.stage("precision-profile"):
            expected, got, _ = debug.trace(model, twin, case, [n for n, _ in names], ws.dir)
            rows = []
            for name, op in names:
                if name in expected and name in got:
                    c = compare.compare(got[name], expected[name], *self._tolerance(compiled=True))
                    rows.append({"value": name, "op": op, "max_abs": c.max_abs, "mean_abs": c.mean_abs,
                                 "cosine": c.cosine})
        self.report.validation["precision"]["layers"] = rows

    def ascend_precision_variant(self, fused: onnx.ModelProto) -> tuple[onnx.ModelProto, set, set] | None:
        """Where the ascend lowering computes in lower precision than the fused op's reference body (q/k/v
        cast to fp16 around FlashAttentionScore): the fused graph with bodies that round like the ascend
        lowering, the ops that differ and the passes that make them; None where there is nothing to measure."""
        if not self.target.measures_primitive_precision(self.opt.precision):
            return None
        variant = opmap.fused.ascend_precision_variant(fused)
        if variant is None:
            return None
        used = {n.op_type for n in fused.graph.node if n.domain == opmap.fused.DOMAIN}
        variant_ops = {op for op in used if opmap.fused.FUSED_OPS[op].ascend_body}
        variant_passes = {opmap.fused.FUSED_OPS[op].producer for op in variant_ops}
        if _inputs_already_fp16(fused, variant_ops):  # (an fp16 model: the variant computes what the graph does)
            self.report.validation["ascend_precision"] = {"status": "not needed",
                                                          "why": "the fused ops' inputs are fp16 already"}
            return None
        return variant, variant_ops, variant_passes

    def check_ascend_precision(self, variant, cases, expected, got=None) -> None:
        """The ascend-precision variant (ascend_precision_variant) run by onnxruntime (`got`: already run, with
        the layer-by-layer oracle) against the oracle, at the lower precision's tolerance."""
        variant, variant_ops, variant_passes = variant
        self.progress.info("ascend precision (fp16 casts) vs oracle")
        with self.report.stage("ascend-precision") as st:
            if got is not None:
                st.detail = {"run": "with the oracle, piece by piece"}
            else:  # piece by piece: its integer products exact, as reference.Oracle runs them
                exact = reference.exact_integer_products(variant)[0] if self.layer_streamed else None
                pieces = piecewise.partition(exact, self.scopes.nodes) if exact is not None else None
                got = piecewise.run(exact, pieces, cases)[0] if pieces else reference.Oracle(variant).run(cases)
            atol, rtol = compare.default_tolerance("float16")
            results, failures, beyond = [], [], []
            for case, exp, act in zip(cases, expected, got):
                for name, ref in exp.items():
                    c = compare.compare(act[name], ref, atol, rtol, case.valid_positions(ref))
                    results.append({"case": case.name, "name": name, **c.as_dict()})
                    if not c.ok:
                        text = f"output {name!r} at {case.shape_text()}: {c.reason} (max abs {c.max_abs:.3g})"
                        (failures if c.suspicious else beyond).append(text)
            status = "failed" if beyond else "exceeds fp16 tolerance" if failures else "ok"
            self.report.validation["ascend_precision"] = {
                "precision": "float16", "atol": atol, "rtol": rtol, "outputs": results, "status": status}
            if beyond:  # not the rounding of fp16 inputs: beyond 100x fp16's tolerance (overflow, say)
                raise VerificationError("the ascend lowering's fp16 casts exceed fp16 tolerance: " + "; ".join(beyond))
            if failures:
                # Within 100x (the comparison rule's "suspicious"): what fp16 inputs do to a deep model (a 32-layer
                # 7B: a few logits in 10^5). The user is told, and how to keep the computation in fp32.
                self.report.warnings.append(
                    "the fp16 inputs the ascend lowering gives " + ", ".join(sorted(variant_ops)) + " (Ascend has no "
                    "fp32 form) move values beyond fp16 tolerance, within 100x of it: " + "; ".join(failures)
                    + "; --disable-passes " + ",".join(sorted(variant_passes)) + " keeps them in fp32")

    def _tolerance(self, compiled: bool = False, reference_value: np.ndarray | None = None) -> tuple[float, float]:
        """The user's tolerance, else the comparison rule's default: fp32 for graph-to-graph checks, the
        compile precision's for the compiled network (`compiled`), or the reference value's own dtype's where
        that is looser (an fp16 model's fp16 outputs: the oracle computed them in fp16)."""
        atol, rtol = compare.default_tolerance(precision.TOLERANCE_KEY[self.opt.precision if compiled else "fp32"])
        if reference_value is not None:
            own = compare.default_tolerance(reference_value.dtype.name)
            atol, rtol = max(atol, own[0]), max(rtol, own[1])
        return (self.opt.atol if self.opt.atol is not None else atol,
                self.opt.rtol if self.opt.rtol is not None else rtol)

    @property
    def target(self) -> targets.Target:
        return targets.get(self.opt.target)

    # --- the run ------------------------------------------------------------------------------------
    def run(self) -> Report:
        if self.opt.precision not in precision.PRECISIONS:
            raise InputError(f"unknown precision {self.opt.precision!r} (choose from {', '.join(precision.PRECISIONS)})")
        self.target.check(self.opt.precision)
        if self.opt.keep_fp32 is not None and self.opt.precision == "fp32":
            raise InputError("--keep-fp32 needs --precision fp16 or bf16")
        try:
            precision.check_keep(precision.parse_keep(self.opt.keep_fp32))
        except precision.PrecisionError as e:
            raise InputError(str(e)) from e
        if self.output.suffix != ".mindir":
            raise InputError(f"output {self.output} must end in .mindir")
        if not self.output.parent.absolute().is_dir():
            raise InputError(f"output directory {self.output.parent} does not exist")
        loaded = self.load()
        if self.opt.bundle:  # refuse bad bundle options now, not after a long compile
            from graphconv import deploy

            deploy.check_options(self.report.model["inputs"], self.opt.shape_ranges, self.opt.cann)
        # the MindSpore child of the emit stage starts now: its import overlaps the stages before it; so does
        # the reading of the weights from disk, which the oracle and that child read after the lowering
        with Workspace(self.output) as ws, Warm(ws.dir) as self._warm, \
                readahead.Readahead(self._ahead_ranges) as self._ahead:
            try:
                self._run_in(loaded, ws)
            except VerificationError as e:
                # The report is still written, and it must say how the run ended.
                self.report.status, self.report.error, self.report.exit_code = "failed", str(e), e.exit_code
                self._commit(ws, {}, report_only=True)
                raise
        return self.report

    def spill(self, ws: Workspace) -> weights.SpillFile | None:
        """The file in the private directory that holds weights this compile makes (one per run); None when
        the model's weights are in memory anyway (no external data)."""
        if not self.streaming:
            return None
        if self._spill is None:
            self._spill = weights.SpillFile(ws.path("made-weights.bin"))
        return self._spill

    def _run_in(self, loaded: LoadedModel, ws: Workspace) -> None:
        original = loaded.proto
        cases = self.reference_cases(original)
        simplified = self.simplify(loaded, ws)
        if self.opt.verify or simplified is not original:
            expected, model = self.validate(original, simplified, cases, loaded.as_given, loaded)
        else:
            expected, model = None, simplified
        fused = self.fuse(model, cases, expected, ws)
        if self.opt.precision != "fp32":
            fused = self.apply_precision(fused, ws)
        cpu_form = opmap.fused.inline_fused(fused)
        net, task = self.lower(self.target.network_graph(fused, cpu_form), ws)
        checkpoint = bool(self.opt.emit_source or self.opt.bundle)
        if not self.opt.verify:
            files, _ = self.emit(task, ws, checkpoint)
            mindir = self._mindir(files)
            self.report.census = census.primitive_census(mindir)
        else:
            twin = cpu_form
            if precision.CPU_EMULATED.get(self.opt.precision):
                twin = precision.emulate_in_fp32(cpu_form, self.opt.precision, spill=self.spill(ws))
            twin_net, twin_task = None, None
            if self.target.needs_twin(twin, fused):
                # Fused primitives have no CPU kernels (nor has MindSpore CPU bf16 ones): numbers are checked
                # on the cpu twin of the same fused graph, built from its generated source and run (no MindIR
                # of it is written), and the ascend MindIR only structurally (census).
                twin_net, twin_task = self.lower(twin, ws, "cpu_twin")
            # One MindSpore child exports and runs the cases (graphconv/worker.export_and_verify).
            run = self._case_run(twin, cases, ws)
            block_plan = self._block_plan(twin_net or net, twin_task or task, run, model, ws)
            variant, variant_got = self.ascend_precision_variant(fused), None
            if expected is None:  # the oracle runs layer by layer, keeping the values at the block boundaries
                with _Overlap(self._oracle_beside_emit(task), self.emit, task, ws, checkpoint, run=run,
                              twin=twin_task) as emitting:
                    expected, variant_got = self.oracle_by_layers(cases, set(self.block_names.values()), variant,
                                                                  beside_emit=emitting.overlapping)
                files, done = emitting.result()
            else:
                files, done = self.emit(task, ws, checkpoint, run=run, twin=twin_task)
            mindir = self._mindir(files)
            self.report.census = census.primitive_census(mindir)
            checked = None if twin_task is not None else mindir
            if block_plan is not None:
                self.verify_blocks(block_plan, twin_net or net, model, cases, run, done)
            try:
                self.verify(checked, twin, cases, expected, net.output_names, ws, run=run, done=done)
            except InternalError as e:
                if checked is None or "lazy_inline" not in str(e):
                    raise
                # MindSpore 2.10's CPU refuses some lazy_inline layer graphs (one holding control flow):
                # the MindIR is exported again with its layers inlined, and verified.
                self.report.warnings.append("the layer classes are exported without lazy_inline (MindSpore's "
                                            f"CPU refused them: {str(e).split(': ', 1)[-1][:160]})")
                shutil.rmtree(ws.path("out"))
                files, done = self.emit({**task, "direct": True}, ws, checkpoint, run=run)
                checked = mindir = self._mindir(files)
                self.report.census = census.primitive_census(mindir)
                self.verify(checked, twin, cases, expected, net.output_names, ws, run=run, done=done)
            if variant is not None:
                self.check_ascend_precision(variant, cases, expected, variant_got)
            if self.opt.precision != "fp32" and block_plan is not None:
                self.report.warnings.append("no per-layer precision profile: it runs the whole network, and this "
                                            "one is verified layer by layer")
            elif self.opt.precision != "fp32":
                self.profile_precision(model, fused, twin, cases[0], ws)
            self.report.validation["checked"] = ("cpu twin of " if checked is None else "") + self.output.name
            self.report.status = "verified"
        if not self.opt.verify:
            self.report.validation["status"] = "unverified"
            self.report.status = "unverified"
        bundle_moves = self.write_bundle(model, mindir, files, cases, expected, ws) if self.opt.bundle else {}
        moves = {**self._artifacts(files, ws), **bundle_moves}
        if self.opt.save_fused:
            target = Path(self.opt.save_fused)
            staged = ws.path("fused")
            staged.mkdir()
            # Named as the final file already: a `.data` file beside it is referenced by that name.
            for written in weights.save_self_contained(fused, staged / target.name):
                moves[written] = target.with_name(written.name)
            self.report.artifacts["fused_onnx"] = str(self.opt.save_fused)
        self._commit(ws, moves)

    def write_bundle(self, model: onnx.ModelProto, mindir: Path, files: list[Path], cases, expected,
                     ws: Workspace) -> dict[Path, Path]:
        """The Ascend deploy bundle, built in the workspace and moved into place with the other artifacts."""
        from graphconv import deploy

        self.progress.info("bundle")
        with self.report.stage("bundle"):
            directory = ws.path("bundle")
            directory.mkdir()
            variables = next((f for f in files if f.is_dir() and f.name.endswith("_variables")), None)
            ctx = deploy.BundleContext(
                name=self.output.stem, mindir=mindir, variables=variables, onnx_model=model,
                source=ws.path("network.py"), checkpoint=ws.path("network.ckpt"),
                inputs=self.report.model["inputs"], outputs=self.report.model["outputs"],
                cases=cases, expected=expected, precision=self.report.provenance["precision"],
                target=self.opt.target, soc=self.opt.soc, cann=self.opt.cann, shape_ranges=self.opt.shape_ranges,
                census=self.report.census, tools=self.report.provenance["tools"])
            written = deploy.write_bundle(directory, ctx)
        self.report.artifacts["bundle"] = str(self.opt.bundle)
        self.report.warnings.extend(ctx.warnings)
        self.report.validation.setdefault("bundle_files", written)
        return {directory: Path(self.opt.bundle)}

    @staticmethod
    def _mindir(files: list[Path]) -> Path:
        mindir = next((f for f in files if f.suffix == ".mindir"), None)
        if mindir is None:
            raise InternalError("mindspore.export wrote no .mindir file")
        return mindir

    def _artifacts(self, files: list[Path], ws: Workspace) -> dict[Path, Path]:
        """temporary path -> final path for every artifact of this run."""
        moves: dict[Path, Path] = {}
        stem = self.output.stem
        for f in files:
            if f.suffix == ".mindir":
                moves[f] = self.output
                self.report.artifacts["mindir"] = str(self.output)
            elif f.is_dir() and f.name == f"{stem}_variables":
                dst = self.output.with_name(f.name)
                moves[f] = dst
                self.report.artifacts["variables"] = str(dst)
        if self.opt.emit_source:
            src_dir = ws.path("source")
            src_dir.mkdir()
            shutil.copy(ws.path("network.py"), src_dir / "network.py")
            shutil.copy(ws.path("network.ckpt"), src_dir / "network.ckpt")
            shutil.copy(ws.path("network.names.json"), src_dir / "network.names.json")
            moves[src_dir] = Path(self.opt.emit_source)
            self.report.artifacts["source"] = str(Path(self.opt.emit_source) / "network.py")
            self.report.artifacts["checkpoint"] = str(Path(self.opt.emit_source) / "network.ckpt")
            self.report.artifacts["parameter_names"] = str(Path(self.opt.emit_source) / "network.names.json")
        return moves

    def _commit(self, ws: Workspace, moves: dict[Path, Path], report_only: bool = False) -> None:
        self.report.peak_rss_bytes = _peak_rss()
        if self.opt.report_path:
            self.report.artifacts["report"] = str(self.opt.report_path)
            if report_only:
                self.report.artifacts = {"report": str(self.opt.report_path)}
            tmp = ws.path("report.json")
            tmp.write_text(self.report.to_json())
            moves = {**moves, tmp: Path(self.opt.report_path)}
        if moves:
            ws.commit(moves)


def _fits_page_cache(nbytes: int) -> bool:
    """Whether weights of this size stay in the page cache between two reads of them (OVERLAP_MEMORY_SHARE)."""
    return nbytes <= OVERLAP_MEMORY_SHARE * psutil.virtual_memory().available


def _external_bytes(task: dict) -> int:
    """The bytes of the weights an emit task's child reads from their files."""
    return sum(ref[2] for ref in task.get("external_weights", {}).values())


def _cpu_run_error(what: str, error: str, model: onnx.ModelProto) -> GraphconvError:
    """A network MindSpore's CPU would not run: graphconv's fault (internal), except where the model itself
    computes in bfloat16, for which most of MindSpore's CPU kernels have no implementation."""
    g = model.graph
    types = [v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]] + \
            [t.data_type for t in g.initializer]
    if "Unsupported data type" in error and onnx.TensorProto.BFLOAT16 in types:
        return UnsupportedError(f"{what} does not run on CPU: the model computes in bfloat16, which MindSpore's CPU "
                                f"kernels mostly lack ({error.strip().splitlines()[0][:200]})")
    return InternalError(f"{what} does not run on CPU: {error}")


_NORM_OPS = {"mindspore::RmsNorm", "mindspore::LayerNorm", "LayerNormalization", "RMSNormalization"}
_MATMUL_OPS = {"MatMul", "Gemm", "Conv"}


def _checkpoints(fused: onnx.ModelProto, model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(value, op) pairs where the precision profile measures error: the outputs of normalization nodes of
    the fused graph (else of matmuls) that the compiled model also holds, in graph order, then the outputs."""
    known = {o for n in model.graph.node for o in n.output}
    picked = []
    for ops in (_NORM_OPS, _MATMUL_OPS):
        for n in fused.graph.node:
            key = precision.op_key(n)
            if key in ops and n.output and n.output[0] in known:
                picked.append((n.output[0], key))
        if picked:
            break
    return picked + [(o.name, "output") for o in model.graph.output]


def compile(model_path: str | Path, output: str | Path | None = None, *, progress: Progress | None = None,
            **options) -> Report:
    """Compile an ONNX model into a verified MindIR. Keyword options are CompileOptions fields.

    Raises GraphconvError subclasses (exit_code attribute) with `.report` set to the partial report.
    """
    opts = CompileOptions(output=Path(output) if output else None, **options)
    compiler = Compiler(Path(model_path), opts, progress or SILENT)
    try:
        return compiler.run()
    except GraphconvError as e:
        compiler.report.status = "failed" if isinstance(e, VerificationError) else "error"
        compiler.report.error = str(e)
        compiler.report.exit_code = e.exit_code
        e.report = compiler.report
        raise


def analyze_fusions(model_path: str | Path, *, simplify: bool = True, passes: str | None = None,
                    disable_passes: tuple[str, ...] = (), plugins: tuple[str, ...] = ()) -> Report:
    """A compile's fusion analysis without lowering, emitting or verifying (`graphconv inspect --fusions`):
    load, simplify, the pass pipeline; the report's `fusions` and `coverage` are what a compile would
    report. Works in a private temporary directory under the system's temp dir, writes nothing else."""
    import tempfile

    opts = CompileOptions(simplify=simplify, verify=False, passes=passes, disable_passes=tuple(disable_passes),
                          plugins=tuple(plugins))
    compiler = Compiler(Path(model_path), opts, SILENT)
    loaded = compiler.load()
    with Workspace(Path(tempfile.gettempdir()) / "graphconv-inspect.mindir") as ws:
        compiler.fuse(compiler.simplify(loaded, ws), None, None, ws)
    compiler.report.status = "analyzed"
    return compiler.report
