"""Streamed MindIR: the graph exported without its weights, then the weights copied into MindSpore's
external-data layout chunk by chunk, so that no more than a bounded number of weight bytes is ever resident.

`mindspore.export` needs every Parameter in memory (and the generated network's build holds up to two copies
of a weight while it transposes it); here the network is built with Parameters from a lazy
`mindspore.common.initializer` (MindSpore 2.10 neither allocates nor touches their memory to compile and
export the graph: measured, 2 GiB of them add 7 MB), the graph is taken from `mindspore.export` itself
(its public `custom_func` hook receives the ModelProto before anything is saved; the hook stops the export
there), and the weights are written by this module from the files they are in.

The format, as mindspore 2.10 writes and reads it (sources: mindspore/train/serialization.py `_split_save`,
`_get_data_file`, `_generate_front_info_for_param_data_file`, `_save_together`; the protobuf
mindspore/train/mind_ir_pb2.py; the loader's MSANFModelParser::GetTensorDataFromExternal in
mindspore/core/load_mindir/load_model.cc; and experiments with mindspore.export and mindspore.load):

- two things beside each other: `<prefix>_graph.mindir`, a `mind_ir.ModelProto`, and the folder
  `<prefix>_variables/` holding `data_0`. mindspore.export writes that split form only when the Parameters
  exceed TOTAL_SAVE (1 GiB: it sums `sys.getsizeof(bytes)` in KiB against 1024 * 1024); smaller networks get
  one `<prefix>.mindir` with each weight in its TensorProto's raw_data. The .mindir may be renamed (graphconv
  moves it to the requested path): only the folder's relative location is recorded;
- `model.graph.parameter[i]` is a TensorProto named `<graph id>:<Parameter name>` with dims and data_type
  (mind_ir DataType: FLOAT 1, UINT8 2, INT8 3, UINT16 4, INT16 5, INT32 6, INT64 7, BOOL 9, FLOAT16 10,
  DOUBLE 11 (float64), UINT32 12, UINT64 13, BFLOAT16 16), no raw_data, and `external_data` {location:
  "<prefix>_variables/data_0", offset, length}. The loader opens dirname(realpath(mindir)) + "/" + location
  and copies `length` bytes from `offset` into a tensor of the proto's dims and dtype;
- data_0 starts with a 64-byte header: byte 0 is 1 when the writer was little-endian (the loader refuses a
  file whose byte order differs from its own), bytes 1..63 are zero. Then every Parameter, in order of its
  name (the part after the first ':', Python string order), its bytes in C order (little-endian), zero-padded
  to a multiple of 64 bytes: the first offset is 64, `length` is the unpadded size (this writer puts the
  Parameters whose source is a hole of its file, zeros never written, after the others, unwritten).
  mindspore.export opens a data_1 only past PARAMETER_SPLIT_SIZE (1 TiB in its KiB units, counting only
  tensors whose size is not a multiple of 64): one data_0 here;
- the loader reads each data_N whole into memory and keeps it until the load ends, then copies every tensor
  out of it: loading a split MindIR holds twice its weight bytes (what mindspore.load costs, not this writer).

The checkpoint (`--emit-source`, `--bundle`: network.ckpt), as mindspore.save_checkpoint 2.10 writes it
(serialization.py `_exec_save`, `_write_parameter_bytes_data`; checkpoint.proto): one serialized `Checkpoint`
message per slice of each Parameter, in the network's parameter order, concatenated (protobuf merges them
into one repeated `value`): `Value {tag = name; tensor = TensorProto {dims (unpacked int64s), tensor_type
("Float32", str(mindspore dtype)), tensor_content}}`, a slice being 512 MiB of the Parameter's bytes (SLICE_SIZE
KiB * 1024); an empty Parameter writes nothing. `write_checkpoint` copies each Parameter's bytes from the
MindIR's data_0 (already in the Parameter's layout and dtype), so the two hold the same values.

Layout changes are applied on the way: a Parameter stored transposed (Linear's [out, in] layout,
graphconv/compiler/lowering.dense_weights) is read as strips of whole source columns or blocks of whole source
rows (whichever makes the larger reads and writes) and transposed in memory one strip at a time; a
Parameter whose dtype differs from its source's (a float cast, fp32 -> fp16 / bf16) is converted per block
exactly as graphconv/passes/precision._to_low converts (through float32, numpy / ml_dtypes rounding). A plain
copy goes through os.copy_file_range (in the kernel: no bytes in this process). Nothing is memory-mapped: the
pages of a map would count in this process's resident memory.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

from graphconv.dtypes import FLOAT_NAMES

HEADER_BYTES = 64
ALIGN = 64
CHUNK_BYTES = 16 * 2**20  # at most this many source bytes in memory at a time (plus their cast and transpose)

# mind_ir.TensorProto.DataType -> numpy dtype name (mind_ir_pb2.TensorProto.DataType; FLOAT64 17 is not written
# by mindspore 2.10, which writes DOUBLE for float64)
MIND_IR_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
                  9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16",
                  17: "float64", 18: "int8"}  # 18: QINT4X2, two int4 per byte: written as its int8 container


class StreamError(RuntimeError):
    """A weight that cannot be written as the graph declares it (missing, wrong shape, impossible cast)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one Parameter's values are: `length` bytes at `offset` of the file `path` (an ONNX external data
    file, the compile's spill file, the weights file emit writes), or `parts` concatenated along `axis` (a
    merged gate/up weight: graphconv.frontend.weights.SpillFile.concatenated; its path holds nothing), or,
    for small ones, `array`. `shape` and `dtype` (numpy name) are the source's, before any layout change."""

    shape: tuple[int, ...]
    dtype: str
    path: str | None = None
    offset: int = 0
    length: int = 0
    array: np.ndarray | None = None
    parts: tuple["Source", ...] = ()
    axis: int = 0

    @classmethod
    def of_array(cls, array: np.ndarray) -> "Source":
        array = np.asarray(array)
        return cls(tuple(int(d) for d in array.shape), array.dtype.name, array=array)

    @classmethod
    def of_ref(cls, ref) -> "Source":
        """From a graphconv.frontend.weights.WeightRef or its as_list() form."""
        from graphconv.frontend.weights import WeightRef

        ref = ref if isinstance(ref, WeightRef) else WeightRef.of_list(ref)
        return cls(ref.shape, ref.dtype, ref.path, ref.offset, ref.length,
                   parts=tuple(cls.of_ref(r) for r in ref.parts), axis=ref.axis)

    def is_zeros(self) -> bool:
        """Whether the bytes are a hole of their file: zeros never written (graphconv.frontend.weights.is_zeros)."""
        from graphconv.frontend.weights import WeightRef, is_zeros

        return self.array is None and not self.parts and self.path is not None and \
            is_zeros(WeightRef("", self.path, self.offset, self.length, self.dtype, self.shape))

    def files(self) -> list["Source"]:
        """The Sources whose bytes are in a file: this one, or its parts'."""
        if self.parts:
            return [f for p in self.parts for f in p.files()]
        return [self] if self.array is None and self.path is not None else []

    def read(self) -> np.ndarray:
        """The whole array, in the source's shape and dtype (a fresh array)."""
        if self.array is not None:
            return np.asarray(self.array)
        if self.parts:
            return np.concatenate([p.read() for p in self.parts], axis=self.axis)
        dtype = numpy_dtype(self.dtype)
        with open(self.path, "rb", buffering=0) as f:
            return _read(f.fileno(), self.offset, self.length // dtype.itemsize, dtype).reshape(self.shape)

    def read_transposed(self) -> np.ndarray:
        """The 2-D source's transpose (a fresh C-order array): read().T without read()'s copies. Tiles are
        transposed straight from a read-only memory map of the file, and a merged weight's parts each into
        their own rows or columns (no concatenation). On the 1.1B's layers (176 MB, in the page cache) the
        read copy and the concatenation cost up to 0.5 s of kernel time per layer; the map ~0.03 s."""
        out = np.empty(self.shape[::-1], numpy_dtype(self.dtype))
        self._transpose_into(out)
        return out

    def _transpose_into(self, out: np.ndarray) -> None:
        if self.parts:
            at, axis = 0, self.axis % 2
            for part in self.parts:  # concatenated along `axis`: along the other one in the transpose
                n = part.shape[axis]
                part._transpose_into(out[at:at + n] if axis == 1 else out[:, at:at + n])
                at += n
        elif self.array is not None:
            _transpose_tiles(np.asarray(self.array), out)
        else:  # (unmapped when it goes, on return: the file's pages leave this process's RSS)
            _transpose_tiles(np.memmap(self.path, numpy_dtype(self.dtype), "r", self.offset, self.shape), out)


def ms_dtype(name: str):
    """The MindSpore dtype of a numpy dtype name (as the compiler's ParamSpecs and Attrs write them)."""
    import mindspore as ms

    return ms.bool_ if name == "bool" else getattr(ms, name)


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype by name; bfloat16 through ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype("int8" if name == "qint4x2" else name)  # (qint4x2: its int8 container, lowering.QINT4X2)


def _cast(block: np.ndarray, target: np.dtype) -> np.ndarray:
    """passes/precision._to_low's conversion (through float32), elementwise: per block it gives the same bytes."""
    if block.dtype == target:
        return block
    return block.astype(np.float32).astype(target)


def parameter_name(proto_name: str) -> str:
    """The Parameter's name in a graph.parameter entry ("<graph id>:<name>"), as mindspore's _split_save reads it."""
    return proto_name[proto_name.find(":") + 1:]


# --- the graph ------------------------------------------------------------------------------------------


class LazyWeights:
    """What the generated network's `_param` (opmap/helpers.py) is given instead of the weights: for each name
    a lazily initialized Parameter of the network's shape and dtype (`shapes`: name -> (shape, numpy dtype
    name), the emit task's param_shapes), whose memory MindSpore never touches while it compiles and exports
    the graph."""

    def __init__(self, shapes: dict):
        self.shapes = shapes
        self.made = {}

    def __getitem__(self, name):
        import mindspore as ms
        from mindspore import Parameter
        from mindspore.common.initializer import Zero, initializer

        if name not in self.shapes:
            raise StreamError(f"the streamed export asked for weight {name!r}, which the network does not declare")
        if name not in self.made:
            shape, dtype = self.shapes[name][0], ms_dtype(self.shapes[name][1])
            # requires_grad as _param sets it (it is part of the exported graph's parameter info)
            self.made[name] = Parameter(initializer(Zero(), tuple(shape), dtype), name=name,
                                        requires_grad=dtype in (ms.float16, ms.bfloat16, ms.float32))
        return self.made[name]


class _GraphReady(Exception):
    def __init__(self, model):
        super().__init__("graph exported")
        self.model = model


def comparable(graph_file: Path):
    """The MindIR graph's ModelProto without what two runs of mindspore.export already differ in (measured:
    the compile_phase attribute carries a run id, the primitives table comes in hash order), and each external
    data location reduced to its file name (the folder's name follows the MindIR's): two MindIRs of one
    network, exported or streamed, compare equal (the tests and benchmarks/mindir_stream.py).
    Also left out: the order of a graph's or function's attributes, and a layer function's
    `lazy_inline_order_clone` flag. Both differed between compiles of the same network in
    tests/test_mindir_stream.py's layer-streamed runs (the flag was set in some runs and absent in others,
    in 1 of 6 to 4 of 7 runs); what makes MindSpore set it is not established."""
    from graphconv.verify import census

    model = census.mind_ir_pb2().ModelProto.FromString(Path(graph_file).read_bytes())
    for attr in model.graph.attribute:
        if attr.name == "compile_phase":
            attr.s = b""
    for graph in [model.graph, *model.functions]:  # named attributes: their order means nothing
        attrs = sorted((a for a in graph.attribute if a.name != "lazy_inline_order_clone"), key=lambda a: a.name)
        del graph.attribute[:]
        graph.attribute.extend(attrs)
    prims = sorted(model.primitives, key=lambda p: p.SerializeToString())
    del model.primitives[:]
    model.primitives.extend(prims)
    for p in model.graph.parameter:
        p.external_data.location = p.external_data.location.rsplit("/", 1)[-1]
    return model


def export_graph(net, *inputs, file_name: str = "network"):
    """The ModelProto mindspore.export would save for `net` (without any weight bytes: no raw_data, no
    external_data). Goes through mindspore.export itself, so the graph is exactly its (jit_syntax_level, phase,
    compile); its `custom_func` hook, called with the parsed proto before any saving, ends the export
    (nothing is written: `file_name` only has to be a name export accepts)."""
    import mindspore as ms
    from mindspore import context

    def take(model):
        raise _GraphReady(model)

    level = context.get_context("jit_syntax_level")
    try:
        ms.export(net, *inputs, file_name=str(file_name), file_format="MINDIR", custom_func=take)
    except _GraphReady as ready:
        return ready.model
    finally:
        context.set_context(jit_syntax_level=level)  # export sets STRICT and restores it only on success
    raise StreamError("mindspore.export did not hand over the graph (custom_func was not called)")


# --- the weights ----------------------------------------------------------------------------------------


class WeightsFile:
    """`<prefix>_variables/data_0` for `model`'s Parameters (the module docstring's layout), its offsets fixed
    up front, so that its weights can be written in any order: `put` takes a weight's final bytes from
    whoever already holds them (the layer-streamed verification's Parameters, graphconv.runtime.blocks),
    `finish` writes every weight not put from its source. Either way the file is byte for byte what
    write_weights writes. Every Parameter is checked against its source before anything is written."""

    def __init__(self, model, directory: Path, prefix: str, sources: dict[str, Source],
                 transposed: dict[str, bool] | None = None, chunk_bytes: int | None = None, progress=None):
        transposed = transposed or {}
        if len(model.graph.map_parameter):
            raise StreamError("MapParameters cannot be written as external data (mindspore.export refuses too)")
        self.sources, self.chunk_bytes, self.progress = sources, chunk_bytes or CHUNK_BYTES, progress
        self.folder = Path(directory) / f"{prefix}_variables"
        location = f"{prefix}_variables/data_0"
        # name -> offset, length, dtype, flip, dims
        self.entries: dict[str, tuple[int, int, np.dtype, bool, tuple]] = {}
        offset = HEADER_BYTES
        missing = next((parameter_name(p.name) for p in model.graph.parameter
                        if parameter_name(p.name) not in sources), None)
        if missing is not None:
            raise StreamError(f"no values for parameter {missing!r}")
        # Zeros never written (a KV cache's: graphconv.frontend.weights.is_zeros) go last, as the file's tail
        # of holes, which a stripped state gives back by truncating (graphconv/runtime/mindir_state.py).
        self.zeros = {name for name, src in sources.items() if src.is_zeros()}
        for name, proto in sorted(((parameter_name(p.name), p) for p in model.graph.parameter),
                                  key=lambda i: (i[0] in self.zeros, i[0])):
            target = numpy_dtype(MIND_IR_DTYPES.get(proto.data_type, "") or _unknown(proto))
            dims = tuple(int(d) for d in proto.dims)
            flip = bool(transposed.get(name))
            _check(name, sources[name], dims, target, flip)
            length = int(np.prod(dims, dtype=np.int64)) * target.itemsize
            proto.ClearField("raw_data")
            proto.external_data.location = location
            proto.external_data.offset = offset
            proto.external_data.length = length
            self.entries[name] = (offset, length, target, flip, dims)
            offset += length + (-length % ALIGN)  # (the padding: zeros, the file's holes read as zeros)
        self.pending = set(self.entries)
        self.put_bytes = 0
        self._background = _Background()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = open(self.folder / "data_0", "wb")  # noqa: SIM115 - closed in finish()
        self._file.write(bytes([1 if sys.byteorder == "little" else 0]) + bytes(HEADER_BYTES - 1))
        self._file.truncate(offset)

    def put(self, name: str, value: np.ndarray, transposed: bool) -> bool:
        """Write weight `name` from `value`, its final array (`transposed`: Linear's layout), if the graph
        stores it exactly so (same layout, dims and dtype) and it is not written yet. Returns whether it was."""
        entry = self.entries.get(name)
        if name not in self.pending or entry is None or name in self.zeros:
            return False
        offset, length, target, flip, dims = entry
        if bool(transposed) != flip or value.dtype != target or tuple(value.shape) != dims or value.nbytes != length:
            return False
        self.pending.discard(name)
        self.put_bytes += length
        self._background.write(self._file.fileno(), value, offset, lambda: self._done(name))
        return True

    def finish(self) -> Path:
        """Write every weight not put from its source; close the file. Returns the folder."""
        try:
            self._background.drain()
            for name in sorted(self.pending):
                offset, _, target, flip, _ = self.entries[name]
                if name not in self.zeros:  # (a hole of the file already)
                    _write_one(self._file.fileno(), offset, self.sources[name], target, flip, self.chunk_bytes)
                drop_written(self._file.fileno())
                self._done(name)
        finally:
            self._file.close()
        return self.folder

    def _done(self, name: str) -> None:
        self.pending.discard(name)
        if self.progress is not None:
            src = self.sources[name]
            self.progress(name, src.array.nbytes if src.array is not None else src.length)


class _Background:
    """Writes done by one thread while the caller goes on (the layer-streamed run computes while the disk
    takes the previous block's weights), at most BACKLOG_BYTES of arrays waiting. An array is kept alive
    until it is written (a MindSpore Parameter's asnumpy() view holds its memory even after set_data)."""

    BACKLOG_BYTES = 512 * 2**20

    def __init__(self):
        import threading

        self._cond = threading.Condition()
        self._jobs: list = []
        self._queued = 0
        self._error: BaseException | None = None
        self._thread = None

    def write(self, fd: int, array: np.ndarray, offset: int, done) -> None:
        import threading

        with self._cond:
            while self._jobs and self._queued + array.nbytes > self.BACKLOG_BYTES and self._error is None:
                self._cond.wait()
            self._raise()
            self._jobs.append((fd, array, offset, done))
            self._queued += array.nbytes
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mindir-weights", daemon=True)
                self._thread.start()

    def drain(self) -> None:
        """Wait until every write is done; raise the first one's error."""
        with self._cond:
            while self._jobs and self._error is None:
                self._cond.wait()
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise StreamError(f"writing the MindIR's weights failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                fd, array, offset, done = self._jobs[0]
            try:
                _pwrite_all(fd, _bytes_of(array), offset)
                drop_written(fd)
                done()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's next write or drain
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._jobs.pop(0)
                self._queued -= array.nbytes
                self._cond.notify_all()


def write_weights(model, directory: Path, prefix: str, sources: dict[str, Source],
                  transposed: dict[str, bool] | None = None, chunk_bytes: int | None = None,
                  progress=None) -> Path:
    """Write every `model.graph.parameter`'s values into `directory/<prefix>_variables/data_0` from
    `sources` (by Parameter name) and point its external_data there (the module docstring's layout).
    `transposed[name]`: the Parameter is the 2-D source's transpose. `progress(name, nbytes)` after each weight
    (the source bytes).
    Returns the folder."""
    return WeightsFile(model, directory, prefix, sources, transposed, chunk_bytes, progress).finish()


def _unknown(proto) -> str:
    raise StreamError(f"parameter {parameter_name(proto.name)!r} has a mind_ir data type "
                      f"({proto.data_type}) this writer does not know")


def _check(name: str, src: Source, dims: tuple, target: np.dtype, flip: bool) -> None:
    want = tuple(reversed(src.shape)) if flip else tuple(src.shape)
    if flip and len(src.shape) != 2:
        raise StreamError(f"parameter {name!r}: only 2-D weights are stored transposed, the source is {src.shape}")
    if dims != want:
        raise StreamError(f"parameter {name!r}: the graph declares {list(dims)}, the source gives {list(want)}")
    if src.dtype != target.name and not (src.dtype in FLOAT_NAMES and target.name in FLOAT_NAMES):
        raise StreamError(f"parameter {name!r}: cannot convert {src.dtype} to {target.name}")
    if src.array is None:
        expected = int(np.prod(src.shape, dtype=np.int64)) * numpy_dtype(src.dtype).itemsize
        if src.length != expected:
            raise StreamError(f"parameter {name!r}: {src.length} bytes in {src.path}, {expected} expected")


def _write_one(fd: int, offset: int, src: Source, target: np.dtype, flip: bool, chunk_bytes: int) -> None:
    if src.parts:
        _write_parts(fd, offset, src, target, flip, chunk_bytes)
        return
    if src.array is not None:  # small (inline or folded): converted whole
        _pwrite_all(fd, _bytes_of(_materialized(src, target, flip)), offset)
        return
    if src.length == 0:
        return
    source_dtype = numpy_dtype(src.dtype)
    with open(src.path, "rb", buffering=0) as f:
        if not flip and source_dtype == target:
            _copy_range(f.fileno(), src.offset, fd, offset, src.length, chunk_bytes)
        elif not flip:
            per = max(1, chunk_bytes // source_dtype.itemsize)
            count = src.length // source_dtype.itemsize
            for start in range(0, count, per):
                n = min(per, count - start)
                block = _read(f.fileno(), src.offset + start * source_dtype.itemsize, n, source_dtype)
                _pwrite_all(fd, _bytes_of(_cast(block, target)), offset + start * target.itemsize)
        else:
            _write_transposed(f.fileno(), src, source_dtype, fd, offset, target, chunk_bytes)


def _write_parts(fd: int, offset: int, src: Source, target: np.dtype, flip: bool, chunk_bytes: int) -> None:
    """A concatenated source. Where the target holds its parts one after the other (joined along the first
    axis, or a 2-D one along the second and transposed: merged gate/up as a Linear weight), each part is
    written as a source of its own; otherwise the whole weight is made in memory (one weight: bounded)."""
    if (src.axis % len(src.shape) == 0 and not flip) or (flip and len(src.shape) == 2 and src.axis % 2 == 1):
        for part in src.parts:
            _write_one(fd, offset, part, target, flip, chunk_bytes)
            offset += int(np.prod(part.shape, dtype=np.int64)) * target.itemsize
        return
    _pwrite_all(fd, _bytes_of(_materialized(src, target, flip)), offset)


def _write_transposed(src_fd: int, src: Source, source_dtype: np.dtype, fd: int, offset: int,
                      target: np.dtype, chunk_bytes: int) -> None:
    """Source [rows, cols] -> target [cols, rows], at most chunk_bytes of the source in memory at a time.
    Whichever way makes the larger pieces (chunk_bytes / min(rows, cols) bytes each): strips of whole source
    columns (one read per row, one contiguous write) when rows <= cols, else blocks of whole source rows (one
    contiguous read, one write per target row)."""
    rows, cols = src.shape
    sz, tz = source_dtype.itemsize, target.itemsize
    if rows <= cols:
        per = max(1, min(cols, chunk_bytes // max(1, rows * sz)))
        for c0 in range(0, cols, per):
            k = min(per, cols - c0)
            strip = np.empty((rows, k * sz), np.uint8)
            for r in range(rows):
                _read_into(src_fd, strip[r], src.offset + (r * cols + c0) * sz)
            flipped = _transpose(_cast(strip.view(source_dtype), target))  # [k, rows]: target rows c0..c0+k
            del strip
            _pwrite_all(fd, _bytes_of(flipped), offset + c0 * rows * tz)
        return
    per = max(1, chunk_bytes // max(1, cols * sz))
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        block = _read(src_fd, src.offset + r0 * cols * sz, n * cols, source_dtype)
        flipped = _transpose(_cast(block.reshape(n, cols), target))  # [cols, n]: a segment of every target row
        del block
        raw = memoryview(_bytes_of(flipped))
        seg = n * tz
        for c in range(cols):
            _pwrite_all(fd, raw[c * seg:(c + 1) * seg], offset + (c * rows + r0) * tz)


def _transpose(block: np.ndarray) -> np.ndarray:
    """block.T in C order (a fresh array)."""
    out = np.empty(block.shape[::-1], block.dtype)
    _transpose_tiles(block, out)
    return out


def _transpose_tiles(block: np.ndarray, out: np.ndarray) -> None:
    """out[...] = block.T, copied in 128 x 128 tiles (numpy's strided .T copy of a large block is ~3x slower;
    opmap/helpers._param does the same)."""
    for i in range(0, block.shape[0], 128):
        for j in range(0, block.shape[1], 128):
            out[j:j + 128, i:i + 128] = block[i:i + 128, j:j + 128].T


def _read(fd: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    buf = np.empty(count * dtype.itemsize, np.uint8)
    _read_into(fd, buf, offset)
    return buf.view(dtype)


def _read_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill the contiguous uint8 array `buf` from `offset` of fd."""
    view, done = memoryview(buf), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise StreamError(f"unexpected end of a weights file at offset {offset + done}")
        done += got


def _bytes_of(arr: np.ndarray):
    # bfloat16 arrays do not export a buffer of their own: view the bytes
    return memoryview(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))


def _pwrite_all(fd: int, data, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def drop_written(fd: int) -> None:
    """Ask the kernel to write the file's dirty pages out now and to drop those already written from the page
    cache (posix_fadvise DONTNEED over the whole file), as the compile_scale floor does. Measured on this
    machine (ext4, 24 GiB): 25 pwrites of 176 MiB into one file took 8.2-12.7 s of kernel time without it and
    1.7-2.5 s with it, called after each write; called on each written range alone it saved nothing."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:  # a hint only
            pass


def _copy_range(src_fd: int, src_offset: int, fd: int, offset: int, length: int, chunk_bytes: int) -> None:
    """`length` bytes from src_fd to fd: in the kernel when it can (os.copy_file_range), else through a buffer."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < length:
                n = os.copy_file_range(src_fd, fd, min(chunk_bytes, length - done), src_offset + done, offset + done)
                if n == 0:
                    raise StreamError(f"unexpected end of a weights file at offset {src_offset + done}")
                done += n
            return
        except OSError:  # another filesystem or kernel that refuses: fall back to reading
            pass
    while done < length:
        n = min(chunk_bytes, length - done)
        _pwrite_all(fd, _read(src_fd, src_offset + done, n, np.dtype(np.uint8)), offset + done)
        done += n


# --- both -------------------------------------------------------------------------------------------------


CKPT_SLICE_BYTES = 512 * 1024 * 1024  # mindspore.train.serialization SLICE_SIZE (KiB) * 1024
_CKPT_TYPES = {"float16": "Float16", "bfloat16": "BFloat16", "float32": "Float32", "float64": "Float64",
               "int8": "Int8", "uint8": "UInt8", "int16": "Int16", "uint16": "UInt16", "int32": "Int32",
               "uint32": "UInt32", "int64": "Int64", "uint64": "UInt64", "bool": "Bool"}


def _numpy_name(ms_dtype) -> str:
    """A MindSpore dtype's numpy name (Float32 -> float32, BFloat16 -> bfloat16, Bool -> bool)."""
    by_ms = {v: k for k, v in _CKPT_TYPES.items()}
    return by_ms.get(str(ms_dtype), str(ms_dtype).lower())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _ckpt_slice_header(name: str, dims: tuple, tensor_type: str, content_bytes: int) -> bytes:
    """The bytes of one serialized Checkpoint{value: [Value{tag, tensor}]} up to (not including) the
    tensor_content's `content_bytes` bytes, the last field of each message (the module docstring)."""
    tensor_head = b"".join(_varint(1 << 3 | 0) + _varint(int(d)) for d in dims)
    tensor_head += _field(2, tensor_type.encode()) + _varint(3 << 3 | 2) + _varint(content_bytes)
    tensor_len = len(tensor_head) + content_bytes
    value_head = _field(1, name.encode()) + _varint(2 << 3 | 2) + _varint(tensor_len) + tensor_head
    return _varint(1 << 3 | 2) + _varint(len(value_head) + content_bytes) + value_head


def write_checkpoint(path: str | Path, parameters: list[tuple[str, str, tuple]], weights: "WeightsFile",
                     transposed: dict[str, bool]) -> Path:
    """`path` as mindspore.save_checkpoint writes the network's Parameters (`parameters`: name, numpy dtype,
    shape, in the network's order), each one's bytes copied from the finished MindIR data file `weights`
    (in the kernel, like a plain weight copy); a Parameter the graph does not hold (an unused one) is
    converted from its source in memory. Written to a .partial file, then renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    data = weights.folder / "data_0"
    with open(data, "rb", buffering=0) as src, open(tmp, "wb", buffering=0) as out:
        pos = 0
        for name, dtype, shape in parameters:
            tensor_type = _CKPT_TYPES.get(dtype)
            if tensor_type is None:
                raise StreamError(f"parameter {name!r}: a checkpoint of dtype {dtype} is not written")
            entry = weights.entries.get(name)
            if entry is not None and (entry[2].name != dtype or entry[4] != tuple(shape)):
                raise StreamError(f"parameter {name!r}: the MindIR holds {entry[2].name}{list(entry[4])}, the "
                                  f"network {dtype}{list(shape)}")
            raw = None if entry is not None else memoryview(_bytes_of(
                _materialized(weights.sources[name], numpy_dtype(dtype), bool(transposed.get(name)))))
            length = entry[1] if raw is None else len(raw)
            for start in range(0, length, CKPT_SLICE_BYTES):
                n = min(CKPT_SLICE_BYTES, length - start)
                header = _ckpt_slice_header(name, shape, tensor_type, n)
                _pwrite_all(out.fileno(), header, pos)
                pos += len(header)
                if raw is None:
                    _copy_range(src.fileno(), entry[0] + start, out.fileno(), pos, n, CHUNK_BYTES)
                else:
                    _pwrite_all(out.fileno(), raw[start:start + n], pos)
                pos += n
        out.truncate(pos)
    os.replace(tmp, path)
    return path


def _materialized(src: Source, target: np.dtype, flip: bool) -> np.ndarray:
    """A Parameter's whole array from its source, cast and transposed as the graph stores it (_write_one
    converts small sources so, large ones chunk by chunk)."""
    arr = _cast(src.read(), target)
    return np.ascontiguousarray(arr.T if flip else arr)


class Writer:
    """A split MindIR being written: the graph of `net` (built on LazyWeights) exported at once, its weights
    file laid out (`weights`: whoever holds a weight's final bytes may `put` it), the rest written and the
    graph saved by `finish`, named as mindspore.export names them: `<file_base>_graph.mindir` and
    `<file_base>_variables/data_0`."""

    def __init__(self, net, inputs, file_base: str | Path, sources: dict[str, Source],
                 transposed: dict[str, bool] | None = None, chunk_bytes: int | None = None, progress=None):
        import time

        self.base = Path(file_base)
        # every Parameter in the order mindspore.save_checkpoint writes them: name, numpy dtype, shape
        self.parameters = [(q.name, _numpy_name(q.dtype), tuple(int(d) for d in q.shape)) for q in net.get_parameters()]
        self.transposed = transposed or {}
        t0 = time.perf_counter()
        self.model = export_graph(net, *inputs, file_name=str(self.base))
        self.graph_seconds = round(time.perf_counter() - t0, 2)
        self.weights = WeightsFile(self.model, self.base.parent, self.base.name, sources, transposed, chunk_bytes,
                                   progress)

    def finish(self, checkpoint: str | Path | None = None) -> list[Path]:
        """The weights not put written from their sources, then the graph (last: a graph file on disk means
        its weights are complete), and `checkpoint` if asked (write_checkpoint). Returns the MindIR's paths."""
        folder = self.weights.finish()
        if checkpoint:
            write_checkpoint(checkpoint, self.parameters, self.weights, self.transposed)
        graph = self.base.with_name(self.base.name + "_graph.mindir")
        tmp = graph.with_name(graph.name + ".partial")
        tmp.write_bytes(self.model.SerializeToString())
        os.replace(tmp, graph)
        return [graph, folder]


def write(net, inputs, file_base: str | Path, sources: dict[str, Source], transposed: dict[str, bool] | None = None,
          chunk_bytes: int | None = None, progress=None, timings: dict | None = None) -> list[Path]:
    """The split MindIR of `net` (built on LazyWeights) at `file_base` (Writer), every weight copied from
    `sources`. Returns both paths; `timings`, if given, receives graph_seconds (MindSpore's compile and export
    of the graph) and weights_seconds."""
    import time

    writer = Writer(net, inputs, file_base, sources, transposed, chunk_bytes, progress)
    t1 = time.perf_counter()
    files = writer.finish()
    if timings is not None:
        timings.update(graph_seconds=writer.graph_seconds, weights_seconds=round(time.perf_counter() - t1, 2))
    return files
