"""The compile report: one object every stage writes into, serialised as the JSON of the shared contract.

Fields (docs/design.md, contracts): graphconv_version, provenance, model, stages, fusions, census, validation,
artifacts, warnings. `summary()` renders the same content for a human.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, TypedDict

from graphconv.onnx_domains import domain_name, op_key
from graphconv.version import __version__


class Validation(TypedDict, total=False):
    """The report's `validation`: what verification checked and found (docs/design.md, contracts). Written by
    graphconv/pipeline.py (the oracle, --precision), graphconv/verification.py (the comparison, its mode, the
    exact values, the ascend precision) and graphconv/parallel/tensor_parallel.py (the ranks); read by summary()
    and the tools. A model whose oracle approximates a quantized op adds one more key, named by that
    approximation (precision_checks.approximation_difference: output -> its distance from the float form)."""

    status: str  # verified | unverified | failed | unverifiable
    oracle: str  # the oracle that gave the expected values: onnxruntime (layer by layer) or onnx.reference
    oracle_exact: str  # what the oracle computes exactly in integers (reference.exact_note)
    mode: str  # whole-network | layer-streamed
    atol: float  # the tolerance the outputs were held to
    rtol: float
    cases: list[dict]  # per case and output: max_abs, mean_abs, cosine, ok
    checked: str  # what ran: the MindIR, its cpu twin, or the tensor-parallel ranks
    exact: dict  # the float64 exact values: status (computed | not computed), why, the rule and factors
    layer_streamed: dict  # threshold_bytes and, per block, its boundary values' comparison
    ascend_precision: Any  # the fused primitives' own precision (a section), or why it was not measured
    precision: dict  # --precision's conversion and, with a profile, its error per layer
    tensor_parallel: dict  # tp, unsharded_weight_bytes, ranks and how they ran
    bundle_files: list[str]  # the files the deploy bundle wrote


@dataclasses.dataclass
class Stage:
    name: str
    seconds: float = 0.0
    started: float = 0.0  # Unix time (benchmarks map memory samples to stages by it)
    nodes_before: int | None = None
    nodes_after: int | None = None
    detail: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Report:
    graphconv_version: str = __version__
    provenance: dict = dataclasses.field(default_factory=dict)
    model: dict = dataclasses.field(default_factory=dict)
    stages: list[Stage] = dataclasses.field(default_factory=list)
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)
    # family -> {candidates, fused, refused: {reason: count}, items: [{node, op, pass, reason}]}
    coverage: dict[str, dict] = dataclasses.field(default_factory=dict)
    skipped_fusions: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # pass -> why not fused
    census: dict[str, int] = dataclasses.field(default_factory=dict)
    # how many quantized linears run on a low-bit primitive, which fell back and why (verify/quantized_census)
    quantized_linears: Any = None  # a QuantizedLinears, or None for a model without quantized linears
    # --quantize: the scheme, the tool, the groups and the quantized model's error against the float model
    # (graphconv/quantize.py); None without --quantize
    quantization: dict | None = None
    op_histogram: dict[str, int] = dataclasses.field(default_factory=dict)
    unsupported_ops: list[str] = dataclasses.field(default_factory=list)
    validation: Validation = dataclasses.field(default_factory=dict)
    artifacts: dict[str, str] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    status: str = "running"  # verified | unverified | failed | error
    exit_code: int = 0
    error: str | None = None
    peak_rss_bytes: int | None = None
    # when work ran: the switches of graphconv/runtime/scheduling.py and what they did in this run
    scheduling: dict = dataclasses.field(default_factory=dict)

    def stage(self, name: str) -> "_StageTimer":
        """Context manager that appends a Stage and times it."""
        return _StageTimer(self, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=_json_default)

    def _mindir_lines(self) -> list[str]:
        """The MindIR's most called primitives, and where its quantized linears run."""
        lines = []
        if self.census:
            top = sorted(self.census.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
            lines.append("  MindIR primitives: " + ", ".join(f"{k} {v}" for k, v in top))
        if self.quantized_linears is not None:
            lines.append("  " + self.quantized_linears.summary())
        if self.quantization is not None:
            lines.append("  " + quantization_line(self.quantization))
        return lines

    def summary(self) -> str:
        lines = [f"graphconv {self.graphconv_version}: {self.status}"
                 + (f" (target {self.provenance.get('target')})" if self.provenance.get("target") else "")]
        if self.error:
            lines.append(f"  error: {self.error}")
        ins = ", ".join(f"{i['name']}{i['shape']}:{i['dtype']}" for i in self.model.get("inputs", []))
        if ins:
            lines.append(f"  inputs: {ins}")
        lines.append("  stages:")
        for s in self.stages:
            nodes = ""
            if s.nodes_before is not None and s.nodes_after is not None:
                nodes = f"  nodes {s.nodes_before} -> {s.nodes_after}"
            elif s.nodes_after is not None:
                nodes = f"  nodes {s.nodes_after}"
            lines.append(f"    {s.name:<15} {s.seconds:8.2f}s{nodes}")
        if self.op_histogram:
            top = sorted(self.op_histogram.items(), key=lambda kv: (-kv[1], kv[0]))
            lines.append("  ops: " + ", ".join(f"{k} {v}" for k, v in top))
        if self.fusions:
            lines.append("  fusions: " + ", ".join(f"{k} {v}" for k, v in self.fusions.items()))
        from passes.coverage import family_passes, summary_lines

        for line in summary_lines(self.coverage):
            lines.append(f"  {line}")
        covered = family_passes() if self.coverage else set()  # (their reasons are in the lines above)
        for name, reasons in self.skipped_fusions.items():
            for r in reasons[:5] if name not in covered else []:
                lines.append(f"  {name} skipped {r}")
        pass_notes = next((s.detail.get("notes") for s in self.stages if s.name == "passes" and s.detail), None)
        for name, notes in (pass_notes or {}).items():
            lines.extend(f"  {name}: {n}" for n in notes[:5])
            if len(notes) > 5:
                lines.append(f"  {name}: {len(notes) - 5} more notes in the report's stages")
        grouping = next((s.detail.get("layers") for s in self.stages if s.name == "lower" and s.detail), None)
        if grouping:
            line = f"  layers: {grouping.get('grouped', 0)} of {grouping.get('layers', 0)} in " \
                   f"{grouping.get('classes', 0)} Cell class(es)"
            if grouping.get("reason") or grouping.get("inline"):
                line += f" ({grouping.get('reason') or 'inline: layers ' + ', '.join(map(str, grouping['inline']))})"
            lines.append(line)
        lines += self._mindir_lines()
        if self.validation:
            v = self.validation
            lines.append(f"  validation: {v.get('status')} (oracle {v.get('oracle')}, checked {v.get('checked', '-')})")
            if v.get("oracle_exact"):
                lines.append(f"    {v['oracle_exact']}")
            exact = v.get("exact") or {}
            if exact.get("status") == "computed":
                lines.append(f"    outputs against the exact (float64) values; beside them the distance of "
                             f"the graph rounded at every op (passes within {exact['factor']:g}x its mean abs and "
                             f"{exact.get('max_factor', exact['factor']):g}x its max abs) and onnxruntime's")
            elif exact:
                lines.append(f"    exact values not computed ({exact['why'][:160]}): held to onnxruntime's")
            for case in v.get("cases", []):
                for out in case.get("outputs", []):
                    flag = "ok" if out["ok"] else "FAIL"
                    ort = out.get("exact")
                    beside = (f"  (rounded {ort['rounded_max_abs']:.3g}, x{ort['ratio']:.2f}, mean "
                              f"x{ort.get('mean_ratio', float('nan')):.2f}; onnxruntime "
                              f"{ort['onnxruntime_max_abs']:.3g})") if ort else ""
                    lines.append(f"    {case['name']:<8} {out['name']:<20} max_abs {out['max_abs']:.3g}  "
                                 f"mean_abs {out['mean_abs']:.3g}  cosine {out['cosine']:.6f}  {flag}{beside}")
        tp = self.validation.get("tensor_parallel")
        for row in tp["ranks"] if tp else []:
            err = f"  max_abs {row['max_abs']:.3g}" if "max_abs" in row else ""
            rss = f"  peak RSS {row['peak_rss_bytes'] / 2**20:,.0f} MiB" if row.get("peak_rss_bytes") else ""
            lines.append(f"    rank {row['rank']:<3} weights {row['weight_bytes']:,} bytes ({row['share']:.1%} of "
                         f"{tp['unsharded_weight_bytes']:,}){err}{rss}{'  streamed' if row.get('streamed') else ''}")
        ap = self.validation.get("ascend_precision")
        if ap and "outputs" not in ap:  # (not measured: e.g. an fp16 model's fused ops take fp16 already)
            lines.append(f"  ascend precision: {ap['status']} ({ap.get('why', '')})")
        elif ap:
            worst = max((o["max_abs"] for o in ap["outputs"]), default=0.0)
            lines.append(f"  ascend precision ({ap['precision']} casts): {ap['status']}, max_abs {worst:.3g} "
                         f"(atol {ap['atol']:g}, rtol {ap['rtol']:g})")
        pr = self.validation.get("precision")
        if pr:
            fp32 = ", ".join(f"{k} {v}" for k, v in pr["fp32_nodes"].items()) or "none"
            lines.append(f"  precision {pr['precision']}: {pr['low_nodes']} nodes low, fp32 nodes: {fp32}; "
                         f"{pr['weights_converted']} weights converted, {pr['casts_inserted']} casts")
            if pr.get("cpu_emulation"):
                lines.append(f"    {pr['cpu_emulation']}")
            for row in pr.get("layers", []):
                lines.append(f"    {row['op']:<22} {row['value'][:28]:<28} max_abs {row['max_abs']:.3g}  "
                             f"mean_abs {row['mean_abs']:.3g}  cosine {row['cosine']:.6f}")
        if self.scheduling:
            off = [k for k, on in self.scheduling.get("switches", {}).items() if not on]
            said = [f"oracle {self.scheduling['oracle']}"] if "oracle" in self.scheduling else []
            state = f"off: {', '.join(off)}" if off else "every mechanism on"
            lines.append("  scheduling: " + "; ".join(said + [state]))
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        for k, v in self.artifacts.items():
            lines.append(f"  {k}: {v}")
        if self.peak_rss_bytes:
            lines.append(f"  peak RSS: {self.peak_rss_bytes / 2**20:.0f} MiB")
        return "\n".join(lines)


def model_info(model) -> dict:
    """The report's `model`: inputs and outputs with their symbolic dims, opset imports, node count."""
    from graphconv.verify import reference

    return {
        "inputs": [s.as_dict() for s in reference.input_specs(model)],
        "outputs": reference.output_specs(model),
        "opset_imports": {domain_name(i.domain): i.version for i in model.opset_import},
        "nodes": len(model.graph.node),
    }


def op_histogram(model) -> dict[str, int]:
    """op type (domain::op outside the default domain) -> nodes of the main graph."""
    hist: dict[str, int] = {}
    for n in model.graph.node:
        hist[op_key(n)] = hist.get(op_key(n), 0) + 1
    return dict(sorted(hist.items()))


class _StageTimer:
    def __init__(self, report: Report, name: str):
        self.stage = Stage(name)
        report.stages.append(self.stage)

    def __enter__(self) -> Stage:
        self._t0 = time.perf_counter()
        self.stage.started = round(time.time(), 3)
        return self.stage

    def __exit__(self, *exc) -> None:
        self.stage.seconds = round(time.perf_counter() - self._t0, 4)


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def quantization_line(info: dict) -> str:
    """`quantized w4a16:128 by onnxruntime (15 linears, groups 32 x 13, 64 x 2); vs float: logits max abs ...`"""
    groups = ", ".join(f"{g} x {n}" for g, n in info.get("groups", {}).items())
    line = f"quantized {info['scheme']} by onnxruntime ({info['linears']} linears" + (f"; groups {groups})" if groups
                                                                                    else ")")
    error = info.get("error_vs_float")
    if isinstance(error, dict):
        line += "; vs float: " + ", ".join(f"{k} max abs {v['max_abs']:.3g}, cosine {v['cosine']:.6f}"
                                          for k, v in list(error.items())[:3])
    elif error:
        line += f"; vs float {error}"
    return line
