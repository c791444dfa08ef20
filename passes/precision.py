"""Lower-precision emission: run a fused fp32 graph in fp16 or bf16, with fp32 islands.

`apply_precision(model, "fp16", keep)` rewrites a (fused, shape-inferred) fp32 ONNX graph so that its weights
and compute are in the low dtype, except

- nodes whose op type is in `keep` (default KEEP_FP32: norm statistics, softmax, large reductions, the RoPE
  angle functions). They get their float inputs cast to fp32 and produce fp32;
- the RoPE angle computation: every float node that feeds a kept Cos/Sin stays fp32 too (positions times
  inverse frequencies lose whole radians in fp16 and everything in bf16: bf16 holds integers exactly only up
  to 256);
- float values that do not descend from a weight or a float graph input (positions cast from int, masks
  built from shapes): they stay fp32 until a low-precision node consumes them.

A node computes in the low dtype when any of its float inputs is low (weights count as low), otherwise in
fp32; casts are inserted where the two meet, one per value and direction. The model's inputs and outputs keep
their fp32 type (the network casts at its boundary), so the emitted MindIR is called exactly like the fp32
one. Fused `mindspore::` ops take low-precision inputs and compute inside in fp32, as their kernels do
(docs/fused_ops.md: RmsNorm, RotaryPositionEmbedding, Swiglu "in fp32, cast out"); their function bodies say so
with Cast/CastLike, so the cpu twin inlines the same behaviour.

`emulate_in_fp32(model, "bf16")` is for running on MindSpore CPU, which has no bf16 kernels for MatMul,
Softmax, Exp, ... (measured with 2.10): every bf16 value becomes an fp32 value rounded to bf16, i.e. each
low-precision node computes in fp32 and rounds its result to bf16. The report says when this is used.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphconv.dtypes import PRECISION_DTYPES
from graphconv.frontend import weights
from graphconv.frontend.param_names import record_made
from graphconv.onnx_domains import find_default_opset, is_default_domain, op_key  # (op_key: API)

PRECISIONS = ("fp32", "fp16", "bf16")
LOW_DTYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
# The comparison rule's tolerance key (graphconv.verify.compare.DEFAULT_TOLERANCE) for each precision.
TOLERANCE_KEY = PRECISION_DTYPES
# How MindSpore CPU runs each precision (measured with mindspore 2.10: fp16 kernels exist for every op the
# zoo uses; bf16 has Cast, Add, Mul, Transpose, Reshape, Concat but no MatMul, Softmax, Exp, Gather, ...).
CPU_EMULATED = {"fp16": False, "bf16": True}

KEEP_FP32 = (
    # norm statistics (fused norms compute their statistics in fp32 inside the kernel: docs/fused_ops.md)
    "ReduceMean", "ReduceSumSquare", "ReduceL2", "Pow", "Sqrt",
    "LayerNormalization", "RMSNormalization", "GroupNormalization", "InstanceNormalization",
    # softmax and large reductions
    "Softmax", "LogSoftmax", "ReduceSum", "ReduceLogSumExp", "CumSum",
    # the RoPE angle computation (with everything that feeds them: see the module docstring)
    "Cos", "Sin",
)
# Inputs that ONNX requires to be fp32 whatever the data's dtype (op type -> input indices).
_FP32_INPUTS = {"Resize": (1, 2), "Upsample": (1,)}
# Inputs left in the dtype they arrive in: the attention mask is 0 / large negative (cast to fp16 it turns
# into -inf) and both lowerings read it as a mask, not as data.
def _as_is_inputs(key: str) -> tuple[int, ...]:
    """The inputs of fused op `mindspore::Name` its record leaves in their dtype (opmap.fused)."""
    from opmap.fused import FUSED_OPS

    op = FUSED_OPS.get(key.removeprefix("mindspore::")) if key.startswith("mindspore::") else None
    return op.as_is_inputs if op is not None else ()
_SUBGRAPH_OPS = {"If", "Loop", "Scan"}


def emulation_note(precision: str) -> str:
    """What the report and debug say when MindSpore CPU cannot run `precision` and the cpu twin emulates it."""
    return (f"MindSpore CPU has no {precision} kernels for MatMul, Softmax, Exp, ...: the cpu twin computes in "
            f"fp32 and rounds every result to {precision}")


class PrecisionError(ValueError):
    """The graph cannot be lowered to the requested precision (the message says why)."""


@dataclasses.dataclass
class PrecisionSummary:
    precision: str
    kept_op_types: list[str]  # the keep set asked for
    fp32_nodes: dict[str, int]  # op type -> nodes that compute in fp32 (kept, angle cone, or fp32 context)
    low_nodes: int
    casts_inserted: int
    weights_converted: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_keep(spec: str | None) -> tuple[str, ...]:
    """`--keep-fp32`: None = the default set; "" or "none" = nothing; "+Exp,Erf" adds to the default."""
    if spec is None:
        return KEEP_FP32
    spec = spec.strip()
    if spec.lower() in ("", "none"):
        return ()
    if spec.startswith("+"):
        return tuple(dict.fromkeys(KEEP_FP32 + tuple(s.strip() for s in spec[1:].split(",") if s.strip())))
    return tuple(s.strip() for s in spec.split(",") if s.strip())


def check_keep(ops: tuple[str, ...]) -> None:
    """Refuse names in a keep set that are neither ONNX op types nor fused ops (`mindspore::RmsNorm`)."""
    import onnx.defs

    from opmap.fused import FUSED_OPS

    unknown = [op for op in ops if not (onnx.defs.has(op) or op.removeprefix("mindspore::") in FUSED_OPS
                                        and op.startswith("mindspore::"))]
    if unknown:
        raise PrecisionError(f"--keep-fp32: unknown op type(s) {', '.join(unknown)} "
                             "(ONNX op types, or fused ops as mindspore::Name)")


def _float_values(model: onnx.ModelProto) -> set[str]:
    vis = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    out = {v.name for v in vis if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    out |= {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    for n in model.graph.node:
        if n.op_type == "Constant" and is_default_domain(n.domain):
            for a in n.attribute:
                if a.name in ("value", "value_float", "value_floats") and (
                        a.name != "value" or a.t.data_type == TensorProto.FLOAT):
                    out.add(n.output[0])
    return out


def _angle_cone(nodes: list[onnx.NodeProto], floats: set[str], keep: set[str]) -> set[int]:
    """Indices of the float nodes that feed a kept Cos or Sin (through float values)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    cone: set[int] = set()
    stack = [i for i, n in enumerate(nodes) if n.op_type in ("Cos", "Sin") and n.op_type in keep]
    while stack:
        i = stack.pop()
        for name in nodes[i].input:
            j = producer.get(name)
            if j is not None and name in floats and j not in cone:
                cone.add(j)
                stack.append(j)
    return cone


