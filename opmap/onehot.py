"""OneHot, as onnxruntime's kernel computes it.

out = values[1] where index == position along the new axis, values[0] elsewhere. onnxruntime 1.32 casts the
index to int64 first (a float index truncated toward zero: 1.5 -> 1, -0.5 -> 0, -1.5 -> -1; measured), then adds
depth to a negative one (so [-depth, depth-1] is in range, anything else gives a row of off values). depth is
cast to int64 (truncated) and must be a compile-time constant (it is the new axis' size). Opsets below 13 are
upgraded to 13 on load, so one handler covers OneHot-11 and OneHot-28 (bfloat16 added, semantics unchanged).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register

_D = ir.DataType


@register("OneHot", since=11)
def one_hot(n):
    rank = n.require_rank(0)
    depth = n.const(1)
    if depth is None:
        n.fail("depth must be a constant (it is the size of the new axis)")
    if depth.size != 1:
        n.fail(f"depth must hold one value, got shape {list(depth.shape)}")
    depth = int(np.asarray(depth).reshape(-1)[0].astype(np.int64))
    if depth <= 0:
        n.fail(f"depth must be positive, got {depth}")
    axis = n.axis(n.attr("axis", -1), rank + 1)
    index = n.x(0) if n.dtype(0) == _D.INT64 else n.call("ops.cast", n.x(0), n.ms_dtype(_D.INT64))
    index = n.call("ops.where", n.binop("<", index, 0), n.binop("+", index, depth), index)
    index = n.call("ops.expand_dims", index, axis)
    positions = np.arange(depth, dtype=np.int64).reshape((depth,) + (1,) * (rank - axis))
    hot = n.call("ops.equal", index, n.const_tensor(positions, "positions"))
    values = n.const(2)
    if values is not None:
        if values.size != 2:
            n.fail(f"values must hold [off, on], got shape {list(values.shape)}")
        off, on = (n.const_tensor(np.asarray(v), name) for v, name in zip(values.reshape(-1), ("off", "on")))
    else:
        off, on = n.getitem(n.x(2), 0), n.getitem(n.x(2), 1)
    return n.call("ops.where", hot, on, off)
