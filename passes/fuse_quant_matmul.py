"""fuse-quant-matmul: the fusion coverage of weight-quantized MatMuls as mindspore::WeightQuantBatchMatmul.

The fused op is written on load, not here, from two sources: graphconv/frontend/contrib/quant.py decomposes a
4-bit or 8-bit MatMulNBits of whole blocks (block_size a multiple of 32) directly into
mindspore::WeightQuantBatchMatmul, its weight re-laid as qint4x2 [N, K/2] or int8 [N, K], because that is
where the packed bytes, the scales and the zero points are read (and onnxsim, which runs between load and the
passes, would otherwise fold the dequantization into float weights: the weights are held out of it,
graphconv/pipeline.py); graphconv/frontend/weight_only_qdq.py writes a weight-only MatMul(x,
DequantizeLinear(W_q)) (int8 / uint8 per channel or per tensor, int4 / uint4 in blocks along K) as the same op,
before any stage reads its 4-bit initializer. Recognising the decomposition's unpack + MatMul here instead
would match some twenty nodes to recover what the load already knew. The constraints
(opmap/fused/weight_quant_batch_matmul.py: the group 0 or a multiple of 32 in [32, K-1], K and N at most
65535, K even for 4 bits) are static (K, N and the block are attributes or initializer shapes), so the load
checks them with the record's `broken`; a form that fails them keeps today's path (MatMulNBits' decomposition,
unpacking with BitShift and a float MatMul; DequantizeLinear and a float MatMul), and its MatMul carries the
reason in its doc_string (quant.NOT_FUSED).

This pass reads them: its count is the WeightQuantBatchMatmul nodes in the graph (after fuse-swiglu merged a
gate/up pair into one), and each dequantized MatMul is a candidate of the family `quant_matmul`, refused with
its reason (e.g. `bits=2 (WeightQuantBatchMatmul takes 4-bit weights, as qint4x2, and 8-bit ones, as int8)`).
A MatMul whose x is dequantized too (activations quantized: not weight-only) is none of its candidates.
Disabling it changes nothing but the report.
"""

from __future__ import annotations

import onnx_ir as ir

from graphconv.frontend.contrib.quant import NOT_FUSED
from graphconv.onnx_domains import is_default_domain
from passes import coverage
from passes.manager import PassResult, register_pass


def _reason(node: ir.Node) -> str | None:
    doc = node.doc_string or ""
    return doc[len(NOT_FUSED):] if doc.startswith(NOT_FUSED) else None


def candidates(graph: ir.Graph) -> list[ir.Node]:
    """Every MatMul of a MatMulNBits or of a weight-only DequantizeLinear dequantized in the network (its
    doc_string says why)."""
    return [n for n in graph if n.op_type == "MatMul" and is_default_domain(n.domain) and _reason(n)]


@register_pass("fuse-quant-matmul", "report MatMulNBits and weight-only QDQ MatMuls written as "
               "mindspore::WeightQuantBatchMatmul on load, and why the others are dequantized in the network")
def apply(model: ir.Model) -> PassResult:
    fused = sum(1 for n in model.graph if n.op_type == "WeightQuantBatchMatmul" and n.domain == "mindspore")
    return PassResult(fused, node_reasons={n.name: _reason(n) for n in candidates(model.graph)})


coverage.register_family(coverage.Family("quant_matmul", ("fuse-quant-matmul",), candidates, _reason))