def apply_precision(model: onnx.ModelProto, precision: str, keep=KEEP_FP32, spill=None,
                    ) -> tuple[onnx.ModelProto, PrecisionSummary]:
    """A copy of `model` computing in `precision` with fp32 islands (module docstring). With `spill` (a
    graphconv.frontend.weights.SpillFile) converted external weights are written there instead of into the proto."""
    if precision not in LOW_DTYPES:
        raise PrecisionError(f"precision must be one of {', '.join(LOW_DTYPES)}, not {precision!r}")
    low = LOW_DTYPES[precision]
    keep = set(keep)
    g = model.graph
    sub = sorted({n.op_type for n in g.node if n.op_type in _SUBGRAPH_OPS})
    if sub:
        raise PrecisionError(f"--precision does not handle control flow yet ({', '.join(sub)}); compile at fp32")
    from opmap.fused.record import island_casts

    fp32_only_fused = not island_casts(find_default_opset(model) or 0)  # a fused body without CastLike
    floats = _float_values(model)
    nodes = list(g.node)
    cone = _angle_cone(nodes, floats, keep)
    initializers = {t.name: t for t in g.initializer}

    state: dict[str, str] = {}  # float value -> "low" | "fp32": its dtype in the new graph
    weights_low: set[str] = set()  # float initializers some low node reads (as `<name>__<precision>`)
    casts: dict[tuple[str, str], str] = {}  # (value, "low" | "fp32") -> name of its cast
    new_nodes: list[onnx.NodeProto] = []
    fp32_nodes: dict[str, int] = {}
    low_count = output_casts = 0

    def cast(name: str, to: str) -> str:
        if (name, to) not in casts:
            casts[name, to] = f"{name}__{precision if to == 'low' else 'fp32'}"
            new_nodes.append(helper.make_node("Cast", [name], [casts[name, to]], name=f"{casts[name, to]}_cast",
                                              to=low if to == "low" else TensorProto.FLOAT))
        return casts[name, to]

    def is_weight(name: str) -> bool:
        t = initializers.get(name)
        return t is not None and t.data_type == TensorProto.FLOAT and int(np.prod(t.dims)) > 1

    # Values that are exact widenings of a `low` value: Cast(to=FLOAT) of a value already in the low dtype (a
    # `--dtype auto` export reads each bf16 weight so). A low reader takes the low value itself: narrowing the
    # widened copy back would give the same bits through two full-size casts on every call.
    typed = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input)}
    typed.update({t.name: t.data_type for t in g.initializer})
    widened = {n.output[0]: n.input[0] for n in nodes if n.op_type == "Cast" and is_default_domain(n.domain)
               and typed.get(n.input[0]) == low
               and next((a.i for a in n.attribute if a.name == "to"), None) == TensorProto.FLOAT}

    for i, n in enumerate(nodes):
        key = op_key(n)
        float_in = [k for k, x in enumerate(n.input) if x and x in floats]
        fused = not is_default_domain(n.domain)
        pinned = key in keep or n.op_type in keep or i in cone or (fused and fp32_only_fused)
        # Weights are low by nature; scalar constants and fp32-context values do not decide.
        runs_low = not pinned and any(state.get(n.input[k]) == "low" or is_weight(n.input[k]) for k in float_in)
        out = onnx.NodeProto()
        out.CopyFrom(n)
        for k in float_in:
            x = n.input[k]
            if k in _as_is_inputs(key):
                continue
            target = "low" if runs_low and k not in _FP32_INPUTS.get(n.op_type, ()) else "fp32"
            if is_weight(x) and target == "low":
                weights_low.add(x)
                out.input[k] = _low_name(x, precision)
            elif x in initializers or x not in state:  # scalar initializers and Constant outputs are fp32
                if target == "low":
                    out.input[k] = cast(x, "low")
            elif state[x] != target:
                out.input[k] = widened[x] if target == "low" and x in widened else cast(x, target)
        if n.op_type == "Cast" and is_default_domain(n.domain) and runs_low:
            to = next(a for a in out.attribute if a.name == "to")
            if to.i == TensorProto.FLOAT:
                to.i = low
        if n.op_type != "Constant":
            for o in n.output:
                if o in floats:
                    state[o] = "low" if runs_low else "fp32"
        if runs_low:
            low_count += 1
        elif float_in or any(o in floats for o in n.output):
            fp32_nodes[key] = fp32_nodes.get(key, 0) + 1
        new_nodes.append(out)

    # The widening Casts no reader is left for (every reader took the low value): dropped.
    read = {x for node in new_nodes for x in node.input} | {o.name for o in g.output}
    new_nodes = [node for node in new_nodes if not (node.output and node.output[0] in widened
                                                    and node.output[0] not in read)]

    # Graph outputs keep fp32: a low output is renamed inside the graph and cast back under its own name.
    for o in g.output:
        if state.get(o.name) == "low":
            inner = f"{o.name}__{precision}_out"
            for node in new_nodes:
                node.input[:] = [inner if x == o.name else x for x in node.input]
                node.output[:] = [inner if x == o.name else x for x in node.output]
            new_nodes.append(helper.make_node("Cast", [inner], [o.name], name=f"{o.name}_cast_fp32",
                                              to=TensorProto.FLOAT))
            output_casts += 1

    # Weights: converted in place when no fp32 node reads them any more, else added as a low copy.
    still_fp32 = {x for node in new_nodes for x in node.input}
    inits = []
    for t in g.initializer:
        if t.name not in weights_low:
            inits.append(t)
            continue
        lowered = _to_low(t, precision, spill)
        if t.name in still_fp32:
            lowered.name = _low_name(t.name, precision)
            inits += [t, lowered]
        else:
            inits.append(lowered)
            for node in new_nodes:
                node.input[:] = [t.name if x == _low_name(t.name, precision) else x for x in node.input]

    result = onnx.ModelProto()
    result.CopyFrom(model)
    rg = result.graph
    del rg.node[:], rg.initializer[:], rg.value_info[:]  # types changed: shape inference recomputes them
    rg.node.extend(new_nodes)
    rg.initializer.extend(inits)
    for name in weights_low:  # the weight mapping beside the .ckpt lists the casts (graphconv/frontend/param_names.py)
        if name in still_fp32:
            record_made(rg, _low_name(name, precision), [name], f"cast to {precision}",
                        f"suffix:__{precision}", made_by="precision")
        else:
            record_made(rg, name, [name], f"cast to {precision}", "same", made_by="precision")
    result = onnx.shape_inference.infer_shapes(result, data_prop=True)
    summary = PrecisionSummary(precision, sorted(keep), dict(sorted(fp32_nodes.items())), low_count,
                               len(casts) + output_casts, len(weights_low))
    return result, summary


