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
        x = n.tmp(f"ops.transpose({x}, (0, 2, 1, 3))", "bshd")
    elif rank == 3:
        heads = n.attr("num_heads", 0)
        if not heads or not isinstance(shape[2], int):
            n.fail("3-D input needs num_heads and a static hidden size")
        head = shape[2] // heads
        shape4 = n.const_tensor(np.array([0, 0, heads, head], np.int64), "shape")
        x = n.tmp(f"{n.helper('onnx_reshape')}({x}, {shape4})", "bshd")
    else:
        n.fail(f"rank {rank} input is not supported")
    if not isinstance(head, int):
        n.fail("the head size must be static")
    rot = n.attr("rotary_embedding_dim", 0) or head
    half = rot // 2
    cos, sin = n.x(1), n.x(2)
    if n.has(3):
        cos, sin = f"ops.gather({cos}, {n.x(3)}, 0)", f"ops.gather({sin}, {n.x(3)}, 0)"
    cos = n.tmp(f"ops.expand_dims({cos}, 2)", "cos")
    sin = n.tmp(f"ops.expand_dims({sin}, 2)", "sin")
    if n.attr("interleaved", 0):
        x1, x2 = f"{x}[..., 0:{rot}:2]", f"{x}[..., 1:{rot}:2]"
    else:
        x1, x2 = f"{x}[..., 0:{half}]", f"{x}[..., {half}:{rot}]"
    x1, x2 = n.tmp(x1, "x1"), n.tmp(x2, "x2")
    real = n.tmp(f"{cos} * {x1} - {sin} * {x2}", "real")
    imag = n.tmp(f"{sin} * {x1} + {cos} * {x2}", "imag")
    if n.attr("interleaved", 0):
        rotated = f"ops.flatten(ops.stack(({real}, {imag}), -1), start_dim=3)"
    else:
        rotated = f"ops.concat(({real}, {imag}), -1)"
    y = rotated if rot == head else f"ops.concat(({rotated}, {x}[..., {rot}:]), -1)"
    y = n.tmp(y, "rotated")
    if rank == 4:
        return f"ops.transpose({y}, (0, 2, 1, 3))"
    return f"ops.flatten({y}, start_dim=2)"
