"""graphconv::KVCacheUpdate: a KV cache held in place (passes/stateful_cache.py makes it from a with-past graph).

Both targets lower it the same way, with `ops.scatter_nd_update` on the cache's Parameter (the helper
kv_cache_update): a MindSpore Parameter written by a scatter inside a MindIR loaded as a GraphCell keeps its
values from call to call, on CPU as on Ascend, so the cpu form keeps this node rather than inlining its ONNX
function body (which computes the same write and read on a cache passed in: opmap/fused.inline_fused).
"""

from __future__ import annotations

from opmap.graphconv_ops import DOMAIN, KV_CACHE_UPDATE
from opmap.registry import register


@register(KV_CACHE_UPDATE.name, since=1, domain=DOMAIN)
def kv_cache_update(n):
    cache = n.x(0)
    if getattr(getattr(cache, "attr", None), "param", None) is None:  # (not self.<Parameter>)
        n.fail("the cache (input 0) must be an initializer: it becomes the Parameter written in place")
    if n.rank(0) != 4 or n.rank(1) != 4:
        n.fail("the cache is [max batch, kv heads, max seq, head dim] and the new values [batch, kv heads, q, "
               "head dim]")
    return n.call(n.helper("kv_cache_update"), cache, n.x(1), n.x(2), n.x(3))
