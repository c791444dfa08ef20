"""The report's answer to a quantized model's question: do its linears run on Ascend's low-bit kernels?

Counted twice. On load (`at_load`), each quantized linear the model brings is found. A quantized contrib op
(MatMulNBits) is already one of two things there: a low-bit primitive node (mindspore::WeightQuantBatchMatmul,
written where the op is read, graphconv/frontend/contrib/quant.py), or a float MatMul that dequantizes its
weight in the network, whose doc_string carries the reason (quant.NOT_FUSED). A QDQ linear (a MatMul reading
a DequantizeLinear of an integer initializer) is decided by the passes: fuse-qdq-matmul either writes it as
QuantV2 + QuantBatchMatmul or leaves it, and its coverage gives the reason. After emission (`finish`), the
coverage settles the QDQ linears and the MindIR says what runs: the low-bit primitives of its census (fewer
than the linears where fuse-swiglu merged a gate/up pair into one) and the bytes of their integer weights
(QINT4X2 or INT8 Parameters) per parameter they hold (0.5 for int4, 1 for int8; scales and offsets apart).
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

LOW_BIT = ("WeightQuantBatchMatmul", "QuantBatchMatmul", "QuantV2", "DynamicQuantExt", "GroupedMatmul")
_LINEARS = ("WeightQuantBatchMatmul", "QuantBatchMatmul")
_INTEGER_TYPES = (2, 3)  # onnx UINT8, INT8


@dataclasses.dataclass
class QuantizedLinears:
    """The quantized linears of a model and where they run (report field `quantized_linears`)."""

    linears: int = 0
    on_low_bit_primitives: int = 0
    qdq: list[str] = dataclasses.field(default_factory=list)  # the QDQ linears' MatMuls, settled by `finish`
    fell_back: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> linears
    parameters: int = 0  # the values the MindIR's integer weights hold
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
    integer = {t.name for t in model.graph.initializer if t.data_type in _INTEGER_TYPES}
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and not n.domain
                   and n.input and n.input[0] in integer}
    reasons: collections.Counter[str] = collections.Counter()
    for node in model.graph.node:
        if node.domain == "mindspore" and node.op_type in _LINEARS:
            found.on_low_bit_primitives += 1
        elif node.op_type == "MatMul" and (node.doc_string or "").startswith(NOT_FUSED):
            reasons[node.doc_string[len(NOT_FUSED):]] += 1
        elif node.op_type == "MatMul" and not node.domain and any(i in dequantized for i in node.input):
            found.qdq.append(node.name)
    found.fell_back = dict(reasons.most_common())
    found.linears = found.on_low_bit_primitives + sum(reasons.values()) + len(found.qdq)
    return found if found.linears else None


def finish(found: QuantizedLinears, mindir: Path, census: dict[str, int], coverage: dict[str, dict]) -> None:
    """The QDQ linears settled by fuse-qdq-matmul's coverage; what the emitted MindIR runs: its low-bit
    primitives and their integer weights' bytes per parameter."""
    from graphconv.verify.census import mind_ir_pb2, read_mindir

    qdq = set(found.qdq)
    refused = [item for item in coverage.get("qdq_matmul", {}).get("items", []) if item.get("node") in qdq]
    reasons = collections.Counter({**found.fell_back})
    for item in refused:
        reasons[item.get("reason", "not fused")] += 1
    found.fell_back = dict(reasons.most_common())
    found.on_low_bit_primitives += len(qdq) - len(refused)
    found.qdq = []
    found.primitives = {k: census[k] for k in LOW_BIT if census.get(k)}
    pb2 = mind_ir_pb2()
    per_byte = {pb2.TensorProto.DataType.Value("QINT4X2"): 2, pb2.TensorProto.DataType.Value("INT8"): 1}
    held = [(len(p.raw_data), per_byte[p.data_type]) for p in read_mindir(mindir).graph.parameter
            if p.data_type in per_byte]
    found.integer_weight_bytes = sum(b for b, _ in held)
    found.parameters = sum(b * k for b, k in held)
    if found.parameters and found.primitives:  # (a cpu MindIR holds the cpu twins' int8 containers instead)
        found.bytes_per_parameter = round(found.integer_weight_bytes / found.parameters, 4)
