"""The deploy bundle of a tensor-parallel compile (`graphconv compile MODEL --tp N -o OUT_DIR --bundle DIR`).

    rank_<i>.mindir       rank i's network: its shards only, and the AllReduce / AllGather between the ranks
    plan.json             each weight's split axis and slices per rank, or why it is replicated
    launch_ascend.sh      msrun starts the N ranks on one Ascend host; they talk over HCCL
    run_rank.py           what each rank runs: one call on an .npz of inputs, its outputs to rank_<i>.out.npz
    reference/            inputs, and onnxruntime's outputs of the unsharded model (cases.json: the rule)
    compare_outputs.py    a rank's outputs against the reference (numpy only)
    README.md, manifest.json

The rank files are the --tp output directory's, hard-linked where the filesystem allows. A generation folder
compiled with --tp gets its own (write_tp_generation_bundle): the ranks' MindIRs, the plan, generation.json, the
msrun launch script and the generation script every rank runs. The single-device
bundle's Lite and ATC routes are not written: graphconv has not checked that converter_lite or ATC take a
graph holding collectives.
"""

from __future__ import annotations

from pathlib import Path

from graphconv.deploy.scripts import compare_script
from graphconv.deploy.writer import _json, _Writer, write_reference
from graphconv.version import __version__

UNVERIFIED = ("HCCL itself; the rank-to-device binding (msrun's default: rank i on device i); the fused "
              "primitives' Ascend kernels; the time and memory of a rank on a device")


def write_tp_bundle(directory: Path, tp_dir: Path, *, name: str, tp: int, inputs: list[dict], outputs: list[dict],
                    cases: list, expected: list[dict] | None, precision: str, ranks: list[dict], status: str,
                    checked: str | None, tools: dict, census: dict) -> list[str]:
    """Write the bundle into the empty directory `directory` from the staged --tp output `tp_dir`; `ranks`:
    per rank its weight bytes, share and (verified) max abs. Returns the relative paths written."""
    w = _Writer(directory)
    for f in sorted(p for p in Path(tp_dir).rglob("*") if p.is_file()):
        w.link(f, f.relative_to(tp_dir).as_posix())
    cases_meta = write_reference(w, inputs, outputs, cases, expected, precision)
    w.text("compare_outputs.py", compare_script(), executable=True)
    w.text("README.md", _readme(name, tp, cases_meta, ranks, status, checked))
    w.text("manifest.json", _json({
        "graphconv": __version__, "name": name, "tensor_parallel": tp, "precision": precision,
        "tools": dict(sorted(tools.items())), "inputs": inputs, "outputs": outputs, "ranks": ranks,
        "verified_here": checked if status == "verified" else None, "unverified_on_ascend": UNVERIFIED,
        "census_rank_0": dict(sorted(census.items()))}) + "\n")
    return sorted(set(w.written))


