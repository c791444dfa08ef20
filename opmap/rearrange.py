"""DepthToSpace and SpaceToDepth: a reshape to six dims, a transpose, a reshape back (the ONNX spec's own
definition). Channels must be static; batch and spatial dims may be symbolic."""

from __future__ import annotations

import numpy as np

from opmap.registry import register


def _dims(n, x, spec):
    """The target shape of a reshape of input 0: each entry an int, or (i, k) for dim i times k, or (i, -k)
    for dim i divided by k. A tuple when every dim is known, else a shape computed at run time."""
    shape = n.shape(0)
    known = []
    for s in spec:
        if isinstance(s, int):
            known.append(s)
        else:
            i, k = s
            d = shape[i]
            known.append((d * k if k > 0 else d // -k) if isinstance(d, int) else None)
    if all(d is not None for d in known):
        return tuple(known)
    dyn = n.call("ops.dyn_shape", x)
    pieces = []
    for s, d in zip(spec, known):
        if d is not None:
            pieces.append(n.const_tensor(np.array([d], np.int64), "dim"))
            continue
        i, k = s
        piece = n.getitem(dyn, slice(i, i + 1))
        pieces.append(n.binop("*", piece, k) if k > 0 else n.binop("//", piece, -k))
    return n.call(n.helper("onnx_dims"), n.call("ops.concat", tuple(pieces)))


def _static_channels(n, blocks: int, divide: bool) -> int:
    if n.require_rank(0) != 4:
        n.fail("only 4-D (N, C, H, W) inputs are defined")
    c = n.shape(0)[1]
    if not isinstance(c, int):
        n.fail("the channel dim must be static")
    if divide and c % (blocks * blocks):
        n.fail(f"{c} channels are not divisible by blocksize^2 = {blocks * blocks}")
    return c


def _rearrange(n, first, perm, last):
    x = n.x(0)
    y = n.call("ops.transpose", n.call("ops.reshape", x, _dims(n, x, first)), perm)
    return n.call("ops.reshape", y, _dims(n, x, last))


@register("DepthToSpace", since=13)
def depth_to_space(n):
    b = int(n.attr("blocksize"))
    c = _static_channels(n, b, divide=True) // (b * b)
    last = [(0, 1), c, (2, b), (3, b)]
    if n.attr("mode", "DCR") == "CRD":
        return _rearrange(n, [(0, 1), c, b, b, (2, 1), (3, 1)], (0, 1, 4, 2, 5, 3), last)
    return _rearrange(n, [(0, 1), b, b, c, (2, 1), (3, 1)], (0, 3, 4, 1, 5, 2), last)


@register("SpaceToDepth", since=13)
def space_to_depth(n):
    """Opset 28 adds mode: DCR (the only order before) or CRD, the inverses of DepthToSpace's."""
    b = int(n.attr("blocksize"))
    c = _static_channels(n, b, divide=False)
    first = [(0, 1), c, (2, -b), b, (3, -b), b]
    last = [(0, 1), c * b * b, (2, -b), (3, -b)]
    if n.attr("mode", "DCR") == "CRD":
        return _rearrange(n, first, (0, 1, 3, 5, 2, 4), last)
    return _rearrange(n, first, (0, 3, 5, 1, 2, 4), last)
