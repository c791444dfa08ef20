"""Every opmap handler, proven numerically: tiny hand-built ONNX graphs with symbolic dims, lowered to MindSpore,
exported to MindIR with the symbolic dims kept dynamic, run at TWO concrete shapes and compared with onnxruntime
(or, for a case whose `reference` says why onnxruntime has no kernel for it, with onnx.reference).

All models run in one MindSpore child process (graphconv.runtime.runner.run_models), built once per module; each case
is then one parametrized test that looks up its result. CASES is the coverage table: every case names the op
it covers and the opset it imports, and `test_every_handler_has_a_case` fails when a registered
(op_type, since_version) has no case here. REFUSALS are graphs the lowering must reject with a clear
UnsupportedError (no MindSpore needed).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper as oh, numpy_helper
from onnx.reference import ReferenceEvaluator

import opmap
from opmap import fused
from graphconv.compiler import lowering
from graphconv.verify import integer_products
from graphconv.verify.compare import compare
from graphconv.errors import GraphconvError, UnsupportedError
from graphconv.runtime.runner import RunResult, run_isolating_crashes

F32, F16, I64, I32, U8, BOOL = np.float32, np.float16, np.int64, np.int32, np.uint8, np.bool_
OPSET = 17
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
# The two concrete shapes every case runs at: each symbolic dim gets a different size in each.
DIMS = ({"batch": 2, "seq": 3, "h": 6, "w": 7}, {"batch": 3, "seq": 5, "h": 9, "w": 5})
ATOL = RTOL = 1e-5


# --- the case table ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class In:
    """A graph input: symbolic dims are str, `gen(rng, shape, dims)` draws its value (default by dtype)."""

    shape: tuple = ("batch", "seq", 4)
    dtype: type = F32
    gen: Callable | None = None
    name: str | None = None


@dataclasses.dataclass
class K:
    """An initializer (a compile-time constant input)."""

    value: np.ndarray
    name: str | None = None


@dataclasses.dataclass
class Case:
    id: str
    op: str  # the op under test: this case covers opmap.lookup(domain, op, opset)
    opset: int
    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    xfail: str | None = None
    atol: float = ATOL
    rtol: float = RTOL
    domain: str = ""
    reference: str | None = None  # why onnxruntime cannot run it (no kernel): onnx.reference is the oracle then


CASES: list[Case] = []
REFUSALS: list[tuple[str, onnx.ModelProto, str]] = []  # (id, model, regex the UnsupportedError must match)


def k(value, dtype=None, name=None) -> K:
    return K(np.asarray(value, dtype=dtype), name)


def _draw(spec: In, rng: np.random.Generator, dims: dict) -> np.ndarray:
    shape = tuple(dims[d] if isinstance(d, str) else d for d in spec.shape)
    if spec.gen is not None:
        return np.asarray(spec.gen(rng, shape, dims)).astype(spec.dtype)
    dt = np.dtype(spec.dtype)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind == "u":
        return rng.integers(0, 200, shape).astype(dt)
    return rng.integers(-6, 7, shape).astype(dt)


def _model(nodes, inputs: list[In], inits: dict, outputs: list[str], opset: int) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes, "opmap_test",
        [oh.make_tensor_value_info(i.name, oh.np_dtype_to_tensor_dtype(np.dtype(i.dtype)), list(i.shape))
         for i in inputs],
        [onnx.ValueInfoProto(name=o) for o in outputs],  # types and shapes come from shape inference
        [numpy_helper.from_array(v, name) for name, v in inits.items()])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])


def graph_case(cid, op, nodes, inputs: list[In], inits=None, outputs=("y",), *, opset=OPSET, dims=DIMS,
               xfail=None, atol=ATOL, rtol=RTOL, domain="", reference=None):
    """A multi-node case: `inputs` must carry names; the nodes refer to them and to `inits`."""
    assert all(c.id != cid for c in CASES), f"duplicate case id {cid}"
    model = _model(nodes, inputs, dict(inits or {}), list(outputs), opset)
    if domain == fused.DOMAIN:
        model = fused.attach_functions(model)  # onnxruntime runs the op's function body
    rng = np.random.default_rng(zlib.crc32(cid.encode()))
    feeds = [{i.name: _draw(i, rng, d) for i in inputs} for d in dims]
    CASES.append(Case(cid, op, opset, model, feeds, xfail, atol, rtol, domain, reference))


def _single_graph(op, args, attrs, n_out, domain=""):
    inputs, inits, names = [], {}, []
    for j, a in enumerate(args):
        if a is None:
            names.append("")
        elif isinstance(a, In):
            a = dataclasses.replace(a, name=a.name or f"x{j}")
            inputs.append(a)
            names.append(a.name)
        else:
            name = a.name or f"c{j}"
            inits[name] = a.value
            names.append(name)
    outs = [f"y{j}" for j in range(n_out)]
    return [oh.make_node(op, names, outs, domain=domain, **(attrs or {}))], inputs, inits, outs


def case(cid, op, args, attrs=None, *, n_out=1, **kw):
    """A one-node case. args: In (graph input), K (initializer) or None (absent optional input), in order."""
    nodes, inputs, inits, outs = _single_graph(op, args, attrs, n_out, kw.get("domain", ""))
    graph_case(cid, op, nodes, inputs, inits, outs, **kw)


def refusal(cid, match, op, args, attrs=None, *, n_out=1, opset=OPSET, nodes=None, inputs=None, inits=None,
            outputs=("y",)):
    """A graph the lowering must reject with an UnsupportedError matching `match`."""
    if nodes is None:
        nodes, inputs, inits, outputs = _single_graph(op, args, attrs, n_out)
    REFUSALS.append((cid, _model(nodes, inputs, dict(inits or {}), list(outputs), opset), match))


def node(op, ins, outs, **attrs):
    return oh.make_node(op, ins, outs, **attrs)


# Value generators: (rng, shape, dims) -> array.
def ints(lo, hi):
    return lambda r, s, d: r.integers(lo, hi, s)


def uniform(lo, hi):
    return lambda r, s, d: r.uniform(lo, hi, s)


def signed(r, s, d):  # magnitudes in [1, 3), either sign
    return r.uniform(1, 3, s) * r.choice([-1, 1], s)


def wide(r, s, d):  # where transcendental approximations drift (tanh near |x| = 5, say)
    return r.uniform(-7.0, 7.0, s)


def positive(r, s, d):
    return r.uniform(0.5, 3.0, s)


def unit(r, s, d):
    return r.uniform(-0.9, 0.9, s)


def above_one(r, s, d):
    return r.uniform(1.1, 4.0, s)


def halves(r, s, d):  # exact .5 values: Round is half-to-even
    return r.integers(-10, 11, s) / 2.0


def nonzero_int(r, s, d):
    v = r.integers(1, 8, s)
    return np.where(r.random(s) < 0.5, -v, v)


def small_int(r, s, d):
    return r.integers(-2, 3, s)


def with_zeros(r, s, d):
    return np.where(r.random(s) < 0.3, 0.0, r.standard_normal(s))


def specials(r, s, d):  # inf, -inf and NaN among ordinary values
    v = r.standard_normal(s)
    return np.where(r.random(s) < 0.4, r.choice([np.inf, -np.inf, np.nan], s), v)


def index_in(dim, negative=True):
    """Indices valid for the symbolic (str) or static (int) dim, negative ones included unless told."""
    def gen(r, s, d):
        n = d[dim] if isinstance(dim, str) else dim
        return r.integers(-n if negative else 0, n, s)
    return gen


def x(*dims, shape=None, dtype=F32, gen=None, name=None) -> In:
    """A graph input of shape `dims` (default ["batch", "seq", 4]); shape=() for a 0-d one."""
    return In(tuple(shape if shape is not None else dims or ("batch", "seq", 4)), dtype, gen, name)


# --- elementwise: unary --------------------------------------------------------------------------------------

UNARY_INPUTS = {
    "Abs": None, "Neg": None, "Exp": wide, "Log": positive, "Sqrt": positive, "Reciprocal": positive,
    "Floor": wide, "Ceil": wide, "Erf": wide, "Tanh": wide, "Sigmoid": wide, "Cos": wide, "Sin": wide,
    "Tan": unit, "Acos": unit, "Asin": unit, "Atan": wide, "Cosh": wide, "Sinh": wide, "Acosh": above_one,
    "Asinh": wide, "Atanh": unit, "Relu": None, "Sign": with_zeros, "Round": halves, "Softsign": wide,
    "Softplus": wide,
}
for _op, _gen in UNARY_INPUTS.items():
    case(f"{_op}", _op, [x("batch", "seq", 64, gen=_gen)])
case("Abs_int64", "Abs", [x(dtype=I64)])
case("Neg_int32", "Neg", [x(dtype=I32)])
case("Sign_int64", "Sign", [x(dtype=I64)])
case("Relu_rank4", "Relu", [x("batch", 2, "h", "w")])
case("Not", "Not", [x(dtype=BOOL)])
case("IsNaN", "IsNaN", [x(gen=specials)])
case("BitwiseNot_int32", "BitwiseNot", [x(dtype=I32)], opset=18)
case("BitwiseNot_uint8", "BitwiseNot", [x(dtype=U8)], opset=18)
case("IsInf", "IsInf", [x(gen=specials)])
case("IsInf_positive", "IsInf", [x(gen=specials)], {"detect_negative": 0})
case("IsInf_negative", "IsInf", [x(gen=specials)], {"detect_positive": 0})
case("IsInf_none", "IsInf", [x(gen=specials)], {"detect_positive": 0, "detect_negative": 0})

# --- elementwise: binary -------------------------------------------------------------------------------------

for _op in ("Add", "Sub", "Mul"):
    case(f"{_op}_both_sides", _op, [x(), x("seq", 1)])
case("Add_broadcast", "Add", [x(), x(4)])
case("Mul_int64", "Mul", [x(dtype=I64), x("seq", 1, dtype=I64)])
case("Sub_scalar_left", "Sub", [k(2.5, F32), x()])
case("Mul_scalar_right", "Mul", [x(), k(0.5, F32)])
case("Mul_scalar_fp16", "Mul", [x(dtype=F16), k(0.5, F16)], atol=1e-3, rtol=1e-3)
case("Div_scalar_fp16", "Div", [x(dtype=F16), k(3.0, F16)], atol=1e-3, rtol=1e-3)
case("Add_fp16", "Add", [x(dtype=F16), x(4, dtype=F16)], atol=1e-3, rtol=1e-3)
case("Add_int_scalar", "Add", [x(dtype=I32), k(3, I32)])
case("Sub_int_scalar_left", "Sub", [k(3, I64), x(dtype=I64)])
case("Add_scalar_input", "Add", [x(), x(name="s", shape=())])
case("Pow", "Pow", [x(gen=positive), x(4, gen=unit)])
case("Pow_scalar_exponent", "Pow", [x(), k(2.0, F32)])
case("Pow_scalar_base", "Pow", [k(2.0, F32), x()])
case("Pow_negative_base", "Pow", [x(), x(4, gen=ints(0, 4))])
case("Pow_int_exponent", "Pow", [x(), x(4, dtype=I64, gen=ints(0, 4))])
case("Pow_int64", "Pow", [x(dtype=I64, gen=small_int), x(4, dtype=I64, gen=ints(0, 4))])
for _op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"):
    case(f"{_op}", _op, [x(), x("seq", 1)])
for _op in ("Equal", "Less", "Greater"):
    case(f"{_op}_int64", _op, [x(dtype=I64, gen=small_int), x(4, dtype=I64, gen=small_int)])
case("Equal_bool", "Equal", [x(dtype=BOOL), x(4, dtype=BOOL)])
case("Less_scalar", "Less", [x(), k(0.0, F32)])
for _op in ("And", "Or", "Xor"):
    case(f"{_op}", _op, [x(dtype=BOOL), x("seq", 1, dtype=BOOL)])
for _op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
    case(f"{_op}_int32", _op, [x(dtype=I32), x(4, dtype=I32)], opset=18)
case("BitwiseAnd_int64", "BitwiseAnd", [x(dtype=I64), x("seq", 1, dtype=I64)], opset=18)
case("Div", "Div", [x(), x(4, gen=positive)])
case("Div_scalar", "Div", [x(), k(4.0, F32)])
case("Div_scalar_left", "Div", [k(1.0, F32), x(gen=positive)])
case("Div_int64_trunc", "Div", [x(dtype=I64, gen=ints(-20, 21)), x(4, dtype=I64, gen=nonzero_int)])
case("Div_int32_trunc", "Div", [x(dtype=I32, gen=ints(-20, 21)), x(4, dtype=I32, gen=nonzero_int)])
case("Div_int_scalar", "Div", [x(dtype=I64, gen=ints(-20, 21)), k(3, I64)])
case("Mod_int64", "Mod", [x(dtype=I64, gen=ints(-20, 21)), x(4, dtype=I64, gen=nonzero_int)])
case("Mod_int32_fmod", "Mod", [x(dtype=I32, gen=ints(-20, 21)), x(4, dtype=I32, gen=nonzero_int)],
     {"fmod": 1})
case("Mod_float_fmod", "Mod", [x(gen=uniform(-9, 9)), x(4, gen=signed)], {"fmod": 1})

# --- elementwise: variadic, Where, Cast, Clip ----------------------------------------------------------------

for _op in ("Max", "Min", "Sum", "Mean"):
    case(f"{_op}_three", _op, [x(), x(4), x("seq", 1)])
    case(f"{_op}_one", _op, [x()])
case("Max_int64", "Max", [x(dtype=I64), x(4, dtype=I64)])
case("Min_two", "Min", [x(4), x()])
case("Where", "Where", [x("batch", 1, 4, dtype=BOOL), x("seq", 4), x(1)])
case("Where_int64", "Where", [x(dtype=BOOL), x(dtype=I64), k(-1, I64)])
case("Where_const_condition", "Where", [k([True, False, False, True]), x(), x(4)])
for _src, _dst, _gen in [(F32, I32, halves), (F32, I64, uniform(-9, 9)), (F32, BOOL, with_zeros),
                         (BOOL, F32, None), (I64, F32, None), (I64, BOOL, small_int),
                         (F32, F16, None), (F16, F32, None), (I64, I32, None), (BOOL, I64, None)]:
    _name = f"Cast_{np.dtype(_src).name}_{np.dtype(_dst).name}"
    case(_name, "Cast", [x(dtype=_src, gen=_gen)], {"to": oh.np_dtype_to_tensor_dtype(np.dtype(_dst))})
case("CastLike", "CastLike", [x(gen=uniform(-9, 9)), x(1, dtype=I64)], opset=15)
case("Clip", "Clip", [x(), k(-0.5, F32), k(0.5, F32)], opset=13)
case("Clip_max_only", "Clip", [x(), None, k(0.3, F32)], opset=13)
case("Clip_min_only", "Clip", [x(), k(-0.2, F32)], opset=13)
case("Clip_none", "Clip", [x()], opset=13)
case("Clip_int64", "Clip", [x(dtype=I64), k(-2, I64), k(3, I64)], opset=13)
case("Clip_runtime_bounds", "Clip", [x(), x(shape=(), name="lo", gen=lambda r, s, d: -r.uniform(0, 1, s)),
                                     x(shape=(), name="hi", gen=uniform(0, 1))], opset=13)
case("Clip_opset11", "Clip", [x(), k(-0.5, F32), k(0.5, F32)], opset=11)

# --- activations ---------------------------------------------------------------------------------------------

case("LeakyRelu", "LeakyRelu", [x()], {"alpha": 0.2})
case("Elu", "Elu", [x()], {"alpha": 0.5})
case("Selu", "Selu", [x()])
case("Selu_attrs", "Selu", [x()], {"alpha": 1.5, "gamma": 2.0})
case("HardSigmoid", "HardSigmoid", [x(gen=uniform(-6, 6))], {"alpha": 0.3, "beta": 0.4})
case("HardSwish", "HardSwish", [x(gen=uniform(-6, 6))])
case("PRelu_vector", "PRelu", [x(), x(4)])
case("PRelu_channels", "PRelu", [x("batch", 3, "h", "w"), k(np.array([[[0.1]], [[0.2]], [[-0.3]]], F32))])
case("ThresholdedRelu", "ThresholdedRelu", [x()], {"alpha": 0.3})
case("Gelu_none", "Gelu", [x(gen=wide)], opset=20)
case("Gelu_tanh", "Gelu", [x(gen=wide)], {"approximate": "tanh"}, opset=20)
case("Celu", "Celu", [x()], {"alpha": 2.0})
case("Mish", "Mish", [x(gen=uniform(-6, 6))], opset=18)
case("Softplus_large", "Softplus", [x(gen=uniform(-30, 30))])

# --- reductions ----------------------------------------------------------------------------------------------

REDUCE_INPUTS = {"ReduceMean": None, "ReduceSum": None, "ReduceMax": None, "ReduceMin": None,
                 "ReduceProd": uniform(0.5, 1.5), "ReduceL1": None, "ReduceL2": None,
                 "ReduceSumSquare": None, "ReduceLogSum": positive, "ReduceLogSumExp": None}
for _op, _gen in REDUCE_INPUTS.items():
    attr_opset = 11 if _op == "ReduceSum" else 13  # axes attribute
    input_opset = 13 if _op == "ReduceSum" else 18  # axes input
    case(f"{_op}_attr_axes", _op, [x(gen=_gen)], {"axes": [0, -1], "keepdims": 0}, opset=attr_opset)
    case(f"{_op}_input_axes", _op, [x(gen=_gen), k([-2], I64)], opset=input_opset)
for _op in ("ReduceMax", "ReduceLogSumExp"):
    case(f"{_op}_all_axes", _op, [x(gen=REDUCE_INPUTS[_op])], opset=18)
case("ReduceMean_opset17", "ReduceMean", [x()], {"axes": [1], "keepdims": 0}, opset=17)
case("ReduceMean_all_nokeep", "ReduceMean", [x()], {"keepdims": 0}, opset=18)
case("ReduceMean_noop_empty_axes", "ReduceMean", [x()], {"noop_with_empty_axes": 1}, opset=18)
case("ReduceSum_all_nokeep", "ReduceSum", [x()], {"keepdims": 0}, opset=13)
case("ReduceSum_empty_axes_input", "ReduceSum", [x(), k(np.zeros(0, I64))], opset=13)
case("ReduceSum_int64", "ReduceSum", [x(dtype=I64), k([1], I64)], opset=13)
case("ReduceMax_int64", "ReduceMax", [x(dtype=I64), k([-1], I64)], opset=18)
for _op in ("ArgMax", "ArgMin"):
    case(f"{_op}_keepdims", _op, [x()], {"axis": -1})
    case(f"{_op}_nokeep", _op, [x()], {"axis": 1, "keepdims": 0})
    case(f"{_op}_int_ties", _op, [x(dtype=I64, gen=ints(0, 2))], {"axis": -1})
case("ArgMax_default_axis", "ArgMax", [x()])
for _op in ("Softmax", "LogSoftmax"):
    case(f"{_op}", _op, [x()])
    case(f"{_op}_axis1", _op, [x()], {"axis": 1})
    case(f"{_op}_negative_axis", _op, [x("batch", "seq", 4, 3)], {"axis": -3})
    case(f"{_op}_large", _op, [x(gen=uniform(-80, 80))])

# --- shape ops -----------------------------------------------------------------------------------------------

case("Shape", "Shape", [x()], opset=13)
case("Shape_start", "Shape", [x()], {"start": 1}, opset=15)
case("Shape_start_end", "Shape", [x("batch", "seq", 4, 2)], {"start": 1, "end": -1}, opset=15)
case("Shape_negative_start", "Shape", [x()], {"start": -2}, opset=15)
case("Shape_static", "Shape", [x(2, 3, 4)], {"start": 1}, opset=15)
case("Size", "Size", [x()])
case("Reshape_zero_minus_one", "Reshape", [x("batch", "seq", 8), k([0, -1], I64)])
case("Reshape_zeros_split", "Reshape", [x("batch", "seq", 8), k([0, 0, 2, 4], I64)])
case("Reshape_minus_one", "Reshape", [x("batch", "seq", 8), k([-1, 4], I64)])
case("Reshape_static_zero", "Reshape", [x("batch", 3, 8), k([-1, 0, 2, 4], I64)])
case("Reshape_allowzero", "Reshape", [x("batch", "seq", 8), k([-1, 2, 4], I64)], {"allowzero": 1}, opset=14)
graph_case("Reshape_runtime_shape", "Reshape",
           [node("Shape", ["x"], ["s"]), node("Slice", ["s", "zero", "one"], ["b"]),
            node("Concat", ["b", "minus_one"], ["shape"], axis=0), node("Reshape", ["x", "shape"], ["y"])],
           [x("batch", "seq", 8, name="x")],
           {"zero": np.array([0], I64), "one": np.array([1], I64), "minus_one": np.array([-1], I64)})
graph_case("Reshape_runtime_shape_with_zero", "Reshape",
           [node("Shape", ["x"], ["s"], start=2), node("Concat", ["zero_minus_one", "s"], ["shape"], axis=0),
            node("Reshape", ["x", "shape"], ["y"])],
           [x("batch", "seq", 8, name="x")], {"zero_minus_one": np.array([0, -1], I64)}, opset=15)
graph_case("Reshape_runtime_shape_allowzero", "Reshape",
           [node("Shape", ["x"], ["s"]), node("Slice", ["s", "one", "two"], ["b"]),
            node("Concat", ["minus_one", "b", "four"], ["shape"], axis=0),
            node("Reshape", ["x", "shape"], ["y"], allowzero=1)],
           [x("batch", "seq", 8, name="x")],
           {"one": np.array([1], I64), "two": np.array([2], I64), "minus_one": np.array([-1], I64),
            "four": np.array([4], I64)}, opset=14)
# The exporters' shape arithmetic: a 0-d Gather of a run-time shape, Unsqueeze, Concat, Reshape.
graph_case("Gather_shape_scalar_reshape", "Gather",
           [node("Shape", ["x"], ["s"]), node("Gather", ["s", "zero"], ["b"]), node("Gather", ["s", "one"], ["t"]),
            node("Mul", ["b", "t"], ["bt"]), node("Unsqueeze", ["bt", "axes"], ["bt1"]),
            node("Concat", ["bt1", "minus_one"], ["shape"], axis=0), node("Reshape", ["x", "shape"], ["y"])],
           [x("batch", "seq", 8, name="x")],
           {"zero": np.array(0, I64), "one": np.array(-2, I64), "axes": np.array([0], I64),
            "minus_one": np.array([-1], I64)})
for _axis in (0, 1, 2, 3, -1, -3):
    case(f"Flatten_axis{_axis}".replace("-", "m"), "Flatten", [x()], {"axis": _axis}, opset=13)
case("Flatten_default", "Flatten", [x("batch", 3, "h", "w")], opset=13)
case("Flatten_rank4_axis2", "Flatten", [x("batch", 3, "h", "w")], {"axis": 2}, opset=13)
case("Transpose_default", "Transpose", [x()])
case("Transpose_perm", "Transpose", [x()], {"perm": [1, 0, 2]})
case("Transpose_rank4", "Transpose", [x("batch", 3, "h", "w")], {"perm": [0, 2, 3, 1]})
case("Concat_negative_axis", "Concat", [x(), x("batch", "seq", 2), x("batch", "seq", 1)], {"axis": -1})
case("Concat_dynamic_axis", "Concat", [x(), x(2, "seq", 4)], {"axis": 0})
case("Concat_int64", "Concat", [x("batch", 4, dtype=I64), k(np.arange(8).reshape(2, 4), I64)], {"axis": 0})
case("Concat_one", "Concat", [x()], {"axis": 1})
case("Split_input", "Split", [x("batch", "seq", 6), k([1, 3, 2], I64)], {"axis": -1}, n_out=3, opset=13)
case("Split_equal", "Split", [x("batch", "seq", 6)], {"axis": 2}, n_out=3, opset=13)
case("Split_dynamic_equal", "Split", [x("batch", "seq", 4)], {"axis": 1}, n_out=2, opset=13,
     dims=({"batch": 2, "seq": 4}, {"batch": 3, "seq": 6}))
case("Split_num_outputs", "Split", [x("batch", "seq", 8)], {"axis": 2, "num_outputs": 3}, n_out=3, opset=18)
case("Split_num_outputs_dynamic", "Split", [x("batch", "seq", 4)], {"axis": 1, "num_outputs": 3}, n_out=3,
     opset=18, dims=({"batch": 2, "seq": 7}, {"batch": 3, "seq": 9}))
case("Split_input_opset18", "Split", [x("batch", "seq", 4), k([3, 1], I64)], {"axis": 2}, n_out=2, opset=18)
# Sizes computed at run time, one part empty (JetMoE splits its tokens by each expert's count; an expert may get none).
case("Split_runtime_sizes", "Split", [x("batch", "seq", 4), x(3, dtype=I64, name="sizes",
                                                              gen=lambda r, s, d: [d["seq"] - 1, 0, 1])],
     {"axis": 1}, n_out=3, opset=13)
case("Split_input_dynamic_axis", "Split", [x("batch", 5, 4), k([2, 3], I64)], {"axis": 1}, n_out=2, opset=13)

# Slice: constant starts/ends/axes/steps in every spelling, then run-time starts/ends.
SLICES = {
    "negative": ([-3], [-1], [2], None),
    "int64_max_end": ([1], [INT64_MAX], [1], None),
    "reverse_all": ([-1], [INT64_MIN], [1], [-1]),
    "reverse_step2": ([6], [0], [2], [-2]),
    "reverse_clamped": ([INT64_MAX], [-100], [-1], [-1]),
    "omitted_axes_steps": ([0, 1], [1, INT64_MAX], None, None),
    "negative_axis_step2": ([0], [INT64_MAX], [-1], [2]),
    "two_axes_unordered": ([1, 0], [INT64_MAX, -1], [2, 0], [1, 1]),
    "end_beyond": ([1], [100], [1], None),
    "dynamic_step2": ([0], [INT64_MAX], [1], [2]),
    "dynamic_reverse_from_middle": ([1], [INT64_MIN], [1], [-1]),
    "dynamic_reverse_negative_start": ([-2], [0], [0], [-1]),
    "start_before": ([-100], [2], [1], None),
}
for _name, (_s, _e, _a, _st) in SLICES.items():
    _args = [x("batch", "seq", 8), k(_s, I64), k(_e, I64)]
    if _a is not None or _st is not None:
        _args.append(k(_a if _a is not None else list(range(len(_s))), I64))
    if _st is not None:
        _args.append(k(_st, I64))
    case(f"Slice_{_name}", "Slice", _args)
case("Slice_int32_indices", "Slice", [x("batch", "seq", 8), k([1], I32), k([-1], I32), k([1], I32)])
graph_case("Slice_runtime_end", "Slice",
           [node("Shape", ["x"], ["s"], start=1, end=2), node("Sub", ["s", "one"], ["end"]),
            node("Slice", ["x", "zero", "end", "one"], ["y"])],
           [x("batch", "seq", 8, name="x")], {"zero": np.array([0], I64), "one": np.array([1], I64)})
graph_case("Slice_runtime_start_end", "Slice",
           [node("Shape", ["x"], ["s"], start=1, end=2), node("Div", ["s", "two"], ["start"]),
            node("Add", ["start", "one"], ["end"]), node("Slice", ["x", "start", "end", "one"], ["y"])],
           [x("batch", "seq", 8, name="x")], {"one": np.array([1], I64), "two": np.array([2], I64)})
graph_case("Slice_runtime_negative_step", "Slice",
           [node("Shape", ["x"], ["s"], start=0, end=1), node("Sub", ["s", "one"], ["start"]),
            node("Slice", ["x", "start", "stop", "zero", "minus_one"], ["y"])],
           [x("batch", "seq", 8, name="x")],
           {"one": np.array([1], I64), "zero": np.array([0], I64), "minus_one": np.array([-1], I64),
            "stop": np.array([INT64_MIN], I64)})
graph_case("Slice_runtime_start_const_end", "Slice",
           [node("Shape", ["x"], ["s"], start=1, end=2), node("Neg", ["s"], ["negs"]),
            node("Add", ["negs", "two"], ["start"]), node("Slice", ["x", "start", "big", "one"], ["y"])],
           [x("batch", "seq", 8, name="x")],
           {"one": np.array([1], I64), "two": np.array([2], I64), "big": np.array([INT64_MAX], I64)})
graph_case("Slice_runtime_input_indices", "Slice",
           [node("Slice", ["x", "s", "e", "axes"], ["y"])],
           [x("batch", "seq", 8, name="x"), x(1, dtype=I64, name="s", gen=lambda r, s, d: [-r.integers(2, 5)]),
            x(1, dtype=I64, name="e", gen=lambda r, s, d: [r.integers(6, 9)])],
           {"axes": np.array([2], I64)})
case("Squeeze", "Squeeze", [x("batch", 1, 4), k([1], I64)])
case("Squeeze_negative", "Squeeze", [x("batch", "seq", 1), k([-1], I64)])
case("Squeeze_two", "Squeeze", [x(1, "seq", 1), k([0, 2], I64)])
case("Squeeze_no_axes_static", "Squeeze", [x(1, 3, 1, 2, name="x")])
case("Unsqueeze", "Unsqueeze", [x(), k([0], I64)])
case("Unsqueeze_unsorted", "Unsqueeze", [x(), k([4, 0], I64)])
case("Unsqueeze_mixed", "Unsqueeze", [x("batch", 4), k([1, -1], I64)])
case("Unsqueeze_scalar", "Unsqueeze", [x(shape=()), k([0], I64)])
graph_case("Expand_runtime_shape", "Expand",
           [node("Shape", ["y_like"], ["s"]), node("Expand", ["x", "s"], ["y"])],
           [x("batch", 1, 4, name="x"), x("seq", 1, name="y_like")])
graph_case("Expand_runtime_shape_higher_rank", "Expand",
           [node("Shape", ["x"], ["s"], end=1), node("Concat", ["s", "three", "one"], ["shape"], axis=0),
            node("Expand", ["x", "shape"], ["y"])],
           [x("batch", 1, 4, name="x")], {"three": np.array([3], I64), "one": np.array([1], I64)}, opset=15)
case("Expand_const_shape", "Expand", [x("batch", 1, 4), k([2, 1, 1, 1], I64)])
case("Expand_const_lower_rank", "Expand", [x("seq", 1), k([3], I64)])
case("Expand_bool", "Expand", [x("batch", 1, 4, dtype=BOOL), k([1, 3, 1], I64)])
case("Tile", "Tile", [x(), k([1, 2, 3], I64)])
case("Tile_int64", "Tile", [x("batch", 2, dtype=I64), k([2, 1], I64)])

# Gather and friends: negative indices (constant and run-time), scalar index, int32 indices.
case("Gather_const_negative_dynamic_axis", "Gather", [x(), k([0, -1, 1], I64)], {"axis": 1})
case("Gather_const_negative_static_axis", "Gather", [x(), k([[-1, 0], [2, -3]], I64)], {"axis": 2})
case("Gather_scalar_index", "Gather", [x(), k(-1, I64)], {"axis": 1})
case("Gather_nonnegative", "Gather", [x(), k([1, 0, 1], I64)])
case("Gather_runtime_indices", "Gather", [x(), x(2, 3, dtype=I64, gen=index_in("seq"))], {"axis": 1})
case("Gather_runtime_int32", "Gather", [x(), x(5, dtype=I32, gen=index_in(4))], {"axis": -1})
case("Gather_runtime_scalar", "Gather", [x(), x(shape=(), dtype=I64, gen=index_in("batch"))])
case("Gather_int64_data", "Gather", [x("batch", 6, dtype=I64), k([1, -2], I64)], {"axis": 1})
case("GatherElements", "GatherElements", [x("batch", "seq"), x("batch", 3, dtype=I64, gen=index_in("seq"))],
     {"axis": 1})
case("GatherElements_const_dynamic_axis", "GatherElements", [x("batch", 4), k([[0, -1, 1, -2]], I64)], {"axis": 0})
case("GatherElements_const_static_axis", "GatherElements", [x("batch", 4), k([[0, -1, 2], [-4, 1, 3]], I64)],
     {"axis": 1}, dims=({"batch": 2}, {"batch": 3}))
case("GatherElements_axis_last_static", "GatherElements", [x(), x("batch", "seq", 2, dtype=I64, gen=index_in(4))],
     {"axis": -1})
case("GatherND", "GatherND", [x("batch", 4, 5), k([[0, 1], [1, 3]], I64)])
case("GatherND_runtime", "GatherND", [x("batch", 4, 5), x(3, 1, dtype=I64, gen=index_in("batch", False))])
case("GatherND_full", "GatherND", [x("batch", 4), x("seq", 2, dtype=I64, gen=lambda r, s, d: np.stack(
    [r.integers(0, d["batch"], s[0]), r.integers(0, 4, s[0])], 1))])
case("ScatterND", "ScatterND", [x("batch", 4), k([[1], [0]], I64), x(2, 4)])
case("ScatterND_no_indices", "ScatterND", [x("batch", 4), k(np.zeros((0, 1)), I64), x(0, 4)])  # updates nothing
case("ScatterND_elements", "ScatterND", [x("batch", 4, dtype=I64), k([[0, 1], [1, 3], [0, 0]], I64),
                                         x(3, dtype=I64)])
case("ScatterND_runtime_indices", "ScatterND", [x("batch", "seq", 4), x(1, 1, dtype=I64, gen=index_in("batch", False)),
                                                x(1, "seq", 4)])
case("ScatterElements", "ScatterElements", [x("batch", 4), k([[1, 0, 3], [2, 2, 0]], I64), x(2, 3)], {"axis": 1})
case("ScatterElements_negative", "ScatterElements", [x("batch", 4), k([[-1, 0, 3]], I64), x(1, 3)], {"axis": 1})
case("ScatterElements_add", "ScatterElements", [x("batch", 4), k([[1, 1, 3], [0, 0, 0]], I64), x(2, 3)],
     {"axis": 1, "reduction": "add"}, opset=18)
case("ScatterElements_axis0", "ScatterElements", [x("batch", 4), k([[1, 0, 1, 0]], I64), x(1, 4)], {"axis": 0})
for _value, _dt in ((None, None), (1, I64), (2.5, F32), (True, BOOL)):
    _attrs = {} if _value is None else {"value": numpy_helper.from_array(np.array([_value], _dt))}
    graph_case(f"ConstantOfShape_{'default' if _value is None else np.dtype(_dt).name}", "ConstantOfShape",
               [node("Shape", ["x"], ["s"]), node("ConstantOfShape", ["s"], ["y"], **_attrs)],
               [x(name="x")])
graph_case("ConstantOfShape_partial_shape", "ConstantOfShape",
           [node("Shape", ["x"], ["s"], start=1), node("ConstantOfShape", ["s"], ["y"],
                                                        value=numpy_helper.from_array(np.array([-3.0], F32)))],
           [x(name="x")], opset=15)
_range_int = x(shape=(), dtype=I64, name="start", gen=lambda r, s, d: r.integers(-3, 3))
case("Range_int64", "Range", [_range_int, x(shape=(), dtype=I64, gen=lambda r, s, d: r.integers(5, 12)),
                              x(shape=(), dtype=I64, gen=lambda r, s, d: r.integers(1, 4))])
case("Range_int64_negative_delta", "Range", [x(shape=(), dtype=I64, gen=lambda r, s, d: r.integers(5, 12)),
                                             x(shape=(), dtype=I64, gen=lambda r, s, d: r.integers(-3, 3)),
                                             k(-2, I64)])
case("Range_float", "Range", [x(shape=(), gen=lambda r, s, d: r.uniform(-2, 0)),
                              x(shape=(), gen=lambda r, s, d: r.uniform(1, 4)), k(0.25, F32)])
case("Range_int32", "Range", [k(0, I32), x(shape=(), dtype=I32, gen=lambda r, s, d: r.integers(3, 9)), k(1, I32)])
graph_case("Range_from_shape", "Range",
           [node("Shape", ["x"], ["s"], start=1, end=2), node("Squeeze", ["s", "zero"], ["n"]),
            node("Range", ["zero_s", "n", "one_s"], ["y"])],
           [x(name="x")], {"zero": np.array([0], I64), "zero_s": np.array(0, I64), "one_s": np.array(1, I64)},
           opset=15)
for _excl, _rev in ((0, 0), (1, 0), (0, 1), (1, 1)):
    case(f"CumSum_exclusive{_excl}_reverse{_rev}", "CumSum", [x(), k(1, I64)], {"exclusive": _excl, "reverse": _rev})
case("CumSum_negative_axis", "CumSum", [x(), k([-1], I64)])
case("CumSum_int64", "CumSum", [x(dtype=I64), k(0, I64)], {"exclusive": 1})
case("CumSum_int32_axis", "CumSum", [x(), k(2, I32)], {"reverse": 1})
case("Trilu_upper", "Trilu", [x("batch", "seq", 4)])
case("Trilu_lower_k1", "Trilu", [x("batch", "seq", 4), k(1, I64)], {"upper": 0})
case("Trilu_upper_k_negative", "Trilu", [x("batch", "seq", 4), k(-1, I64)])
case("Trilu_int64", "Trilu", [x("batch", 3, 3, dtype=I64), k(1, I64)], {"upper": 1})
case("Pad_constant", "Pad", [x(), k([0, 1, 2, 0, 2, 1], I64), k(1.5, F32)], {"mode": "constant"})
case("Pad_constant_default", "Pad", [x(), k([1, 0, 0, 0, 0, 3], I64)])
case("Pad_constant_int64", "Pad", [x(dtype=I64), k([0, 0, 1, 0, 0, 1], I64), k(-7, I64)])
case("Pad_reflect", "Pad", [x("batch", 3, "h", "w"), k([0, 0, 1, 2, 0, 0, 2, 1], I64)], {"mode": "reflect"})
case("Pad_reflect_last", "Pad", [x(), k([0, 0, 2, 0, 0, 3], I64)], {"mode": "reflect"})
case("Pad_edge", "Pad", [x("batch", 3, "h", "w"), k([0, 0, 2, 1, 0, 0, 1, 3], I64)], {"mode": "edge"})
case("Pad_axes", "Pad", [x(), k([1, 2], I64), k(0.5, F32), k([-2], I64)], opset=18)
case("Pad_axes_reflect", "Pad", [x(), k([1, 2, 0, 1], I64), None, k([2, 1], I64)], {"mode": "reflect"}, opset=18)
case("Pad_wrap", "Pad", [x("batch", 3, "h", "w"), k([0, 0, 1, 2, 0, 0, 2, 1], I64)], {"mode": "wrap"}, opset=19)
case("Pad_zero", "Pad", [x(), k([0, 0, 0, 0, 0, 0], I64)])
case("Pad_negative", "Pad", [x("batch", "seq", 6), k([0, 1, -1, 0, 0, -2], I64)])
case("Identity", "Identity", [x()])
case("Dropout", "Dropout", [x()], opset=13)
case("Dropout_mask", "Dropout", [x()], n_out=2, opset=13)
case("Dropout_ratio", "Dropout", [x(), k(0.3, F32), k(False, BOOL)], n_out=2, opset=13)

# --- nn ------------------------------------------------------------------------------------------------------


def weights(*shape, seed=0):
    return np.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.5, F32)


IMG = ("batch", 3, "h", "w")
case("Conv2d_bias_pads_strides", "Conv", [x(*IMG), k(weights(4, 3, 3, 3)), k(weights(4, seed=1))],
     {"pads": [1, 1, 1, 1], "strides": [2, 2]})
case("Conv2d_dilations_asymmetric_pads", "Conv", [x(*IMG), k(weights(5, 3, 3, 2))],
     {"pads": [0, 1, 2, 0], "dilations": [2, 1]})
case("Conv2d_groups", "Conv", [x(*IMG), k(weights(6, 1, 3, 3)), k(weights(6, seed=1))],
     {"group": 3, "pads": [1, 1, 1, 1]})
case("Conv2d_groups_dilations_strides", "Conv", [x("batch", 4, "h", "w"), k(weights(4, 2, 2, 3))],
     {"group": 2, "strides": [1, 2], "dilations": [2, 2], "kernel_shape": [2, 3]})
case("Conv2d_same_upper_static", "Conv", [x("batch", 3, 7, 8), k(weights(4, 3, 3, 3)), k(weights(4, seed=1))],
     {"auto_pad": "SAME_UPPER", "strides": [2, 2]})
case("Conv2d_same_lower_static", "Conv", [x("batch", 3, 7, 8), k(weights(4, 3, 4, 4))],
     {"auto_pad": "SAME_LOWER", "strides": [2, 1]})
case("Conv2d_same_upper_dynamic_stride1", "Conv", [x(*IMG), k(weights(4, 3, 3, 2))], {"auto_pad": "SAME_UPPER"})
case("Conv2d_valid", "Conv", [x(*IMG), k(weights(4, 3, 3, 3))], {"auto_pad": "VALID", "strides": [2, 1]})
case("Conv2d_runtime_weights", "Conv", [x(*IMG), x(4, 3, 2, 2), x(4)], {"pads": [1, 0, 0, 1]})
case("Conv2d_opset11", "Conv", [x(*IMG), k(weights(2, 3, 3, 3))], {"pads": [1, 1, 1, 1]}, opset=11)
case("Conv1d", "Conv", [x("batch", 2, "w"), k(weights(3, 2, 3)), k(weights(3, seed=1))],
     {"pads": [1, 1], "strides": [2], "dilations": [2]})
case("Conv1d_groups_same_upper", "Conv", [x("batch", 4, "w"), k(weights(4, 2, 3))],
     {"group": 2, "auto_pad": "SAME_UPPER"})
case("Conv3d", "Conv", [x("batch", 2, "h", 4, "w"), k(weights(3, 2, 2, 2, 2)), k(weights(3, seed=1))],
     {"pads": [1, 0, 1, 0, 1, 0]})
case("MaxPool", "MaxPool", [x(*IMG)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
case("MaxPool_ceil", "MaxPool", [x(*IMG)], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1})
case("MaxPool_ceil_pads", "MaxPool", [x(*IMG)], {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 0, 1, 1],
                                                  "ceil_mode": 1})
case("MaxPool_dilations", "MaxPool", [x(*IMG)], {"kernel_shape": [2, 2], "dilations": [2, 2]})
case("MaxPool_dilations_pads_ceil", "MaxPool", [x(*IMG)],
     {"kernel_shape": [3, 3], "dilations": [2, 1], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1})
case("MaxPool_dilations_asymmetric_pads", "MaxPool", [x(*IMG)], {"kernel_shape": [3, 2], "dilations": [1, 2],
                                                                 "pads": [2, 0, 0, 1]})
case("MaxPool_asymmetric_pads", "MaxPool", [x(*IMG)], {"kernel_shape": [3, 2], "pads": [0, 1, 2, 0]})
case("MaxPool_same_upper", "MaxPool", [x("batch", 3, 7, 8)], {"kernel_shape": [3, 3], "strides": [2, 2],
                                                              "auto_pad": "SAME_UPPER"})
case("MaxPool_negative_inputs", "MaxPool", [x(*IMG, gen=lambda r, s, d: -r.uniform(1, 2, s))],
     {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]})
case("AveragePool", "AveragePool", [x(*IMG)], {"kernel_shape": [3, 3], "strides": [2, 2]})
case("AveragePool_pads_exclude", "AveragePool", [x(*IMG)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]})
case("AveragePool_pads_include", "AveragePool", [x(*IMG)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1],
                                                            "count_include_pad": 1})
case("AveragePool_asymmetric_include", "AveragePool", [x(*IMG)], {"kernel_shape": [2, 3], "pads": [0, 1, 1, 2],
                                                                  "count_include_pad": 1})
case("AveragePool_asymmetric_exclude", "AveragePool", [x(*IMG)], {"kernel_shape": [2, 3], "pads": [0, 1, 1, 2]})
case("AveragePool_ceil_pads_include", "AveragePool", [x(*IMG)],
     {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 1})
case("AveragePool_ceil_pads_exclude", "AveragePool", [x(*IMG)],
     {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1})
case("AveragePool_same_upper", "AveragePool", [x("batch", 3, 7, 8)],
     {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"})
case("GlobalAveragePool", "GlobalAveragePool", [x(*IMG)])
case("GlobalAveragePool_1d", "GlobalAveragePool", [x("batch", 3, "w")])
case("GlobalMaxPool", "GlobalMaxPool", [x(*IMG)])
_bn = [k(np.array([1.0, 0.5, -2.0], F32)), k(np.array([0.1, 0.0, -0.3], F32)), k(np.array([0.2, -1.0, 0.5], F32)),
       k(np.array([1.0, 0.25, 4.0], F32))]
case("BatchNormalization", "BatchNormalization", [x(*IMG), *_bn], opset=15)
case("BatchNormalization_rank3", "BatchNormalization", [x("batch", 3, "w"), *_bn], {"epsilon": 1e-3}, opset=15)
case("BatchNormalization_runtime_params", "BatchNormalization",
     [x(*IMG), x(3), x(3), x(3), x(3, gen=positive)], opset=15)
case("LayerNormalization", "LayerNormalization", [x("batch", "seq", 8), k(weights(8)), k(weights(8, seed=1))])
case("LayerNormalization_axis_m2", "LayerNormalization", [x("batch", 5, 4), k(weights(5, 4)), k(weights(5, 4, seed=1))],
     {"axis": -2, "epsilon": 1e-3})
case("LayerNormalization_no_bias", "LayerNormalization", [x("batch", "seq", 8), k(weights(8))])
case("LayerNormalization_fp16", "LayerNormalization", [x("batch", "seq", 8, dtype=F16),
                                                       k(weights(8).astype(F16)), k(weights(8, seed=1).astype(F16))],
     atol=2e-3, rtol=2e-3)
case("RMSNormalization", "RMSNormalization", [x("batch", "seq", 8), k(weights(8))], opset=23)
case("RMSNormalization_axis_m2", "RMSNormalization", [x("batch", 5, 4), k(weights(5, 4))],
     {"axis": -2, "epsilon": 1e-3}, opset=23)
case("RMSNormalization_fp16", "RMSNormalization", [x("batch", "seq", 8, dtype=F16), k(weights(8).astype(F16))],
     opset=23, atol=2e-3, rtol=2e-3)

# --- linalg --------------------------------------------------------------------------------------------------

case("Gemm_linear", "Gemm", [x("batch", 4), k(weights(5, 4)), k(weights(5, seed=1))], {"transB": 1})
case("Gemm_linear_no_bias", "Gemm", [x("batch", 4), k(weights(5, 4))], {"transB": 1})
case("Gemm_linear_beta0", "Gemm", [x("batch", 4), k(weights(5, 4)), k(weights(5, seed=1))], {"transB": 1, "beta": 0.0})
case("Gemm_plain", "Gemm", [x("batch", 4), k(weights(4, 5)), k(weights(5, seed=1))])
case("Gemm_transA_alpha_beta", "Gemm", [x(4, "batch"), k(weights(4, 5)), k(weights(1, 5, seed=1))],
     {"transA": 1, "alpha": 0.5, "beta": 2.0})
case("Gemm_transA_transB", "Gemm", [x(4, "batch"), k(weights(5, 4)), k(weights(seed=1))],
     {"transA": 1, "transB": 1, "alpha": 2.0, "beta": -1.0})
case("Gemm_linear_alpha", "Gemm", [x("batch", 4), k(weights(5, 4)), k(weights(5, seed=1))],
     {"transB": 1, "alpha": 0.25, "beta": 0.5})
case("Gemm_runtime_c", "Gemm", [x("batch", 4), x(4, 3), x("batch", 3)], {"beta": 0.5})
case("MatMul_batch_broadcast", "MatMul", [x("batch", 1, "seq", 4), x(3, 4, 5)])
case("MatMul_same_batch", "MatMul", [x("batch", "seq", 4), x("batch", 4, "seq")])
case("MatMul_2d_weight", "MatMul", [x("batch", "seq", 4), k(weights(4, 6))])
# Weights above PARAM_MIN_ELEMENTS read only by MatMuls are stored [out, in] and lowered to ops.dense.
case("MatMul_dense_weight_3d", "MatMul", [x("batch", "seq", 16), k(weights(16, 8))])
case("MatMul_dense_weight_2d", "MatMul", [x("batch", 16), k(weights(16, 8))])
case("MatMul_1d_left", "MatMul", [x(4), x("batch", 4, 5)])
case("MatMul_1d_right", "MatMul", [x("batch", "seq", 4), x(4)])
case("MatMul_1d_both", "MatMul", [x("seq"), x("seq")])


# opset 23 Attention (4-D, GQA, causal, masks; what fuse-attention does not fuse lowers here). A random bool
# mask leaves some query rows without keys: onnxruntime outputs 0 there, and so must the lowering.
case("Attention_gqa_causal", "Attention", [x("batch", 4, "seq", 16), x("batch", 2, "seq", 16),
                                           x("batch", 2, "seq", 16)], {"is_causal": 1}, opset=23)
case("Attention_bool_mask", "Attention", [x("batch", 2, "seq", 16), x("batch", 2, "seq", 16),
                                          x("batch", 2, "seq", 16), x("batch", 1, "seq", "seq", dtype=BOOL)],
     {"scale": 0.3}, opset=23)
case("Attention_float_mask", "Attention", [x("batch", 2, "seq", 16), x("batch", 2, "seq", 16),
                                           x("batch", 2, "seq", 16), x("batch", 2, "seq", "seq")], opset=23)


# --- conformance-driven handlers (graphconv conformance: docs/conformance.md) ---------------------------------

I8 = np.int8
IMG_S = ("batch", 3, 7, 8)  # static spatial dims: the window pooling and resampling handlers need them


def _subgraph(name, nodes, inputs, outputs):
    """A Loop/Scan/If body: inputs and outputs as (name, numpy dtype, shape)."""
    def vi(n, dt, shape):
        return oh.make_tensor_value_info(n, oh.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
    return oh.make_graph(nodes, name, [vi(*i) for i in inputs], [vi(*o) for o in outputs])


# losses
_class_weights = k(np.abs(weights(5)) + 0.5)
case("NegativeLogLikelihoodLoss_mean_weight_ignore", "NegativeLogLikelihoodLoss",
     [x("batch", 5, 3), x("batch", 3, dtype=I64, gen=ints(0, 5)), _class_weights], {"ignore_index": 1}, opset=13)
case("NegativeLogLikelihoodLoss_none_2d", "NegativeLogLikelihoodLoss",
     [x("batch", 5), x("batch", dtype=I64, gen=ints(0, 5))], {"reduction": "none"}, opset=13)
case("SoftmaxCrossEntropyLoss_sum_log_prob", "SoftmaxCrossEntropyLoss",
     [x("batch", 5, 2, 3), x("batch", 2, 3, dtype=I64, gen=ints(0, 5))], {"reduction": "sum"}, n_out=2, opset=13)
case("SoftmaxCrossEntropyLoss_mean_weight_ignore_negative", "SoftmaxCrossEntropyLoss",
     [x("batch", 5), x("batch", dtype=I64, gen=ints(-1, 5)), _class_weights], {"ignore_index": -1}, opset=13)

# Resize (11: scales or sizes; 18: axes, antialias, keep_aspect_ratio_policy; 19: half_pixel_symmetric)
case("Resize_linear_scales", "Resize", [x(2, 3, 4, 5), k(np.zeros(0, F32)), k([1, 1, 2.0, 1.5], F32)],
     {"mode": "linear"}, opset=13)
case("Resize_nearest_sizes_asymmetric", "Resize", [x(2, 3, 4, 5), None, None, k([2, 3, 7, 3], I64)],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, opset=13)
# align_corners with a whole output length: where scale * size is fractional, the ONNX reference (and the node
# tests) divide by that fractional length and onnxruntime by the integer one; opmap follows the reference.
case("Resize_cubic_align_corners", "Resize", [x(1, 2, 5, 6), None, k([1, 1, 0.8, 1.5], F32)],
     {"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, opset=13)
case("Resize_cubic_antialias_axes", "Resize", [x(1, 2, 6, 7), None, k([0.6, 0.5], F32)],
     {"mode": "cubic", "antialias": 1, "axes": [2, 3]}, opset=18)
case("Resize_linear_not_larger", "Resize", [x(1, 2, 4, 6), None, None, k([7, 8], I64)],
     {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, opset=18)
case("Resize_tf_crop_and_resize", "Resize", [x(1, 1, 5, 6), k([0.1, 0.2, 0.9, 1.2], F32), None, k([4, 4], I64)],
     {"mode": "linear", "axes": [2, 3], "coordinate_transformation_mode": "tf_crop_and_resize",
      "extrapolation_value": 7.0}, opset=18)
case("Resize_half_pixel_symmetric", "Resize", [x(1, 2, 3, 4), None, k([1, 1, 2.3, 1.6], F32)],
     {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, opset=19)
# ... with a dynamic input shape: nearest upsampling by whole scales, each element repeated (YOLO's and
# PaddleOCR's detectors: opset 11-17, asymmetric + floor, roi empty or absent)
case("Resize_nearest_dynamic_asymmetric_floor", "Resize",
     [x("batch", 3, "h", "w"), k(np.zeros(0, F32)), k([1, 1, 2.0, 2.0], F32)],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, opset=11)
case("Resize_nearest_dynamic_half_pixel_ceil_3x2", "Resize", [x("batch", 2, "h", "w"), None, k([1, 1, 3.0, 2.0], F32)],
     {"mode": "nearest", "nearest_mode": "round_prefer_ceil"}, opset=13)
case("Resize_nearest_dynamic_pytorch_half_pixel_axes", "Resize", [x("batch", 2, "h", 5), None, k([4.0, 1.0], F32)],
     {"mode": "nearest", "coordinate_transformation_mode": "pytorch_half_pixel", "axes": [2, 3]}, opset=18)
case("Resize_nearest_dynamic_asymmetric_round_2x", "Resize", [x("batch", 2, "h", "w"), None, k([1, 1, 2.0, 1.0], F32)],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric"}, opset=13)

# RotaryEmbedding (batch 1: onnxruntime 1.32 fails at batch > 1)
_angles = np.arange(40).reshape(10, 4) * 0.3
_cos, _sin = k(np.cos(_angles).astype(F32)), k(np.sin(_angles).astype(F32))
case("RotaryEmbedding_position_ids", "RotaryEmbedding",
     [x(1, 2, 5, 8), _cos, _sin, x(1, 5, dtype=I64, gen=ints(0, 10))], opset=23)
case("RotaryEmbedding_3d_interleaved_partial", "RotaryEmbedding",
     [x(1, 5, 24), k(np.cos(_angles[:5]).astype(F32)[None]), k(np.sin(_angles[:5]).astype(F32)[None])],
     {"num_heads": 2, "interleaved": 1, "rotary_embedding_dim": 8}, opset=23)

# GridSample (16: 4-D bilinear/nearest/bicubic; 20: N-D linear/nearest/cubic) and AffineGrid
_grid = uniform(-1.3, 1.3)
case("GridSample_bilinear_border", "GridSample", [x("batch", 2, 4, 5), x("batch", 3, 4, 2, gen=_grid)],
     {"mode": "bilinear", "padding_mode": "border"}, opset=16)
case("GridSample_cubic_reflection_align", "GridSample", [x("batch", 2, 4, 5), x("batch", 3, 4, 2, gen=_grid)],
     {"mode": "cubic", "padding_mode": "reflection", "align_corners": 1}, opset=20)
case("GridSample_nearest_zeros_5d", "GridSample", [x("batch", 2, 3, 4, 5), x("batch", 2, 3, 2, 3, gen=_grid)],
     {"mode": "nearest"}, opset=20)
case("AffineGrid_2d", "AffineGrid", [x(2, 2, 3), k([2, 1, 4, 5], I64)], opset=20)
case("AffineGrid_3d_align_corners", "AffineGrid", [x(2, 3, 4), k([2, 1, 3, 4, 5], I64)], {"align_corners": 1}, opset=20)

# ConvTranspose
case("ConvTranspose_strides_pads_output_padding", "ConvTranspose",
     [x("batch", 2, 4, 5), k(weights(2, 3, 3, 3)), k(weights(3, seed=1))],
     {"strides": [2, 1], "pads": [1, 0, 0, 1], "output_padding": [1, 0]})
case("ConvTranspose_group_dilation", "ConvTranspose", [x("batch", 4, 4, 5), k(weights(4, 1, 2, 3))],
     {"group": 2, "dilations": [2, 1]})
case("ConvTranspose_1d_output_shape", "ConvTranspose", [x("batch", 2, 6), k(weights(2, 3, 3))],
     {"strides": [2], "output_shape": [13]})
case("ConvTranspose_3d_same_upper", "ConvTranspose", [x("batch", 1, 3, 4, 2), k(weights(1, 2, 2, 2, 2))],
     {"strides": [2, 2, 2], "auto_pad": "SAME_UPPER"})
# dynamic spatial dims (PaddleOCR's DB head upsamples by 2 x 2 kernels at stride 2)
case("ConvTranspose_dynamic_spatial_stride2", "ConvTranspose",
     [x("batch", 2, "h", "w"), k(weights(2, 3, 2, 2)), k(weights(3, seed=1))], {"strides": [2, 2]})
case("ConvTranspose_dynamic_1d_stride3_pads", "ConvTranspose", [x("batch", 2, "seq"), k(weights(2, 3, 4))],
     {"strides": [3], "pads": [1, 2], "output_padding": [1]})

# pooling beyond MindSpore's 2-D float primitives: window pooling
case("MaxPool_1d", "MaxPool", [x("batch", 3, 9)], {"kernel_shape": [3], "strides": [2]})
case("MaxPool_3d", "MaxPool", [x("batch", 2, 4, 5, 6)], {"kernel_shape": [2, 2, 2], "pads": [1, 0, 1, 0, 1, 0]})
case("MaxPool_indices", "MaxPool", [x(2, 3, 6, 7)], {"kernel_shape": [2, 2], "strides": [2, 2]}, n_out=2)
case("MaxPool_indices_column_major", "MaxPool", [x(2, 3, 5, 6)], {"kernel_shape": [3, 2], "pads": [1, 0, 1, 1],
                                                                 "storage_order": 1}, n_out=2)
case("MaxPool_uint8", "MaxPool", [x(*IMG_S, dtype=U8)], {"kernel_shape": [3, 3], "strides": [2, 2]})
case("MaxPool_large_pads", "MaxPool", [x(*IMG_S)], {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]})
case("MaxPool_dilated_ceil_asymmetric_pads", "MaxPool", [x(*IMG_S)],
     {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [0, 0, 1, 1], "ceil_mode": 1})
case("AveragePool_1d", "AveragePool", [x("batch", 3, 9)], {"kernel_shape": [3], "strides": [2], "pads": [1, 1]})
case("AveragePool_3d_include_pad", "AveragePool", [x("batch", 2, 4, 5, 6)],
     {"kernel_shape": [2, 3, 2], "pads": [1, 1, 0, 1, 1, 1], "count_include_pad": 1})
case("AveragePool_dilated_ceil", "AveragePool", [x(*IMG_S)],
     {"kernel_shape": [2, 2], "dilations": [2, 1], "strides": [2, 2], "ceil_mode": 1}, opset=19)
case("AveragePool_large_pads", "AveragePool", [x(*IMG_S)], {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]})
case("LpPool_p1_pads", "LpPool", [x(*IMG_S)], {"kernel_shape": [3, 2], "p": 1, "pads": [1, 0, 1, 1], "strides": [2, 1]})
case("LpPool_p2_ceil", "LpPool", [x(*IMG_S)], {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, opset=18)

# normalisations
case("InstanceNormalization", "InstanceNormalization", [x("batch", 3, "h", "w"), k(weights(3)), k(weights(3, seed=1))],
     {"epsilon": 1e-3})
case("GroupNormalization", "GroupNormalization", [x("batch", 4, "h", "w"), k(weights(4)), k(weights(4, seed=1))],
     {"num_groups": 2}, opset=21)
case("LRN", "LRN", [x("batch", 5, "h", "w")], {"size": 3, "alpha": 1e-2, "beta": 0.75, "bias": 2.0})
case("MeanVarianceNormalization", "MeanVarianceNormalization", [x("batch", 3, "h", "w")])
case("MeanVarianceNormalization_axes", "MeanVarianceNormalization", [x("batch", 3, "h", "w")], {"axes": [1, 3]})
case("LpNormalization_l1", "LpNormalization", [x()], {"axis": -1, "p": 1})
case("LpNormalization_l2_axis1", "LpNormalization", [x()], {"axis": 1, "p": 2})
case("BatchNormalization_training", "BatchNormalization", [x(*IMG), *_bn], {"training_mode": 1, "momentum": 0.8},
     n_out=3, opset=15)
case("LayerNormalization_mean_inv_std", "LayerNormalization", [x("batch", "seq", 8), k(weights(8))], {"axis": -1},
     n_out=3)

# small ops
case("Hardmax", "Hardmax", [x()])
case("Hardmax_ties_axis0", "Hardmax", [x(3, "seq", 4, gen=ints(0, 2))], {"axis": 0})
case("Shrink", "Shrink", [x()], {"bias": 0.5, "lambd": 0.8})
case("Det", "Det", [x("batch", 3, 3)])
case("EyeLike_k_int64", "EyeLike", [x(4, 5)], {"k": 1, "dtype": onnx.TensorProto.INT64})
case("CenterCropPad", "CenterCropPad", [x(6, 5, 3), k([4, 8], I64)], {"axes": [0, 1]}, opset=18)
case("NonZero", "NonZero", [x(3, 4, dtype=BOOL)])
case("Pow_int_base_float_exponent", "Pow", [x(dtype=I32, gen=ints(0, 5)), x(4, gen=uniform(0, 2))], opset=15)
case("Gemm_linear_2d_bias", "Gemm", [x("batch", 4), k(weights(5, 4)), k(weights(1, 5, seed=1))], {"transB": 1})
case("ReduceSum_empty_axis", "ReduceSum", [x(2, 0, 3), k([1], I64)], opset=13)
case("ReduceMax_empty_axis", "ReduceMax", [x(2, 0, 3), k([1], I64)], {"keepdims": 0}, opset=18)
case("ReduceMax_bool", "ReduceMax", [x(dtype=BOOL), k([-1], I64)], opset=20)
case("ReduceMin_bool", "ReduceMin", [x(dtype=BOOL), k([1], I64)], opset=20)
case("ArgMax_select_last_index", "ArgMax", [x(dtype=I64, gen=ints(0, 2))], {"axis": 1, "select_last_index": 1})
case("ArgMin_select_last_index", "ArgMin", [x(dtype=I64, gen=ints(0, 2))], {"axis": -1, "select_last_index": 1,
                                                                            "keepdims": 0})
case("GatherND_batch_dims", "GatherND", [x(2, 4, 5), k([[[0], [3]], [[1], [2]]], I64)], {"batch_dims": 1})
case("ScatterND_add_duplicates", "ScatterND", [x("batch", 4), k([[0], [0]], I64), x(2, 4)], {"reduction": "add"},
     opset=16)
case("ScatterND_mul", "ScatterND", [x("batch", 4), k([[1], [0], [1]], I64), x(3, 4)], {"reduction": "mul"}, opset=16)
case("ScatterND_max", "ScatterND", [x("batch", 4), k([[0, 1], [0, 1], [1, 3]], I64), x(3)], {"reduction": "max"},
     opset=18)
case("ScatterElements_mul", "ScatterElements", [x("batch", 4), k([[1, 1, 3], [0, 0, 0]], I64), x(2, 3)],
     {"axis": 1, "reduction": "mul"}, opset=18)
case("ScatterElements_min_negative", "ScatterElements", [x("batch", 4), k([[-1, 0, -1]], I64), x(1, 3)],
     {"axis": 1, "reduction": "min"}, opset=18)
case("Trilu_empty", "Trilu", [x(0, 3)])
case("Slice_runtime_two_axes", "Slice", [x(), x(2, dtype=I64, name="starts", gen=ints(0, 2)), k([2, 3], I64),
                                         k([1, 2], I64)])
case("CumSum_runtime_data_int32", "CumSum", [x(dtype=I32), k(1, I64)])


def _masked_rows(r, s, d):  # the first slice along the last axis is all -inf
    v = r.standard_normal(s)
    v[..., 0, :] = -np.inf
    return v


case("Softmax_all_neg_inf_row", "Softmax", [x(gen=_masked_rows)])

# Attention beyond the 4-D path (opmap/attention_general.py)
case("Attention_3d_gqa_past_present_causal", "Attention",
     [x(2, 4, 16), x(2, 6, 8), x(2, 6, 8), None, x(2, 1, 3, 8), x(2, 1, 3, 8)],
     {"q_num_heads": 2, "kv_num_heads": 1, "is_causal": 1}, n_out=3, opset=23)
case("Attention_softcap_qk_bias_output", "Attention", [x(2, 2, 4, 8), x(2, 2, 5, 8), x(2, 2, 5, 8), x(4, 5)],
     {"softcap": 2.0, "qk_matmul_output_mode": 2}, n_out=4, opset=23)
case("Attention_bool_mask_past_softmax_output", "Attention",
     [x(1, 2, 3, 8), x(1, 2, 4, 8), x(1, 2, 4, 8), x(3, 6, dtype=BOOL), x(1, 2, 2, 8), x(1, 2, 2, 8)],
     {"qk_matmul_output_mode": 3}, n_out=4, opset=23)
case("Attention_fp16", "Attention", [x(2, 2, 4, 8, dtype=F16), x(2, 2, 5, 8, dtype=F16), x(2, 2, 5, 8, dtype=F16)],
     {"is_causal": 1}, opset=23, atol=2e-3, rtol=2e-3)

# recurrent layers (7: no layout; 14: layout)
_seq = x(3, 2, 4)
case("RNN_bias_initial_h", "RNN", [_seq, k(weights(1, 5, 4)), k(weights(1, 5, 5, seed=1)), k(weights(1, 10, seed=2)),
                                   None, x(1, 2, 5)], {"hidden_size": 5}, n_out=2, opset=13)
# layout=1 (batch first) is covered by the node tests only: onnxruntime refuses it.
case("RNN_bidirectional_relu", "RNN", [_seq, k(weights(2, 5, 4)), k(weights(2, 5, 5, seed=1))],
     {"hidden_size": 5, "direction": "bidirectional", "activations": ["Relu", "Tanh"]}, n_out=2, opset=14)
case("GRU_linear_before_reset", "GRU", [_seq, k(weights(1, 15, 4)), k(weights(1, 15, 5, seed=1)),
                                        k(weights(1, 30, seed=2))],
     {"hidden_size": 5, "linear_before_reset": 1}, n_out=2, opset=13)
case("GRU_reverse", "GRU", [_seq, k(weights(1, 15, 4)), k(weights(1, 15, 5, seed=1)), k(weights(1, 30, seed=2))],
     {"hidden_size": 5, "direction": "reverse"}, n_out=2, opset=14)
case("LSTM_peepholes_seq_lens", "LSTM",
     [_seq, k(weights(1, 12, 4)), k(weights(1, 12, 3, seed=1)), k(weights(1, 24, seed=2)), k([3, 2], I32),
      x(1, 2, 3), x(1, 2, 3), k(weights(1, 9, seed=3))], {"hidden_size": 3}, n_out=3, opset=13)
case("LSTM_bidirectional_clip", "LSTM", [_seq, k(weights(2, 12, 4)), k(weights(2, 12, 3, seed=1))],
     {"hidden_size": 3, "direction": "bidirectional", "clip": 0.5}, n_out=3, opset=14)
# a dynamic batch (unrolled); an LSTM over a dynamic sequence (MindSpore's LSTM primitive, both seq sizes)
_dyn = x("seq", "batch", 4)
case("LSTM_dynamic_batch", "LSTM", [x(3, "batch", 4), k(weights(1, 12, 4)), k(weights(1, 12, 3, seed=1)),
                                    k(weights(1, 24, seed=2))], {"hidden_size": 3}, n_out=3, opset=14)
case("GRU_dynamic_batch", "GRU", [x(3, "batch", 4), k(weights(1, 15, 4)), k(weights(1, 15, 5, seed=1))],
     {"hidden_size": 5}, n_out=2, opset=14)
case("LSTM_dynamic_seq_bidirectional", "LSTM", [_dyn, k(weights(2, 12, 4)), k(weights(2, 12, 3, seed=1)),
                                                k(weights(2, 24, seed=2))],
     {"hidden_size": 3, "direction": "bidirectional"}, n_out=3, opset=14)
case("LSTM_dynamic_seq_reverse_initial_state", "LSTM",
     [_dyn, k(weights(1, 12, 4)), k(weights(1, 12, 3, seed=1)), None, None, x(1, "batch", 3), x(1, "batch", 3)],
     {"hidden_size": 3, "direction": "reverse"}, n_out=3, opset=14)

# spectral
case("DFT_real_onesided", "DFT", [x("batch", 8, 1)], {"axis": 1, "onesided": 1}, opset=17)
case("DFT_inverse_complex_length", "DFT", [x(2, 8, 2), k(10, I64), k(1, I64)], {"inverse": 1}, opset=20)
case("DFT_irfft", "DFT", [x(2, 5, 2), None, k(-2, I64)], {"inverse": 1, "onesided": 1}, opset=20)
_hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(16) / 16)).astype(F32)
case("STFT_window", "STFT", [x(2, 64, 1), k(8, I64), k(_hann), k(16, I64)], opset=17)
_size = x(shape=(), dtype=I32, gen=lambda r, s, d: 10, name="size")
case("HannWindow", "HannWindow", [_size], opset=17)
case("HammingWindow_symmetric", "HammingWindow", [_size], {"periodic": 0}, opset=17)
case("BlackmanWindow_double", "BlackmanWindow", [_size], {"output_datatype": onnx.TensorProto.DOUBLE}, opset=17)

# control flow
_then = _subgraph("then", [node("Add", ["x", "x"], ["t"])], [], [("t", F32, ["batch", "seq", 4])])
_else = _subgraph("else", [node("Mul", ["x", "x"], ["e"])], [], [("e", F32, ["batch", "seq", 4])])
graph_case("If_runtime_condition", "If", [node("If", ["c"], ["y"], then_branch=_then, else_branch=_else)],
           [x(name="x"), x(shape=(), dtype=BOOL, name="c", gen=lambda r, s, d: d["batch"] == 2)])
graph_case("If_constant_condition", "If",
           [node("Shape", ["x"], ["s"]), node("Size", ["s"], ["rank"]), node("Equal", ["rank", "three"], ["c"]),
            node("If", ["c"], ["y"], then_branch=_then, else_branch=_else)],
           [x(name="x")], {"three": np.array(3, I64)})
_body = _subgraph("body", [node("Identity", ["c_in"], ["c_out"]), node("Add", ["y_in", "x"], ["y_out"]),
                           node("Identity", ["y_out"], ["scan"])],
                  [("i", I64, []), ("c_in", BOOL, []), ("y_in", F32, ["batch", "seq", 4])],
                  [("c_out", BOOL, []), ("y_out", F32, ["batch", "seq", 4]), ("scan", F32, ["batch", "seq", 4])])
graph_case("Loop_constant_trip_count", "Loop", [node("Loop", ["m", "cond", "x"], ["y", "ys"], body=_body)],
           [x(name="x")], {"m": np.array(3, I64), "cond": np.array(True)}, outputs=("y", "ys"))
_scan_body = _subgraph("scan_body", [node("Add", ["s_in", "v"], ["s_out"]), node("Mul", ["s_out", "v"], ["o"])],
                       [("s_in", F32, [4]), ("v", F32, [4])], [("s_out", F32, [4]), ("o", F32, [4])])
graph_case("Scan_reverse_axis1", "Scan",
           [node("Scan", ["s0", "seq"], ["s", "outs"], body=_scan_body, num_scan_inputs=1,
                 scan_input_axes=[1], scan_input_directions=[1], scan_output_axes=[1])],
           [x(4, name="s0"), x(4, 5, name="seq")], outputs=("s", "outs"))

# quantization
case("QuantizeLinear_uint8", "QuantizeLinear", [x(gen=uniform(-5, 5)), k(0.05, F32), k(3, U8)], opset=13)
case("QuantizeLinear_per_axis_int8", "QuantizeLinear", [x("batch", 3, 4, gen=uniform(-5, 5)), k([0.1, 0.2, 0.05], F32),
                                                        k([0, 1, -2], I8)], {"axis": 1}, opset=19)
case("QuantizeLinear_int8_opset21", "QuantizeLinear", [x(gen=uniform(-2, 2)), k(0.02, F32), k(0, I8)], opset=21)
case("DequantizeLinear_uint8", "DequantizeLinear", [x(dtype=U8), k(0.05, F32), k(3, U8)], opset=13)
case("DequantizeLinear_per_axis", "DequantizeLinear", [x("batch", 3, 4, dtype=I8), k([0.1, 0.2, 0.05], F32),
                                                       k([0, 1, -2], I8)], {"axis": 1}, opset=19)
case("DequantizeLinear_opset21", "DequantizeLinear", [x(dtype=I8), k(0.5, F32)], opset=21)
case("QuantizeLinear_blocked", "QuantizeLinear", [x(4, 6, gen=uniform(-5, 5)), x(4, 3, name="scale", gen=positive)],
     {"axis": 1, "block_size": 2}, opset=21)
case("DequantizeLinear_blocked_last_block_short", "DequantizeLinear",
     [x(5, 4, dtype=U8), x(3, 4, name="scale", gen=positive), x(3, 4, name="zp", dtype=U8)],
     {"axis": 0, "block_size": 2}, opset=21)
case("DynamicQuantizeLinear", "DynamicQuantizeLinear", [x()], n_out=3)
case("MatMulInteger", "MatMulInteger", [x("batch", 4, dtype=U8), x(4, 3, dtype=U8), k(12, U8), k(3, U8)])
case("ConvInteger", "ConvInteger", [x("batch", 2, "h", "w", dtype=U8), x(3, 2, 2, 2, dtype=U8), k(5, U8)],
     {"pads": [1, 0, 0, 1]})
_q = [k(0.05, F32), k(2, I8)]
case("QLinearMatMul_int8", "QLinearMatMul", [x("batch", 4, dtype=I8), *_q, x(4, 3, dtype=I8), k(0.02, F32), k(-1, I8),
                                             k(0.01, F32), k(3, I8)])
case("QLinearMatMul_uint8_opset21", "QLinearMatMul",
     [x("batch", 4, dtype=U8), k(0.05, F32), k(2, U8), x(4, 3, dtype=U8), k(0.02, F32), k(100, U8), k(0.5, F32),
      k(128, U8)], opset=21)
case("QLinearConv_per_channel", "QLinearConv",
     [x("batch", 2, "h", "w", dtype=U8), k(0.05, F32), k(100, U8), x(3, 2, 2, 2, dtype=U8), k([0.01, 0.02, 0.03], F32),
      k([120, 128, 130], U8), k(0.8, F32), k(128, U8), k([5, -3, 0], I32)])

# text, detection
case("TfIdfVectorizer_tfidf_skips", "TfIdfVectorizer", [x(2, 8, dtype=I32, gen=ints(0, 4))],
     {"mode": "TFIDF", "min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 1, "ngram_counts": [0, 3],
      "ngram_indexes": [0, 1, 2, 3, 4], "pool_int64s": [1, 2, 3, 1, 2, 2, 3], "weights": [0.5, 1.0, 2.0, 1.5, 3.0]})
case("TfIdfVectorizer_idf_bigrams_1d", "TfIdfVectorizer", [x(9, dtype=I64, gen=ints(0, 3))],
     {"mode": "IDF", "min_gram_length": 2, "max_gram_length": 2, "max_skip_count": 2, "ngram_counts": [0, 2],
      "ngram_indexes": [1, 0, 3, 2], "pool_int64s": [0, 1, 0, 1, 2, 1]})


def _boxes(r, s, d):  # [y1, x1, y2, x2] with some corners swapped
    lo = r.uniform(0, 6, s[:-1] + (2,))
    hi = lo + r.uniform(0.5, 3, lo.shape)
    b = np.concatenate([lo, hi], -1)
    return np.where(r.random(s[:-1] + (1,)) < 0.3, b[..., [2, 3, 0, 1]], b)


case("NonMaxSuppression", "NonMaxSuppression", [x(2, 6, 4, gen=_boxes), x(2, 2, 6, gen=uniform(0, 1)), k([3], I64),
                                                k([0.3], F32), k([0.2], F32)])
case("NonMaxSuppression_center_no_threshold", "NonMaxSuppression",
     [x(1, 5, 4, gen=lambda r, s, d: np.concatenate([r.uniform(2, 6, (1, 5, 2)), r.uniform(1, 3, (1, 5, 2))], -1)),
      x(1, 1, 5, gen=uniform(0, 1)), k([5], I64), k([0.2], F32)], {"center_point_box": 1})
_rois = k([[0.0, 0.0, 5.0, 6.0], [1.5, 2.0, 7.0, 8.5], [2.0, 1.0, 4.0, 4.0]], F32)
case("RoiAlign_max_half_pixel", "RoiAlign", [x(2, 3, 8, 9), _rois, k([0, 1, 1], I64)],
     {"output_height": 3, "output_width": 2, "sampling_ratio": 2, "spatial_scale": 0.8, "mode": "max"}, opset=16)
case("RoiAlign_avg_opset13", "RoiAlign", [x(2, 3, 8, 9), _rois, k([1, 0, 1], I64)],
     {"output_height": 2, "output_width": 3, "sampling_ratio": 1}, opset=13)
case("DeformConv_mask_bias_groups", "DeformConv",
     [x(1, 4, 5, 6), k(weights(2, 2, 2, 2)), x(1, 16, 4, 5, gen=uniform(-1.5, 1.5)), k(weights(2, seed=1)),
      x(1, 8, 4, 5, gen=uniform(0, 1))], {"group": 2, "offset_group": 2}, opset=19)
case("DeformConv_strides_pads_dilations", "DeformConv",
     [x(1, 2, 6, 7), k(weights(3, 2, 2, 3)), x(1, 12, 3, 2, gen=uniform(-2, 2))],
     {"strides": [2, 2], "pads": [1, 0, 0, 1], "dilations": [1, 2]}, opset=19)

# MaxUnpool (indices from MaxPool) and Col2Im
graph_case("MaxUnpool", "MaxUnpool",
           [node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
            node("MaxUnpool", ["p", "i"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], [x(2, 3, 4, 6, name="x")])
# With output_shape larger than the inferred shape the ONNX reference (and the node test) scatter into the
# inferred shape and pad at the end, onnxruntime scatters into output_shape: covered by the node test only.
case("Col2Im", "Col2Im", [x("batch", 4, 12), k([4, 5], I64), k([2, 2], I64)], opset=18)
case("Col2Im_strides_pads_dilations", "Col2Im", [x("batch", 6, 9), k([5, 6], I64), k([2, 3], I64)],
     {"strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2]}, opset=18)


# --- TopK, OneHot (MoE routing; more in tests/test_moe.py) -------------------------------------------------

case("TopK_ties", "TopK", [x("batch", "seq", 6, gen=small_int), k([3], I64)], n_out=2)
case("TopK_smallest_axis1_int32", "TopK", [x("batch", "seq", 4, dtype=I32, gen=small_int), k([2], I64)],
     {"axis": 1, "largest": 0}, n_out=2)
case("OneHot", "OneHot", [x("batch", "seq", dtype=I64, gen=ints(-6, 6)), k(5, I64), k([0.0, 2.0], F32)],
     {"axis": 1})


# --- opset 24-28 definitions and the remaining conformance handlers -----------------------------------

I16, U16, U32, U64 = np.int16, np.uint16, np.uint32, np.uint64

case("Swish", "Swish", [x(gen=wide)], opset=24)
case("Swish_alpha", "Swish", [x(gen=wide)], {"alpha": 0.5}, opset=24)

# BitShift: amounts at or past the width (and, from opset 28, negative amounts and signed types) give what the
# sign extension alone gives.
case("BitShift_left_uint8_past_width", "BitShift", [x(dtype=U8), x(4, dtype=U8, gen=ints(0, 10))],
     {"direction": "LEFT"}, opset=11)
case("BitShift_right_uint32_past_width", "BitShift", [x(dtype=U32, gen=ints(0, 2 ** 32)),
                                                      x("seq", 1, dtype=U32, gen=ints(0, 40))],
     {"direction": "RIGHT"}, opset=11)
case("BitShift_right_uint16", "BitShift", [x(dtype=U16, gen=ints(0, 2 ** 16)), x(4, dtype=U16, gen=ints(0, 16))],
     {"direction": "RIGHT"}, opset=11)
case("BitShift_left_uint64_scalar", "BitShift", [x(dtype=U64, gen=ints(0, 2 ** 62)), k(3, U64)],
     {"direction": "LEFT"}, opset=11)
case("BitShift_right_int32_signed", "BitShift",
     [x(dtype=I32, gen=ints(-1000, 1000)), x(4, dtype=I32, gen=ints(-3, 40))],
     {"direction": "RIGHT"}, opset=28)
case("BitShift_left_int64_signed", "BitShift", [x(dtype=I64), x(4, dtype=I64, gen=ints(-2, 70))],
     {"direction": "LEFT"}, opset=28)
case("BitShift_right_int8_signed", "BitShift",
     [x(dtype=I8, gen=ints(-128, 128)), x("seq", 1, dtype=I8, gen=ints(-1, 10))],
     {"direction": "RIGHT"}, opset=28)

# BitCast between integer types of one width (a modular cast) and bool to an 8-bit integer
for _src, _dst in ((I32, U32), (U32, I32), (U8, I8), (I64, U64), (U16, I16), (I32, I32)):
    _info = np.iinfo(_src)
    case(f"BitCast_{np.dtype(_src).name}_{np.dtype(_dst).name}", "BitCast",
         [x(dtype=_src, gen=ints(int(_info.min), int(_info.max) + 1))],
         {"to": oh.np_dtype_to_tensor_dtype(np.dtype(_dst))}, opset=26)
for _dst in (U8, I8):
    case(f"BitCast_bool_{np.dtype(_dst).name}", "BitCast", [x(dtype=BOOL)],
         {"to": oh.np_dtype_to_tensor_dtype(np.dtype(_dst))}, opset=26,
         reference="onnxruntime 1.32 has no BitCast-26 kernel from bool")

for _excl, _rev in ((0, 0), (1, 0), (0, 1), (1, 1)):
    case(f"CumProd_exclusive{_excl}_reverse{_rev}", "CumProd", [x(gen=uniform(0.5, 1.5)), k(1, I64)],
         {"exclusive": _excl, "reverse": _rev}, opset=26)
case("CumProd_zeros_exclusive_negative_axis", "CumProd", [x(gen=with_zeros), k([-1], I64)], {"exclusive": 1},
     opset=26)
case("CumProd_int64_reverse", "CumProd", [x(dtype=I64, gen=small_int), k(0, I64)], {"reverse": 1}, opset=26)
case("CumProd_int32_axis_int32", "CumProd", [x(dtype=I32, gen=small_int), k(2, I32)], {"exclusive": 1}, opset=26)

# Range 27: float16 computed in stash_type and cast back; other types as at 11
_f16_start = x(shape=(), dtype=F16, gen=uniform(-2, 0), name="start")
case("Range_fp16_opset27", "Range", [_f16_start, x(shape=(), dtype=F16, gen=uniform(1, 4)), k(0.3, F16)], opset=27)
case("Range_fp16_stash_double", "Range", [_f16_start, x(shape=(), dtype=F16, gen=uniform(1, 4)), k(0.15, F16)],
     {"stash_type": onnx.TensorProto.DOUBLE}, opset=27)
case("Range_int64_opset27", "Range", [_range_int, x(shape=(), dtype=I64, gen=ints(5, 12)), k(2, I64)], opset=27)

# DepthToSpace / SpaceToDepth: static channels, symbolic batch and spatial dims
case("DepthToSpace_dcr", "DepthToSpace", [x("batch", 8, "h", "w")], {"blocksize": 2}, opset=13)
case("DepthToSpace_crd", "DepthToSpace", [x("batch", 8, "h", "w")], {"blocksize": 2, "mode": "CRD"}, opset=13)
case("DepthToSpace_static_block3", "DepthToSpace", [x(2, 18, 3, 4)], {"blocksize": 3, "mode": "CRD"}, opset=13)
_even = ({"batch": 2, "h": 4, "w": 6}, {"batch": 3, "h": 6, "w": 2})  # spatial dims divisible by the block
case("SpaceToDepth", "SpaceToDepth", [x("batch", 3, "h", "w")], {"blocksize": 2}, opset=13, dims=_even)
case("SpaceToDepth_crd_opset28", "SpaceToDepth", [x("batch", 3, "h", "w")], {"blocksize": 2, "mode": "CRD"},
     opset=28, dims=_even)
case("SpaceToDepth_dcr_opset28", "SpaceToDepth", [x("batch", 2, "h", "w")], {"blocksize": 2, "mode": "DCR"},
     opset=28, dims=_even)
case("SpaceToDepth_static_block3", "SpaceToDepth", [x(2, 2, 6, 9)], {"blocksize": 3}, opset=13)

# Einsum: the matmul pairs, the broadcast-multiply pairs, diagonals, sums, ellipsis, implicit output
EINSUMS = {
    "attention_scores": ("bhqd,bhkd->bhqk", [x("batch", 2, "seq", 8), x("batch", 2, "w", 8)]),
    "attention_values": ("bhqk,bhkd->bhqd", [x("batch", 2, "seq", "w"), x("batch", 2, "w", 8)]),
    "implicit_matmul": ("ij,jk", [x("batch", 4), x(4, "seq")]),
    "ellipsis_broadcast": ("...ij,...jk->...ik", [x("batch", 1, "seq", 4), x(1, 3, 4, 5)]),
    "ellipsis_lower_rank": ("...ij,jk->...ik", [x("batch", 2, "seq", 4), x(4, 5)]),
    "diagonal": ("ii->i", [x("seq", "seq")]),
    "trace_implicit": ("ii", [x("seq", "seq")]),
    "diagonal_with_label": ("iij->ji", [x("seq", "seq", 3)]),
    "sum_all": ("ij->", [x("batch", "seq")]),
    "outer": ("i,j->ij", [x("seq"), x("batch")]),
    "three_operands": ("ij,jk,kl->il", [x("batch", 3), x(3, 4), x(4, "seq")]),
    "rowwise_dot": ("bij,bij->bi", [x(), x()]),
    "two_contractions": ("bijk,bjkl->bil", [x("batch", "seq", 3, 2), x("batch", 3, 2, 4)]),
    "transpose": ("bij->bji", [x()]),
    "int64": ("ij,jk->ik", [x("batch", 4, dtype=I64), x(4, 3, dtype=I64)]),
}
for _name, (_eq, _args) in EINSUMS.items():
    case(f"Einsum_{_name}", "Einsum", _args, {"equation": _eq}, opset=12)

case("GlobalLpPool", "GlobalLpPool", [x(*IMG)])
case("GlobalLpPool_p1_1d", "GlobalLpPool", [x("batch", 3, "w")], {"p": 1})
case("GlobalLpPool_p3_3d", "GlobalLpPool", [x("batch", 2, "h", 4, "w")], {"p": 3})

# MaxRoiPool: [batch, x1, y1, x2, y2] rounded half away from zero (2.5 -> 3), a roi past the map (all bins empty)
_roi_pool = k([[0, 0, 0, 4, 5], [1, 1.5, 2, 6.5, 8.5], [1, 2.5, 0.5, 3, 2], [0, 20, 20, 30, 30]], F32)
case("MaxRoiPool", "MaxRoiPool", [x(*IMG), _roi_pool], {"pooled_shape": [2, 3]})
case("MaxRoiPool_scale_runtime_rois", "MaxRoiPool",
     [x(*IMG), x(3, 5, gen=lambda r, s, d: np.concatenate([r.integers(0, 2, (3, 1)), r.uniform(0, 4, (3, 2)),
                                                          r.uniform(4, 12, (3, 2))], 1))],
     {"pooled_shape": [3, 2], "spatial_scale": 0.8})

# Compress: with and without axis, a condition shorter than the axis, run-time conditions
case("Compress_axis1_runtime", "Compress", [x(), x("seq", dtype=BOOL)], {"axis": 1})
case("Compress_flat_short_condition", "Compress", [x(), x(5, dtype=BOOL)])
case("Compress_negative_axis_short_const", "Compress", [x("batch", "seq", 6), k([False, True, True, False])],
     {"axis": -1})
case("Compress_int64_axis0", "Compress", [x(dtype=I64), x("batch", dtype=BOOL)], {"axis": 0})
case("Compress_nothing_selected", "Compress", [x(), k([False, False])], {"axis": 1})


def _lens(r, s, d):  # a sequence length per batch entry, in [1, seq]
    return r.integers(1, d["seq"] + 1, s)


case("ReverseSequence_time_major", "ReverseSequence", [x("seq", "batch", 4), x("batch", dtype=I64, gen=_lens)])
case("ReverseSequence_batch_major_int64", "ReverseSequence",
     [x("batch", "seq", 4, dtype=I64), x("batch", dtype=I64, gen=_lens)], {"time_axis": 1, "batch_axis": 0})

# Unique: values, first indices, inverse indices, counts (sorted, or in order of first occurrence)
case("Unique_flat_sorted", "Unique", [x("batch", "seq", gen=ints(0, 5))], n_out=4)
case("Unique_flat_unsorted_int64", "Unique", [x("batch", "seq", dtype=I64, gen=ints(0, 5))], {"sorted": 0}, n_out=4)
case("Unique_axis0_sorted_dynamic", "Unique", [x("seq", 2, dtype=I64, gen=ints(0, 2))], {"axis": 0}, n_out=4)
case("Unique_axis1_unsorted_static", "Unique", [x("batch", 6, 2, gen=ints(0, 2))], {"axis": 1, "sorted": 0}, n_out=4)
case("Unique_negative_axis_values_only", "Unique", [x(2, "seq", gen=ints(0, 2))], {"axis": -1})
case("Unique_one_value", "Unique", [x("batch", "seq", dtype=I64, gen=ints(3, 4))], n_out=4)

# Optional values that hold a tensor (opset 18: OptionalGetElement and OptionalHasElement also take tensors)
_opt = node("Optional", ["x"], ["o"])
_where_has = [node("Neg", ["x"], ["nx"]), node("Where", ["h", "x", "nx"], ["y"])]
graph_case("Optional_get_element", "Optional", [_opt, node("OptionalGetElement", ["o"], ["e"]),
                                                node("Add", ["e", "x"], ["y"])], [x(name="x")], opset=18)
graph_case("OptionalGetElement_of_optional", "OptionalGetElement",
           [_opt, node("OptionalGetElement", ["o"], ["y"])], [x(name="x")], opset=18)
graph_case("OptionalGetElement_of_tensor", "OptionalGetElement", [node("OptionalGetElement", ["x"], ["y"])],
           [x(name="x")], opset=18)
graph_case("OptionalHasElement_of_optional", "OptionalHasElement",
           [_opt, node("OptionalHasElement", ["o"], ["h"]), *_where_has], [x(name="x")], outputs=("y", "h"),
           opset=18)
graph_case("OptionalHasElement_of_tensor", "OptionalHasElement", [node("OptionalHasElement", ["x"], ["h"]),
                                                                  *_where_has], [x(name="x")], opset=18)
graph_case("OptionalHasElement_absent", "OptionalHasElement", [node("OptionalHasElement", [], ["h"]), *_where_has],
           [x(name="x")], opset=18)


# --- opsets 24-28: KV-cache writes, gated activations, recurrent blocks (opmap/tensor_scatter.py, swiglu.py,
# linear_attention.py). onnxruntime 1.32 cannot run SwiGLU-28 (no kernel for the Swish-24 of its body): the ONNX
# reference is its oracle (_expected).
case("TensorScatter_linear_write_indices", "TensorScatter",
     [x("batch", 2, 6, 4), x("batch", 2, 2, 4), x("batch", dtype=I64, gen=ints(0, 5))], opset=24)
case("TensorScatter_circular_axis1", "TensorScatter",
     [x("batch", 5, 3), x("batch", 3, 3), x("batch", dtype=I64, gen=ints(0, 9))], {"mode": "circular", "axis": 1},
     opset=24)
case("TensorScatter_no_write_indices", "TensorScatter", [x("batch", 6, 4), x("batch", 2, 4)], opset=24)
def _kv_cache_update_case():
    """graphconv::KVCacheUpdate, the KV cache held in place, on a with-past graph rewritten by
    passes/stateful_cache.py: a call at past 0 (a prompt), whose value onnxruntime computes with the node's
    function body (the write into the zero cache, read back). Calls in a row, whose state onnxruntime cannot
    hold: tests/test_stateful_cache.py."""
    from passes import stateful_cache

    f32 = oh.np_dtype_to_tensor_dtype(np.dtype(F32))
    graph = oh.make_graph(
        [node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2),
         node("Mul", ["present.0.key", "two"], ["y"])], "kv",
        [oh.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"]),
         oh.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "seq"]),
         oh.make_tensor_value_info("new", f32, ["batch", 2, "seq", 4]),
         oh.make_tensor_value_info("past_key_values.0.key", f32, ["batch", 2, "past", 4])],
        [onnx.ValueInfoProto(name="y")], [numpy_helper.from_array(np.array(2.0, F32), "two")])
    model, _ = stateful_cache.make_stateful(oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET)]),
                                            max_batch=4, max_seq=8)
    rng = np.random.default_rng(0)
    feeds = [{"input_ids": np.zeros((d["batch"], d["seq"]), np.int64),
              "attention_mask": np.ones((d["batch"], d["seq"]), np.int64),
              "new": rng.standard_normal((d["batch"], 2, d["seq"], 4)).astype(F32)} for d in DIMS]
    CASES.append(Case("KVCacheUpdate", "KVCacheUpdate", OPSET, model, feeds, domain=stateful_cache.DOMAIN))


_kv_cache_update_case()


def _collective_cases():
    """graphconv::AllReduce and AllGather, the collectives of a tensor-parallel rank graph
    (graphconv/parallel/sharding.py), with their one-rank bodies. ops.AllReduce/AllGather need a communication
    group, which only msrun sets up: tests/test_tensor_parallel.py runs them there, on every rank."""
    from graphconv.parallel import sharding

    f32 = oh.np_dtype_to_tensor_dtype(np.dtype(F32))
    rng = np.random.default_rng(0)
    why = "needs a communication group (msrun): tests/test_tensor_parallel.py runs it under msrun"
    for op, attrs, function in (
            ("AllReduce", {}, sharding.all_reduce_function(OPSET)),
            ("AllGather", {"axis": 2}, sharding.all_gather_function(OPSET, 0, 2, [4, 4], 3))):
        graph = oh.make_graph([node(op, ["x"], ["y"], domain=sharding.DOMAIN, **attrs)], op,
                              [oh.make_tensor_value_info("x", f32, ["batch", "seq", 4])],
                              [onnx.ValueInfoProto(name="y")])
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET), oh.make_opsetid(sharding.DOMAIN, 1)],
                              functions=[function])
        feeds = [{"x": rng.standard_normal((d["batch"], d["seq"], 4)).astype(F32)} for d in DIMS]
        CASES.append(Case(op, op, OPSET, model, feeds, xfail=f"ops.{op} {why}", domain=sharding.DOMAIN))


_collective_cases()
case("Swish_alpha_0.7", "Swish", [x("batch", "seq", 4, gen=wide)], {"alpha": 0.7}, opset=24)
case("SwiGLU_alpha", "SwiGLU", [x("batch", "seq", 8, gen=wide), x("batch", "seq", 8)], {"alpha": 1.5}, opset=28)
case("LinearAttention_gated_delta_gqa_past", "LinearAttention",
     [x("batch", 3, 32), x("batch", 3, 16), x("batch", 3, 16), x("batch", 2, 8, 8, gen=uniform(-0.5, 0.5)),
      x("batch", 3, 16, gen=uniform(-0.5, 0.0)), x("batch", 3, 2, gen=uniform(0.0, 1.0))],
     {"q_num_heads": 4, "kv_num_heads": 2}, n_out=2, opset=27)
case("LinearAttention_linear", "LinearAttention", [x("batch", 2, 16), x("batch", 2, 16), x("batch", 2, 8)],
     {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear", "scale": 0.5}, n_out=2, opset=27)
case("CausalConvWithState_past_bias_silu", "CausalConvWithState",
     [x("batch", 4, "seq"), k(weights(4, 1, 3)), k(weights(4, seed=1)), x("batch", 4, 2)],
     {"activation": "silu"}, n_out=2, opset=27)
case("CausalConvWithState_no_state", "CausalConvWithState", [x("batch", 3, "seq"), k(weights(3, 1, 4))],
     n_out=2, opset=27)


# --- fused ops (domain `mindspore`) -------------------------------------------------------------------------

case("RmsNorm", "RmsNorm", [x("batch", "seq", 8), k(weights(8) + 1)], {"epsilon": 1e-5}, domain=fused.DOMAIN,
     xfail="ops.rms_norm has no CPU kernel (Ascend only); the fused graph's numbers are checked through its cpu "
           "twin in tests/test_fuse_rmsnorm.py")

case("LayerNorm_fused", "LayerNorm", [x("batch", "seq", 8), k(weights(8)), k(weights(8, seed=1))], {"epsilon": 1e-5},
     domain=fused.DOMAIN)
case("RotaryPositionEmbedding", "RotaryPositionEmbedding",
     [x("batch", 2, "seq", 8), x(1, 1, "seq", 8, gen=uniform(-1, 1)), x(1, 1, "seq", 8, gen=uniform(-1, 1))],
     {"mode": 0}, domain=fused.DOMAIN,
     xfail="ops.rotary_position_embedding has no CPU kernel (Ascend only)")
case("FlashAttentionScore", "FlashAttentionScore",
     [x("batch", 4, "seq", 16), x("batch", 2, "seq", 16), x("batch", 2, "seq", 16), k(0.0, F32), k(0.0, F32)],
     {"scale": 16 ** -0.5, "head_num": 4, "kv_head_num": 2, "mask_kind": "none",
      "input_layout": "BNSD", "sparse_mode": 0}, domain=fused.DOMAIN,
     xfail="ops.flash_attention_score has no CPU kernel (Ascend only)")
case("FusedInferAttentionScore", "FusedInferAttentionScore",
     [x("batch", 4, 1, 16), x("batch", 2, "seq", 16), x("batch", 2, "seq", 16), k(0.0, F32), k(0.0, F32)],
     {"scale": 16 ** -0.5, "head_num": 4, "kv_head_num": 2, "mask_kind": "none",
      "input_layout": "BNSD", "sparse_mode": 0}, domain=fused.DOMAIN,
     xfail="ops.fused_infer_attention_score has no CPU kernel (Ascend only); tests/test_cached_attention.py "
           "checks the cpu twin")

case("Gelu_fused", "Gelu", [x("batch", "seq", 8)], domain=fused.DOMAIN,
     xfail="GeluExt has no CPU kernel (Ascend only); tests/test_fuse_gelu.py checks the cpu twin")
case("GeluTanh_fused", "GeluTanh", [x("batch", "seq", 8)], domain=fused.DOMAIN)
case("SiLU_fused", "SiLU", [x("batch", "seq", 8)], domain=fused.DOMAIN)
case("FastGelu_fused", "FastGelu", [x("batch", "seq", 8)], domain=fused.DOMAIN)
case("Swiglu_fused", "Swiglu", [x("batch", "seq", 8)], {"dim": -1}, domain=fused.DOMAIN,
     xfail="Swiglu has no CPU kernel (Ascend only); tests/test_fuse_swiglu.py checks the cpu twin")
case("DynamicRNN_fused", "DynamicRNN", [x("seq", "batch", 4), k(weights(1, 12, 4)), k(weights(1, 12, 3, seed=1)),
                                        k(weights(1, 24, seed=2)), x(1, "batch", 3), x(1, "batch", 3)],
     {"hidden_size": 3, "direction": "forward"}, n_out=3, domain=fused.DOMAIN,
     xfail="DynamicRNN has no CPU kernel (Ascend only); tests/test_fuse_lstm.py and tests/test_compile.py check the "
           "cpu twin")
case("WeightQuantBatchMatmul_fused", "WeightQuantBatchMatmul",
     [x("batch", 64), k(np.random.default_rng(3).integers(-128, 128, (8, 32)), np.int8),
      k(np.random.default_rng(4).uniform(0.01, 0.1, (2, 8)), F32), k(np.full((2, 8), 8.0), F32)],
     {"antiquant_group_size": 32, "weight_bits": 4}, domain=fused.DOMAIN,
     xfail="WeightQuantBatchMatmul has no CPU kernel (Ascend only); tests/test_weight_quant_batch_matmul.py checks "
           "the cpu twin")
case("QuantV2_fused", "QuantV2",
     [x("batch", 8), k(np.random.default_rng(5).uniform(0.01, 0.1, 8), F32), k(np.full(8, 3), np.int8)],
     domain=fused.DOMAIN,
     xfail="QuantV2 has no CPU kernel (Ascend only); tests/test_quant_batch_matmul.py checks the cpu twin")
case("QuantBatchMatmul_fused", "QuantBatchMatmul",
     [x("batch", 32, dtype=np.int8, gen=lambda rng, shape, _d: rng.integers(-128, 128, shape)),
      k(np.random.default_rng(6).integers(-128, 128, (8, 32)), np.int8),
      k(np.random.default_rng(7).uniform(1e-4, 1e-3, 8), F32), k(np.arange(8) * 10, np.int32)],
     {"dtype": 1}, domain=fused.DOMAIN,
     xfail="QuantBatchMatmul has no CPU kernel (Ascend only); tests/test_quant_batch_matmul.py checks the cpu twin")
case("MoeGatingTopKSoftmax_fused", "MoeGatingTopKSoftmax", [x("batch", 8)], {"k": 2}, n_out=2, domain=fused.DOMAIN,
     xfail="MoeGatingTopKSoftmax has no CPU kernel (Ascend only); tests/test_moe.py checks the cpu twin")

# run-time steps (silero-vad's If branch): reversed along the dynamic axis, and a run-time start with step 2
graph_case("Slice_runtime_step_reverse", "Slice", [
    node("Shape", ["x"], ["s"], start=1, end=2), node("Div", ["s", "s"], ["one"]), node("Neg", ["one"], ["step"]),
    node("Slice", ["x", "minus_one", "very_negative", "axis1", "step"], ["y"])], [x(name="x")],
    {"minus_one": np.array([-1], I64), "very_negative": np.array([-INT64_MAX], I64), "axis1": np.array([1], I64)},
    opset=15)
graph_case("Slice_runtime_start_and_step", "Slice", [
    node("Shape", ["x"], ["s"], start=1, end=2), node("Div", ["s", "s"], ["one"]), node("Add", ["one", "one"], ["two"]),
    node("Slice", ["x", "one", "big", "axis1", "two"], ["y"])], [x(name="x")],
    {"big": np.array([INT64_MAX], I64), "axis1": np.array([1], I64)}, opset=15)

# --- refusals: what the lowering must reject with a clear UnsupportedError ------------------------------------

refusal("Squeeze_no_axes_dynamic", "without axes needs a fully static", "Squeeze", [x("batch", 1, 4)])
refusal("Slice_runtime_axes", "axes must be a constant", "Slice",
        [x(), k([0], I64), k([1], I64), x(1, dtype=I64, name="axes")])
refusal("Split_runtime_sizes_not_one_per_output", "3 outputs, but split sizes of shape", "Split",
        [x(), x(2, dtype=I64, name="sizes")], {"axis": 2}, n_out=3, opset=13)
refusal("Reduce_runtime_axes", "reduction axes must be a constant", "ReduceMean",
        [x(), x(1, dtype=I64, name="axes")], opset=18)
refusal("GRU_dynamic_seq", "the sequence length must be static", "GRU",
        [x("seq", "batch", 4), k(weights(1, 15, 4)), k(weights(1, 15, 5, seed=1))], {"hidden_size": 5}, n_out=2)
refusal("LSTM_dynamic_seq_clip", "only the default activations, no clip", "LSTM",
        [x("seq", "batch", 4), k(weights(1, 12, 4)), k(weights(1, 12, 3, seed=1))], {"hidden_size": 3, "clip": 1.0},
        n_out=3)
refusal("Conv_dynamic_weight_shape", "weight shape must be static", "Conv", [x(*IMG), x(4, 3, "k", "k")])
refusal("Conv_same_upper_dynamic_stride2", "static spatial dims", "Conv", [x(*IMG), k(weights(4, 3, 3, 3))],
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]})
refusal("Tile_runtime_repeats", "Tile repeats must be a constant", None, None, nodes=[
    node("Shape", ["x"], ["s"]), node("Tile", ["x", "s"], ["y"])], inputs=[x(name="x")])
refusal("Trilu_runtime_k", "Trilu k must be a constant", "Trilu", [x(), x(shape=(), dtype=I64, name="k")])
refusal("CumSum_runtime_axis", "CumSum axis must be a constant", "CumSum", [x(), x(shape=(), dtype=I64, name="axis")])
refusal("Unsqueeze_runtime_axes", "Unsqueeze axes must be a constant", "Unsqueeze",
        [x(), x(1, dtype=I64, name="axes")])
refusal("Pad_runtime_pads", "Pad pads must be a constant", "Pad", [x(), x(6, dtype=I64, name="pads")])
refusal("Cast_to_string", "STRING has no MindSpore equivalent", "Cast", [x()], {"to": onnx.TensorProto.STRING})
refusal("Softmax_opset11", "no lowering for Softmax at opset 11", "Softmax", [x()], opset=11)
refusal("Unknown_op", "no lowering for MelWeightMatrix", "MelWeightMatrix",
        [x(shape=(), dtype=I32), x(shape=(), dtype=I32), x(shape=(), dtype=I32), x(shape=()), x(shape=())])
refusal("Loop_runtime_trip_count", "trip count must be a compile-time constant", None, None,
        nodes=[node("Loop", ["m", "", "x"], ["y"], body=_body)],
        inputs=[x(name="x"), x(shape=(), dtype=I64, name="m")])
refusal("Resize_runtime_scales", "scales\\) must be a constant", "Resize",
        [x(1, 2, 4, 5), None, x(4, name="scales")], {"mode": "linear"}, opset=13)
refusal("Resize_dynamic_linear", "only nearest upsampling by whole scales.*mode linear", "Resize",
        [x("batch", 2, "h", "w"), None, k([1, 1, 2.0, 2.0], F32)], {"mode": "linear"}, opset=13)
refusal("Resize_dynamic_asymmetric_round_3x", "whole scales.*scales \\[1.0, 1.0, 3.0, 1.0\\]", "Resize",
        [x("batch", 2, "h", "w"), None, k([1, 1, 3.0, 1.0], F32)],
        {"mode": "nearest", "coordinate_transformation_mode": "asymmetric"}, opset=13)
refusal("Resize_dynamic_sizes", "sizes instead of scales", "Resize",
        [x("batch", 2, "h", "w"), None, None, k([1, 2, 8, 8], I64)], {"mode": "nearest"}, opset=13)
refusal("ConvTranspose_dynamic_output_shape", "output_shape or a SAME auto_pad needs static spatial", "ConvTranspose",
        [x("batch", 2, "seq"), k(weights(2, 3, 3))], {"strides": [2], "output_shape": [13]})
refusal("QuantizeLinear_int4", "INT4 is not supported", "QuantizeLinear",
        [x(4, 6), x(4, 3, name="scale", gen=positive)], {"axis": 1, "block_size": 2,
                                                          "output_dtype": onnx.TensorProto.INT4}, opset=21)
refusal("RNN_reverse_sequence_lens", "sequence_lens with a reverse direction", "RNN",
        [x(3, 2, 4), k(weights(1, 5, 4)), k(weights(1, 5, 5, seed=1)), None, k([3, 2], I32)],
        {"hidden_size": 5, "direction": "reverse"}, n_out=2)
refusal("RoiAlign_adaptive_sampling", "sampling_ratio=0", "RoiAlign", [x(1, 3, 8, 9), _rois, k([0, 0, 0], I64)],
        {"sampling_ratio": 0}, opset=16)
refusal("TfIdfVectorizer_strings", "string pools", "TfIdfVectorizer", [x(2, 8, dtype=I32)],
        {"mode": "TF", "min_gram_length": 1, "max_gram_length": 1, "max_skip_count": 0, "ngram_counts": [0],
         "ngram_indexes": [0], "pool_strings": ["a"]})

refusal("BitCast_float_bits", "cannot reinterpret float bits", "BitCast", [x()], {"to": onnx.TensorProto.INT32},
        opset=26)
refusal("Optional_empty", "an empty optional has no MindSpore value", None, None, nodes=[
    node("Optional", [], ["o"], type=oh.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)),
    node("OptionalHasElement", ["o"], ["h"]), node("Where", ["h", "x", "x"], ["y"])], inputs=[x(name="x")], opset=18)
refusal("DepthToSpace_dynamic_channels", "the channel dim must be static", "DepthToSpace", [x("batch", "c", 4, 4)],
        {"blocksize": 2}, opset=13)

# --- running -------------------------------------------------------------------------------------------------


def _lower_only(model: onnx.ModelProto):
    return lowering.lower(ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=True)))


def _expected(c: Case) -> list[list[np.ndarray]]:
    """onnxruntime's outputs; the ONNX reference's where the case says onnxruntime cannot run it
    (`reference`), where onnxruntime has no kernel for the op version (the oracle rule), and where the op
    multiplies integers (MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv): onnxruntime's u8s8 kernel
    saturates on x86 without VNNI, the ONNX reference's numpy products are exact."""
    if not c.reference and not integer_products.found(c.model):
        try:
            sess = ort.InferenceSession(c.model.SerializeToString(), providers=["CPUExecutionProvider"])
            return [sess.run(None, feed) for feed in c.feeds]
        except ort.capi.onnxruntime_pybind11_state.NotImplemented:
            pass
    ref = ReferenceEvaluator(c.model)
    return [ref.run(None, feed) for feed in c.feeds]


