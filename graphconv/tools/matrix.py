"""The opset compatibility matrix: zoo model x exporter x opset -> export, compile for both targets, check.

Two zoos: the plain-torch models of graphconv.zoo.ZOO, and the real transformers architectures of
graphconv.zoo.architectures, addressed as `hf/<name>` (built with default settings: sdpa attention). Each cell
exports the model (graphconv.frontend.export), compiles it for `ascend` (graphconv.compile verifies the numbers on
CPU at two shapes through the cpu twin, which is exactly the `--target cpu` network), and checks that the
ascend MindIR's census of fused primitives EQUALS the model's expected census (written from the
architecture, not from graphconv's output). A cell is `pass`, `fail` (graphconv's fault: the reason says what,
with the fusion coverage's refusals), `unsupported` (the architecture is known to need what graphconv does not
have yet, with its name), or `exporter` (PyTorch's exporter refused or produced an invalid model:
recorded as PyTorch's, not hidden).
`docs/opset-matrix.md` and `docs/opset-matrix.json` are written from the results; the JSON is the baseline
against which regressions (a passing cell that fails, a fusion count that drops) are found.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

from graphconv.errors import GraphconvError, UnsupportedError
from opmap.fused import fused_primitives
from graphconv.progress import SILENT, Progress

EXPORTERS = ("dynamo", "torchscript")
OPSETS = tuple(range(14, 29))  # 14 .. the newest opset the loader takes (28)
SLICE = {"exporters": ("dynamo",), "opsets": (17, 18)}  # what CI runs; --full runs everything
# torch 2.13's TorchScript exporter writes opsets up to 23 (beyond 20 with a warning) and refuses 24+
# ("Unsupported onnx_opset_version: 24", measured); the plain zoo's torchscript 24-28 cells record that.
TORCHSCRIPT_MAX_OPSET = 23
# The architecture zoo at the opsets users export with, through both exporters: TorchScript still exports
# these tiny transformers models (measured: hf/llama and hf/bert at opset 17); where it fails, the cell says so.
# Dynamo also at 24-28, where its output uses the newest op versions; TorchScript is not run there for the
# architectures (it refuses every model, as the plain zoo's cells show).
HF_PREFIX = "hf/"
HF_OPSETS = (17, 18, 23, 24, 25, 26, 27, 28)
HF_SLICE_OPSETS = (18,)
DOCS = Path(__file__).resolve().parents[2] / "docs"

# Fused primitives each plain zoo model has in its ascend MindIR (N = 2 layers everywhere), from the models'
# code (models/*.py). A cell whose census differs fails.
_LLAMA = {"RmsNorm": 5, "FlashAttentionScore": 2, "RotaryPositionEmbedding": 4, "Swiglu": 2}
EXPECTED_PRIMITIVES: dict[str, dict[str, int]] = {
    "llama": _LLAMA, "llama-sdpa": _LLAMA, "hf-llama": _LLAMA,
    "gpt2": {"LayerNorm": 5, "FlashAttentionScore": 2, "GeLU": 2},
    "cnn": {}, "mlp": {},
    "hf-gpt2": {"LayerNorm": 5, "FlashAttentionScore": 2, "GeLU": 2},
    "bert": {"LayerNorm": 5, "FlashAttentionScore": 2, "GeluExt": 2},
    "hf-bert": {"LayerNorm": 5, "FlashAttentionScore": 2, "GeluExt": 2},
}


@dataclasses.dataclass
class Cell:
    model: str
    exporter: str
    opset: int
    status: str  # pass | fail | exporter
    reason: str = ""
    max_abs: float | None = None  # the cpu twin against onnxruntime, at the compile's two reference shapes
    torch_max_abs: float | None = None  # onnxruntime against PyTorch at those same inputs (valid positions)
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)
    census: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.model}/{self.exporter}/{self.opset}"


def model_names(full: bool = False) -> list[str]:
    """Every matrix model: graphconv.zoo.ZOO's names, then `hf/<name>` for graphconv.zoo.architectures (all of
    them with `full`, else its CI slice). The transformers ones only where transformers is installed."""
    from graphconv.zoo import PLAIN_TORCH, ZOO

    names = list(ZOO)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [m for m in names if m in PLAIN_TORCH]
    from graphconv.zoo import architectures

    return names + [HF_PREFIX + n for n in architectures.names("all" if full else "ci")]


def _architecture(model: str):
    """The graphconv.zoo.architectures record of an `hf/<name>` model, else None."""
    if not model.startswith(HF_PREFIX):
        return None
    from graphconv.zoo.architectures import ARCHITECTURES

    return ARCHITECTURES[model[len(HF_PREFIX):]]


def expected_census(model: str) -> dict[str, int]:
    """The fused primitives (name -> call-weighted count) a perfect compile of `model` holds; absent = 0."""
    arch = _architecture(model)
    return dict(arch.census if arch is not None else EXPECTED_PRIMITIVES.get(model, {}))


def _factory(model: str):
    from graphconv.frontend.export import load_factory

    try:
        return load_factory(model)
    except ValueError as e:
        raise UnsupportedError(str(e)) from None


def census_mismatch(expected: dict[str, int], census: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Fused primitive -> (found, expected) wherever the census differs from the expectation."""
    names = set(expected) | (set(census) & fused_primitives())
    return {p: (census.get(p, 0), expected.get(p, 0)) for p in sorted(names)
            if census.get(p, 0) != expected.get(p, 0)}


