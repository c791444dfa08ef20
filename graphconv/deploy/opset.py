"""The ONNX at an opset the chosen CANN's ATC accepts: onnx.version_converter down to the highest accepted
opset, kept only when onnx.checker passes and onnxruntime gives the original's outputs on the reference
inputs (graphconv's comparison rule); otherwise the original opset, with a warning.
"""

from __future__ import annotations

import dataclasses

import onnx

from graphconv.verify import compare
from graphconv.deploy.options import TOLERANCE_KEY, cann_opset_range
from graphconv.errors import InternalError, first_line
from graphconv.onnx_domains import find_default_opset


@dataclasses.dataclass
class AtcOnnx:
    path: str  # relative to the bundle
    opset: int
    original_opset: int
    cann_row: str
    accepted: tuple[int, int]
    converted: bool = False
    note: str = ""  # what happened, for the README


def _repair_reduce_attrs(model: onnx.ModelProto, target: int) -> None:
    """onnx.version_converter leaves `noop_with_empty_axes` (new in opset 18) on Reduce* nodes it moves
    below 18; with its default value 0 the attribute means nothing, so drop it there."""
    if target >= 18:
        return
    for node in model.graph.node:
        if node.op_type.startswith("Reduce"):
            for a in list(node.attribute):
                if a.name == "noop_with_empty_axes" and a.i == 0:
                    node.attribute.remove(a)


def clamp_opset(model: onnx.ModelProto, cann: str | None, cases: list, precision: str = "fp32"
                ) -> tuple[onnx.ModelProto | None, AtcOnnx, list[str]]:
    """The model at an opset the CANN version's ATC accepts: unchanged when it already is; otherwise
    onnx.version_converter to the highest accepted opset, checked with onnx.checker and against the
    original with onnxruntime on the reference inputs. Returns (converted model or None, facts, warnings)."""
    row, lo, hi = cann_opset_range(cann)
    opset = find_default_opset(model) or 0
    facts = AtcOnnx("", opset, opset, row, (lo, hi))
    if lo <= opset <= hi:
        facts.note = f"opset {opset} is within {lo}..{hi}: ATC reads the simplified ONNX as it is"
        return None, facts, []
    if opset < lo:
        msg = (f"the model's opset {opset} is below {lo}, the lowest CANN {row} accepts; "
               "onnx.version_converter is not used to raise opsets here")
        facts.note = msg
        return None, facts, [msg]
    target = hi
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, target)
        _repair_reduce_attrs(converted, target)
        onnx.checker.check_model(converted, full_check=True)
        _compare_with_ort(model, converted, cases, precision)
    except Exception as e:  # noqa: BLE001 - any failure keeps the original opset, with a warning
        reason = first_line(e, 240)
        msg = (f"the model needs ONNX opset {opset} but CANN {row} ATC accepts {lo}..{hi}; converting to opset "
               f"{target} failed ({type(e).__name__}: {reason}); the ONNX route keeps opset {opset} and may be "
               "refused by ATC")
        facts.note = msg
        return None, facts, [msg]
    facts.opset, facts.converted = target, True
    facts.note = (f"converted from opset {opset} to {target} with onnx.version_converter; onnx.checker passed "
                  f"and onnxruntime gives the same outputs as opset {opset} on the reference inputs")
    return converted, facts, []


def _compare_with_ort(original: onnx.ModelProto, converted: onnx.ModelProto, cases: list, precision: str) -> None:
    import onnxruntime as ort

    if not cases:
        raise InternalError("no reference inputs to compare the converted model on")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    runs = []
    for m in (original, converted):
        sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        runs.append([dict(zip(names, sess.run(names, c.inputs))) for c in cases])
    atol, rtol = compare.default_tolerance(TOLERANCE_KEY.get(precision, "float32"))
    for case, ref, got in zip(cases, *runs):
        for name, r in ref.items():
            c = compare.compare(got[name], r, atol, rtol, case.valid_positions(r))
            if not c.ok:
                raise InternalError(f"output {name!r} at {case.shape_text()} changed: {c.reason}")

