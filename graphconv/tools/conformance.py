"""ONNX conformance: onnx's node test suite run through graphconv.tools.backend.

The onnx wheel ships the node-test generators (onnx.backend.test.case.node): each case is a one-op model (or
its function body, the `_expanded` variants) with input data sets and expected outputs. Every case is run:
the backend's preparation (load, upgrade below opset 13, compile-time inputs), then batches of models in one
MindSpore child each (graphconv.runtime.runner.run_models; a batch whose child aborts is bisected so the crash is
pinned on one case). Each output is checked like onnx's own runner does, with graphconv.verify.compare: same
shape, same dtype, then |a - b| <= atol + rtol * |ref| with the case's own tolerances (onnx's default 1e-3 /
1e-7 where a case gives none); integers and bools exactly; NaN/inf in kind. bfloat16 outputs get
rtol >= 2**-6 as in onnx's runner.

A case is *applicable* unless one of RULES excludes it (`exclusion()`, decided from the model and its inputs
before anything runs): every opset onnx defines is in scope; what is left out is a non-standard domain,
training-only ops, nondeterministic ops, strings, non-tensor values, and element types outside
APPLICABLE_DTYPES. An exclusion reads "<rule id>: <detail>". The rest runs too and is reported apart. Status:
`passed`, `failed` (ran and disagrees, or MindSpore failed or crashed), `unsupported` (graphconv refused the
model, with its reason).

`graphconv conformance` prints the per-op and total counts and regenerates docs/conformance.md.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import importlib.metadata
import re
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx

from graphconv.verify.compare import compare
from graphconv.progress import SILENT, Progress
from graphconv.onnx_domains import DEFAULT_DOMAINS, find_default_opset

DOCS = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
APPLICABLE_DTYPES = ("float32", "float16", "int8", "int32", "int64", "uint8", "bool")
_APPLICABLE_ELEM = {onnx.helper.np_dtype_to_tensor_dtype(np.dtype(d)) for d in APPLICABLE_DTYPES}
# Why a node test is outside the applicable set: rule id -> reason. exclusion() cites exactly one (the first that
# applies, in this order); tests/test_conformance.py checks that every exclusion of the suite cites one of these.
RULES = {
    "domain": "not the standard ONNX domain (ai.onnx.ml's classical ML, ai.onnx.preview's experimental ops): "
    "graphconv lowers the default domain",
    "training": "training-only (ai.onnx.preview.training's optimizers and gradients): no place in an inference graph",
    "random": "the op is nondeterministic (Random*, Bernoulli, Multinomial, training-mode Dropout with a ratio above "
    "0): the expected values come from numpy's generator, which no backend reproduces",
    "string": "a string tensor: MindSpore has no string tensors",
    "non-tensor": "a sequence, optional or map value at the graph interface: graphconv lowers tensors only (a "
    "MindSpore network takes and returns tensors)",
    "dtype-none": "an element type MindSpore has no tensors for (float8, float6, float4, int4/uint4, int2/uint2, "
    "complex at the interface)",
    "dtype-bfloat16": "bfloat16 at the graph interface: numpy cannot hand bfloat16 arrays to MindSpore or take them "
    "back (bfloat16 inside a network is supported)",
    "dtype-wide": "float64, int16, uint16, uint32 or uint64 at the graph interface: outside the deployment dtypes "
    "the applicable set was fixed to (Ascend computes in fp16/bf16/fp32; MindSpore's CPU kernels lack many ops "
    "for these types)",
}
_RANDOM = re.compile(r"^(Random\w*|Bernoulli|Multinomial)$")
_TRAINING_DOMAIN = "ai.onnx.preview.training"
_WIDE = {onnx.TensorProto.DOUBLE, onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32,
         onnx.TensorProto.UINT64}
_EXPANDED = re.compile(r"_expanded(_ver\d+)?$")
BATCH = 60
STATUSES = ("passed", "failed", "unsupported")
# Why some cases cannot pass, where the one-line error does not say it (appended to the reason in the document).
NOTES = {
    r"^test_training_dropout(_default)?(_mask)?$": "training-mode Dropout with ratio > 0 draws a random mask; the "
    "expected outputs come from numpy's generator, which no backend reproduces",
    r"^test_image_decoder": "ImageDecoder decodes JPEG/PNG/TIFF/WebP byte streams: MindSpore has no such operator",
    r"^test_melweightmatrix$": "every input is a run-time scalar that decides the output's shape and values; "
    "binding them would leave no run-time input (the lowering would fold the whole op)",
    r"^test_max_uint|^test_min_uint|^test_sub_uint|^test_add_uint|^test_mul_uint|^test_div_uint":
    "MindSpore's CPU kernels lack this unsigned type",
}


@dataclasses.dataclass
class NodeCase:
    name: str
    op: str  # the op under test (for an _expanded case: the op whose function body it is)
    opset: int | None  # of the default domain
    model: onnx.ModelProto
    data_sets: list  # [(inputs, expected outputs)]
    rtol: float
    atol: float
    exclusion: str | None  # why the case is not applicable; None when it is

    @property
    def applicable(self) -> bool:
        return self.exclusion is None


@dataclasses.dataclass
class Outcome:
    name: str
    op: str
    opset: int | None
    applicable: bool
    exclusion: str | None
    status: str  # passed | failed | unsupported
    reason: str = ""
    bound: list[str] = dataclasses.field(default_factory=list)  # inputs bound at compile time


def _value_kinds(model: onnx.ModelProto):
    for vi in list(model.graph.input) + list(model.graph.output):
        kind = vi.type.WhichOneof("value")
        yield vi.name, kind, vi.type.tensor_type.elem_type if kind == "tensor_type" else None


def _known_value(model: onnx.ModelProto, name: str, feeds: dict) -> np.ndarray | None:
    """A value known before running: an initializer, a Constant node's output, or a graph input's test data."""
    for t in model.graph.initializer:
        if t.name == name:
            return onnx.numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name and n.attribute and n.attribute[0].name == "value":
            return onnx.numpy_helper.to_array(n.attribute[0].t)
    return feeds.get(name)


def _random_dropout(model: onnx.ModelProto, feeds: dict) -> bool:
    """A training-mode Dropout whose ratio is not 0 draws a random mask."""
    for n in model.graph.node:
        if n.op_type != "Dropout" or len(n.input) < 3 or not n.input[2]:
            continue
        training = _known_value(model, n.input[2], feeds)
        ratio = _known_value(model, n.input[1], feeds) if n.input[1] else np.float32(0.5)
        if (training is None or bool(np.asarray(training))) and (ratio is None or float(np.asarray(ratio)) > 0):
            return True
    return False


def exclusion(model: onnx.ModelProto, op: str, inputs: list | None = None) -> str | None:
    """Why a node-test model is outside the applicable set, as "<RULES id>: <detail>", or None. `inputs`: the
    first data set's input values (in graph input order), for ops whose determinism depends on them."""
    names = [vi.name for vi in model.graph.input if vi.name not in {t.name for t in model.graph.initializer}]
    feeds = dict(zip(names, [_array(v) for v in (inputs or [])]))
    domains = sorted(({i.domain for i in model.opset_import} | {n.domain for n in model.graph.node})
                     - set(DEFAULT_DOMAINS))
    if _TRAINING_DOMAIN in domains:
        return f"training: domain {_TRAINING_DOMAIN}"
    if domains:
        return f"domain: {', '.join(domains)}"
    ops = {op} | {n.op_type for n in model.graph.node}
    random = sorted(o for o in ops if _RANDOM.match(o))
    if random:
        return f"random: {random[0]}"
    if _random_dropout(model, feeds):
        return "random: training-mode Dropout with a ratio above 0"
    for name, kind, elem in _value_kinds(model):
        if kind != "tensor_type":
            return f"non-tensor: {(kind or 'untyped').replace('_type', '')} value {name!r}"
        dtype = onnx.TensorProto.DataType.Name(elem).lower()
        if elem == onnx.TensorProto.STRING:
            return f"string: {name!r}"
        if elem == onnx.TensorProto.BFLOAT16:
            return f"dtype-bfloat16: {name!r}"
        if elem in _WIDE:
            return f"dtype-wide: {dtype} ({name!r})"
        if elem not in _APPLICABLE_ELEM:
            return f"dtype-none: {dtype} ({name!r})"
    return None


