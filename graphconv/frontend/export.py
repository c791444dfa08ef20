"""PyTorch front end: nn.Module + example inputs -> ONNX with dynamic axes, checked against PyTorch.

The dynamo exporter is the default (transformers 5.x models fail the TorchScript one); TorchScript is the
fallback or an explicit choice. After export: onnx.checker, then onnxruntime vs PyTorch at the export shape
and at a second shape with every dynamic dim changed (this catches shapes baked into the graph).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import onnx

from graphconv.verify import compare, reference
from graphconv import interrupts
from graphconv.errors import InputError, UnsupportedError, first_line
from graphconv.onnx_domains import default_opset
from graphconv.workspace import partial_dir, release

EXPORTERS = ("auto", "dynamo", "torchscript")  # auto: dynamo, then TorchScript if dynamo refuses
# Up to the newest opset the loader takes (load.MAX_OPSET): torch 2.13's dynamo exporter is asked for 24-28 by the
# opset matrix; what it cannot write there comes back as PyTorch's error (TorchScript stops at 23).
MIN_EXPORT_OPSET, MAX_EXPORT_OPSET = 14, 28


@dataclasses.dataclass
class ExportResult:
    path: Path
    exporter: str
    opset: int
    checks: list[dict]  # per shape: max_abs, mean_abs, cosine, ok
    warnings: list[str]


def _as_tuple(out):
    if isinstance(out, (tuple, list)):
        return tuple(out)
    if isinstance(out, dict):
        raise UnsupportedError("the model returns a dict: wrap it to return tensors "
                               "(see models/hf.py for a use_cache=False wrapper)")
    return (out,)


def grown_inputs(example_inputs: dict, dynamic_axes: dict):
    """Example inputs with every dynamic dim grown by 1-2 (same growth for the same dim name)."""
    import torch

    growth: dict[str, int] = {}
    out = {}
    for name, t in example_inputs.items():
        axes = dynamic_axes.get(name, {})
        if not axes:
            out[name] = t
            continue
        shape = list(t.shape)
        for ax, dim in axes.items():
            growth.setdefault(dim, 1 + len(growth) % 2)
            shape[ax] += growth[dim]
        if t.dtype.is_floating_point:
            out[name] = torch.randn(shape, dtype=t.dtype, generator=torch.Generator().manual_seed(1))
        elif "mask" in name.lower():
            m = torch.ones(shape, dtype=t.dtype)
            if m.ndim == 2 and shape[1] > 2:
                m[0, :2] = 0
            out[name] = m
        else:
            hi = int(t.max()) + 1 if t.numel() else 2
            out[name] = torch.randint(0, max(hi, 2), shape, dtype=t.dtype, generator=torch.Generator().manual_seed(1))
    return out


@contextlib.contextmanager
def _quiet_stdout():
    """Drop what the exporter prints on stdout: TorchScript's C++ logger writes a "Torch IR graph at exception"
    dump of the whole model to file descriptor 1 when it fails. `--json` output owns stdout, and the failure
    is reported as one line anyway."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            with contextlib.redirect_stdout(null):
                yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_exporter(module, example_inputs: dict, path: Path, dynamic_axes: dict, opset: int, exporter: str,
                  names: list[str], graph_inputs: list[str] | None = None) -> None:
    import torch

    from graphconv.frontend import optimize

    input_names = list(example_inputs)
    with warnings.catch_warnings(), _quiet_stdout():
        warnings.simplefilter("ignore")
        fixed = None
        try:
            if exporter == "dynamo":
                dims: dict[str, object] = {}
                dyn = {name: ({ax: dims.setdefault(dim, torch.export.Dim(dim))
                               for ax, dim in dynamic_axes.get(name, {}).items()} or None) for name in input_names}
                program = torch.onnx.export(module, (), kwargs=example_inputs, dynamo=True, opset_version=opset,
                                            dynamic_shapes=dyn, input_names=graph_inputs or input_names,
                                            output_names=names, optimize=False, verbose=False)
                fixed = fixed_dynamic_axes(program.model, example_inputs, graph_inputs or input_names, dynamic_axes)
                if not fixed:
                    optimize.exporter_optimize(program.model)  # (what optimize=True runs, tiny epsilons kept)
                    program.save(str(path), external_data=False)
            else:
                torch.onnx.export(module, tuple(example_inputs.values()), str(path), dynamo=False,
                                  opset_version=opset, input_names=graph_inputs or input_names, output_names=names,
                                  dynamic_axes={k: dict(v) for k, v in dynamic_axes.items()})
        except Exception as e:  # noqa: BLE001 - the exporter's own failure, reported as such
            raise UnsupportedError(f"PyTorch's {exporter} exporter refused the model at opset {opset}: "
                                   f"{exporter_failure(e)}") from None
    if fixed:
        raise UnsupportedError(fixed)


