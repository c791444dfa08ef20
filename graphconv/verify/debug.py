"""graphconv debug: find the first node where the MindSpore network diverges from onnxruntime.

Both sides run with every intermediate tensor exposed: onnxruntime on the original graph (every node output
made a graph output), the generated MindSpore network (lowered from the fused graph, with every value that
also exists in the original graph returned). Tensors are aligned by ONNX value name (a fused node is compared
at its outputs, which keep the original names), compared with the shared rule in the original graph's
topological order; `first_divergent` is the first node whose output fails the rule or turns non-finite where
the reference is finite (graphconv.verify.compare).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

import opmap.fused
import passes.precision
import passes
from graphconv.runtime import runner
from graphconv.verify import compare, reference
from graphconv.errors import InputError, InternalError
from graphconv.frontend.load import load

def likely_causes(op: str) -> str:
    """What usually makes a node of this kind disagree: a fused op's record says it (opmap.fused), else the
    table below."""
    from opmap.fused import FUSED_OPS

    fused = FUSED_OPS.get(op)
    return fused.likely_causes if fused is not None and fused.likely_causes else LIKELY_CAUSES.get(op, "")


# What usually makes a node of this kind disagree.
LIKELY_CAUSES = {
    "LayerNormalization": "epsilon, the normalised axes, stash_type",
    "Softmax": "the axis; a mask with the wrong polarity or a non-finite fill value",
    "Where": "mask polarity",
    "Cast": "the target dtype; overflow when narrowing",
    "Exp": "overflow in low precision",
    "Pow": "overflow in low precision, the exponent",
    "MatMul": "accumulation precision, transposed operands",
    "Mul": "overflow in low precision (fp16 ends at 65504), a scale applied twice",
    "Add": "overflow in low precision, a broadcast over the wrong axis",
    "Reshape": "a 0 or -1 in the target shape, a baked-in size",
    "Gather": "negative indices, the axis",
    "Slice": "negative or open-ended starts/ends, the step",
}


@dataclasses.dataclass
class Row:
    node: str
    op: str
    output: str
    status: str  # ok | suspicious | fail | fused (inside a fused op, not a value of the network)
    max_abs: float | None = None
    mean_abs: float | None = None
    cosine: float | None = None
    reason: str = ""
    likely_causes: str = ""


@dataclasses.dataclass
class DebugReport:
    rows: list[Row]
    first_divergent: str | None
    inputs: dict[str, list[int]]
    oracle: str
    network: dict = dataclasses.field(default_factory=dict)  # precision, ops kept in fp32, emulation

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        lines = [f"{'node':<32} {'op':<22} {'max_abs':>10} {'mean_abs':>10} {'cosine':>9}  status"]
        for r in self.rows:
            nums = (f"{r.max_abs:>10.3g} {r.mean_abs:>10.3g} {r.cosine:>9.6f}" if r.max_abs is not None
                    else f"{'-':>10} {'-':>10} {'-':>9}")
            lines.append(f"{r.node[:32]:<32} {r.op[:22]:<22} {nums}  {r.status}"
                         + (f"  ({r.likely_causes})" if r.likely_causes else ""))
        if self.network.get("precision", "fp32") != "fp32":
            lines.append(f"precision {self.network['precision']}"
                         + (f" ({self.network['emulated']})" if self.network.get("emulated") else ""))
        lines.append(f"first divergent node: {self.first_divergent or 'none'}")
        return "\n".join(lines)


def _expose_all(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of `model` whose graph outputs are its own outputs plus every value in `names` with a type."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    typed = {vi.name: vi for vi in list(out.graph.value_info) + list(out.graph.output)}
    present = {o.name for o in out.graph.output}
    for name in names:
        if name in typed and name not in present and typed[name].type.tensor_type.elem_type:
            out.graph.output.append(typed[name])
            present.add(name)
    return out


def network_for(original: onnx.ModelProto, pass_spec: str | None, target: str, precision: str = "fp32",
                keep_fp32: str | None = None) -> tuple[onnx.ModelProto, dict]:
    """The graph graphconv lowers for `original`: passes, fused bodies attached, precision applied, and for
    the cpu target (or any network that runs on CPU) the fused ops inlined; plus what was done to it."""
    ir_model = ir.from_proto(original)
    passes.PassManager(pass_spec).run(ir_model)
    fused = onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(ir.to_proto(ir_model)), data_prop=True)
    info: dict = {"precision": precision}
    if precision != "fp32":
        keep = passes.precision.parse_keep(keep_fp32)
        try:
            passes.precision.check_keep(keep)
            fused, summary = passes.precision.apply_precision(fused, precision, keep)
        except passes.precision.PrecisionError as e:
            raise InputError(str(e)) from e
        info.update(summary.as_dict())
    network = opmap.fused.inline_fused(fused) if target == "cpu" else fused
    if precision != "fp32" and target == "cpu" and passes.precision.CPU_EMULATED[precision]:
        network = passes.precision.emulate_in_fp32(network, precision)
        info["emulated"] = passes.precision.emulation_note(precision)
    return onnx.shape_inference.infer_shapes(network, data_prop=True), info


def trace(original: onnx.ModelProto, network: onnx.ModelProto, case: reference.ReferenceCase, names: list[str],
          workdir: Path | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]:
    """Run onnxruntime on `original` and MindSpore on `network`, both with the values `names` exposed:
    (reference values, MindSpore values, oracle name). Values the network does not hold are absent."""
    oracle = reference.Oracle(_expose_all(original, names))
    expected = oracle.run([case])[0]
    exposed = _expose_all(network, names)
    result = runner.run_models([(exposed, [case.inputs])], workdir)[0]
    if result.outputs is None:
        raise InternalError(f"the MindSpore network did not run: {result.error}")
    got = dict(zip([o.name for o in exposed.graph.output], result.outputs[0]))
    return expected, got, oracle.name


def compare_value(act: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> tuple[str, compare.Comparison]:
    """(status, comparison) of one exposed value by the one rule; an inf or NaN where the reference is finite
    (an overflow) fails it as a mismatch of kind, never as merely suspicious."""
    c = compare.compare(act, ref, atol, rtol)
    return ("ok" if c.ok else "suspicious" if c.suspicious else "fail"), c


def debug(model_path: str | Path, inputs: Path | None = None, target: str = "cpu", pass_spec: str | None = None,
          atol: float | None = None, rtol: float | None = None, save: Path | None = None,
          mask_inputs: tuple[str, ...] = (), precision: str = "fp32", keep_fp32: str | None = None) -> DebugReport:
    """Compare every intermediate tensor of the MindSpore network with onnxruntime on one input case."""
    loaded = load(model_path)
    original = onnx.shape_inference.infer_shapes(loaded.proto, data_prop=True)
    case = (reference.load_npz_cases([Path(inputs)], original, mask_inputs) if inputs
            else reference.make_cases(original, mask_inputs))[0]
    order = [(n.name, n.op_type, [o for o in n.output if o]) for n in original.graph.node]
    all_values = [o for _, _, outs in order for o in outs]
    network, info = network_for(original, pass_spec, target, precision, keep_fp32)
    expected, got, oracle_name = trace(original, network, case, all_values)

    default_atol, default_rtol = compare.default_tolerance(passes.precision.TOLERANCE_KEY[precision])
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    rows, first = [], None
    for node, op, outs in order:
        for name in outs:
            if name not in expected:
                continue
            ref = expected[name]
            if name not in got:
                rows.append(Row(node, op, name, "fused",
                                reason="inside a fused op: compared at the fused op's outputs"))
                continue
            act = got[name]
            status, c = compare_value(act, ref, atol, rtol)
            row = Row(node, op, name, status, c.max_abs, c.mean_abs, c.cosine, c.reason)
            if status != "ok":
                row.likely_causes = likely_causes(op)
                if first is None:
                    first = node
            rows.append(row)
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
                np.save(save / f"{safe}.onnxruntime.npy", ref)
                np.save(save / f"{safe}.mindspore.npy", act)
    return DebugReport(rows, first, {k: list(v.shape) for k, v in case.inputs.items()}, oracle_name, info)
