"""TopK, with ONNX's tie rule.

ONNX (and onnxruntime's kernel: its comparator orders equal values by index) returns equal values in index
order, the lower index first. MindSpore's TopK does not (mindspore 2.10 CPU: equal values come back in another
order, and uint8 inputs give wrong values), so only its *values* are used: they are right whatever the tie
order. The index of output position p is then found exactly: with g(p) = the count of elements greater than
v[p], position p holds the (p - g(p) + 1)-th element equal to v[p], counted in index order (a cumulative sum
over the axis). That costs a (k, n) comparison per row, small for the routers (n = experts) and samplers
(k small) that use TopK.

k computed at run time (DeepSeek-V3.2's indexer keeps min(2048, sequence) keys, `torch.sort` exports as a TopK
of k = the axis size) passes to MindSpore's TopK as a 0-d tensor: mindspore 2.10 takes it in graph mode and in
an exported MindIR, at each shape.

Opsets below 13 are upgraded to 13 on load (k an input since 10, `largest` / `sorted` since 11), so one handler
covers TopK-11 and TopK-24 (bfloat16 added, semantics unchanged). `sorted=0` leaves the order undefined in
ONNX: the elements come back sorted, which is one valid order (onnxruntime's own order then is the heap's,
and a consumer that depends on it does not verify).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphconv.dtypes import FLOATS
from opmap.registry import register

_D = ir.DataType
# Types MindSpore's TopK does not sort right, or that have no order-reversing bitwise not, computed in a wider
# signed type that holds every value (uint64: int64 with the sign bit flipped, the same order).
_WIDEN = {_D.UINT8: _D.INT32, _D.UINT16: _D.INT32, _D.UINT32: _D.INT64, _D.INT16: _D.INT32, _D.UINT64: _D.INT64}


@register("TopK", since=11)
def top_k(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", -1), rank)
    k = n.ints(1)
    dims = n.shape(0)
    dt = n.dtype(0)
    if k is None:  # computed at run time
        if n.shape(1) not in (None, [1], []):
            n.fail(f"k must hold one value, got shape {n.shape(1)}")
        k = n.call("ops.reshape", n.x(1), ())
    else:
        if len(k) != 1 or k[0] < 0:
            n.fail(f"k must be one non-negative value, got {k}")
        k = k[0]
        dim = dims[axis]
        if isinstance(dim, int) and k > dim:
            n.fail(f"k={k} is larger than axis {axis} (size {dim})")
        if k == 0:
            if not all(isinstance(d, int) for d in dims):
                n.fail("k=0 needs a static input shape (the outputs are empty)")
            out = list(dims)
            out[axis] = 0
            return np.zeros(out, dt.numpy()), np.zeros(out, np.int64)
    x = n.x(0)
    last = rank - 1
    if axis != last:  # work on the last axis: swapping two axes is its own inverse
        perm = list(range(rank))
        perm[axis], perm[last] = last, axis
        x = n.call("ops.transpose", x, tuple(perm))
    work = _WIDEN.get(dt, dt)
    if work != dt:
        x = n.call("ops.cast", x, n.ms_dtype(work))
    if dt == _D.UINT64:
        x = _flip_sign(n, x)
    if not n.attr("largest", 1):
        # An order-reversing bijection: -x for floats, ~x = -x - 1 for signed integers (no overflow at the minimum).
        x = _reverse(n, x, work)
    values, index = _top_k_last(n, x, k)
    if not n.attr("largest", 1):
        values = _reverse(n, values, work)
    if dt == _D.UINT64:
        values = _flip_sign(n, values)
    if work != dt:
        values = n.call("ops.cast", values, n.ms_dtype(dt))
    if axis != last:
        values = n.call("ops.transpose", values, tuple(perm))
        index = n.call("ops.transpose", index, tuple(perm))
    return values, index


def _flip_sign(n, x):
    """uint64 <-> int64 in the same order: the cast keeps the bits (values from 2**63 turn negative), flipping the
    sign bit then moves them above the rest."""
    return n.call("ops.bitwise_xor", x, n.const_tensor(np.array(np.iinfo(np.int64).min, np.int64), "sign_bit"))


def _reverse(n, x, dtype):
    return n.unop("-", x) if dtype in FLOATS else n.call(n.call("ops.Invert"), x)


def _top_k_last(n, x, k):
    """The k largest along the last axis, equal values in index order: (values, int64 indices); k an int or a
    0-d tensor."""
    i32 = n.ms_dtype(_D.INT32)
    values = n.call_n("ops.topk", 2, x, k)[0]
    row = n.call("ops.expand_dims", x, -2)  # (..., 1, n)
    col = n.call("ops.expand_dims", values, -1)  # (..., k, 1)
    greater = n.call("ops.sum", n.call("ops.cast", n.binop(">", row, col), i32), -1)  # (..., k)
    positions = n.const_tensor(np.arange(1, k + 1, dtype=np.int32), "rank") if isinstance(k, int) else \
        n.call("ops.cumsum", n.call("ops.ones_like", greater), -1)  # 1 .. k (k computed at run time)
    wanted = n.call("ops.expand_dims", n.binop("-", positions, greater), -1)  # (..., k, 1): occurrence number
    equal = n.call("ops.equal", row, col)  # (..., k, n)
    seen = n.call("ops.cumsum", n.call("ops.cast", equal, i32), -1)
    hit = n.call("ops.logical_and", equal, n.call("ops.equal", seen, wanted))  # one True per (..., p)
    index = n.call("ops.argmax", n.call("ops.cast", hit, i32), -1)
    return values, n.named(n.call("ops.cast", index, n.ms_dtype(_D.INT64)), "indices")
