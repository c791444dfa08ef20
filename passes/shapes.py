"""What can be proved about dims beyond ONNX's own shape inference (shared by fuse-rope and refine-shapes).

onnxruntime's symbolic shape inference follows shape arithmetic that onnx's does not: a Reshape to
(batch, seq, -1, 16) of a (batch, seq, 64) tensor has 4 heads, TorchScript exports name each unknown dim
anew, and so on. It runs on a weight-less snapshot of the graph (weights as shaped inputs), so it costs the
same for any model size.
"""

from __future__ import annotations


import numpy as np
import onnx
import onnx_ir as ir

from graphconv.onnx_domains import is_default_domain
from passes import match

# Initializers up to this size are kept in the shape-inference copy (shape constants); bigger ones (weights)
# become inputs of the same shape.
_SNAPSHOT_MAX_ELEMENTS = 4096

def _snapshot(model: ir.Model) -> onnx.ModelProto | None:
    """The graph as a proto for shape inference: nodes and small initializers, weights as shaped inputs."""
    try:
        g = model.graph
        inputs = [ir.serde.serialize_value(v) for v in g.inputs]
        names = {v.name for v in g.inputs}
        inits = []
        for name, v in g.initializers.items():
            if name in names:
                continue
            t = v.const_value
            if t is not None and t.size <= _SNAPSHOT_MAX_ELEMENTS:
                proto = ir.serde.serialize_tensor(t)
                proto.name = name
                inits.append(proto)
            else:
                shape = list(t.shape) if t is not None else [d if isinstance(d, int) else d.value for d in v.shape]
                inputs.append(onnx.helper.make_tensor_value_info(name, (t.dtype if t is not None else v.dtype).value,
                                                                 [int(d) if isinstance(d, int) else d for d in shape]))
        outputs = [onnx.helper.make_tensor_value_info(v.name, v.dtype.value if v.dtype else 0, None)
                   for v in g.outputs]
        graph = onnx.helper.make_graph([ir.serde.serialize_node(n) for n in g], "shapes", inputs, outputs, inits)
        opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
        return onnx.helper.make_model(graph, opset_imports=opsets)
    except Exception:  # noqa: BLE001 - only a proof aid: without it dims compare by their IR symbols
        return None


