"""RotaryEmbedding (opset 23), as the ONNX reference computes it.

X is (B, heads, S, head) or (B, S, hidden) with num_heads; the first rotary_embedding_dim (default: all) of
each head rotate, the rest pass through. cos/sin caches are (max_pos, rot/2) indexed by position_ids (B, S),
or already (B, S, rot/2) without position_ids. interleaved=1 pairs (x[2i], x[2i+1]), else the two halves.
"""

from __future__ import annotations

import numpy as np

from opmap.registry import register


@register("RotaryEmbedding", since=23)
def rotary_embedding(n):
    rank = n.require_rank(0)
    shape = n.shape(0)
    x = n.x(0)
    if rank == 4:
        head = shape[3]
        x = n.call("ops.transpose", x, (0, 2, 1, 3))
    elif rank == 3:
        heads = n.attr("num_heads", 0)
        if not heads or not isinstance(shape[2], int):
            n.fail("3-D input needs num_heads and a static hidden size")
        head = shape[2] // heads
        shape4 = n.const_tensor(np.array([0, 0, heads, head], np.int64), "shape")
        x = n.call(n.helper("onnx_reshape"), x, shape4)
    else:
        n.fail(f"rank {rank} input is not supported")
    if not isinstance(head, int):
        n.fail("the head size must be static")
    rot = n.attr("rotary_embedding_dim", 0) or head
    half = rot // 2
    cos, sin = n.x(1), n.x(2)
    if n.has(3):
        cos, sin = n.call("ops.gather", cos, n.x(3), 0), n.call("ops.gather", sin, n.x(3), 0)
    cos = n.call("ops.expand_dims", cos, 2)
    sin = n.call("ops.expand_dims", sin, 2)
    if n.attr("interleaved", 0):
        x1, x2 = n.getitem(x, (Ellipsis, slice(0, rot, 2))), n.getitem(x, (Ellipsis, slice(1, rot, 2)))
    else:
        x1, x2 = n.getitem(x, (Ellipsis, slice(0, half))), n.getitem(x, (Ellipsis, slice(half, rot)))
    real = n.binop("-", n.binop("*", cos, x1), n.binop("*", sin, x2))
    imag = n.binop("+", n.binop("*", sin, x1), n.binop("*", cos, x2))
    if n.attr("interleaved", 0):
        rotated = n.call("ops.flatten", n.call("ops.stack", (real, imag), -1), start_dim=3)
    else:
        rotated = n.call("ops.concat", (real, imag), -1)
    y = rotated if rot == head else n.call("ops.concat", (rotated, n.getitem(x, (Ellipsis, slice(rot, None)))), -1)
    if rank == 4:
        return n.call("ops.transpose", y, (0, 2, 1, 3))
    return n.call("ops.flatten", y, start_dim=2)
