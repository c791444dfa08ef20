"""Weight-only QDQ: MatMul(x, DequantizeLinear(W_q, scale, zero_point)) -> mindspore::WeightQuantBatchMatmul.

A weight-only quantized MatMul, as onnxruntime's MatMulNBitsQuantizer writes it with quant_format=QDQ (int4 /
uint4 in blocks along K, opset 21) or as a hand-quantized export writes it (int8 / uint8 per output channel
or per tensor), is the same computation as a MatMulNBits: it becomes the same fused op, with the weight
re-laid once (opmap/fused/weight_quant_batch_matmul.py):

- int8 / uint8 per channel (axis = the N axis of the [K, N] weight, scale [N]) or per tensor (one scale and
  zero point, repeated over N): an int8 [N, K] weight, antiquant_group_size 0, scale and offset (N,). uint8 q_u
  with zero point zp is q_u XOR 0x80 = q_u - 128 with offset 128 - zp; int8 q is itself with offset -zp; so
  (q + offset) * s = (q_u - zp) * s exactly (Ascend adds the offset). int8 / uint8 in blocks along K (opset 21
  block_size on axis 0) is the per-group form of the same, scale and offset (K/g, N).
- int4 / uint4 in blocks along K (block_size on axis 0, scale [K/g, N]): a qint4x2 [N, K/2] weight (two's
  complement nibbles, element 2j in the low one), offsets -zp (int4) or 8 - zp (uint4, whose q_u - 8 is stored).

Why on load, beside MatMulNBits (graphconv/frontend/contrib/quant.py) rather than in a pass: the 4-bit
initializers are re-laid into int8 bytes before any stage reads them (graphconv binds no 4-bit tensor); the
re-laid weights are held out of onnxsim with the MatMulNBits ones (`quant.weight_quant_weights`); the oracle
runs the model as given (`LoadedModel.as_given`), so every compile checks the rewrite against onnxruntime's
own DequantizeLinear and MatMul; and the pass order is untouched, fuse-swiglu merging a gate/up pair of these
as it merges MatMulNBits'. onnxsim and onnxscript's constant folding both keep a DequantizeLinear of a constant
(neither folds it into a float weight: tests/test_weight_quant_int8.py checks it), so a form refused here
reaches the network as exported and is dequantized there (opmap/quant.py); its MatMul's doc_string says why
(quant.NOT_FUSED), which fuse-quant-matmul reports as the candidate's refusal.

Not taken: a MatMul whose x is itself a DequantizeLinear's output (activations quantized too: not weight-only),
which is left exactly as it is and is no candidate here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from graphconv.dtypes import LOW_PRECISION
from graphconv.frontend.contrib.quant import NOT_FUSED
from graphconv.frontend import weights
from graphconv.frontend.contrib.registry import FUSED_TABLE
from graphconv.onnx_domains import default_opset, is_default_domain

T = onnx.TensorProto
_BITS = {T.INT8: 8, T.UINT8: 8, T.INT4: 4, T.UINT4: 4}
_UNSIGNED = {T.UINT8, T.UINT4}
_CASTLIKE_OPSET = 15  # the fused body's fp32 island needs CastLike (opmap/fused/record.py ISLAND_OPSET)


@dataclasses.dataclass(frozen=True)
class Form:
    """A DequantizeLinear weight WeightQuantBatchMatmul takes: its re-laid arrays and attributes."""

    weight: np.ndarray  # int8 [N, K] (8 bits) or the qint4x2 bytes [N, K/2] (4 bits)
    scale: np.ndarray  # (N,) per channel or (K/g, N) per group, in the scale's dtype
    offset: np.ndarray  # the same shape and dtype
    group: int  # antiquant_group_size: 0 per channel
    bits: int
    what: str  # for the load report


def _dtype_name(t: int) -> str:
    return T.DataType.Name(t).lower()


def _layout(dq: onnx.NodeProto, q: np.ndarray, scale: np.ndarray) -> tuple[int, str] | str:
    """(group, description) of the scale's layout over the [K, N] weight, or why it is none WeightQuantBatchMatmul
    takes: per tensor or per channel (group 0), or blocks along K (group = block_size)."""
    k, n = q.shape
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    axis, block = attrs.get("axis", 1) % 2, attrs.get("block_size", 0)
    if block:
        if axis != 0:
            return f"blocks along N (axis {attrs.get('axis', 1)}): WeightQuantBatchMatmul's groups run along K"
        if k % block:
            return f"K={k} is not a multiple of block_size={block} (a padded last block)"
        return block, f"blocks of {block} along K"
    if scale.size == 1:
        return 0, "per tensor"
    if scale.ndim == 1 and axis == 1 and scale.shape[0] == n:
        return 0, "per channel"
    return f"scales of shape {list(scale.shape)} on axis {attrs.get('axis', 1)} (per output channel taken, axis 1)"


def _qint4x2(q: np.ndarray) -> np.ndarray:
    """int4 values [N, K] (-8..7, K even) -> the qint4x2 bytes [N, K/2]: element 2j in the low nibble."""
    lo, hi = q[:, 0::2].astype(np.int16) & 0xF, q[:, 1::2].astype(np.int16) & 0xF
    return (lo | (hi << 4)).astype(np.uint8).view(np.int8)


def form_of(dq: onnx.NodeProto, arrays: list[np.ndarray | None], q_type: int) -> Form | str:
    """The WeightQuantBatchMatmul form of DequantizeLinear(W_q, scale, zero_point) on a [K, N] weight, or why
    it has none. `arrays`: W_q (widened to int16), the scale and the zero point (None when absent)."""
    q, scale, zp = arrays
    bits = _BITS.get(q_type)
    if bits is None:
        return f"a {_dtype_name(q_type)} weight (int8, uint8, int4 and uint4 taken)"
    if q.ndim != 2:
        return f"a weight of rank {q.ndim} (a [K, N] one taken)"
    if scale.dtype not in (np.float32, np.float16) and scale.dtype.name != "bfloat16":
        return f"scales of type {scale.dtype} (fp32, fp16 or bf16 taken)"
    layout = _layout(dq, q, scale)
    if isinstance(layout, str):
        return layout
    group, where = layout
    if bits == 4 and group == 0:
        return f"a 4-bit weight {where} (4-bit ones are taken in blocks along K, as MatMulNBitsQuantizer writes them)"
    k, n = q.shape
    record = FUSED_TABLE.get("records", {}).get("WeightQuantBatchMatmul")
    if record is None:
        return "the fused-op table (opmap.fused) is not loaded"
    broken = record.broken({"K": k, "N": n, "G": group, "bits": bits})
    if broken is not None:
        return f"WeightQuantBatchMatmul needs {broken.text} ({broken.source}) at K={k}, N={n}, group {group}"
    laid = (n,) if group == 0 else (k // group, n)
    if zp is None:
        zero = np.zeros(laid, np.int16)
    else:  # (per tensor: one zero point, repeated over N like the scale)
        zero = np.broadcast_to(zp.astype(np.int16).reshape(-1), laid) if group == 0 else zp.astype(np.int16)
    shift = 1 << (bits - 1) if q_type in _UNSIGNED else 0  # unsigned q_u is stored as q_u - 2^(bits-1)
    signed = (q - shift).T  # [N, K], -2^(bits-1)..2^(bits-1)-1
    weight = signed.astype(np.int8) if bits == 8 else _qint4x2(signed)
    scales = np.broadcast_to(scale.reshape(-1), (n,)) if group == 0 else scale
    offsets = (shift - zero).astype(scale.dtype)
    what = f"{_dtype_name(q_type)} {where}, offsets {f'{shift} - ' if shift else '-'}zero point"
    return Form(np.ascontiguousarray(weight), np.ascontiguousarray(scales), np.ascontiguousarray(offsets),
                group, bits, what)


class _Graph:
    """Who produces and who reads each value of a model's main graph (subgraphs' reads counted too)."""

    def __init__(self, model: onnx.ModelProto, spill=None):
        self.spill = spill  # (a weights.SpillFile: external weights are read, re-laid ones written there)
        self.producer = {o: node for node in model.graph.node for o in node.output if o}
        self.readers: dict[str, int] = {}
        todo = [model.graph]
        while todo:
            graph = todo.pop()
            for node in graph.node:
                for name in node.input:
                    self.readers[name] = self.readers.get(name, 0) + 1
                for a in node.attribute:
                    todo.extend([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))
            for o in graph.output:
                self.readers[o.name] = self.readers.get(o.name, 0) + 1
        self.initializers = {t.name: t for t in model.graph.initializer}

    def held(self, name: str) -> np.ndarray | None:
        """An initializer's value: in the model, or in a file where the re-laid weights can go too (`spill`)."""
        t = self.initializers.get(name)
        if t is None or (t.data_location == T.EXTERNAL and self.spill is None):
            return None
        return weights.to_array(t)

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and is_default_domain(node.domain) else None


