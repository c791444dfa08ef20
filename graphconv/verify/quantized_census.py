"""The report's answer to a quantized model's question: do its linears run on Ascend's low-bit kernels?

Counted twice. On load (`at_load`), each quantized linear the model brings is one of two things: a low-bit
primitive node (mindspore::WeightQuantBatchMatmul or QuantBatchMatmul, written where the quantized contrib op
is read, graphconv/frontend/contrib/quant.py), or a float MatMul that dequantizes its weight in the network,
whose doc_string carries the reason (quant.NOT_FUSED). After emission (`finish`), the MindIR says what
runs: the low-bit primitives of its census (fewer than the linears where fuse-swiglu merged a gate/up pair
into one) and the bytes of their integer weights (QINT4X2 or INT8 Parameters), per parameter of the linears
they carry (0.5 for int4; the scales and offsets are apart).
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

LOW_BIT = ("WeightQuantBatchMatmul", "QuantBatchMatmul", "QuantV2", "DynamicQuantExt", "GroupedMatmul")
_LINEARS = ("WeightQuantBatchMatmul", "QuantBatchMatmul")
_INTEGER_WEIGHTS = ("QINT4X2", "INT8")


@dataclasses.dataclass
class QuantizedLinears:
    """The quantized linears of a model and where they run (report field `quantized_linears`)."""

    linears: int = 0
    on_low_bit_primitives: int = 0
    fell_back: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> linears
    parameters: int = 0  # K * N summed over the linears on a low-bit primitive
    primitives: dict[str, int] = dataclasses.field(default_factory=dict)  # the MindIR's census of LOW_BIT
    integer_weight_bytes: int | None = None
    bytes_per_parameter: float | None = None

    def summary(self) -> str:
        line = f"quantized linears: {self.on_low_bit_primitives}/{self.linears} on low-bit primitives"
        if self.primitives:
            line += f" ({', '.join(f'{v} {k}' for k, v in sorted(self.primitives.items()))})"
        if self.bytes_per_parameter is not None:
            line += f", {self.bytes_per_parameter:.3g} weight bytes per parameter"
        if self.fell_back:
            line += "; dequantized in the network: " + "; ".join(f"{n} × {r}" for r, n in self.fell_back.items())
        return line


def at_load(model) -> QuantizedLinears | None:
    """The quantized linears of the loaded onnx.ModelProto (None: it has none)."""
    from graphconv.frontend.contrib.quant import NOT_FUSED

    found = QuantizedLinears()
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    reasons: collections.Counter[str] = collections.Counter()
    for node in model.graph.node:
        if node.domain == "mindspore" and node.op_type in _LINEARS:
            found.on_low_bit_primitives += 1
            found.parameters += _parameters(node, shapes)
        elif node.op_type == "MatMul" and (node.doc_string or "").startswith(NOT_FUSED):
            reasons[node.doc_string[len(NOT_FUSED):]] += 1
    found.fell_back = dict(reasons.most_common())
    found.linears = found.on_low_bit_primitives + sum(reasons.values())
    return found if found.linears else None


def _parameters(node, shapes: dict[str, list[int]]) -> int:
    """K * N of a low-bit linear, from its weight [N, K / per byte] and, per group of g, its scales (K / g, N)."""
    import onnx

    weight = shapes.get(node.input[1]) if len(node.input) > 1 else None
    if not weight or len(weight) != 2:
        return 0
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    group = attrs.get("antiquant_group_size", 0)
    scale = shapes.get(node.input[2]) if len(node.input) > 2 else None
    k = scale[0] * group if group and scale and len(scale) == 2 else weight[1]
    return weight[0] * k


def finish(found: QuantizedLinears, mindir: Path, census: dict[str, int]) -> None:
    """What the emitted MindIR runs: its low-bit primitives and their integer weights' bytes."""
    from graphconv.verify.census import mind_ir_pb2, read_mindir

    found.primitives = {k: census[k] for k in LOW_BIT if census.get(k)}
    pb2 = mind_ir_pb2()
    kinds = {pb2.TensorProto.DataType.Value(k) for k in _INTEGER_WEIGHTS}
    proto = read_mindir(mindir)
    found.integer_weight_bytes = sum(len(p.raw_data) for p in proto.graph.parameter if p.data_type in kinds)
    if found.parameters and found.primitives:
        found.bytes_per_parameter = round(found.integer_weight_bytes / found.parameters, 4)
