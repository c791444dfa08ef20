"""The input sizes onnxruntime's contrib kernels accept, for the reference cases graphconv makes itself.

GroupQueryAttention (onnxruntime-genai's model builder graphs) runs a prompt with an empty cache (past length
0) and, at batch > 1, a cache with exactly one new token; only at batch 1 does it take several new tokens
over a non-empty cache. Its cache inputs' head dim is symbolic in the builder's graphs (`kv_cache_dim`) but
must equal the head size. So a graph with GroupQueryAttention over graph-input caches is verified on the two
cases a generation runs: a prompt (5 tokens, past 0) and a decode step (1 token, past 7), with the head dim
bound to the head size. It reads the attention mask only as lengths (seqlens_k, total_sequence_length):
a shorter row means right padding, whose rows' outputs onnxruntime leaves undefined, so its cases use full
masks (`pads_masks`).
"""

from __future__ import annotations

import onnx

from graphconv.frontend.contrib.registry import MICROSOFT
from graphconv.frontend.contrib.rewrite import static_shapes

PROMPT = (5, 0)  # (new tokens, past length) of the prompt case
DECODE = (1, 7)  # ... and of the decode step


def _gqa_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == MICROSOFT and n.op_type == "GroupQueryAttention"]


def pads_masks(model: onnx.ModelProto) -> bool:
    """Whether generated cases may left-pad attention masks (not when GroupQueryAttention reads them)."""
    return not _gqa_nodes(model)


def case_dims(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Sizes (case 0, case 1) of the symbolic dims GroupQueryAttention constrains, by dim name."""
    nodes = _gqa_nodes(model)
    inputs = {i.name for i in model.graph.input}
    if not nodes or not any(len(n.input) > 3 and n.input[3] in inputs for n in nodes):
        return {}
    shapes = static_shapes(model)
    out: dict[str, tuple[int, int]] = {}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        query, past = shapes.get(node.input[0], ([], 0))[0], shapes.get(node.input[3], ([], 0))[0]
        if len(query) != 3 or len(past) != 4 or node.input[3] not in inputs:
            continue
        if isinstance(query[1], str):
            out[query[1]] = (PROMPT[0], DECODE[0])
        if isinstance(past[2], str):
            out[past[2]] = (PROMPT[1], DECODE[1])
        heads = attrs.get("num_heads", 0) + (2 * attrs.get("kv_num_heads", 0) if len(node.input) < 2 or
                                             not node.input[1] else 0)
        if isinstance(past[3], str) and isinstance(query[2], int) and heads:
            out[past[3]] = (query[2] // heads,) * 2
    return out