def _low_name(name: str, precision: str) -> str:
    return f"{name}__{precision}"


def _to_low(t: onnx.TensorProto, precision: str, spill=None) -> onnx.TensorProto:
    """`t` converted; written to `spill` (not into the proto) when it came from a file, and only named there
    when it is zeros never written (a KV cache's: SpillFile.zeros)."""
    if spill is not None and weights.unwritten_zeros(t):
        return spill.zeros(t.name, LOW_DTYPES[precision], list(t.dims))
    arr = weights.to_array(t).astype(np.float32)
    if precision == "fp16":
        low = arr.astype(np.float16)
    else:
        import ml_dtypes

        low = arr.astype(ml_dtypes.bfloat16)
    if spill is not None and t.data_location == TensorProto.EXTERNAL:
        return spill.tensor_proto(t.name, low)
    return numpy_helper.from_array(low, t.name)


def emulate_in_fp32(model: onnx.ModelProto, precision: str, spill=None) -> onnx.ModelProto:
    """Every `precision` value of a lowered model as fp32 holding values rounded to `precision`.

    Each node that produced a low-precision value now computes in fp32 and rounds its result (Cast to the
    low dtype and back), named as parts of the node (`<node>::...`), so that the layer grouping keeps them in
    its layer: a block then passes on the rounded value under its name in the model as given, where the
    oracle's layer-by-layer run can be cut too. Low-precision weights stay as they are and are read through a Cast
    to fp32 (an exact widening): an fp32 copy would double their bytes, on disk in the spill and in memory, and the
    low ones are the target network's own Parameters, which the verification shares with this network where they
    agree (graphconv/runtime/network.shareable). A graph whose subgraphs read weights (If, Loop) gets fp32 copies
    instead, since a Cast at the top would not reach them. So does a KV cache held in place (passes/stateful_cache.py):
    its update writes the Parameter itself, and the values it writes are rounded already. Used to run a bf16 network
    on MindSpore CPU, whose bf16 kernels are missing (module docstring).
    """
    from passes.stateful_cache import cache_names

    low = LOW_DTYPES[precision]
    typed = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.output)}
    result = onnx.ModelProto()
    result.CopyFrom(model)
    g = result.graph
    subgraphs = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                    for n in g.node for a in n.attribute)
    widened = {}
    caches = set(cache_names(result))
    for t in g.initializer:
        if t.data_type != low:
            continue
        external = spill is not None and t.data_location == TensorProto.EXTERNAL
        if external and t.name in caches and weights.unwritten_zeros(t):
            t.CopyFrom(spill.zeros(t.name, TensorProto.FLOAT, list(t.dims)))
        elif subgraphs or t.name in caches:
            wide = weights.to_array(t).astype(np.float32)
            t.CopyFrom(spill.tensor_proto(t.name, wide) if external else numpy_helper.from_array(wide, t.name))
        else:
            widened[t.name] = f"{t.name}__wide"
    new_nodes = [helper.make_node("Cast", [name], [wide], name=f"{name}_widen", to=TensorProto.FLOAT)
                 for name, wide in widened.items()]
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type == low:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
        n.input[:] = [widened.get(x, x) for x in n.input]
        new_nodes.append(n)
        if n.op_type == "Constant":
            continue
        is_cast = n.op_type == "Cast" and is_default_domain(n.domain)
        for k, name in enumerate(n.output):
            if not name or typed.get(name) != low:
                continue
            wide = f"{name}__wide"
            n.output[k] = wide
            if not is_cast:  # computed in fp32: round the result (a Cast to bf16 already rounded)
                new_nodes.append(helper.make_node("Cast", [wide], [f"{name}__rounded"], name=f"{n.name}::{name}_round",
                                                  to=low))
                wide = f"{name}__rounded"
            new_nodes.append(helper.make_node("Cast", [wide], [name], name=f"{n.name}::{name}_widen",
                                              to=TensorProto.FLOAT))
    del g.node[:], g.value_info[:]
    g.node.extend(new_nodes)
    return onnx.shape_inference.infer_shapes(result, data_prop=True)
