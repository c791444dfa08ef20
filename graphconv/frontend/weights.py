"""Weights that stay on disk: external data referenced by absolute path, read lazily, written once.

A model with external data is never loaded into a protobuf with its weights (which caps at 2 GB and would
hold a second copy). Instead:

- load rewrites each external tensor's location to the absolute path of its (validated) data file, in
  memory only. Protos then carry names, dtypes, dims and where the bytes are; shape inference, the inliner
  and the passes (onnx-ir ExternalTensor, memory-mapped) work on them as usual;
- onnxruntime and onnx.reference run such a model *stripped*: every external initializer becomes a graph
  input, fed with a read-only memory map of its bytes (no copy: the pages are the file's), see `feeds`;
- new weights that a pass or the precision stage makes (fp16 copies) are appended to one file in the
  compile's private directory by `SpillFile` and referenced like the others, so no stage keeps them in
  memory for the next. A weight that is other weights concatenated (merged gate/up: 0.43 x a Llama's
  weights) is written nowhere: its ref lists its parts, and every reader here makes it from them;
- the MindSpore export child reads each weight by itself (`read`) right before it becomes a Parameter.

ORT refuses external data given by absolute path or through a symlink out of the model's folder (measured
with 1.32), hence the stripping rather than a rewritten model file.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

_ALIGN = 4096


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """Where one tensor's bytes are: an absolute file path, an offset and a length. A concatenated weight
    (`parts`, along `axis`) has a path and offset that name it but hold no bytes (SpillFile.concatenated)."""

    name: str
    path: str
    offset: int
    length: int
    dtype: str  # numpy dtype name (bfloat16 via ml_dtypes)
    shape: tuple[int, ...]
    parts: tuple["WeightRef", ...] = ()
    axis: int = 0

    def as_list(self) -> list:
        """[path, offset, length, dtype, shape] (+ {"axis", "parts"} for a concatenated one): JSON for the
        export child."""
        out = [self.path, self.offset, self.length, self.dtype, list(self.shape)]
        if self.parts:
            out.append({"axis": self.axis, "parts": [p.as_list() for p in self.parts]})
        return out

    @classmethod
    def of_list(cls, ref: list, name: str = "") -> "WeightRef":
        path, offset, length, dtype, shape = ref[:5]
        made = ref[5] if len(ref) > 5 else {}
        return cls(name, str(path), int(offset), int(length), dtype, tuple(int(d) for d in shape),
                   tuple(cls.of_list(p) for p in made.get("parts", ())), int(made.get("axis", 0)))


def np_dtype(data_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type: the one mapping of weights, reference inputs and contrib
    constants. onnx (1.23, pinned) maps bfloat16 and the float8/int4 types to ml_dtypes' numpy dtypes."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))


def external_refs(model: onnx.ModelProto) -> dict[str, WeightRef]:
    """The external initializers of the main graph, by name (locations must already be absolute)."""
    return {t.name: weight_ref(t) for t in model.graph.initializer if uses_external_data(t)}


# External tensors up to this size are read into the proto at load: shape constants and axes must be
# visible to shape inference's data propagation and to constant folding.
INLINE_MAX_BYTES = 4096


def take_over_external(model: onnx.ModelProto, base_dir: Path) -> None:
    """Read small external tensors into the proto; point every other one (graph and functions' constants)
    at the absolute path of its file. The locations must have been validated (graphconv.frontend.load)."""
    from onnx.external_data_helper import _get_all_tensors

    base = Path(os.path.realpath(base_dir))
    for t in _get_all_tensors(model):
        if not uses_external_data(t):
            continue
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = str(base / entry.value)
        ref = weight_ref(t)
        if ref.length <= INLINE_MAX_BYTES:
            data = read(ref, mmap=False)
            t.raw_data = data.tobytes()
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT


# (spill file path, offset) -> the parts of a concatenated weight named there (SpillFile.concatenated). Weak:
# an entry goes with its SpillFile (a compile's), which holds the parts.
_CONCATENATED: "weakref.WeakValueDictionary[tuple[str, int], _Parts]" = weakref.WeakValueDictionary()


class _Parts:
    def __init__(self, parts: tuple[WeightRef, ...], axis: int):
        self.parts, self.axis = parts, axis


def read(ref: WeightRef | list, mmap: bool = True) -> np.ndarray:
    """The tensor's values: a read-only memory map (default) or a fresh array read from the file. A
    concatenated weight is made from its parts (a fresh array)."""
    ref = ref if isinstance(ref, WeightRef) else WeightRef.of_list(ref)
    if ref.parts:
        return np.concatenate([read(p, mmap) for p in ref.parts], axis=ref.axis)
    dt = _dtype_by_name(ref.dtype)
    count = int(np.prod(ref.shape, dtype=np.int64)) if ref.shape else 1
    if count == 0:
        return np.zeros(ref.shape, dt)
    if mmap:
        return np.memmap(ref.path, dtype=dt, mode="r", offset=ref.offset, shape=tuple(ref.shape))
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return np.fromfile(f, dtype=dt, count=count).reshape(ref.shape)


def is_zeros(ref: WeightRef) -> bool:
    """Whether the tensor's bytes are a hole of its file (SpillFile.zeros): zeros that were never written. False
    where the filesystem cannot tell (no SEEK_DATA), which only costs reading them."""
    if ref.parts or ref.length == 0:
        return False
    end = ref.offset + ref.length
    try:
        with open(ref.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < end:
                return False
            data = os.lseek(f.fileno(), ref.offset, os.SEEK_DATA)
    except OSError as e:
        return e.errno == errno.ENXIO  # no data from the offset to the end of the file
    return data >= end


def unwritten_zeros(t: onnx.TensorProto) -> bool:
    """Whether `t` is external zeros never written (SpillFile.zeros: a KV cache's), which a stage that would copy
    or convert its bytes names as another hole instead."""
    return uses_external_data(t) and is_zeros(weight_ref(t))


def to_array(t: onnx.TensorProto) -> np.ndarray:
    """numpy_helper.to_array that also reads tensors whose external location is absolute (memory-mapped)."""
    return read(weight_ref(t)) if uses_external_data(t) else onnx.numpy_helper.to_array(t)


def made_initializer(array: np.ndarray, name: str, spill: "SpillFile | None") -> onnx.TensorProto:
    """A weight the load makes (a quantized weight re-laid for a low-bit primitive): in `spill` (the compile's
    private file) when given and it is at least SPILL_MIN_BYTES, so a model of many gigabytes never holds
    its re-laid weights in memory nor in the proto (which stops at 2 GB); else in the proto."""
    array = np.ascontiguousarray(array)
    if spill is not None and array.nbytes >= SPILL_MIN_BYTES:
        return spill.tensor_proto(name, array)
    return onnx.numpy_helper.from_array(array, name)


def weight_ref(t: onnx.TensorProto) -> WeightRef:
    """Where an external tensor's bytes are (its length from its dims when the file does not say)."""
    info = ExternalDataInfo(t)
    dtype = np_dtype(t.data_type)
    count = int(np.prod(list(t.dims), dtype=np.int64))
    made = _CONCATENATED.get((info.location, info.offset or 0))
    return WeightRef(t.name, info.location, info.offset or 0,
                     info.length if info.length is not None else count * dtype.itemsize, dtype.name,
                     tuple(int(d) for d in t.dims), made.parts if made else (), made.axis if made else 0)


def _dtype_by_name(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def stripped(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, WeightRef]]:
    """A copy of `model` whose external initializers are graph inputs instead (with their dtype and dims),
    and the refs to feed them from. A model without external data is returned as is."""
    refs = external_refs(model)
    if not refs:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [t for t in out.graph.initializer if t.name not in refs]
    inputs = [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
              for t in out.graph.initializer if t.name in refs]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    have = {i.name for i in out.graph.input}
    out.graph.input.extend(i for i in inputs if i.name not in have)
    return out, refs


def feeds(refs: dict[str, WeightRef]) -> dict[str, np.ndarray]:
    """Memory maps of the stripped weights, to pass with the real inputs."""
    return {name: read(ref) for name, ref in refs.items()}


def restore(simplified: onnx.ModelProto, original: onnx.ModelProto, refs: dict[str, WeightRef]) -> onnx.ModelProto:
    """Undo `stripped` on a model derived from it (onnxsim's output): graph inputs that were weights become
    the original external initializers again; weights the derived graph no longer reads are dropped."""
    by_name = {t.name: t for t in original.graph.initializer}
    used = {x for n in simplified.graph.node for x in n.input} | {o.name for o in simplified.graph.output}
    inputs = [i for i in simplified.graph.input if i.name not in refs]
    back = [by_name[i.name] for i in simplified.graph.input if i.name in refs and i.name in used]
    del simplified.graph.input[:]
    simplified.graph.input.extend(inputs)
    simplified.graph.initializer.extend(back)
    return simplified


class SpillFile:
    """Appends new weights to one file in the compile's private directory; returns external TensorProtos /
    onnx-ir ExternalTensors that reference them, so the values can leave memory. A concatenation of weights
    in files is only named (`concatenated`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # Concatenated weights are named in this file, which is never created: a reader that does not make
        # them from their parts fails on it instead of reading anything else.
        self.unwritten = self.path.with_name(self.path.name + ".concatenated")
        self._next_unwritten = 0
        self._parts: list[_Parts] = []  # what _CONCATENATED refers to, alive as long as this file
        self.concatenated_bytes = 0

    def _append(self, array: np.ndarray) -> tuple[int, int]:
        array = np.ascontiguousarray(array)
        with open(self.path, "ab") as f:
            offset = f.seek(0, os.SEEK_END)
            pad = (-offset) % _ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(array.tobytes(order="C") if array.dtype.name == "bfloat16" else memoryview(array).cast("B"))
        return offset, array.nbytes

    def tensor_proto(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        offset, length = self._append(array)
        t = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
        t.dims.extend(array.shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", str(self.path)), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=k, value=v)
        return t

    def zeros(self, name: str, data_type: int, dims: list[int]) -> onnx.TensorProto:
        """A tensor of zeros written nowhere: the file is only extended over it (a hole, which takes no disk
        and reads as zeros), so that readers that can tell (`is_zeros`) skip its bytes. A KV cache's initial
        value (passes/stateful_cache.py): gigabytes at a real capacity, none of them ever read."""
        length = int(np.prod(dims, dtype=np.int64)) * np_dtype(data_type).itemsize
        with open(self.path, "ab") as f:
            end = f.seek(0, os.SEEK_END)
            offset = end + (-end) % _ALIGN
            f.truncate(offset + length)
        t = onnx.TensorProto(name=name, data_type=data_type)
        t.dims.extend(dims)
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", str(self.path)), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=k, value=v)
        return t

    def external_tensor(self, name: str, array: np.ndarray) -> ir.ExternalTensor:
        offset, length = self._append(array)
        return ir.ExternalTensor(str(self.path), offset, length, ir.DataType.from_numpy(array.dtype),
                                 shape=ir.Shape(array.shape), name=name)

    def concatenated(self, name: str, parts: list[WeightRef], axis: int) -> "ConcatenatedTensor":
        """A tensor that is `parts` concatenated along `axis`, written nowhere: its proto names a place in
        `unwritten`, and weight_ref of that proto gives the parts."""
        first = parts[0]
        shape = list(first.shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        length = sum(p.length for p in parts)
        offset = self._next_unwritten
        self._next_unwritten += length + (-length) % _ALIGN
        made = _Parts(tuple(parts), axis)
        self._parts.append(made)
        _CONCATENATED[(str(self.unwritten), offset)] = made
        self.concatenated_bytes += length
        dtype = ir.DataType.from_numpy(_dtype_by_name(first.dtype))
        return ConcatenatedTensor(str(self.unwritten), offset, length, dtype, shape=ir.Shape(shape), name=name)


class ConcatenatedTensor(ir.ExternalTensor):
    """SpillFile.concatenated's tensor: an external tensor whose values are made from its parts when read."""

    def ref(self) -> WeightRef:
        made = _CONCATENATED[(str(self.location), self.offset)]  # (the key weight_ref looks up: the proto's)
        return WeightRef(self.name or "", str(self.location), self.offset, self.length, self.dtype.numpy().name,
                         tuple(int(d) for d in self.shape), made.parts, made.axis)

    def numpy(self) -> np.ndarray:
        return read(self.ref())

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def tobytes(self) -> bytes:
        return np.ascontiguousarray(self.numpy()).tobytes()

    def tofile(self, file) -> None:  # (onnx-ir's save copies an external tensor's file range)
        file.write(self.tobytes())

    def release(self) -> None:
        pass


# In-memory tensors at least this big are spilled after the passes (smaller ones are cheap to keep).
SPILL_MIN_BYTES = 1 << 20


def spill_new_tensors(model: ir.Model, spill: SpillFile) -> int:
    """Move every large in-memory initializer a pass created to the spill file (a concatenation of weights
    in files is only named there: SpillFile.concatenated); returns the bytes written."""
    moved = 0
    for value in model.graph.initializers.values():
        t = value.const_value
        if t is None or isinstance(t, ir.ExternalTensor) or t.nbytes < SPILL_MIN_BYTES:
            continue
        parts = _parts_in_files(t)
        if parts:
            value.const_value = spill.concatenated(value.name, parts, t.axis)
            continue
        value.const_value = spill.external_tensor(value.name, t.numpy())
        moved += t.nbytes
    return moved


class Concatenated(ir.LazyTensor):
    """A weight a pass makes that is its `sources` (ir.Values) concatenated along `axis` (merged gate/up,
    passes.match.concatenated): where every source is in a file, the spill only names it (SpillFile.concatenated)."""

    def __init__(self, make, sources: list, axis: int, **kwargs):
        super().__init__(make, **kwargs)
        self.sources, self.axis = list(sources), axis


def _parts_in_files(t) -> list[WeightRef] | None:
    """The refs of a Concatenated tensor's sources, if each is in a file in the made dtype (a bfloat16 source
    is made float32: then the bytes are not its)."""
    if not isinstance(t, Concatenated):
        return None
    parts = []
    for v in t.sources:
        c = v.const_value
        if not isinstance(c, ir.ExternalTensor) or c.dtype != t.dtype:
            return None
        if isinstance(c, ConcatenatedTensor):
            parts.append(c.ref())
            continue
        parts.append(WeightRef(v.name or "", str(c.path), c.offset or 0,
                               c.length if c.length is not None else c.nbytes, c.dtype.numpy().name,
                               tuple(int(d) for d in c.shape)))
    return parts


def save_self_contained(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write `model` as a file that stands on its own: weights held by reference (or too big for one
    protobuf) are copied into `<name>.data` beside it. Returns the files written."""
    path = Path(path)
    if not external_refs(model) and model.ByteSize() < 1_800_000_000:
        onnx.save(model, str(path))
        return [path]
    data = path.with_name(path.name + ".data")
    ir.save(to_ir(model), path, external_data=data.name)
    return [path, data]


def to_ir(model: onnx.ModelProto) -> ir.Model:
    """ir.from_proto, with the concatenated weights (SpillFile.concatenated) as tensors that make their values
    from their parts (ir.from_proto would make external tensors of a file that does not exist)."""
    out = ir.from_proto(model)
    for value in out.graph.initializers.values():
        t = value.const_value
        if isinstance(t, ir.ExternalTensor) and (str(t.location), t.offset or 0) in _CONCATENATED:
            value.const_value = ConcatenatedTensor(str(t.location), t.offset or 0, t.length, t.dtype, shape=t.shape,
                                                   name=t.name)
    return out


def release_mapped(model: ir.Model) -> None:
    """Close the memory maps onnx-ir opened for external weights a pass read (their pages stop counting
    in this process's resident memory; the next read maps them again)."""
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.release()
