"""Quantized contrib ops -> standard ONNX that dequantizes in the graph.

A 4-bit or 8-bit MatMulNBits of whole blocks (block_size a multiple of 32, within WeightQuantBatchMatmul's limits;
an 8-bit one whose single block spans K is per channel, group 0) becomes mindspore::WeightQuantBatchMatmul here,
directly: this is where its packed bytes, scales and zero points are read, so its weight is re-laid once, 4 bits as
the qint4x2 [N, K/2] the primitive takes (B XOR 0x88, weight_bits 4), 8 bits as int8 [N, K] (B XOR 0x80,
weight_bits 8), the scales as (K/g, N) and the zero points as the offsets 2^(bits-1) - zp
(opmap/fused/weight_quant_batch_matmul.py: the record, its body and its limits, read through registry.FUSED_TABLE).
Emitting the node here rather than recognising an unpack + MatMul in a pass keeps it one node through onnxsim (its
weights are held out of it, like the packed ones) and needs no pattern of twenty nodes; passes/fuse_quant_matmul.py
reports it, and fuse-swiglu merges a gate/up pair of them. The ascend MindIR holds the weight packed (QINT4X2) or
as int8 (INT8), the cpu twin unpacks the same bytes with integer ops. Weight-only DequantizeLinear + MatMul become
the same op on load too (graphconv/frontend/weight_only_qdq.py).
Every other form keeps the decomposition: the packed weights stay the initializers they are (same bytes, same
uint8 type), so the compiled network carries them packed; the graph unpacks them with BitShift and BitwiseAnd
(Mod below opset 18), subtracts the zero point, multiplies by the scale and then runs the float op (MatMul,
Gather) a PyTorch export would have; the MatMul's doc_string says why it is no WeightQuantBatchMatmul, and the
load stage reports what happens to each weight (`quantized_weights`).

Semantics read from onnxruntime's contrib schemas (docs/ContribOperators.md) and CPU kernels
(contrib_ops/cpu/quantization/matmul_nbits.cc, matmul_nbits_impl.cc, gather_block_quantized.cc); the integer
matmuls (MatMulIntegerToFloat, DynamicQuantizeMatMul) and com.microsoft's (De)QuantizeLinear from the schemas,
checked against onnxruntime on hand-built graphs (tests/test_contrib_quant.py):

MatMulNBits (A, B, scales, zero_points?, g_idx?, bias?; K, N, bits 2|4|8, block_size, accuracy_level):
    B is uint8 [N, k_blocks, blob_size] (k_blocks = ceil(K / block_size), blob_size = block_size * bits / 8),
    the values of one column of the logical [K, N] weight packed along K, lowest bits first;
    W[k, n] = (q[n, k] - zp[n, k // block_size]) * scales[n, k // block_size], elements past K (padding of
    the last block) are dropped; Y = A @ W (+ bias). zero_points: uint8 packed like B along the blocks
    ([N, ceil(k_blocks * bits / 8)]), or unpacked in A's type ([N, k_blocks]); absent: 2^(bits - 1).
    fp16/bf16 A: onnxruntime's CPU kernel converts A and the scales to float32 and the result back, so the
    decomposition computes in float32 between two Casts. accuracy_level 4 lets onnxruntime quantize A to int8
    (an approximation of these semantics): the oracle runs the model at accuracy_level 0 (frontend/load.py).
GatherBlockQuantized (data, indices, scales, zero_points?; gather_axis=0, quantize_axis=1, block_size=128,
bits=4): uint8 data only (bits 2|4|8 packed along the last axis, lowest bits first; gather_axis 0, quantize_axis
the last; zero points packed the same way; default zero point 2^(bits - 1)); output = (q - zp) * scale in
float32, cast to the scales' type; an index outside [-dim, dim) gives zeros (not an error, unlike Gather).
"""

from __future__ import annotations

import numpy as np
import onnx