@pytest.fixture(scope="module")
def results() -> dict[str, RunResult]:
    out: dict[str, RunResult] = {}
    batch = []
    for c in CASES:
        # Lower here first: a handler that raises something other than a GraphconvError would abort the
        # whole batch in run_models; pin it on its case instead.
        try:
            _lower_only(c.model)
        except GraphconvError:
            pass  # run_models reports it as the case's error
        except Exception as e:  # noqa: BLE001 - a handler bug, reported by the case's test
            out[c.id] = RunResult(None, f"lowering crashed: {type(e).__name__}: {e}")
            continue
        batch.append(c)
    for c, r in zip(batch, run_isolating_crashes([(c.model, c.feeds) for c in batch])):
        out[c.id] = r
    return out


@pytest.mark.parametrize("c", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail, strict=True)]
                                            if c.xfail else []) for c in CASES])
def test_op(c: Case, results):
    res = results[c.id]
    assert res.error is None, f"{res.error}\n{res.source or ''}"
    expected = _expected(c)
    assert len(res.outputs) == len(c.feeds)
    for feed, actual, want in zip(c.feeds, res.outputs, expected):
        shapes = {k: v.shape for k, v in feed.items()}
        assert len(actual) == len(want), f"{len(actual)} outputs, onnxruntime gives {len(want)}"
        for j, (a, e) in enumerate(zip(actual, want)):
            where = f"output {j} at input shapes {shapes}"
            assert a.shape == e.shape, f"{where}: shape {a.shape} != onnxruntime {e.shape}\n{res.source}"
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != onnxruntime {e.dtype}\n{res.source}"
            cmp = compare(a, e, atol=c.atol, rtol=c.rtol)
            assert cmp.ok, f"{where}: {cmp.reason} (max_abs {cmp.max_abs:g})\n{res.source}"


