"""The oracle of a model too big to run whole: onnxruntime runs it one layer at a time.

A model's weights, fed to onnxruntime as memory maps (graphconv.frontend.weights), become resident page by
page as the run reads them, and stay resident until the maps are closed: one run of a 7B model holds all
27 GB. Here the graph is cut into *pieces*, one per block of the compiled network (graphconv/compiler/
partition.py: the prologue, each layer, the epilogue); each piece runs as a model of its own over every case,
with only its weights mapped, and is released (session and maps) before the next. The pieces' values that
later pieces read are kept between them (activations of the reference cases: kilobytes to megabytes). The
outputs are the model's: the same nodes run, in the same order, on the same kernels, with the same inputs.

The cut (`cut`) is at the values the blocks pass on, by their ONNX names: piece k is every node needed for
block k's values that no earlier piece computed. So the pieces are the blocks, and each piece keeps the values
the block-by-block run compares. A block whose values the model does not hold by those names (a value only the
lowering made) is joined to the next piece.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np
import onnx

from graphconv.errors import UnsupportedError, first_line
from graphconv.frontend import weights
from graphconv.verify.exact import as_float, declared_low_precision, reference_ops, upcast


@dataclasses.dataclass
class Piece:
    name: str  # the block's: prologue | <layer list>[<index>] | <layer path> | epilogue
    nodes: list[onnx.NodeProto]
    reads: list[str]  # values it reads that it does not make (graph inputs, weights, earlier pieces' values)
    makes: set[str]


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph (If/Loop/Scan body) reads from the scopes around it."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    read: set[str] = set()
    for n in graph.node:
        read |= {i for i in n.input if i and i not in defined} | _subgraph_reads(n)
        defined |= set(n.output)
    return read - defined


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    out: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            out |= _outer_names(g)
    return out


def _reads(node: onnx.NodeProto) -> list[str]:
    return [i for i in node.input if i] + sorted(_subgraph_reads(node))


def cut(model: onnx.ModelProto, boundaries: list[tuple[str, list[str]]]) -> list[Piece] | None:
    """The pieces of `model`'s graph in run order: per (block name, ONNX names of the values it passes on), the
    nodes those values need that no earlier piece computed; the last piece computes the graph's outputs (its
    name is the last block's). None when fewer than two pieces have nodes (the model then runs whole)."""
    producer = {o: k for k, n in enumerate(model.graph.node) for o in n.output if o}
    taken: set[int] = set()
    pieces: list[Piece] = []
    targets = [(name, values) for name, values in boundaries[:-1]]
    targets.append((boundaries[-1][0] if boundaries else "epilogue", [o.name for o in model.graph.output]))
    for name, values in targets:
        members: set[int] = set()
        stack = [v for v in values if v in producer]
        while stack:
            k = producer.get(stack.pop())
            if k is None or k in taken or k in members:
                continue
            members.add(k)
            stack.extend(_reads(model.graph.node[k]))
        if not members:
            continue
        taken |= members
        nodes = [model.graph.node[k] for k in sorted(members)]
        makes = {o for n in nodes for o in n.output if o}
        reads = list(dict.fromkeys(r for n in nodes for r in _reads(n) if r not in makes))
        pieces.append(Piece(name, nodes, reads, makes))
    return pieces if len(pieces) >= 2 else None


def whole(model: onnx.ModelProto) -> list[Piece]:
    """The whole graph as one piece (a model run at once)."""
    nodes = list(model.graph.node)
    makes = {o for n in nodes for o in n.output if o}
    reads = list(dict.fromkeys(r for n in nodes for r in _reads(n) if r not in makes))
    return [Piece("model", nodes, reads, makes)]


def _piece_model(model: onnx.ModelProto, piece: Piece, inputs: dict[str, onnx.ValueInfoProto],
                 outputs: list[str]) -> onnx.ModelProto:
    typed = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}
    reads = set(piece.reads)
    inits = [t for t in model.graph.initializer if t.name in reads]
    graph = onnx.helper.make_graph(
        piece.nodes, f"{model.graph.name}_{piece.name}", [inputs[r] for r in piece.reads if r in inputs],
        [typed.get(o) or onnx.helper.make_empty_tensor_value_info(o) for o in outputs], inits)
    out = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    out.functions.extend(model.functions)
    return out


def _value_info(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    """A graph input of the array's dtype and of any shape (the cases differ in shape)."""
    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), None)


def run(model: onnx.ModelProto, pieces: list[Piece], cases, keep: set[str] = frozenset(), progress=None,
        exact: bool = False, rounded: bool = False):
    """onnxruntime's outputs of `model` for every case, piece by piece; also the values pieces pass on and
    those named in `keep` (per case, by name), and a row per piece (name, nodes, weight bytes, seconds).
    `exact`: the model's exact values instead, computed in float64 (graphconv/verify/exact.py); with `rounded`,
    computed in fp32 with each fp16/bf16 result rounded to its dtype (an ideal fp16 device).

    `model` holds its big weights as external references (read in place, never loaded): each piece maps
    only its own and unmaps them before the next."""
    return run_together([(model, pieces, keep, exact, rounded)], cases, progress)[0]


