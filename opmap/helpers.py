"""Functions copied into the generated network source where a handler needs more than one expression.

They run inside MindSpore's GRAPH_MODE (parsed from source): only `ops`/`ms` calls and Python control flow
on compile-time values (ranks, dtypes, constants). `ms`, `ops`, `Tensor`, `Parameter` and `np` are the
generated module's imports; this module is never executed by graphconv itself.
"""
# ruff: noqa: F821  (names resolve in the generated module)

import inspect
import re


def _param_value(array, transposed=False):
    """A weight's array as the Tensor a Parameter holds; transposed: its transpose (a MatMul weight in
    Linear's [out, in] layout)."""
    if transposed:  # in 128 x 128 tiles: numpy's strided .T copy of a large weight runs ~3x slower
        source, array = array, np.empty(array.shape[::-1], array.dtype)
        for i in range(0, source.shape[0], 128):
            for j in range(0, source.shape[1], 128):
                array[j:j + 128, i:i + 128] = source[i:i + 128, j:j + 128].T
    # Tensor(array) copies; from_numpy shares the array's memory (bfloat16 and read-only arrays excepted), and
    # _param's Parameter keeps that Tensor's memory: a weight is built without a copy of its own.
    shareable = array.flags.c_contiguous and array.flags.writeable and array.dtype.name != "bfloat16"
    return Tensor.from_numpy(array) if shareable else Tensor(array)


def _param(weights, name, shape, dtype, transposed=False):
    """A Parameter named like the ONNX initializer; zeros when no weights are given (then load a .ckpt).
    `weights` maps each name to the initializer's array (transposed here where the Parameter is stored
    transposed), or to a ready Parameter, which is used as it is."""
    if weights is None:
        value = Tensor(np.zeros(shape, np.int8), dtype) if dtype == ms.qint4x2 else ops.zeros(shape, dtype)
    else:
        value = weights[name]
        if isinstance(value, Parameter):
            return value
        # qint4x2 (two int4 per byte): the int8 container's bytes and shape, typed qint4x2
        value = Tensor(value, ms.qint4x2) if dtype == ms.qint4x2 else _param_value(value, transposed)
    # Parameter(value) would copy value (mindspore 2.10 shares a Tensor only at a reference count no call from
    # here has); a lazily initialized Parameter given value by set_data holds value's own memory: one copy
    # less while the network is built.
    param = Parameter(initializer(Zero(), value.shape, value.dtype), name=name,
                      requires_grad=value.dtype in (ms.float16, ms.bfloat16, ms.float32))
    param.set_data(value)
    return param


def onnx_dims(shape):
    """A 1-D int64 shape tensor as the tuple of its run-time values, for every op that takes a shape (reshape,
    zeros, broadcast_to...). Given the tensor itself, graph mode converts it to a tuple of unknown length, which
    the shape inference of a loaded MindIR cannot follow: a GraphCell called without set_inputs then keeps
    the first call's shapes downstream and fails (or is wrong) at a second shape (mindspore 2.10). This tuple
    has the tensor's static length."""
    return ops.TensorToTuple()(shape)


def onnx_reshape(x, shape):
    """ONNX Reshape with allowzero=0: a 0 in `shape` copies the input's dim at that position."""
    n = shape.shape[0]
    dims = ops.dyn_shape(x)
    if x.ndim < n:
        dims = ops.concat((dims, ops.ones((n - x.ndim,), ms.int64)))
    return ops.reshape(x, onnx_dims(ops.where(shape == 0, dims[:n], shape)))


def onnx_flatten(x, axis):
    """ONNX Flatten: (prod(dims[:axis]), prod(dims[axis:])) for any mix of static and dynamic dims."""
    dims = ops.dyn_shape(x)
    one = ops.ones((1,), ms.int64)
    # A full reduction (axis=None) cannot keep dims in MindSpore: reduce, then make it 1-D.
    head = ops.prod(dims[:axis]).reshape((1,)) if axis > 0 else one
    tail = ops.prod(dims[axis:]).reshape((1,)) if axis < x.ndim else one
    return ops.reshape(x, onnx_dims(ops.concat((head, tail))))


