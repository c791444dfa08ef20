"""The opset compatibility matrix: zoo model x exporter x opset -> export, compile for both targets, check.

Each cell exports the zoo model (graphconv.export), compiles it for `ascend` (graphconv.compile verifies the
numbers on CPU at two shapes through the cpu twin, which is exactly the `--target cpu` network), and checks the ascend MindIR's census against the fused
primitives the model is expected to get. A cell is `pass`, `fail` (graphconv's fault: the reason says what),
or `exporter` (PyTorch's exporter refused or produced an invalid model: recorded as PyTorch's, not hidden).
`docs/opset-matrix.md` and `docs/opset-matrix.json` are written from the results; the JSON is the baseline
against which regressions (a passing cell that fails, a fusion count that drops) are found.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from graphconv.errors import GraphconvError, UnsupportedError
from graphconv.progress import SILENT, Progress

EXPORTERS = ("dynamo", "torchscript")
OPSETS = tuple(range(14, 24))
SLICE = {"exporters": ("dynamo",), "opsets": (17, 18)}  # what CI runs; --full runs everything
DOCS = Path(__file__).resolve().parents[1] / "docs"

# Fused primitives each zoo model must reach in the ascend MindIR (N = 2 layers everywhere). A cell whose
# census has fewer fails; more is fine. Grows as fusions land.
_LLAMA = {"RmsNorm": 5, "FlashAttentionScore": 2, "RotaryPositionEmbedding": 4, "Swiglu": 2}
EXPECTED_PRIMITIVES: dict[str, dict[str, int]] = {
    "llama": _LLAMA, "llama-sdpa": _LLAMA, "hf-llama": _LLAMA,
    "gpt2": {"LayerNorm": 5, "FlashAttentionScore": 2, "GeLU": 2},
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
    max_abs: float | None = None
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)
    census: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.model}/{self.exporter}/{self.opset}"


def _max_abs(report) -> float:
    return max((o["max_abs"] for c in report.validation.get("cases", []) for o in c["outputs"]), default=0.0)


def run_cell(model: str, exporter: str, opset: int, workdir: Path) -> Cell:
    from graphconv.export import zoo_export
    from graphconv.pipeline import compile as compile_model
    from models import load_factory

    t0 = time.perf_counter()
    d = workdir / f"{model}-{exporter}-{opset}"
    d.mkdir(parents=True, exist_ok=True)
    onnx_path = d / "model.onnx"
    try:
        result = zoo_export(load_factory(model), onnx_path, opset=opset, exporter=exporter)
    except UnsupportedError as e:
        return Cell(model, exporter, opset, "exporter", str(e), seconds=time.perf_counter() - t0)
    except GraphconvError as e:
        return Cell(model, exporter, opset, "exporter", f"export check failed: {e}", seconds=time.perf_counter() - t0)
    if result.opset != opset:
        reason = "; ".join(w for w in result.warnings if "produced opset" in w) or f"produced opset {result.opset}"
        return Cell(model, exporter, opset, "exporter", reason, seconds=time.perf_counter() - t0)
    cell = Cell(model, exporter, opset, "pass")
    try:
        # One ascend compile covers both targets: its numbers are checked on the cpu twin, which is by
        # construction the network `--target cpu` emits (the same fused graph with the bodies inlined).
        ascend = compile_model(onnx_path, d / "ascend.mindir", target="ascend")
    except GraphconvError as e:
        cell.status, cell.reason = "fail", str(e)
    else:
        cell.max_abs = _max_abs(ascend)
        cell.fusions, cell.census = ascend.fusions, ascend.census
        missing = {p: n for p, n in EXPECTED_PRIMITIVES.get(model, {}).items() if ascend.census.get(p, 0) < n}
        if missing:
            cell.status = "fail"
            cell.reason = "too few fused primitives: " + ", ".join(
                f"{p} {ascend.census.get(p, 0)} < {n}" for p, n in missing.items())
            passes = {_PASS_OF.get(p) for p in missing}
            why = [f"{name} skipped {reasons[0]}" for name, reasons in ascend.skipped_fusions.items()
                   if reasons and name in passes]
            if why:  # the passes' own account of the candidates they refused
                cell.reason += " (" + "; ".join(why) + ")"
    cell.seconds = round(time.perf_counter() - t0, 1)
    return cell


def run_matrix(models, exporters, opsets, progress: Progress = SILENT) -> list[Cell]:
    cells = []
    with tempfile.TemporaryDirectory(prefix="graphconv-matrix-") as tmp:
        for model in models:
            for exporter in exporters:
                for opset in opsets:
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
        for prim, n in old.get("census", {}).items():
            if prim in _FUSED_PRIMITIVES and cell.status == "pass" and cell.census.get(prim, 0) < n:
                found.append(f"{cell.key}: {prim} dropped from {n} to {cell.census.get(prim, 0)}")
    return found


# The pass that makes each fused primitive (for the reason of a cell that lacks some).
_PASS_OF = {"RmsNorm": "fuse-rmsnorm", "LayerNorm": "fuse-layernorm", "FlashAttentionScore": "fuse-attention",
            "RotaryPositionEmbedding": "fuse-rope", "Swiglu": "fuse-swiglu", "GeLU": "fuse-gelu",
            "GeluExt": "fuse-gelu", "SiLU": "fuse-silu"}
_FUSED_PRIMITIVES = {"RmsNorm", "LayerNorm", "FlashAttentionScore", "RotaryPositionEmbedding", "Swiglu", "GeLU",
                     "GeluExt", "SiLU"}


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
        "expected fused primitives. `exporter` = PyTorch's exporter refused the model or changed the opset.",
        f"`pass` = all of that; otherwise the reason. {passed} of {len(cells)} cells pass.",
        "",
        "| model | " + " | ".join(f"{e} {o}" for e, o in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    reasons: list[str] = []
    for m in models:
        row = []
        for e, o in columns:
            c = by_key.get((m, e, o))
            if c is None:
                row.append("not run")
            elif c["status"] == "pass":
                row.append("pass")
            else:
                reasons.append(f"{c['status']}: {c['reason']}")
                row.append(f"{c['status']} [{len(reasons)}]")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    if reasons:
        lines += ["", "## Reasons", ""]
        lines += [f"{i}. {r.replace(chr(10), ' ')[:400]}" for i, r in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"
