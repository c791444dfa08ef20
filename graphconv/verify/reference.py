"""Reference inputs and the oracle (docs/design.md, contracts).

Reference inputs: two cases, each giving every symbolic dim a concrete size that is unlikely to be the
export size; integer ids drawn below the size of the table they index; attention masks with one row
left-padded. The oracle is onnxruntime; where it cannot run the model, onnx.reference.ReferenceEvaluator,
and the caller records which one answered. onnxruntime runs the model with its integer products (MatMulInteger,
ConvInteger, the QLinear and com.microsoft integer matmuls) rewritten to exact int32 arithmetic
(`exact_integer_products`): its own u8s8 kernel saturates on x86 CPUs without VNNI.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import numpy as np
import onnx

from graphconv.frontend import weights
from graphconv.verify import dims, integer_products
from graphconv.errors import InputError, UnsupportedError, first_line

# Sizes per symbolic dim, two cases. Chosen to differ from typical export sizes (1, 2, 8, 16, 32...).
BATCH_SIZES = (3, 5)
SPATIAL_SIZES = (20, 28)
OTHER_SIZES = [(5, 11), (9, 6), (13, 4), (7, 10)]
# Tried in turn when onnxruntime refuses the sizes above (stride_overrides): detectors' and OCR models' strides,
# then 256 for audio models whose frames must exceed a window (silero-vad's reflect pad of 64 samples).
STRIDES = (32, 64, 256)
_BATCH_RE = dims.BATCH
_SPATIAL_RE = re.compile(r"height|width|^h$|^w$", re.I)
_MASK_RE = re.compile(r"mask", re.I)
DEFAULT_INT_HIGH = 8


@dataclasses.dataclass
class InputSpec:
    name: str
    dtype: np.dtype
    shape: list  # int for fixed dims, str for symbolic ones, None for unnamed dynamic ones
    elem_type: int

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype), "shape": self.shape}


@dataclasses.dataclass
class ReferenceCase:
    name: str
    inputs: dict[str, np.ndarray]
    mask: np.ndarray | None = None  # (B, S) 0/1 attention mask, used to skip padded output positions

    def shape_text(self, most: int = 4) -> str:
        """`input_ids[3, 5] attention_mask[3, 5] …`: the first `most` inputs' shapes, then how many more (a
        decoder's 64 cache inputs would make one error line thousands of characters long)."""
        items = [f"{k}{list(v.shape)}" for k, v in self.inputs.items()]
        more = f" and {len(items) - most} more inputs" if len(items) > most else ""
        return " ".join(items[:most]) + more

    def valid_positions(self, output: np.ndarray) -> np.ndarray | None:
        """Boolean mask over the leading dims of `output` when they are the attention mask's dims."""
        if self.mask is None or output.ndim < self.mask.ndim:
            return None
        if tuple(output.shape[: self.mask.ndim]) != tuple(self.mask.shape):
            return None
        return self.mask.astype(bool)


def typed(array: np.ndarray) -> np.ndarray:
    """An array read from an .npz: np.savez stores bfloat16 (ml_dtypes) as 2-byte void, viewed back here."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return array.view(weights.np_dtype(onnx.TensorProto.BFLOAT16))
    return array


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise UnsupportedError(f"graph input {vi.name!r} is not a tensor")
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.dim_param:
                shape.append(d.dim_param)
            else:
                shape.append(None)
        specs.append(InputSpec(vi.name, weights.np_dtype(tt.elem_type), shape, tt.elem_type))
    return specs


def output_specs(model: onnx.ModelProto) -> list[dict]:
    out = []
    for vi in model.graph.output:
        tt = vi.type.tensor_type
        shape = [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        dtype = str(weights.np_dtype(tt.elem_type)) if tt.elem_type else "?"
        out.append({"name": vi.name, "dtype": dtype, "shape": shape})
    return out


# onnxruntime's EmbedLayerNormalization (transformers optimizer): (index input, table input) pairs.
_EMBED_INDICES = ((0, 2), (1, 4), (8, 3))


def _index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For graph inputs used as Gather indices into a constant table (directly or through a Cast, also as
    onnxruntime's EmbedLayerNormalization ids): the table's size on that axis."""
    sizes = {t.name: list(t.dims) for t in model.graph.initializer}
    source = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    bounds: dict[str, int] = {}

    def bound(index: str, table: str, axis: int) -> None:
        index = source.get(index, index)
        rank = len(sizes.get(table) or ())
        if index and rank and -rank <= axis < rank:  # an axis out of range is the oracle's to refuse
            b = sizes[table][axis]
            bounds[index] = min(bounds.get(index, b), b)

    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2:
            bound(node.input[1], node.input[0], next((a.i for a in node.attribute if a.name == "axis"), 0))
        elif node.op_type == "EmbedLayerNormalization" and node.domain == "com.microsoft":
            for i, t in _EMBED_INDICES:
                if i < len(node.input) and t < len(node.input):
                    bound(node.input[i], node.input[t], 0)
    return bounds


