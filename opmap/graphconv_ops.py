"""The graphconv-op record: each op of the `graphconv` domain, defined once, as opmap/fused/record.py defines
the `mindspore` fused ops. graphconv makes these ops itself (a pass or the sharding plan) and lowers them as
they are on both targets, so none is inlined into the cpu form: KVCacheUpdate writes a Parameter in place,
AllReduce and AllGather are collectives, SDPA never reaches the lowering (fuse-attention takes it to
FlashAttentionScore or expands it back). A GraphconvOp gives the name, inputs, outputs and attributes its
maker writes and its lowering reads, what it computes, and where one exists its ONNX function body (what
onnxruntime runs in its place)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphconv.onnx_domains import GRAPHCONV_DOMAIN

DOMAIN = GRAPHCONV_DOMAIN


@dataclasses.dataclass(frozen=True)
class GraphconvOp:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    doc: str  # what it computes, in one paragraph (the function body's doc string)
    producer: str  # the module that makes it
    lowering: str  # the module that lowers it, or how it leaves the graph before the lowering
    # (opset, the op's own parameters) -> the nodes of its ONNX function body; None: the op has no body
    body: Callable[..., list[onnx.NodeProto]] | None = None
    min_opset: int = 1  # the least default-domain opset the body imports (its ops' versions)

    def function(self, opset: int, **params) -> onnx.FunctionProto:
        """The op's model-local FunctionProto at the model's `opset`; `params` go to the body (AllGather's
        rank view)."""
        assert self.body is not None, f"graphconv::{self.name} has no function body"
        return helper.make_function(DOMAIN, self.name, list(self.inputs), list(self.outputs), self.body(**params),
                                    opset_imports=[helper.make_opsetid("", max(opset, self.min_opset))],
                                    attributes=list(self.attributes), doc_string=self.doc)


def _kv_cache_update_body() -> list[onnx.NodeProto]:
    return [
        helper.make_node("Constant", [], ["starts"], value=numpy_helper.from_array(np.array([0, 0], np.int64))),
        helper.make_node("Constant", [], ["axes02"], value=numpy_helper.from_array(np.array([0, 2], np.int64))),
        helper.make_node("ScatterND", ["cache", "indices", "new"], ["written"]),
        helper.make_node("Shape", ["new"], ["b1"], start=0, end=1),
        helper.make_node("Concat", ["b1", "total_length"], ["ends"], axis=0),
        helper.make_node("Slice", ["written", "starts", "ends", "axes02"], ["kv"]),
    ]


def _all_reduce_body() -> list[onnx.NodeProto]:
    return [helper.make_node("Identity", ["x"], ["y"])]


def _all_gather_body(rank: int, axis: int, sizes: list[int], ndim: int) -> list[onnx.NodeProto]:
    pads = [0] * (2 * ndim)
    pads[axis], pads[ndim + axis] = sum(sizes[:rank]), sum(sizes[rank + 1:])
    return [helper.make_node("Constant", [], ["pads"], value_ints=pads), helper.make_node("Pad", ["x", "pads"], ["y"])]


KV_CACHE_UPDATE = GraphconvOp(
    "KVCacheUpdate", ("cache", "new", "indices", "total_length"), ("kv",), (),
    doc="KVCacheUpdate(cache [MB, N, MS, D], new [B, N, q, D], indices int64 [B, N, q, 3], total_length int64 [1]) "
        "-> kv [B, N, total, D]: `cache` with new[b, n, j] written at indices[b, n, j] (b, n, past + j), then its "
        "first B rows and `total` (past + q) positions.",
    producer="passes/stateful_cache.py", lowering="opmap/kv_cache.py",
    body=_kv_cache_update_body, min_opset=13)  # (Slice and ScatterND take their 13 forms)

ALL_REDUCE = GraphconvOp(
    "AllReduce", ("x",), ("y",), (),
    doc="graphconv::AllReduce(x) -> y: the sum of x over the ranks. The body is one rank's view (the identity): "
        "onnxruntime runs a rank graph with it, and tests sum the ranks' partial values where it sits. It is "
        "lowered to ops.AllReduce on both targets (opmap/collective.py), never inlined.",
    producer="graphconv/parallel/sharding.py", lowering="opmap/collective.py", body=_all_reduce_body)

ALL_GATHER = GraphconvOp(
    "AllGather", ("x",), ("y",), ("axis",),
    doc="graphconv::AllGather(x; axis) -> y: the ranks' x concatenated along `axis` in rank order. The body is "
        "rank `rank`'s view, as AllReduce's is: its x padded with zeros to its place in y (the gather where every "
        "other rank's part is zero), so y has the gathered shape and the ranks' bodies sum to the gathered value. "
        "Lowered to ops.AllGather (axis 0) between transposes (opmap/collective.py), never inlined.",
    producer="graphconv/parallel/sharding.py", lowering="opmap/collective.py", body=_all_gather_body)

SDPA = GraphconvOp(
    "SDPA", ("q", "k", "v", "mask", "bias"), ("out",),
    ("scale", "mask_kind", "mask_proven", "fill", "safe_softmax", "fp32_softmax"),
    doc="SDPA(q, k, v[, mask][, bias]) -> out = Softmax(scale * q @ k^T + bias + M) @ v, the intermediate op "
        "between fuse-attention's stages (passes/attention/sdpa.py gives the whole definition).",
    producer="passes/attention/scores.py",
    lowering="none: fuse-attention takes it to FlashAttentionScore or expands it back (sdpa.expand_leftovers)")

GRAPHCONV_OPS: dict[str, GraphconvOp] = {op.name: op for op in (KV_CACHE_UPDATE, ALL_REDUCE, ALL_GATHER, SDPA)}
