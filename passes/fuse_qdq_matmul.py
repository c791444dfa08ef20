"""fuse-qdq-matmul: static W8A8 QDQ linears -> mindspore::QuantV2 + mindspore::QuantBatchMatmul.

Matched (what onnxruntime's quantize_static writes in QuantFormat.QDQ for a MatMul):
    MatMul(DequantizeLinear(QuantizeLinear(x, s_x, zp_x), s_x, zp_x), DequantizeLinear(W, s_w[, zp_w][, axis]))
    x float (fp32, fp16, bf16) of static last dim K; s_x and zp_x constant scalars, the same values on the Q and
    the DQ; zp_x int8, or uint8 (the activation is shifted to int8: q - 128, zp - 128, exact); W a constant
    2-D [K, N] int8 with zero points 0 (or uint8 with zero points 128, shifted the same way); s_w one scalar
    (per tensor) or [N] along axis 1 (per output channel).
Rewritten to QuantBatchMatmul(QuantV2(x, s_x, zp), W^T [N, K], s_x * s_w [N], -zp * sum_k W[n, k]; dtype of
x) (opmap/fused/quant_batch_matmul.py: the records and their exact integer bodies). One QuantV2 per quantized
activation, shared by the MatMuls that read it (q, k and v projections); a bias Add after the MatMul stays
as it is (folding a float bias into the int32 bias would round it). The Q/DQ pair and the weight's DQ are
removed once nothing else reads them; the int8 weight is stored once, transposed.

The pass runs before the norm, gated-MLP and attention fusions, so that they see the quantized linears as
they see float ones (fuse-swiglu merges a gate/up pair of QuantBatchMatmuls on one QuantV2). A Q/DQ pair
anywhere else (on a MatMul's output, on attention scores) is left as it is: the fusion whose pattern it sits
in does not fire and its coverage names the unmatched node; nothing drops a rounding.

onnxsim keeps DequantizeLinear of a constant (it does not fold QDQ), so the int8 weights reach this pass.

Coverage (family `qdq_matmul`): every MatMul with an input computed by a DequantizeLinear; one not fused says
why (e.g. `asymmetric int8 weight (zero points != 0): QuantBatchMatmul has no weight offset`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphconv.frontend.param_names import record_made
from graphconv.onnx_domains import is_default_domain
from opmap.fused.quant_batch_matmul import FP16_MAX
from passes import coverage, match
from passes.manager import PassResult, register_pass

_INT8, _UINT8 = ir.DataType.INT8, ir.DataType.UINT8
MAX_K = 1 << 17  # |sum_k q_k w_k| <= K * 2^14 stays below 2^31


def candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.op_type == "MatMul" and is_default_domain(n.domain)
            and any(match.producer(v, "DequantizeLinear") for v in n.inputs)]


def _zero_point(node: ir.Node, i: int, q_type: ir.DataType | None) -> np.ndarray | None:
    """A (De)QuantizeLinear's zero point input i as int64 (absent: 0), None when not a constant."""
    if match.input_at(node, i) is None:
        return np.zeros((), np.int64)
    value = match.const_value(node.inputs[i])
    return None if value is None else value.astype(np.int64)


def _unsupported_attrs(node: ir.Node) -> str | None:
    if node.attributes.get_int("block_size", 0):
        return f"{node.op_type} with block_size (blocked quantization)"
    return None


