"""Past/present -> a KV cache held in place: the stateful-cache transform of a generation graph (issue 32 item 2).

A with-past graph, as every exporter writes it, takes the cache as inputs (`past_key_values.*`, [batch, kv
heads, past, head dim]) and returns it grown (`present.*`): a Concat of the past and the new keys/values along
the sequence axis. The caller feeds each step's presents back, so every token moves the whole cache in and out
of the graph. This transform keeps the graph's arithmetic and moves the cache inside:

- each past input becomes an initializer `cache.<past name>` of fixed capacity [max_batch, kv heads, max_seq,
  head dim] (zeros: in a compile, a hole of a file in its private directory; BNSD, the layout of the past it
  replaces and of FusedInferAttentionScore's keys), which the lowering turns into a MindSpore Parameter;
- each Concat(past, new) becomes `graphconv::KVCacheUpdate(cache, new, indices, total_length)`: write the new
  keys/values at positions past_length .. past_length + q of every row and head, in place, and read back the
  cache's first past_length + q positions: exactly what the Concat gave (opmap/kv_cache.py lowers it with
  `ops.scatter_nd_update` on the Parameter). The write positions are computed once per graph, at its top;
- past_length is computed in the graph as the attention mask's length minus the query's, so the caller passes
  only ids, the mask and positions; each `Shape(past)` the exporter wrote (the batch, the past length) reads the
  same numbers from there;
- the presents leave the graph's outputs.

A prompt is a call at past length 0, then one call per token. Nothing needs resetting between requests: a call
writes positions [past, past + q) before it reads [0, past + q), so a position is never read before the current
request wrote it.

The node's ONNX function body is the same write and read on its `cache` input. onnxruntime runs it with the
initializer's zeros as the cache, which is the stateful graph's value at past length 0 only (a prompt): the
compile verifies the prompt calls so, and the cached steps by generating against the ONNX graphs
(graphconv/generation/build.py). Applied by the compile's load stage (graphconv.pipeline.Compiler.load, when
CompileOptions.cache_capacity is set), not by the PassManager (it changes the graph's inputs and outputs,
which the pipeline's oracle reads).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphconv.frontend.load import value_dims
from graphconv.onnx_domains import GRAPHCONV_DOMAIN_VERSION as DOMAIN_VERSION
from graphconv.onnx_domains import default_opset
from opmap.graphconv_ops import DOMAIN, KV_CACHE_UPDATE

OP = KV_CACHE_UPDATE.name
CACHE_PREFIX = "cache."


class NotStateful(ValueError):
    """The graph's cache is not the past -> Concat -> present pattern this transform rewrites (the reason)."""


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    max_batch: int
    max_seq: int
    # past input name -> (cache initializer name, kv heads, head dim, the present output it replaced or None)
    caches: dict[str, tuple[str, int, int, str | None]]
    nbytes: int  # the caches' zeros


def _write_positions(p: str, heads: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """Nodes computing, once per graph, where a step writes: indices [B, N, q, 3] = (b, n, past + j), from the
    top's `{p}_batch`, `{p}_q`, `{p}_past_length`, `{p}_total` ([1] each)."""
    k = f"{p}_n{heads}"
    inits = [numpy_helper.from_array(np.array(v, np.int64), f"{k}_{name}") for name, v in
             (("zero", 0), ("one", 1), ("axis0", [0]), ("last", [-1]), ("heads", [heads]), ("rows_shape", [-1, 1, 1]),
              ("heads_shape", [1, -1, 1]), ("cols_shape", [1, 1, -1]), ("n", heads))]
    nodes = [
        helper.make_node("Concat", [f"{p}_batch", f"{k}_heads", f"{p}_q"], [f"{k}_bnq"], axis=0),
        helper.make_node("Squeeze", [f"{p}_batch", f"{k}_axis0"], [f"{k}_b"]),
        helper.make_node("Squeeze", [f"{p}_past_length", f"{k}_axis0"], [f"{k}_past"]),
        helper.make_node("Squeeze", [f"{p}_total", f"{k}_axis0"], [f"{k}_end"]),
        helper.make_node("Range", [f"{k}_zero", f"{k}_b", f"{k}_one"], [f"{k}_rows"]),
        helper.make_node("Range", [f"{k}_zero", f"{k}_n", f"{k}_one"], [f"{k}_heads_range"]),
        helper.make_node("Range", [f"{k}_past", f"{k}_end", f"{k}_one"], [f"{k}_cols"]),
    ]
    parts = []
    for axis in ("rows", "heads_range", "cols"):
        shape = {"rows": "rows_shape", "heads_range": "heads_shape", "cols": "cols_shape"}[axis]
        nodes += [helper.make_node("Reshape", [f"{k}_{axis}", f"{k}_{shape}"], [f"{k}_{axis}3"]),
                  helper.make_node("Expand", [f"{k}_{axis}3", f"{k}_bnq"], [f"{k}_{axis}_bnq"]),
                  helper.make_node("Unsqueeze", [f"{k}_{axis}_bnq", f"{k}_last"], [f"{k}_{axis}4"])]
        parts.append(f"{k}_{axis}4")
    nodes.append(helper.make_node("Concat", parts, [f"{k}_indices"], axis=-1))
    return nodes, inits, f"{k}_indices"


def cache_names(model: onnx.ModelProto) -> list[str]:
    """The caches held in place in `model`: the initializers KVCacheUpdate nodes write."""
    inits = {t.name for t in model.graph.initializer}
    return [n.input[0] for n in model.graph.node if (n.domain, n.op_type) == (DOMAIN, OP) and n.input[0] in inits]


def past_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph's cache inputs, by the pattern every exporter writes (whatever it names them:
    past_key_values.*, transformers' exporter's input.cache.layers.*): a rank-4 input that is the first of a
    Concat's two inputs along axis 2."""
    graph = model.graph
    rank4 = {vi.name for vi in graph.input if len(vi.type.tensor_type.shape.dim) == 4}
    found = []
    for node in graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        if node.op_type == "Concat" and len(node.input) == 2 and axis in (2, -2) and node.input[0] in rank4 \
                and node.input[0] not in found:
            found.append(node.input[0])
    order = [vi.name for vi in graph.input]
    return sorted(found, key=order.index)


