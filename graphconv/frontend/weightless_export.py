"""Export a checkpoint's graph without holding its weights: trace with the parameters as FakeTensors, then write
each initializer straight from the checkpoint's safetensors files, one tensor at a time.

Why: exporting a materialised model holds the weights several times over (the fp32 model, the exporter's
folded copies, the serialised proto) and cannot reach 7B on a 24 GiB host (docs/performance.md).
torch.export traces FakeTensors (shape and dtype, no storage); torch.onnx keeps them as initializers it
cannot serialise, so they are replaced here by `ir.LazyTensor`s that read the checkpoint when `ir.save`
streams them to external data. Buffers (rotary inv_freq) stay real: they are computed at construction.

What the exporter's own optimizer would have done to a weight is done here lazily: the Transpose of a
Linear weight (its only reader) becomes the transposed initializer, named after the Transpose's output as
the optimizer names it (`val_76`), so the graph is the one a materialised export writes.

A parameter must be stored under its own name with its own shape; where transformers renames or merges
checkpoint tensors at load (MoE experts fused into one 3-D tensor), `plan` says which and the caller loads
the model instead (`NotPlain`).
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from pathlib import Path

from graphconv.dtypes import PRECISION_DTYPES
from graphconv.errors import InputError, UnsupportedError

# safetensors dtype -> torch dtype name; ONNX stores what torch.onnx maps them to. The format's F4 and F6 types
# have no torch dtype: a tensor in one is refused by name (torch_dtype).
_SAFETENSORS_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
STORE_DTYPES = PRECISION_DTYPES


def torch_dtype(dtype: str, key: str):
    """The torch dtype of a safetensors dtype, or one line naming the tensor torch cannot hold."""
    import torch

    name = _SAFETENSORS_TORCH.get(dtype)
    if name is None or not hasattr(torch, name):
        raise UnsupportedError(f"tensor {key!r} is stored as {dtype}, which graphconv does not read (no torch dtype "
                               "holds it)")
    return getattr(torch, name)


class NotPlain(Exception):
    """The checkpoint's tensors are not the model's parameters one to one (the reason is the message)."""


class ModuleWeights:
    """A loaded model's parameters behind the Checkpoint interface (the export's fallback)."""

    def __init__(self, model):
        self._params = dict(model.named_parameters(remove_duplicate=False))
        dtypes = {v: k for k, v in _SAFETENSORS_TORCH.items()}
        self.entries = {name: (None, dtypes[str(p.dtype).removeprefix("torch.")], tuple(p.shape))
                        for name, p in self._params.items()}

    def tensor(self, key: str):
        return self._params[key].detach()


class Checkpoint:
    """The tensors of a folder's safetensors files: key -> (file, dtype, shape), read one at a time."""

    def __init__(self, files: list[Path]):
        self.entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        self._where: dict[str, tuple[int, int]] = {}  # key -> (file offset, bytes)
        for f in files:
            header, data_start = _read_header(f)
            for key, meta in header.items():
                if key != "__metadata__":
                    self.entries[key] = (f, meta["dtype"], tuple(meta["shape"]))
                    begin, end = meta["data_offsets"]
                    self._where[key] = (data_start + begin, end - begin)

    def tensor(self, key: str):
        """The stored tensor as torch (bf16 has no numpy dtype), read with plain file reads: a memory map (as
        safetensors' safe_open) keeps every page it touched resident in the process, the whole checkpoint by
        the end of an export; a read holds one tensor."""
        import torch

        path, dtype, shape = self.entries[key]
        offset, size = self._where[key]
        dtype_ = torch_dtype(dtype, key)
        if size == 0:
            return torch.empty(shape, dtype=dtype_)
        buffer = bytearray(size)
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(buffer) != size:
                raise InputError(f"{path}: truncated while reading {key}")
        return torch.frombuffer(buffer, dtype=dtype_).reshape(shape)


# The safetensors format's dtypes, in bits per element (F4 and F6 pack several elements to a byte).
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
                    "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER_BYTES = 100_000_000  # the format's own limit (safetensors' MAX_HEADER_SIZE)