def _weight_only(g: _Graph, matmul: onnx.NodeProto) -> onnx.NodeProto | None:
    """The DequantizeLinear feeding `matmul`'s weight when x is not itself dequantized (weight-only)."""
    if matmul.op_type != "MatMul" or not is_default_domain(matmul.domain) or len(matmul.input) != 2:
        return None
    dq = g.made_by(matmul.input[1], "DequantizeLinear")
    return dq if dq is not None and g.made_by(matmul.input[0], "DequantizeLinear") is None else None


def _form(g: _Graph, dq: onnx.NodeProto, opset: int) -> Form | str:
    """What of the graph keeps this DequantizeLinear from WeightQuantBatchMatmul, else its form."""
    if opset < _CASTLIKE_OPSET:
        return f"opset {opset} (the fused body needs CastLike, opset {_CASTLIKE_OPSET})"
    names = [dq.input[i] if i < len(dq.input) else "" for i in range(3)]
    arrays = [g.held(name) if name else None for name in names]
    if arrays[0] is None or arrays[1] is None or (names[2] and arrays[2] is None):
        return "the quantized weight, its scale or its zero point is not an initializer (computed, or in an " \
               "external file outside a compile)"
    read = max(g.readers.get(names[0], 0), g.readers.get(dq.output[0], 0))
    if read > 1:
        return f"the quantized weight is read {read} times (re-laid for one WeightQuantBatchMatmul, it would be " \
               "stored twice)"
    q_type = g.initializers[names[0]].data_type
    return form_of(dq, [arrays[0].astype(np.int16), arrays[1], arrays[2]], q_type)


