"""graphconv::AllReduce: the sum over the tensor-parallel ranks after a row-parallel projection
(graphconv/target/sharding.py makes it).

Both targets lower it to `ops.AllReduce` (HCCL on Ascend; MindSpore's CPU collectives under msrun, which
the compile's verification uses), so the cpu form keeps the node rather than inlining its ONNX body, the one
rank's identity (opmap.fused.inline_fused inlines the `mindspore` domain only).
"""

from __future__ import annotations

from opmap.registry import register


@register("AllReduce", since=1, domain="graphconv")
def all_reduce(n):
    return n.call(n.helper("all_reduce"), n.x(0))
