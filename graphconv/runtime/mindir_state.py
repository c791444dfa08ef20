"""State held in a MindIR's Parameters (a KV cache, passes/stateful_cache.py) stored without its bytes, and made at
load instead.

A state Parameter's initial value never matters to the graph (a call writes the positions it reads: see
passes/stateful_cache.py), yet mindspore.export stores it like a weight: at a real capacity that is gigabytes of
zeros in the file, and twice that in memory while `mindspore.load` copies them out of its read buffer. MindSpore
2.10 loads a graph.parameter entry that has neither raw_data nor external_data by allocating it without filling it
(load_model.cc: "Parameter will load initialized data"), and `nn.GraphCell(graph, params_init={name: Tensor})`
replaces a Parameter's value by its plain name (the part after the graph id); given `Tensor(shape, dtype,
init=Zero())`, only the pages a call writes are ever touched (docs/performance.md has the measurement). So the
compile strips the state's bytes (`strip`), records the Parameters (generation.json's `state.params`), and each
loader passes zeros for them (`params_init`).
"""

from __future__ import annotations

import os
from pathlib import Path

from graphconv.runtime.mindir_stream import ALIGN, HEADER_BYTES, MIND_IR_DTYPES, _copy_range, parameter_name

_COPY_CHUNK = 64 * 2**20


def strip(path: Path, prefix: str) -> dict[str, dict]:
    """Remove the bytes of the Parameters of the MindIR `path` whose name starts with `prefix`, from the .mindir
    (raw_data) or from its `_variables/` data file (which is rewritten without them, the other Parameters'
    offsets moved). Returns {name: {"shape", "dtype"}} of what was stripped (empty: nothing matched, the files
    are untouched). The files are replaced whole (written beside, then renamed), keeping their permissions, or
    the data file truncated where the stripped bytes were its tail."""
    from graphconv.verify import census

    path = Path(path)
    model = census.mind_ir_pb2().ModelProto.FromString(path.read_bytes())
    stripped, kept = {}, {}
    for tensor in model.graph.parameter:
        name = parameter_name(tensor.name)
        if name.startswith(prefix):
            stripped[name] = {"shape": list(tensor.dims), "dtype": MIND_IR_DTYPES[tensor.data_type]}
            external = tensor.external_data.location if tensor.HasField("external_data") else None
            tensor.ClearField("raw_data")
            tensor.ClearField("external_data")
            kept.setdefault(external, [])
        elif tensor.HasField("external_data"):
            kept.setdefault(tensor.external_data.location, []).append(tensor.external_data)
    if not stripped:
        return {}
    for location, entries in kept.items():
        if location is not None:
            _compact(path.parent / location, entries)
    _replace(path, model.SerializeToString())
    return stripped


def _compact(data_file: Path, entries: list) -> None:
    """Rewrite a MindIR data file with only `entries` (ExternalDataProtos pointing into it), in their order in
    the file, each at a multiple of ALIGN after the header, as mindspore.export lays them out; their offsets
    are updated in place. Where that moves none of them (the state was the file's tail: the streamed writer
    puts zeros last), the file is only truncated."""
    unmoved, offset = [], HEADER_BYTES
    for entry in sorted(entries, key=lambda e: e.offset):
        unmoved.append(entry.offset == offset)
        offset += -(-entry.length // ALIGN) * ALIGN
    if all(unmoved):
        os.truncate(data_file, offset)
        return
    tmp = data_file.with_name(data_file.name + ".compact")
    with open(data_file, "rb") as src, open(tmp, "wb") as out:
        out.write(src.read(HEADER_BYTES))
        offset = HEADER_BYTES
        for entry in sorted(entries, key=lambda e: e.offset):
            _copy_range(src.fileno(), entry.offset, out.fileno(), offset, entry.length, _COPY_CHUNK)
            entry.offset = offset
            offset += -(-entry.length // ALIGN) * ALIGN
        out.truncate(offset)
    os.chmod(tmp, os.stat(data_file).st_mode & 0o7777)
    os.replace(tmp, data_file)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".stripped")
    tmp.write_bytes(data)
    os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    os.replace(tmp, path)


def params_init(params: dict[str, dict] | None) -> dict:
    """GraphCell's params_init for the stripped state: a Tensor of zeros per Parameter, allocated lazily (pages
    are touched only where a call writes). Imports MindSpore: call it in the process that loads the MindIR."""
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.common.initializer import Zero

    return {name: Tensor(shape=p["shape"], dtype=getattr(ms, p["dtype"]), init=Zero())
            for name, p in (params or {}).items()}