def fixed_dynamic_axes(model, example_inputs: dict, graph_names: list[str], dynamic_axes: dict) -> str | None:
    """Why the exported ir.Model cannot take other sizes: an axis asked to be dynamic that the exporter fixed at
    the example's size (dynamo does so, without a word, where the model's code treats the size as a constant),
    or None. Otherwise the export would end at the second shape's check in onnxruntime's "invalid dimensions"."""
    by_name = {v.name: v for v in model.graph.inputs}
    for key, name in zip(example_inputs, graph_names):
        value = by_name.get(name)
        if value is None or value.shape is None:
            continue
        for axis, dim_name in dynamic_axes.get(key, {}).items():
            if axis < value.shape.rank() and isinstance(value.shape[axis], int):
                return (f"PyTorch's dynamo exporter fixed {name}'s axis {axis} ({dim_name}) at {value.shape[axis]}, "
                        "the example's size: the model's code treats that size as a constant, so the graph "
                        "would take no other")
    return None


def exporter_failure(e: BaseException) -> str:
    """An exporter's failure in one line: its first line and, where it has one, its innermost cause's.
    torch.onnx's first line says only which step failed ("... Next steps:"); the cause says what (a missing
    ONNX function for an op on a complex tensor, say)."""

    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    head = re.sub(r"\s*Next steps:$", "", first_line(e))[:300]
    return head if inner is e else f"{head} Cause: {first_line(inner)[:300]}"