def _weight(dq: ir.Node | None) -> tuple[np.ndarray, np.ndarray] | str:
    """(Wq int8 [K, N] as int64, s_w float32 [N] or scalar) of the weight's DequantizeLinear, or why not."""
    if dq is None:
        return "the weight is not computed by a DequantizeLinear (W8A8 needs an int8 weight)"
    w, scale = match.const_value(dq.inputs[0]), match.const_value(dq.inputs[1])
    if w is None:
        return ("the second operand is dequantized from a computed tensor, not a constant int8 weight (a product "
                "of two activations, such as attention's)")
    if scale is None:
        return "the weight's scale is not a constant"
    q_type = dq.inputs[0].dtype
    if q_type not in (_INT8, _UINT8) or w.ndim != 2:
        return f"a {getattr(q_type, 'name', q_type)} weight of rank {w.ndim} (int8/uint8 2-D [K, N] taken)"
    why = _unsupported_attrs(dq)
    if why:
        return why
    zp = _zero_point(dq, 2, q_type)
    if zp is None:
        return "the weight's zero point is not a constant"
    centre = 128 if q_type == _UINT8 else 0
    if np.any(zp != centre):
        return (f"asymmetric {q_type.name.lower()} weight (zero points != {centre}): QuantBatchMatmul has no "
                "weight offset")
    k, n = w.shape
    if scale.size != 1:
        axis = dq.attributes.get_int("axis", 1)
        if scale.shape != (n,) or axis % 2 != 1:
            return (f"weight scales of shape {list(scale.shape)} along axis {axis}: per tensor or per output "
                    f"channel (axis 1, size N={n}) taken")
    return w.astype(np.int64) - centre, scale.astype(np.float32).reshape(-1 if scale.size != 1 else ())


def _activation(dq: ir.Node | None) -> tuple[ir.Node, float, int] | str:
    """(the QuantizeLinear, s_x, zp_x shifted to int8) of the activation's Q -> DQ pair, or why not."""
    if dq is None:
        return "the activation is not computed by a DequantizeLinear (a float activation is no W8A8)"
    q = match.producer(dq.inputs[0], "QuantizeLinear")
    if q is None:
        return "the activation's DequantizeLinear does not read a QuantizeLinear (a stored int8 activation)"
    q_type = dq.inputs[0].dtype
    if q_type not in (_INT8, _UINT8):
        return f"a {getattr(q_type, 'name', q_type)} activation (int8/uint8 taken)"
    why = _unsupported_attrs(q) or _unsupported_attrs(dq)
    if why:
        return why
    scales = [match.const_value(n.inputs[1]) for n in (q, dq)]
    zps = [_zero_point(n, 2, q_type) for n in (q, dq)]
    if any(v is None or v.size != 1 for v in (*scales, *zps)):
        return "the activation's scale or zero point is not a constant scalar (per tensor taken)"
    if scales[0].astype(np.float32).item() != scales[1].astype(np.float32).item() or zps[0].item() != zps[1].item():
        return "the QuantizeLinear and DequantizeLinear of the activation have different scales or zero points"
    s_x = float(scales[0].astype(np.float32).item())
    if not s_x > 0:
        return f"activation scale {s_x} (positive taken)"
    return q, s_x, int(zps[0].item()) - (128 if q_type == _UINT8 else 0)


def plan(node: ir.Node):
    """What the rewrite of a candidate MatMul needs, or the reason it is not fused (a string)."""
    a, b = node.inputs
    weight = _weight(match.producer(b, "DequantizeLinear"))
    if isinstance(weight, str):
        return weight
    act = _activation(match.producer(a, "DequantizeLinear"))
    if isinstance(act, str):
        return act
    q, s_x, zp = act
    x = q.inputs[0]
    k = weight[0].shape[0]
    dims = match.dims(x)
    if x.dtype not in match.FLOATS:
        return f"activation of dtype {getattr(x.dtype, 'name', x.dtype)} (fp32, fp16, bf16 taken)"
    if dims is None or len(dims) < 2 or dims[-1] != k:
        return f"the activation's shape {dims} is not [..., K={k}] with a static K"
    if k >= MAX_K:
        return f"K={k}: the int32 accumulator could overflow (K < {MAX_K} taken)"
    if x.dtype == ir.DataType.FLOAT16 and not 1.0 / np.float32(s_x) <= FP16_MAX:
        return f"1/s_x = {1.0 / s_x:.6g} overflows fp16 (QuantV2's scale is in x's dtype)"
    return q, s_x, zp, weight


def explain(node: ir.Node) -> str | None:
    why = plan(node)
    return why if isinstance(why, str) else None