def _readme(name: str, tp: int, cases_meta: list[dict], ranks: list[dict], status: str, checked: str | None) -> str:
    case = cases_meta[0] if cases_meta else None
    run = (f"    ./launch_ascend.sh {case['inputs']}\n"
           f"    python compare_outputs.py rank_0.out.npz --case {case['name']}\n"
           if case else "    ./launch_ascend.sh INPUTS.npz   # (no reference case was made)\n")
    rows = "\n".join(f"| {r['rank']} | {r['weight_bytes']:,} | {r['share']:.3f} | "
                     f"{r['max_abs']:.3g} |" if "max_abs" in r else
                     f"| {r['rank']} | {r['weight_bytes']:,} | {r['share']:.3f} | not run |" for r in ranks)
    verified = (f"Verified here: the {checked}, against onnxruntime on the unsharded model, on every "
                "reference case (MindSpore's CPU collectives stood in for HCCL)."
                if status == "verified" else
                "NOT verified here: the compile ran with --no-verify, so the ranks were not run at all.")
    return (f"# {name}: tensor-parallel over {tp} devices\n\n"
            f"- `rank_<i>.mindir` (i = 0..{tp - 1}): rank i's network, holding only its shards of the weights, "
            "and the\n  AllReduce / AllGather between the ranks.\n"
            "- `plan.json`: each weight's split axis and slices per rank, or why it is replicated.\n"
            "- `launch_ascend.sh`: msrun starts the ranks on one Ascend host (HCCL between them); each runs\n"
            "  `run_rank.py` on one .npz of inputs (keys: the graph's input names) and writes `rank_<i>.out.npz`.\n"
            "- `reference/`: inputs, and onnxruntime's outputs of the unsharded model; `compare_outputs.py`\n"
            "  compares a rank's outputs with them (numpy only; every rank computes the same outputs).\n\n"
            "## Run and check, from this directory on the Ascend host\n\n" + run + "\n"
            "## What was checked, and what was not\n\n" + verified + "\n\n"
            "| rank | weight bytes | share of the unsharded | max abs vs onnxruntime |\n|---|---|---|---|\n"
            + rows + "\n\n"
            f"UNVERIFIED ON ASCEND: {UNVERIFIED}. The Lite and ATC routes of a single-device bundle are not "
            "offered:\ngraphconv has not checked that converter_lite or ATC take a graph holding collectives.\n")


GENERATION_FILES = ("plan.json", "generation.json", "launch_ascend.sh", "generate_mindspore.py")


def write_tp_generation_bundle(directory: Path, gen_dir: Path, report: dict) -> list[str]:
    """The bundle of a generation folder compiled with --tp: the rank MindIRs of the target (not the cpu ones
    `generate` runs here), the plan, generation.json, the msrun launch script and the generation script it runs
    on every rank, the tokenizer where there is one, and a README saying what was checked and what was not."""
    w = _Writer(directory)
    tp = report["tensor_parallel"]["tp"]
    for r in range(tp):
        w.link(gen_dir / f"rank_{r}.mindir", f"rank_{r}.mindir")
    for name in GENERATION_FILES:
        w.link(gen_dir / name, name)
    for f in sorted(p for p in (gen_dir / "tokenizer").rglob("*") if p.is_file()):
        w.link(f, f.relative_to(gen_dir).as_posix())
    ranks = report["tensor_parallel"].get("ranks") or []
    rows = "\n".join(f"| {r['rank']} | {r['weight_bytes']:,} | {r['share']:.3f} | "
                     f"{r.get('max_abs', float('nan')):.3g} |" for r in ranks)
    check = (report.get("cache") or {}).get("cached_steps_check") or {}
    w.text("README.md", (
        f"# Text generation over {tp} devices (tensor parallelism)\n\n"
        f"- `rank_<i>.mindir` (i = 0..{tp - 1}): rank i's generation graph, its shards of the weights and its kv "
        "heads of the\n  cache (held in place: Parameters each call writes, stored without their bytes; "
        "generation.json's\n  `state.params`).\n"
        "- `launch_ascend.sh`: msrun runs `generate_mindspore.py` on every rank (HCCL between them); rank 0 prints "
        "the\n  new ids and writes `generated.txt`:\n\n"
        "      ./launch_ascend.sh --input-ids '1,2,3;4,5' --max-new-tokens 16\n\n"
        "- `plan.json`: each weight's and cache's split; `generation.json`: token ids, the graph's inputs, the "
        "cache.\n\n"
        "## What was checked, and what was not\n\n"
        f"Checked here, on this machine's CPU under msrun: each rank's prompt call against onnxruntime on the "
        f"unsharded graph, and the cached steps by generating (argmax match: {check.get('argmax_match')}, max abs "
        f"{check.get('max_abs')}).\n\n"
        "| rank | weight bytes | share of the unsharded | prompt max abs |\n|---|---|---|---|\n" + rows + "\n\n"
        f"UNVERIFIED ON ASCEND: {UNVERIFIED}.\n"))
    return sorted(set(w.written))
