"""The compile's back half (graphconv/pipeline.py runs the front): emit the MindIR, with the verification run in
the same MindSpore child, and prove the numbers right against the oracle (onnxruntime): the network's outputs,
block by block in layer-streamed mode (the oracle then runs layer by layer, cut where the network's blocks
are), the fused primitives' own precision on Ascend, and a low-precision network's error layer by layer.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx
import psutil

from graphconv.errors import GraphconvError, InternalError, UnsupportedError, VerificationError, first_line
from graphconv.frontend.load import zero_sized_inputs
from graphconv.options import THRESHOLD_BYTES
from graphconv.runtime import child, scheduling
from graphconv.stage_context import StageContext, case_run, lower
from graphconv.stage_results import Emitted, Loaded, Lowered, OracleValues, Validated
from graphconv.compiler import export_task
from graphconv.verify import census, compare, exact, outputs, piecewise, precision_checks, reference
from graphconv.workspace import Workspace
from passes import precision

MAX_LISTED_FAILURES = 3  # the error line names the first failures; report.json has them all
EXACT_MEMORY_SHARE = 0.5  # the exact values' float64 weights of one piece may take this share of free memory

# Ops that quantize activations at run time, each a rounding of values the graph computes in float.
RUN_TIME_QUANTIZERS = ("DynamicQuantizeLinear",)


def _rounding_note(histogram: dict[str, int]) -> str:
    """Why a model that quantizes its activations at run time fails a float tolerance: a last-bit difference
    before one of its roundings (a Sigmoid computed another way) moves a value by a whole quantization step
    (ddddocr's common_old.onnx: docs/performance.md)."""
    found = {op: histogram[op] for op in RUN_TIME_QUANTIZERS if histogram.get(op)}
    if not found:
        return ""
    ops = ", ".join(f"{n} {op}" for op, n in found.items())
    return (f"; the model quantizes activations at run time ({ops}): a last-bit difference before a rounding moves "
            "a value by a whole quantization step, which a float tolerance does not allow, even between two ONNX "
            "runtimes (`graphconv debug MODEL` names the first rounding that parts); --atol/--rtol set the "
            "tolerance for such a model")


def _boundaries(partition) -> list[tuple[str, list[str]]]:
    """(block name, ONNX names of the values it passes on) per block of a compiled network's partition."""
    if partition is None:
        return []
    return [(b.name, names) for b, names in zip(partition.blocks, partition.onnx_boundaries())]


class Verification:
    """The emit and verify stages of one compile. They read the options and write the report through the
    compile's StageContext; nothing is left on this object between stages."""

    def __init__(self, ctx: StageContext):
        self.ctx = ctx

    def emit(self, network: Lowered, ws: Workspace, run: dict | None = None, twin: Lowered | None = None) -> Emitted:
        """mindspore.export in a child; with `run` (the verification cases) the same child then runs them, on
        the MindIR (cpu target), on the cpu twin `twin` built from the exported network's Parameters, or block
        by block (run["blocks"]): graphconv/runtime/export_tasks.export_and_verify."""
        self.ctx.progress.info("emit (mindspore.export)" + (" and the verification run, in one process" if run else ""))
        with self.ctx.report.stage("emit") as st:
            out_dir = ws.path("out")
            out_dir.mkdir()
            keeps_checkpoint = self.ctx.options.emit_source or self.ctx.options.bundle
            checkpoint = str(ws.path("network.ckpt")) if keeps_checkpoint else None
            task = {**network.task, "file_base": str(out_dir / self.ctx.output.stem), "checkpoint": checkpoint}
            external = sum(ref[2] for ref in task.get("external_weights", {}).values())
            tracker = self.ctx.progress.track("weights into MindSpore", external) if external else None
            st.detail = {"weights_read_from_files_bytes": external}
            try:
                if run is None:
                    result = child.run_task("export", task, ws.dir, "mindspore.export", tracker)
                else:
                    result = child.run_task("export_and_verify", {"export": task, "run": run,
                                                                  "twin": twin.task if twin else None},
                                            ws.dir, "mindspore.export", tracker)
            except child.ChildError as e:
                raise InternalError(f"mindspore.export rejected the generated network: {e.error}") from e
            timings = ("build_seconds", "export_seconds", "streamed", "graph_seconds", "weights_seconds",
                       "weights_put_by_verification_bytes")
            st.detail.update({k: result[k] for k in timings if k in result})
        done = None if run is None else result.get("verify") or {"error": result.get("verify_error", "no result")}
        return Emitted([Path(p) for p in result["files"]], done)

    def oracle_by_layers(self, checked: Validated, partition, cases, variant,
                         exact_of: tuple | None = None) -> OracleValues:
        """onnxruntime runs the model piece by piece, cut where the compiled network's blocks are
        (graphconv/verify/piecewise.py), keeping the values the blocks pass on; with `variant` (the
        ascend-precision variant) its pieces run beside the model's of the same block (one read of the
        weights from disk). Where the network has no blocks, or the model cannot be cut there, it runs whole.
        `exact_of`: (graph, partition) whose exact values judge the network (exact_values), the graph cut where
        that partition's blocks are, if not the oracle's model."""
        boundaries = _boundaries(partition)
        keep = {n for _, names in boundaries for n in names}
        # (onnxruntime runs what it is given: integer products made exact first, reference.exact_integer_products)
        model, rewritten = reference.exact_integer_products(checked.oracle_model)
        if rewritten:
            self.ctx.report.validation["oracle_exact"] = reference.exact_note(rewritten)
        variant = dataclasses.replace(variant, model=reference.exact_integer_products(variant.model)[0]) \
            if variant else None
        pieces = piecewise.cut(model, boundaries) if boundaries else None
        if pieces is None:
            if partition is not None:
                self.ctx.report.warnings.append("the oracle runs the model whole: it holds none of the values the "
                                            "compiled network's blocks pass on")
            self.ctx.progress.info("oracle (onnxruntime, the whole model)")
            with self.ctx.report.stage("oracle"):
                expected = outputs.oracle_values(model, sorted(keep), cases)
                self.ctx.report.validation["oracle"] = "onnxruntime"
                got = reference.Oracle(variant.model).run(cases) if variant else None
            exact_values = self._exact_by_layers(model, boundaries, exact_of, cases, keep)
            return OracleValues(expected, expected, got, exact_values)
        runs = [(model, pieces, keep)]
        variant_pieces = piecewise.cut(variant.model, boundaries) if variant else None
        if variant_pieces:
            runs.append((variant.model, variant_pieces, set()))
        self.ctx.progress.info(f"oracle (onnxruntime, layer by layer: {len(pieces)} pieces"
                           + (", with the ascend-precision variant's)" if variant_pieces else ")"))
        with self.ctx.report.stage("oracle") as st:
            results = piecewise.run_together(runs, cases, progress=self.ctx.progress)
            expected, kept, rows = results[0]
            self.ctx.report.validation["oracle"] = "onnxruntime (layer by layer)"
            st.detail = {"pieces": len(rows), "largest_piece_weight_bytes": max(r["weight_bytes"] for r in rows),
                         "kept_values": len(kept[0])}
            if variant_pieces:
                st.detail["ascend_precision_variant_pieces"] = len(results[1][2])
                st.detail["variant_weights_made_from_parts"] = sum(r["weights_made_from_parts"] for r in results[1][2])
        got = results[1][0] if variant_pieces else reference.Oracle(variant.model).run(cases) if variant else None
        return OracleValues(expected, kept, got, self._exact_by_layers(model, boundaries, exact_of, cases, keep))

    def _exact_by_layers(self, model, boundaries, exact_of, cases, keep) -> exact.Values | None:
        """exact_values of `model`, or of exact_of's graph, cut by the blocks where it can be (its weights are
        float64 there, four times an fp16 model's)."""
        if exact_of is not None:
            model, partition = exact_of
            boundaries = _boundaries(partition) if partition is not None else boundaries
        return self.exact_values(model, cases, piecewise.cut(model, boundaries) if boundaries else None, keep)

    def exact_values(self, model: onnx.ModelProto, cases, pieces=None, keep=frozenset()) -> exact.Values | None:
        """A low-precision compile's exact values and those of its graph rounded at every op
        (graphconv/verify/exact.py), per case, of its outputs and of the values named in `keep` (those the
        blocks pass on), run by `pieces` (None: whole). `model`: the model as given where its outputs are fp16
        or bf16; with --precision fp16|bf16, the precision pass's graph (the model on its low-precision weights).
        None for any other compile (its oracle's values are the reference), or where they cannot be computed
        (the report says why, and the network is held to onnxruntime's values)."""
        if self.ctx.options.precision == "fp32" and not exact.computes_in_low_precision(model):
            return None
        need, available = exact.float64_bytes(model, pieces), psutil.virtual_memory().available
        if need > EXACT_MEMORY_SHARE * available:
            self.ctx.report.validation["exact"] = {
                "status": "not computed", "why": f"its float64 weights would take {need / 2**30:.1f} GiB at once, "
                f"more than {EXACT_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available"}
            return None
        self.ctx.progress.info("exact values (the model in float64" + (", layer by layer)" if pieces else ")"))
        with self.ctx.report.stage("exact-values") as st:
            try:
                pieces = pieces or piecewise.whole(model)  # (both runs read each piece's weights once)
                runs = piecewise.run_together([(model, pieces, set(keep), True, rounded) for rounded in (False, True)],
                                              cases, progress=self.ctx.progress if len(pieces) > 1 else None)
            except UnsupportedError as e:
                self.ctx.report.validation["exact"] = {"status": "not computed", "why": str(e)}
                return None
            st.detail = {"pieces": len(runs[0][2]), "engines": sorted({r["engine"] for r in runs[0][2]})}
        self.ctx.report.validation["exact"] = {
            "status": "computed", "factor": compare.EXACT_FACTOR, "max_factor": compare.EXACT_MAX_FACTOR,
            "rule": "a float output passes within the tolerance of its exact (float64) values, or when its mean "
                    f"abs distance from them is within {compare.EXACT_FACTOR:g}x, and its max abs within "
                    f"{compare.EXACT_MAX_FACTOR:g}x, that of the graph rounded at every op"}
        exact_run, rounded_run = ([{**k, **v} for v, k in zip(values, kept)] for values, kept, _ in runs)
        return exact.Values(exact_run, rounded_run)

    def verify(self, network: Lowered, checked_what: str, cases, expected: list[dict], done: dict,
               exact_values: exact.Values | None = None) -> None:
        """Every case's outputs (the child's run, `done`) against the oracle's, by the comparison rule."""
        self.ctx.progress.info(f"verify (MindSpore CPU vs oracle, {checked_what})")
        with self.ctx.report.stage("verify") as st:
            if "error" in done:
                raise InternalError(f"{checked_what} does not run on CPU: {done['error']}")
            st.detail = {k: done[k] for k in ("build_seconds", "case_seconds", "shared_parameters") if k in done}
            check = outputs.compare_outputs(cases, expected, done["outputs"], network.net.output_names,
                                            lambda ref: self.ctx.tolerance(True, ref), exact_values)
            atol, rtol = self.ctx.tolerance(compiled=True)
            self.ctx.report.validation.update({"status": "failed" if check.failures else "verified", "atol": atol,
                                           "rtol": rtol, "cases": check.cases})
            if check.overflowed:
                # Both sides overflowed, differently: where inf meets -inf (a NaN) depends on the order of the
                # arithmetic, which neither runtime promises. Nothing can be verified on these inputs.
                self.ctx.report.validation["status"] = "unverifiable"
                raise UnsupportedError(f"cannot verify: the model overflows on the reference inputs "
                                       f"({check.failures[0]}, and onnxruntime's and MindSpore's values there are all "
                                       "inf or NaN, or at the end of float32's range, where rounding is beyond any "
                                       "tolerance: which way they go depends on the order of the arithmetic)")
            if check.failures:
                listed = check.failures[:MAX_LISTED_FAILURES]
                more = len(check.failures) - len(listed)
                raise VerificationError("verification failed: " + "; ".join(listed) + (
                    f" (and {more} more outputs or cases: the report's validation has each: --report FILE)"
                    if more else "") + _rounding_note(network.net.op_histogram))

    def verify_blocks(self, plan: dict, cases, kept: list[dict], done: dict, run: dict,
                      exact_values: exact.Values | None = None) -> None:
        """The values every block passed on against onnxruntime's values of the same ONNX values; the first
        failing block is named."""
        self.ctx.progress.info("verify blocks (layer-streamed: boundary values vs oracle)")
        with self.ctx.report.stage("verify-blocks") as st:
            if "blocks" not in done:
                raise InternalError(f"the layer-streamed run did not run on CPU: {done.get('error', 'no result')}")
            rows, failure = outputs.compare_blocks(done["blocks"], plan["onnx_names"], cases, kept,
                                                   run["block_values"], lambda ref: self.ctx.tolerance(True, ref),
                                                   exact_values)
            st.detail = {"blocks": len(rows), "compared_values": sum(len(r["values"]) for r in rows[:-1]),
                         "child_peak_rss_after_block": max(b["rss_after"] for b in done["blocks"]),
                         "child_peak_rss": done.get("peak_rss")}
            self.ctx.report.validation["layer_streamed"] = {"threshold_bytes": THRESHOLD_BYTES, "blocks": rows}
            if self.ctx.schedule.block_read_ahead:  # (how many weights of each block a second thread read ahead)
                read_ahead = [b["weights_read_ahead"] for b in done["blocks"]]
                self.ctx.report.scheduling["block_weights_read_ahead"] = read_ahead
            if failure is not None:
                self.ctx.report.validation["status"] = "failed"
                raise VerificationError(f"layer-streamed verification failed at {failure}")

    def run(self, loaded: Loaded, checked: Validated, fused, cpu_form, network: Lowered, cases, spill,
            ws: Workspace) -> tuple[Emitted, list[dict]]:
        """Emit and verify: the numbers of the MindIR (cpu target), or of the cpu twin of the same fused graph
        (ascend: fused primitives have no CPU kernels, nor has MindSpore's CPU bf16 ones; the ascend MindIR is
        then checked structurally, by its census), against the oracle's; block by block in layer-streamed mode."""
        twin_graph = cpu_form
        if precision.CPU_EMULATED.get(self.ctx.options.precision):
            twin_graph = precision.emulate_in_fp32(cpu_form, self.ctx.options.precision, spill=spill)
        needs_twin = self.ctx.target.needs_twin(twin_graph, fused)
        twin = lower(self.ctx, twin_graph, loaded, ws, "cpu_twin") if needs_twin else None
        checked_net = twin or network
        # --precision fp16|bf16: the exact values are the precision pass's graph's, on its low-precision weights
        exact_of = (fused, network.net.partition) if self.ctx.options.precision != "fp32" else None
        run = case_run(twin_graph, cases, ws)
        plan = self._block_plan(loaded, checked_net, ws)
        if plan is not None:
            run.update(blocks=plan, read_ahead=self.ctx.schedule.block_read_ahead,
                       block_values=[str(ws.path(f"case{k}.blocks.npz")) for k in range(len(cases))])
        variant = None
        if self.ctx.target.measures_primitive_precision(self.ctx.options.precision):
            variant, why_not = precision_checks.ascend_variant(fused)
            if why_not:
                self.ctx.report.validation["ascend_precision"] = why_not
        try:
            if checked.expected is not None:
                emitted = self.emit(network, ws, run, twin)
                names = set(plan["onnx_names"].values()) if plan is not None else set()
                kept = None if plan is None else outputs.oracle_values(checked.oracle_model, sorted(names), cases)
                oracle = OracleValues(checked.expected, kept,
                                      exact=self.exact_values(exact_of[0] if exact_of else checked.oracle_model,
                                                              cases, keep=names))
            else:
                weight_bytes = sum(ref[2] for ref in network.task.get("external_weights", {}).values())
                (emitted, oracle), how = scheduling.both(
                    lambda: self.emit(network, ws, run, twin),
                    lambda: self.oracle_by_layers(checked, checked_net.net.partition, cases, variant, exact_of),
                    self.ctx.schedule, weight_bytes, cancel=lambda: child.kill_children(ws.dir),
                    progress=self.ctx.progress)
                self.ctx.report.scheduling.update(how)
        except InternalError as e:
            raise refusal(e, loaded, checked) from None
        self.ctx.report.census = census.primitive_census(emitted.mindir)
        what = "the cpu twin" if twin is not None else "the emitted MindIR"
        try:
            if plan is not None:
                self.verify_blocks(plan, cases, oracle.kept, emitted.run, run, oracle.exact)
            self.verify(checked_net, what, cases, oracle.expected, emitted.run, oracle.exact)
        except InternalError as e:
            if twin is not None or "lazy_inline" not in str(e):
                raise refusal(e, loaded, checked) from None
            # MindSpore 2.10's CPU refuses some lazy_inline layer graphs (one holding control flow): the MindIR
            # is exported again with its layers inlined, and verified.
            self.ctx.report.warnings.append("the layer classes are exported without lazy_inline (MindSpore's CPU "
                                        f"refused them: {str(e).split(': ', 1)[-1][:160]})")
            shutil.rmtree(ws.path("out"))
            network = Lowered(network.net, export_task.without_lazy_inline(network.net, network.task, ws.dir))
            emitted = self.emit(network, ws, run)
            self.ctx.report.census = census.primitive_census(emitted.mindir)
            try:
                self.verify(network, what, cases, oracle.expected, emitted.run, oracle.exact)
            except InternalError as again:
                raise refusal(again, loaded, checked) from None
        if variant is not None:
            self.ctx.progress.info("ascend precision (fp16 casts) vs oracle")
            with self.ctx.report.stage("ascend-precision") as st:
                got = oracle.variant
                if got is None:
                    got = reference.Oracle(variant.model).run(cases)
                else:
                    st.detail = {"run": "with the oracle"}
                section, warning = precision_checks.check_ascend_variant(variant, cases, oracle.expected, got)
                self.ctx.report.validation["ascend_precision"] = section
                self.ctx.report.warnings.extend([warning] if warning else [])
        if self.ctx.options.precision != "fp32" and plan is not None:
            self.ctx.report.warnings.append("no per-layer precision profile: it runs the whole network, and this one "
                                            "is verified layer by layer")
        elif self.ctx.options.precision != "fp32":
            self.ctx.progress.info("precision profile")
            with self.ctx.report.stage("precision-profile"):
                self.ctx.report.validation["precision"]["layers"] = precision_checks.profile(
                    checked.model, fused, twin_graph, cases[0], ws.dir, self.ctx.tolerance(compiled=True))
        self.ctx.report.validation["checked"] = ("cpu twin of " if twin is not None else "") + self.ctx.output.name
        self.ctx.report.status = "verified"
        return emitted, oracle.expected

    def _block_plan(self, loaded: Loaded, checked_net: Lowered, ws: Workspace) -> dict | None:
        """The blocks the checked network runs one at a time (graphconv/compiler/partition.py), or None for the
        whole-network check: in layer-streamed mode, where the lowering cut the network into blocks."""
        self.ctx.report.validation["mode"] = "whole-network"
        if not loaded.layer_streamed:
            return None
        partition = checked_net.net.partition
        if partition is None:
            size = checked_net.net.param_bytes
            why = (checked_net.net.layers or {}).get("reason", "")
            self.ctx.report.warnings.append(f"no layers found ({why}): the network is verified as a whole "
                                            f"({size / 2**30:.2f} GiB of Parameters)")
            return None
        self.ctx.report.validation["mode"] = "layer-streamed"
        return export_task.write_blocks(checked_net.net, ws.dir, Path(checked_net.task["source"]).stem)


def refusal(error: InternalError, loaded: Loaded, checked: Validated) -> GraphconvError:
    """MindSpore refusing the network is graphconv's fault (internal), unless onnxruntime refused the model
    too (onnx.reference was the oracle): two runtimes refusing it point at the model; or a graph input is
    zero-sized, which some MindSpore kernels refuse; or the model computes in bfloat16, for which most of
    MindSpore's CPU kernels have no implementation."""
    text = first_line(error, 300)
    g = loaded.model.proto.graph
    types = [v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]] + \
        [t.data_type for t in g.initializer]
    if "Unsupported data type" in str(error) and onnx.TensorProto.BFLOAT16 in types:
        return UnsupportedError(f"{text}: the model computes in bfloat16, which MindSpore's CPU kernels mostly lack")
    zero_sized = zero_sized_inputs(loaded.model.proto)
    if zero_sized:
        return UnsupportedError(f"{text}; {zero_sized}")
    if checked.ort_refused:
        return UnsupportedError(f"{text}; {checked.ort_refused}")
    return error


