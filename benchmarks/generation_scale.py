#!/usr/bin/env python3
"""generation_scale: the user flow for text generation at a real size, stage by stage.

    .venv/bin/python benchmarks/generation_scale.py --size default   # TinyLlama-1.1B's shape, bf16
    .venv/bin/python benchmarks/generation_scale.py --size 7b --stages export,compile

1. Writes a checkpoint folder the way `save_pretrained` does for a real model: config.json of a
   LlamaForCausalLM with the size's numbers (transformers' defaults otherwise), generation_config.json, and
   bf16 safetensors shards of at most 2 GB, with random weights (N(0, 0.02), norm weights 1 + N(0, 0.02)),
   written one tensor at a time (the 7B's 13.5 GB are never in memory at once).
2. Runs, each as its own `python -m graphconv` process: `export CKPT --task text-generation-with-past
   --dtype D`, `compile EXPORT -o GEN`, `generate GEN` (16 new tokens on 3 prompts of different lengths);
   per stage: wall, exit code, peak RSS of the process tree (polled every 0.1 s), bytes written and bytes
   written per checkpoint byte.
3. After generate, unless --no-reference: transformers' own greedy `generate` on the same left-padded prompts,
   the checkpoint loaded in fp32 (the export's compute), and whether graphconv's tokens equal it (up to a
   step whose top-2 logits differ by < 1e-4).
4. Prints a table and one JSON line; deletes the workdir unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_scale import SIZES, dir_bytes, measure

SHARD_BYTES = 2 * 10**9
PROMPTS = [[1, 15, 27, 300, 4000, 77, 9], [1, 5, 6], [1, 900, 901, 902, 903, 904, 905, 906, 907, 908, 909]]
NEW_TOKENS = 16
TIE = 1e-4


def transformers_tokens(ckpt: Path) -> tuple[list[list[int]], list[int | None]]:
    """transformers' greedy generate (fp32) on PROMPTS left-padded: per prompt the new ids (cut after eos) and
    the first step whose top-2 logits are within TIE (None if none)."""
    import torch
    import transformers

    from graphconv.runtime import decoding

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    generation = model.generation_config.to_dict()
    eos, pad = decoding.eos_ids(generation), decoding.pad_id(generation)
    ids, mask = decoding.left_pad(PROMPTS, pad)
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=pad, return_dict_in_generate=True,
                             output_scores=True)
    rows, _ = decoding.sequences(out.sequences[:, ids.shape[1]:].numpy(), eos)
    gaps = [[float(torch.topk(out.scores[k][r], 2).values.diff().abs()) for k in range(len(row))]
            for r, row in enumerate(rows)]
    ties = [next((k for k, g in enumerate(row) if g < TIE), None) for row in gaps]
    return rows, ties


def write_checkpoint(size: str, folder: Path, seed: int = 0) -> int:
    """A bf16 LlamaForCausalLM checkpoint of the size's shape; returns its weight bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    c = SIZES[size]
    config = transformers.LlamaConfig(hidden_size=c.hidden, intermediate_size=c.intermediate,
                                      num_hidden_layers=c.layers, num_attention_heads=c.heads,
                                      num_key_value_heads=c.kv_heads, vocab_size=c.vocab,
                                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=False, dtype="bfloat16",
                                      architectures=["LlamaForCausalLM"])
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]
    sizes = [0]
    for key, shape in shapes.items():
        n = 2 * int(torch.tensor(shape).prod())
        if sizes[-1] and sizes[-1] + n > SHARD_BYTES:
            shards.append({})
            sizes.append(0)
        shards[-1][key] = shape
        sizes[-1] += n
    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in keys.items():
            t = torch.randn(shape, generator=g) * 0.02
            if key.endswith("norm.weight"):
                t += 1
            tensors[key] = t.to(torch.bfloat16)
            weight_map[key] = name
            total += 2 * t.numel()
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--dtype", default="auto", help="export --dtype (default: auto, the checkpoint's bf16)")
    ap.add_argument("--stages", default="export,compile,generate")
    ap.add_argument("--compile-args", default="", help="extra compile arguments, space-separated")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers' own generate")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="generation_scale."))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, exported, gen, logs = work / "ckpt", work / "export", work / "gen", work / "logs"
    try:
        if not ckpt.exists():
            print(f"writing the {args.size} checkpoint into {ckpt}", flush=True)
            write_checkpoint(args.size, ckpt)
        ckpt_bytes = dir_bytes(ckpt)
        py = [sys.executable, "-m", "graphconv"]
        commands = {
            "export": [*py, "export", str(ckpt), "--task", "text-generation-with-past", "--dtype", args.dtype,
                       "-o", str(exported), "-q"],
            "compile": [*py, "compile", str(exported), "-o", str(gen), "-q", *args.compile_args.split()],
            "generate": [*py, "generate", str(gen), "--max-new-tokens", str(NEW_TOKENS), "--json", "--input-ids",
                         ";".join(",".join(map(str, p)) for p in PROMPTS)],
        }
        outputs = {"export": exported, "compile": gen, "generate": None}
        rows = {}
        for stage in args.stages.split(","):
            print(f"{stage}: {' '.join(commands[stage][2:])}", flush=True)
            m = measure(commands[stage], logs, stage)
            written = dir_bytes(outputs[stage]) if outputs[stage] else 0
            rows[stage] = {"wall_s": round(m["wall_s"], 1), "exit": m["exit_code"],
                           "peak_rss_gib": round(m["peak_rss_tree_bytes"] / 2**30, 2),
                           "written_gib": round(written / 2**30, 2),
                           "written_per_ckpt_byte": round(written / ckpt_bytes, 2), "error": m["stderr_tail"]}
            print(f"  {rows[stage]}", flush=True)
            if m["exit_code"] != 0:
                break
            if stage == "generate" and not args.no_reference:
                got = json.loads((logs / "generate.out").read_text())["sequences"]
                want, ties = transformers_tokens(ckpt)
                same = [g == w if t is None else g[:t] == w[:t] for g, w, t in zip(got, want, ties)]
                rows[stage]["tokens_equal_transformers"] = same
                rows[stage]["near_tie_steps"] = ties
                print(f"  graphconv:    {got}\n  transformers: {want}\n  equal (up to a near tie): {same}, "
                      f"near-tie steps {ties}", flush=True)
        print(f"\ncheckpoint: {args.size}, {ckpt_bytes / 2**30:.2f} GiB bf16")
        print("| stage | wall (s) | exit | peak RSS (GiB) | written (GiB) | written / checkpoint |")
        print("|---|---|---|---|---|---|")
        for stage, r in rows.items():
            print(f"| {stage} | {r['wall_s']} | {r['exit']} | {r['peak_rss_gib']} | {r['written_gib']} | "
                  f"{r['written_per_ckpt_byte']} |")
        print(json.dumps({"size": args.size, "checkpoint_bytes": ckpt_bytes, "stages": rows}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
