"""`compile --tp N`: the compile's back half for a tensor-parallel network (graphconv/pipeline.py runs the front
half up to the fused graph, as for any compile).

The plan and the rank graphs come from graphconv/parallel/sharding.py. Each rank's graph is lowered like any
fused graph (its MindIR for the target, and its cpu twin where the target needs one); the N ranks are then
exported and run on the reference cases under msrun, MindSpore's own launcher, on this machine's CPU
(graphconv/runtime/msrun.py): the AllReduce and AllGather the rank networks hold run as MindSpore's CPU
collectives, as they run over HCCL on Ascend. Every rank's outputs are compared with onnxruntime's on the
unsharded model. The output directory holds rank_<i>.mindir (only that rank's shards), plan.json and launch_ascend.sh.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx

import opmap.fused
from graphconv.dtypes import FLOATS
from graphconv.errors import InternalError, VerificationError
from graphconv.runtime import msrun
from graphconv.parallel import sharding
from graphconv.stage_context import StageContext, case_run, lower
from graphconv.verify import census, outputs
from passes.stateful_cache import CACHE_PREFIX

LAUNCH_ABOUT = """\
# Run the {n} ranks of {name} on one Ascend host: msrun starts {n} processes, rank i loads rank_<i>.mindir
# (its shards only) and the AllReduce between them runs over HCCL.
#
# UNVERIFIED ON ASCEND: graphconv verified these networks' cpu twins under msrun on CPU (MindSpore's CPU
# collectives), not on Ascend. Not checked here: HCCL itself, the rank-to-device binding (msrun's
# default: rank i on device i; set --bind_core / ASCEND_RT_VISIBLE_DEVICES as your host needs), the fused
# primitives' kernels, and run_rank.py's inputs (give your own: one .npz per call, keys = graph input names).
"""

RUN_RANK = '''"""One rank of the tensor-parallel network (launched by launch_ascend.sh through msrun):
python run_rank.py INPUTS.npz -> rank_<i>.out.npz (every rank computes the same outputs)."""
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from mindspore.communication import get_rank, init

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("Ascend")
init()
rank = get_rank()
net = nn.GraphCell(ms.load(f"rank_{{rank}}.mindir"))
data = np.load(sys.argv[1])
outs = net(*[Tensor(data[name]) for name in {inputs!r}])
outs = outs if isinstance(outs, (tuple, list)) else (outs,)
np.savez(f"rank_{{rank}}.out.npz", **{{name: o.asnumpy() for name, o in zip({outputs!r}, outs)}})
'''


class TensorParallel:
    """The shard, lower, emit-and-run (under msrun) and verify stages of a --tp compile, through its StageContext."""

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.n = ctx.options.tp

    def run(self, loaded, checked, fused: onnx.ModelProto, cases, ws, spill=None) -> dict[Path, Path]:
        """The rank networks built, run and verified; returns {staged directory: output directory}. `spill`:
        the compile's spill file (a model whose weights are in files), where the shards go."""
        with self.ctx.report.stage("shard") as st:
            plan = sharding.plan(fused, self.n)
            ranks = sharding.shard_all(fused, plan, spill)
            st.detail = {"tp": self.n, "blocks": len(plan.blocks), "all_reduces": len(plan.reduces),
                         "all_gathers": len(plan.gathers)}
        tasks, nets = [], []
        for r, graph in enumerate(ranks):
            cpu_form = opmap.fused.inline_fused(graph)
            net = lower(self.ctx, self.ctx.target.network_graph(graph, cpu_form), loaded, ws, f"rank_{r}",
                               lazy_inline=self.ctx.target.lazy_inline)
            needs_twin = self.ctx.options.verify and self.ctx.target.needs_twin(cpu_form, graph)  # (only to verify)
            twin = lower(self.ctx, cpu_form, loaded, ws, f"rank_{r}_cpu_twin", lazy_inline=False) \
                if needs_twin else None
            out_dir = ws.path(f"out_rank_{r}")
            out_dir.mkdir()
            run = case_run(cpu_form, cases, ws, f".rank{r}") if self.ctx.options.verify else None
            export = {**net.task, "file_base": str(out_dir / f"rank_{r}"), "checkpoint": None}
            tasks.append({"kind": "export_and_verify", "export": export, "run": run,
                          "twin": twin.task if twin else None} if run else {"kind": "export", **export})
            nets.append((net, twin))
        self.ctx.progress.info(f"emit and run {self.n} ranks under msrun")
        with self.ctx.report.stage("emit") as st:
            t0 = time.perf_counter()
            results = msrun.run(tasks, ws.dir, f"msrun ({self.n} ranks)")
            st.detail = {"msrun_seconds": round(time.perf_counter() - t0, 2)}
        self.ctx.report.census = census.primitive_census(next(f for f in results[0]["files"] if f.endswith(".mindir")))
        sources = self._sources(ws)
        total = _weight_bytes(fused)
        rows = [{"rank": r, "weight_bytes": _weight_bytes(g), "share": round(_weight_bytes(g) / total, 4),
                 "streamed": bool(res.get("streamed")), "peak_rss_bytes": res.get("peak_rss_bytes")}
                for r, (g, res) in enumerate(zip(ranks, results))]
        if self.ctx.options.verify:
            self._verify(nets, results, cases, checked.expected, rows)
        else:
            self.ctx.report.validation["status"] = self.ctx.report.status = "unverified"
        self.ctx.report.validation["tensor_parallel"] = {"tp": self.n, "unsharded_weight_bytes": total, "ranks": rows,
                                                       "run": "msrun on CPU (MindSpore's CPU collectives)"}
        staged = self._stage_output(plan, sources, results, fused, ws)
        moves = {staged: Path(self.ctx.output)}
        if self.ctx.options.bundle:
            moves[self._bundle(staged, cases, checked.expected, rows, ws)] = Path(self.ctx.options.bundle)
        return moves

    def _verify(self, nets, results, cases, expected, rows) -> None:
        self.ctx.progress.info(f"verify ({self.n} ranks under msrun vs onnxruntime on the unsharded model)")
        with self.ctx.report.stage("verify"):
            failures = []
            for r, ((net, twin), result) in enumerate(zip(nets, results)):
                done = result.get("verify") or {"error": result.get("verify_error", "no result")}
                if "error" in done:
                    raise InternalError(f"rank {r} does not run on CPU under msrun: {done['error']}")
                check = outputs.compare_outputs(cases, expected, done["outputs"], (twin or net).net.output_names,
                                                lambda ref: self.ctx.tolerance(True, ref))
                rows[r]["max_abs"] = max(o["max_abs"] for c in check.cases for o in c["outputs"])
                rows[r]["case_seconds"] = done.get("case_seconds")
                failures += [f"rank {r}: {f}" for f in check.failures]
                if r == 0:
                    atol, rtol = self.ctx.tolerance(compiled=True)
                    self.ctx.report.validation.update({"atol": atol, "rtol": rtol, "cases": check.cases})
            self.ctx.report.validation["status"] = "failed" if failures else "verified"
            self.ctx.report.validation["checked"] = ("cpu twins" if nets[0][1] else "MindIRs") + \
                f" of the {self.n} ranks, under msrun"
            if failures:
                raise VerificationError("verification failed: " + "; ".join(failures[:3]))
        self.ctx.report.status = "verified"

    def _sources(self, ws) -> dict[str, str]:
        """ONNX initializer -> the model's own (PyTorch) name, from the lowering's name mapping."""
        path = ws.path("rank_0.names.json")
        if not path.exists():
            return {}
        return {e["onnx"]: name for name, e in json.loads(path.read_text()).items()}

    def _stage_output(self, plan, sources, results, fused, ws) -> Path:
        staged = ws.path("tp_out")
        staged.mkdir()
        for r, result in enumerate(results):
            for f in map(Path, result["files"]):
                f.rename(staged / f.name.replace(f"rank_{r}_graph", f"rank_{r}"))
        (staged / "plan.json").write_text(json.dumps(plan.as_json(sources), indent=1) + "\n")
        name = Path(self.ctx.output).name
        launch = staged / "launch_ascend.sh"
        launch.write_text(msrun.launch_script(self.n, LAUNCH_ABOUT.format(n=self.n, name=name), "run_rank.py"))
        launch.chmod(0o755)
        (staged / "run_rank.py").write_text(RUN_RANK.format(
            inputs=[i.name for i in fused.graph.input if i.name not in {t.name for t in fused.graph.initializer}],
            outputs=[o.name for o in fused.graph.output]))
        out = Path(self.ctx.output)
        self.ctx.report.artifacts.update({"tp_dir": str(out), "plan": str(out / "plan.json"),
                                          "launch": str(out / "launch_ascend.sh")})
        return staged

    def _bundle(self, staged: Path, cases, expected, rows, ws) -> Path:
        """The deploy bundle (graphconv/deploy/tensor_parallel.py), staged beside the rank files."""
        from graphconv.deploy.tensor_parallel import write_tp_bundle

        self.ctx.progress.info("bundle")
        with self.ctx.report.stage("bundle"):
            directory = ws.path("bundle")
            directory.mkdir()
            v = self.ctx.report.validation
            written = write_tp_bundle(
                directory, staged, name=Path(self.ctx.output).name, tp=self.n, inputs=self.ctx.report.model["inputs"],
                outputs=self.ctx.report.model["outputs"], cases=cases, expected=expected,
                precision=self.ctx.options.precision, ranks=rows, status=v.get("status", "unverified"),
                checked=v.get("checked"), tools=self.ctx.report.provenance["tools"], census=self.ctx.report.census)
        self.ctx.report.artifacts["bundle"] = str(self.ctx.options.bundle)
        v.setdefault("bundle_files", written)
        return directory


def _weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of a graph's float weights (what its MindIR holds, up to folded constants)."""
    return sum(int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
               for t in model.graph.initializer
               if t.data_type in FLOATS and not t.name.startswith(CACHE_PREFIX))  # (state, not weights)