from graphconv.dtypes import LOW_PRECISION
from graphconv.frontend.contrib.registry import FUSED_TABLE, MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite

FLOAT = onnx.TensorProto.FLOAT
UINT8 = onnx.TensorProto.UINT8
_CASTLIKE_OPSET = 15  # a fused body's fp32 island needs CastLike (opmap/fused/record.py ISLAND_OPSET)


def unpack(rw: Rewrite, packed: str, bits: int, rank: int | None = None) -> str:
    """uint8 `packed` [..., L] (of rank `rank`, when known) -> uint8 [..., L * 8 / bits]: the values packed in
    each byte, lowest bits first (the packing of MatMulNBits and GatherBlockQuantized)."""
    if bits == 8:
        return packed
    per, mask = 8 // bits, (1 << bits) - 1
    parts = []
    for i in range(per):
        v = packed if i == 0 else rw.op("BitShift", packed, rw.const(np.uint8(i * bits)), direction="RIGHT")
        if i < per - 1:  # the top field needs no mask
            v = (rw.op("BitwiseAnd", v, rw.const(np.uint8(mask))) if rw.opset >= 18
                 else rw.op("Mod", v, rw.const(np.uint8(mask + 1))))
        parts.append(rw.op("Unsqueeze", v, rw.const([-1], np.int64)))
    stacked = rw.op("Concat", *parts, axis=-1)  # [..., L, per]
    if rank is not None:
        return rw.op("Reshape", stacked, rw.const([0] * (rank - 1) + [-1], np.int64))
    leading = rw.op("Slice", rw.op("Shape", packed), rw.const([0], np.int64), rw.const([-1], np.int64))
    return rw.op("Reshape", stacked, rw.op("Concat", leading, rw.const([-1], np.int64), axis=0))


def _check_bits(rw: Rewrite, bits: int) -> None:
    if bits not in (2, 4, 8):
        rw.fail(f"bits={bits} (onnxruntime's kernels define 2, 4 and 8)")


# --- MatMulNBits -------------------------------------------------------------------------------------

def _nbits_zero_point(rw: Rewrite, n: int, k_blocks: int, bits: int, work: int) -> str:
    """The zero points as a `work`-typed [N, k_blocks, 1] value (broadcast over a block)."""
    if not rw.has(3):
        return rw.const(np.full((1, 1, 1), 1 << (bits - 1)), onnx.helper.tensor_dtype_to_np_dtype(work))
    zp = rw.input(3)
    if rw.dtype(zp) == UINT8:
        rows = rw.op("Reshape", zp, rw.const([n, -1], np.int64))  # [N, ceil(k_blocks * bits / 8)] (or flat)
        zp = rw.op("Slice", unpack(rw, rows, bits, 2) if bits < 8 else rows, rw.const([0], np.int64),
                   rw.const([k_blocks], np.int64), rw.const([1], np.int64))
    zp = rw.op("Cast", zp, to=work)
    return rw.op("Reshape", zp, rw.const([n, k_blocks, 1], np.int64))


