"""graphconv::AllReduce: the sum over the tensor-parallel ranks after a row-parallel projection, and
graphconv::AllGather: the ranks' parts concatenated after the vocab-parallel LM head (graphconv/parallel/sharding.py
makes both).

Both targets lower them to `ops.AllReduce` / `ops.AllGather` (HCCL on Ascend; MindSpore's CPU collectives
under msrun, which the compile's verification uses), so the cpu form keeps the nodes rather than inlining
their ONNX bodies, one rank's view (opmap.fused.inline_fused inlines the `mindspore` domain only).
"""

from __future__ import annotations

import numpy as np

from opmap.graphconv_ops import ALL_GATHER, ALL_REDUCE, DOMAIN
from opmap.registry import register


@register(ALL_REDUCE.name, since=1, domain=DOMAIN)
def all_reduce(n):
    return n.call(n.helper("all_reduce"), n.x(0))


@register(ALL_GATHER.name, since=1, domain=DOMAIN)
def all_gather(n):
    """ops.AllGather concatenates along axis 0: the gathered axis is moved there and back."""
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis"), rank)
    perm = (axis, *[i for i in range(rank) if i != axis])
    return n.call(n.helper("all_gather"), n.x(0), perm, tuple(int(i) for i in np.argsort(perm)))