def _max_abs(report) -> float:
    return max((o["max_abs"] for c in report.validation.get("cases", []) for o in c["outputs"]), default=0.0)


def torch_vs_onnxruntime(module, onnx_path: Path) -> float:
    """Max abs difference of onnxruntime on the export against PyTorch on the module, at the reference inputs
    a compile of that export generates (its two shapes, neither the export shape), on valid positions; raises
    VerificationError beyond the fp32 comparison rule. With the compile's own twin-vs-onnxruntime numbers
    at the same inputs this bounds the cpu twin against PyTorch."""
    import onnx
    import torch

    from graphconv.verify import compare, reference
    from graphconv.errors import VerificationError

    model = onnx.load(str(onnx_path))
    cases = reference.make_cases(model)
    got = reference.Oracle(onnx_path).run(cases)
    atol, rtol = compare.default_tolerance("float32")
    worst = 0.0
    for case, outputs in zip(cases, got):
        with torch.no_grad():
            ref = module(**{k: torch.from_numpy(v) for k, v in case.inputs.items()})
        ref = ref if isinstance(ref, (tuple, list)) else (ref,)
        for (name, value), r in zip(outputs.items(), ref):
            expected = r.detach().numpy()
            c = compare.compare(value, expected, atol, rtol, case.valid_positions(expected))
            if not c.ok:
                raise VerificationError(f"onnxruntime disagrees with PyTorch at {case.shape_text()}: {c.reason}")
            worst = max(worst, c.max_abs)
    return worst