def rule_of(exclusion_text: str) -> str:
    """The RULES id an exclusion cites."""
    return exclusion_text.split(":", 1)[0]


def collect(pattern: str | None = None) -> list[NodeCase]:
    """Every node test of the installed onnx (optionally those whose name matches `pattern`), sorted by op."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators divide by zero on purpose (inf cases)
        raw = node.collect_testcases(None)
    by_name = {c.name: c for c in raw}
    regex = re.compile(pattern) if pattern else None
    cases = []
    for c in raw:
        if regex and not regex.search(c.name):
            continue
        base = by_name.get(_EXPANDED.sub("", c.name), c)
        nodes = base.model.graph.node
        op = nodes[0].op_type if len(nodes) == 1 else (c.model.graph.node[0].op_type if c.model.graph.node else "?")
        data_sets = list(c.data_sets)
        cases.append(NodeCase(c.name, op, find_default_opset(c.model), c.model, data_sets, c.rtol, c.atol,
                              exclusion(c.model, op, data_sets[0][0] if data_sets else None)))
    return sorted(cases, key=lambda c: (c.op, c.name))


def _array(t):
    """A data-set value as numpy; sequences stay lists (the backend refuses them)."""
    if isinstance(t, onnx.TensorProto):
        return onnx.numpy_helper.to_array(t)
    if isinstance(t, (list, tuple)) or t is None:
        return t
    return np.asarray(t)


def _short(message: str, limit: int = 220) -> str:
    """One line: the node name prefix dropped (`node 'Add_0' (Add): x` -> `Add: x`), whitespace folded."""
    message = re.sub(r"node '[^']*' \((\w+)\): ", r"\1: ", message)
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def check(case: NodeCase, outputs: list[list[np.ndarray]]) -> str:
    """'' when every output of every data set matches, else the first mismatch in a few words."""
    for k, ((_, expected), actual) in enumerate(zip(case.data_sets, outputs)):
        expected = [_array(e) for e in expected]
        if len(actual) != len(expected):
            return f"{len(actual)} outputs, expected {len(expected)}"
        for j, (a, e) in enumerate(zip(actual, expected)):
            where = f"output {j}" + (f" (data set {k})" if len(case.data_sets) > 1 else "")
            if a.shape != e.shape:
                return f"{where}: shape {list(a.shape)}, expected {list(e.shape)}"
            if a.dtype != e.dtype:
                return f"{where}: dtype {a.dtype}, expected {e.dtype}"
            rtol = max(case.rtol, 2**-6) if e.dtype.name == "bfloat16" else case.rtol
            if e.dtype.name == "bfloat16":
                a, e = a.astype(np.float32), e.astype(np.float32)
            cmp = compare(a, e, atol=case.atol, rtol=rtol)
            if not cmp.ok:
                return f"{where}: {cmp.reason} (max_abs {cmp.max_abs:.3g})"
    return ""


def run(cases: list[NodeCase], progress: Progress = SILENT, batch: int = BATCH) -> list[Outcome]:
    """Run every case through graphconv.tools.backend.run_batch, `batch` models per MindSpore child."""
    from graphconv.tools import backend

    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="graphconv-conformance-") as tmp:
        for start in range(0, len(cases), batch):
            chunk = cases[start:start + batch]
            progress.info(f"cases {start + 1}-{start + len(chunk)} of {len(cases)} ({chunk[0].op} .. {chunk[-1].op})")
            items = [(c.model, [[_array(i) for i in inputs] for inputs, _ in c.data_sets]) for c in chunk]
            work = Path(tmp) / f"batch{start}"
            for c, res in zip(chunk, backend.run_batch(items, work)):
                if res.error is not None:
                    status, reason = ("unsupported" if res.unsupported else "failed"), _short(res.error)
                else:
                    reason = check(c, res.outputs)
                    status = "failed" if reason else "passed"
                    reason = _short(reason)
                note = next((text for rx, text in NOTES.items() if re.search(rx, c.name)), None)
                if status != "passed" and note:
                    reason = f"{reason} ({note})"
                outcomes.append(Outcome(c.name, c.op, c.opset, c.applicable, c.exclusion, status, reason, res.bound))
    return outcomes


# --- summaries and the document -------------------------------------------------------------------------------


def summarize(outcomes: list[Outcome]) -> dict:
    def counts(items):
        c = collections.Counter(o.status for o in items)
        return {s: c.get(s, 0) for s in STATUSES} | {"cases": len(items)}

    applicable = [o for o in outcomes if o.applicable]
    ops: dict[str, dict] = {}
    for op in sorted({o.op for o in outcomes}):
        mine = [o for o in outcomes if o.op == op]
        ops[op] = {"applicable": counts([o for o in mine if o.applicable]),
                   "other": counts([o for o in mine if not o.applicable])}
    failures = collections.Counter(o.op for o in applicable if o.status != "passed")
    excluded = collections.Counter(rule_of(o.exclusion) for o in outcomes if not o.applicable)
    passed = sum(o.status == "passed" for o in applicable)
    return {
        "total": counts(outcomes),
        "applicable": counts(applicable) | {"percent": round(100.0 * passed / len(applicable), 1) if applicable
                                            else 0.0},
        "not_applicable": counts([o for o in outcomes if not o.applicable])
        | {"by_reason": dict(excluded.most_common())},
        "bound_compile_time_inputs": sum(bool(o.bound) for o in outcomes if o.status == "passed"),
        "top_failures": [{"op": op, "not_passed": n, "reasons": _top_reasons(applicable, op)}
                         for op, n in sorted(failures.items(), key=lambda kv: (-kv[1], kv[0]))[:10]],
        "ops": ops,
    }


def _top_reasons(outcomes: list[Outcome], op: str) -> list[str]:
    """The two most common reasons (grouped with their numbers ignored), each as one real example."""
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        if o.op == op and o.status != "passed":
            groups.setdefault(_generic(o.reason), []).append(o.reason)
    ranked = sorted(groups.values(), key=len, reverse=True)[:2]
    return [f"{r[0]} (x{len(r)})" if len(r) > 1 else r[0] for r in ranked]


def _generic(reason: str) -> str:
    """A reason with numbers dropped, to group similar failures."""
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", reason)[:120]


def _versions() -> str:
    out = []
    for dist in ("onnx", "mindspore", "onnxruntime"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render(summary: dict, outcomes: list[Outcome], seconds: float) -> str:
    t, a, na = summary["total"], summary["applicable"], summary["not_applicable"]
    lines = [
        "# ONNX conformance of graphconv.tools.backend",
        "",
        "Generated by `graphconv conformance` (do not edit by hand; rerun the command). The ONNX node test suite "
        "(`onnx.backend.test.case.node.collect_testcases`) runs through `graphconv.tools.backend`: load, lower, emit "
        "MindIR, run with MindSpore on CPU, compare with the expected outputs.",
        "",
        f"Run {datetime.date.today().isoformat()} with {_versions()}; wall time {seconds / 60:.1f} min on this host.",
        "",
        "## Totals",
        "",
        "| | cases | passed | failed | unsupported |",
        "|---|---:|---:|---:|---:|",
        f"| all node tests | {t['cases']} | {t['passed']} | {t['failed']} | {t['unsupported']} |",
        f"| **applicable** | **{a['cases']}** | **{a['passed']} ({a['percent']}%)** | {a['failed']} | "
        f"{a['unsupported']} |",
        f"| not applicable | {na['cases']} | {na['passed']} | {na['failed']} | {na['unsupported']} |",
        "",
        "**Applicable**: every case at every opset onnx defines, unless one of the rules below excludes it "
        "(decided from the model and its inputs before anything runs; an exclusion cites its rule). Graph input and "
        f"output dtypes in scope: {', '.join(APPLICABLE_DTYPES)}. Excluded cases run too; their results are listed "
        "apart.",
        "",
        "| rule | excluded cases | why |",
        "|---|---:|---|",
        *[f"| {rule} | {na['by_reason'].get(rule, 0)} | {_md(why)} |" for rule, why in RULES.items()],
        "",
        "**Comparison**: `graphconv.verify.compare.compare` with each case's own tolerances (onnx's runner defaults, "
        "rtol 1e-3 / atol 1e-7, where the case sets none): |a - b| <= atol + rtol * |expected| elementwise, after "
        "the shape and the dtype match exactly; integers and bools exactly, NaN/inf in kind; bfloat16 with "
        "rtol >= 2**-6 as in onnx's runner.",
        "",
        "**How cases run**: models below opset 13 are upgraded to 13 with onnx.version_converter (the node tests "
        "build each op at its since_version). Where a lowering needs a value at compile time that the test passes "
        f"as a graph input (axes, pads, repeats, sizes...), the backend binds that input to its value and "
        f"compiles once per value ({summary['bound_compile_time_inputs']} passing cases); a node is never left "
        "with constant inputs only, so MindSpore always computes the op.",
        "",
        "## The ten ops with the most applicable cases not passing",
        "",
        "| op | not passed | main reasons |",
        "|---|---:|---|",
    ]
    for f in summary["top_failures"]:
        lines.append(f"| {f['op']} | {f['not_passed']} | {_md('; '.join(f['reasons']))} |")
    lines += [
        "",
        "## Per op",
        "",
        "Applicable cases: passed / failed / unsupported. Not applicable: passed of run.",
        "",
        "| op | applicable | passed | failed | unsupported | not applicable (passed/run) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for op, c in summary["ops"].items():
        ap, ot = c["applicable"], c["other"]
        other = f"{ot['passed']}/{ot['cases']}" if ot["cases"] else ""
        lines.append(f"| {op} | {ap['cases']} | {ap['passed']} | {ap['failed']} | {ap['unsupported']} | {other} |")
    lines += [
        "",
        "## Every case that does not pass",
        "",
        "| case | op | opset | applicable | status | reason |",
        "|---|---|---:|---|---|---|",
    ]
    for o in sorted(outcomes, key=lambda o: (not o.applicable, o.op, o.name)):
        if o.status == "passed":
            continue
        appl = "yes" if o.applicable else f"no ({o.exclusion})"
        lines.append(f"| {o.name} | {o.op} | {o.opset if o.opset is not None else ''} | {_md(appl)} | {o.status} | "
                     f"{_md(o.reason)} |")
    return "\n".join(lines) + "\n"


def write_docs(summary: dict, outcomes: list[Outcome], seconds: float, path: Path = DOCS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(summary, outcomes, seconds))
    return path


def conformance(pattern: str | None = None, progress: Progress = SILENT) -> tuple[dict, list[Outcome], float]:
    """The Python API behind `graphconv conformance`: (summary, outcomes, seconds)."""
    t0 = time.perf_counter()
    cases = collect(pattern)
    progress.info(f"{len(cases)} node tests ({sum(c.applicable for c in cases)} applicable)")
    outcomes = run(cases, progress)
    return summarize(outcomes), outcomes, time.perf_counter() - t0