def fuse(model: onnx.ModelProto, spill=None) -> tuple[onnx.ModelProto, dict[str, str], int]:
    """`model` with every weight-only QDQ MatMul it can take written as mindspore::WeightQuantBatchMatmul and
    the others' reasons in their doc_strings (a copy; `model` itself when it has no weight-only QDQ MatMul),
    weight name -> what is done with it (the load report), and how many were written. `spill`: where large
    re-laid weights go (weights.made_initializer), for a model whose weights are in files."""
    g = _Graph(model, spill)
    pairs = [(mm, dq) for mm in model.graph.node if (dq := _weight_only(g, mm)) is not None]
    if not pairs:
        return model, {}, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {id(n): k for k, n in enumerate(model.graph.node)}
    nodes = list(out.graph.node)
    taken = set(g.readers) | set(g.producer) | set(g.initializers) | {n.name for n in model.graph.node}
    described, dropped, made = {}, set(), []
    for matmul, dq in pairs:
        form = _form(g, dq, default_opset(model))
        x_type = _value_type(model, matmul.input[0])
        if not isinstance(form, str) and x_type is not None and x_type not in (T.FLOAT, *LOW_PRECISION):
            form = f"x of type {_dtype_name(x_type)} (fp32, fp16 or bf16 taken)"
        if isinstance(form, str):
            nodes[by_name[id(matmul)]].doc_string = NOT_FUSED + form
            described[dq.input[0]] = f"dequantized in the network ({form})"
            continue
        base = matmul.name or matmul.output[0]
        inits = []
        for array, what in ((form.weight, "weight_int8" if form.bits == 8 else "weight_qint4x2"),
                            (form.scale, "antiquant_scale"), (form.offset, "antiquant_offset")):
            name = _unique(f"{base}::{what}", taken)
            inits.append(weights.made_initializer(array, name, spill))
        made += inits
        nodes[by_name[id(matmul)]] = onnx.helper.make_node(
            "WeightQuantBatchMatmul", [matmul.input[0], *(t.name for t in inits)], [matmul.output[0]],
            name=matmul.name, domain="mindspore", antiquant_group_size=form.group, weight_bits=form.bits)
        dropped.add(id(dq))
        layout = "qint4x2 [N, K/2]" if form.bits == 4 else "int8 [N, K]"
        described[dq.input[0]] = f"{form.what}; the {layout} weight of a WeightQuantBatchMatmul"
    del out.graph.node[:]
    out.graph.node.extend(n for k, n in enumerate(nodes) if id(model.graph.node[k]) not in dropped)
    if made:
        _replace_weights(out, made)
    return out, described, len(dropped)


def _value_type(model: onnx.ModelProto, name: str) -> int | None:
    for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if vi.name == name and vi.type.HasField("tensor_type"):
            return vi.type.tensor_type.elem_type or None
    return None


def _unique(name: str, taken: set[str]) -> str:
    k, candidate = 0, name
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    taken.add(candidate)
    return candidate


def _replace_weights(model: onnx.ModelProto, made: list[onnx.TensorProto]) -> None:
    """Add the re-laid weights, drop the initializers and value infos nothing reads any more, and attach the
    fused op's body (onnxruntime, onnxsim and shape inference run it until the passes)."""
    model.graph.initializer.extend(made)
    read = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    todo = [a for n in model.graph.node for a in n.attribute]
    while todo:  # (subgraphs read values too)
        a = todo.pop()
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            read |= {x for n in sub.node for x in n.input}
            todo.extend(b for n in sub.node for b in n.attribute)
    produced = {o for n in model.graph.node for o in n.output}
    kept = [t for t in model.graph.initializer if t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    infos = [vi for vi in model.graph.value_info if vi.name in produced]
    del model.graph.value_info[:]
    model.graph.value_info.extend(infos)
    FUSED_TABLE["attach"](model)
