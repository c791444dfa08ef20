"""Text features: TfIdfVectorizer (opset 9), as the ONNX reference counts n-grams.

For each pool n-gram g of length n in [min_gram_length, max_gram_length] and each skip distance d (d = 1 only
for unigrams, 1 .. max_skip_count + 1 otherwise), the count of positions i with X[i + j d] == g[j] for all j is
a compile-time unrolled sum of elementwise comparisons of shifted slices; counts land on ngram_indexes and are
weighted by mode (TF: counts, IDF: weight (or 1) where the count is positive, TFIDF: weight * count). Integer
pools only (pool_strings: MindSpore has no string tensors).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register


@register("TfIdfVectorizer", since=9)
def tf_idf_vectorizer(n):
    if n.attr("pool_strings"):
        n.fail("string pools are not supported (MindSpore has no string tensors)")
    shape = n.shape(0)
    if shape is None or len(shape) not in (1, 2) or not isinstance(shape[-1], int):
        n.fail("the input must be [C] or [B, C] with a static C")
    length = shape[-1]
    lo, hi = int(n.attr("min_gram_length")), int(n.attr("max_gram_length"))
    skips = int(n.attr("max_skip_count"))
    counts = list(n.attr("ngram_counts"))
    indexes = list(n.attr("ngram_indexes"))
    pool = list(n.attr("pool_int64s") or [])
    weights = n.attr("weights")
    mode = text(n.attr("mode"))
    out_size = max(indexes) + 1
    f32 = n.ms_dtype(ir.DataType.FLOAT)
    x = n.x(0) if len(shape) == 2 else n.call("ops.expand_dims", n.x(0), 0)
    x = n.call("ops.cast", x, n.ms_dtype(ir.DataType.INT64))
    per_index: dict[int, list] = {}
    gram_id = 0
    for size, start in enumerate(counts, start=1):
        end = counts[size] if size < len(counts) else len(pool)
        grams = [pool[k:k + size] for k in range(start, end, size)]
        if gram_id + len(grams) > len(indexes):
            n.fail("ngram_indexes has fewer entries than the pool has n-grams")
        for gram in grams:
            index = indexes[gram_id]
            gram_id += 1
            if not lo <= size <= hi:
                continue
            for d in ([1] if size == 1 else range(1, skips + 2)):
                span = length - (size - 1) * d
                if span <= 0:
                    continue
                hits = [n.call("ops.equal", n.getitem(x, (slice(None), slice(j * d, j * d + span))), int(v))
                        for j, v in enumerate(gram)]
                count = n.call("ops.sum", n.call("ops.cast", _chain(n, "&", hits), f32), 1)
                per_index.setdefault(index, []).append(count)
    columns = []
    zero = None
    for index in range(out_size):
        terms = per_index.get(index)
        if not terms and zero is None:
            zero = n.call("ops.zeros", (n.getitem(n.call("ops.dyn_shape", x), 0),), f32)
        columns.append(_chain(n, "+", terms) if terms else zero)
    tf = n.call("ops.stack", tuple(columns), 1)
    if mode == "TF":
        y = tf
    elif mode == "IDF":
        w = n.const_tensor(np.asarray(weights if weights else [1.0] * out_size, np.float32), "idf")
        y = n.call("ops.where", n.binop(">", tf, 0), n.call("ops.broadcast_to", w, n.call("ops.dyn_shape", tf)),
                   n.call("ops.zeros_like", tf))
    elif mode == "TFIDF":
        y = n.binop("*", tf, n.const_tensor(np.asarray(weights, np.float32), "idf")) if weights else tf
    else:
        n.fail(f"mode {mode!r} is not supported")
    return y if len(shape) == 2 else n.call("ops.squeeze", y, 0)


def _chain(n, op: str, items: list):
    """items[0] op items[1] op ... (left to right)."""
    acc = items[0]
    for item in items[1:]:
        acc = n.binop(op, acc, item)
    return acc
