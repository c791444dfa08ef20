"""graphconv inspect: what is inside an .onnx or a .mindir, read from the file (a MindIR is never executed).

ONNX: inputs/outputs with symbolic dims, op histogram (custom-domain ops keyed `domain::Op`), fused-op
census (the `mindspore` domain), parameter count and bytes, opset imports. MindIR: inputs/outputs, the
call-weighted primitive census (graphconv.census, the same definition the compile report uses), fused
primitives, parameter count and bytes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from graphconv import census
from opmap.fused import fused_primitives
from graphconv.errors import InputError



def inspect_onnx(path: Path) -> dict:
    import onnx

    from graphconv.load import check_external_data, read_proto
    from graphconv.reference import input_specs, output_specs

    model = read_proto(path)
    check_external_data(model, path.parent)
    ops = Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                  for n in model.graph.node)
    n_params, n_bytes = 0, 0
    for t in model.graph.initializer:
        count = int(np.prod(t.dims, dtype=np.int64))
        n_params += count
        n_bytes += count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return {
        "format": "onnx",
        "path": str(path),
        "inputs": [s.as_dict() for s in input_specs(model)],
        "outputs": output_specs(model),
        "opset_imports": {(i.domain or "ai.onnx"): i.version for i in model.opset_import},
        "ops": dict(sorted(ops.items())),
        "fused": {k.split("::", 1)[1]: v for k, v in sorted(ops.items()) if k.startswith("mindspore::")},
        "parameters": n_params,
        "parameter_bytes": n_bytes,
        "nodes": len(model.graph.node),
    }


_ITEMSIZE = {"FLOAT": 4, "FLOAT16": 2, "BFLOAT16": 2, "DOUBLE": 8, "INT8": 1, "UINT8": 1, "INT16": 2,
             "UINT16": 2, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8, "BOOL": 1}


def _short(name: str) -> str:
    """MindIR prefixes names with the graph's name ('<graph>:input_ids')."""
    return name.split(":", 1)[1] if ":" in name else name


def inspect_mindir(path: Path) -> dict:
    model = census.read_mindir(path)
    dtype_name = census.mind_ir_pb2().TensorProto.DataType.Name
    g = model.graph
    prims = census.primitive_census(path)
    n_params, n_bytes = 0, 0
    for p in g.parameter:
        count = int(np.prod(list(p.dims), dtype=np.int64)) if len(p.dims) else 1
        n_params += count
        n_bytes += count * _ITEMSIZE.get(dtype_name(p.data_type), 4)
    inputs = []
    for i in g.input:
        t = i.tensor[0] if i.tensor else None
        inputs.append({"name": _short(i.name),
                       "shape": [int(d) if d >= 0 else None for d in t.dims] if t is not None else None,
                       "dtype": dtype_name(t.data_type).lower() if t is not None else None})
    return {
        "format": "mindir",
        "path": str(path),
        "producer": f"{model.producer_name} {model.model_version}".strip(),
        "inputs": inputs,
        "outputs": [{"name": _short(o.name)} for o in g.output],
        "primitives": prims,
        "fused": {k: v for k, v in prims.items() if k in fused_primitives()},
        "parameters": n_params,
        "parameter_bytes": n_bytes,
        "functions": len(model.functions),
    }


def inspect(path: str | Path, fusions: bool = False, **pass_options) -> dict:
    """The Python API behind `graphconv inspect`. With `fusions` (ONNX only), also the fusion analysis a
    compile would make (graphconv.pipeline.analyze_fusions; `pass_options` are its keyword options):
    `fusions` (pass -> count) and `coverage` (family -> candidates, fused, refused reasons, items)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix == ".onnx":
        info = inspect_onnx(path)
        if fusions:
            from graphconv.pipeline import analyze_fusions

            report = analyze_fusions(path, **pass_options)
            info["fusions"], info["coverage"] = report.fusions, report.coverage
            info["warnings"] = report.warnings
        return info
    if fusions:
        raise InputError(f"{path}: --fusions analyses an .onnx model (a .mindir holds the fused primitives: "
                         "see its census)")
    if path.suffix == ".mindir":
        return inspect_mindir(path)
    raise InputError(f"{path}: expected a .onnx or .mindir file")


def summary(info: dict) -> str:
    lines = [f"{info['path']} ({info['format']})"]
    for i in info["inputs"]:
        lines.append(f"  input  {i['name']} {i.get('shape')} {i.get('dtype', '')}".rstrip())
    for o in info["outputs"]:
        lines.append(f"  output {o['name']} {o.get('shape', '')} {o.get('dtype', '')}".rstrip())
    if "opset_imports" in info:
        lines.append("  opsets: " + ", ".join(f"{k} {v}" for k, v in info["opset_imports"].items()))
    hist = info.get("ops") or info.get("primitives") or {}
    top = sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))
    lines.append(("  ops: " if "ops" in info else "  primitives: ") + ", ".join(f"{k} {v}" for k, v in top))
    lines.append("  fused: " + (", ".join(f"{k} {v}" for k, v in info["fused"].items()) or "none"))
    lines.append(f"  parameters: {info['parameters']:,} ({info['parameter_bytes'] / 2**20:.1f} MiB)")
    if "coverage" in info:
        from passes.coverage import summary_lines

        lines.append("  fusions: " + (", ".join(f"{k} {v}" for k, v in info["fusions"].items()) or "none"))
        lines += [f"  {line}" for line in summary_lines(info["coverage"])]
        for family in info["coverage"].values():
            lines += [f"    {i['node']} ({i['op']}, {i['pass']}): {i['reason']}" for i in family["items"]]
        lines += [f"  warning: {w}" for w in info.get("warnings", [])]
    return "\n".join(lines)