def is_mask_input(spec: InputSpec, mask_inputs: tuple[str, ...] = ()) -> bool:
    if spec.name in mask_inputs:
        return True
    return bool(_MASK_RE.search(spec.name)) and spec.dtype.kind in "biu"


def _dim_name(spec: InputSpec, axis: int, d) -> str:
    return d if d is not None else f"{spec.name}:{axis}"  # unnamed dims get a name of their own


def _unnamed_batch(spec: InputSpec, axis: int) -> bool:
    """An unnamed dim that is a batch: at axis 0, or the one dynamic dim of a [static, ?, static] input (the
    layout of an RNN's state: layers x directions, batch, hidden; silero-vad's `state` is [2, ?, 128])."""
    if spec.shape[axis] is not None:
        return False
    return axis == 0 or (len(spec.shape) == 3 and axis == 1 and all(isinstance(spec.shape[k], int) for k in (0, 2)))


def _free_dims(specs: list[InputSpec], model: onnx.ModelProto | None) -> tuple[list[str], dict, set[str]]:
    """The symbolic dims whose sizes are chosen (the others derived from them), the derived ones' expressions,
    and the unnamed dims that are batches (_unnamed_batch)."""
    names: list[str] = []
    unnamed_batches: set[str] = set()
    for spec in specs:
        for axis, d in enumerate(spec.shape):
            if not isinstance(d, int) and _dim_name(spec, axis, d) not in names:
                names.append(_dim_name(spec, axis, d))
                if _unnamed_batch(spec, axis):
                    unnamed_batches.add(names[-1])
    derived = dims.relations(names, model)
    free = [n for n in names if n not in derived]
    free += sorted({s for tree in derived.values() for s in dims.symbols(tree)} - set(free))
    return free, derived, unnamed_batches


def stride_overrides(model: onnx.ModelProto, stride: int, given: dict | None = None) -> dict[str, tuple[int, int]]:
    """Sizes `stride` and 2 x `stride` for every free dim that is neither batch-like nor given (`--dim`): the
    retry for a model whose inputs must be multiples of a stride (a detector's downsampling, an OCR model's
    width), which the usual sizes (20 and 28, 5 and 11...) are not."""
    specs = input_specs(model)
    free, _, unnamed_batches = _free_dims(specs, model)
    return {name: (stride, 2 * stride) for name in free
            if name not in (given or {}) and not _BATCH_RE.search(name) and name not in unnamed_batches}


