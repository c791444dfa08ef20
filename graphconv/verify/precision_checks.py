"""What a compile measures about precision beside its main check: the fused primitives' own lower precision on
Ascend (`ascend_variant`, `check_ascend_variant`: q/k/v cast to fp16 around FlashAttentionScore), the error
of a low-precision network at every norm output (`profile`), and how far a model whose onnxruntime kernels
approximate a quantized op (MatMulNBits quantizing activations, DynamicQuantizeLSTM its state) is from what the
oracle runs instead (`approximation_difference`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

import opmap.fused
from passes import precision
from graphconv.errors import VerificationError
from graphconv.onnx_domains import is_default_domain
from graphconv.verify import compare, reference


@dataclasses.dataclass
class AscendVariant:
    """The fused graph with bodies that round like the ascend lowering, the ops that differ, the passes that
    make them, and the fused graph it was made from."""

    model: onnx.ModelProto
    ops: set[str]
    passes: set[str]
    fused: onnx.ModelProto | None = None


def _inputs_already_fp16(fused: onnx.ModelProto, ops: set[str]) -> bool:
    """Whether every node of the fused ops `ops` whose ascend lowering computes in fp16 already gets fp16 data
    inputs (its mask aside): its ascend-precision body then rounds nothing its reference body does not."""
    g = fused.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    small = {t.name: t for t in g.initializer if not t.external_data}
    small.update({n.output[0]: a.t for n in g.node if n.op_type == "Constant"
                  for a in n.attribute if a.name == "value"})

    def fp16(name: str) -> bool:  # an fp16 value, or a constant fp16 holds exactly (the rewriter's 0.0 shift)
        if name in small:
            v = onnx.numpy_helper.to_array(small[name])
            return v.dtype.kind == "f" and bool(np.array_equal(v.astype(np.float16).astype(v.dtype), v))
        return types.get(name) == onnx.TensorProto.FLOAT16

    nodes = [n for n in g.node if n.domain == opmap.fused.DOMAIN and n.op_type in ops]
    return bool(nodes) and all(
        opmap.fused.FUSED_OPS[n.op_type].ascend_compute == "fp16"
        and all(fp16(name) for i, name in enumerate(n.input)
                if name and i not in opmap.fused.FUSED_OPS[n.op_type].as_is_inputs)
        for n in nodes)


def ascend_variant(fused: onnx.ModelProto) -> tuple[AscendVariant | None, dict | None]:
    """Where the ascend lowering computes in lower precision than the fused op's reference body: the variant
    to run (else None), and what the report says when there is nothing to measure (else None)."""
    variant = opmap.fused.ascend_precision_variant(fused)
    if variant is None:
        return None, None
    used = {n.op_type for n in fused.graph.node if n.domain == opmap.fused.DOMAIN}
    ops = {op for op in used if opmap.fused.FUSED_OPS[op].ascend_body}
    if _inputs_already_fp16(fused, ops):  # (an fp16 model: the variant computes what the graph does)
        return None, {"status": "not needed", "why": "the fused ops' inputs are fp16 already"}
    return AscendVariant(variant, ops, {opmap.fused.FUSED_OPS[op].producer for op in ops}, fused), None


def check_ascend_variant(variant: AscendVariant, cases, expected, got) -> tuple[dict, str | None]:
    """The variant's outputs (`got`, run by onnxruntime) against the oracle at fp16's tolerance: the report's
    ascend_precision section and a warning (values beyond fp16 tolerance, within 100x of it); beyond 100x
    (not the rounding of fp16 inputs: an overflow, say) is a VerificationError."""
    atol, rtol = compare.default_tolerance("float16")
    results, failures, beyond = [], [], []
    for case, exp, act in zip(cases, expected, got):
        for name, ref in exp.items():
            c = compare.compare(act[name], ref, atol, rtol, case.valid_positions(ref))
            results.append({"case": case.name, "name": name, **c.as_dict()})
            if not c.ok:
                text = f"output {name!r} at {case.shape_text()}: {c.reason} (max abs {c.max_abs:.3g})"
                (failures if c.suspicious else beyond).append(text)
    status = "failed" if beyond else "exceeds fp16 tolerance" if failures else "ok"
    section = {"precision": "float16", "atol": atol, "rtol": rtol, "outputs": results, "status": status}
    if beyond:
        flips = routing_flips(variant, cases, expected) if variant.fused is not None else None
        if flips is None:
            raise VerificationError("the ascend lowering's fp16 casts exceed fp16 tolerance: " + "; ".join(beyond))
        section.update(status="routing flips", routing=flips)
        return section, (f"the fp16 inputs the ascend lowering gives {', '.join(sorted(variant.ops))} change the "
                         f"top-k choice of {flips['rows_flipped']} of {flips['rows']} rows (MoE routing: there the "
                         f"k-th and (k+1)-th fp32 scores differ by at most {flips['max_margin']:.2g}), which moves "
                         f"outputs beyond fp16 tolerance (" + "; ".join(beyond) + "); with the fp32 choices "
                         f"imposed the outputs are within it (max abs {flips['imposed_max_abs']:.3g}): a near-tie "
                         f"of the router, not an error of the lowering")
    warning = None
    if failures:
        # Within 100x (the comparison rule's "suspicious"): what fp16 inputs do to a deep model (a 32-layer 7B: a
        # few logits in 10^5). The user is told, and how to keep the computation in fp32.
        warning = ("the fp16 inputs the ascend lowering gives " + ", ".join(sorted(variant.ops)) + " (Ascend has no "
                   "fp32 form) move values beyond fp16 tolerance, within 100x of it: " + "; ".join(failures)
                   + "; " + " ".join(f"--disable-pass {p}" for p in sorted(variant.passes)) + " keeps them in fp32")
    return section, warning


_GATING = "MoeGatingTopKSoftmax"


def _choices(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes that choose by rank: TopK, and the fused routers (MoeGatingTopKSoftmax: a softmax's top k)."""
    return [n for n in model.graph.node if (n.op_type == "TopK" and is_default_domain(n.domain))
            or (n.op_type == _GATING and n.domain == opmap.fused.DOMAIN)]


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in have)
    return m