@decomposes("MatMulNBits", domain=MICROSOFT)
def matmul_nbits(rw: Rewrite) -> None:
    k, n = rw.attr("K"), rw.attr("N")
    bits, block = rw.attr("bits", 4), rw.attr("block_size")
    if k is None or n is None or block is None:
        rw.fail("attributes K, N and block_size are required")
    _check_bits(rw, bits)
    if block < 16 or block & (block - 1):
        rw.fail(f"block_size={block} (onnxruntime requires a power of 2, at least 16)")
    if rw.attr("weight_prepacked", 0):
        rw.fail(f"weight_prepacked={rw.attr('weight_prepacked')}: B is in an execution provider's own layout")
    if rw.has(4):
        rw.fail("g_idx (deprecated act-order group index) is not supported")
    k_blocks = -(-k // block)
    blob = block * bits // 8
    b_shape = rw.shape(rw.input(1))
    if b_shape is not None and 0 in b_shape:
        rw.fail("an empty B (an omitted projection) is not supported")
    if b_shape is not None and all(isinstance(d, int) for d in b_shape) and b_shape != [n, k_blocks, blob]:
        rw.fail(f"B has shape {b_shape}, expected [N, k_blocks, blob_size] = {[n, k_blocks, blob]}")
    a, a_type = rw.input(0), rw.dtype(rw.input(0))
    refusal = weight_quant_refusal(k, n, bits, block) or _held_refusal(rw, a_type)
    if refusal is None:
        _weight_quant_batch_matmul(rw, k, n, bits, block)
        return
    work = FLOAT if a_type in LOW_PRECISION or a_type is None else a_type

    q = unpack(rw, rw.input(1), bits, 3)  # uint8 [N, k_blocks, block_size]
    zp = _nbits_zero_point(rw, n, k_blocks, bits, work)
    scales = rw.op("Reshape", rw.input(2), rw.const([n, k_blocks, 1], np.int64))
    if rw.dtype(rw.input(2)) != work:
        scales = rw.op("Cast", scales, to=work)
    w = rw.op("Mul", rw.op("Sub", rw.op("Cast", q, to=work), zp), scales)  # [N, k_blocks, block_size]
    w = rw.op("Reshape", w, rw.const([n, k_blocks * block], np.int64))
    if k_blocks * block != k:  # the last block's padding
        w = rw.op("Slice", w, rw.const([0], np.int64), rw.const([k], np.int64), rw.const([1], np.int64))
    w_t = rw.op("Transpose", w, perm=[1, 0])  # [K, N], as a PyTorch export's MatMul weight
    if work != a_type:
        a = rw.op("Cast", a, to=work)
    y = rw.op("MatMul", a, w_t, doc_string=NOT_FUSED + refusal)  # (passes/fuse_quant_matmul.py reads it)
    if rw.has(5):
        bias = rw.input(5)
        y = rw.op("Add", y, bias if rw.dtype(bias) == work else rw.op("Cast", bias, to=work))
    if work != a_type:
        rw.op("Cast", y, outputs=[rw.output(0)], to=a_type)
    else:
        rw.identity(y, rw.output(0))


KEPT = "kept packed, dequantized in the network (a small one is folded at compile time)"
AS_QINT4X2 = ("kept packed: the qint4x2 [N, K/2] weight of a WeightQuantBatchMatmul (its bytes XOR 0x88), the "
              "scales (K/g, N), the offsets 8 - zero point")
AS_INT8 = ("the int8 [N, K] weight of a WeightQuantBatchMatmul (its bytes XOR 0x80), the scales (K/g, N), the "
           "offsets 128 - zero point")
# The doc_string of a dequantized MatMulNBits' MatMul: then why it is no WeightQuantBatchMatmul (coverage)
NOT_FUSED = "graphconv: not WeightQuantBatchMatmul: "


def weight_quant_refusal(k: int, n: int, bits: int, block: int) -> str | None:
    """Why a MatMulNBits of these attributes cannot be a WeightQuantBatchMatmul (None: it can, as far as its
    attributes tell): 4 bits (a qint4x2 weight) or 8 (int8), whole blocks, and the primitive's documented limits."""
    record = FUSED_TABLE.get("records", {}).get("WeightQuantBatchMatmul")
    if record is None:
        return "the fused-op table (opmap.fused) is not loaded"
    if bits not in (4, 8):
        return f"bits={bits} (WeightQuantBatchMatmul takes 4-bit weights, as qint4x2, and 8-bit ones, as int8)"
    group = antiquant_group(k, bits, block)
    if group and k % block:
        return f"K={k} is not a multiple of block_size={block} (a padded last block)"
    broken = record.broken({"K": k, "N": n, "G": group, "bits": bits})
    if broken is not None:
        return f"WeightQuantBatchMatmul needs {broken.text} ({broken.source}) at K={k}, N={n}, group {group}"
    return None


def antiquant_group(k: int, bits: int, block: int) -> int:
    """WeightQuantBatchMatmul's antiquant_group_size for a MatMulNBits: the block size, or 0 (per channel) for
    one block of all K (the primitive's groups are below K; per channel it takes scales (N,)), and for an
    8-bit one whose single block spans K with padding past K, which is dropped."""
    return 0 if block == k or (bits == 8 and block > k) else block


def _held_refusal(rw: Rewrite, a_type: int | None) -> str | None:
    """What of the node itself keeps it from a WeightQuantBatchMatmul: its weights must be held in the model
    (they are re-laid at load), integer zero points, a float A, and CastLike (opset 15) for the body."""
    if a_type not in (FLOAT, *LOW_PRECISION):
        return f"A of type {onnx.TensorProto.DataType.Name(a_type or 0)} (fp32, fp16 or bf16 taken)"
    if rw.opset < _CASTLIKE_OPSET:
        return f"opset {rw.opset} (the fused body needs CastLike, opset {_CASTLIKE_OPSET})"
    held = [rw.array(rw.input(i)) for i in (1, 2, 3) if rw.has(i)]
    if any(h is None for h in held):
        return "B, the scales or the zero points are not initializers (computed, or external outside a compile)"
    if rw.has(3) and rw.dtype(rw.input(3)) != UINT8:
        zp, top = held[2].astype(np.float64), (1 << rw.attr("bits", 4)) - 1
        if not np.array_equal(zp, np.round(zp)) or zp.min() < 0 or zp.max() > top:
            return f"float zero points that are not integers in [0, {top}] (the offset would round)"
    return None


def _weight_quant_batch_matmul(rw: Rewrite, k: int, n: int, bits: int, block: int) -> None:
    """MatMulNBits (4 or 8 bits, whole blocks, or 8 bits in one block over K) as mindspore::WeightQuantBatchMatmul
    (opmap/fused/weight_quant_batch_matmul.py). B [N, K/block, block * bits / 8] uint8, reshaped to
    [N, K * bits / 8], is XOR 0x88 (4 bits: each nibble's top bit flipped) exactly the two's-complement qint4x2
    of q - 8, element 2j in the low nibble as MatMulNBits packs it, and XOR 0x80 (8 bits) exactly the int8 q -
    128; the offsets 2^(bits-1) - zp make (q - 2^(bits-1) + 2^(bits-1) - zp) * s = (q - zp) * s exactly, in
    integers; the scales are laid (K/g, N)."""
    group = antiquant_group(k, bits, block)
    k_blocks, half = max(k // block, 1), 1 << (bits - 1)
    packed = rw.array(rw.input(1)).reshape(n, -1)[:, :k * bits // 8]  # (a single block's padding dropped)
    weight = (packed ^ np.uint8(0x88 if bits == 4 else 0x80)).view(np.int8)
    scales = rw.array(rw.input(2)).reshape(n, k_blocks)
    zp = np.full((n, k_blocks), half, np.int64)
    if rw.has(3):
        z = rw.array(rw.input(3))
        if z.dtype == np.uint8 and bits == 4:  # packed along the blocks, low nibble first, each row padded to a byte
            rows = z.reshape(n, -1)
            z = np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(n, -1)
        zp = z.reshape(n, -1)[:, :k_blocks].astype(np.int64)
    offsets = (half - zp).T.astype(scales.dtype)
    scales = scales.T
    if group == 0:  # per channel: the (N,) layout
        scales, offsets = scales.reshape(n), offsets.reshape(n)
    name = "weight_qint4x2" if bits == 4 else "weight_int8"
    ins = [rw.input(0), rw.initializer(np.ascontiguousarray(weight), name), rw.initializer(scales, "antiquant_scale"),
           rw.initializer(np.ascontiguousarray(offsets), "antiquant_offset")]
    out = rw.output(0) if not rw.has(5) else ""
    y = rw.op("WeightQuantBatchMatmul", *ins, outputs=[out] if out else 1, domain="mindspore",
              antiquant_group_size=group, weight_bits=bits)
    if rw.has(5):
        rw.op("Add", y, rw.input(5), outputs=[rw.output(0)])


def weight_quant_weights(model: onnx.ModelProto) -> list[str]:
    """The qint4x2 and int8 weights of the WeightQuantBatchMatmul nodes the load wrote: held out of onnxsim too."""
    return [n.input[1] for n in model.graph.node if n.domain == "mindspore" and n.op_type == "WeightQuantBatchMatmul"]


# --- integer matmuls and com.microsoft's (De)QuantizeLinear -------------------------------------------

@decomposes("MatMulIntegerToFloat", domain=MICROSOFT)
def matmul_integer_to_float(rw: Rewrite) -> None:
    """Y = MatMulInteger(A, B, a_zero_point, b_zero_point) * (a_scale * b_scale) (+ bias), the int32 product
    converted to the scales' float type first (onnxruntime's MLAS scale-bias output processor)."""
    zps = [rw.input(4), rw.input(5)]
    if any(zps):
        acc = rw.op("MatMulInteger", rw.input(0), rw.input(1), *zps)
    else:
        acc = rw.op("MatMulInteger", rw.input(0), rw.input(1))
    out_type = rw.dtype(rw.input(2)) or FLOAT
    y = rw.op("Mul", rw.op("Cast", acc, to=out_type), rw.op("Mul", rw.input(2), rw.input(3)))
    if rw.has(6):
        y = rw.op("Add", y, rw.input(6))
    rw.identity(y, rw.output(0))


@decomposes("DynamicQuantizeMatMul", domain=MICROSOFT)
def dynamic_quantize_matmul(rw: Rewrite) -> None:
    """A quantized to uint8 as DynamicQuantizeLinear does (per tensor), then MatMulIntegerToFloat with B."""
    a_q, a_scale, a_zp = rw.op("DynamicQuantizeLinear", rw.input(0), outputs=3)
    acc = rw.op("MatMulInteger", a_q, rw.input(1), a_zp, *([rw.input(3)] if rw.has(3) else []))
    y = rw.op("Mul", rw.op("Cast", acc, to=FLOAT), rw.op("Mul", a_scale, rw.input(2)))
    if rw.has(4):
        y = rw.op("Add", y, rw.input(4))
    rw.identity(y, rw.output(0))


LSTM_WEIGHT = ("8-bit, dequantized to float32 at compile time (MindSpore's LSTM primitives take float weights "
               "in their own gate layout)")

# onnx's LSTM attributes, which DynamicQuantizeLSTM shares (it has no `layout`: X is [seq, batch, input])
_LSTM_ATTRS = ("activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size",
               "input_forget")


def _dequantized_lstm_weight(rw: Rewrite, q: int, scale: int, zero_point: int) -> str:
    """DynamicQuantizeLSTM's int8/uint8 weight [D, K, 4H] with its scale and zero point ([D] per direction or
    [D, 4H] per column) -> the float [D, 4H, K] onnx's LSTM takes. Computed here where all three are
    initializers: MindSpore's LSTM primitives take float weights laid out at compile time (opmap/rnn.py), and
    the lowering folds no tensor that large."""
    held = [rw.array(rw.input(i)) for i in (q, scale, zero_point)]
    if all(a is not None for a in held):
        w, sc, zp = held
        lead = (len(w), 1, -1) if sc.ndim == 2 else (len(w), 1, 1)
        deq = (w.astype(np.float32) - zp.astype(np.float32).reshape(lead)) * sc.astype(np.float32).reshape(lead)
        return rw.const(np.ascontiguousarray(deq.transpose(0, 2, 1)))
    rank = len(rw.shape(rw.input(scale)) or [1])
    lead = [0, 1, -1] if rank == 2 else [0, 1, 1]  # [D, 4H] -> [D, 1, 4H]; [D] -> [D, 1, 1]
    zp = rw.op("Reshape", rw.op("Cast", rw.input(zero_point), to=FLOAT), rw.const(lead, np.int64))
    sc = rw.op("Reshape", rw.input(scale), rw.const(lead, np.int64))
    w = rw.op("Mul", rw.op("Sub", rw.op("Cast", rw.input(q), to=FLOAT), zp), sc)
    return rw.op("Transpose", w, perm=[0, 2, 1])


@decomposes("DynamicQuantizeLSTM", domain=MICROSOFT)
def dynamic_quantize_lstm(rw: Rewrite) -> None:
    """onnx's LSTM on the dequantized weights, its input X quantized to uint8 and back as onnxruntime's kernel
    does (once over the whole sequence: DynamicQuantizeLinear's min/max with 0, scale and zero point).
    Inputs: X, W [D, K, 4H], R [D, H, 4H] (int8/uint8), B, sequence_lens, initial_h, initial_c, P, W_scale,
    W_zero_point, R_scale, R_zero_point (contrib_ops/cpu/quantization/dynamic_quantize_lstm.cc,
    rnn/rnn_helpers.cc). What it leaves out: onnxruntime also quantizes the hidden state at every step before
    the recurrent product, which needs a loop over a dynamic sequence (no MindSpore LSTM primitive quantizes
    it); the oracle runs this decomposition, and the report gives how far onnxruntime's own kernel is from it
    (frontend/load.py, as for MatMulNBits' accuracy_level 4)."""
    if not all(rw.has(i) for i in range(8, 12)):
        rw.fail("the weights' scales and zero points (inputs 8-11) are required")
    x_q, x_scale, x_zp = rw.op("DynamicQuantizeLinear", rw.input(0), outputs=3)
    x = rw.op("DequantizeLinear", x_q, x_scale, x_zp)
    w = _dequantized_lstm_weight(rw, 1, 8, 9)
    r = _dequantized_lstm_weight(rw, 2, 10, 11)
    attrs = {name: [a.decode() if isinstance(a, bytes) else a for a in value] if isinstance(value, list) else value
             for name in _LSTM_ATTRS if (value := rw.attr(name)) is not None}  # (activations: bytes in a list)
    optional = [rw.input(i) for i in range(3, 8)]
    while optional and not optional[-1]:
        optional.pop()
    rw.op("LSTM", x, w, r, *optional, outputs=[rw.output(k) for k in range(3)], **attrs)


def _standard_qdq(rw: Rewrite, op: str) -> None:
    """com.microsoft's QuantizeLinear / DequantizeLinear: the standard op's per-tensor / per-axis semantics
    (attribute axis, default 1), written as the standard op (int8 / uint8 below opset 21)."""
    quantized = rw.input(0) if op == "DequantizeLinear" else (rw.input(2) if rw.has(2) else "")
    q_type = rw.dtype(quantized) if quantized else UINT8
    if q_type not in (UINT8, onnx.TensorProto.INT8) and rw.opset < 21:
        rw.fail(f"{onnx.TensorProto.DataType.Name(q_type or 0)} data needs the standard op at opset 21 "
                f"(the model's is {rw.opset})")
    inputs = [rw.input(i) for i in range(3) if rw.has(i)]
    attrs = {"axis": rw.attr("axis")} if rw.attr("axis") is not None else {}
    rw.op(op, *inputs, outputs=[rw.output(0)], **attrs)


@decomposes("QuantizeLinear", domain=MICROSOFT)
def quantize_linear(rw: Rewrite) -> None:
    _standard_qdq(rw, "QuantizeLinear")


@decomposes("DequantizeLinear", domain=MICROSOFT)
def dequantize_linear(rw: Rewrite) -> None:
    _standard_qdq(rw, "DequantizeLinear")


def nbits_description(node: onnx.NodeProto) -> str:
    """What happens to a MatMulNBits weight, for the load report."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    bits = attrs.get("bits", 4)
    has_zp = len(node.input) > 3 and bool(node.input[3])
    zp = "zero points given" if has_zp else f"symmetric (zero point {1 << (bits - 1)})"
    k, n, block = attrs.get("K"), attrs.get("N"), attrs.get("block_size")
    why = weight_quant_refusal(k, n, bits, block) if None not in (k, n, block) else "K, N or block_size missing"
    if len(node.input) > 4 and node.input[4]:
        why = "g_idx"
    fused = AS_QINT4X2 if bits == 4 else AS_INT8
    return f"uint{bits} block {block}, {zp}; {fused if why is None else f'{KEPT} ({why})'}"


# --- GatherBlockQuantized ----------------------------------------------------------------------------

@decomposes("GatherBlockQuantized", domain=MICROSOFT)
def gather_block_quantized(rw: Rewrite) -> None:
    data, indices = rw.input(0), rw.input(1)
    if rw.dtype(data) != UINT8:
        rw.fail("data of type int4/uint4 is not supported (graphconv binds no 4-bit tensors); uint8-packed data is")
    shape = rw.shape(data)
    if shape is None or not all(isinstance(d, int) for d in shape):
        rw.fail("the shape of data is not static")
    rank = len(shape)
    bits, block = rw.attr("bits", 4), rw.attr("block_size", 128)
    _check_bits(rw, bits)
    if rw.attr("gather_axis", 0) % rank != 0 or rw.attr("quantize_axis", 1) % rank != rank - 1 or rank < 2:
        rw.fail("uint8 data needs gather_axis 0 and quantize_axis the last axis (onnxruntime's kernel)")
    if block < 16 or block & (block - 1):
        rw.fail(f"block_size={block} (onnxruntime requires a power of 2, at least 16)")
    rows = shape[0]
    width = shape[-1] * (8 // bits)  # logical length of the quantized axis
    blocks = -(-width // block)
    out_type = rw.dtype(rw.input(2)) or FLOAT

    # Out-of-range indices give zeros: gather row 0 for them, zero them afterwards.
    idx = rw.op("Cast", indices, to=onnx.TensorProto.INT64)
    valid = rw.op("And", rw.op("GreaterOrEqual", idx, rw.const(np.int64(-rows))),
                  rw.op("Less", idx, rw.const(np.int64(rows))))
    safe = rw.op("Where", valid, idx, rw.const(np.int64(0)))

    # Gather the packed rows first (an embedding dequantizes only the rows it reads).
    q = unpack(rw, rw.op("Gather", data, safe, axis=0), bits)  # uint8 [*idx, ..., width]
    scales = rw.op("Gather", rw.input(2), safe, axis=0)  # [*idx, ..., blocks]
    if rw.has(3):
        zp = rw.op("Gather", rw.input(3), safe, axis=0)
        if bits < 8:
            zp = rw.op("Slice", unpack(rw, zp, bits), rw.const([0], np.int64), rw.const([blocks], np.int64),
                       rw.const([-1], np.int64))
        zp = rw.op("Cast", zp, to=FLOAT)
    else:
        zp = rw.const(np.float32(1 << (bits - 1)))

    def per_element(v: str) -> str:
        """[..., blocks] -> [..., width]: each block's value repeated over its elements."""
        v = rw.op("Unsqueeze", v, rw.const([-1], np.int64))
        v = rw.op("Expand", v, rw.const([1, block], np.int64))  # [..., blocks, block]
        shape_out = rw.op("Concat", rw.op("Slice", rw.op("Shape", v), rw.const([0], np.int64),
                                          rw.const([-2], np.int64)),
                          rw.const([blocks * block], np.int64), axis=0)
        v = rw.op("Reshape", v, shape_out)
        if blocks * block != width:
            v = rw.op("Slice", v, rw.const([0], np.int64), rw.const([width], np.int64), rw.const([-1], np.int64))
        return v

    centered = rw.op("Cast", q, to=FLOAT)
    if rw.has(3):
        centered = rw.op("Sub", centered, per_element(zp))
    else:
        centered = rw.op("Sub", centered, zp)
    scale32 = rw.op("Cast", scales, to=FLOAT) if out_type != FLOAT else scales
    y = rw.op("Mul", centered, per_element(scale32))
    # Zero the rows of out-of-range indices: valid has idx's shape; broadcast it over the row's dims.
    mask = valid
    for _ in range(rank - 1):
        mask = rw.op("Unsqueeze", mask, rw.const([-1], np.int64))
    y = rw.op("Where", mask, y, rw.const(np.float32(0)))
    if out_type != FLOAT:
        rw.op("Cast", y, outputs=[rw.output(0)], to=out_type)
    else:
        rw.identity(y, rw.output(0))


def gather_description(node: onnx.NodeProto) -> str:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return (f"uint{attrs.get('bits', 4)} block {attrs.get('block_size', 128)} embedding; kept packed, the rows read "
            "are dequantized in the network (a small one is folded at compile time)")


def describe_quantized_weights(model: onnx.ModelProto) -> dict[str, str]:
    """weight name -> what graphconv does with it, for every MatMulNBits / GatherBlockQuantized node."""
    out = {}
    for node in model.graph.node:
        if node.domain != MICROSOFT:
            continue
        if node.op_type == "MatMulNBits" and len(node.input) > 1:
            out[node.input[1]] = nbits_description(node)
        elif node.op_type == "GatherBlockQuantized" and node.input:
            out[node.input[0]] = gather_description(node)
        elif node.op_type == "DynamicQuantizeLSTM" and len(node.input) > 2:
            for i in (1, 2):
                out[node.input[i]] = LSTM_WEIGHT
    return out


def packed_initializers(model: onnx.ModelProto) -> list[str]:
    """Names of the packed uint8 initializers the quantized contrib nodes read (weights and zero points):
    they are to reach the network as they are (`held_out`)."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    picks = {"MatMulNBits": (1, 3), "GatherBlockQuantized": (0, 3)}
    return sorted({node.input[i] for node in model.graph.node
                   if node.domain == MICROSOFT and node.op_type in picks
                   for i in picks[node.op_type] if i < len(node.input) and inits.get(node.input[i]) == UINT8})


def at_accuracy_level_0(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, list[int]]:
    """A copy of `model` whose MatMulNBits nodes run at accuracy_level 0, and the levels the model gives;
    (None, []) when every node is at level 0 already. At level 4 onnxruntime quantizes A to int8 (its
    approximation of the op): the oracle runs the copy, the exact semantics the decomposition computes."""
    levels = sorted({onnx.helper.get_attribute_value(a) for n in model.graph.node
                     if n.op_type == "MatMulNBits" and n.domain == MICROSOFT
                     for a in n.attribute if a.name == "accuracy_level"} - {0})
    if not levels:
        return None, []
    exact = onnx.ModelProto()
    exact.CopyFrom(model)
    for node in exact.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == MICROSOFT:
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = 0
    return exact, levels


def held_out(model: onnx.ModelProto, names) -> tuple[onnx.ModelProto, dict[str, None]]:
    """A copy of `model` whose initializers `names` (the packed quantized weights) are graph inputs instead,
    and those names: onnxsim would otherwise fold their dequantization into float initializers (8 times the
    bytes of an int4 weight). graphconv.frontend.weights.restore puts them back."""
    names = {t.name for t in model.graph.initializer if t.name in set(names)}
    if not names:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inputs = [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
              for t in out.graph.initializer if t.name in names]
    kept = [t for t in out.graph.initializer if t.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    have = {i.name for i in out.graph.input}
    out.graph.input.extend(i for i in inputs if i.name not in have)
    return out, dict.fromkeys(names)