class _ConversionLog(logging.Handler):
    """Collects what onnxscript's version converter logs during a dynamo export. The exporter builds the model
    at its own opset and converts it to the requested one; onnxscript's converter stops at 25, beyond it falls
    back to the onnx C API, and when that fails only logs it (the model then keeps ops newer than its opset
    import, which the checker refuses). The log holds the real cause: the adapter onnx lacks."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.failures: list[str] = []  # each failed conversion's error, its last line from the assertion on
        self._logger = logging.getLogger("onnxscript.version_converter")

    def emit(self, record):
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and record.getMessage().startswith("Failed to convert"):
            last = str(error).strip().splitlines()[-1]
            self.failures.append(last.split("failed: ", 1)[-1])

    def __enter__(self):
        self._propagate, self._logger.propagate = self._logger.propagate, False  # keep the traceback off stderr
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate


def _cause(converter: _ConversionLog | None) -> str:
    if not converter or not converter.failures:
        return ""
    return f" (its opset conversion failed in onnx's version converter: {converter.failures[0]})"


def run_cell(model: str, exporter: str, opset: int, workdir: Path) -> Cell:
    from graphconv.frontend.export import export_pytorch
    from graphconv.pipeline import compile as compile_model

    t0 = time.perf_counter()
    d = workdir / f"{model.replace('/', '-')}-{exporter}-{opset}"
    d.mkdir(parents=True, exist_ok=True)
    onnx_path = d / "model.onnx"
    converter = None
    try:
        module, example_inputs, dynamic_axes = _factory(model)()
        with _ConversionLog() as converter:
            result = export_pytorch(module, example_inputs, onnx_path, dynamic_axes, opset=opset, exporter=exporter)
    except UnsupportedError as e:
        return Cell(model, exporter, opset, "exporter", str(e) + _cause(converter), seconds=time.perf_counter() - t0)
    except GraphconvError as e:
        return Cell(model, exporter, opset, "exporter", f"export check failed: {e}{_cause(converter)}",
                    seconds=time.perf_counter() - t0)
    if result.opset != opset:
        reason = "; ".join(w for w in result.warnings if "produced opset" in w) or f"produced opset {result.opset}"
        return Cell(model, exporter, opset, "exporter", reason, seconds=time.perf_counter() - t0)
    cell = Cell(model, exporter, opset, "pass")
    try:
        # One ascend compile covers both targets: its numbers are checked on the cpu twin, which is by
        # construction the network `--target cpu` emits (the same fused graph with the bodies inlined).
        ascend = compile_model(onnx_path, d / "ascend.mindir", target="ascend")
    except UnsupportedError as e:
        arch = _architecture(model)
        known = arch is not None and arch.unsupported and all(op in str(e) for op in arch.unsupported)
        cell.status, cell.reason = ("unsupported" if known else "fail"), str(e)
    except GraphconvError as e:
        cell.status, cell.reason = "fail", str(e)
    else:
        cell.max_abs = _max_abs(ascend)
        cell.fusions, cell.census = ascend.fusions, ascend.census
        try:
            cell.torch_max_abs = torch_vs_onnxruntime(module, onnx_path)
        except GraphconvError as e:
            cell.status, cell.reason = "fail", str(e)
            cell.seconds = round(time.perf_counter() - t0, 1)
            return cell
        wrong = census_mismatch(expected_census(model), ascend.census)
        if wrong:
            cell.status = "fail"
            cell.reason = "fused census differs from the architecture's: " + ", ".join(
                f"{p} {found} (expected {want})" for p, (found, want) in wrong.items())
            from passes.coverage import summary_lines

            refusals = [line for line in summary_lines(ascend.coverage) if ": " in line]
            if refusals:  # the fusion coverage's account of the candidates that were refused
                cell.reason += " (" + "; ".join(refusals) + ")"
    cell.seconds = round(time.perf_counter() - t0, 1)
    return cell


def model_cells(model: str, exporters, opsets) -> list[tuple[str, int]]:
    """The (exporter, opset) cells of `model`: every pair, except TorchScript beyond TORCHSCRIPT_MAX_OPSET for
    an `hf/` architecture (a refusal the plain zoo's cells already record)."""
    return [(e, o) for e in exporters for o in opsets
            if not (model.startswith(HF_PREFIX) and e == "torchscript" and o > TORCHSCRIPT_MAX_OPSET)]


def run_matrix(models, exporters, opsets, progress: Progress = SILENT, hf_opsets=None) -> list[Cell]:
    """Run the cells; `hf_opsets` (default: `opsets`) are the opsets of the `hf/` architectures."""
    from graphconv.frontend.export import require_torch

    require_torch("graphconv matrix", transformers=any(m.startswith(HF_PREFIX) for m in models))
    cells = []
    with tempfile.TemporaryDirectory(prefix="graphconv-matrix-") as tmp:
        for model in models:
            chosen = hf_opsets if hf_opsets is not None and model.startswith(HF_PREFIX) else opsets
            for exporter, opset in model_cells(model, exporters, chosen):
                progress.info(f"matrix {model} {exporter} opset {opset}")
                cell = run_cell(model, exporter, opset, Path(tmp))
                progress.info(f"  {cell.status}{': ' + cell.reason[:150] if cell.reason else ''}")
                cells.append(cell)
    return cells


def regressions(cells: list[Cell], baseline: dict[str, dict]) -> list[str]:
    """Cells that passed in the baseline and fail now, and fused-primitive counts that dropped."""
    found = []
    for cell in cells:
        old = baseline.get(cell.key)
        if not old:
            continue
        if old["status"] == "pass" and cell.status != "pass":
            found.append(f"{cell.key}: passed before, now {cell.status}: {cell.reason}")
        fused = fused_primitives()
        for prim, n in old.get("census", {}).items():
            if prim in fused and cell.status == "pass" and cell.census.get(prim, 0) < n:
                found.append(f"{cell.key}: {prim} dropped from {n} to {cell.census.get(prim, 0)}")
    return found


def load_baseline(path: Path | None = None) -> dict[str, dict]:
    path = path or DOCS / "opset-matrix.json"
    if not path.exists():
        return {}
    return {c["key"]: c for c in json.loads(path.read_text())["cells"]}


def write_docs(cells: list[Cell], directory: Path | None = None) -> None:
    """Merge `cells` into the stored matrix (cells not run keep their last result) and regenerate the docs."""
    directory = directory or DOCS
    directory.mkdir(exist_ok=True)
    merged = load_baseline(directory / "opset-matrix.json")
    for c in cells:
        merged[c.key] = {**dataclasses.asdict(c), "key": c.key}
    ordered = sorted(merged.values(), key=lambda c: (c["model"], c["exporter"], c["opset"]))
    (directory / "opset-matrix.json").write_text(json.dumps({"cells": ordered}, indent=1) + "\n")
    (directory / "opset-matrix.md").write_text(render_markdown(ordered))


def render_markdown(cells: list[dict]) -> str:
    models = sorted({c["model"] for c in cells})
    columns = sorted({(c["exporter"], c["opset"]) for c in cells})
    by_key = {(c["model"], c["exporter"], c["opset"]): c for c in cells}
    passed = sum(c["status"] == "pass" for c in cells)
    lines = [
        "# Opset compatibility matrix",
        "",
        "Generated by `graphconv matrix` (do not edit by hand). Each cell: the zoo model exported by PyTorch",
        "with that exporter at that opset, compiled for `ascend`, its cpu twin (exactly the `--target cpu`",
        "network) verified against onnxruntime at two shapes, and the ascend MindIR checked for the model's",
        "expected fused primitives (census equal to the one written down from the architecture). `hf/NAME` =",
        "a transformers architecture with default settings (models/architectures.py). `exporter` = PyTorch's",
        "exporter refused the model, changed the opset or wrote an invalid model (the reason quotes it, with what",
        "its opset conversion logged); `unsupported` = an op graphconv does not have yet, known for that",
        "architecture; `not run` = no result stored (TorchScript beyond opset "
        f"{TORCHSCRIPT_MAX_OPSET} is not run for the `hf/` architectures:",
        "it refuses every model, as the plain zoo's cells show).",
        f"`pass` = all of that; otherwise the reason. {passed} of {len(cells)} cells pass.",
        "",
        "| model | " + " | ".join(f"{e} {o}" for e, o in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    reasons: dict[str, int] = {}  # each distinct reason once, numbered in order of first use
    for m in models:
        row = []
        for e, o in columns:
            c = by_key.get((m, e, o))
            if c is None:
                row.append("not run")
            elif c["status"] == "pass":
                row.append("pass")
            else:
                text = f"{c['status']}: {c['reason']}".replace("\n", " ")[:400]
                row.append(f"{c['status']} [{reasons.setdefault(text, len(reasons) + 1)}]")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    if reasons:
        lines += ["", "## Reasons", ""]
        lines += [f"{i}. {r}" for r, i in reasons.items()]
    return "\n".join(lines) + "\n"