def _symbolic_shapes(proto: onnx.ModelProto) -> dict[str, list]:
    """value name -> dims (int, or a sympy expression as text) from onnxruntime's symbolic shape inference.

    auto_merge is off: two dims get one symbol only where the inference derives them from the same shape
    arithmetic or the model could not run otherwise, never merely because an op broadcasts them
    (graphconv/frontend/shapes.symbolic_inference runs it).
    """
    import opmap.fused
    from graphconv.frontend.shapes import symbolic_inference

    try:
        proto = _plain_constants(opmap.fused.inline_fused(opmap.fused.attach_functions(proto)))
    except Exception:  # noqa: BLE001 - see _snapshot
        return {}
    ssi = symbolic_inference(proto, auto_merge=False)
    if ssi is None:
        return {}
    try:
        dims = {}
        for name, vi in ssi.known_vi_.items():
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                dims[name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        return dims
    except Exception:  # noqa: BLE001 - see _snapshot
        return {}


def _plain_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant nodes with value_float/value_int(s)/value_floats rewritten to a `value` tensor: the only form
    the symbolic shape inference reads (inlined fused-op bodies take their attributes that way)."""
    kinds = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    for node in model.graph.node:
        if node.op_type != "Constant" or not is_default_domain(node.domain) or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        if attr.name in kinds:
            array = np.array(onnx.helper.get_attribute_value(attr), kinds[attr.name])
            del node.attribute[:]
            node.attribute.append(onnx.helper.make_attribute("value", onnx.numpy_helper.from_array(array)))
    return model


def refine_static_dims(model: ir.Model) -> int:
    """Give IR values the static dims that the symbolic shape inference proves where the IR has none;
    returns how many values changed. Only integers are taken: a symbol is never equated with another."""
    snap = _snapshot(model)
    dims = _symbolic_shapes(snap) if snap is not None else {}
    changed = 0
    for node in model.graph:
        for v in node.outputs:
            inferred = dims.get(v.name) if v.name else None
            if v.shape is None or inferred is None or len(inferred) != v.shape.rank():
                continue
            new = [d if isinstance(d, int) or not isinstance(s, int) else s for d, s in zip(v.shape, inferred)]
            if new != list(v.shape):
                v.shape = ir.Shape(new)
                changed += 1
    return changed


# --- Reshape's -1 from shape arithmetic ------------------------------------------------------------------------
# TorchScript writes Reshape(x, Concat(Shape(y)[0], Shape(y)[1], -1, 16)); where x's own dims are traced to the
# same Shape(y) pieces (x = Reshape(..., Concat(Shape(y)[0:2], 64))), the -1 is 64 / 16 = 4 whatever y's dims are.
# A dim is an "atom": a static int, ("axis", value, i) for axis i of a value no producer explains further, or
# ("prod", c, atoms) for a product such as Bloom's B·N = Mul(Shape(x)[0], N). Where all but one of the input's
# symbolic factors cancel and the static ones are equal, the -1 is that input axis: Bloom's Reshape(q (B, N, S,
# D), Concat(Shape(x)[0]·N, -1, D)) gets q's own S, so fuse-attention sees the flattening it reads.

# A dim passed on unchanged (an op whose output axis is exactly one input's axis) is the same atom as that
# input's: Shape(LayerNorm(x))[0] and MatMul(LayerNorm(x), W)'s axis 0 are both x's axis 0 (BERT's first query
# through TorchScript after onnxsim dropped its zero bias: Reshape(MatMul(ln, Wq), Concat(Shape(ln)[0],
# Shape(ln)[1], -1, 16))). Both sides of a comparison are traced by the same walk, so they meet where they should.

_MAX_DEPTH = 8
_MAX_CHAIN = 256  # ops passing a dim on, followed in a row (not counted in the depth: the walks must meet)
# Output 0 has input 0's shape.
_SAME_SHAPE = {"Identity", "Cast", "CastLike", "LayerNormalization", "RMSNormalization", "Softmax", "LogSoftmax",
               "Dropout", "Relu", "LeakyRelu", "Gelu", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "Softplus", "Neg",
               "Abs", "Sqrt", "Exp", "Log", "Reciprocal", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Not",
               "IsNaN", "IsInf", "Clip"}
# Multidirectional (numpy) broadcasting of all inputs.
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Where", "And", "Or", "Xor", "Equal",
              "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "PRelu"}


def _passed_on(value: ir.Value, axis: int) -> tuple[ir.Value, int] | None:
    """(input, its axis) when `value`'s `axis` is provably that input's dim, else None: output 0 of a
    same-shape op; a Transpose's permuted axis; a Gather's axes (the data's outside the gathered axis, the
    indices' in its place); a MatMul by a 2-D matrix (no batch broadcast) on every axis but
    the last; a broadcasting op on an axis where every other input is absent or static 1 (broadcasting a 1
    gives the other input's size, whatever it is)."""
    p = value.producer()
    if p is None or not is_default_domain(p.domain) or not p.inputs or p.inputs[0] is None:
        return None
    op = p.op_type
    if op in _SAME_SHAPE:
        return (p.inputs[0], axis) if value is p.outputs[0] else None
    if op == "Transpose":
        r = match.rank(p.inputs[0])
        return (p.inputs[0], match.perm(p, r)[axis]) if r is not None and r == match.rank(value) else None
    if op == "Gather":  # output = data.shape[:a] + indices.shape + data.shape[a+1:]
        data, idx = p.inputs[0], match.input_at(p, 1)
        r, ri = match.rank(data), match.rank(idx)
        if r is None or ri is None:
            return None
        a = p.attributes.get_int("axis", 0)
        a = a + r if a < 0 else a
        if axis < a:
            return data, axis
        return (idx, axis - a) if axis < a + ri else (data, axis - ri + 1)
    if op == "MatMul":
        a, b = p.inputs[0], p.inputs[1]
        ra = match.rank(a)
        return (a, axis) if ra is not None and ra >= 2 and match.rank(b) == 2 and axis < ra - 1 else None
    if op in _BROADCAST:
        out_rank = match.rank(value)
        if out_rank is None:
            return None
        carriers = []
        for x in p.inputs:
            xd = match.dims(x)
            if xd is None:
                return None
            k = axis - (out_rank - len(xd))
            if k < 0 or xd[k] == 1:
                continue  # absent or static 1: broadcast to the other inputs' size
            carriers.append((x, k))
        return carriers[0] if len(carriers) == 1 else None
    return None


def _dim_atom(value: ir.Value, axis: int, depth: int = 0):
    for _ in range(_MAX_CHAIN):
        dims = match.dims(value)
        if dims is not None and axis < len(dims) and isinstance(dims[axis], int):
            return dims[axis]
        nxt = _passed_on(value, axis)
        if nxt is None:
            break
        value, axis = nxt
    reshape = match.producer(value, "Reshape")
    if reshape is not None and depth < _MAX_DEPTH:
        target = _shape_atoms(reshape.inputs[1], depth + 1)
        if target is not None and axis < len(target) and target[axis] not in (None, -1, 0):
            return target[axis]
    return ("axis", id(value), axis)


def _shape_atoms(shape: ir.Value | None, depth: int = 0) -> list | None:
    """The atoms of a 1-D int64 shape tensor's elements (None for an element not traced), else None."""
    if shape is None or depth > _MAX_DEPTH:
        return None
    c = match.const_value(shape)
    if c is not None:
        return [int(v) for v in c.reshape(-1)] if c.dtype.kind in "iu" else None
    p = shape.producer()
    if p is None or not is_default_domain(p.domain):
        return None
    if p.op_type == "Shape":
        rank = match.rank(p.inputs[0])
        if rank is None:
            return None
        start = p.attributes.get_int("start", 0)
        end = p.attributes.get_int("end", rank)
        start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else min(end, rank))
        return [_dim_atom(p.inputs[0], i, depth + 1) for i in range(start, end)]
    if p.op_type in ("Cast", "Identity"):
        return _shape_atoms(p.inputs[0], depth + 1)
    if p.op_type == "Concat":
        parts = [_shape_atoms(x, depth + 1) for x in p.inputs]
        return None if any(x is None for x in parts) else [a for x in parts for a in x]
    if p.op_type == "Mul":  # elementwise, a 1-element side broadcast: B·N as Mul(Shape(x)[0], N)
        a, b = _shape_atoms(p.inputs[0], depth + 1), _shape_atoms(match.input_at(p, 1), depth + 1)
        if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        return [_product(a[i if len(a) > 1 else 0], b[i if len(b) > 1 else 0]) for i in range(n)]
    if p.op_type in ("Unsqueeze", "Squeeze", "Reshape"):  # a scalar made 1-D, or the other way
        inner = _shape_atoms(p.inputs[0], depth + 1)
        return inner if inner is not None and len(inner) == 1 else None
    if p.op_type in ("Gather", "Slice"):
        src = _shape_atoms(p.inputs[0], depth + 1)
        if src is None:
            return None
        if p.op_type == "Gather":
            idx = match.ints(p.inputs[1])
            return None if idx is None or p.attributes.get_int("axis", 0) != 0 else [src[i] for i in idx]
        starts, ends = match.ints(match.input_at(p, 1)), match.ints(match.input_at(p, 2))
        axes, steps = match.input_at(p, 3), match.input_at(p, 4)
        if starts is None or ends is None or len(starts) != 1 or (axes is not None and match.ints(axes) != [0]) \
                or (steps is not None and match.ints(steps) != [1]):
            return None
        return src[slice(starts[0], ends[0])]
    return None


def _factors(atom) -> list:
    """A product atom's factors (its static part first), any other atom alone."""
    return [atom[1], *atom[2]] if isinstance(atom, tuple) and atom[0] == "prod" else [atom]


def _product(a, b):
    """The atom of a · b: an int, one symbolic atom, ("prod", static part, sorted symbolic atoms), or None
    (a factor not traced, or a -1 or negative factor: not a dim)."""
    if a is None or b is None:
        return None
    fs = _factors(a) + _factors(b)
    c = int(np.prod([f for f in fs if isinstance(f, int)]))
    syms = sorted(f for f in fs if not isinstance(f, int))
    if c < 0:
        return None
    if c == 0 or not syms:
        return c
    return syms[0] if c == 1 and len(syms) == 1 else ("prod", c, tuple(syms))


_FOLLOWS = {"Transpose", "Mul", "Div", "Add", "Sub", "Cast", "Identity"}


def _follow(node: ir.Node) -> int:
    """Static dims of a Transpose's input, or of an elementwise op's input taken with a scalar constant,
    carried to its output where the output's are unknown."""
    x, out = node.inputs[0], node.outputs[0]
    xd, od = match.dims(x), match.dims(out)
    if xd is None or od is None or len(xd) != len(od):
        return 0
    if node.op_type == "Transpose":
        xd = [xd[i] for i in match.perm(node, len(xd))]
    elif node.op_type not in ("Cast", "Identity") and (len(node.inputs) != 2 or match.scalar(node.inputs[1]) is None):
        return 0
    new = [x_ if isinstance(x_, int) and not isinstance(o, int) else o for x_, o in zip(xd, od)]
    if new == od:
        return 0
    out.shape = ir.Shape([n if isinstance(n, int) else d for n, d in zip(new, out.shape)])
    return 1


def _symbols(atoms: list) -> list:
    return [a for a in atoms if not isinstance(a, int)]


def refine_reshape_minus_one(model: ir.Model) -> int:
    """Give a Reshape output its -1 where the shape arithmetic proves it: every symbolic factor of the target
    is one of the input's (same value, same axis) and the static factors divide. With none of the input's
    left over the -1 is static (num / den); with exactly one left over, a whole input axis, and the static
    factors equal, the -1 is that axis and gets its symbolic dim (Bloom's flattening through TorchScript:
    Reshape(q (B, N, S, D), Concat(Shape(x)[0]·N, -1, D)) is (B·N, S, D) with q's own S). Returns how many
    dims were refined."""
    changed = 0
    for node in model.graph:  # topological order: a refined dim reaches the Transposes and scalings after it
        if not is_default_domain(node.domain):
            continue
        if node.op_type in _FOLLOWS:
            changed += _follow(node)
            continue
        if node.op_type != "Reshape":
            continue
        out, src = node.outputs[0], node.inputs[0]
        target, dims = _shape_atoms(node.inputs[1]), match.dims(out)
        rank = match.rank(src)
        if target is None or dims is None or rank is None or len(target) != len(dims) or target.count(-1) != 1:
            continue
        if 0 in target and node.attributes.get_int("allowzero", 0) == 0:
            continue  # (0 copies an input dim: not handled)
        k = target.index(-1)
        if isinstance(dims[k], int) or any(a is None for a in target):
            continue
        have = [_dim_atom(src, i) for i in range(rank)]
        have_f = [f for a in have for f in _factors(a)]
        target_f = [f for i, a in enumerate(target) if i != k for f in _factors(a)]
        left = _symbols(have_f)
        for a in _symbols(target_f):
            if a not in left:
                break
            left.remove(a)
        else:
            num = int(np.prod([a for a in have_f if isinstance(a, int)]))
            den = int(np.prod([a for a in target_f if isinstance(a, int)]))
            new = list(out.shape)
            if not left and den > 0 and num % den == 0:
                new[k] = num // den
            elif len(left) == 1 and num == den and left[0] in have:
                dim = src.shape[have.index(left[0])]
                if not isinstance(dim, ir.SymbolicDim) or dim.value is None or dims[k] == dim.value:
                    continue
                new[k] = dim
            else:
                continue
            out.shape = ir.Shape(new)
            changed += 1
    return changed
