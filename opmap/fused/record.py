"""The fused-op record: each MindSpore fused operator's facts, defined once (opmap/fused/__init__.py
explains the table). Its own module so that the op modules and the package can both import it."""

from __future__ import annotations

import dataclasses
from typing import Callable

import onnx

DOMAIN = "mindspore"
DOMAIN_VERSION = 1
# CastLike's opset: from it on a body computes in an fp32 island (island_casts); below it, fp32 only.
ISLAND_OPSET = 15


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A documented limit of a fused primitive over named sizes of one call (B, N, S, D, ...), with its source.

    `holds(**sizes)` reads the sizes named in `reads`. Every limit here is an upper bound (a size below a
    maximum, a ratio below a maximum) or a property of a static size (D even), so it is checked at the largest
    size each dim can take: its --shape-range maximum, else its reference sizes (passes/dim_bounds.py). `when`:
    the attribute values it applies under (mode 1 only)."""

    text: str
    source: str
    reads: tuple[str, ...]
    holds: Callable[..., bool]
    when: tuple[tuple[str, int], ...] = ()

    def applies(self, attrs: dict) -> bool:
        return all(attrs.get(k) == v for k, v in self.when)


@dataclasses.dataclass(frozen=True)
class FusedOp:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    body: Callable[[int], list[onnx.NodeProto]]  # opset -> nodes of the function body
    primitive: str  # the MindSpore primitive the ascend lowering emits
    doc: str = ""
    # The body as the ascend lowering computes it when that differs in precision (e.g. q/k/v cast to fp16
    # around FlashAttentionScore): run by onnxruntime to measure the cast's effect, never lowered.
    ascend_body: Callable[[int], list[onnx.NodeProto]] | None = None
    # The op's other facts, in this one record (read by the passes' docs, precision, debug, the bundle):
    producer: str = ""  # the pass that makes it
    family: str = ""  # its fusion-coverage family (passes/coverage.py)
    as_is_inputs: tuple[int, ...] = ()  # inputs --precision leaves in their dtype (a mask is not data)
    ascend_compute: str | None = None  # "fp16": the ascend lowering computes in fp16 whatever the model's dtype
    likely_causes: str = ""  # what usually makes it disagree (graphconv debug)
    constraints: tuple[Constraint, ...] = ()  # its documented size limits, checked by the pass that makes it

    def broken(self, sizes: dict, attrs: dict | None = None) -> Constraint | None:
        """The first constraint these sizes break (None: all hold, or cannot be checked: a size is unknown)."""
        for c in self.constraints:
            if c.applies(attrs or {}) and all(sizes.get(r) is not None for r in c.reads) and \
                    not c.holds(**{r: sizes[r] for r in c.reads}):
                return c
        return None

    def function(self, opset: int, ascend_precision: bool = False) -> onnx.FunctionProto:
        body = self.ascend_body if ascend_precision and self.ascend_body else self.body
        return onnx.helper.make_function(
            DOMAIN, self.name, list(self.inputs), list(self.outputs), body(opset),
            opset_imports=[onnx.helper.make_opsetid("", opset)], attributes=list(self.attributes),
            doc_string=self.doc)


FUSED_OPS: dict[str, FusedOp] = {}


# MindSpore fused primitives graphconv recognises in a MindIR without emitting them (primitive -> "fp16"
# where it computes in fp16 only, like FlashAttentionScore).
READ_ONLY_PRIMITIVES = {"AddRmsNorm": None, "LayerNormExt": None, "PromptFlashAttention": "fp16",
                        "IncreFlashAttention": "fp16"}


def fused_primitives() -> set[str]:
    """Every fused primitive: those of the table and the read-only ones (inspect, matrix census)."""
    return {op.primitive for op in FUSED_OPS.values()} | set(READ_ONLY_PRIMITIVES)


def fp16_primitives() -> set[str]:
    """Primitives that compute in fp16 on Ascend (a device run is held to the fp16 tolerance)."""
    return ({op.primitive for op in FUSED_OPS.values() if op.ascend_compute == "fp16"}
            | {p for p, dtype in READ_ONLY_PRIMITIVES.items() if dtype == "fp16"})


def island_casts(opset: int) -> bool:
    """Whether a body at `opset` computes in an fp32 island (inputs Cast to fp32, the result CastLike back).
    Before opset 15 (ISLAND_OPSET) there is no CastLike to return to the input's dtype: the body then computes
    in that dtype, and the fusions take fp32 inputs only there (match.float_guard)."""
    return opset >= ISLAND_OPSET


def to_fp32(opset: int, src: str, dst: str) -> onnx.NodeProto:
    """`src` into the fp32 island as `dst` (an Identity where the body does not cast: island_casts)."""
    if island_casts(opset):
        return onnx.helper.make_node("Cast", [src], [dst], to=onnx.TensorProto.FLOAT)
    return onnx.helper.make_node("Identity", [src], [dst])


def from_fp32(opset: int, src: str, like: str, dst: str) -> onnx.NodeProto:
    """The island's result `src` back in `like`'s dtype as `dst` (an Identity where the body does not cast)."""
    if island_casts(opset):
        return onnx.helper.make_node("CastLike", [src, like], [dst])
    return onnx.helper.make_node("Identity", [src], [dst])


def rounded_to_fp32(src: str, dst: str, round_to: int | None) -> list[onnx.NodeProto]:
    """`src` cast to fp32 as `dst`. With round_to (a TensorProto dtype) it is rounded through that dtype first,
    as an ascend lowering that computes in that dtype rounds its inputs (a FusedOp's ascend_body)."""
    if round_to is None:
        return [onnx.helper.make_node("Cast", [src], [dst], to=onnx.TensorProto.FLOAT)]
    return [onnx.helper.make_node("Cast", [src], [dst + "_lp"], to=round_to),
            onnx.helper.make_node("Cast", [dst + "_lp"], [dst], to=onnx.TensorProto.FLOAT)]


def fp32_island(opset: int, core: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """A body computed in fp32: x -> x32, `core` computes y32 from x32 (and casts any other input it
    reads with to_fp32), y32 -> y in x's dtype."""
    return [to_fp32(opset, "x", "x32"), *core, from_fp32(opset, "y32", "x", "y")]


def attr_constant(name: str, kind: str, attr: str) -> onnx.NodeProto:
    """A body's Constant node whose `kind` (value_float or value_int) is the calling node's attribute `attr`."""
    node = onnx.helper.make_node("Constant", [], [name])
    node.attribute.append(onnx.helper.make_attribute_ref(
        kind, onnx.AttributeProto.FLOAT if kind == "value_float" else onnx.AttributeProto.INT, ref_attr_name=attr))
    return node


def int64_constant(name: str, value) -> onnx.NodeProto:
    """A body's Constant node holding an int64 scalar or vector."""
    import numpy as np

    return onnx.helper.make_node("Constant", [], [name],
                                 value=onnx.numpy_helper.from_array(np.array(value, np.int64), name))


def define(op: FusedOp) -> FusedOp:
    FUSED_OPS[op.name] = op
    return op