def dim_sizes(specs: list[InputSpec], overrides: dict[str, tuple[int, int]] | None = None,
              model: onnx.ModelProto | None = None, preferred: dict[str, tuple[int, int]] | None = None) -> dict:
    """Two concrete sizes for every symbolic dim name. Dims related to others (graphconv/verify/dims.py:
    written as `past + 1`, or implied by `model`'s graph) are derived from the free ones. `overrides` are the
    user's --dim (an error where they name no free dim); `preferred` sizes (what a kernel accepts,
    graphconv.frontend.contrib.cases) apply to the free dims they name, the user's winning."""
    overrides = overrides or {}
    free, derived, unnamed_batches = _free_dims(specs, model)
    fixed = sorted(set(overrides) & set(derived))
    if fixed:
        raise InputError(f"--dim {fixed[0]}: that dim is {ast.unparse(derived[fixed[0]])}; give sizes for "
                         f"{', '.join(sorted(dims.symbols(derived[fixed[0]])))} instead")
    unknown = set(overrides) - set(free)
    if unknown:
        raise InputError(f"--dim names {sorted(unknown)} are not symbolic dims of the model "
                         f"(it has {sorted(free) or 'none'})")
    sizes: dict[str, tuple[int, int]] = {}
    others = iter(OTHER_SIZES * 4)
    preferred = preferred or {}
    for name in free:
        if name in overrides:
            sizes[name] = tuple(overrides[name])
        elif name in preferred:
            sizes[name] = tuple(preferred[name])
        elif _BATCH_RE.search(name) or name in unnamed_batches:
            sizes[name] = BATCH_SIZES
        elif _SPATIAL_RE.search(name):
            sizes[name] = SPATIAL_SIZES
        else:
            sizes[name] = next(others)
    return dims.solve(sizes, derived)


def dims_text(model: onnx.ModelProto, case: ReferenceCase) -> str:
    """`seq = 5, past = 9` for the symbolic dims of `model`'s inputs in `case`."""
    found: dict[str, int] = {}
    for spec in input_specs(model):
        for ax, d in enumerate(spec.shape):
            if not isinstance(d, int) and spec.name in case.inputs:
                found.setdefault(_dim_name(spec, ax, d), case.inputs[spec.name].shape[ax])
    return ", ".join(f"{k} = {v}" for k, v in found.items())


# What one reference case may need: the inputs together, and any one tensor the graph computes (inferred
# shapes at the case's sizes). Past these, the run would exhaust a CPU host's memory (or the OOM killer would
# end it, and maybe other work with it): refused before anything is allocated.
MAX_CASE_INPUT_BYTES = 1 << 30
MAX_TENSOR_BYTES = 4 << 30


def _human_bytes(n: int) -> str:
    for suffix, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {suffix}"
    return f"{n} B"


def _itemsize(elem_type: int) -> int:
    try:
        return weights.np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 1


def _case_dim(d, sizes: dict[str, int]) -> int:
    """A value_info dim at one case's sizes: its value, the case's size of that symbolic dim (or of that
    expression of them), else 1 (unknown: the estimate stays a lower bound)."""
    if d.HasField("dim_value"):
        return max(int(d.dim_value), 0)
    if d.dim_param in sizes:
        return sizes[d.dim_param]
    tree = dims.parse(d.dim_param) if d.dim_param else None
    if tree is not None and dims.symbols(tree) <= set(sizes):
        try:
            return max(dims.evaluate(tree, sizes), 1)
        except ZeroDivisionError:
            return 1
    return 1


