"""A generation folder compiled with --tp N: the one stateful graph compiled into each rank's MindIR
(graphconv/parallel/tensor_parallel.py: the ranks verified under msrun at the prompt call against onnxruntime
on the unsharded graph), for the --target and, for a target other than cpu, once more for cpu (what generate
runs here); the cache's zeros stripped from every rank file; and the Ascend launch scripts.

Its functions take the folder's `Build` (graphconv/generation/build.py), untyped here: the build imports this
module, and an import back would be a cycle."""

from __future__ import annotations

import os
import shutil

from graphconv.errors import UnsupportedError
from graphconv.generation import cache
from graphconv.generation.run import mindir_bytes
from graphconv.runtime import msrun

RANKS_ABOUT = """# Generate with the {n} ranks of {name} on one Ascend host: msrun starts {n} processes, rank i loads
# rank_<i>.mindir (its shards, and its kv heads' cache) and runs generate_mindspore.py's loop; the AllReduce and
# AllGather between them run over HCCL. Rank 0 prints the new ids (msrun_logs/worker_0.log) and writes
# generated.txt, shown at the end.   ./launch_ascend.sh --input-ids '1,2,3;4,5' --max-new-tokens 16
#
# UNVERIFIED ON ASCEND: graphconv ran these ranks' cpu MindIRs (rank_<i>.cpu.mindir) under msrun on CPU
# (MindSpore's CPU collectives) and checked their tokens against onnxruntime, not on Ascend. Not checked here:
# HCCL itself, the rank-to-device binding (msrun's default: rank i on device i), the fused primitives' kernels.
"""


def compile_ranks(build) -> None:
    """Each form's ranks into build.staging/rank_<i>[.cpu].mindir and plan.json; the build's reports, twins,
    weights and generation.json (`tensor_parallel`, every step on rank 0's file) filled in."""
    (g, path), = build.graphs.items()
    tp, target, staging = build.options.tp, build.options.target, build.staging
    for form, suffix in [(target, ".mindir")] + ([("cpu", ".cpu.mindir")] if target != "cpu" else []):
        build.progress.info(f"{g}: compile {tp} ranks ({form})")
        build.current = g if form == target else f"{g}.cpu"
        ranks_dir = staging / f"ranks-{form}"
        report = build.compile(path, build.graph_options(g, output=ranks_dir, target=form, tp=tp))
        if form == target:
            build.reports[g] = report
            os.replace(ranks_dir / "plan.json", staging / "plan.json")
        else:
            build.twins[g] = report
        _take_rank_files(ranks_dir, staging, tp, suffix)
    files = [staging / f"rank_{r}.mindir" for r in range(tp)]
    build.state["params"] = cache.strip(files + ([] if target == "cpu" else
                                                 [staging / f"rank_{r}.cpu.mindir" for r in range(tp)]))
    if target == "cpu":  # (after the strip, which replaces the files)
        for r in range(tp):
            os.link(files[r], staging / f"rank_{r}.cpu.mindir")
    ranks = [{"mindir_bytes": mindir_bytes(f), "cpu_mindir_bytes": mindir_bytes(staging / f"rank_{r}.cpu.mindir")}
             for r, f in enumerate(files)]
    build.weights[g] = {**ranks[0], "ranks": ranks}
    about = {"tp": tp, "target": target, "mindirs": [f.name for f in files],
             "cpu_mindirs": [f"rank_{r}.cpu.mindir" for r in range(tp)], "plan": "plan.json",
             "run": "msrun, rank i on rank_<i>; every rank's logits whole (the LM head's AllGather), rank 0's tokens "
                    "reported"}
    graphs = {k: {**v, "mindir": "rank_0"} for k, v in build.meta["graphs"].items()}
    build.meta = {**build.meta, "graphs": graphs, "tensor_parallel": about}


def _take_rank_files(ranks_dir, staging, tp: int, suffix: str) -> None:
    """Each rank's MindIR moved from the compile's output folder into the staging folder, which is removed."""
    for r in range(tp):
        if (ranks_dir / f"rank_{r}_variables").exists():
            raise UnsupportedError(f"--tp: rank {r}'s weights are past 1 GiB (a _variables/ folder): a "
                                   "tensor-parallel generation folder takes smaller ranks in this version")
        os.replace(ranks_dir / f"rank_{r}.mindir", staging / f"rank_{r}{suffix}")
    shutil.rmtree(ranks_dir)


def write_scripts(build) -> None:
    """A tensor-parallel GEN_DIR's Ascend launch: launch_ascend.sh (msrun) running generate_mindspore.py (the
    bundle's generation script, which under msrun joins the group and loads its rank's MindIR) on every rank."""
    from graphconv.deploy.pair import generate_script

    report = next(iter(build.reports.values()))
    inputs = {"rank_0": [{k: s[k] for k in ("name", "dtype", "shape")} for s in report["model"]["inputs"]]}
    script = build.staging / "generate_mindspore.py"
    script.write_text(generate_script(inputs))
    script.chmod(0o755)
    launch = build.staging / "launch_ascend.sh"
    n = build.options.tp
    launch.write_text(msrun.launch_script(n, RANKS_ABOUT.format(n=n, name=build.gen_dir.name), "generate_mindspore.py",
                                          "cat generated.txt\n"))
    launch.chmod(0o755)
