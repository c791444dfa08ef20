"""Control flow: If, Loop, Scan. Their subgraphs are lowered by the same lowering, statement by statement.

- If: a compile-time condition (shape arithmetic, mostly) inlines the taken branch; a run-time condition
  becomes a Python `if` on the tensor in `construct`, which MindSpore's graph mode compiles to control flow
  (both branches must produce outputs of the same shapes and types).
- Loop: unrolled when the trip count is a compile-time constant and the body's condition output stays a
  compile-time constant (a loop whose termination depends on run-time data is refused); scan outputs are
  stacked on a new first axis.
- Scan (opset 9+): unrolled over the static length of the scan axis, with scan_input/output axes and
  directions.
Subgraphs see the enclosing graph's values directly (onnx_ir shares them); the handlers bind the body's
inputs for each iteration and lower it through the NodeContext's public sub-graph API (bind,
lower_subgraph, block, if_).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register


def _graph(n, name: str):
    g = n.attr(name)
    if g is None:
        n.fail(f"attribute {name} is missing")
    return g


def _tensor(n, item):
    """A branch or loop result as a value (an array from compile time becomes a constant tensor)."""
    return n.const_tensor(item, "branch") if isinstance(item, np.ndarray) else item


@register("If", since=1)
def if_(n):
    cond = n.const(0)
    if cond is not None:
        taken = "then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"
        return tuple(n.lower_subgraph(_graph(n, taken)))
    blocks = []
    for branch in ("then_branch", "else_branch"):
        with n.block() as block:
            outs = n.lower_subgraph(_graph(n, branch))
            if len(outs) != n.n_outputs:
                n.fail(f"{branch} has {len(outs)} outputs, the node {n.n_outputs}")
            block.outputs = [_tensor(n, item) for item in outs]
        blocks.append(block)
    return n.if_(n.x(0), *blocks)


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
        n.bind(ins[0], np.array(i, np.int64))
        n.bind(ins[1], np.array(bool(np.asarray(cond).reshape(-1)[0])))
        for v, item in zip(ins[2:], carried):
            n.bind(v, item)
        outs = n.lower_subgraph(body)
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
        results.append(n.call("ops.stack", tuple(_tensor(n, it) for it in items), 0))
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
            n.bind(v, item)
        for j, (x, axis) in enumerate(xs):
            step = length - 1 - t if in_dirs[j] else t
            index = n.call("Tensor", step, n.ms_dtype(ir.DataType.INT64))
            n.bind(body.inputs[n_state + j], n.call("ops.gather", x, index, axis))
        outs = n.lower_subgraph(body)
        state = outs[:n_state]
        for k, item in enumerate(outs[n_state:]):
            collected[k].append(_tensor(n, item))
    results = [_tensor(n, s) for s in state]
    for k, items in enumerate(collected):
        if out_dirs[k]:
            items = items[::-1]
        rank = (n.out_shape(n_state + k) or [None]).__len__()
        axis = out_axes[k] + rank if out_axes[k] < 0 else out_axes[k]
        results.append(n.call("ops.stack", tuple(items), axis))
    return tuple(results)
