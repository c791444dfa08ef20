"""Weight-only quantized linears of a checkpoint, kept quantized in the export as com.microsoft::MatMulNBits.

A weight-only format (compressed-tensors' pack-quantized, GPTQ, AWQ) stores each Linear weight as integers
with a scale, and a zero point, per group of its input columns. Its readers (graphconv/frontend/
compressed_tensors.py and the others) describe each such weight as a `QuantizedLinear`: the unsigned integers
q_u [N, K], the scales [N, K/g] and the unsigned zero points [N, K/g], with W = (q_u - zp_u) * scale exactly.

The export traces the float model as for any checkpoint, its weights read through `WeightOnlyCheckpoint`
(each quantized weight dequantized in fp32, the format's value exactly). Then `to_matmul_nbits` replaces
each MatMul reading such a weight by a MatMulNBits carrying the checkpoint's integers, repacked to its layout,
and the float weight is never written. MatMulNBits because onnxruntime runs it (it stays the oracle), onnxruntime's
own quantizer writes it, and graphconv's load writes a 4-bit one as mindspore::WeightQuantBatchMatmul; the
standard DequantizeLinear would need opset 21 for int4, and models here are exported at 17 or 18.

MatMulNBits (onnxruntime's contrib schema) takes B uint8 [N, K/block, block * bits / 8], packed along K with
the lowest bits first, scales [N, K/block] in A's type, zero points uint8 packed the same way along the blocks
(absent: 2^(bits - 1)); block a power of 2, at least 16. A linear that does not fit (a group that does not
divide K, one that is no power of 2, bits other than 2, 4 and 8) keeps its dequantized float weight, and the
export's notes say which and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

MICROSOFT = "com.microsoft"


@dataclasses.dataclass(frozen=True)
class QuantizedLinear:
    """One Linear weight [N, K] stored as integers: W[n, k] = (q_u[n, k] - zp_u[n, g]) * scale[n, g], g = k // group."""

    key: str  # the weight's parameter name (`model.layers.0.mlp.down_proj.weight`)
    n: int
    k: int
    bits: int
    group: int
    zero_points: bool  # False: every zero point is 2^(bits - 1) (a symmetric format), and `read` gives None
    read: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray | None]]  # (q_u uint8, scale fp32, zp_u uint8|None)
    kept: str | None = None  # why the export keeps it in float though it reads exactly (GPTQ's activation order)

    def dequantized(self):
        """The weight in fp32 as torch, exactly the format's value (small integers times an fp32 scale)."""
        import torch

        q, scale, zp = self.read()
        z = np.full(scale.shape, 1 << (self.bits - 1), np.float32) if zp is None else zp.astype(np.float32)
        groups = q.astype(np.float32).reshape(self.n, -1, self.group) - z[..., None]
        return torch.from_numpy((groups * scale[..., None]).reshape(self.n, self.k))

    def refusal(self) -> str | None:
        """Why MatMulNBits cannot carry it (None: it can)."""
        if self.kept is not None:
            return self.kept
        if self.bits not in (2, 4, 8):
            return f"{self.bits}-bit (MatMulNBits takes 2, 4 and 8 bits)"
        if self.group < 16 or self.group & (self.group - 1):
            return f"group {self.group} (MatMulNBits takes a power of 2, at least 16)"
        if self.k % self.group:
            return f"K={self.k} is not a multiple of the group {self.group}"
        return None

    def matmul_nbits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(B, scales, zero_points) as MatMulNBits lays them; zero_points None where every one is 2^(bits - 1)."""
        q, scale, zp = self.read()
        blocks = self.k // self.group
        b = _pack(q, self.bits).reshape(self.n, blocks, self.group * self.bits // 8)
        if zp is None:
            return b, scale, None
        per = 8 // self.bits
        if blocks % per:  # (each row padded to a whole byte)
            zp = np.concatenate([zp, np.zeros((self.n, per - blocks % per), np.uint8)], axis=1)
        return b, scale, _pack(zp, self.bits)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [rows, L] of `bits`-bit values -> uint8 [rows, L * bits / 8], the lowest bits first."""
    if bits == 8:
        return values.astype(np.uint8)
    per = 8 // bits
    v = values.astype(np.uint8).reshape(values.shape[0], -1, per)
    out = np.zeros(v.shape[:2], np.uint8)
    for i in range(per):
        out |= v[..., i] << np.uint8(i * bits)
    return out


def checkpoint_entry(entries: dict, key: str, where: str = "the checkpoint") -> tuple:
    """A tensor's (file, dtype, shape) in a checkpoint's entries, or one line naming the absent tensor."""
    from graphconv.errors import InputError

    entry = entries.get(key)
    if entry is None:
        raise InputError(f"{key} is absent from {where}")
    return entry


