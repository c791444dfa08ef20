"""The program IR and its code generator (graphconv/compiler/program_ir.py, codegen.py) and the repeated-layer grouping
(graphconv/compiler/layers.py), on programs built by hand: assertions on IR nodes and on the generated source's
structure; the real exports' numbers are in tests/test_layers_real.py."""

from __future__ import annotations

import numpy as np

from graphconv.compiler import codegen, layers
from graphconv.compiler.program_ir import Attr, AttrValue, Body, Builder, Program, Ref, Value
from graphconv.compiler.lowering import ParamSpec
from opmap import helpers


def _program(build) -> Program:
    body = Body()
    b = Builder(body)
    x = Value(hint="x")
    body.inputs.append(x)
    body.outputs = list(build(b, x))
    return Program("Network", body)


def _construct(src: str) -> list[str]:
    lines = src.splitlines()
    start = max(i for i, line in enumerate(lines) if line.strip().startswith("def construct("))
    return [line.strip() for line in lines[start + 1:] if line.strip()]


def test_values_used_once_in_one_onnx_node_are_inline_and_dead_ones_dropped():
    def build(b, x):
        b.origin = "node_a"
        y = b.binop("*", 2, b.call("ops.sigmoid", x))
        b.call("ops.exp", x)  # nothing reads it
        b.origin = "node_b"
        z = b.call("ops.add", y, y)
        return [z]

    program = _program(build)
    src = codegen.render(program, helpers)
    body = _construct(src)
    assert body[0].endswith("= 2 * ops.sigmoid(x)")  # one statement for node_a, its inner call inline
    assert "ops.exp" not in src
    assert body[1].endswith(f"= ops.add({body[0].split(' = ')[0]}, {body[0].split(' = ')[0]})")
    assert body[-1].startswith("return ")


def test_literals_are_python_and_never_names():
    def build(b, x):
        b.origin = "n"
        return [b.call("ops.clamp", x, float("-inf"), 1e30, name="a'b", axes=(0, 1), dtype=Ref("ms.float16"))]

    src = codegen.render(_program(build), helpers)
    call = next(line for line in _construct(src) if "ops.clamp" in line)
    assert '-float("inf")' in call and "1e+30" in call and "name=\"a'b\"" in call and "axes=(0, 1)" in call
    assert "dtype=ms.float16" in call


def test_if_blocks_render_both_branches():
    def build(b, x):
        b.origin = "if0"
        with b.block() as then:
            then.outputs = [b.binop("+", x, 1)]
        with b.block() as orelse:
            orelse.outputs = [b.binop("-", x, 1)]
        (out,) = b.if_(b.call("ops.reduce_any", b.binop(">", x, 0)), then, orelse)
        return [out]

    body = _construct(codegen.render(_program(build), helpers))
    k = next(i for i, line in enumerate(body) if line.startswith("if "))
    assert body[k + 1].endswith("= x + 1") and body[k + 2] == "else:" and body[k + 3].endswith("= x - 1")


def _param_attr(name: str, shape=(4, 4)) -> AttrValue:
    spec = ParamSpec(name.replace(".", "_"), name, shape, "float32")
    return AttrValue(Attr(spec.attr, shape, "float32", param=spec))


def _layered(n_layers: int, odd: int | None = None) -> tuple[Program, dict[str, str]]:
    """x -> [mask from x, same in every layer] -> n layers h = dense(h, w_i) * mask (+ an extra op in
    layer `odd`) -> out."""
    scopes = layers.Scopes()

    def build(b, x):
        b.origin = "embed"
        scopes.nodes["embed"] = "model.embed"
        h = b.call("ops.relu", x)
        for i in range(n_layers):
            b.origin = f"/model/layers.{i}/mask"
            scopes.nodes[b.origin] = f"model.layers.{i}"
            mask = b.call("ops.less", x, 0.0)  # reads no layer value and no weight: computed once
            b.origin = f"/model/layers.{i}/proj"
            scopes.nodes[b.origin] = f"model.layers.{i}.proj"
            h = b.binop("*", b.call("ops.dense", h, _param_attr(f"model.layers.{i}.proj.weight")), mask)
            if i == odd:
                h = b.call("ops.neg", h)
        b.origin = "head"
        scopes.nodes["head"] = "lm_head"
        return [b.call("ops.dense", h, _param_attr("lm_head.weight"))]

    return _program(build), scopes


def test_identical_layers_become_one_class_and_shared_work_is_done_once():
    program, scopes = _layered(3)
    summary = layers.group(program, scopes).summary
    assert summary["layers"] == 3 and summary["classes"] == 1 and summary["grouped"] == 3
    assert summary["merged_shared_nodes"] == 2  # the mask of layers 1 and 2 is layer 0's
    (cell,) = program.cells
    assert [n.target for n in cell.body.nodes if n.kind == "call"] == ["ops.dense"]
    assert [a.param.name for a in cell.attrs] == ["model.layers.0.proj.weight"]
    (_, list_attr, instances) = program.instances[0]
    assert [[a.param.name for a in inst] for inst in instances] == [
        [f"model.layers.{i}.proj.weight"] for i in range(3)]
    top = program.body.nodes
    assert sum(n.kind == "cell" for n in top) == 3 and sum(n.target == "ops.less" for n in top) == 1
    src = codegen.render(program, helpers)
    assert src.count("class Layer(nn.Cell)") == 1 and "LAZY_INLINE = True" in src
    assert "Layer.__init__ = ms.lazy_inline(Layer.__init__)" in src
    assert "nn.CellList([" in src and "'model.layers.2.proj.weight'" in src


