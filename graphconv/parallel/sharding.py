"""Tensor parallelism (`compile --tp N`): the Megatron plan of a fused graph, and each rank's graph.

Why here, between the passes and the lowering: the plan is read off the fused graph, where attention is one
`mindspore::FlashAttentionScore` node carrying its head counts and a gated MLP one `Swiglu` on a merged
gate/up weight, so the blocks are found by what they are, not by the exporter's spelling. It is not a pass: a
pass rewrites one graph into one graph, this makes N of them (one per rank) from one plan. It runs after the
precision pass, so the shards are in the compile's dtype, and before the cpu form is made (opmap.fused
.inline_fused), so both targets lower the same rank graph.

The plan (data, written as plan.json): attention column-parallel by heads (q heads split, kv heads split, or
each rank holding the kv heads its q heads read where there are fewer kv heads than ranks), its output
projection row-parallel; an MLP's up (and gate) projections column-parallel, its down projection
row-parallel; an MoE's stacked [E, ...] expert weights likewise, each expert split along its own intermediate
dim (routing replicated). A row-parallel projection's output is a partial sum: `graphconv::AllReduce` (sum
over the ranks) follows it, or follows the ops linear in it after it (an MoE's weighting and sum over the
experts). The LM head (a projection making a graph output) is column-parallel over the vocab and
`graphconv::AllGather` concatenates the ranks' logits; where the vocab does not divide or the head is tied to
the embedding it is replicated with a note. Everything else (embedding, norms, routers, weights in no
recognised block) is replicated, and the plan says so. A block whose shape the plan cannot follow exactly is
an error naming it, never a guess.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from graphconv.dtypes import FLOATS
from graphconv.errors import UnsupportedError
from graphconv.frontend import weights
from graphconv.onnx_domains import GRAPHCONV_DOMAIN_VERSION, canonical_domain, default_opset, is_default_domain
from opmap import graphconv_ops
from opmap.graphconv_ops import DOMAIN

ALL_REDUCE = graphconv_ops.ALL_REDUCE.name
ALL_GATHER = graphconv_ops.ALL_GATHER.name
ATTENTION_OPS = ("FlashAttentionScore", "FusedInferAttentionScore")
# A KV cache held in place (passes/stateful_cache.py): the initializer its update node writes, [MB, kv heads, MS, D].
CACHE_UPDATE = (DOMAIN, graphconv_ops.KV_CACHE_UPDATE.name)
# Ops a q/k/v value passes through between its projection and the attention, head by head.
_HEAD_WISE = {("", "Transpose"), ("", "Cast"), ("", "Identity"), ("mindspore", "RotaryPositionEmbedding")}
# Ops an MLP's hidden value passes through between its up and down projections, feature by feature.
_ELEMENTWISE = {"Cast", "Identity", "Relu", "Sigmoid", "Tanh", "Erf", "Gelu", "Neg", "Exp", "Mul", "Add", "Sub",
                "Div", "Pow", "Sqrt", "Softplus"}
_FUSED_ELEMENTWISE = {"GeluTanh", "Gelu", "FastGelu", "SiLU", "Swiglu"}
# Ops that add or drop a unit axis around an expert's features (batched experts: [T, F, 1] <-> [T, F]).
_UNIT_AXIS = {"Squeeze", "Unsqueeze"}
# Ops linear in a partial sum, one input being the partial: the AllReduce can follow them (fewer values to sum).
_LINEAR = {"Reshape", "Squeeze", "Unsqueeze", "Transpose", "ReduceSum", "Mul"}


class ShardingError(UnsupportedError):
    """The plan cannot cover the graph exactly (one line, naming the node or weight)."""


def all_reduce_function(opset: int) -> onnx.FunctionProto:
    """graphconv::AllReduce's function body at `opset` (opmap/graphconv_ops.py defines it)."""
    return graphconv_ops.ALL_REDUCE.function(opset)


def all_gather_function(opset: int, rank: int, axis: int, sizes: list[int], ndim: int) -> onnx.FunctionProto:
    """graphconv::AllGather's function body at `opset`, rank `rank`'s view (opmap/graphconv_ops.py defines it)."""
    return graphconv_ops.ALL_GATHER.function(opset, rank=rank, axis=axis, sizes=sizes, ndim=ndim)


@dataclasses.dataclass
class WeightSplit:
    """One initializer: split along `axis` (each rank: the concatenation of its [start, stop) ranges), or
    replicated (axis None)."""
    name: str
    role: str
    shape: list[int]
    axis: int | None = None
    slices: list[list[tuple[int, int]]] | None = None

    def shard(self, array: np.ndarray, rank: int) -> np.ndarray:
        if self.axis is None:
            return array
        parts = [np.take(array, np.arange(a, b), axis=self.axis) for a, b in self.slices[rank]]
        return np.ascontiguousarray(np.concatenate(parts, axis=self.axis))

    def as_dict(self) -> dict:
        d = {"role": self.role, "shape": self.shape, "onnx": self.name}
        if self.axis is None:
            return {**d, "split": "replicated"}
        return {**d, "split": "axis", "axis": self.axis, "slices": [[list(r) for r in s] for s in self.slices]}


