"""The compiled network's numbers against the oracle's, by the comparison rule (verify/compare.py): the outputs
of every case (`compare_outputs`), and, in the block-by-block run, the values every block passed on
(`compare_blocks`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphconv.verify import compare, reference


@dataclasses.dataclass
class OutputCheck:
    cases: list[dict]  # per case: name, input shapes, per output its comparison
    failures: list[str]
    overflowed: bool  # every failure is both sides overflowing (nothing can be verified on these inputs)


def compare_outputs(cases, expected: list[dict], out_files: list[str], output_names: list[str],
                    tolerance, exact=None) -> OutputCheck:
    """Each case's outputs (the child's out<i> files, in graph-output order) against the oracle's;
    `tolerance(reference)` gives (atol, rtol). With `exact` (graphconv.verify.exact.Values, a low-precision
    compile's), a float output is judged against its exact values (compare.judge_against_exact)."""
    results, failures, overflows = [], [], []
    for number, (case, exp, out_file) in enumerate(zip(cases, expected, out_files)):
        with np.load(out_file) as got:
            outs = []
            for i, name in enumerate(output_names):
                ref = exp[name]
                atol, rtol = tolerance(ref)
                actual, valid = reference.typed(got[f"out{i}"]), case.valid_positions(ref)
                pair = exact.of(number, name) if exact is not None and _is_float(ref) else None
                if pair is not None:
                    c = compare.judge_against_exact(actual, ref, *pair, atol, rtol, valid)
                else:
                    c = compare.compare(actual, ref, atol, rtol, valid)
                outs.append({"name": name, "shape": list(ref.shape), **c.as_dict()})
                if not c.ok:
                    failures.append(f"output {name!r} at {case.shape_text()}: {c.reason} (max abs {c.max_abs:.3g})")
                    overflows.append(c.overflow)
        results.append({"name": case.name, "inputs": {k: list(v.shape) for k, v in case.inputs.items()},
                        "outputs": outs})
    return OutputCheck(results, failures, bool(failures) and all(overflows))


def compare_blocks(blocks: list[dict], onnx_names: dict[str, str], cases, expected: list[dict],
                   got_files: list[str], tolerance, exact=None) -> tuple[list[dict], str | None]:
    """Each block's boundary values (by number, `onnx_names`: number -> ONNX name) against onnxruntime's values
    of those ONNX names, in block order: a row per block (max abs over the cases of the values compared)
    and the first failure (None if none). With `exact` (graphconv.verify.exact.Values), float values are
    judged against theirs, and the row gives the rounded graph's distance from them beside the block's."""
    got = []
    for f in got_files:
        with np.load(f) as data:
            got.append({k: data[k] for k in data.files})
    rows, failure = [], None
    for b in blocks[:-1]:
        compared = [str(i) for i in b["outputs"] if str(i) in onnx_names and onnx_names[str(i)] in expected[0]]
        worst, rounded_worst, bad = 0.0, None, None
        for k, (case, exp, act) in enumerate(zip(cases, expected, got)):
            for i in compared:
                if i not in act:
                    continue
                name = onnx_names[i]
                ref = exp[name]
                pair = exact.of(k, name) if exact is not None and _is_float(ref) else None
                if pair is not None:
                    c = compare.judge_against_exact(act[i], ref, *pair, *tolerance(ref), case.valid_positions(ref))
                    rounded_worst = max(rounded_worst or 0.0, c.exact["rounded_max_abs"])
                else:
                    c = compare.compare(act[i], ref, *tolerance(ref), case.valid_positions(ref))
                worst = max(worst, c.max_abs)
                if not c.ok and bad is None:
                    bad = f"value {name!r} at {case.shape_text()}: {c.reason} (max abs {c.max_abs:.3g})"
        rows.append({**_row(b), "values": [onnx_names[i] for i in compared], "max_abs": worst,
                     **({"rounded_max_abs": rounded_worst} if rounded_worst is not None else {})})
        if bad is not None and failure is None:
            failure = f"block {b['name']}" + (f" ({b['class']})" if b.get("class") else "") + f": {bad}"
    rows.append({**_row(blocks[-1]), "values": ["(the network's outputs)"]})
    return rows, failure


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


def _row(b: dict) -> dict:
    return {"block": b["name"], "kind": b["kind"], "class": b.get("class"), "weight_bytes": b["weight_bytes"],
            "seconds": b["seconds"], "rss_after": b["rss_after"], "compiled_again": not b["reused"],
            **{k: b[k] for k in ("weights_seconds", "write_seconds") if k in b}}


def oracle_values(model, names: list[str], cases) -> list[dict[str, np.ndarray]]:
    """onnxruntime's values of `names` (and the graph's outputs) for every case: one run of `model` with them
    added as graph outputs (their types from the graph's value_info where known; onnxruntime infers the rest)."""
    import onnx

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    typed = {vi.name: vi for vi in exposed.graph.value_info}
    present = {o.name for o in exposed.graph.output}
    made = {o for n in exposed.graph.node for o in n.output}
    for n in names:
        if n not in present and n in made:
            exposed.graph.output.append(typed.get(n) or onnx.helper.make_empty_tensor_value_info(n))
            present.add(n)
    return reference.Oracle(exposed).run(cases)