def test_a_layer_that_differs_stays_inline():
    program, scopes = _layered(3, odd=1)
    summary = layers.group(program, scopes).summary
    assert summary["grouped"] == 2 and summary["inline"] == [1]
    assert any(n.kind == "call" and n.target == "ops.neg" for n in program.body.nodes)


def test_without_scopes_or_layer_weights_nothing_is_grouped():
    def build(b, x):
        b.origin = "n"
        return [b.call("ops.dense", x, AttrValue(Attr("w", (4, 4), "float32", value=np.zeros((4, 4), np.float32))))]

    program = _program(build)
    summary = layers.group(program, layers.Scopes()).summary
    assert summary["grouped"] == 0 and "no node has a layer index" in summary["reason"]
    assert not program.cells


def test_record_scopes_reads_dynamo_metadata_and_torchscript_names():
    import onnx
    from onnx import helper

    dyn = helper.make_node("Relu", ["a"], ["b"], name="node_relu_3")
    entry = dyn.metadata_props.add()
    entry.key, entry.value = "namespace", (": top/model: LlamaForCausalLM/model.model.layers.3: LlamaDecoderLayer/"
                                           "model.model.layers.3.mlp: LlamaMLP/relu_3: aten.relu.default")
    ts = helper.make_node("Relu", ["b"], ["c"], name="/model/layers.5/self_attn/Relu")
    model = helper.make_model(helper.make_graph([dyn, ts], "g", [], []))
    scopes = layers.record_scopes(model)
    assert scopes.nodes == {"node_relu_3": "model.model.layers.3.mlp",
                            "/model/layers.5/self_attn/Relu": "model.layers.5.self_attn"}
    assert scopes.classes["model.model.layers.3"] == "LlamaDecoderLayer"
    assert layers.layer_of(scopes.get("node_relu_3")) == ("model.model.layers", 3)
    assert isinstance(model, onnx.ModelProto)


_PARAM_CHILD = """
import json, sys
import numpy as np
import ml_dtypes
from graphconv.compiler import codegen
from graphconv.compiler.program_ir import Body, Program
from opmap import helpers

# the generated module's preamble (its imports, _param_value, _param), run as the network runs it
preamble = codegen.render(Program("Network", Body()), helpers).split("class Network")[0]
env = {}
exec(compile(preamble, "network.py", "exec"), env)
ms, _param = env["ms"], env["_param"]
a = np.arange(12, dtype=np.float32).reshape(3, 4)
plain = _param({"w": a}, "w", (3, 4), ms.float32)
flipped = _param({"w": a}, "w", (4, 3), ms.float32, transposed=True)
frozen = a.copy()
frozen.flags.writeable = False
copied = _param({"w": frozen}, "w", (3, 4), ms.float32)
b16 = _param({"w": a.astype(ml_dtypes.bfloat16)}, "w", (3, 4), ms.bfloat16)
zeros = _param(None, "w", (3, 4), ms.float32)
print("RESULT " + json.dumps({
    "plain_equal": bool(np.array_equal(plain.asnumpy(), a)), "plain_shares": bool(np.shares_memory(plain.asnumpy(), a)),
    "flipped_equal": bool(np.array_equal(flipped.asnumpy(), a.T)),
    "frozen_equal": bool(np.array_equal(copied.asnumpy(), a)),
    "frozen_shares": bool(np.shares_memory(copied.asnumpy(), frozen)),
    "b16_equal": bool(np.array_equal(b16.asnumpy().astype(np.float32), a)),
    "zeros": bool(not zeros.asnumpy().any()) and list(zeros.shape) == [3, 4],
    "names": [p.name for p in (plain, flipped, copied, b16, zeros)],
    "requires_grad": [p.requires_grad for p in (plain, b16)]}))
"""


def test_generated_param_holds_the_weights_own_memory(tmp_path):
    """The generated `_param` (opmap/helpers.py, as codegen writes it into network.py) gives each Parameter
    its weight's values, and a writeable float weight's own memory (no copy: Parameter(tensor) would copy
    it); a read-only or bfloat16 array is copied once; without weights the Parameter is zeros."""
    import json
    import subprocess
    import sys

    from graphconv.runtime.child import child_env

    script = tmp_path / "param_child.py"
    script.write_text(_PARAM_CHILD)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got == {"plain_equal": True, "plain_shares": True, "flipped_equal": True, "frozen_equal": True,
                   "frozen_shares": False, "b16_equal": True, "zeros": True, "names": ["w"] * 5,
                   "requires_grad": [True, True]}


def test_empty_array_literals_keep_their_shape():
    """A constant of size 0 is written with its shape: [] would make a (0, 1) index array 1-D (Qwen 3.5's empty
    M-RoPE section reached TensorScatterUpdate as 1-D indices, which mindspore.export rejects)."""
    for value in (np.zeros((0, 1), np.int64), np.zeros((2, 0, 3), np.float16), np.zeros(0, np.float32)):
        got = eval(codegen._np_literal(value), {"np": np})
        assert got.shape == value.shape and got.dtype == (np.float32 if value.dtype == np.float16 else value.dtype)
    assert codegen._np_literal(np.array([[1]], np.int64)) == "np.array([[1]], dtype='int64')"
