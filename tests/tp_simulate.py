"""The ranks of a tensor-parallel plan simulated with onnxruntime in one process.

Each rank's graph is cut at its graphconv::AllReduce nodes: the value going in becomes a graph output, the
value coming out a graph input. Every round runs every rank with the sums of the previous round's partial
values fed in; the k-th sum is right from round k on (it depends only on the sums before it), so after as many
rounds as there are AllReduces every output is what the ranks compute together.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from graphconv.target import sharding


def _cut(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[tuple[str, str]]]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    pairs = [(n.input[0], n.output[0]) for n in m.graph.node if (n.domain, n.op_type) == (sharding.DOMAIN,
                                                                                         sharding.ALL_REDUCE)]
    keep = [n for n in m.graph.node if (n.domain, n.op_type) != (sharding.DOMAIN, sharding.ALL_REDUCE)]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    elem = {v.name: v.type.tensor_type.elem_type for v in m.graph.value_info}
    for x, y in pairs:
        m.graph.input.append(onnx.helper.make_tensor_value_info(y, elem.get(x, onnx.TensorProto.FLOAT), None))
        m.graph.output.append(onnx.helper.make_tensor_value_info(x, elem.get(x, onnx.TensorProto.FLOAT), None))
    return m, pairs


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_ranks(models: list[onnx.ModelProto], feeds: dict) -> list[list[np.ndarray]]:
    """Every rank's graph outputs for the same `feeds`, the AllReduces summing over the ranks."""
    cuts = [_cut(m) for m in models]
    pairs = cuts[0][1]
    n_out = len(models[0].graph.output)
    # round 0: each rank alone (AllReduce as its identity body), its partial values as extra outputs
    partial = []
    for model in models:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for x, _ in pairs:
            m.graph.output.append(onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None))
        partial.append(_session(m).run([x for x, _ in pairs], feeds))
    sessions = [_session(m) for m, _ in cuts]
    outs = None
    for _ in range(len(pairs)):
        sums = {y: sum(p[k] for p in partial) for k, (_, y) in enumerate(pairs)}
        outs = [s.run(None, {**feeds, **sums}) for s in sessions]
        partial = [o[n_out:] for o in outs]
    return [o[:n_out] for o in outs]
