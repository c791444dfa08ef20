"""Control flow: If, Loop, Scan. Their subgraphs are lowered by the same lowering, statement by statement.

- If: a compile-time condition (shape arithmetic, mostly) inlines the taken branch; a run-time condition
  becomes a Python `if` on the tensor in `construct`, which MindSpore's graph mode compiles to control flow
  (both branches must produce outputs of the same shapes and types).
- Loop: unrolled when the trip count is a compile-time constant and the body's condition output stays a
  compile-time constant (a loop whose termination depends on run-time data is refused); scan outputs are
  stacked on a new first axis.
- Scan (opset 9+): unrolled over the static length of the scan axis, with scan_input/output axes and
  directions.
Subgraphs see the enclosing graph's values directly (onnx_ir shares them), so the lowering's operand table
is all they need; the handlers bind the body's inputs in it for each iteration.
"""

from __future__ import annotations

import numpy as np

from opmap.registry import register


def _graph(n, name: str):
    attr = n.node.attributes.get(name)
    if attr is None:
        n.fail(f"attribute {name} is missing")
    return attr.value


def _lower_body(n, graph) -> list:
    """Lower the subgraph's nodes; returns each output as a numpy array (compile-time value) or an expression."""
    low = n._low
    for node in graph:
        low.lower_node(node)
    out = []
    for v in graph.outputs:
        c = low.const_value(v)
        out.append(c if c is not None else low.tensor_expr(v))
    return out


def _bind(n, value, item) -> None:
    """Make a subgraph input stand for `item` (an array: a compile-time value; a str: an expression)."""
    from graphconv.lower import Operand

    if isinstance(item, np.ndarray):
        n._low.operands[value] = Operand(expr=None, const=item)
    else:
        n._low.operands[value] = Operand(expr=item)


def _expr(n, item, hint: str) -> str:
    return n.const_tensor(item, hint) if isinstance(item, np.ndarray) else item


@register("If", since=1)
def if_(n):
    cond = n.const(0)
    if cond is not None:
        taken = "then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"
        return tuple(_lower_body(n, _graph(n, taken)))
    from graphconv.lower import py_name

    low = n._low
    names = [py_name(f"{low.var_prefix(n.node)}_branch{k}", low.used_names) for k in range(n.n_outputs)]
    blocks = []
    for branch in ("then_branch", "else_branch"):
        start = len(low.body)
        outs = _lower_body(n, _graph(n, branch))
        if len(outs) != len(names):
            n.fail(f"{branch} has {len(outs)} outputs, the node {len(names)}")
        for name, item in zip(names, outs):
            low.emit(f"{name} = {_expr(n, item, 'branch')}")
        blocks.append(low.body[start:])
        del low.body[start:]
    low.emit(f"if {n.x(0)}:")
    low.body.extend("    " + line for line in blocks[0])
    low.emit("else:")
    low.body.extend("    " + line for line in blocks[1])
    return tuple(names)


@register("Loop", since=11)
def loop(n):
    """Opset 11 (13, 16, 19, 21 only widen the types): unrolled for a constant trip count."""
    body = _graph(n, "body")
    trips = n.ints(0) if n.has(0) else None
    if n.has(0) and trips is None:
        n.fail("the trip count must be a compile-time constant (the loop is unrolled)")
    cond = n.const(1) if n.has(1) else np.array(True)
    if n.has(1) and cond is None:
        n.fail("the initial condition must be a compile-time constant (the loop is unrolled)")
    if trips is None and n.const(1) is None:
        n.fail("a loop without a trip count needs a constant condition")
    limit = trips[0] if trips is not None else 1 << 12
    carried = [n.const(i) if n.const(i) is not None else n.x(i) for i in range(2, n.n_inputs)]
    n_carried = len(carried)
    scans: list[list] = [[] for _ in range(len(body.outputs) - 1 - n_carried)]
    ins = body.inputs
    i = 0
    while i < limit and bool(np.asarray(cond).reshape(-1)[0]):
        _bind(n, ins[0], np.array(i, np.int64))
        _bind(n, ins[1], np.array(bool(np.asarray(cond).reshape(-1)[0])))
        for v, item in zip(ins[2:], carried):
            _bind(n, v, item)
        outs = _lower_body(n, body)
        cond = outs[0]
        if not isinstance(cond, np.ndarray):
            n.fail("the loop condition depends on run-time values (the loop is unrolled)")
        carried = outs[1:1 + n_carried]
        for k, item in enumerate(outs[1 + n_carried:]):
            scans[k].append(item)
        i += 1
    if i >= limit and trips is None:
        n.fail("the loop did not terminate within 4096 unrolled iterations")
    results = list(carried)
    for items in scans:
        if not items:
            n.fail("a loop with no iteration has empty scan outputs of unknown shape")
        results.append(f"ops.stack(({', '.join(_expr(n, it, 'scan') for it in items)},), 0)")
    return tuple(results)


@register("Scan", since=9)
def scan(n):
    """Opset 9 (11, 16, 19, 21 only widen types or allow negative axes)."""
    body = _graph(n, "body")
    m = int(n.attr("num_scan_inputs"))
    n_state = n.n_inputs - m
    in_axes = list(n.attr("scan_input_axes") or [0] * m)
    in_dirs = list(n.attr("scan_input_directions") or [0] * m)
    k_out = len(body.outputs) - n_state
    out_axes = list(n.attr("scan_output_axes") or [0] * k_out)
    out_dirs = list(n.attr("scan_output_directions") or [0] * k_out)
    lengths = set()
    xs = []
    for j in range(m):
        shape = n.shape(n_state + j)
        if shape is None:
            n.fail("scan inputs need a known rank")
        axis = n.axis(in_axes[j], len(shape))
        if not isinstance(shape[axis], int):
            n.fail("the scan axis must have a static length (the scan is unrolled)")
        lengths.add(shape[axis])
        xs.append((n.x(n_state + j), axis))
    if len(lengths) != 1:
        n.fail("scan inputs of different lengths")
    length = lengths.pop()
    state = [n.const(i) if n.const(i) is not None else n.x(i) for i in range(n_state)]
    collected: list[list] = [[] for _ in range(k_out)]
    for t in range(length):
        for v, item in zip(body.inputs[:n_state], state):
            _bind(n, v, item)
        for j, (x, axis) in enumerate(xs):
            step = length - 1 - t if in_dirs[j] else t
            _bind(n, body.inputs[n_state + j], n.tmp(f"ops.gather({x}, Tensor({step}, ms.int64), {axis})", "scan_in"))
        outs = _lower_body(n, body)
        state = outs[:n_state]
        for k, item in enumerate(outs[n_state:]):
            collected[k].append(_expr(n, item, "scan"))
    results = [_expr(n, s, "state") for s in state]
    for k, items in enumerate(collected):
        if out_dirs[k]:
            items = items[::-1]
        rank = (n.out_shape(n_state + k) or [None]).__len__()
        axis = out_axes[k] + rank if out_axes[k] < 0 else out_axes[k]
        results.append(f"ops.stack(({', '.join(items)},), {axis})")
    return tuple(results)