def read_header(path: Path) -> dict:
    """A .safetensors file's header (8-byte little-endian length, then JSON), checked against the file
    (`_read_header`): a file cut short or a header that lies is refused here, before any tensor is read."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict, int]:
    """(the header, the file offset where the tensor data starts). The header is checked before anything
    trusts it: its length within the file, JSON, and each tensor's dtype known, its data_offsets a pair
    0 <= begin <= end within the data, end - begin the bytes its shape and dtype take, no two overlapping.
    Otherwise a reader would allocate what a hostile header claims, or read another tensor's bytes (or past
    the end of a file cut short by an interrupted download)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise InputError(f"{path}: not a .safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, MAX_HEADER_BYTES):
                where = f"past the end of the file ({size} bytes)" if n > size - 8 else \
                    f"over the format's limit ({MAX_HEADER_BYTES})"
                raise InputError(f"{path}: not a .safetensors file: its header length {n} is {where}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # (UnicodeDecodeError too)
        raise InputError(f"{path}: not a .safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: not a .safetensors file: its header is not a JSON object")
    held = size - 8 - n
    spans = sorted((*_span(path, key, entry, held), key) for key, entry in header.items() if key != "__metadata__")
    spans = [s for s in spans if s[1] > s[0]]  # (an empty tensor holds no bytes to share)
    for (begin, end, key), (begin2, end2, key2) in zip(spans, spans[1:]):
        if begin2 < end:
            raise InputError(f"{path}: tensors {key!r} and {key2!r} overlap (data_offsets [{begin}, {end}] and "
                             f"[{begin2}, {end2}])")
    return header, 8 + n


def _span(path: Path, key: str, entry, held: int) -> tuple[int, int]:
    """(begin, end) of one header entry's bytes in the data (`held` bytes), checked."""

    def refuse(why: str):
        raise InputError(f"{path}: tensor {key!r} {why}")

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(entry, dict):
        refuse("is not an object in the header")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        refuse(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(count(d) for d in shape):
        refuse(f"has the shape {shape!r}: not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(count(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        refuse(f"has data_offsets {offsets!r}: not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
    if bits % 8 or end - begin != bits // 8:
        refuse(f"holds {end - begin} bytes, its dtype and shape ({dtype} {shape}) take {bits / 8:g}")
    if end > held:
        raise InputError(f"{path}: truncated, or its header lies: tensor {key!r} ends at byte {end} of the tensor "
                         f"data, the file holds {held}")
    return begin, end


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside create their parameters on the meta device (no storage); buffers stay real."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def fake_model(cls, config, dtype, **kwargs):
    """`cls` built from `config` with FakeTensor parameters of `dtype`: traceable, storage-free; with the
    FakeTensorMode to run it in (shapes only)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _parameters_on_meta():
        model = cls._from_config(config, dtype=dtype, **kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in fakes:  # tied parameters stay one object
                    with mode:
                        fakes[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False)
                module._parameters[name] = fakes[id(p)]
    return model.eval(), mode


def plan(model, checkpoint: Checkpoint) -> dict[str, str]:
    """Each parameter's module path -> its checkpoint key (the same name, shape checked); tied parameters share
    one key. Raises NotPlain naming the first parameter the checkpoint does not hold as it is."""
    keys: dict[str, str] = {}
    by_object: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = checkpoint.entries.get(name)
        if entry is not None and entry[2] == tuple(p.shape):
            keys[name] = by_object.setdefault(id(p), name)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in keys:
            if id(p) not in by_object:
                entry = checkpoint.entries.get(name)
                why = "absent" if entry is None else f"stored as {list(entry[2])}, the model's is {list(p.shape)}"
                raise NotPlain(f"parameter {name} {why} in the checkpoint")
            keys[name] = by_object[id(p)]
    return keys


def export_graph(module, example_inputs: dict, dynamic_axes: dict, opset: int, input_names: list[str],
                 output_names: list[str]):
    """torch.onnx's dynamo export of a module with fake parameters -> the ir.Model, not optimised (the
    optimizer would fold weights it cannot read; `attach_weights` optimises)."""
    import torch

    dims: dict[str, object] = {}
    dyn = {name: ({ax: dims.setdefault(dim, torch.export.Dim(dim)) for ax, dim in dynamic_axes.get(name, {}).items()}
                  or None) for name in example_inputs}
    program = torch.onnx.export(module.eval(), (), kwargs=example_inputs, dynamo=True, opset_version=opset,
                                dynamic_shapes=dyn, input_names=input_names, output_names=output_names,
                                optimize=False, verbose=False)
    return program.model


def attach_weights(model, checkpoint: Checkpoint, keys: dict[str, str], prefix: str, store: str = "fp32",
                   attached: dict[str, str] | None = None) -> int:
    """Replace the fake initializers of `model` (named `prefix` + module path) by lazy reads of the checkpoint,
    stored as `store` (fp32, or bf16/fp16 with a Cast to fp32 at the reader), then run the exporter's optimizer.
    Returns the bytes the initializers will take; `attached`, when given, receives each float initializer's
    name -> its checkpoint key."""
    import onnx_ir as ir
    import torch

    from graphconv.frontend import optimize

    target = getattr(torch, STORE_DTYPES[store])
    lazy: set[str] = set()
    graph = model.graph
    for name, value in list(graph.initializers.items()):
        if not name.startswith(prefix) or name[len(prefix):] not in keys:
            continue
        key = keys[name[len(prefix):]]
        stored_dtype = torch_dtype(checkpoint.entries[key][1], key)
        if not stored_dtype.is_floating_point:
            value.const_value = _lazy(checkpoint, key, None, False, value.name)
            continue
        readers = list(value.uses())
        transposed = (len(readers) == 1 and readers[0].node.op_type == "Transpose"
                      and _perm(readers[0].node) in ([1, 0], None) and len(value.shape) == 2)
        if transposed:  # the optimizer's fold, without reading the weight now
            node = readers[0].node
            out = node.outputs[0]
            new = ir.Value(name=out.name, shape=ir.Shape([value.shape[1], value.shape[0]]), type=value.type)
            new.const_value = _lazy(checkpoint, key, target, True, out.name)
            out.replace_all_uses_with(new)
            graph.remove(node, safe=True)
            graph.initializers.pop(name)
            graph.register_initializer(new)
            value = new
        else:
            value.const_value = _lazy(checkpoint, key, target, False, value.name)
        lazy.add(value.name)
        if attached is not None:
            attached[value.name] = key
        if target is not torch.float32:
            _cast_at_readers(graph, value)
    # the optimizer may fold what does not read a lazy weight (shapes, masks); a node reading one stays
    optimize.optimize_ir(
        model, should_fold=lambda node: False if any(v is not None and v.name in lazy for v in node.inputs) else None)
    return sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)


def _perm(node):
    attr = node.attributes.get("perm")
    return None if attr is None else list(attr.as_ints())


def _cast_at_readers(graph, value) -> None:
    """value (now bf16/fp16) -> Cast(to=FLOAT) feeding every reader; the initializer keeps its name."""
    import onnx_ir as ir

    dtype = value.const_value.dtype
    value.type = ir.TensorType(dtype)
    readers = list(value.uses())
    cast = ir.node("Cast", [value], attributes={"to": ir.DataType.FLOAT})
    out = cast.outputs[0]
    out.name, out.shape, out.type = f"{value.name}__fp32", value.shape, ir.TensorType(ir.DataType.FLOAT)
    for use in readers:
        use.node.replace_input_with(use.idx, out)
    graph.insert_before(graph[0], cast) if len(graph) else graph.append(cast)


def _lazy(checkpoint: Checkpoint, key: str, dtype, transpose: bool, name: str):
    import onnx_ir as ir
    from onnx_ir.tensor_adapters import from_torch_dtype

    shape = checkpoint.entries[key][2]
    shape = shape[::-1] if transpose else shape
    stored = torch_dtype(checkpoint.entries[key][1], key)
    out_dtype = dtype or stored

    def read():
        t = checkpoint.tensor(key)
        if transpose:
            t = t.t()
        return ir.tensor(t.to(out_dtype).contiguous(), name=name)

    return ir.LazyTensor(read, dtype=from_torch_dtype(out_dtype), shape=ir.Shape(shape), name=name)


def rename_dim(model, old: str, new: str) -> None:
    """Rename a symbolic dim in the graph's inputs, outputs and intermediate values."""
    import onnx_ir as ir

    values = [*model.graph.inputs, *model.graph.outputs,
              *(out for node in model.graph for out in node.outputs)]
    for v in values:
        if v.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value == old for d in v.shape):
            v.shape = ir.Shape([new if isinstance(d, ir.SymbolicDim) and d.value == old else d for d in v.shape])


def save(model, path: Path, external: bool) -> None:
    """Write the graph, its weights streamed one at a time from their lazy sources (into PATH.data when
    `external`: protobuf cannot hold 2 GB)."""
    import onnx_ir as ir

    ir.save(model, path, external_data=f"{path.name}.data" if external else None)