@dataclasses.dataclass
class Plan:
    tp: int
    weights: dict[str, WeightSplit]
    heads: dict[str, tuple[int, int]]  # attention node -> (q heads, kv heads) per rank
    reshapes: dict[str, tuple[int, list[int]]]  # Reshape node -> (entry of its shape, size per rank) to rewrite
    reduces: list[str]  # the row-parallel nodes whose output is summed over the ranks
    blocks: list[dict]
    notes: list[str]
    gathers: dict[str, tuple[int, list[int]]] = dataclasses.field(default_factory=dict)  # node -> (axis, sizes)
    # KVCacheUpdate node -> (kv heads, kv heads per rank): its write positions cut to the rank's heads
    cache_updates: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def as_json(self, sources: dict[str, str] | None = None) -> dict:
        """plan.json: the weights keyed by the model's own names where known (`sources`: ONNX name -> name)."""
        sources, keys = sources or {}, {}
        for n in self.weights:  # (two initializers of one source name keep their ONNX names)
            keys[n] = sources[n] if n in sources and sources[n] not in keys.values() else n

        def named(value):
            if isinstance(value, dict):
                return {k: named(v) for k, v in value.items()}
            if isinstance(value, list):
                return [named(v) for v in value]
            return keys.get(value, value) if isinstance(value, str) else value

        return {"tp": self.tp, "scheme": "megatron: attention by heads, MLP (and each MoE expert) column/row, "
                                         "AllReduce after each row-parallel projection (or the experts' sum); LM "
                                         "head column-parallel over the vocab with an AllGather of the logits; "
                                         "embedding replicated",
                "blocks": named(self.blocks), "weights": {keys[n]: w.as_dict() for n, w in self.weights.items()},
                "notes": self.notes}


class _Graph:
    """Producers, consumers and constant values of a ModelProto's graph."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.init = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in g.output}

    def const(self, name: str) -> np.ndarray | None:
        if name in self.init:
            return weights.to_array(self.init[name])
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            return numpy_helper.to_array(n.attribute[0].t)
        return None

    def weight(self, node: onnx.NodeProto) -> tuple[str, bool] | None:
        """(initializer, stored [out, in]) of a MatMul/Gemm's weight (read directly or through a Cast)."""
        if node.op_type not in ("MatMul", "Gemm") or not is_default_domain(node.domain) or len(node.input) < 2:
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and attrs.get("transA", 0):
            return None
        name = node.input[1]
        p = self.producer.get(name)
        if p is not None and p.op_type == "Cast":
            name = p.input[0]
        if name not in self.init or len(self.init[name].dims) != 2:
            return None
        return name, bool(attrs.get("transB", 0))

    def projection(self, node: onnx.NodeProto) -> tuple[str, int, int, int] | None:
        """(weight, index of the activation input, the weight's input-feature axis, its output-feature axis) of
        a projection: a 2-D MatMul/Gemm weight, or an MoE's stacked [E, ...] experts gathered per token
        (Gather/GatherND on axis 0) into a batched MatMul, W[e] @ x ([E, out, in]) or x @ W[e] ([E, in, out])."""
        w = self.weight(node)
        if w is not None:
            return w[0], 0, int(w[1]), int(not w[1])
        if node.op_type != "MatMul" or not is_default_domain(node.domain):
            return None
        for k in (0, 1):
            p = self.producer.get(node.input[k])
            if p is None or p.op_type not in ("Gather", "GatherND") or p.input[0] not in self.init:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in p.attribute}
            if attrs.get("axis", 0) or attrs.get("batch_dims", 0) or len(self.init[p.input[0]].dims) != 3:
                continue
            return (p.input[0], 1, 2, 1) if k == 0 else (p.input[0], 0, 1, 2)
        return None

    def length(self, value: str) -> int:
        """The static length of a 1-D value (a piece of a Reshape's target shape)."""
        vi = next((v for v in self.model.graph.value_info if v.name == value), None)
        dims = vi.type.tensor_type.shape.dim if vi is not None else []
        if len(dims) != 1 or not dims[0].HasField("dim_value"):
            _fail(f"the length of {value!r} (a piece of a target shape) is unknown")
        return dims[0].dim_value

    def only_consumer(self, value: str) -> onnx.NodeProto | None:
        users = self.consumers.get(value, [])
        return users[0] if len(users) == 1 and value not in self.outputs else None


def _fail(msg: str):
    raise ShardingError(f"--tp: {msg}")


