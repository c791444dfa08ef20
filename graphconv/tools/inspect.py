"""graphconv inspect: what is inside an .onnx or a .mindir, read from the file (a MindIR is never executed).

ONNX: inputs/outputs with symbolic dims, op histogram (custom-domain ops keyed `domain::Op`), fused-op
census (the `mindspore` domain), parameter count and bytes, opset imports. MindIR: inputs/outputs, the
call-weighted primitive census (graphconv.verify.census, the same definition the compile report uses), fused
primitives, parameter count and bytes. Checkpoint (.ckpt, as `--emit-source` writes it): every parameter's
name, shape and dtype, with the source ONNX initializer and transform from the mapping file beside it
(`<stem>.names.json`, graphconv.frontend.param_names) when there is one.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from graphconv.verify import census
from opmap.fused import fused_primitives
from graphconv.errors import InputError



def inspect_onnx(path: Path) -> dict:
    import onnx

    from graphconv.frontend.load import check_external_data, read_proto
    from graphconv.onnx_domains import domain_name, op_key
    from graphconv.verify.reference import input_specs, output_specs

    model = read_proto(path)
    check_external_data(model, path.parent, path)
    ops = Counter(op_key(n) for n in model.graph.node)
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
        "opset_imports": {domain_name(i.domain): i.version for i in model.opset_import},
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


_CKPT_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
                  "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1}


def _varint(buf, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, value or (offset, length) of a length-delimited field) of one message."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield field, wire, (pos, length)
            pos += length
        elif wire == 5:
            yield field, wire, None
            pos += 4
        elif wire == 1:
            yield field, wire, None
            pos += 8
        else:
            raise ValueError(f"wire type {wire}")


def read_checkpoint_index(path: Path) -> list[dict]:
    """name, shape, dtype of every parameter of a MindSpore .ckpt (a `Checkpoint` protobuf: repeated
    Value{tag, TensorProto{dims, tensor_type, tensor_content}}, large tensors split into several Values of one
    tag), read without loading the tensors or importing MindSpore."""
    import mmap

    out: dict[str, dict] = {}
    with open(path, "rb") as f:
        if Path(path).stat().st_size == 0:
            return []
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            pos, end = 0, len(buf)
            while pos < end:
                key, body = _varint(buf, pos)
                if key != (1 << 3 | 2):  # not a Checkpoint.value (e.g. the crc_num trailer): done
                    break
                length, body = _varint(buf, body)
                tag, dims, dtype, nbytes = None, [], None, 0
                for field, _, val in _fields(buf, body, body + length):
                    if field == 1:
                        tag = bytes(buf[val[0]:val[0] + val[1]]).decode()
                    elif field == 2:
                        for f2, w2, v2 in _fields(buf, val[0], val[0] + val[1]):
                            if f2 == 1 and w2 == 0:
                                dims.append(v2)
                            elif f2 == 1 and w2 == 2:  # packed dims
                                p2, stop = v2[0], v2[0] + v2[1]
                                while p2 < stop:
                                    d, p2 = _varint(buf, p2)
                                    dims.append(d)
                            elif f2 == 2:
                                dtype = bytes(buf[v2[0]:v2[0] + v2[1]]).decode()
                            elif f2 == 3:
                                nbytes += v2[1]
                pos = body + length
                if tag in out:
                    out[tag]["bytes"] += nbytes
                else:
                    out[tag] = {"name": tag, "shape": dims, "dtype": (dtype or "").lower(), "bytes": nbytes}
        except (IndexError, ValueError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: not a MindSpore checkpoint ({e})") from None
        finally:
            buf.close()
    return list(out.values())


def inspect_ckpt(path: Path) -> dict:
    import json

    params = read_checkpoint_index(path)
    names_file = path.with_name(f"{path.stem}.names.json")
    mapping = json.loads(names_file.read_text()) if names_file.is_file() else {}
    for p in params:
        m = mapping.get(p["name"])
        if m is not None:
            p.update({k: m.get(k) for k in ("source", "transform", "layout", "recovered", "made_by", "derived_from")
                      if m.get(k) is not None})
    n_params = sum(int(np.prod(p["shape"], dtype=np.int64)) for p in params)
    return {
        "format": "ckpt",
        "path": str(path),
        "names_file": str(names_file) if mapping else None,
        "params": params,
        "parameters": n_params,
        "parameter_bytes": sum(p.pop("bytes") for p in params),
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
    if path.suffix == ".ckpt":
        return inspect_ckpt(path)
    raise InputError(f"{path}: expected a .onnx or .mindir file (or a MindSpore .ckpt)")


def _ckpt_summary(info: dict) -> str:
    lines = [f"{info['path']} (ckpt)"]
    for p in info["params"]:
        line = f"  {p['name']} {p['shape']} {p['dtype']}"
        if "source" in p:
            src = ", ".join(p["source"]) or "?"
            line += f"  <- {src}" + (f" ({p['transform']})" if p.get("transform") else "")
        lines.append(line)
    lines.append(f"  parameters: {info['parameters']:,} ({info['parameter_bytes'] / 2**20:.1f} MiB) in "
                 f"{len(info['params'])} tensors")
    lines.append(f"  names: {info['names_file']}" if info["names_file"] else
                 "  names: no mapping file beside it (sources unknown)")
    return "\n".join(lines)


def summary(info: dict) -> str:
    if info["format"] == "ckpt":
        return _ckpt_summary(info)
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
