"""The validate stage: the oracle's outputs of the model as given, at sizes the model takes.

The generated reference sizes may be too small for a model that downsamples (a detector's strides, an OCR
model's windows): then the oracle runs again at multiples of a stride, and the report says which sizes ran.
The stage also chooses what is compiled: onnxsim's output where it agrees with the model, else the model.
"""

from __future__ import annotations

import dataclasses

import onnx

from graphconv.errors import InputError, UnsupportedError, first_line
from graphconv.frontend.load import LoadedModel, infer_shapes
from graphconv.stage_context import StageContext
from graphconv.stage_results import Loaded, Validated
from graphconv.verify import compare, observed_ranks as ranks, precision_checks, reference


def _too_small(expected: list[dict], cases, model: onnx.ModelProto) -> tuple[str, str | None] | None:
    """Why the generated sizes are too small for the model (its downsampling past what they hold), or None: an
    output that came out empty from inputs none of which is, or a window larger than its input (then also the
    input dim the window most likely runs along, if one)."""
    if any(v.size == 0 for c in cases for v in c.inputs.values()):
        return None
    empty = next((name for outs in expected for name, v in outs.items() if getattr(v, "size", 1) == 0), None)
    if empty is not None:
        return f"made output {empty!r} empty", None
    window = next((w for c in cases if (w := reference.window_too_large(
        model, c, lambda names: ranks.observed_shapes(model, c, names, reference.Oracle)))), None)
    return None if window is None else (f"are smaller than the window of {window[0]}", window[1])



def validate(ctx: StageContext, loaded: Loaded, simplified: onnx.ModelProto, cases) -> Validated:
    """The oracle's outputs of the model as given (where loading upgraded its opset, the user's: a converter
    fault is then caught too), and the model to compile: the simplified one if it agrees with the
    original, else the original (with a warning). In layer-streamed mode the oracle runs later, layer by
    layer (`oracle_by_layers`), once the lowering has cut the network into blocks."""
    original = loaded.model.proto
    oracle_model = loaded.model.as_given if loaded.model.as_given is not None else original
    if not ctx.options.verify and simplified is original:
        return Validated(simplified, None, oracle_model)
    ctx.progress.info("validate (reference outputs)")
    with ctx.report.stage("validate") as st:
        if loaded.layer_streamed and not ctx.options.verify_each:
            st.detail = {"oracle": "layer by layer, after lowering"}
            if simplified is not original:
                ctx.report.warnings.append(
                    "onnxsim's output is not run on its own at this size (a second pass over the weights): the "
                    "verification of the compiled network checks it; if that fails, try --no-simplify")
            return Validated(simplified, None, oracle_model)
        oracle = reference.Oracle(oracle_model)
        given = cases
        try:
            expected = oracle.run(cases)
        except UnsupportedError as e:
            if ctx.options.inputs or oracle.load_failed:  # (onnxruntime refused the model, not its inputs)
                raise
            why = f"onnxruntime refused the generated inputs ({first_line(e, 160)})"
            expected, cases, tried = _at_a_stride(ctx, loaded.model, oracle, cases, why)
            if expected is None:  # dims the graph relates but neither names nor implies: the likely cause
                raise UnsupportedError(f"{e}; the generated inputs had {'; then '.join(tried)}: if some of these "
                                       "dims are related, give --dim NAME=A,B for each free one or --inputs") \
                    from None
        small = _too_small(expected, cases, original)
        if small and not ctx.options.inputs and not ctx.options.dims:  # sizes too small for the model's strides
            why, along = small
            again, strided, tried = _at_a_stride(ctx, loaded.model, oracle, cases, f"the generated inputs {why}")
            if again is None and "window" in why:  # (MindSpore refuses a window larger than its input)
                hint = f"--dim '{along}=A,B' for the input dim the window runs along (the sizes the model " \
                       "takes), and --dim NAME=A,B for other free dims" if along else \
                       "give the sizes the model takes, --dim NAME=A,B for its free dims"
                raise UnsupportedError(f"the generated inputs {why} at {'; then '.join(tried)}: {hint}, or "
                                       "--inputs")
            expected, cases = (again, strided) if again is not None else (expected, cases)
        ctx.report.validation["oracle"] = oracle.name
        if oracle.exact:
            ctx.report.validation["oracle_exact"] = reference.exact_note(oracle.exact)
        if oracle.fallback_reason:
            ctx.report.warnings.append(oracle.fallback_reason + "; using onnx.reference instead")
        checked = Validated(simplified, expected, oracle_model, oracle.fallback_reason,
                            None if cases is given else cases)
        if loaded.model.as_shipped is not None:
            section, warning = precision_checks.approximation_difference(loaded.model, cases, expected)
            ctx.report.validation.update(section)
            ctx.report.warnings.append(warning)
        if simplified is original and loaded.model.as_given is None:
            return checked
        got = reference.Oracle(simplified).run(cases)
        for case, exp, act in zip(cases, expected, got):
            for name, ref in exp.items():
                c = compare.compare(act[name], ref, *ctx.tolerance(), case.valid_positions(ref))
                if not c.ok:
                    ctx.report.warnings.append(f"onnxsim changed output {name!r} at {case.shape_text()} "
                                                f"({c.reason}); compiling the unsimplified model")
                    return dataclasses.replace(checked, model=original)
    return checked

def observed_ranks(ctx: StageContext, loaded: Loaded, checked: Validated, cases) -> Validated:
    """The ranks onnx's shape inference could not give, from onnxruntime's run on the reference cases
    (graphconv/verify/observed_ranks.py); not at sizes run layer by layer, nor without a run."""
    if checked.expected is None or loaded.layer_streamed or loaded.model.external_bytes:
        return checked
    model, given = ranks.complete(checked.model, cases, reference.Oracle)
    if not given:
        return checked
    shown = ", ".join(repr(n) for n in given[:3]) + (f" and {len(given) - 3} more" if len(given) > 3 else "")
    ctx.report.warnings.append(f"onnx's shape inference left the rank of {len(given)} values unknown ({shown}): "
                                "they have the ranks onnxruntime's run gave")
    return dataclasses.replace(checked, model=infer_shapes(model, loaded.model.path))

def _at_a_stride(ctx: StageContext, model: LoadedModel, oracle, cases, why: str) -> tuple[list | None, list, list[str]]:
    """The generated inputs did not serve (`why`): the oracle's outputs and the cases again, with every free
    dim but the batch at multiples of 32, then of 64, then of 256 (reference.STRIDES: the strides detectors and
    OCR models take, and frames longer than an audio model's window), and a warning saying which sizes ran;
    (None, cases, the sizes tried) where none ran with outputs that are not empty."""
    tried = [reference.dims_text(model.proto, cases[0])]
    for stride in reference.STRIDES:
        sizes = reference.stride_overrides(model.proto, stride, ctx.options.dims)
        if not sizes:
            break
        strided = None
        try:
            strided = reference.make_cases(model.proto, ctx.options.mask_inputs, {**sizes, **(ctx.options.dims or {})},
                                           pad_masks=model.pad_masks, preferred_dims=model.case_dims)
            expected = oracle.run(strided, fallback=False)
        except (UnsupportedError, InputError):
            expected = None
        if expected is None or _too_small(expected, strided, model.proto):
            tried.append(reference.dims_text(model.proto, strided[0]) if strided else f"multiples of {stride}")
            continue
        ran = " and ".join(reference.dims_text(model.proto, c) for c in strided)
        ctx.report.warnings.append(f"{why} at {tried[0]}: they ran at multiples of {stride}: {ran}")
        return expected, strided, tried
    return None, cases, tried