class _Planner:
    def __init__(self, model: onnx.ModelProto, tp: int):
        self.g, self.tp = _Graph(model), tp
        self.weights: dict[str, WeightSplit] = {}
        self.heads, self.reshapes, self.reduces, self.blocks, self.notes, self.gathers = {}, {}, [], [], [], {}
        self.cache_updates: dict[str, tuple[int, int]] = {}
        self.claimed: set[str] = set()  # nodes inside a sharded block
        self.pending: list = []  # (Reshape of q/k/v features, entry, weight): sized once the weight's slices are

    # --- weights --------------------------------------------------------------------------------------
    def split_weight(self, node: onnx.NodeProto, role: str, column: bool, slices) -> None:
        """A projection's weight: column-parallel splits its output features, row-parallel its input
        features. A column-parallel Gemm's bias follows its columns; a row-parallel one's is added once, after
        the AllReduce (shard)."""
        name, _, inp, out = self.g.projection(node)
        self.extend(name, role, out if column else inp, slices, node)
        if column and node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            self.bias(node.input[2], node, slices)

    def bias(self, name: str, node: onnx.NodeProto, slices) -> None:
        if name not in self.g.init or len(self.g.init[name].dims) != 1:
            _fail(f"the bias of {node.name!r} is not a 1-D weight")
        self.extend(name, "bias of a column-parallel projection", 0, slices, node)

    # --- attention ------------------------------------------------------------------------------------
    def attention(self, fa: onnx.NodeProto) -> None:
        attrs = {a.name: helper.get_attribute_value(a) for a in fa.attribute}
        layout = attrs.get("input_layout", b"BNSD")
        layout = layout.decode() if isinstance(layout, bytes) else layout
        h, kv, n = int(attrs["head_num"]), int(attrs.get("kv_head_num", attrs["head_num"])), self.tp
        if layout != "BNSD":
            _fail(f"attention {fa.name!r} has layout {layout}; only BNSD is planned")
        if h % n:
            _fail(f"{n} ranks do not divide the {h} attention heads of {fa.name!r}")
        if kv % n and n % kv:
            _fail(f"{n} ranks neither divide the {kv} kv heads of {fa.name!r} nor are a multiple of them")
        for k, what in ((3, "mask"), (4, "real_shift")):  # (one for every head: the same on every rank)
            if len(fa.input) > k and fa.input[k] and self.head_dim_of(fa.input[k]) not in (None, 1):
                _fail(f"the {what} of {fa.name!r} differs per head: its split is not planned")
        q_per, kv_per = h // n, max(kv // n, 1)
        q_heads = [list(range(r * q_per, (r + 1) * q_per)) for r in range(n)]
        kv_heads = [list(range(r * kv_per, (r + 1) * kv_per)) if kv >= n else [r * kv // n] for r in range(n)]
        chains = {}
        for k, (which, per_rank, count) in enumerate((("q", q_heads, h), ("k", kv_heads, kv), ("v", kv_heads, kv))):
            chains[which], head_dim = self.trace_projection(fa, fa.input[k], which, per_rank, count)
        for reshape, axis, w in self.pending:
            self.reshapes[reshape.name] = (axis, [sum(b - a for a, b in s) for s in self.weights[w].slices])
        self.heads[fa.name] = (q_per, kv_per)
        self.claimed.add(fa.name)
        out = self.trace_output(fa, q_heads, h, head_dim)
        self.blocks.append({"kind": "attention", "node": fa.name, "heads": h, "kv_heads": kv,
                            "per_rank": {"heads": q_per, "kv_heads": kv_per,
                                         "kv": "split" if kv >= n else "replicated over groups of ranks"},
                            "projections": {**chains, "out": out}})

    def trace_projection(self, fa, value: str, which: str, heads: list[list[int]], count: int) -> tuple[str, int]:
        """Walk from the attention's input back to its projection; every value on the way feeds this chain
        only. The heads sit on axis 1 (BNSD) at the attention; a Reshape splitting [..., F] into [..., heads,
        D] puts them on the features, head by head. Returns the projection's weight and the head size."""
        biases, split, head_dim, features = [], None, None, []
        heads_axis = 1  # BNSD at the attention; 2 (BSND) once the walk has passed the Transpose
        node = self.g.producer.get(value)
        while True:
            if node is None:
                _fail(f"the {which} input of {fa.name!r} does not come from a projection")
            if self.g.only_consumer(value) is None:
                _fail(f"{value!r} (the {which} of {fa.name!r}) is used outside the attention block")
            key = (canonical_domain(node.domain), node.op_type)
            if self.g.weight(node) is not None:
                break
            if key in _HEAD_WISE:
                if node.op_type == "Transpose":
                    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
                    if perm != [[0, 2, 1, 3]]:
                        _fail(f"{node.name!r}: a transpose other than BSND <-> BNSD before {fa.name!r}")
                    heads_axis = 3 - heads_axis
            elif node.op_type == "Unsqueeze" and self.after_heads(node, heads_axis, count):
                pass
            elif key == ("mindspore", "RmsNorm") and self.per_head_norm(node):
                pass
            elif key == CACHE_UPDATE:  # the cache held in place: each rank's holds its kv heads (dim 1)
                self.cache(node, fa, heads, count)
                value = node.input[1]
                node = self.g.producer.get(value)
                continue
            elif node.op_type == "Reshape" and heads_axis == 1:  # heads kept on axis 1, the dims after regrouped
                if not self.after_heads(node, heads_axis, count):
                    _fail(f"{node.name!r}: a reshape in BNSD layout that moves the heads of {fa.name!r}")
                head_dim = self.reshape_heads(node, fa, count, [len(h) for h in heads], head_dim, features, 1)
            elif node.op_type == "Reshape":
                head_dim = self.reshape_heads(node, fa, count, [len(h) for h in heads], head_dim, features)
            elif node.op_type == "Split" and split is None:
                split = (node, list(node.output).index(value))
            elif node.op_type == "Add" and sum(i in self.g.init for i in node.input) == 1:
                bias = next(i for i in node.input if i in self.g.init)
                biases.append((bias, node))
                self.claimed.add(node.name)
                value = next(i for i in node.input if i != bias)
                node = self.g.producer.get(value)
                continue
            else:
                _fail(f"{node.name!r} ({node.op_type}) between the {which} projection and {fa.name!r} is not "
                      "planned")
            self.claimed.add(node.name)
            value = node.input[0]
            node = self.g.producer.get(value)
        if head_dim is None:
            _fail(f"the head size of the {which} of {fa.name!r} is unknown (no Reshape with a constant head dim)")
        offset = 0
        if split is not None:  # fused q/k/v: this chain's columns are one part of the projection's
            sizes = self.split_sizes(split[0])
            offset = sum(sizes[:split[1]])
            if sizes[split[1]] != count * head_dim:
                _fail(f"{split[0].name!r}: part {split[1]} is not {count} heads of {head_dim}")
        slices = [[(offset + hs[0] * head_dim, offset + (hs[-1] + 1) * head_dim)] for hs in heads]
        self.claimed.add(node.name)
        w, transposed = self.g.weight(node)
        role = "attention q/k/v, one weight" if split is not None else f"attention {which}"
        self.extend(w, f"{role} (column-parallel by heads)", 0 if transposed else 1, slices, node)
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            biases.append((node.input[2], node))
        for bias, at in biases:
            if bias not in self.g.init or len(self.g.init[bias].dims) != 1:
                _fail(f"the bias of {at.name!r} is not a 1-D weight")
            self.extend(bias, "bias of a column-parallel projection", 0, slices, at)
        for reshape, axis in features:  # [..., F]: F is what the rank holds of the projection's output
            self.pending.append((reshape, axis, w))
        return w, head_dim

    def cache(self, node, fa, heads: list[list[int]], count: int) -> None:
        """A KVCacheUpdate on the k or v of `fa`: its cache initializer [max batch, kv heads, max seq, head dim]
        split along the kv heads as the projection's columns are, and its write positions ([B, kv heads, q, 3],
        the heads numbered 0..) cut to the rank's first len(heads) (shard)."""
        cache = node.input[0]
        dims = list(self.g.init[cache].dims) if cache in self.g.init else []
        if len(dims) != 4 or dims[1] != count:
            _fail(f"{node.name!r}: its cache {cache!r} {dims} is not [batch, the {count} kv heads of {fa.name!r}, "
                  "seq, head dim]")
        self.extend(cache, "KV cache held in place (split by kv heads)", 1, [[(hs[0], hs[-1] + 1)] for hs in heads],
                    node)
        self.cache_updates[node.name] = (count, len(heads[0]))
        self.claimed.add(node.name)

    def extend(self, name: str, role: str, axis: int, slices, node) -> None:
        """Add `slices` to weight `name`'s (a fused q/k/v weight collects the three chains' slices)."""
        users = [u.name for u in self.g.consumers.get(name, [])]
        if len(users) != 1:
            _fail(f"weight {name!r} is read by {len(users)} nodes ({', '.join(users[:3])}): a shard of it cannot "
                  "serve all")
        split = self.weights.setdefault(name, WeightSplit(name, role, list(self.g.init[name].dims), axis,
                                                          [[] for _ in range(self.tp)]))
        for r in range(self.tp):
            split.slices[r] = sorted(set(split.slices[r]) | set(slices[r]))

    def after_heads(self, node, heads_axis: int, count: int) -> bool:
        """In BNSD layout (`heads_axis` 1), an Unsqueeze or Reshape that leaves the heads where they are: its
        input's dim 1 is the `count` heads, and an Unsqueeze adds axes after them only (as a repeat_kv by 1
        leaves: Unsqueeze(2) then Reshape back to [B, heads, S, D]), so each rank's heads pass through it."""
        if heads_axis != 1:
            return False
        vi = next((v for v in self.g.model.graph.value_info if v.name == node.input[0]), None)
        dims = vi.type.tensor_type.shape.dim if vi is not None and vi.type.tensor_type.HasField("shape") else []
        if len(dims) < 4 or dims[1].dim_value != count:
            return False
        if node.op_type != "Unsqueeze":
            return True
        axes = self.g.const(node.input[1]) if len(node.input) > 1 else \
            next((np.array(a.ints) for a in node.attribute if a.name == "axes"), None)
        return axes is not None and bool(np.all((axes >= 2) | (axes < 0) & (axes + len(dims) + len(axes) >= 2)))

    def per_head_norm(self, node) -> bool:
        """A norm over the last axis of a 4-d value, one weight for every head (Qwen3's q_norm / k_norm): head
        by head, so the same on every rank."""
        gamma = self.g.const(node.input[1]) if len(node.input) > 1 else None
        return self.rank_of(node.input[0]) == 4 and gamma is not None and gamma.ndim == 1 and \
            gamma.shape[0] == self.feature_size(node.input[0])

    def split_sizes(self, node) -> list[int]:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        sizes = self.g.const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if sizes is None:
            feat = self.feature_size(node.input[0])
            if feat is None or feat % len(node.output):
                _fail(f"{node.name!r}: the sizes of the split are unknown")
            sizes = [feat // len(node.output)] * len(node.output)
        if axis != -1 and axis != self.rank_of(node.input[0]) - 1:
            _fail(f"{node.name!r} splits axis {axis}, not the features")
        return [int(s) for s in sizes]

    def head_dim_of(self, value: str) -> int | None:
        """Dim 1 of a 4-d value (a mask's heads): None below rank 4; -1 where it is not known."""
        const = self.g.const(value)
        if const is not None:
            return const.shape[1] if const.ndim == 4 else None
        vi = next((v for v in self.g.model.graph.value_info if v.name == value), None)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            return -1
        dims = vi.type.tensor_type.shape.dim
        if len(dims) < 4:
            return None
        return dims[1].dim_value if dims[1].HasField("dim_value") else -1

    def rank_of(self, value: str) -> int:
        g = self.g.model.graph
        vi = next((v for v in [*g.value_info, *g.input, *g.output] if v.name == value), None)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            _fail(f"the rank of {value!r} is unknown")
        return len(vi.type.tensor_type.shape.dim)

    def feature_size(self, value: str) -> int | None:
        vi = next((v for v in self.g.model.graph.value_info if v.name == value), None)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            return None
        d = vi.type.tensor_type.shape.dim[-1]
        return d.dim_value if d.HasField("dim_value") else None

    def shape_entries(self, reshape) -> list[tuple[str, int, np.ndarray | None]]:
        """The target shape of a Reshape entry by entry: (tensor, index in it, its constant value or None)."""
        shape = reshape.input[1]
        value = self.g.const(shape)
        if value is not None:
            return [(shape, i, value) for i in range(len(value))]
        concat = self.g.producer.get(shape)
        if concat is None or concat.op_type != "Concat":
            _fail(f"{reshape.name!r}: its target shape is neither a constant nor a Concat of pieces")
        entries = []
        for piece in concat.input:
            value = self.g.const(piece)
            length = len(value) if value is not None else self.g.length(piece)
            entries += [(piece, i, value) for i in range(length)]
        return entries

    def reshape_heads(self, node, fa, count: int, per_rank: list[int], head_dim: int | None, features,
                      heads_axis: int = 2) -> int:
        """A Reshape on the way to the attention: [..., heads, D] (BSND; or [B, heads, S, D] in BNSD,
        `heads_axis` 1: the heads entry rewritten per rank unless -1) or [..., F] (F = heads * D, or q, k and v
        together: rewritten once the rank's columns are known). Returns D."""
        entries = self.shape_entries(node)
        consts = [None if v is None else int(v[i]) for _, i, v in entries]
        if len(entries) == 4 or heads_axis != 2:
            if len(entries) != 4:
                _fail(f"{node.name!r}: a reshape to rank {len(entries)} in BNSD layout before {fa.name!r}")
            d, hd = consts[3], consts[heads_axis]
            if d is None or d <= 0:
                _fail(f"{node.name!r}: the head size (last entry of its target shape) is not a constant")
            if hd not in (-1, count):
                _fail(f"{node.name!r}: its heads entry {hd} is neither -1 nor the {count} heads of {fa.name!r}")
            if hd == count:
                self.reshapes[node.name] = (heads_axis, per_rank)
            return d
        if head_dim is None:
            _fail(f"{node.name!r}: a reshape of the features before the heads are known")
        if consts[-1] is None:
            _fail(f"{node.name!r}: its last entry (the features) is not a constant")
        if consts[-1] != -1:
            features.append((node, len(entries) - 1))
        return head_dim

    def trace_output(self, fa, heads: list[list[int]], h: int, head_dim: int) -> str:
        """Walk from the attention's output to its row-parallel projection: Transpose to BSND, Reshape merging
        the heads, then the projection."""
        value = fa.output[0]
        for _ in range(6):
            node = self.g.only_consumer(value)
            if node is None:
                _fail(f"the output of {fa.name!r} is used outside the attention block")
            self.claimed.add(node.name)
            if self.g.weight(node) is not None and node.input[0] == value:
                w, transposed = self.g.weight(node)
                rows = self.g.init[w].dims[1 if transposed else 0]
                if rows % h:
                    _fail(f"{node.name!r}: {rows} input features are not the {h} heads of {fa.name!r}")
                d = rows // h
                slices = [[(hs[0] * d, (hs[-1] + 1) * d)] for hs in heads]
                self.split_weight(node, "attention output (row-parallel)", False, slices)
                self.reduces.append(node.name)
                return w
            if node.op_type == "Transpose":
                perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
                if perm != [[0, 2, 1, 3]]:
                    _fail(f"{node.name!r}: a transpose other than BNSD -> BSND after {fa.name!r}")
            elif node.op_type == "Reshape":
                entries = self.shape_entries(node)
                last = entries[-1][2]
                last = None if last is None else int(last[entries[-1][1]])
                if last is None:
                    _fail(f"{node.name!r}: its last entry (the merged heads) is not a constant")
                if last not in (-1, h * head_dim):
                    _fail(f"{node.name!r}: its last entry {last} is not the {h} heads of {head_dim} of {fa.name!r}")
                if last != -1:
                    self.reshapes[node.name] = (len(entries) - 1, [len(hs) * head_dim for hs in heads])
            elif node.op_type not in ("Cast", "Identity"):
                _fail(f"{node.name!r} ({node.op_type}) after {fa.name!r} is not planned")
            value = node.output[0]
        _fail(f"no output projection found after {fa.name!r}")

    # --- MLP ------------------------------------------------------------------------------------------
    def mlp(self, down: onnx.NodeProto) -> bool:
        """`down`'s input comes from column projections through elementwise ops only (and a Swiglu): an MLP, or
        an MoE's experts where the projections are the stacked [E, ...] expert weights (each expert split the
        same way, so the batched matmuls split with them). False where it does not (the weight then stays
        replicated)."""
        region, ups, swiglu_inputs, biases = set(), [], {}, []
        todo = [down.input[self.g.projection(down)[1]]]
        while todo:
            value = todo.pop()
            node = self.g.producer.get(value)
            if node is None or node.name in region or node.name in self.claimed:
                if node is None or node.name in self.claimed:
                    return False
                continue
            if self.g.projection(node) is not None:
                ups.append(node)
                region.add(node.name)
                continue
            default = is_default_domain(node.domain)
            elementwise = node.op_type in _ELEMENTWISE | _UNIT_AXIS and default or \
                node.op_type in _FUSED_ELEMENTWISE and node.domain == "mindspore"
            if not elementwise:
                return False
            region.add(node.name)
            for i in node.input[:1] if node.op_type in _UNIT_AXIS else node.input:
                c = self.g.const(i)
                if c is not None and c.size == 1:
                    continue
                if c is not None and node.op_type == "Add" and c.ndim == 1 and i in self.g.init:
                    biases.append((i, node))
                    continue
                if c is not None:
                    return False
                if node.op_type == "Swiglu":
                    swiglu_inputs[i] = node
                todo.append(i)
        if not ups:
            return False
        by_name = {n.name: n for n in self.g.model.graph.node}
        for name in region:  # every value made in the region feeds the region or the down projection only
            for o in by_name[name].output:
                if o in self.g.outputs or any(u.name not in region and u is not down
                                              for u in self.g.consumers.get(o, [])):
                    return False
        w, _, inp, _ = self.g.projection(down)
        dims = self.g.init[w].dims
        inner, experts = dims[inp], (dims[0] if len(dims) == 3 else None)
        n = self.tp
        if inner % n:
            _fail(f"{n} ranks do not divide the {inner} hidden features of the MLP ending at {down.name!r}")
        part = inner // n
        what = "MoE experts" if experts else "MLP"
        for up in ups:
            self.claimed.add(up.name)
            uw, _, _, out = self.g.projection(up)
            cols = self.g.init[uw].dims[out]
            halves = [sw for i, sw in swiglu_inputs.items() if self.reaches(up.output[0], i)]
            if cols != (2 * inner if halves else inner):
                _fail(f"{up.name!r}: {cols} output features do not match the {inner} of {down.name!r}")
            if any(self.feature_size(sw.input[0]) not in (None, cols) for sw in halves):
                _fail(f"{halves[0].name!r} does not halve the {cols} features of {up.name!r} on its last axis")
            slices = [[(r * part, (r + 1) * part)] + ([(inner + r * part, inner + (r + 1) * part)] if halves else [])
                      for r in range(n)]
            self.split_weight(up, f"{what} gate/up (column-parallel)" if halves else f"{what} up (column-parallel)",
                              True, slices)
            for bias, node in biases:
                if up.output[0] in node.input:
                    self.bias(bias, node, slices)
        if any(b not in self.weights for b, _ in biases):
            _fail(f"a bias in the MLP ending at {down.name!r} does not follow its projection")
        self.split_weight(down, f"{what} down (row-parallel)", False, [[(r * part, (r + 1) * part)] for r in range(n)])
        self.reduces.append(self.sink(down))
        self.claimed |= region | {down.name}
        block = {"kind": "moe_experts" if experts else "mlp", "down": down.name, "hidden": inner, "per_rank": part,
                 "up": [self.g.projection(u)[0] for u in ups], "down_weight": w, "all_reduce_after": self.reduces[-1]}
        self.blocks.append({**block, "experts": experts} if experts else block)
        return True

    def reaches(self, value: str, target: str) -> bool:
        """`target` is `value` or made from it by unit-axis ops, Casts and a bias Add (a Swiglu's input)."""
        while target != value:
            node = self.g.producer.get(target)
            if node is None or node.op_type not in _UNIT_AXIS | {"Cast", "Identity", "Add"}:
                return False
            target = next((i for i in node.input if i not in self.g.init), node.input[0])
        return True

    def sink(self, node: onnx.NodeProto) -> str:
        """The node after which a row-parallel projection's partial sum is reduced: the projection, or the last
        of the ops linear in it that follow (an MoE's routing-weight Mul and sum over the experts: one AllReduce
        of [tokens, hidden] rather than [tokens x k, hidden]). Not past a Gemm's bias (added once, after)."""
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            return node.name
        value = node.output[0]
        while True:
            user = self.g.only_consumer(value)
            if user is None or user.op_type not in _LINEAR or not is_default_domain(user.domain) or \
                    (user.input[0] != value if user.op_type != "Mul" else list(user.input).count(value) != 1):
                return node.name
            node, value = user, user.output[0]

    def lm_head(self, node: onnx.NodeProto) -> None:
        """A projection whose output is a graph output: column-parallel over its output features (the vocab),
        the ranks' logits gathered along the last axis. Replicated, with a note, where the vocab does not divide
        or the weight is shared (tied to the embedding, which stays replicated)."""
        w, _, _, out = self.g.projection(node)
        vocab, n = self.g.init[w].dims[out], self.tp
        if vocab % n:
            self.notes.append(f"{w}: LM head replicated, {n} ranks do not divide its vocab of {vocab}")
            return
        vi = next((v for v in self.g.model.graph.output if v.name == node.output[0]), None)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            self.notes.append(f"{w}: LM head replicated, the rank of its output is unknown")
            return
        if len(self.g.consumers.get(w, [])) != 1:
            self.notes.append(f"{w}: LM head replicated, its weight is shared (tied to the embedding)")
            return
        part = vocab // n
        self.split_weight(node, "LM head (column-parallel over the vocab)", True,
                          [[(r * part, (r + 1) * part)] for r in range(n)])
        self.claimed.add(node.name)
        self.gathers[node.name] = (self.rank_of(node.output[0]) - 1, [part] * n)
        self.blocks.append({"kind": "lm_head", "node": node.name, "weight": w, "vocab": vocab, "per_rank": part,
                            "all_gather_axis": -1})

    def run(self) -> Plan:
        nodes = list(self.g.model.graph.node)
        others = [n for n in nodes if n.domain == "mindspore" and "Attention" in n.op_type
                  and n.op_type not in ATTENTION_OPS]
        if others:
            _fail(f"attention {others[0].name!r} ({others[0].op_type}) is not planned yet")
        for node in nodes:
            if node.domain == "mindspore" and node.op_type in ATTENTION_OPS:
                self.attention(node)
        for node in nodes:
            if node.name not in self.claimed and self.g.projection(node) is not None:
                self.mlp(node)
        if not self.blocks:
            _fail("no attention or MLP block found to shard (no recognised layers)")
        for node in nodes:
            if node.name not in self.claimed and self.g.weight(node) is not None and node.output[0] in self.g.outputs:
                self.lm_head(node)
        for t in self.g.model.graph.initializer:
            if t.name not in self.weights and t.data_type in FLOATS and int(np.prod(t.dims)) > 1:
                self.weights[t.name] = WeightSplit(t.name, self.replicated_role(t.name), list(t.dims))
        return Plan(self.tp, self.weights, self.heads, self.reshapes, self.reduces, self.blocks, self.notes,
                    self.gathers, self.cache_updates)

    def replicated_role(self, name: str) -> str:
        users = self.g.consumers.get(name, [])
        near = [o for u in users for v in u.output for c in [u, *self.g.consumers.get(v, [])] for o in c.output]
        head = any(o in self.g.outputs for o in near)
        if any(u.op_type == "Gather" for u in users):
            if head:
                self.notes.append(f"{name}: embedding and LM head tied, replicated (the embedding is)")
                return "embedding and tied LM head (replicated)"
            return "embedding (replicated)"
        if head:
            return "LM head (replicated)"
        if any(self.g.weight(u) is not None for u in users):
            routed = {c.op_type for u in users for c in self.g.consumers.get(u.output[0], [])}
            if routed & {"MoeGatingTopKSoftmax", "Softmax", "TopK", "Sigmoid"}:
                return "MoE router (replicated)"
            self.notes.append(f"{name}: a projection in no recognised block, replicated")
            return "projection in no recognised block (replicated)"
        return "replicated (norm, bias or constant)"


def plan(model: onnx.ModelProto, tp: int) -> Plan:
    """The Megatron plan of a fused graph over `tp` ranks; a ShardingError where it cannot cover it exactly."""
    if tp < 2:
        _fail(f"--tp {tp}: at least 2 ranks")
    return _Planner(model, tp).run()


def shard(model: onnx.ModelProto, p: Plan, rank: int, spill: weights.SpillFile | None = None) -> onnx.ModelProto:
    """Rank `rank`'s graph: its shards of the split weights, its head counts, its Reshape sizes, an AllReduce
    after every row-parallel projection and an AllGather after the LM head. Shape information is inferred
    again. With `spill` (a model whose weights are in files), the shard of a weight in a file is appended to
    it and the rank graph refers to it there, as to the weights a pass made: the rank graphs hold no weight
    bytes (the N ranks' shards are the model's size; a rank's past 2 GB would not fit a protobuf), and each
    rank's MindIR is written from the files, streamed (graphconv/compiler/export_task.py)."""
    return _rank_graph(model, p, rank, _shards(model, p, [rank], spill)[0])


def shard_all(model: onnx.ModelProto, p: Plan, spill: weights.SpillFile | None = None) -> list[onnx.ModelProto]:
    """Every rank's graph (`shard`), each split weight read once for all the ranks: a column split touches
    every page of its weight, so rank by rank the model would be read N times."""
    return [_rank_graph(model, p, r, made) for r, made in enumerate(_shards(model, p, range(p.tp), spill))]


def _shards(model: onnx.ModelProto, p: Plan, ranks, spill) -> list[dict[str, onnx.TensorProto]]:
    """For each of `ranks`, its shard of every split weight (in `spill` where the weight is in a file); one
    weight in memory at a time."""
    out: list[dict[str, onnx.TensorProto]] = [{} for _ in ranks]
    for t in model.graph.initializer:
        split = p.weights.get(t.name)
        if split is None or split.axis is None:
            continue
        in_file = spill is not None and uses_external_data(t)
        if in_file and weights.unwritten_zeros(t):  # a KV cache's zeros: its shards, zeros unwritten
            for made, rank in zip(out, ranks):
                dims = list(t.dims)
                dims[split.axis] = sum(b - a for a, b in split.slices[rank])
                made[t.name] = spill.zeros(t.name, t.data_type, dims)
            continue
        whole = np.array(weights.to_array(t))  # (read once)
        for made, rank in zip(out, ranks):
            part = split.shard(whole, rank)
            made[t.name] = spill.tensor_proto(t.name, part) if in_file else numpy_helper.from_array(part, t.name)
        del whole
    return out


def _rank_graph(model: onnx.ModelProto, p: Plan, rank: int, shards: dict[str, onnx.TensorProto]) -> onnx.ModelProto:
    """`model` rewritten for `rank` (shard), its split weights replaced by `shards`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for t in g.initializer:
        if t.name in shards:
            t.CopyFrom(shards[t.name])
    graph = _Graph(out)
    new_nodes = []
    for node in g.node:
        if node.name in p.heads:
            q, kv = p.heads[node.name]
            for a in node.attribute:
                if a.name == "head_num":
                    a.i = q
                elif a.name == "kv_head_num":
                    a.i = kv
        if node.name in p.cache_updates and p.cache_updates[node.name][1] < p.cache_updates[node.name][0]:
            new_nodes += _first_heads(out, node, p.cache_updates[node.name][1])
        if node.name in p.reshapes:
            axis, sizes = p.reshapes[node.name]
            new_nodes += _rewrite_shape(graph, node, axis, sizes[rank])
        if node.name in p.gathers:
            axis, sizes = p.gathers[node.name]
            partial = f"{node.output[0]}_tp_part"
            new_nodes += [node, helper.make_node(ALL_GATHER, [partial], [node.output[0]], axis=axis, domain=DOMAIN,
                                                 name=f"{node.name}_tp_all_gather")]
            node.output[0] = partial
            continue
        if node.name in p.reduces:
            partial = f"{node.output[0]}_tp_partial"
            total = node.output[0]
            bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else ""
            node.output[0] = partial
            new_nodes.append(node)
            if bias:  # added once, after the sum
                del node.input[2]
                new_nodes.append(helper.make_node(ALL_REDUCE, [partial], [f"{total}_tp_sum"],
                                                  name=f"{node.name}_tp_all_reduce", domain=DOMAIN))
                new_nodes.append(helper.make_node("Add", [f"{total}_tp_sum", bias], [total],
                                                  name=f"{node.name}_tp_bias"))
            else:
                new_nodes.append(helper.make_node(ALL_REDUCE, [partial], [total], name=f"{node.name}_tp_all_reduce",
                                                  domain=DOMAIN))
            continue
        new_nodes.append(node)
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    opset = default_opset(out)
    if not any(f.domain == DOMAIN and f.name == ALL_REDUCE for f in out.functions):
        out.functions.append(all_reduce_function(opset))
    for axis, sizes in list(p.gathers.values())[:1]:  # (one function per rank graph: the gathers share sizes)
        out.functions.append(all_gather_function(opset, rank, axis, sizes, axis + 1))  # (axis: the last, vocab)
    if not any(i.domain == DOMAIN for i in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, GRAPHCONV_DOMAIN_VERSION))
    return onnx.shape_inference.infer_shapes(out, data_prop=True)


def _first_heads(model: onnx.ModelProto, update: onnx.NodeProto, heads: int) -> list[onnx.NodeProto]:
    """A KVCacheUpdate's write positions [B, N, q, 3] cut to their first `heads` heads (numbered 0..heads-1: the
    rank's own cache's); returns the Slice to insert before it."""
    name = f"{update.name}_tp_heads"
    model.graph.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), f"{name}_{k}")
                                   for k, v in (("start", 0), ("end", heads), ("axis", 1)))
    cut = helper.make_node("Slice", [update.input[2], f"{name}_start", f"{name}_end", f"{name}_axis"], [name],
                           name=name)
    update.input[2] = name
    return [cut]


def _rewrite_shape(graph: _Graph, reshape: onnx.NodeProto, axis: int, size: int) -> list[onnx.NodeProto]:
    """Point `reshape` at a copy of its target shape with entry `axis` set to `size` (the original may be
    shared with reshapes that keep it); returns the nodes to insert before it."""
    shape = reshape.input[1]
    value = graph.const(shape)
    name = f"{reshape.name}_tp_shape"
    if value is not None:
        value = value.copy()
        value[axis] = size
        graph.model.graph.initializer.append(numpy_helper.from_array(value, name))
        reshape.input[1] = name
        return []
    concat = graph.producer[shape]
    pieces, k = list(concat.input), 0
    for j, piece in enumerate(pieces):
        v = graph.const(piece)
        length = len(v) if v is not None else graph.length(piece)
        if k <= axis < k + length:
            v = v.copy()
            v[axis - k] = size
            graph.model.graph.initializer.append(numpy_helper.from_array(v, f"{name}_piece"))
            pieces[j] = f"{name}_piece"
            break
        k += length
    made = copy.deepcopy(concat)
    made.name, made.output[0] = f"{name}_concat", name
    del made.input[:]
    made.input.extend(pieces)
    reshape.input[1] = name
    return [made]
