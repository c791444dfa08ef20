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
import struct
from pathlib import Path

from graphconv.errors import InputError

# safetensors dtype -> torch dtype name; ONNX stores what torch.onnx maps them to
_SAFETENSORS_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
STORE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


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
        torch_dtype = getattr(torch, _SAFETENSORS_TORCH[dtype])
        if size == 0:
            return torch.empty(shape, dtype=torch_dtype)
        buffer = bytearray(size)
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(buffer) != size:
                raise InputError(f"{path}: truncated while reading {key}")
        return torch.frombuffer(buffer, dtype=torch_dtype).reshape(shape)


def read_header(path: Path) -> dict:
    """A .safetensors file's header (8-byte little-endian length, then JSON), checked against the file's size:
    a file cut short (an interrupted download or copy) is refused here, before anything is written."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict, int]:
    """(the header, the file offset where the tensor data starts)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            size = f.seek(0, 2)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise InputError(f"{path}: not a readable .safetensors file ({type(e).__name__}: {e})") from None
    held = size - 8 - n
    if max(ends, default=0) > held:
        raise InputError(f"{path}: truncated: its header places {max(ends)} bytes of tensor data, the file holds "
                         f"{max(held, 0)}")
    return header, 8 + n


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


def attach_weights(model, checkpoint: Checkpoint, keys: dict[str, str], prefix: str, store: str = "fp32") -> int:
    """Replace the fake initializers of `model` (named `prefix` + module path) by lazy reads of the checkpoint,
    stored as `store` (fp32, or bf16/fp16 with a Cast to fp32 at the reader), then run the exporter's optimizer.
    Returns the bytes the initializers will take."""
    import onnx_ir as ir
    import onnxscript.optimizer
    import torch

    target = getattr(torch, STORE_DTYPES[store])
    lazy: set[str] = set()
    graph = model.graph
    for name, value in list(graph.initializers.items()):
        if not name.startswith(prefix) or name[len(prefix):] not in keys:
            continue
        key = keys[name[len(prefix):]]
        stored_dtype = getattr(torch, _SAFETENSORS_TORCH[checkpoint.entries[key][1]])
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
        if target is not torch.float32:
            _cast_at_readers(graph, value)
    # the optimizer may fold what does not read a lazy weight (shapes, masks); a node reading one stays
    onnxscript.optimizer.optimize_ir(
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
    import torch
    from onnx_ir.tensor_adapters import from_torch_dtype

    shape = checkpoint.entries[key][2]
    shape = shape[::-1] if transpose else shape
    stored = getattr(torch, _SAFETENSORS_TORCH[checkpoint.entries[key][1]])
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
