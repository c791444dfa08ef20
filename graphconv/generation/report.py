"""A generation folder's report.json (the contract fields, each graph's compile report, the cache, the
weights, the ranks) and the summary `graphconv compile` prints of it.

Its functions take the folder's `Build` (graphconv/generation/build.py), untyped here: the build imports this
module, and an import back would be a cycle."""

from __future__ import annotations

from pathlib import Path

from graphconv.generation import cache
from graphconv.generation.schema import GRAPHS

_WEIGHTS_NOTE = "each MindIR holds its own copy of the weights: a MindIR cannot reference another file's Parameters"


def assemble(build, cached_steps: dict | None) -> dict:
    """The report of a build whose graphs all compiled; `cached_steps` the check of the cache held in place."""
    first = next(iter(build.reports.values()))
    statuses = [r["status"] for r in [*build.reports.values(), *build.twins.values()] if r["status"] != "not written"]
    source_dir = str(build.source.folder.resolve())
    report = {
        "graphconv_version": first["graphconv_version"],
        "provenance": {**first["provenance"], "source_dir": source_dir},
        "status": "verified" if all(s == "verified" for s in statuses) else "unverified",
        "exit_code": 0,
        "artifacts": _artifacts(build),
        "weights": {**build.weights, "shared": False, "note": _WEIGHTS_NOTE},
        "graphs": build.reports, "cpu_twins": build.twins,
        "steps": {step: build.meta["graphs"][step].get("mindir", step) for step in GRAPHS},  # the graph each runs
        "cache": _cache(build, first, cached_steps),
    }
    if build.options.tp is not None:
        own = first["validation"].get("tensor_parallel") or {}
        report["tensor_parallel"] = {
            "tp": build.options.tp, "plan": str(build.gen_dir / "plan.json"), "ranks": own.get("ranks"),
            "unsharded_weight_bytes": own.get("unsharded_weight_bytes"),
            "cache_bytes_per_rank": cache.state_bytes(build.state["params"]),
            "checked": "each rank's prompt call under msrun vs onnxruntime on the unsharded graph (the "
                       "compile's cases); the cached steps by generating under msrun (cache.cached_steps_check)"}
    return report


def _artifacts(build) -> dict:
    """The files of GEN_DIR the report names: each graph's MindIRs, or each rank's and the plan."""
    gen_dir, staging = build.gen_dir, build.staging
    if build.options.tp is not None:
        return {f.name: str(gen_dir / f.name) for f in sorted(staging.glob("rank_*.mindir"))} \
            | {"plan": str(gen_dir / "plan.json")}
    return {g: str(gen_dir / f"{g}.mindir") for g in build.graphs} \
        | {f"{g}_cpu": str(gen_dir / f"{g}.cpu.mindir") for g in build.graphs
           if (staging / f"{g}.cpu.mindir").exists()}


def _cache(build, first: dict, cached_steps: dict | None) -> dict:
    """How the cache is held: in place (the load stage's account, its bytes, the cached steps' check) or
    passed in and out, and why."""
    if build.held is None:
        return {"held_in_place": False, "why": build.not_held}
    held = next(s["detail"]["cache_held_in_place"] for s in first["stages"] if s["name"] == "load")
    return {**held, "bytes": cache.state_bytes(build.state["params"]),  # (in the ascend MindIR's dtype)
            "stored": "no: zeros made at load (generation.json's state.params)", "cached_steps_check": cached_steps}


def summary(report: dict) -> str:
    """The lines `graphconv compile` prints for a generation folder."""
    from opmap.fused import fused_primitives

    steps = report.get("steps") or {}
    how = f"one graph, {steps['decode']}, for prompt and decode" if len(set(steps.values())) == 1 else \
        "prefill + decode pair"
    tp = report.get("tensor_parallel")
    if tp:
        how = f"tensor-parallel over {tp['tp']} ranks, one stateful graph each"
    lines = [f"graphconv {report['graphconv_version']}: {report['status']} (generation: {how}, target "
             f"{report['provenance'].get('target')})"]
    for g, r in report["graphs"].items():
        twin = report["cpu_twins"].get(g)
        attention = r["coverage"].get("attention", {})
        fused = ", ".join(f"{k} {v}" for k, v in r["census"].items() if k in fused_primitives())
        lines.append(f"  {g}: {r['status']}, attention {attention.get('fused', 0)}/{attention.get('candidates', 0)} "
                     f"fused ({fused or 'no fused primitive'})" + (f"; cpu MindIR {twin['status']}" if twin else ""))
        quantized = r.get("quantized_linears")
        if quantized:
            lines.append(f"    {quantized['on_low_bit_primitives']}/{quantized['linears']} quantized linears on "
                         "low-bit primitives" + (f", {quantized['bytes_per_parameter']:g} weight bytes per parameter"
                                                 if quantized.get("bytes_per_parameter") is not None else "")
                         + "".join(f"; {n} dequantized: {why}" for why, n in quantized["fell_back"].items()))
    lines += _cache_lines(report.get("cache"))
    w = report["weights"]
    if tp:
        lines.append("  ranks: " + ", ".join(
            f"rank {r['rank']} {r['weight_bytes'] / 2**20:.2f} MiB ({100 * r['share']:.0f}% of the weights), prompt "
            f"max_abs {r.get('max_abs', float('nan')):.2g}" for r in tp["ranks"] or [])
            + f"; cache {tp['cache_bytes_per_rank'] / 2**20:.2f} MiB per rank")
    lines.append("  weights: " + ", ".join(f"{g} {w[g]['mindir_bytes'] / 2**20:.1f} MiB" for g in report["graphs"])
                 + (f" ({w['note']})" if len(report["graphs"]) > 1 else ""))
    lines.append("  wrote: " + ", ".join(Path(p).name for p in report["artifacts"].values())
                 + ", generation.json, report.json")
    return "\n".join(lines)


def _cache_lines(held: dict | None) -> list[str]:
    """The summary's line on the cache: held in place (its size, the cached steps' check) or why not."""
    if not held:
        return []
    if held.get("held_in_place") is False:
        return [f"  KV cache passed in and out, not held in place: {held['why']}"]
    check = held.get("cached_steps_check") or {}
    checked = f"; cached steps not checked: {check['skipped']}" if "skipped" in check else \
        f"; {check['steps']} cached steps match onnxruntime (max_abs {check['max_abs']:.2g})" if check else ""
    return [f"  KV cache held in place: {held['max_batch']} rows x {held['max_seq']} positions, "
            f"{len(held['caches'])} caches, {held['bytes'] / 2**20:.1f} MiB" + checked]
