"""The child's run tasks: a MindIR loaded and run on the cases (`run_mindir`), a generated network built and run
without a MindIR round trip (`run_network`), and many small networks exported and run in one process
(`export_and_run`: the op tests, the ONNX backend)."""

from __future__ import annotations

import gc

from graphconv.runtime import export_tasks, network

# GraphCells that run_mindir keeps for the next tasks that run the same MindIR with "keep": true (a server's
# repeated runs: the ONNX backend), oldest first; past KEEP_CELLS the oldest is dropped (its MindIR stays on
# disk). A server that has loaded RETIRE_AFTER of them asks to be replaced (graphconv.runtime.worker.serve),
# which keeps MindSpore's per-graph memory bounded.
KEEP_CELLS = 32
RETIRE_AFTER = 200
_kept: dict = {}
_loads = [0]


def loads() -> int:
    """How many MindIRs run_mindir has kept so far in this process."""
    return _loads[0]


def run_mindir(task: dict) -> dict:
    import mindspore as ms
    from mindspore import nn

    network.cpu_graph_mode()
    cell = _kept.get(task["mindir"]) if task.get("keep") else None
    if cell is not None:
        return network.run_cases(cell, task, with_placeholders=False)  # set at its first run
    cell = nn.GraphCell(ms.load(task["mindir"]))
    if task.get("keep"):
        if len(_kept) >= KEEP_CELLS:
            _kept.pop(next(iter(_kept)))
        _kept[task["mindir"]] = cell
        _loads[0] += 1
    return network.run_cases(cell, task)


def run_network(task: dict) -> dict:
    """Build the generated network from its source and weights and run the cases (no MindIR round trip:
    used for the cpu twin of an ascend compile, whose MindIR would be written only to be read back)."""
    network.cpu_graph_mode()
    net, build_seconds = network.build(task)
    return {**network.run_cases(net, task), "build_seconds": build_seconds}


def export_and_run(task: dict) -> dict:
    """Many small networks in one process (op tests, the ONNX backend): export each, then run its MindIR.
    A failure is recorded per item, so one bad network does not hide the others."""
    results = []
    for item in task["items"]:
        # MindSpore runs gc.collect() on every graph compile; freezing what is alive so far keeps that
        # cheap across hundreds of networks (measured: 110 s -> 39 s for 355 one-op models).
        gc.freeze()
        try:
            export_tasks.export(item)
            run_mindir({**item, "mindir": item["file_base"] + ".mindir"})
            results.append({"ok": True})
        except Exception as e:  # noqa: BLE001 - reported per item
            results.append({"ok": False, "error": f"{type(e).__name__}: {network.first_line(str(e))}"})
    return {"items": results}