def _imposed(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """`model` with each choice of `nodes` replaced by the one fed as input `<indices>.imposed`: its indices
    are that input, its values gathered from its own scores at them (a fused router's: its softmax's)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = {n.name for n in nodes}
    body = []
    for n in m.graph.node:
        if n.name not in names:
            body.append(n)
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        fed = n.output[1] + ".imposed"
        m.graph.input.append(onnx.helper.make_tensor_value_info(fed, onnx.TensorProto.INT64, None))
        body.append(onnx.helper.make_node("Identity", [fed], [n.output[1]]))
        if n.op_type == _GATING:  # its values are the fp32 softmax's, cast back to x's dtype
            x32, p, y32 = (f"{n.output[0]}.imposed_{s}" for s in ("x32", "p", "y32"))
            body += [onnx.helper.make_node("Cast", [n.input[0]], [x32], to=onnx.TensorProto.FLOAT),
                     onnx.helper.make_node("Softmax", [x32], [p], axis=-1),
                     onnx.helper.make_node("GatherElements", [p, fed], [y32], axis=-1),
                     onnx.helper.make_node("CastLike", [y32, n.input[0]], [n.output[0]])]
        else:
            body.append(onnx.helper.make_node("GatherElements", [n.input[0], fed], [n.output[0]], axis=axis))
    del m.graph.node[:]
    m.graph.node.extend(body)
    return m


def routing_flips(variant: AscendVariant, cases, expected) -> dict | None:
    """Whether outputs beyond fp16 tolerance come from routers choosing other experts: the variant's TopK and
    fused router choices (MoE routers, DeepSeek-V3.2's indexer) are compared with the fp32 fused graph's, and
    the variant is run again with the fp32 choices imposed. A near-tie flipped by fp16 rounding upstream is how
    Ascend would route too; a lowering error survives the imposition. None when there is no choice, none differs,
    or the imposed outputs are still beyond 100x fp16 tolerance."""
    from graphconv.verify import reference

    nodes = _choices(variant.fused)
    if not nodes or {n.name for n in nodes} - {n.name for n in _choices(variant.model)}:
        return None
    picks = [n.output[1] for n in nodes]
    want = reference.Oracle(_with_outputs(variant.fused, picks + [n.input[0] for n in nodes])).run(cases)
    got = reference.Oracle(_with_outputs(variant.model, picks)).run(cases)
    rows = flipped = 0
    margins = []
    for w, g in zip(want, got):
        for n in nodes:
            axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
            largest = next((a.i for a in n.attribute if a.name == "largest"), 1)
            a, b = np.moveaxis(w[n.output[1]], axis, -1), np.moveaxis(g[n.output[1]], axis, -1)
            k = a.shape[-1]
            differ = np.atleast_1d((np.sort(a, -1) != np.sort(b, -1)).any(-1))
            rows += int(differ.size)
            flipped += int(differ.sum())
            scores = np.moveaxis(w[n.input[0]].astype(np.float64), axis, -1)
            if n.op_type == _GATING:
                scores = np.exp(scores - scores.max(-1, keepdims=True))
                scores /= scores.sum(-1, keepdims=True)
            scores = scores.reshape(-1, scores.shape[-1])[differ.reshape(-1)]
            if differ.any() and scores.shape[-1] > k:
                ordered = np.sort(scores if not largest else -scores, -1)
                margins.append(float(np.abs(ordered[:, k] - ordered[:, k - 1]).max()))
    if not flipped:
        return None
    imposed = [reference.ReferenceCase(c.name, {**c.inputs, **{p + ".imposed": w[p] for p in picks}}, c.mask)
               for c, w in zip(cases, want)]
    out = reference.Oracle(_imposed(variant.model, nodes)).run(imposed)
    atol, rtol = compare.default_tolerance("float16")
    worst = 0.0
    for case, exp, act in zip(cases, expected, out):
        for name, ref in exp.items():
            c = compare.compare(act[name], ref, atol, rtol, case.valid_positions(ref))
            if not (c.ok or c.suspicious):
                return None
            worst = max(worst, c.max_abs)
    return {"rows": rows, "rows_flipped": flipped, "max_margin": max(margins, default=float("nan")),
            "imposed_max_abs": worst}


_NORM_OPS = {"mindspore::RmsNorm", "mindspore::LayerNorm", "LayerNormalization", "RMSNormalization"}
_MATMUL_OPS = {"MatMul", "Gemm", "Conv"}


def checkpoints(fused: onnx.ModelProto, model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(value, op) pairs where the precision profile measures error: the outputs of normalization nodes of
    the fused graph (else of matmuls) that the compiled model also holds, in graph order, then the outputs."""
    known = {o for n in model.graph.node for o in n.output}
    picked = []
    for ops in (_NORM_OPS, _MATMUL_OPS):
        for n in fused.graph.node:
            key = precision.op_key(n)
            if key in ops and n.output and n.output[0] in known:
                picked.append((n.output[0], key))
        if picked:
            break
    return picked + [(o.name, "output") for o in model.graph.output]


def profile(model, fused, twin, case, workdir, tolerance: tuple[float, float]) -> list[dict]:
    """Per-layer error growth: the error of the low-precision network (`twin`, run by MindSpore) against the
    fp32 oracle at every normalization output (two per transformer layer; matmul outputs for models without
    norms)."""
    from graphconv.verify import debug

    names = checkpoints(fused, model)
    if not names:
        return []
    expected, got, _ = debug.trace(model, twin, case, [n for n, _ in names], workdir)
    rows = []
    for name, op in names:
        if name in expected and name in got:
            c = compare.compare(got[name], expected[name], *tolerance)
            rows.append({"value": name, "op": op, "max_abs": c.max_abs, "mean_abs": c.mean_abs, "cosine": c.cosine})
    return rows


def approximation_difference(loaded, cases, expected) -> tuple[dict, str]:
    """Where onnxruntime's kernels approximate a quantized op (MatMulNBits at accuracy_level 4 quantizing the
    activations to int8, DynamicQuantizeLSTM its state), the oracle ran a copy computing what the network
    computes (graphconv.frontend.load). How far the model as given is from that reference (worst case over the
    reference shapes), and the warning saying so."""
    got = reference.Oracle(loaded.as_shipped).run(cases)
    diff: dict[str, dict] = {}
    for case, exp, act in zip(cases, expected, got):
        for name, ref in exp.items():
            c = compare.compare(act[name], ref, valid=case.valid_positions(ref))
            d = diff.setdefault(name, {"max_abs": 0.0, "mean_abs": 0.0, "cosine": 1.0})
            d["max_abs"], d["mean_abs"] = max(d["max_abs"], c.max_abs), max(d["mean_abs"], c.mean_abs)
            d["cosine"] = min(d["cosine"], c.cosine)
    worst = max((d["max_abs"] for d in diff.values()), default=0.0)
    return {"_and_".join(loaded.approximations): diff}, (
        f"{'; '.join(loaded.approximations.values())}: the model as given differs from that by max abs {worst:.3g}")