def export_pytorch(module, example_inputs: dict, path: str | Path, dynamic_axes: dict | None = None, *,
                   opset: int = 17, exporter: str = "auto", output_names: list[str] | None = None,
                   check: bool = True, atol: float = 1e-4, rtol: float = 1e-4,
                   input_names: list[str] | None = None, second_inputs: dict | None = None,
                   masked_axes: dict[str, tuple[int, int]] | None = None) -> ExportResult:
    """Export, check with onnx.checker, compare onnxruntime with PyTorch at two shapes. The file appears at
    `path` only when every check passed.

    `input_names`: the graph's input names, in the order of `example_inputs`, when they differ from the keyword
    names (`past_key_values.0.key` is no Python identifier). `second_inputs`: the inputs of the second check
    (default: every dynamic dim grown), for dims tied to each other (a mask as long as past + new tokens).
    `masked_axes`: output name -> its (batch, sequence) axes, when they are not the leading ones (a KV cache
    [batch, heads, seq, head_dim]): positions the attention mask pads are not compared there either."""
    import torch

    path = Path(path)
    dynamic_axes = dynamic_axes or {}
    if exporter not in EXPORTERS:
        raise InputError(f"unknown exporter {exporter!r} (choose from {', '.join(EXPORTERS)})")
    if not MIN_EXPORT_OPSET <= opset <= MAX_EXPORT_OPSET:
        raise InputError(f"opset {opset} is outside {MIN_EXPORT_OPSET}-{MAX_EXPORT_OPSET}")
    if not path.parent.is_dir():
        raise InputError(f"output directory {path.parent} does not exist")
    for name, axes in dynamic_axes.items():
        if name not in example_inputs:
            raise InputError(f"dynamic_axes names {name!r}, which is not an example input")
        for ax in axes:
            if example_inputs[name].shape[ax] == 1:
                raise InputError(f"example input {name!r} has size 1 on dynamic axis {ax}: the exporter would "
                                 "specialise it; use a size of at least 2")
    module = module.eval()
    notes: list[str] = []
    with torch.no_grad():
        expected = _as_tuple(module(**example_inputs))
    names = output_names or (["output"] if len(expected) == 1 else [f"output_{i}" for i in range(len(expected))])
    staging = partial_dir(path)  # (with an owner record: a killed run's is removed by the next)
    tmp = staging / path.name
    try:
        used = exporter if exporter != "auto" else "dynamo"
        try:
            _run_exporter(module, example_inputs, tmp, dynamic_axes, opset, used, names, input_names)
        except UnsupportedError as e:
            if exporter != "auto":
                raise
            notes.append(f"{e}; fell back to the TorchScript exporter")
            used = "torchscript"
            _run_exporter(module, example_inputs, tmp, dynamic_axes, opset, used, names, input_names)
        _keep_tied(module, tmp, notes)
        second = second_inputs if second_inputs is not None else grown_inputs(example_inputs, dynamic_axes)
        graph_names = dict(zip(example_inputs, input_names or list(example_inputs)))
        result = _check(module, example_inputs, second, graph_names, tmp, used, opset, names, notes, check, atol,
                        rtol, masked_axes or {})
        with interrupts.final_moves():
            release(staging)
            tmp.replace(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result.path = path
    return result


def _keep_tied(module, path: Path, notes: list[str]) -> None:
    """Tied parameters (GPT-2's lm_head is the embedding) come out of both exporters as two initializers, one
    pre-transposed: keep one (passes/tie_weights.py, the same function the compile pipeline runs)."""
    import onnx_ir as ir

    from passes.tie_weights import tie_weights

    by_storage: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_storage.setdefault(id(p), []).append(name)
    tied = [names for names in by_storage.values() if len(names) > 1]
    if not tied:
        return
    model = ir.load(path)
    external = any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    removed = tie_weights(model)
    if removed:
        ir.save(model, path, external_data=f"{path.name}.data" if external else None)
    notes.append(f"tied parameters ({'; '.join(' = '.join(n) for n in tied)}): {removed} duplicate "
                 "initializer(s) the exporter wrote replaced by the one weight")


def check_against_torch(module, result: ExportResult, example_inputs: dict, second_inputs: dict, graph_names: dict,
                        names: list[str], masked_axes: dict, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """Check a written graph (`result.path`) against `module` at two shapes, as export_pytorch does; the checks
    and notes go into `result`."""
    checked = _check(module, example_inputs, second_inputs, graph_names, result.path, result.exporter, result.opset,
                     names, result.warnings, True, atol, rtol, masked_axes)
    result.checks, result.opset = checked.checks, checked.opset


def _check(module, example_inputs, second_inputs, graph_names: dict, path: Path, exporter: str, opset: int, names,
           notes, check: bool, atol: float, rtol: float, masked_axes: dict) -> ExportResult:
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        raise UnsupportedError(f"PyTorch's {exporter} exporter produced an invalid ONNX model at opset {opset}: "
                               f"{first_line(e)}") from None
    produced = default_opset(onnx.load(str(path), load_external_data=False))
    if produced != opset:
        # dynamo exports at 18 and converts down; the conversion can fail (Reduce* axes as inputs).
        notes.append(f"the {exporter} exporter produced opset {produced}, not the requested {opset}")
    checks = []
    if check:
        # The same oracle as compile (onnxruntime, onnx.reference where ORT cannot run the model) and the same
        # rule: positions left-padded by an attention mask are undefined and not compared.
        oracle = reference.Oracle(path)
        for label, inputs in (("export shape", example_inputs), ("second shape", second_inputs)):
            checks += check_case(module, oracle, label, inputs, graph_names, names, masked_axes, atol, rtol)
        if oracle.fallback_reason:
            notes.append(oracle.fallback_reason + "; checked with onnx.reference instead")
    return ExportResult(path, exporter, produced, checks, notes)


def check_case(module, oracle, label: str, inputs: dict, graph_names: dict, names, masked_axes: dict,
               atol: float = 1e-4, rtol: float = 1e-4) -> list[dict]:
    """`oracle` (a reference.Oracle on the written graph) against `module` at one case: a check per output,
    or an InputError naming the first that disagrees (first the top-k ties PyTorch met, where it met some)."""
    model = onnx.load(str(oracle.model), load_external_data=False)
    feed_names = {vi.name for vi in model.graph.input}
    specs = {s.name: s for s in reference.input_specs(model)}
    ref, ties = torch_outputs(module, inputs)
    feed = {graph_names[k]: v.numpy() for k, v in inputs.items() if graph_names[k] in feed_names}
    mask = next((v for k, v in feed.items() if reference.is_mask_input(specs[k]) and v.ndim == 2), None)
    case = reference.ReferenceCase(label, feed, None if mask is None else mask.astype(bool))
    got = oracle.run([case])[0]
    checks = []
    for name, r in zip(names, ref):
        expected = r.detach().numpy()
        c = compare.compare(got[name], expected, atol, rtol, _valid(case, expected, masked_axes.get(name)))
        checks.append({"shape": label, "inputs": {graph_names[k]: list(v.shape) for k, v in inputs.items()},
                       "output": name, "oracle": oracle.name, **c.as_dict()})
        if not c.ok and ties:
            raise InputError(f"{ties[0]}: torch.topk and ONNX TopK (the lower index first) keep different ones "
                             f"of equal values, so the exported model disagrees with PyTorch at the {label}, output "
                             f"{name} (weights that score alike: an untrained router?)")
        if not c.ok:
            raise InputError(f"exported model disagrees with PyTorch at the {label}, output {name}: {c.reason}")
    return checks


def torch_outputs(module, inputs: dict) -> tuple[tuple, list[str]]:
    """`module`'s outputs at `inputs` and the ties its top-k calls met there (topk_ties); a module that
    recorded them up front (hf_export's _Recorded) gives what it recorded."""
    import torch

    recorded = getattr(module, "recorded", None)
    if recorded is not None:
        return recorded(inputs)
    with torch.no_grad(), topk_ties() as ties:
        out = _as_tuple(module(**inputs))
    return out, ties


@contextlib.contextmanager
def topk_ties():
    """A list, filled while inside, of the torch.topk calls that chose among equal finite values (the k-th and
    the (k+1)-th largest equal in some row), one line each naming the caller. Which of equal values a top-k
    keeps is its implementation's choice: ONNX TopK keeps the lower index, torch.topk on CPU may not (AFMoE's
    router, which transformers initialises to zero, scores 4 experts 0.5 each: torch keeps experts 2 and 3,
    onnxruntime 0 and 1), and every output after the router then differs."""
    import torch
    from torch.overrides import TorchFunctionMode

    found: list[str] = []
    torch_dir = os.path.dirname(torch.__file__)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.topk or func is torch.Tensor.topk:
                caller = sys._getframe(1)
                while caller is not None and caller.f_code.co_filename.startswith(torch_dir):
                    caller = caller.f_back
                tie = _topk_tie(args, kwargs or {}, caller)
                if tie and tie not in found:
                    found.append(tie)
            return out

    with Watch():
        yield found


def _topk_tie(args, kwargs, caller) -> str | None:
    """One line for a torch.topk call that chose among equal finite values, else None."""
    import torch

    bound = {**dict(zip(("input", "k", "dim", "largest"), args)), **kwargs}
    x, k, dim = bound.get("input"), int(bound.get("k", 0)), bound.get("dim", -1)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or not 0 < k < x.shape[dim]:
        return None
    ranked = x.detach().sort(dim, descending=bound.get("largest", True)).values
    kth, after = ranked.narrow(dim, k - 1, 1), ranked.narrow(dim, k, 1)
    tied = (kth == after) & torch.isfinite(kth)
    if not tied.any():
        return None
    owner = caller.f_locals.get("self") if caller is not None else None
    where = caller.f_code.co_name if caller is not None else "?"
    where = f"{type(owner).__name__}.{where}" if owner is not None else where
    return (f"torch.topk(k={k}) in {where} finds its k-th and (k+1)-th values equal ({kth[tied][0].item():g}) "
            f"in {int(tied.sum())} of {tied.numel()} rows")


def _valid(case, expected, axes: tuple[int, int] | None):
    """The positions to compare: the mask over the leading dims, or over `axes` (batch, seq) of a cache."""
    if axes is None or case.mask is None:
        return case.valid_positions(expected)
    b, s = axes
    if b >= s or expected.shape[b] != case.mask.shape[0] or expected.shape[s] != case.mask.shape[1]:
        return case.valid_positions(expected)
    shape = [1] * (s + 1)
    shape[b], shape[s] = case.mask.shape
    return case.mask.reshape(shape)


def require_torch(command: str, transformers: bool = False) -> None:
    """One line naming what to install when `command` needs PyTorch (and transformers) and they are missing."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except ImportError:
            return True

    missing = [m for m in ("torch",) + (("transformers",) if transformers else ()) if absent(m)]
    if missing:
        raise InputError(f"{command} needs {' and '.join(missing)}: pip install -e '.[torch]' "
                         "(torch==2.13.0, the CPU build, and transformers==5.24.0)")
    # torch.onnx logs a warning per torchvision op when torchvision is absent (it is not needed): a user's
    # error or progress would come after four lines of them
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def load_factory(spec: str):
    """The factory a spec names: "package.module:function", a zoo name (`llama`) or `hf/<name>`. The test zoo
    graphconv.zoo (the repository's models/) is imported here, when asked, and never on the compile path."""
    require_torch("graphconv export", transformers=spec.startswith("hf/"))
    from graphconv.zoo import load_factory as resolve

    return resolve(spec)


def is_factory_name(spec: str) -> bool:
    """A factory spec rather than a path: "package.module:function", a zoo name or `hf/<name>`."""
    from graphconv.zoo import ZOO  # the zoo's __init__ imports neither torch nor a factory

    return ":" in spec or spec in ZOO or spec.startswith("hf/")


def zoo_export(factory, path: str | Path, **kwargs) -> ExportResult:
    """Export a zoo factory (build() -> (module, example_inputs, dynamic_axes))."""
    module, example_inputs, dynamic_axes = factory()
    return export_pytorch(module, example_inputs, path, dynamic_axes, **kwargs)