def _initializer(graph: ir.Graph, array: np.ndarray, source: str, suffix: str, how: str) -> ir.Value:
    """A new initializer named after `source` + `suffix`, recorded as made from it (its Parameter's name)."""
    name = match.unique_initializer_name(graph, source + suffix)
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.shape, value.type = ir.Shape(array.shape), ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    record_made(graph, name, [source], how, naming=f"suffix:{suffix}", made_by="fuse-qdq-matmul")
    return value


def _quant_v2(graph: ir.Graph, node: ir.Node, q: ir.Node, zp: int, made: dict) -> ir.Value:
    """The int8 activation of `q` (one QuantV2 per quantized value and zero point), inserted before `node`."""
    key = (id(q), zp)
    if key not in made:
        base = q.inputs[0].name or "x"
        zp_source = q.inputs[2].name if match.input_at(q, 2) is not None else base
        zp_value = _initializer(graph, np.array(zp, np.int8), zp_source, "_int8", "the zero point as int8")
        quant = ir.Node("mindspore", "QuantV2", [q.inputs[0], q.inputs[1], zp_value], name=f"{q.name or base}_v2")
        quant.outputs[0].name = f"{base}_int8"
        quant.outputs[0].dtype, quant.outputs[0].shape = _INT8, q.inputs[0].shape
        graph.insert_before(node, quant)
        made[key] = quant.outputs[0]
    return made[key]


def _rewrite(graph: ir.Graph, node: ir.Node, found, made: dict) -> None:
    q, s_x, zp, (w, s_w) = found
    w_dq = node.inputs[1].producer()
    w_name = w_dq.inputs[0].name or f"{node.name}_weight"
    n = w.shape[1]
    x1 = _quant_v2(graph, node, q, zp, made)
    x2 = _initializer(graph, np.ascontiguousarray(w.T.astype(np.int8)), w_name, "_nk", "transpose to [N, K], int8")
    deq = (np.float32(s_x) * np.broadcast_to(s_w, (n,)).astype(np.float32)).astype(np.float32)
    scale = _initializer(graph, deq, w_name, "_deq_scale", "s_x * s_w")
    bias = _initializer(graph, (-zp * w.sum(axis=0)).astype(np.int32), w_name, "_quant_bias", "-zp_x * sum_k W")
    out = node.outputs[0]
    fused = ir.Node("mindspore", "QuantBatchMatmul", [x1, x2, scale, bias],
                    [ir.AttrInt64("dtype", int(q.inputs[0].dtype))], name=node.name)
    fused.outputs[0].name, fused.outputs[0].shape, fused.outputs[0].type = out.name, out.shape, out.type
    ir.convenience.replace_nodes_and_values(graph, node, [node], [fused], [out], [fused.outputs[0]])


def _drop_dead(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove the Q/DQ nodes nothing reads any more (consumers first), and initializers left unread."""
    for node in nodes:
        if node.graph is graph and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            inputs = list(node.inputs)
            graph.remove(node, safe=True)
            for v in inputs:
                if v is not None and v.is_initializer() and not v.uses() and v.name in graph.initializers:
                    del graph.initializers[v.name]


@register_pass("fuse-qdq-matmul", "QuantizeLinear -> DequantizeLinear -> MatMul by a DequantizeLinear'd int8 "
               "weight -> mindspore::QuantV2 + mindspore::QuantBatchMatmul")
def apply(model: ir.Model) -> PassResult:
    graph = model.graph
    count, reasons, node_reasons, made, touched = 0, [], {}, {}, []
    for node in candidates(graph):
        found = plan(node)
        if isinstance(found, str):
            reasons.append(f"{node.name or 'MatMul'}: {found}")
            if node.name:
                node_reasons[node.name] = found
            continue
        a_dq, w_dq = (v.producer() for v in node.inputs)
        _rewrite(graph, node, found, made)
        touched += [w_dq, a_dq, found[0]]
        count += 1
    _drop_dead(graph, touched)
    if count:
        model.opset_imports.setdefault("mindspore", 1)
    return PassResult(count, sorted(reasons), node_reasons)


coverage.register_family(coverage.Family("qdq_matmul", ("fuse-qdq-matmul",), candidates, explain))