def run_together(runs: list[tuple], cases, progress=None) -> list[tuple]:
    """`run` for several models of the same layers (the model, its ascend-precision variant, its exact
    values), each (model, pieces, keep[, exact, rounded]), their pieces interleaved by name (each run's pieces still in
    its own order): a layer's weights are read from disk once for all of them, the later runs finding them in
    the page cache. One (outputs, kept, rows) per run."""
    runners = [_Runner(run[0], run[1], cases, *run[2:]) for run in runs]
    tracker = progress.track("oracle (layer by layer)", sum(len(r.pieces) for r in runners), "pieces") \
        if progress else None

    def advance(r: _Runner, count: int) -> None:
        for _ in range(count):
            r.step()
            if tracker:
                tracker.update(sum(q.next for q in runners))

    gc.freeze()  # the collection after each piece need not walk the compile's graphs again
    try:
        for piece in runners[0].pieces:
            for r in runners:  # each run up to its piece of that name, if it has one (the first: that piece)
                names = [q.name for q in r.pieces[r.next:]]
                if piece.name in names:
                    advance(r, names.index(piece.name) + 1)
        for r in runners:
            advance(r, len(r.pieces) - r.next)
    finally:
        gc.unfreeze()
    return [r.results() for r in runners]


class _Runner:
    """One model run piece by piece over the cases (`run`): `step` runs the next piece."""

    def __init__(self, model: onnx.ModelProto, pieces: list[Piece], cases, keep: set[str], exact: bool = False,
                 rounded: bool = False):
        self.pieces, self.keep, self.next, self.exact = pieces, keep, 0, exact
        self.bare, self.refs = weights.stripped(model)
        self.rounded = declared_low_precision(self.bare) if exact and rounded else None
        # exact: float64; rounded at every op: float32 between the roundings, as an fp16 device accumulates
        self.compute = onnx.TensorProto.FLOAT if self.rounded else onnx.TensorProto.DOUBLE
        self.declared = {i.name: i for i in self.bare.graph.input}
        self.graph_outputs = [o.name for o in model.graph.output]
        self.envs = [{k: as_float(v, self.compute) if exact else v for k, v in c.inputs.items()} for c in cases]
        self.kept: list[dict[str, np.ndarray]] = [{} for _ in cases]
        self.rows: list[dict] = []

    def step(self) -> None:
        from graphconv.verify import reference

        k, piece, envs = self.next, self.pieces[self.next], self.envs
        t0 = time.perf_counter()
        later = {r for p in self.pieces[k + 1:] for r in p.reads} | set(self.graph_outputs)
        outputs = [o for n in piece.nodes for o in n.output if o and (o in later or o in self.keep)]
        feeds = {r: weights.read(self.refs[r]) for r in piece.reads if r in self.refs}
        if self.exact:
            feeds = {r: as_float(a, self.compute) for r, a in feeds.items()}
        ort_feeds = {r: reference.ort_feed(a) for r, a in feeds.items()}
        inputs = {r: self.declared[r] for r in piece.reads if r in self.declared}
        inputs.update({r: _value_info(r, envs[0][r]) for r in piece.reads if r not in inputs and r in envs[0]})
        sub = _piece_model(self.bare, piece, inputs, outputs)
        if self.exact:
            sub = upcast(sub, self.rounded, self.compute)
        try:
            sess, engine = _session(sub, self.exact)
            for env, saved in zip(envs, self.kept):
                given = {r: env[r] for r in piece.reads if r in env}
                for name, value in zip(outputs, sess.run(outputs, {**given, **ort_feeds})):
                    # a copy: an output onnxruntime hands back can hold on to its session's memory arena,
                    # and with it to everything the piece allocated (an fp16 model's fp32 weight casts)
                    env[name] = saved[name] = np.array(value, copy=True)  # (every output is passed on or kept)
        except Exception as e:  # noqa: BLE001 - onnxruntime's message, in one line
            what = "neither onnxruntime nor onnx.reference could compute the exact values of" if self.exact \
                else "onnxruntime could not run"
            where = "the model" if len(self.pieces) == 1 else \
                f"the model's {piece.name} (the oracle runs it layer by layer)"
            raise UnsupportedError(f"{what} {where}: {first_line(e, 300)}") from None
        mapped = sum(f.nbytes for f in feeds.values())
        made = sum(bool(self.refs[r].parts) for r in feeds)  # (weights.read concatenated their parts)
        del sess, feeds, ort_feeds
        gc.collect()
        for env in envs:  # values no later piece reads
            for name in [n for n in env if n not in later]:
                del env[name]
        self.rows.append({"piece": piece.name, "engine": engine, "nodes": len(piece.nodes), "weight_bytes": mapped,
                          "weights_made_from_parts": made, "seconds": round(time.perf_counter() - t0, 3)})
        self.next += 1

    def results(self) -> tuple:
        outputs = [{o: env[o] for o in self.graph_outputs} for env in self.envs]
        return outputs, self.kept, self.rows


def _session(model: onnx.ModelProto, exact: bool):
    """(something with onnxruntime's `run(outputs, feeds)`, the engine's name) for one piece: onnxruntime's
    session; for an exact piece with a node onnxruntime has no double kernel for, onnx.reference's evaluator."""
    from graphconv.verify import reference

    try:
        return reference.ort_session(model.SerializeToString()), "onnxruntime"
    except Exception:  # only an exact piece has somewhere else to go
        if not exact:
            raise
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=reference_ops()), "onnx.reference"