def test_cases_run_at_two_shapes():
    for c in CASES:
        assert len(c.feeds) == 2, c.id
        symbolic = [i for i in c.model.graph.input
                    if any(d.dim_param for d in i.type.tensor_type.shape.dim)]
        if symbolic:
            shapes = [tuple(c.feeds[j][i.name].shape for i in symbolic) for j in range(2)]
            assert shapes[0] != shapes[1], c.id


@pytest.mark.parametrize("cid,model,match", [pytest.param(*r, id=r[0]) for r in REFUSALS])
def test_refusal(cid, model, match):
    with pytest.raises(UnsupportedError, match=match):
        _lower_only(model)


def test_every_handler_has_a_case():
    """Adding a handler (or a new since_version of one) without a case here fails."""
    covered = set()
    for c in CASES:
        h = opmap.lookup(c.domain, c.op, c.opset if not c.domain else
                         next(i.version for i in c.model.opset_import if i.domain == c.domain))
        assert h is not None, f"case {c.id}: no handler for {c.op} at opset {c.opset}"
        assert any(nd.op_type == c.op for nd in c.model.graph.node), f"case {c.id} has no {c.op} node"
        covered.add((h.domain, h.op_type, h.since_version))
    registered = {(h.domain, h.op_type, h.since_version) for h in opmap.registry.all_handlers()}
    missing = sorted(registered - covered)
    assert not missing, f"registered handlers without a case in tests/test_opmap.py: {missing}"


