"""onnxruntime's contrib ops, rewritten on load into the standard ONNX an exporter would have written.

Models made by onnxruntime's tools (onnxruntime-genai's model builder, the transformers optimizer, the
quantizer) use ops onnxruntime registers beyond the ONNX standard: the `com.microsoft` domain
(GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits, ...) and a few in the default domain
(SimplifiedLayerNormalization). onnx.checker and onnx's shape inference do not know them, onnxsim cannot
simplify them, and opmap has no lowering for them.

So the loader replaces each such node by standard ONNX that computes exactly what onnxruntime's kernel
computes (each decomposition's docstring states the semantics and where they were read). After that the
model is an ordinary one: the fusion passes see the same spellings as in a PyTorch export (an RMSNorm written
out, attention as MatMul/Softmax/MatMul, ...) and fuse them to MindSpore's fused operators, every target
lowers them, and the cpu twin runs them. The oracle runs the model as given, in onnxruntime, so a wrong
decomposition shows up as a verification failure, never as a silently different model (the integer products
of MatMulIntegerToFloat and DynamicQuantizeMatMul excepted: the oracle computes those exactly, not with
onnxruntime's u8s8 kernel, graphconv/verify/integer_products.py).

A decomposition is registered per (domain, op type) with `@decomposes(...)`; it receives a `Rewrite`
(graphconv/frontend/contrib/rewrite.py) and writes the replacement nodes through it.
"""

from __future__ import annotations

import collections
import functools

import onnx

from graphconv.errors import UnsupportedError
from graphconv.onnx_domains import canonical_domain, default_opset, find_default_opset
from graphconv.frontend.contrib.registry import DECOMPOSITIONS, FUSED_TABLE, MICROSOFT, decomposes  # noqa: F401 (API)
from graphconv.frontend.contrib.rewrite import Rewrite, read_values, static_shapes

@functools.cache
def onnxruntime_ops() -> frozenset[tuple[str, str]]:
    """(domain, op type) of every op onnxruntime registers a schema for (contrib ops included)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    return frozenset((canonical_domain(s.domain), s.name) for s in ort_c.get_all_operator_schema())


def is_standard(node: onnx.NodeProto, opsets: dict[str, int]) -> bool:
    """An op onnx itself defines at the model's opset of its domain."""
    domain = canonical_domain(node.domain)
    if domain not in ("", "ai.onnx.ml", "ai.onnx.preview.training"):
        return False
    try:
        onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
        return True
    except onnx.defs.SchemaError:
        return False


@functools.cache
def _first_opset(op_type: str) -> int | None:
    """The first opset at which onnx defines `op_type` in the default domain, or None."""
    versions = [s.since_version for s in onnx.defs.get_all_schemas_with_history()
                if s.name == op_type and s.domain == ""]
    return min(versions) if versions else None


def contrib_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Main-graph nodes of ops onnxruntime registers but onnx does not define at the model's opset."""
    opsets = {canonical_domain(i.domain): i.version for i in model.opset_import}
    return [n for n in model.graph.node
            if not is_standard(n, opsets) and (canonical_domain(n.domain), n.op_type) in onnxruntime_ops()]


def label(node: onnx.NodeProto) -> str:
    domain = canonical_domain(node.domain)
    return f"{domain}::{node.op_type}" if domain else node.op_type


