"""Static W8A8 linears of a checkpoint (int8 weights, int8 activations with a fixed scale), kept quantized in
the export as the QDQ spelling the compile fuses into mindspore::QuantV2 + mindspore::QuantBatchMatmul
(passes/fuse_qdq_matmul.py).

A format's readers (graphconv/frontend/msmodelslim.py, compressed_tensors.py) describe each such linear as a
`StaticLinear`: the int8 weight Wq [N, K], the activation's scale s_x and integer zero point z_x, the
dequantization scale deq [N] and an integer bias c [N], with

    xq = clamp(round(x / s_x + z_x), -128, 127)
    y[n] = deq[n] * (sum_k Wq[n, k] * (xq[k] - z_x) + c[n])

(msModelSlim's W8A8: deq = deq_scale, c = quant_bias + z_x * sum_k Wq[n, k], the bias quant_bias folds;
compressed-tensors' static W8A8: deq = input_scale * weight_scale, c = 0). Both formats round with
torch.round, half to even, as ONNX's QuantizeLinear does; QuantizeLinear rounds x / s_x and adds z_x after,
which differs from round(x / s_x + z_x) only at an exact tie of x / s_x with an odd zero point (ties happen:
x / s_x in fp32 lands on k + 0.5 about once in some thousands of elements at |x / s_x| near 64).

The export traces the float model with each such weight read as Wq * (deq / s_x) in fp32 (`tensor`), then
`to_qdq` rewrites each MatMul reading it as

    MatMul(DequantizeLinear(QuantizeLinear(x, s_x, z_x), s_x, z_x), DequantizeLinear(Wq^T int8, deq / s_x, axis 1))
    [+ Add(deq * c), only where c is not all 0]

one Q/DQ pair per activation and (s_x, z_x), shared by the MatMuls reading it (q, k and v; gate and up, which
fuse-swiglu merges). The float weight is never written. The export's check runs `fake_quantized_model`: the
float model whose Linear inputs are fake-quantized as above, with deq * c added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from graphconv.errors import UnsupportedError
from graphconv.frontend.quantized_linears import WeightOnlyCheckpoint, _matmul_readers


@dataclasses.dataclass(frozen=True)
class StaticLinear:
    """One static W8A8 Linear [N, K]: y = deq * (Wq @ (xq - z_x) + c), xq = clamp(round(x / s_x + z_x))."""

    key: str  # the weight's parameter name
    n: int
    k: int
    input_scale: float  # s_x (fp32)
    input_zero_point: int  # z_x in -128..127
    read: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray | None]]  # (Wq int8 [N, K], deq fp32 [N], c|None)
    bias_stored: bool = False  # the architecture's own bias parameter reads deq * c (`folded_bias`): no Add

    def weight_scale(self, deq: np.ndarray) -> np.ndarray:
        """deq / s_x in fp32: the weight's DequantizeLinear scale, per output channel."""
        return (deq.astype(np.float32) / np.float32(self.input_scale)).astype(np.float32)

    def dequantized(self):
        """Wq * deq / s_x in fp32 as torch: the weight the float trace and the reference hold."""
        import torch

        wq, deq, _ = self.read()
        return torch.from_numpy(wq.astype(np.float32) * self.weight_scale(deq)[:, None])

    def folded_bias(self) -> np.ndarray:
        """deq * c in fp32 (0 where the format has no c)."""
        _, deq, c = self.read()
        c = np.zeros(self.n) if c is None else c
        return (deq.astype(np.float64) * c.astype(np.float64)).astype(np.float32)

    def bias(self) -> np.ndarray | None:
        """deq * c in fp32 for the Add after the MatMul, or None: c all 0, or the model's bias carries it."""
        _, _, c = self.read()
        if self.bias_stored or c is None or not np.any(c):
            return None
        return self.folded_bias()


class QuantizedCheckpoint(WeightOnlyCheckpoint):
    """A WeightOnlyCheckpoint that also holds static W8A8 linears (`static`), read as their float weights; a
    stored bias of one (`bias_stored`) reads as deq * c."""

    def __init__(self, checkpoint, linears: dict, static: dict[str, StaticLinear], consumed: set[str], note: str):
        super().__init__(checkpoint, linears, consumed, note)
        self.static = static
        self.biases = {f"{k.removesuffix('.weight')}.bias": lin for k, lin in static.items() if lin.bias_stored}
        for key, lin in static.items():
            self.entries[key] = (None, "F32", (lin.n, lin.k))
        for key, lin in self.biases.items():
            self.entries[key] = (None, "F32", (lin.n,))

    def tensor(self, key: str):
        import torch

        if key in self.biases:
            return torch.from_numpy(self.biases[key].folded_bias())
        lin = self.static.get(key)
        return lin.dequantized() if lin is not None else super().tensor(key)