def test_dense_weights_are_those_only_matmuls_read():
    """graphconv.compiler.lowering.dense_weights: a 2-D weight read only as a MatMul's B is stored transposed for
    ops.dense; one that a Gather also reads (a tied embedding) stays as it is, and the source says which."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from graphconv.compiler import lowering
    from graphconv.compiler.program_ir import AttrValue

    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "e"], ["y"]),
             helper.make_node("Gather", ["e", "ids"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16]),
                                       helper.make_tensor_value_info("ids", TensorProto.INT64, ["m"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, ["m", 16])],
                          [numpy_helper.from_array(weights(16, 16), "w"),
                           numpy_helper.from_array(weights(16, 16), "e")])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])))
    assert {v.name for v in lowering.dense_weights(model.graph)} == {"w"}
    net, _ = lowering.lower(model)
    x_in = net.program.body.inputs[0]
    (dense,) = net.program.calls("ops.dense")
    data, w = dense.args
    assert data is x_in and isinstance(w, AttrValue)
    assert w.attr.param.onnx_name == "w" and w.attr.param.transposed and w.attr.shape == (16, 16)
    (mm,) = net.program.calls("ops.matmul")
    h, e = mm.args
    assert h is dense.outputs[0] and isinstance(e, AttrValue)
    assert e.attr.param.onnx_name == "e" and not e.attr.param.transposed
    assert [p.transposed for p in net.params] == [True, False]


def test_a_weight_read_through_a_cast_is_a_dense_weight(tmp_path):
    """A bf16 checkpoint exported with --dtype auto reads each weight through a Cast to fp32: the weight is
    stored transposed too, the Cast stays (on the transposed Parameter) and the MatMul is ops.dense, not
    ops.matmul (whose CPU kernel broadcasts the weight over the batch: graphconv.compiler.lowering.dense_weights).
    A Cast whose result something else reads too keeps its weight as it is. The compile verifies against
    onnxruntime at two shapes."""
    import ml_dtypes
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    import graphconv
    from graphconv.compiler import lowering

    rng = np.random.default_rng(0)
    bf16 = {k: numpy_helper.from_array(rng.normal(0, 0.2, shape).astype(ml_dtypes.bfloat16), k)
            for k, shape in (("w", (16, 24)), ("u", (24, 24)))}
    nodes = [helper.make_node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w32"], ["h"]),
             helper.make_node("Cast", ["u"], ["u32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["h", "u32"], ["y"]), helper.make_node("Neg", ["u32"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 24]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [24, 24])], list(bf16.values()))
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    assert {v.name for v in lowering.dense_weights(model.graph)} == {"w", "w32"}
    net, _ = lowering.lower(model)
    (dense,) = net.program.calls("ops.dense")
    (cast,) = [c for c in net.program.calls("ops.cast") if c.args[0].attr.param.onnx_name == "w"]
    assert dense.args[1] is cast.outputs[0]
    assert [(p.onnx_name, p.shape) for p in net.params if p.transposed] == [("w", (24, 16))]
    (mm,) = net.program.calls("ops.matmul")  # u32 is read by the Neg too
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    report = graphconv.compile(path, tmp_path / "m.mindir", target="cpu")
    assert report.status == "verified" and len(report.validation["cases"]) >= 2


@pytest.mark.parametrize("ctm", ["asymmetric", "half_pixel", "pytorch_half_pixel", "align_corners"])
@pytest.mark.parametrize("nearest_mode", ["floor", "ceil", "round_prefer_floor", "round_prefer_ceil"])
def test_whole_repeats_is_exactly_where_nearest_resize_repeats(ctm, nearest_mode):
    """opmap.resize.whole_repeats (what a Resize of a dynamic shape is lowered to) against onnx.reference's
    Resize on 1-D inputs of every length 1..16: where it gives s, every length's output is each element repeated
    s times; for a scale of 2..4 where it gives None, some length's is not."""
    from onnx.reference import ReferenceEvaluator

    from opmap.resize import whole_repeats

    def repeats_at_every_length(s: int) -> bool:
        graph = oh.make_graph([oh.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest",
                                            coordinate_transformation_mode=ctm, nearest_mode=nearest_mode)],
                              "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
                              [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(np.array([s], F32), "scales")])
        ref = ReferenceEvaluator(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)]))
        return all(np.array_equal(ref.run(None, {"x": np.arange(n, dtype=F32)})[0],
                                  np.repeat(np.arange(n, dtype=F32), s)) for n in range(1, 17))

    for s in (1, 2, 3, 4):
        said = whole_repeats("nearest", ctm, nearest_mode, float(s))
        assert said in (None, s)
        if said is not None or s > 1:
            assert (said == s) == repeats_at_every_length(s), (s, said)
