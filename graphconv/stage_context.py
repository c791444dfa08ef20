"""What the stages of one compile share, and the two steps several of them take.

The front half (graphconv/pipeline.py) builds one StageContext; the back half (graphconv/verification.py,
graphconv/parallel/tensor_parallel.py) receives it instead of the Compiler. A stage reads the options and
writes only its own sections of the report through it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx

from graphconv.compiler import export_task
from graphconv.compiler.targets import Target
from graphconv.frontend import param_names
from graphconv.options import CompileOptions
from graphconv.progress import Progress
from graphconv.report import Report
from graphconv.runtime.scheduling import Schedule
from graphconv.stage_results import Loaded, Lowered
from graphconv.verify import compare
from graphconv.workspace import Workspace
from passes import precision


@dataclasses.dataclass(frozen=True)
class StageContext:
    options: CompileOptions
    report: Report
    progress: Progress
    target: Target
    schedule: Schedule
    output: Path  # the MindIR, or the --tp directory

    def tolerance(self, compiled: bool = False, reference_value=None) -> tuple[float, float]:
        """The user's tolerance, else the comparison rule's default.

        Graph-to-graph checks use fp32's. The compiled network (`compiled`) uses the compile precision's. A
        reference value in a lower dtype than that loosens it to its own dtype's, since the oracle computed
        that value in its dtype (an fp16 model's fp16 outputs).
        """
        key = precision.TOLERANCE_KEY[self.options.precision if compiled else "fp32"]
        atol, rtol = compare.default_tolerance(key)
        if reference_value is not None:
            own = compare.default_tolerance(reference_value.dtype.name)
            atol, rtol = max(atol, own[0]), max(rtol, own[1])
        return (self.options.atol if self.options.atol is not None else atol,
                self.options.rtol if self.options.rtol is not None else rtol)


def lower(ctx: StageContext, model: onnx.ModelProto, loaded: Loaded, ws: Workspace, name: str = "network",
          lazy_inline: bool | None = None) -> Lowered:
    """Lower `model` into the network `name` in the workspace, as the report's stage `lower` (or `lower-NAME`).

    lazy_inline applies to the target's own network where the target asks for it. The cpu twin never takes it,
    because the twin runs directly.
    """
    if lazy_inline is None:
        lazy_inline = name == "network" and ctx.target.lazy_inline
    ctx.progress.info(f"lower (opmap{', cpu twin' if name != 'network' else ''})")
    with ctx.report.stage("lower" if name == "network" else f"lower-{name}") as st:
        st.nodes_before = st.nodes_after = len(model.graph.node)
        net, task = export_task.prepare(model, ws.dir, name, names=loaded.names, scopes=loaded.scopes,
                                        lazy_inline=lazy_inline)
        st.detail = {"parameters": len(net.params), "source_lines": net.source.count("\n"), "layers": net.layers,
                     "parameter_names": param_names.name_summary(ws.path(f"{name}.names.json"))}
    return Lowered(net, task)


def case_run(model: onnx.ModelProto, cases, ws: Workspace, tag: str = "") -> dict:
    """The verification cases as .npz files, and what a MindSpore child needs to run them.

    Each case's inputs are written once, so several networks (the ranks of a --tp compile) share them. `tag`
    names each network's output files apart.
    """
    specs = export_task.placeholders(model)
    run = {"cases": [], "outputs": [], "input_names": [s["name"] for s in specs], "inputs": specs}
    for k, case in enumerate(cases):
        path = ws.path(f"case{k}.npz")
        if not path.exists():
            np.savez(path, **case.inputs)
        run["cases"].append(str(path))
        run["outputs"].append(str(ws.path(f"case{k}{tag}.out.npz")))
    return run