def onnx_slice_axis(x, start, end, axis, step):
    """ONNX Slice on one axis with run-time start/end (0-d or 1-element tensors) and a constant step: both are
    clamped like ONNX does (tensor bounds: ops.clamp rejects a tensor bound mixed with an int one)."""
    dim = ops.dyn_shape(x)[axis]
    start = start.reshape(()).astype(ms.int64)
    end = end.reshape(()).astype(ms.int64)
    start = ops.where(start < 0, start + dim, start)
    end = ops.where(end < 0, end + dim, end)
    if step > 0:
        lo, hi = ops.zeros_like(dim), dim
    else:
        lo, hi = ops.zeros_like(dim) - 1, dim - 1
    start = ops.minimum(ops.maximum(start, lo), hi)
    end = ops.minimum(ops.maximum(end, lo), hi)
    end = ops.maximum(end, start) if step > 0 else ops.minimum(end, start)
    index = ops.range(start, end, Tensor(step, ms.int64))
    return ops.gather(x, index, axis)


def onnx_slice_axis_stepped(x, start, end, axis, step):
    """onnx_slice_axis with a run-time step too (a 0-d or 1-element tensor, never 0): the bounds are clamped
    for its sign at run time."""
    dim = ops.dyn_shape(x)[axis]
    start = start.reshape(()).astype(ms.int64)
    end = end.reshape(()).astype(ms.int64)
    step = step.reshape(()).astype(ms.int64)
    start = ops.where(start < 0, start + dim, start)
    end = ops.where(end < 0, end + dim, end)
    forward = step > 0
    lo = ops.where(forward, ops.zeros_like(dim), ops.zeros_like(dim) - 1)
    hi = ops.where(forward, dim, dim - 1)
    start = ops.minimum(ops.maximum(start, lo), hi)
    end = ops.minimum(ops.maximum(end, lo), hi)
    end = ops.where(forward, ops.maximum(end, start), ops.minimum(end, start))
    return ops.gather(x, ops.range(start, end, step), axis)


def onnx_gather(x, index, axis):
    """ONNX Gather: negative indices count from the end of the axis."""
    dim = ops.dyn_shape(x)[axis]
    return ops.gather(x, ops.where(index < 0, index + dim, index), axis)


def onnx_unsqueeze(x, axes):
    """ONNX Unsqueeze: `axes` are positions in the output, normalised and sorted by the caller."""
    for a in axes:
        x = ops.expand_dims(x, a)
    return x


def kv_cache_update(cache, new, indices, total_length):
    """graphconv::KVCacheUpdate (passes/stateful_cache.py): new[b, n, j] written in place into the Parameter
    `cache` [max batch, N, max seq, D] at indices[b, n, j] = (b, n, past + j), then its first B rows and
    `total_length` (past + q) positions read back. The read is of the scatter's result, so it follows the
    write."""
    written = ops.scatter_nd_update(cache, indices, new)
    return written[:ops.dyn_shape(new)[0], :, :total_length.reshape(()).astype(ms.int64)]


def all_reduce(x):
    """graphconv::AllReduce: the sum of x over the ranks of the world group (the primitive made where it is
    used: graph mode takes a Primitive built in construct)."""
    return ops.AllReduce()(x)


def all_gather(x, perm, inverse):
    """graphconv::AllGather: the ranks' x concatenated along the axis `perm` moves first (ops.AllGather
    gathers along axis 0), moved back by `inverse`."""
    return ops.transpose(ops.AllGather()(ops.transpose(x, perm)), inverse)


def dependencies(fn) -> list[str]:
    """Other helpers that `fn` calls (they are copied into the generated source before it)."""
    src = inspect.getsource(fn)
    names = set(re.findall(r"\b(onnx_\w+)\(", src)) - {fn.__name__}
    return sorted(names)