class WeightOnlyCheckpoint:
    """A checkpoint whose quantized Linear weights read as their fp32 dequantized values (the Checkpoint
    interface: `entries`, `tensor`); `linears` keeps each one's integers for `to_matmul_nbits`."""

    def __init__(self, checkpoint, linears: dict[str, QuantizedLinear], consumed: set[str], note: str):
        self._checkpoint, self.linears, self.note = checkpoint, linears, note
        self.entries = {k: v for k, v in checkpoint.entries.items() if k not in consumed}
        for key, lin in linears.items():
            self.entries[key] = (None, "F32", (lin.n, lin.k))

    def tensor(self, key: str):
        lin = self.linears.get(key)
        return lin.dequantized() if lin is not None else self._checkpoint.tensor(key)


def to_matmul_nbits(model, linears: dict[str, QuantizedLinear], weights: dict[str, str]) -> list[str]:
    """Replace each MatMul reading a quantized linear's weight (an initializer of `model` named in `weights`,
    value name -> checkpoint key) by a MatMulNBits with the linear's integers; returns one line per weight
    left in float, with the reason. A Cast between the weight and its MatMuls (a weight stored in bf16) goes."""
    import onnx_ir as ir

    graph = model.graph
    kept: list[str] = []
    for name, key in weights.items():
        lin, value = linears.get(key), graph.initializers.get(name)
        if lin is None or value is None:
            continue
        readers, casts = _matmul_readers(value)
        why = lin.refusal() or (None if readers else "it is not only the B input of MatMuls")
        if why is not None:
            kept.append(f"{key}: {why}")
            continue
        inputs = _lazy_inputs(graph, lin, name)
        for mm in readers:
            new = ir.node("MatMulNBits", [mm.inputs[0], *inputs], domain=MICROSOFT, name=mm.name,
                          attributes={"K": lin.k, "N": lin.n, "bits": lin.bits, "block_size": lin.group,
                                      "accuracy_level": 0})
            ir.convenience.replace_nodes_and_values(graph, mm, [mm], [new], [mm.outputs[0]], [new.outputs[0]])
        for cast in casts:
            graph.remove(cast, safe=True)
        graph.initializers.pop(name)
    if any(n.domain == MICROSOFT for n in graph):
        model.opset_imports.setdefault(MICROSOFT, 1)
    return kept


def _matmul_readers(value) -> tuple[list, list]:
    """(the MatMuls reading `value` as B, directly or through a Cast; the Casts), or ([], []) when another
    node reads it."""
    readers, casts = [], []
    for use in value.uses():
        node = use.node
        if node.op_type == "Cast" and not node.domain:
            casts.append(node)
            uses = list(node.outputs[0].uses())
            if any(u.node.op_type != "MatMul" or u.idx != 1 or u.node.domain for u in uses) \
                    or any(v is node.outputs[0] for v in node.graph.outputs):
                return [], []
            readers += [u.node for u in uses]
        elif node.op_type == "MatMul" and use.idx == 1 and not node.domain:
            readers.append(node)
        else:
            return [], []
    return readers, casts


def _lazy_inputs(graph, lin: QuantizedLinear, name: str) -> list:
    """B, scales and (where the format has them) zero points as initializers that read the checkpoint when
    they are written; the three of one linear are written one after the other, so one linear's arrays are
    held at a time."""
    import onnx_ir as ir

    blocks = lin.k // lin.group
    zp_bytes = -(-blocks * lin.bits // 8)
    roles = [("B", ir.DataType.UINT8, (lin.n, blocks, lin.group * lin.bits // 8)),
             ("scales", ir.DataType.FLOAT, (lin.n, blocks)),
             ("zero_points", ir.DataType.UINT8, (lin.n, zp_bytes))][: 3 if lin.zero_points else 2]
    held: dict[str, tuple] = {}

    def part(i: int, full: str):
        if "parts" not in held:
            held["parts"] = lin.matmul_nbits()
        array = held["parts"][i]
        if i == len(roles) - 1:
            held.clear()
        return ir.tensor(np.ascontiguousarray(array), name=full)

    values = []
    for i, (role, dtype, shape) in enumerate(roles):
        full = f"{name}_{role}"
        tensor = ir.LazyTensor(lambda i=i, full=full: part(i, full), dtype=dtype, shape=ir.Shape(shape), name=full)
        v = ir.Value(name=full, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=tensor)
        graph.register_initializer(v)
        values.append(v)
    return values


def dequantized_model(cls, config, checkpoint: WeightOnlyCheckpoint):
    """`cls` from `config` in fp32 with every weight read through `checkpoint` (the quantized ones dequantized
    exactly): the export's check reference, as transformers would hold the format's own dequantized weights.
    It is built on the meta device and its parameters assigned from the checkpoint, so nothing is initialised."""
    import torch

    from graphconv.errors import UnsupportedError
    from graphconv.frontend.weightless_export import _parameters_on_meta

    with _parameters_on_meta():
        model = cls._from_config(config, dtype=torch.float32)
    params = dict(model.named_parameters())
    state = {name: checkpoint.tensor(name).to(torch.float32) for name in params if name in checkpoint.entries}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise UnsupportedError(f"the checkpoint lacks weights {cls.__name__} needs ({', '.join(missing[:3])}"
                               f"{' ...' if len(missing) > 3 else ''})")
    return model.eval()