def to_qdq(model, static: dict[str, StaticLinear], weights: dict[str, str]) -> int:
    """Rewrite each MatMul reading a static linear's weight (an initializer of `model` named in `weights`,
    value name -> checkpoint key) as the QDQ linear above; returns the linears rewritten. A linear whose weight
    another node reads is refused: its activations could not be quantized as the format says."""
    import onnx_ir as ir

    graph = model.graph
    shared: dict[tuple, ir.Value] = {}
    done = 0
    for name, key in weights.items():
        lin, value = static.get(key), graph.initializers.get(name)
        if lin is None or value is None:
            continue
        readers, casts = _matmul_readers(value)
        if not readers:
            raise UnsupportedError(f"{key}: a static W8A8 weight read by other nodes than MatMuls: graphconv cannot "
                                   "quantize its activations")
        w_dq = _weight_dq(graph, lin, name)
        bias = lin.bias()
        for mm in readers:
            x = _activation_qdq(graph, mm.inputs[0], lin, shared)
            new = ir.node("MatMul", [x, w_dq], name=mm.name)
            nodes, out = [new], new.outputs[0]
            if bias is not None:
                b = _initializer(graph, f"{name}_bias", bias)
                add = ir.node("Add", [out, b], name=f"{mm.name}_bias")
                nodes.append(add)
                out = add.outputs[0]
            ir.convenience.replace_nodes_and_values(graph, mm, [mm], nodes, [mm.outputs[0]], [out])
        for cast in casts:
            graph.remove(cast, safe=True)
        graph.initializers.pop(name)
        done += 1
    return done


def _initializer(graph, name: str, array: np.ndarray, lazy=None):
    import onnx_ir as ir

    dtype = ir.DataType.from_numpy(array.dtype) if lazy is None else lazy[0]
    shape = ir.Shape(array.shape if lazy is None else lazy[1])
    tensor = ir.tensor(array, name=name) if lazy is None else ir.LazyTensor(lazy[2], dtype=dtype, shape=shape,
                                                                             name=name)
    v = ir.Value(name=name, shape=shape, type=ir.TensorType(dtype), const_value=tensor)
    graph.register_initializer(v)
    return v


def _weight_dq(graph, lin: StaticLinear, name: str):
    """DequantizeLinear(Wq^T int8 [K, N], deq / s_x [N], axis 1), the integers read when they are written."""
    import onnx_ir as ir

    def wq_t():
        return ir.tensor(np.ascontiguousarray(lin.read()[0].T), name=f"{name}_int8")

    w = _initializer(graph, f"{name}_int8", None, (ir.DataType.INT8, (lin.k, lin.n), wq_t))
    scale = _initializer(graph, f"{name}_scale", lin.weight_scale(lin.read()[1]))
    dq = ir.node("DequantizeLinear", [w, scale], attributes={"axis": 1}, name=f"{name}_dq")
    graph.insert_before(graph[0], dq) if len(graph) else graph.append(dq)
    return dq.outputs[0]


def _activation_qdq(graph, x, lin: StaticLinear, shared: dict):
    """DequantizeLinear(QuantizeLinear(x, s_x, z_x), s_x, z_x), one per activation and (s_x, z_x)."""
    import onnx_ir as ir

    key = (id(x), np.float32(lin.input_scale).item(), lin.input_zero_point)
    if key not in shared:
        base = f"{x.name or 'x'}_q{len(shared)}"
        s = _initializer(graph, f"{base}_scale", np.array(lin.input_scale, np.float32))
        zp = _initializer(graph, f"{base}_zero_point", np.array(lin.input_zero_point, np.int8))
        q = ir.node("QuantizeLinear", [x, s, zp], name=f"{base}_quantize")
        dq = ir.node("DequantizeLinear", [q.outputs[0], s, zp], name=f"{base}_dequantize")
        producer = x.producer()
        if producer is None:
            graph.insert_before(graph[0], [q, dq])
        else:
            graph.insert_after(producer, [q, dq])
        shared[key] = dq.outputs[0]
    return shared[key]


def fake_quantized_model(cls, config, checkpoint: QuantizedCheckpoint):
    """The export's check reference: the dequantized model (quantized_linears.dequantized_model) whose static
    linears fake-quantize their inputs, (clamp(round(x / s_x) + z_x) - z_x) * s_x in fp32, and add deq * c.
    The zero point is added after the rounding, as QuantizeLinear does: at an exact tie of x / s_x (fp32 makes
    them, one element in some thousands) with an odd zero point, the format's round(x / s_x + z_x) is one step
    apart, and in a quantized network one step moves every later rounding near it, far past the check's
    tolerance; elsewhere the two are the same integer."""
    import torch

    from graphconv.frontend.quantized_linears import dequantized_model

    model = dequantized_model(cls, config, checkpoint)
    modules = dict(model.named_modules())
    for key, lin in checkpoint.static.items():
        module = modules[key.removesuffix(".weight")]
        bias = lin.bias()

        def pre(_m, args, s=np.float32(lin.input_scale).item(), z=float(lin.input_zero_point)):
            (x, *rest) = args
            xq = torch.clamp(torch.round(x / s) + z, -128, 127)  # (QuantizeLinear's order: see the module doc)
            return ((xq - z) * s, *rest)

        module.register_forward_pre_hook(pre)
        if bias is not None:
            b = torch.from_numpy(bias)
            module.register_forward_hook(lambda _m, _a, y, b=b: y + b)
    return model
