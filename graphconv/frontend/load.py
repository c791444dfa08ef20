"""Load stage: read an ONNX file safely, check it, infer shapes.

Refuses, with one line each: a missing or empty file, bytes that are not an ONNX model, external data whose
location is absolute or leaves the model's folder (or is missing or shorter than declared), and opsets
outside the supported range. Models with external data are checked without their weights and never loaded
whole: their weights stay in their files (graphconv.frontend.weights), so a 30 GB model costs load what a 10 MB
one does.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

from graphconv.frontend import contrib, weight_only_qdq, weights
from graphconv.frontend.contained import inside
from graphconv.frontend.contrib import cases
from graphconv.frontend.contrib import quant
from graphconv.dtypes import PRECISION_OF_TYPE
from graphconv.errors import InputError, UnsupportedError, first_line
from graphconv.onnx_domains import default_opset  # (load.default_opset is API)

MIN_OPSET = 13
MAX_OPSET = 28  # the newest opset onnx 1.23 defines (onnx.defs.onnx_opset_version())
UPGRADE_FROM = 7  # opsets 7-12 are upgraded to MIN_OPSET on load


@dataclasses.dataclass(frozen=True)
class ContribNote:
    """What loading did to a model with onnxruntime contrib ops, and what the oracle runs instead of it."""

    ops: tuple[str, ...]  # the contrib ops, as contrib.label spells them
    checker: str  # what onnx.checker says of the model as given
    approximated: bool  # an onnxruntime kernel approximates an op: the next warning says what the oracle runs
    oracle: str = "the oracle, onnxruntime, runs the model as given"

    def text(self) -> str:
        return (f"onnxruntime contrib op(s) {', '.join(self.ops)} ({self.checker}): decomposed into standard ONNX "
                f"on load; {self.oracle}" + (" (but for what the next warning says)" if self.approximated else ""))


@dataclasses.dataclass
class LoadedModel:
    path: Path
    # shapes inferred; inline weights loaded, external ones referenced by absolute path (graphconv.frontend.weights)
    proto: onnx.ModelProto
    external_bytes: int  # bytes of weights stored as external data
    # the model as given (the oracle runs it) when `proto` differs: below MIN_OPSET its upgrade (from opset
    # `upgraded_from`), with onnxruntime contrib ops their decomposition (graphconv.frontend.contrib)
    as_given: onnx.ModelProto | None = None
    upgraded_from: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)  # what loading did to the model, for the report
    decomposed: dict[str, int] = dataclasses.field(default_factory=dict)  # onnxruntime contrib op -> nodes
    # the reference cases' constraints from contrib kernels (graphconv.frontend.contrib.cases)
    case_dims: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    pad_masks: bool = True
    # Quantized ops whose onnxruntime kernels approximate their semantics (MatMulNBits at accuracy_level > 0,
    # DynamicQuantizeLSTM): `as_given` is then a copy computing what the network computes (the oracle's) and
    # this the model exactly as given, whose difference from the oracle the report states under each key of
    # `approximations`, which says what the oracle runs instead (graphconv.frontend.contrib.oracle_semantics)
    as_shipped: onnx.ModelProto | None = None
    approximations: dict[str, str] = dataclasses.field(default_factory=dict)
    quantized_weights: dict[str, str] = dataclasses.field(default_factory=dict)  # weight -> what is done with it
    packed: list[str] = dataclasses.field(default_factory=list)  # packed quantized initializers, kept packed
    contrib: ContribNote | None = None  # set where the model has onnxruntime contrib ops

    def warnings(self) -> list[str]:
        """What loading did, for the report's warnings: the notes, then the contrib ops' note."""
        return [*self.notes, *([self.contrib.text()] if self.contrib is not None else [])]

    @property
    def opset(self) -> int:
        return default_opset(self.proto)


def read_proto(path: Path) -> onnx.ModelProto:
    """Parse the file without its external data; every failure becomes one InputError line."""
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a file")
    size = path.stat().st_size
    if size == 0:
        raise InputError(f"{path}: empty file, not an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not an ONNX model, or truncated ({type(e).__name__}: {str(e)[:120]})") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.output:
        raise InputError(f"{path}: not an ONNX model (no IR version, graph or graph outputs)")
    return model


def check_external_data(model: onnx.ModelProto, base_dir: Path, source: Path | None = None) -> int:
    """Validate every external-data reference before anything reads it: each location stays in the model's
    folder (graphconv.frontend.contained; `source`, the model file, names it in the refusal) and its file
    holds the bytes declared. Returns the total bytes referenced."""
    total = 0
    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        loc = info.location
        if not loc:
            raise InputError(f"tensor {tensor.name!r}: external data without a location")
        target = inside(base_dir, loc, source or base_dir, f"tensor {tensor.name!r}: external data location")
        if tensor.data_type == onnx.TensorProto.UNDEFINED:  # (no size to read: refused before the weights' reader)
            raise InputError(f"tensor {tensor.name!r}: external data of an undefined element type")
        if not target.is_file():
            raise InputError(f"tensor {tensor.name!r}: external data file {loc!r} is missing")
        offset = info.offset or 0
        length = info.length
        if length is None:
            dims = 1
            for d in tensor.dims:
                dims *= d
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            length = dims * itemsize
        if offset + length > target.stat().st_size:
            raise InputError(f"tensor {tensor.name!r}: external data file {loc!r} is shorter than declared "
                             f"({target.stat().st_size} bytes, needs {offset + length})")
        total += length
    return total


_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
# Undefined, strings, and sub-byte types packed several to a byte: their sizes are not checked here.
_UNCHECKED_TYPES = {0, onnx.TensorProto.STRING, onnx.TensorProto.INT4, onnx.TensorProto.UINT4,
                    getattr(onnx.TensorProto, "FLOAT4E2M1", -1), getattr(onnx.TensorProto, "INT2", -1),
                    getattr(onnx.TensorProto, "UINT2", -1)}


def check_inline_tensors(model: onnx.ModelProto) -> None:
    """Every inline tensor holds as much data as its dims declare (a hostile file can declare 10^12 elements
    in a few bytes; converting it would try to allocate terabytes)."""
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            continue
        count = 1
        for d in tensor.dims:
            if d < 0:
                raise InputError(f"tensor {tensor.name!r} declares a negative dim {d}")
            count *= d
        if tensor.data_type in _UNCHECKED_TYPES:
            continue
        if tensor.raw_data:
            have = len(tensor.raw_data)
            need = count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        else:  # typed fields hold one entry per element (two for complex numbers)
            have = max(len(getattr(tensor, f)) for f in _TYPED_FIELDS)
            need = count * (2 if tensor.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1)
        if have != need:
            raise InputError(f"tensor {tensor.name!r} declares {count} elements but holds data for "
                             f"{'a different number' if have else 'none'}")


def check_names(model: onnx.ModelProto) -> None:
    """Every name is text: protobuf hands invalid UTF-8 in these fields back as bytes (or raises on access),
    which no later stage expects."""
    graph = model.graph
    where = []
    try:
        for n in graph.node:
            where.append(("node", [n.name, n.op_type, n.domain, *n.input, *n.output, *(a.name for a in n.attribute)]))
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            dims = [d.dim_param for d in vi.type.tensor_type.shape.dim] if vi.type.HasField("tensor_type") else []
            where.append(("value", [vi.name, *dims]))
        where.append(("initializer", [t.name for t in graph.initializer]))
        where.append(("opset import", [i.domain for i in model.opset_import]))
    except UnicodeDecodeError:
        raise InputError("invalid ONNX model: a name is not valid UTF-8") from None
    for kind, names in where:
        if any(isinstance(x, bytes) for x in names):
            raise InputError(f"invalid ONNX model: a {kind} name is not valid UTF-8")


def check_value_types(model: onnx.ModelProto) -> None:
    """Graph inputs, outputs and value infos name element types ONNX knows (the checker lets unknown
    numbers through, and every later stage would trip over them)."""
    known = set(onnx.TensorProto.DataType.values())
    graph = model.graph
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type not in known:
            raise InputError(f"value {vi.name!r} has the unknown element type {vi.type.tensor_type.elem_type}")
    for t in graph.initializer:
        if t.data_type not in known:
            raise InputError(f"tensor {t.name!r} has the unknown element type {t.data_type}")


def negative_dims_dynamic(model: onnx.ModelProto) -> list[str]:
    """Dims declared with a negative value (paddle2onnx and old exporters write -1 for "any size") made
    unnamed dynamic dims, as onnxruntime reads them; one note per value that had any."""
    notes = []
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if not vi.type.HasField("tensor_type"):
            continue
        axes = [k for k, d in enumerate(vi.type.tensor_type.shape.dim) if d.HasField("dim_value") and d.dim_value < 0]
        for k in axes:
            vi.type.tensor_type.shape.dim[k].ClearField("dim_value")
        if axes:
            notes.append(f"{vi.name!r} declares a negative dim at axis {', '.join(map(str, axes))}: read as a "
                         "dynamic dim")
    return notes


def zero_sized_inputs(model: onnx.ModelProto) -> str | None:
    """The first graph input that declares a dim of size 0, described, or None. Many MindSpore kernels run
    zero-sized tensors (onnx's empty-set reductions verify), some refuse them (PadV3: "the output size must be
    greater than 0", Conv2d's kernel-size check): MindSpore refusing such a network is then the input's fault
    (graphconv.pipeline: exit 1 with this reason), not graphconv's."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        for axis, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value == 0:
                shape = [x.dim_value if x.HasField("dim_value") else (x.dim_param or "?") for x in dims]
                return (f"graph input {vi.name!r} {shape} has a dim of size 0 (axis {axis}), and MindSpore does not "
                        "run zero-sized tensors in every kernel")
    return None


# A float value's type as generation.json and --dtype name it.
FLOAT_TYPE_NAMES = PRECISION_OF_TYPE


def value_dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    """A graph input's or output's dims: ints and symbol names ("" where the dim is unknown); a name that is a
    number (transformers' exporter writes fixed cache dims so) as that number."""
    return [d.dim_value if d.HasField("dim_value") else int(d.dim_param) if d.dim_param.isdigit() else d.dim_param
            for d in vi.type.tensor_type.shape.dim]


def check_opsets(model: onnx.ModelProto) -> None:
    """Opsets from 7 (older ones are upgraded to MIN_OPSET first, `upgrade`) up to MAX_OPSET."""
    opset = default_opset(model)
    if not UPGRADE_FROM <= opset <= MAX_OPSET:
        raise UnsupportedError(f"opset {opset} is outside the supported range {UPGRADE_FROM}-{MAX_OPSET} "
                               f"(below {MIN_OPSET}: upgraded with onnx.version_converter)")


def upgrade(model: onnx.ModelProto) -> onnx.ModelProto:
    """A model below MIN_OPSET upgraded to it with onnx.version_converter; others unchanged (the lowering's op
    mappings are written from opset 13 on; the model as given stays the oracle's, so a converter bug is seen)."""
    opset = default_opset(model)
    if opset is None or opset >= MIN_OPSET:
        return model
    if opset < 9 and any(n.op_type == "Scan" for n in model.graph.node):
        raise UnsupportedError(f"Scan at opset {opset} (with a batch axis and sequence_lens) is not supported: "
                               "onnx.version_converter's Scan 8 -> 9 adapter does not remove the batch axis")
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors from C++
        raise UnsupportedError(f"opset {opset} is below {MIN_OPSET} and onnx.version_converter cannot upgrade "
                               f"this model: {first_line(e, 200)}") from None


def name_nodes(model: onnx.ModelProto) -> None:
    """Give unnamed nodes the stable name `<op>_<index>` (docs/design.md, contracts): every later stage,
    the report and `graphconv debug` then speak of the same nodes."""
    used = {n.name for n in model.graph.node if n.name}
    for k, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{k}"
            while name in used:
                name += "_"
            node.name = name
            used.add(name)


def load(path: str | os.PathLike, spill: weights.SpillFile | None = None) -> LoadedModel:
    """Read, check and shape-infer. Checks and inference run on the proto without its weights (external
    tensors keep their dims), so they cost the same for a 10 MB and a 30 GB model. `spill` (a file in the
    compile's private directory): where quantized weights in external files go once re-laid for a low-bit
    primitive; without it such weights are dequantized in the network."""
    path = Path(path)
    model = read_proto(path)
    external = check_external_data(model, path.parent, path)
    check_names(model)
    check_value_types(model)
    check_inline_tensors(model)
    check_opsets(model)
    as_given, upgraded_from, notes, decomposed, case_dims, pad_masks = None, None, [], {}, {}, True
    as_shipped, approximations, quantized, packed, contrib_note = None, {}, {}, [], None
    notes.extend(negative_dims_dynamic(model))
    found = contrib.contrib_nodes(model)
    if found:
        # onnxruntime's contrib ops: the checker's complaint about them is a note, the model to compile is
        # their standard decomposition (checked in full), the oracle runs the model as given.
        if external:
            weights.take_over_external(model, path.parent)
        name_nodes(model)
        as_given = model
        # Quantized contrib ops: the oracle runs what the network computes where onnxruntime's kernel
        # approximates the op, and the report says what happens to each quantized weight.
        exact, approximations = contrib.oracle_semantics(model)
        contrib_note = _contrib_note(model, found, bool(approximations))
        if exact is not None:
            as_shipped, as_given = model, exact
        quantized, packed = quant.describe_quantized_weights(model), quant.packed_initializers(model)
        model, decomposed = contrib.decompose(model, spill=spill if external else None)
        packed = sorted({*packed, *quant.weight_quant_weights(model)})
        case_dims, pad_masks = cases.case_dims(as_given), cases.pads_masks(as_given)
        _check(weights.stripped(model)[0], path)
    else:
        if external:
            # The weights stay in their files, referenced by absolute path; small tensors (shape constants)
            # are read in so that shape inference sees their values (graphconv.frontend.weights).
            weights.take_over_external(model, path.parent)
        bare = weights.stripped(model)[0]
        # The checker on the model with its external weights as graph inputs (check_external_data checked
        # their files): by path it would refuse a data file that is a symlink, as a Hugging Face cache's are,
        # which graphconv.frontend.contained accepts inside the folder. External tensors elsewhere (a
        # subgraph's) keep the check by path, which resolves their files relative to the model.
        nested = any(uses_external_data(t) for t in _get_all_tensors(bare))
        _check(str(path) if nested else bare, path)
    # Weight-only QDQ MatMuls as WeightQuantBatchMatmul (graphconv.frontend.weight_only_qdq): the oracle runs
    # the model as given, the re-laid weights are held out of onnxsim like MatMulNBits' ones.
    fused, qdq_weights, written = weight_only_qdq.fuse(model, spill if external else None)
    quantized = {**quantized, **qdq_weights}
    if written:
        as_given = as_given or model
        packed = sorted({*packed, *quant.weight_quant_weights(fused)})
    model = fused
    if external:
        external = sum(r.length for r in weights.external_refs(model).values())
    if default_opset(model) < MIN_OPSET:
        if external:
            raise UnsupportedError(f"opset {default_opset(model)} with external data: upgrade it to opset "
                                   f"{MIN_OPSET} first (onnx.version_converter)")
        name_nodes(model)
        as_given, upgraded_from = as_given or model, default_opset(model)
        model = upgrade(model)
    model = infer_shapes(model, path, notes)
    name_nodes(model)
    return LoadedModel(path=path, proto=model, external_bytes=external, as_given=as_given,
                       upgraded_from=upgraded_from, notes=notes, decomposed=decomposed,
                       case_dims=case_dims, pad_masks=pad_masks, as_shipped=as_shipped,
                       approximations=approximations, quantized_weights=quantized, packed=packed,
                       contrib=contrib_note)


_NODE_NAME = re.compile(r"node name: (.*?)\): \[")
_CONTRADICTION = re.compile(r"\(op_type:[^)]*\): \[\w+\] Inferred (shape and existing shape|elem type differs)[^\n]*")


def infer_shapes(model: onnx.ModelProto, path: Path, notes: list[str] | None = None) -> onnx.ModelProto:
    """ONNX shape inference. Later stages trust declared shapes, so a declared type that contradicts what a
    node computes is not kept: strict inference finds those. An intermediate value's declared shape is a hint
    (onnxruntime overrides it too; onnxruntime-genai's builder writes some that contradict): it is dropped,
    with a note. A contradicting element type, or a graph input's or output's declared shape, is refused. Where strict
    inference fails for another reason (an op it cannot infer), the lenient one runs as before."""
    _drop_value_info_contradicting_initializers(model, notes)
    for _ in range(len(model.graph.value_info) + 1):
        try:
            return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
        except (onnx.shape_inference.InferenceError, RuntimeError) as e:
            found = _CONTRADICTION.search(str(e))
            if not found:
                break
            what = found.group(0)
            if "elem type" in what:  # onnx writes the element types as numbers: (16) vs (7)
                what = re.sub(r"\((\d+)\)", lambda m: f"({_type_name(int(m.group(1)))})", what)
            named = _NODE_NAME.search(what)
            node = next((n for n in model.graph.node if named and n.name == named.group(1)), None)
            hints = [vi for vi in model.graph.value_info if node is not None and vi.name in node.output]
            if not hints or "elem type" in what:  # (a wrong dtype is a wrong model, not a stale hint)
                raise InputError(f"{path}: a declared type contradicts the graph: {what}") from None
            for vi in hints:
                model.graph.value_info.remove(vi)
            if notes is not None:
                notes.append(f"value_info of {', '.join(repr(vi.name) for vi in hints)} contradicts the graph "
                             f"({what}): ignored")
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, RuntimeError) as e:
        raise InputError(f"{path}: shape inference failed: {first_line(e)}") from None


