"""fuse-quant-matmul: the fusion coverage of MatMulNBits as mindspore::WeightQuantBatchMatmul.

The fused op is written on load, not here: graphconv/frontend/contrib/quant.py decomposes a 4-bit MatMulNBits
of whole blocks (block_size a multiple of 32) directly into mindspore::WeightQuantBatchMatmul, its weight
re-laid as qint4x2 [N, K/2], because that is where the packed bytes, the scales and the zero points are read
(and onnxsim, which runs between load and the passes, would otherwise fold the dequantization into float
weights: the weights are held out of it, graphconv/pipeline.py). Recognising the decomposition's unpack +
MatMul here instead would match some twenty nodes to recover what the load already knew. The constraints
(opmap/fused/weight_quant_batch_matmul.py: the group a multiple of 32 in [32, K-1], K and N at most 65535, K
even) are static (K, N and the block are attributes), so the load checks them with the record's `broken`;
a MatMulNBits that fails them, or is not 4-bit, keeps today's decomposition (unpack with BitShift, float
MatMul), and its MatMul carries the reason in its doc_string (quant.NOT_FUSED).

This pass reads them: its count is the WeightQuantBatchMatmul nodes in the graph (after fuse-swiglu merged a
gate/up pair into one), and each dequantized MatMul is a candidate of the family `quant_matmul`, refused with
its reason (e.g. `bits=8 (only 4-bit weights are emitted, as qint4x2)`). Disabling it changes nothing but the
report.
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
    """Every MatMul of a MatMulNBits dequantized in the network (its doc_string says why)."""
    return [n for n in graph if n.op_type == "MatMul" and is_default_domain(n.domain) and _reason(n)]


@register_pass("fuse-quant-matmul", "report MatMulNBits written as mindspore::WeightQuantBatchMatmul on load, "
               "and why the others are dequantized in the network")
def apply(model: ir.Model) -> PassResult:
    fused = sum(1 for n in model.graph if n.op_type == "WeightQuantBatchMatmul" and n.domain == "mindspore")
    return PassResult(fused, node_reasons={n.name: _reason(n) for n in candidates(model.graph)})


coverage.register_family(coverage.Family("quant_matmul", ("fuse-quant-matmul",), candidates, _reason))