def past_present_pairs(model: onnx.ModelProto) -> dict[str, str]:
    """{cache input: the graph output its Concat gives} (past_inputs whose grown cache the graph returns), in
    input order: how a caller feeds one step's presents to the next step, whatever the exporter named them."""
    outputs = {vo.name for vo in model.graph.output}
    concat = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "Concat" and n.input}
    return {name: concat[name] for name in past_inputs(model) if concat.get(name) in outputs}


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    uses: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            uses.setdefault(name, []).append(node)
    return uses


def make_stateful(model: onnx.ModelProto, max_batch: int, max_seq: int, past_names: list[str] | None = None,
                  ids: str = "input_ids", mask: str = "attention_mask",
                  presents: dict[str, str] | None = None, zeros=None) -> tuple[onnx.ModelProto, CacheLayout]:
    """The stateful graph of a with-past `model` (changed in place and returned) and its cache layout.
    `past_names`: the cache inputs (default: past_inputs(model)). `presents`: {past: the output returning it
    grown} where that output is not the Concat's own, but equals it on the calls the generation makes
    (GroupQueryAttention's present, decomposed by graphconv.frontend.contrib.gqa: the Concat gathered into the
    kernel's layout, the same rows when no row is padded); it leaves the outputs too. `zeros(name, elem type, dims)`
    makes each cache's initializer (a compile's: graphconv.frontend.weights.SpillFile.zeros, external zeros that
    take neither memory nor disk, so any capacity fits); default: zeros in the proto. NotStateful says why not."""
    graph = model.graph
    inputs = {vi.name: vi for vi in graph.input}
    typed = {vi.name: vi for vi in [*graph.value_info, *graph.output]}
    presents = presents or {}
    if ids not in inputs or mask not in inputs:
        raise NotStateful(f"the graph takes no {ids if ids not in inputs else mask!r}: the past length is read as the "
                          "attention mask's length minus the query's")
    past_names = past_names if past_names is not None else past_inputs(model)
    if not past_names:
        raise NotStateful("no graph input is a cache (a rank-4 input that a Concat along axis 2 extends)")
    uses = _consumers(graph)
    outputs = {vo.name for vo in graph.output}
    caches: dict[str, tuple[str, int, int, str | None]] = {}
    concat_of: dict[str, onnx.NodeProto] = {}
    shapes_of: dict[str, list[onnx.NodeProto]] = {}
    for name in past_names:
        dims = value_dims(inputs[name])
        concats = [n for n in uses.get(name, []) if n.op_type == "Concat"]
        new = value_dims(typed[concats[0].input[-1]]) if len(concats) == 1 and concats[0].input[-1] in typed else []
        if len(dims) == 4 and len(new) == 4 and not isinstance(dims[3], int):
            dims[3] = new[3]  # a symbolic head dim (the builder's `kv_cache_dim`): the new values' static one
        if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
            raise NotStateful(f"{name}: shape {dims}, not [batch, kv heads, past, head dim] with static heads and "
                              "head dim")
        others = [n for n in uses.get(name, []) if n.op_type not in ("Concat", "Shape")]
        if len(concats) != 1 or others:
            what = others[0].op_type if others else f"{len(concats)} Concats"
            raise NotStateful(f"{name} is read by {what}: a cache is read once, by a Concat with the new values")
        concat = concats[0]
        axis = next((a.i for a in concat.attribute if a.name == "axis"), None)
        if list(concat.input)[:1] != [name] or len(concat.input) != 2 or axis not in (2, -2):
            raise NotStateful(f"{name}: its Concat ({concat.name or concat.output[0]}) is not [past, new] "
                              "along the sequence axis")
        present = concat.output[0] if concat.output[0] in outputs else presents.get(name)
        if present is not None and present not in outputs:
            raise NotStateful(f"{name}: its present {present!r} is not a graph output")
        caches[name] = (CACHE_PREFIX + name, dims[1], dims[3], present)
        concat_of[name] = concat
        shapes_of[name] = [n for n in uses.get(name, []) if n.op_type == "Shape"]

    def fresh(base: str) -> str:
        taken = {v for n in graph.node for v in [*n.input, *n.output]} | set(inputs) | \
            {i.name for i in graph.initializer}
        k, name = 0, base
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        return name

    # past_length = len(mask) - len(ids), and each past's shape [batch, N, past_length, D], at the graph's top
    p = fresh("gc_state")
    top = [helper.make_node("Shape", [ids], [f"{p}_ids_shape"]), helper.make_node("Shape", [mask], [f"{p}_mask_shape"]),
           helper.make_node("Slice", [f"{p}_ids_shape", f"{p}_i0", f"{p}_i1"], [f"{p}_batch"]),
           helper.make_node("Slice", [f"{p}_ids_shape", f"{p}_i1", f"{p}_i2"], [f"{p}_q"]),
           helper.make_node("Slice", [f"{p}_mask_shape", f"{p}_i1", f"{p}_i2"], [f"{p}_total"]),
           helper.make_node("Sub", [f"{p}_total", f"{p}_q"], [f"{p}_past_length"])]
    inits = [numpy_helper.from_array(np.array([k], np.int64), f"{p}_i{k}") for k in range(3)]
    past_length = f"{p}_past_length"
    indices = {}
    for n in sorted({c[1] for c in caches.values()}):
        index_nodes, index_inits, indices[n] = _write_positions(p, n)
        top += index_nodes
        inits += index_inits
    nbytes = 0
    for name, (cache, n, d, _) in caches.items():
        elem = inputs[name].type.tensor_type.elem_type
        np_dtype = helper.tensor_dtype_to_np_dtype(elem)
        if np_dtype.kind != "f" and elem != onnx.TensorProto.BFLOAT16:
            raise NotStateful(f"{name}: cache dtype {onnx.TensorProto.DataType.Name(elem)} is not a float")
        size = max_batch * n * max_seq * d * np_dtype.itemsize
        dims = [max_batch, n, max_seq, d]
        inits.append(zeros(cache, elem, dims) if zeros
                     else helper.make_tensor(cache, elem, dims, bytes(size), raw=True))
        nbytes += size
        shape_value = f"{p}_{len(top)}_shape"
        inits += [numpy_helper.from_array(np.array([n], np.int64), f"{shape_value}_n"),
                  numpy_helper.from_array(np.array([d], np.int64), f"{shape_value}_d")]
        top.append(helper.make_node("Concat", [f"{p}_batch", f"{shape_value}_n", past_length, f"{shape_value}_d"],
                                    [shape_value], axis=0))
        for k, shape in enumerate(shapes_of[name]):
            start = next((a.i for a in shape.attribute if a.name == "start"), 0)
            end = next((a.i for a in shape.attribute if a.name == "end"), 4)
            starts, ends = f"{shape.output[0]}_start", f"{shape.output[0]}_end"
            inits += [numpy_helper.from_array(np.array([start], np.int64), starts),
                      numpy_helper.from_array(np.array([end], np.int64), ends)]
            shape.op_type = "Slice"
            del shape.attribute[:]
            shape.input[:] = [shape_value, starts, ends]
        concat = concat_of[name]
        concat.op_type, concat.domain = OP, DOMAIN
        del concat.attribute[:]
        concat.input[:] = [cache, concat.input[1], indices[n], f"{p}_total"]

    kept_inputs = [vi for vi in graph.input if vi.name not in caches]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    dropped = {c[3] for c in caches.values() if c[3]}
    kept_outputs = [vo for vo in graph.output if vo.name not in dropped]
    # (a present's type stays as its producer's value_info)
    graph.value_info.extend(vo for vo in graph.output if vo.name in dropped)
    del graph.output[:]
    graph.output.extend(kept_outputs)
    nodes = top + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
    opset = default_opset(model)
    if not any(f.domain == DOMAIN and f.name == OP for f in model.functions):
        model.functions.append(KV_CACHE_UPDATE.function(opset))
    if not any(i.domain == DOMAIN for i in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model, CacheLayout(max_batch, max_seq, caches, nbytes)
