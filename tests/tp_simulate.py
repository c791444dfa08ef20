"""The ranks of a tensor-parallel plan simulated with onnxruntime in one process.

Each rank's graph is cut at its collectives (graphconv::AllReduce, graphconv::AllGather): the value going in
becomes a graph output, the value coming out a graph input. Every round runs every rank with the previous
round's partial values combined (summed for an AllReduce, concatenated in rank order along its axis for an
AllGather) and fed in; the k-th combination is right from round k on (it depends only on the ones before it),
so after as many rounds as there are collectives every output is what the ranks compute together.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from graphconv.parallel import sharding

_COLLECTIVES = (sharding.ALL_REDUCE, sharding.ALL_GATHER)


def _collectives(model: onnx.ModelProto) -> list[tuple[str, str, int | None]]:
    """(value in, value out, gather axis or None for a sum) of each collective, in graph order."""
    return [(n.input[0], n.output[0], next((a.i for a in n.attribute if a.name == "axis"), None)
             if n.op_type == sharding.ALL_GATHER else None)
            for n in model.graph.node if n.domain == sharding.DOMAIN and n.op_type in _COLLECTIVES]


def _cut(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [n for n in m.graph.node if not (n.domain == sharding.DOMAIN and n.op_type in _COLLECTIVES)]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    elem = {v.name: v.type.tensor_type.elem_type for v in m.graph.value_info}
    for x, y, _ in _collectives(model):
        m.graph.input.append(helper.make_tensor_value_info(y, elem.get(x, onnx.TensorProto.FLOAT), None))
        m.graph.output.append(helper.make_tensor_value_info(x, elem.get(x, onnx.TensorProto.FLOAT), None))
    return m


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_ranks(models: list[onnx.ModelProto], feeds: dict) -> list[list[np.ndarray]]:
    """Every rank's graph outputs for the same `feeds`, the collectives combining the ranks' values."""
    pairs = _collectives(models[0])
    n_out = len(models[0].graph.output)
    # round 0: each rank alone (the collectives as their one-rank bodies), its partial values as extra outputs
    partial = []
    for model in models:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for x, _, _ in pairs:
            m.graph.output.append(helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None))
        partial.append(_session(m).run([x for x, _, _ in pairs], feeds))
    sessions = [_session(_cut(m)) for m in models]
    outs = None
    for _ in range(len(pairs)):
        combined = {y: sum(p[k] for p in partial) if axis is None else np.concatenate([p[k] for p in partial], axis)
                    for k, (_, y, axis) in enumerate(pairs)}
        outs = [s.run(None, {**feeds, **combined}) for s in sessions]
        partial = [o[n_out:] for o in outs]
    return [o[:n_out] for o in outs]