def check_memory(model: onnx.ModelProto, specs: list[InputSpec], sizes: dict[str, int]) -> None:
    """Refuse a case that would not fit in memory, naming what would need how much: the graph inputs of one
    case together, and every tensor the graph computes whose shape inference knows (at the case's sizes)."""
    total, parts = 0, []
    for spec in specs:
        shape = [d if isinstance(d, int) else sizes[_dim_name(spec, ax, d)] for ax, d in enumerate(spec.shape)]
        n = int(np.prod(shape, dtype=object)) * spec.dtype.itemsize
        total += n
        parts.append(f"{spec.name} {shape} {spec.dtype}")
    if total > MAX_CASE_INPUT_BYTES:
        raise UnsupportedError(f"the reference inputs ({', '.join(parts)}) would need {_human_bytes(total)}, more "
                               f"than the {_human_bytes(MAX_CASE_INPUT_BYTES)} graphconv allocates for one "
                               "verification case: give smaller sizes (--inputs) or a model without such dims")
    for vi in list(model.graph.value_info) + list(model.graph.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        shape = [_case_dim(d, sizes) for d in tt.shape.dim]
        n = int(np.prod(shape, dtype=object)) * _itemsize(tt.elem_type)
        if n > MAX_TENSOR_BYTES:
            raise UnsupportedError(f"value {vi.name!r} would be {shape} {_np_dtype_name(tt.elem_type)}, "
                                   f"{_human_bytes(n)}, at the reference inputs' sizes (more than the "
                                   f"{_human_bytes(MAX_TENSOR_BYTES)} graphconv allows one tensor of a "
                                   "verification run)")


def _np_dtype_name(elem_type: int) -> str:
    try:
        return str(weights.np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else "?"


_WINDOWED = ("Conv", "MaxPool", "AveragePool", "LpPool")


def window_too_large(model: onnx.ModelProto, case: "ReferenceCase", observe=None) -> tuple[str, str | None] | None:
    """The first windowed node (Conv, pooling) whose window, at `case`'s input sizes, is larger than its padded
    input (shape inference on the model with those sizes fixed), as (`node (window 32 over 5)`, the input dim it
    most likely runs along); else None. ONNX's
    own inference and onnxruntime still give such a node an output of 1 (their division truncates toward zero)
    where MindSpore refuses an output of 0: sizes the model is not meant for, which the generator avoids. Where
    inference cannot size a window's input (after a Reshape to a computed shape), `observe(names)` -> {name:
    shape} gives the sizes a run of the case had (graphconv/verify/observed_ranks.py), if given."""
    if not any(n.op_type in _WINDOWED for n in model.graph.node):
        return None
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    del fixed.graph.value_info[:]
    for vi in fixed.graph.input:
        if vi.name in case.inputs and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape.dim
            for d, size in zip(dims, case.inputs[vi.name].shape):
                d.Clear()
                d.dim_value = int(size)
    try:
        inferred = onnx.shape_inference.infer_shapes(fixed)
    except Exception:  # noqa: BLE001 - no shapes, no finding
        return None
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in list(inferred.graph.value_info) + list(inferred.graph.input)}
    windows = [w for n in model.graph.node if (w := _window(n, model)) is not None]
    unsized = [n.input[0] for n, _, _, _ in windows if None in (shapes.get(n.input[0]) or [None])]
    if unsized and observe is not None:
        shapes.update({name: list(shape) for name, shape in observe(sorted(set(unsized))).items()})
    for n, kernel, pads, dilations in windows:
        spatial = (shapes.get(n.input[0]) or [])[2:]
        if len(spatial) != len(kernel):
            continue
        for k, (size, width) in enumerate(zip(spatial, kernel)):
            extent = (width - 1) * dilations[k] + 1
            if size is not None and size + pads[k] + pads[k + len(kernel)] < extent:
                return f"{n.name or n.op_type} (window {extent} over {size})", _input_dim(model, 2 + k,
                                                                                          2 + len(kernel))
    return None


def _input_dim(model: onnx.ModelProto, axis: int, rank: int) -> str | None:
    """The free dim a window over `axis` of a rank-`rank` value most likely runs along: a convolutional net keeps
    its (N, C, spatial...) axes, so the one float input of that rank whose dim at `axis` is symbolic (PP-OCRv4's
    recognizer: height `?`, which must be 48). None where that is not one dim."""
    names = {_dim_name(spec, axis, spec.shape[axis]) for spec in input_specs(model)
             if len(spec.shape) == rank and spec.dtype.kind == "f" and not isinstance(spec.shape[axis], int)}
    return names.pop() if len(names) == 1 else None


def _window(n: onnx.NodeProto, model: onnx.ModelProto) -> tuple | None:
    """(node, kernel, pads, dilations) of a windowed node with explicit padding, else None."""
    if n.op_type not in _WINDOWED or not n.input:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        return None
    weight = next((t for t in model.graph.initializer if len(n.input) > 1 and t.name == n.input[1]), None)
    kernel = list(attrs.get("kernel_shape") or (list(weight.dims)[2:] if weight is not None else []))
    pads = list(attrs.get("pads") or [0] * 2 * len(kernel))
    dilations = list(attrs.get("dilations") or [1] * len(kernel))
    if not kernel or len(pads) != 2 * len(kernel) or len(dilations) != len(kernel):
        return None  # (attributes the checker refuses: not this function's to judge)
    return n, kernel, pads, dilations


def selector_inputs(model: onnx.ModelProto, specs: list[InputSpec] | None = None) -> dict[str, int]:
    """Integer graph inputs of one element that the graph compares for equality with a constant (silero-vad's
    `sr`, Equal(sr, 16000) choosing the 16 kHz branch): name -> that constant. Fed it, the run takes the branch
    the model was made for rather than the one a random value falls into. Only one-element constants are read
    (weights stay where they are)."""
    scalar_ints = {s.name for s in specs or input_specs(model) if s.dtype.kind in "iu" and all(d == 1 for d in s.shape)}
    g = model.graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer
              if t.name not in scalar_ints and not t.external_data and all(d == 1 for d in t.dims)}
    consts.update({n.output[0]: onnx.numpy_helper.to_array(a.t) for n in g.node if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value" and all(d == 1 for d in a.t.dims)})
    found = {}
    for n in g.node:
        if n.op_type != "Equal" or len(n.input) != 2:
            continue
        for a, b in (n.input, reversed(n.input)):
            c = consts.get(b)
            if a in scalar_ints and a not in found and c is not None and c.dtype.kind in "iu":
                found[a] = int(c.reshape(-1)[0])
    return found


def make_cases(model: onnx.ModelProto, mask_inputs: tuple[str, ...] = (),
               dim_overrides: dict | None = None, seed: int = 0, pad_masks: bool = True,
               preferred_dims: dict | None = None) -> list[ReferenceCase]:
    """Two cases at different sizes of every symbolic dim. Attention masks are all ones except row 0, left
    padded by two (the padded rows are then not compared), unless `pad_masks` is False."""
    specs = input_specs(model)
    sizes = dim_sizes(specs, dim_overrides, model, preferred_dims)
    for case_index in range(2):
        check_memory(model, specs, {name: pair[case_index] for name, pair in sizes.items()})
    bounds = _index_bounds(model)
    selectors = selector_inputs(model, specs)
    cases = []
    for case_index in range(2):
        rng = np.random.default_rng(seed + case_index)
        inputs: dict[str, np.ndarray] = {}
        mask = None
        for spec in specs:
            shape = [d if isinstance(d, int) else sizes[_dim_name(spec, ax, d)][case_index]
                     for ax, d in enumerate(spec.shape)]
            if is_mask_input(spec, mask_inputs):
                value = np.ones(shape, dtype=spec.dtype)
                if pad_masks and len(shape) == 2 and shape[0] >= 1 and shape[1] >= 2:
                    value[0, : min(2, shape[1] - 1)] = 0  # row 0 left-padded
                    mask = value.astype(bool)
            elif spec.dtype.kind == "f" or spec.dtype.name == "bfloat16":
                value = rng.standard_normal(shape).astype(spec.dtype)
            elif spec.dtype.kind == "b":
                value = rng.random(shape) < 0.5
            elif spec.dtype.kind in "iu" and spec.name in selectors:
                value = np.full(shape, selectors[spec.name], dtype=spec.dtype)
            elif spec.dtype.kind in "iu":
                high = bounds.get(spec.name, DEFAULT_INT_HIGH)
                value = rng.integers(0, max(high, 1), size=shape).astype(spec.dtype)
            else:
                raise UnsupportedError(f"graph input {spec.name!r} has dtype {spec.dtype}, which graphconv cannot feed")
            inputs[spec.name] = value
        cases.append(ReferenceCase(f"case{case_index}", inputs, mask))
    return cases


def _same_kind(given: np.dtype, declared: np.dtype) -> bool:
    """Whether an array of dtype `given` may be fed as `declared` (a cast that keeps its meaning)."""
    kinds = {given.kind, declared.kind}
    return len(kinds) == 1 or kinds <= {"i", "u"} or (declared.name == "bfloat16" and given.kind == "f")


def load_npz_cases(paths: list[Path], model: onnx.ModelProto, mask_inputs: tuple[str, ...] = ()) -> list[ReferenceCase]:
    """The user's --inputs, checked before anything runs: names, ranks, dtypes, every fixed dim, one size per
    symbolic dim across the inputs, the dims' relations (graphconv/verify/dims.py), and ids inside the table
    they index."""
    specs = input_specs(model)
    names = list(dict.fromkeys(_dim_name(s, ax, d) for s in specs for ax, d in enumerate(s.shape)
                               if not isinstance(d, int)))
    derived = dims.relations(names, model)
    bounds = _index_bounds(model)
    cases = []
    for path in paths:
        try:
            data = {k: typed(v) for k, v in np.load(path, allow_pickle=False).items()}
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise InputError(f"--inputs {path}: cannot read as .npz ({type(e).__name__}: {e})") from None
        expected = {s.name for s in specs}
        if set(data) != expected:
            raise InputError(f"--inputs {path}: keys {sorted(data)} do not match the graph inputs {sorted(expected)}")
        mask = None
        seen: dict[str, list[tuple[str, int]]] = {}
        for spec in specs:
            arr = data[spec.name]
            declared = f"{spec.dtype} {[d if d is not None else '?' for d in spec.shape]}"
            if arr.ndim != len(spec.shape):
                raise InputError(f"--inputs {path}: {spec.name} has rank {arr.ndim} (shape {list(arr.shape)}), "
                                 f"the model declares {declared}")
            if not _same_kind(arr.dtype, spec.dtype):
                raise InputError(f"--inputs {path}: {spec.name} is {arr.dtype}, the model declares {declared}")
            for ax, d in enumerate(spec.shape):
                if isinstance(d, int) and arr.shape[ax] != d:
                    raise InputError(f"--inputs {path}: {spec.name} dim {ax} is {arr.shape[ax]}, the model declares "
                                     f"{declared}")
                if not isinstance(d, int):
                    seen.setdefault(_dim_name(spec, ax, d), []).append((f"{spec.name} dim {ax}", arr.shape[ax]))
            bound = bounds.get(spec.name)
            if bound is not None and arr.size and arr.dtype.kind in "iu" and (arr.max() >= bound or arr.min() < -bound):
                raise InputError(f"--inputs {path}: {spec.name} holds ids {arr.min()}..{arr.max()}, but the table it "
                                 f"indexes has {bound} rows")
            data[spec.name] = arr.astype(spec.dtype, copy=False)
            if is_mask_input(spec, mask_inputs) and arr.ndim == 2:
                mask = arr.astype(bool)
        dims.check_sizes(seen, derived, f"--inputs {path}")
        cases.append(ReferenceCase(path.stem, data, mask))
    return cases


def exact_integer_products(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The model onnxruntime is to run for the oracle: a copy whose integer-product nodes compute exactly
    (graphconv/verify/integer_products.py), and the count rewritten per op ({} and `model` itself when it has
    none). onnxruntime's u8s8 kernel saturates on x86 without VNNI, so its own results depend on the CPU."""
    return integer_products.rewrite(model)


def exact_note(counts: dict[str, int]) -> str:
    """The report's line for what `exact_integer_products` rewrote."""
    return integer_products.note(counts)


def _names_an_integer_product(path: Path) -> bool:
    """Whether the file holds the name of an op `exact_integer_products` rewrites anywhere (a memory-mapped
    scan: a model file without one is handed to onnxruntime unread, however large)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return re.search("|".join(op for _, op in integer_products.OPS).encode(), mm) is not None


def ort_session(model: str | bytes):
    """The oracle's onnxruntime session (CPU, basic graph optimizations) of a model file or serialized model."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    # onnxruntime's own log (red [E:onnxruntime] lines for a node that fails) only under --debug: the
    # failure reaches the user as graphconv's one-line error.
    opts.log_severity_level = 3 if os.environ.get("GRAPHCONV_DEBUG") else 4
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def ort_feed(array: np.ndarray):
    """An array as onnxruntime takes it: bfloat16 (ml_dtypes, which onnxruntime's numpy bridge does not know) as
    an OrtValue over the same bytes; any other dtype as it is."""
    if array.dtype.name != "bfloat16":
        return array
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array).view(np.uint16),
                                                           onnx.TensorProto.BFLOAT16)


class Oracle:
    """Runs a model (proto or path) on reference inputs; onnxruntime first, ReferenceEvaluator as fallback."""

    def __init__(self, model: onnx.ModelProto | Path):
        self.model = model
        self.name: str | None = None
        self.fallback_reason: str | None = None
        self.load_failed = False  # onnxruntime refused the model itself (not the inputs)
        self.exact: dict[str, int] = {}  # integer-product nodes onnxruntime ran rewritten, per op (exact_note)

    def _stripped(self, for_ort: bool = False):
        """The model to hand over and the memory-mapped weights to feed with every case: weights held as
        absolute external references (graphconv.frontend.weights) run as graph inputs. `for_ort`: with its
        integer products exact (a model file with any is loaded for that, its external weights by reference)."""
        model = self.model
        if isinstance(model, Path):
            if not for_ort:
                return model, {}
            if not _names_an_integer_product(model):
                return model, {}
            proto = onnx.load(str(model), load_external_data=False)
            if not integer_products.found(proto):
                return model, {}
            weights.take_over_external(proto, model.parent)
            model = proto
        model, refs = weights.stripped(model)
        if for_ort:
            model, self.exact = exact_integer_products(model)
        return model, weights.feeds(refs)

    def _ort(self, cases):
        model, extra = self._stripped(for_ort=True)
        src = str(model) if isinstance(model, Path) else model.SerializeToString()
        try:
            sess = ort_session(src)
        except Exception:
            self.load_failed = True
            raise
        names = [o.name for o in sess.get_outputs()]
        return [dict(zip(names, sess.run(names, {**c.inputs, **extra}))) for c in cases]

    def _reference(self, cases):
        from onnx.reference import ReferenceEvaluator

        model, extra = self._stripped()
        model = onnx.load(str(model)) if isinstance(model, Path) else model
        ev = ReferenceEvaluator(model)
        names = list(ev.output_names)
        return [dict(zip(names, ev.run(None, {**c.inputs, **extra}))) for c in cases]

    def run(self, cases: list[ReferenceCase], fallback: bool = True) -> list[dict[str, np.ndarray]]:
        """The outputs per case. `fallback` False: onnxruntime's or an UnsupportedError, never onnx.reference's
        (a search for sizes onnxruntime takes: the reference evaluator on a convolutional model at larger
        sizes is slow, and its im2col took 22 GiB on an OCR model at 128 x 128)."""
        try:
            out = self._ort(cases)
            self.name = "onnxruntime"
            self.fallback_reason = None  # (an earlier call's: these outputs are onnxruntime's)
            return out
        except Exception as e:  # noqa: BLE001 - any ORT failure sends us to the fallback
            if not fallback:
                raise UnsupportedError(f"onnxruntime could not run the model: {first_line(e, 200)}"
                                       ) from None
            self.fallback_reason = f"onnxruntime could not run the model: {first_line(e, 200)}"
            self.exact = {}  # (onnx.reference runs the model as given: its integer kernels are exact)
        try:
            out = self._reference(cases)
            self.name = "onnx.reference"
            return out
        except Exception as e:  # noqa: BLE001
            raise UnsupportedError(f"no oracle can run this model ({self.fallback_reason}; "
                                   f"onnx.reference: {first_line(e, 200)})") from None
