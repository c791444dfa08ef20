"""Shape and data-movement ops: Shape, Reshape, Transpose, Concat, Split, Slice, Gather*, Expand, Pad...

Shapes that are not compile-time constants flow as int64 tensors (`ops.dyn_shape`), so symbolic dims stay
symbolic in the MindIR. A handler may return a numpy array: the output is then a compile-time constant.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register

_OPEN = 2**31  # |index| at or beyond this means "to the end of the axis" in ONNX slicing


@register("Shape", since=1)
def shape(n):
    start, end = n.attr("start", 0), n.attr("end", None)
    static = n.shape(0)
    if static is not None and all(isinstance(d, int) for d in static[start:end]):
        return np.array(static[start:end], dtype=np.int64)  # (also when only the dims read are static)
    dims = n.call("ops.dyn_shape", n.x(0))
    if start != 0 or end is not None:
        dims = n.getitem(dims, slice(start or None, end))
    return dims


@register("Size", since=1)
def size(n):
    return n.call("ops.prod", n.call("ops.dyn_shape", n.x(0)))


@register("Reshape", since=5)
def reshape(n):
    x = n.x(0)
    target = n.ints(1)
    allowzero = n.attr("allowzero", 0)
    if target is None:
        if allowzero:
            return n.call("ops.reshape", x, n.call(n.helper("onnx_dims"), n.x(1)))
        return n.call(n.helper("onnx_reshape"), x, n.x(1))
    if any(v < -1 for v in target) or target.count(-1) > 1:
        n.fail(f"shape {target}: one -1 at most and no other negative value")
    if not allowzero and 0 in target:
        src = n.shape(0) or []
        if all(i < len(src) and isinstance(src[i], int) for i, v in enumerate(target) if v == 0):
            target = [src[i] if v == 0 else v for i, v in enumerate(target)]
        else:
            return n.call(n.helper("onnx_reshape"), x, n.const_tensor(np.array(target, dtype=np.int64), "shape"))
    return n.call("ops.reshape", x, tuple(target))


@register("Flatten", since=13)
def flatten(n):
    rank = n.require_rank(0)
    # axis is in [-r, r]: a negative one counts from r (not r + 1), a positive one may equal r.
    axis = n.attr("axis", 1)
    axis = n.axis(axis, rank) if axis < 0 else n.axis(axis, rank + 1)
    src = n.shape(0)
    head, tail = src[:axis], src[axis:]
    if all(isinstance(d, int) for d in tail):
        return n.call("ops.reshape", n.x(0), (-1, int(np.prod(tail, dtype=np.int64))))
    if all(isinstance(d, int) for d in head):
        return n.call("ops.reshape", n.x(0), (int(np.prod(head, dtype=np.int64)), -1))
    return n.call(n.helper("onnx_flatten"), n.x(0), axis)


@register("Transpose", since=1)
def transpose(n):
    rank = n.require_rank(0)
    perm = n.attr("perm") or list(reversed(range(rank)))
    return n.call("ops.transpose", n.x(0), tuple(perm))


@register("Concat", since=4)
def concat(n):
    rank = n.require_rank(0)
    return n.call("ops.concat", tuple(n.xs()), n.axis(n.attr("axis"), rank))


@register("Split", since=13)
def split(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", 0), rank)
    parts = n.n_outputs
    x = n.x(0)
    if n.has(1) and n.const(1) is None:
        # Sizes computed at run time (JetMoE splits its tokens by the count each expert got): part k is the
        # slice between the running sums of the sizes.
        if (n.shape(1) or [parts])[0] != parts:
            n.fail(f"{parts} outputs, but split sizes of shape {n.shape(1)}")
        sizes = n.x(1)
        ends = n.call("ops.cumsum", sizes, 0)
        starts = n.binop("-", ends, sizes)
        fn = n.helper("onnx_slice_axis")
        return tuple(n.call(fn, x, n.getitem(starts, k), n.getitem(ends, k), axis, 1) for k in range(parts))
    sizes = n.ints(1) if n.has(1) else None
    if sizes is None:
        dim = (n.shape(0) or [None] * rank)[axis]
        if not isinstance(dim, int):
            # ops.chunk/ops.split need the dim at compile time (graph mode): slice each part at run time.
            length = n.getitem(n.call("ops.dyn_shape", x), axis)
            step = n.binop("//", n.binop("+", length, parts - 1), parts)
            fn = n.helper("onnx_slice_axis")
            return tuple(n.call(fn, x, n.binop("*", step, k), n.binop("*", step, k + 1), axis, 1)
                         for k in range(parts))
        step = -(-dim // parts)  # ceil, the last part smaller (opset 18 num_outputs rule)
        sizes = [min(step, dim - k * step) for k in range(parts)]
    # One slice per part, not ops.split: ops.split checks `sum(sizes) == x.shape[axis]` in Python, and where
    # MindSpore does not know that dim at compile time (a dim behind a Reshape by a shape tensor, as onnxsim's
    # Gemm spelling of a Linear leaves) graph mode compiles the check into Switch/raise nodes: a GraphCell
    # loaded without set_inputs then fails ("primitive name: raise"), a lazy_inline layer cannot hold it on
    # CPU, and at fp16 the Reshape after the split fails on CPU (mindspore 2.10; tests/test_graphcell_load.py).
    bounds = np.cumsum([0, *sizes]).tolist()
    lead = (slice(None),) * axis
    return tuple(n.getitem(x, lead + (slice(lo, hi),) if axis else slice(lo, hi))
                 for lo, hi in zip(bounds[:-1], bounds[1:]))


@register("Split", since=18)
def split18(n):
    return split(n)


@register("Slice", since=13)
def slice_(n):
    rank = n.require_rank(0)
    x = n.x(0)
    if n.has(4) and n.const(4) is None:  # run-time steps: each axis sliced at run time
        axes = [n.axis(a, rank) for a in n.require_ints(3, "Slice axes")] if n.has(3) else None
        if axes is None:
            count = (n.shape(4) or [None])[0]
            if not isinstance(count, int):
                n.fail("the number of sliced axes is unknown")
            axes = list(range(count))
        fn = n.helper("onnx_slice_axis_stepped")
        for k, a in enumerate(axes):
            x = n.call(fn, x, *(n.getitem(n.x(i), slice(k, k + 1)) for i in (1, 2)), a,
                       n.getitem(n.x(4), slice(k, k + 1)))
        return x
    starts, ends = n.ints(1), n.ints(2)
    axes = n.require_ints(3, "Slice axes") if n.has(3) else None
    steps = n.ints(4) if n.has(4) else None
    if axes is None:
        n_axes = len(starts) if starts is not None else len(ends) if ends is not None else (n.shape(1) or [None])[0]
        if not isinstance(n_axes, int):
            n.fail("the number of sliced axes is unknown")
        axes = list(range(n_axes))
    axes = [n.axis(a, rank) for a in axes]
    steps = steps or [1] * len(axes)
    if 0 in steps:
        n.fail("a step of 0 is invalid")
    if starts is not None and ends is not None:
        dims = n.shape(0)
        index = [slice(None)] * (max(axes) + 1)
        for a, s, e, st in zip(axes, starts, ends, steps):
            s = max(min(s, _OPEN), -_OPEN)
            e = max(min(e, _OPEN), -_OPEN)
            if isinstance(dims[a], int):
                s, e, _ = slice(s, e, st).indices(dims[a])  # ONNX clamps exactly like Python
                e = None if e < 0 else e  # a negative step down to the first element
            else:
                s = None if (s >= _OPEN if st < 0 else s <= -_OPEN) else s
                e = None if (e <= -_OPEN if st < 0 else e >= _OPEN) else e
                if st < 0 and s is not None and s >= 0:
                    # MindSpore does not clamp a start past the end of a dynamic dim when stepping backwards (it
                    # reads out of bounds): clamp at run time.
                    x = n.call(n.helper("onnx_slice_axis"), x, n.const_tensor(np.array(s, np.int64), "start"),
                               n.const_tensor(np.array(-_OPEN if e is None else e, np.int64), "end"), a, st)
                    continue
            index[a] = slice(s, e, st if st != 1 else None)
        return n.getitem(x, _index(index)) if any(i != slice(None) for i in index) else x
    start = n.x(1) if starts is None else n.const_tensor(np.array(starts, np.int64), "start")
    end = n.x(2) if ends is None else n.const_tensor(np.array(ends, np.int64), "end")
    fn = n.helper("onnx_slice_axis")
    if len(axes) == 1:
        return n.call(fn, x, start, end, axes[0], steps[0])
    for k, (a, st) in enumerate(zip(axes, steps)):  # one axis at a time
        x = n.call(fn, x, n.getitem(start, slice(k, k + 1)), n.getitem(end, slice(k, k + 1)), a, st)
    return x


def _index(index: list[slice]):
    """A subscript: one slice alone (`x[1:3]`), several as a tuple (`x[:, 1:3]`)."""
    return index[0] if len(index) == 1 else tuple(index)


@register("Squeeze", since=13)
def squeeze(n):
    rank = n.require_rank(0)
    axes = n.require_ints(1, "Squeeze axes") if n.has(1) else None  # run-time axes: not "squeeze every 1"
    if axes is None:
        shape_ = n.shape(0)
        if any(not isinstance(d, int) for d in shape_):
            n.fail("Squeeze without axes needs a fully static input shape")
        axes = [i for i, d in enumerate(shape_) if d == 1]
    axes = sorted(n.axis(a, rank) for a in axes)
    if not axes:
        return n.x(0)
    return n.call("ops.squeeze", n.x(0), tuple(axes))


@register("Unsqueeze", since=13)
def unsqueeze(n):
    rank = n.require_rank(0)
    axes = n.require_ints(1, "Unsqueeze axes")
    out_rank = rank + len(axes)
    axes = sorted(n.axis(a, out_rank) for a in axes)
    if len(axes) == 1:
        return n.call("ops.expand_dims", n.x(0), axes[0])
    return n.call(n.helper("onnx_unsqueeze"), n.x(0), tuple(axes))


@register("Expand", since=8)
def expand(n):
    # Bidirectional broadcasting, exactly ONNX's: combine with a tensor of the target shape.
    target = n.ints(1)
    shape_ = tuple(target) if target is not None else n.call(n.helper("onnx_dims"), n.x(1))
    x = n.x(0)
    if n.dtype(0) == ir.DataType.BOOL:
        return n.call("ops.logical_or", x, n.call("ops.zeros", shape_, n.ms_dtype(ir.DataType.BOOL)))
    return n.binop("+", x, n.call("ops.zeros", shape_, n.ms_dtype(n.dtype(0))))


@register("Tile", since=13)
def tile(n):
    reps = n.require_ints(1, "Tile repeats")
    return n.call("ops.tile", n.x(0), tuple(reps))


def _nonneg_index(n, i: int, axis: int) -> tuple:
    """The index input as a value, and whether it is known to hold no negative values."""
    idx = n.const(i)
    if idx is not None:
        dim = (n.shape(0) or [None] * (axis + 1))[axis]
        if (idx >= 0).all():
            return n.x(i), True
        if isinstance(dim, int):
            return n.const_tensor(np.where(idx < 0, idx + dim, idx).astype(idx.dtype), "index"), True
    return n.x(i), False


@register("Gather", since=13)
def gather(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", 0), rank)
    idx, safe = _nonneg_index(n, 1, axis)
    if safe:
        return n.call("ops.gather", n.x(0), idx, axis)
    return n.call(n.helper("onnx_gather"), n.x(0), idx, axis)


@register("GatherElements", since=13)
def gather_elements(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", 0), rank)
    idx, safe = _nonneg_index(n, 1, axis)
    if not safe:
        dim = n.getitem(n.call("ops.dyn_shape", n.x(0)), axis)
        idx = n.call("ops.where", n.binop("<", idx, 0), n.binop("+", idx, dim), idx)
    return n.call("ops.gather_elements", n.x(0), axis, idx)


@register("GatherND", since=13)
def gather_nd(n):
    b = int(n.attr("batch_dims", 0))
    if not b:
        return n.call("ops.gather_nd", n.x(0), n.x(1))
    # batch_dims=b: prefix every index tuple with its own batch coordinates, then one plain gather_nd.
    ishape = n.shape(1)
    if ishape is None or not all(isinstance(d, int) for d in ishape):
        n.fail("batch_dims > 0 needs a static indices shape")
    grids = np.meshgrid(*[np.arange(d) for d in ishape[:b]], indexing="ij")
    prefix = np.stack(grids, -1).reshape(tuple(ishape[:b]) + (1,) * (len(ishape) - 1 - b) + (b,))
    prefix = np.broadcast_to(prefix, tuple(ishape[:-1]) + (b,)).astype(np.int64)
    full = n.call("ops.concat", (n.const_tensor(prefix, "batch_index"),
                                 n.call("ops.cast", n.x(1), n.ms_dtype(ir.DataType.INT64))), -1)
    return n.call("ops.gather_nd", n.x(0), full)


_SCATTER = {"none": "ops.tensor_scatter_update", "add": "ops.tensor_scatter_add", "mul": "ops.tensor_scatter_mul",
            "max": "ops.tensor_scatter_max", "min": "ops.tensor_scatter_min"}


def _reduction(n) -> str:
    r = text(n.attr("reduction", "none"))
    if r not in _SCATTER:
        n.fail(f"reduction={r!r} is not supported")
    return r


@register("ScatterND", since=13)
def scatter_nd(n):
    """Opset 16 adds reduction add / mul, 18 max / min: duplicates accumulate, as MindSpore's tensor_scatter_*.
    No indices (a constant of size 0: Qwen 3.5's interleaved M-RoPE assigns an empty section at small sizes)
    update nothing: the data as it is."""
    reduction = _reduction(n)
    indices = n.const(1)
    if indices is not None and indices.size == 0:
        return n.x(0)
    return n.call(_SCATTER[reduction], n.x(0), n.x(1), n.x(2))


@register("ScatterElements", since=13)
def scatter_elements(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", 0), rank)
    reduction = _reduction(n)
    if reduction in ("none", "add"):
        return n.call("ops.tensor_scatter_elements", n.x(0), n.x(1), n.x(2), axis, reduction)
    # mul / max / min: as ScatterND with full coordinates (the element's own position, the index on `axis`).
    ishape = n.shape(1)
    if ishape is None or not all(isinstance(d, int) for d in ishape):
        n.fail(f"reduction={reduction!r} needs a static indices shape")
    dim = (n.shape(0) or [None] * rank)[axis]
    idx = n.call("ops.cast", n.x(1), n.ms_dtype(ir.DataType.INT64))
    if isinstance(dim, int):
        idx = n.call("ops.where", n.binop("<", idx, 0), n.binop("+", idx, dim), idx)
    grids = np.meshgrid(*[np.arange(d, dtype=np.int64) for d in ishape], indexing="ij")
    parts = [idx if a == axis else n.const_tensor(g, f"coord{a}") for a, g in enumerate(grids)]
    coords = n.call("ops.stack", tuple(parts), -1)
    return n.call(_SCATTER[reduction], n.x(0), coords, n.x(2))


@register("ConstantOfShape", since=9)
def constant_of_shape(n):
    value = n.attr("value")
    value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    dt = n.ms_dtype(ir.DataType.from_numpy(value.dtype))
    v = value[0].item()
    target = n.ints(0)
    shape_ = tuple(target) if target is not None else n.call(n.helper("onnx_dims"), n.x(0))
    if v == 0:
        return n.call("ops.zeros", shape_, dt)
    if v == 1:
        return n.call("ops.ones", shape_, dt)
    return n.binop("+", n.call("ops.zeros", shape_, dt), v)


@register("Range", since=11)
def range_(n):
    # ops.range returns int64 for every integer input type (ONNX keeps the input type).
    y = n.call("ops.range", n.x(0), n.x(1), n.x(2))
    return y if n.dtype(0) in (ir.DataType.INT64, ir.DataType.FLOAT) else n.call("ops.cast", y, n.ms_dtype(n.dtype(0)))


@register("CumSum", since=14)
def cumsum(n):
    rank = n.require_rank(0)
    axis = n.axis(n.require_ints(1, "CumSum axis")[0], rank)
    x = n.x(0)
    if n.attr("reverse", 0):
        x = n.call("ops.flip", x, (axis,))
    y = n.call("ops.cumsum", x, axis)
    if n.attr("exclusive", 0):
        y = n.binop("-", y, x)
    if n.attr("reverse", 0):
        y = n.call("ops.flip", y, (axis,))
    return y


@register("Trilu", since=14)
def trilu(n):
    k = n.require_ints(1, "Trilu k")[0] if n.has(1) else 0
    if 0 in (n.shape(0) or []):
        return n.x(0)  # nothing to mask (and MindSpore's CPU kernels refuse empty matrices)
    fn = "ops.triu" if n.attr("upper", 1) else "ops.tril"
    return n.call(fn, n.x(0), k)


@register("Pad", since=13)
def pad(n):
    rank = n.require_rank(0)
    pads = n.require_ints(1, "Pad pads")
    axes = n.ints(3) if n.has(3) else list(range(rank))
    axes = [n.axis(a, rank) for a in axes]
    mode = text(n.attr("mode", "constant"))
    begins, ends = pads[: len(axes)], pads[len(axes):]
    per_axis = {a: (b, e) for a, b, e in zip(axes, begins, ends)}
    # MindSpore/torch order: last axis first, (begin, end) pairs.
    last = max((a for a, be in per_axis.items() if be != (0, 0)), default=None)
    if last is None:
        return n.x(0)
    first = min(a for a, be in per_axis.items() if be != (0, 0))
    order = []
    for a in range(rank - 1, first - 1, -1):
        order += list(per_axis.get(a, (0, 0)))
    ms_mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}.get(mode)
    if ms_mode is None:
        n.fail(f"mode {mode!r} is not supported")
    if ms_mode == "constant":
        value = n.const(2) if n.has(2) else None
        v = 0 if value is None else np.asarray(value).reshape(-1)[0].item()
        return n.call("ops.pad", n.x(0), tuple(order), "constant", v)
    return n.call("ops.pad", n.x(0), tuple(order), ms_mode)


@register("Identity", since=1)
def identity(n):
    return n.x(0)


@register("Dropout", since=13)
def dropout(n):
    # Inference: identity; the optional mask output is all True.
    x = n.x(0)
    return (x, n.method(n.call("ops.ones_like", x), "astype", n.ms_dtype(ir.DataType.BOOL)))


@register("EyeLike", since=9)
def eye_like(n):
    """Ones on diagonal k of a 2-D tensor shaped like the input: a compile-time constant of its static shape."""
    s = n.shape(0)
    if s is None or len(s) != 2 or not all(isinstance(d, int) for d in s):
        n.fail("EyeLike needs a static 2-D input shape")
    dt = n.attr("dtype", None)
    dt = n.dtype(0) if dt is None else ir.DataType(dt)
    n.ms_dtype(dt)  # refuses dtypes MindSpore has no equivalent for
    return np.eye(s[0], s[1], k=int(n.attr("k", 0)), dtype=dt.numpy())


@register("CenterCropPad", since=18)
def center_crop_pad(n):
    """Per axis: crop (start (dim - size) // 2) or pad (begin (size - dim) // 2, the rest at the end) to `shape`."""
    rank = n.require_rank(0)
    target = n.require_ints(1, "CenterCropPad shape")
    axes = [n.axis(a, rank) for a in (n.attr("axes") or range(rank))]
    dims = n.shape(0)
    x = n.x(0)
    index, pads = [slice(None)] * rank, {}
    for a, size in zip(axes, target):
        d = dims[a]
        if not isinstance(d, int):
            n.fail("cropped or padded axes must have static sizes")
        if d > size:
            start = (d - size) // 2
            index[a] = slice(start, start + size)
        elif d < size:
            pads[a] = ((size - d) // 2, size - d - (size - d) // 2)
    if any(i != slice(None) for i in index):
        x = n.getitem(x, _index(index))
    if pads:
        order = []
        for a in range(rank - 1, min(pads) - 1, -1):
            order += list(pads.get(a, (0, 0)))
        x = n.call("ops.pad", x, tuple(order))
    return x


@register("NonZero", since=13)
def non_zero(n):
    """(rank, count) int64 indices of the non-zero elements in row-major order; the count is data-dependent."""
    return n.call("ops.transpose", n.call("ops.cast", n.call("ops.nonzero", n.x(0)), n.ms_dtype(ir.DataType.INT64)),
                  (1, 0))


@register("Range", since=27)
def range_27(n):
    """Opset 27 adds float16/bfloat16, computed in stash_type (float32 by default, or float64) and cast back."""
    dtype = n.dtype(0)
    if dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return range_(n)
    stash = ir.DataType(n.attr("stash_type", 1))
    if stash not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        n.fail(f"stash_type {stash.name} is not FLOAT or DOUBLE")
    wide = [n.call("ops.cast", n.x(i), n.ms_dtype(stash)) for i in range(3)]
    return n.call("ops.cast", n.call("ops.range", *wide), n.ms_dtype(dtype))