def decompose(model: onnx.ModelProto, only: tuple[str, ...] = (), spill=None) -> tuple[onnx.ModelProto, dict[str, int]]:
    """`model` with every onnxruntime contrib node replaced by its standard decomposition (a new proto; the
    input is left as given, for the oracle). Returns it and the count of decomposed nodes per op. An op
    onnxruntime registers that graphconv cannot decompose is refused, naming it. `only`: just the nodes of
    these op types. `spill`: where the weights a decomposition re-lays go (Rewrite)."""
    nodes = [n for n in contrib_nodes(model) if not only or n.op_type in only]
    if not nodes:
        return model, {}
    missing = sorted({label(n) for n in nodes if (canonical_domain(n.domain), n.op_type) not in DECOMPOSITIONS})
    opset = find_default_opset(model)
    too_new = {op: since for op in missing if (since := _first_opset(op)) is not None}
    if too_new:  # standard ops of a later opset than the model imports: not contrib ops at all
        op, since = sorted(too_new.items())[0]
        raise UnsupportedError(f"op {op} does not exist at opset {opset} (onnx defines it from opset {since}); "
                               f"{len(too_new)} such op(s): {', '.join(sorted(too_new))}")
    if missing:
        raise UnsupportedError(f"{len(missing)} onnxruntime contrib op(s) graphconv does not lower: "
                               f"{', '.join(missing)} (onnxruntime runs them; no MindSpore mapping is written)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    shapes = static_shapes(model)
    opset = default_opset(model)
    taken = {x for n in model.graph.node for x in (*n.input, *n.output, n.name)}
    taken |= {t.name for t in model.graph.initializer} | {v.name for v in model.graph.input}
    read = read_values(model)
    initializers = {t.name: t for t in model.graph.initializer}
    counts: collections.Counter[str] = collections.Counter()
    chosen = {id(n) for n in nodes}  # the contrib nodes found above, by the one rule (contrib_nodes)
    new_nodes: list[onnx.NodeProto] = []
    made: list[onnx.TensorProto] = []
    for node in model.graph.node:
        if id(node) not in chosen:
            new_nodes.append(node)
            continue
        rw = Rewrite(node, shapes, opset, taken, read, initializers, spill)
        DECOMPOSITIONS[(canonical_domain(node.domain), node.op_type)](rw)
        new_nodes.extend(rw.finish())
        made.extend(rw.initializers)
        counts[label(node)] += 1
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    if made:  # (MatMulNBits as WeightQuantBatchMatmul: its weights re-laid; the sources no node reads go)
        _replace_initializers(out, made)
    # Value infos of the replaced nodes' outputs stay valid (same names, same values); the ones the
    # decompositions add are inferred later. Domains no node uses any more are dropped from the imports.
    used = {canonical_domain(n.domain) for n in out.graph.node} | {""}
    used |= {canonical_domain(f.domain) for f in out.functions}
    for f in out.functions:
        used |= {canonical_domain(n.domain) for n in f.node}
    kept = [i for i in out.opset_import if canonical_domain(i.domain) in used]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out, dict(counts)


def _replace_initializers(model: onnx.ModelProto, made: list[onnx.TensorProto]) -> None:
    """Add the initializers decompositions made, drop those nothing reads any more, and attach the bodies of
    the fused ops a decomposition wrote (mindspore::WeightQuantBatchMatmul: onnxruntime, onnxsim and shape
    inference run them until the passes)."""
    model.graph.initializer.extend(made)
    read = read_values(model)
    inputs = {i.name for i in model.graph.input}
    kept = [t for t in model.graph.initializer if t.name in read or t.name in inputs]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if any(n.domain == "mindspore" for n in model.graph.node):
        FUSED_TABLE["attach"](model)


def oracle_semantics(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, dict[str, str]]:
    """Where onnxruntime's kernels approximate a quantized op's semantics, a copy of `model` computing what the
    compiled network computes, for the oracle, and {report key: what the oracle runs instead}; (None, {}) where
    they do not: MatMulNBits at accuracy_level > 0 (at_accuracy_level_0), DynamicQuantizeLSTM (its hidden
    state quantized at every step: the oracle runs the decomposition, quant.dynamic_quantize_lstm)."""
    exact, levels = quant.at_accuracy_level_0(model)
    instead = {}
    if levels:
        shown = ", ".join(map(str, levels))
        instead[f"accuracy_level_{shown}_vs_0"] = (
            f"MatMulNBits accuracy_level {shown}: onnxruntime may quantize the activations there; the oracle runs "
            "the model at accuracy_level 0 (the op's exact semantics)")
    exact, lstms = decompose(exact or model, only=("DynamicQuantizeLSTM",))
    if lstms:
        instead["dynamic_quantize_lstm_vs_float_state"] = (
            "DynamicQuantizeLSTM: onnxruntime quantizes the hidden state to uint8 at every step, which no MindSpore "
            "LSTM primitive does; the oracle runs the decomposition graphconv compiles (dequantized weights, the "
            "input quantized as onnxruntime does, the state in float)")
    return (exact, instead) if instead else (None, {})


# The decompositions, one module per op family (each registers itself).
from graphconv.frontend.contrib import norm  # noqa: E402,F401  (registers its decompositions)
from graphconv.frontend.contrib import rotary  # noqa: E402,F401  (registers its decompositions)
from graphconv.frontend.contrib import gqa  # noqa: E402,F401  (registers its decompositions)
from graphconv.frontend.contrib import quant  # noqa: E402  (registers its decompositions)
from graphconv.frontend.contrib import layer_norm  # noqa: E402,F401
from graphconv.frontend.contrib import gelu  # noqa: E402,F401
from graphconv.frontend.contrib import matmul  # noqa: E402,F401
from graphconv.frontend.contrib import embed  # noqa: E402,F401
from graphconv.frontend.contrib import bert_attention  # noqa: E402,F401