def _drop_value_info_contradicting_initializers(model: onnx.ModelProto, notes: list[str] | None) -> None:
    """A value_info naming an initializer with other dims (transformers' exporter with ort_fusions declares its
    `unfused_attention_*_scale`, a [1] tensor, as a scalar): the initializer is the value, the hint goes, with a
    note (onnx's strict inference stops there without naming a node)."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    stale = []
    for vi in model.graph.value_info:
        tt = vi.type.tensor_type
        if vi.name in dims and vi.type.HasField("tensor_type") and tt.HasField("shape"):
            declared = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if len(declared) != len(dims[vi.name]) or any(d is not None and d != t for d, t in
                                                          zip(declared, dims[vi.name])):
                stale.append(vi)
    for vi in stale:
        model.graph.value_info.remove(vi)
        if notes is not None:
            notes.append(f"value_info of initializer {vi.name!r} contradicts its dims {dims[vi.name]}: ignored")


def _type_name(elem_type: int) -> str:
    known = onnx.TensorProto.DataType.values()
    return onnx.TensorProto.DataType.Name(elem_type) if elem_type in known else str(elem_type)


def _check(model: onnx.ModelProto | str, path: Path) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise InputError(f"{path}: invalid ONNX model: {first_line(e)}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: invalid ONNX model: a name or string is not valid UTF-8") from None


def _contrib_note(model: onnx.ModelProto, nodes: list[onnx.NodeProto], approximated: bool) -> ContribNote:
    """What onnx.checker says of the model as given (it does not know onnxruntime's contrib ops)."""
    ops = tuple(sorted({contrib.label(n) for n in nodes}))
    try:
        onnx.checker.check_model(weights.stripped(model)[0] if weights.external_refs(model) else model)
        complaint = "onnx.checker accepts it"
    except (onnx.checker.ValidationError, UnicodeDecodeError) as e:
        complaint = f"onnx.checker: {first_line(e)}"
    return ContribNote(ops, complaint, approximated)
