#!/usr/bin/env python3
"""quantized_generation: a compressed-tensors W4A16 checkpoint of a real shape through export, compile and
generate, against transformers loading the same folder.

What it does, in one run:

1. Writes a Llama checkpoint of the chosen shape in compressed-tensors' pack-quantized W4A16 layout, as
   llm-compressor ships it: each Linear of the decoder layers as `weight_packed` int32 (random int4 values,
   packed by compressed-tensors' own `pack_to_int32`), `weight_scale` bf16 per group of 128 and
   `weight_shape`; embeddings, norms and lm_head in bf16 (the presets' `ignore: ["lm_head"]`); config.json's
   quantization_config as the package writes it. The weights are seeded N(0, STD) values quantized round to
   nearest (symmetric min-max per group, as llm-compressor's default observer); STD is large enough that
   greedy decoding gives varied tokens.
2. Runs, each in a fresh subprocess with its wall time and peak RSS (ru_maxrss of the child): `graphconv
   export` (--dtype auto: the checkpoint's bf16), `graphconv compile --target cpu`, `graphconv generate` (three
   left-padded prompts, greedy), and transformers' greedy generate on the same folder in fp32 (skipped with
   --no-reference; at 7B it needs some 28 GB).
3. Prints the table: per step wall and peak RSS; the quantized bytes of the checkpoint and of the written
   graphs; whether the tokens equal transformers'.

Run (from the repository root; needs compressed-tensors, in the test extra):

    .venv/bin/python benchmarks/quantized_generation.py [--size small|1.1b|7b] [--workdir DIR] [--keep]
        [--no-reference] [--target cpu|ascend] [--new-tokens N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {  # (hidden, intermediate, layers, heads, kv heads, vocab)
    "small": (512, 1408, 4, 8, 4, 32000),
    "1.1b": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B
    "7b": (4096, 11008, 32, 32, 32, 32000),  # Llama-2-7B
}
GROUP = 128
# The weights' spread: at 4 layers 0.02 (a trained checkpoint's) repeats one token; at 22 layers 0.06 grows the
# activations until fp32 rounding alone exceeds the export check's 1e-4.
STD = {"small": 0.06, "1.1b": 0.02, "7b": 0.02}
PROMPTS = [[1, 450, 4996, 17354, 1701, 432, 29889, 975], [1, 306, 763, 278], [1, 1724, 338, 263, 1243, 29973]]


def log(msg: str) -> None:
    print(f"[quantized_generation] {msg}", file=sys.stderr, flush=True)


def write_checkpoint(folder: Path, size: str, seed: int) -> int:
    """The W4A16 folder; returns the bytes of its quantized tensors (weight_packed and weight_scale)."""
    import torch
    import transformers as tf
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    config = tf.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                            dtype="bfloat16")
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    head = hidden // heads
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv * head, hidden),
              "self_attn.v_proj": (kv * head, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    tensors = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * STD[size]).bfloat16(),
               "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * STD[size]).bfloat16(),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    quantized = 0
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k // GROUP, GROUP, generator=gen) * STD[size]
            scale = (w.abs().amax(-1) / 7.5).bfloat16()  # round to nearest, min-max per group (symmetric)
            q = (w / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int8).reshape(n, k)
            tensors[f"{p}.{name}.weight_packed"] = pack_to_int32(q, 4)
            tensors[f"{p}.{name}.weight_scale"] = scale
            tensors[f"{p}.{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            quantized += tensors[f"{p}.{name}.weight_packed"].numel() * 4 + scale.numel() * 2
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                      "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": GROUP, "dynamic": False}}}}
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return quantized


def run(name: str, cmd: list[str], logs: Path) -> dict:
    """One step in a child: wall seconds, peak RSS (ru_maxrss of the largest child), exit code."""
    log(f"{name}: {' '.join(cmd[2:])}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
        code = subprocess.run(cmd, stdout=out, stderr=err, cwd=ROOT).returncode
    wall = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = {"step": name, "wall_s": round(wall, 1), "peak_rss_gib": round(max(peak, before) / 2**20, 2)
              if peak > before else None, "exit": code}
    if code:
        result["error"] = (logs / f"{name}.err").read_text().strip().splitlines()[-1:]
    log(f"{name}: {result}")
    return result


REFERENCE = """
import json, sys, torch, transformers as tf
src, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
length = max(map(len, prompts))
ids = torch.full((len(prompts), length), 2, dtype=torch.int64)
mask = torch.zeros_like(ids)
for r, p in enumerate(prompts):
    ids[r, length - len(p):] = torch.tensor(p)
    mask[r, length - len(p):] = 1
with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=2,
                         pad_token_id=2)
print(json.dumps([out[r, length:].tolist() for r in range(len(prompts))]))
"""


def _cut(rows: list[list[int]]) -> list[list[int]]:
    return [row[: row.index(2) + 1] if 2 in row else row for row in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--target", choices=("cpu", "ascend"), default="cpu")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="quantized_generation-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    py = [sys.executable, "-m"]
    try:
        log(f"writing the {args.size} W4A16 checkpoint in {work}")
        quantized = write_checkpoint(work / "ckpt", args.size, args.seed)
        steps = [run("export", [*py, "graphconv", "export", str(work / "ckpt"), "-o", str(work / "exp"),
                                "--dtype", "auto", "-q"], logs)]
        if steps[-1]["exit"]:
            print(_table({"size": args.size, "steps": steps, "checkpoint_quantized_bytes": quantized,
                          "graphs_bytes": {}}))
            return 1
        steps.append(run("compile", [*py, "graphconv", "compile", str(work / "exp"), "-o", str(work / "gen"),
                                     "--target", args.target, "-q"], logs))
        ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
        if args.target == "cpu":
            steps.append(run("generate", [*py, "graphconv", "generate", str(work / "gen"), "--input-ids", ids,
                                          "--max-new-tokens", str(args.new_tokens), "--json"], logs))
        result = {"size": args.size, "steps": steps, "checkpoint_quantized_bytes": quantized,
                  "graphs_bytes": {p.name: p.stat().st_size for p in sorted((work / "gen").glob("*.mindir"))}
                  if (work / "gen").is_dir() else {}}
        report = work / "gen" / "report.json"
        if report.is_file():
            graphs = json.loads(report.read_text())["graphs"]
            result["quantized_linears"] = {g: r.get("quantized_linears") for g, r in graphs.items()}
        if args.target == "cpu" and not steps[-1]["exit"]:
            got = json.loads((logs / "generate.out").read_text())["sequences"]
            result["tokens"] = got
            if not args.no_reference:
                steps.append(run("transformers", [sys.executable, "-c", REFERENCE, str(work / "ckpt"),
                                                  json.dumps(PROMPTS), str(args.new_tokens)], logs))
                want = _cut(json.loads((logs / "transformers.out").read_text()))
                result["token_exact"] = _cut(got) == want
                result["distinct_tokens"] = len({t for row in want for t in row})
        print(json.dumps(result, indent=2) if args.json else _table(result))
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _table(result: dict) -> str:
    gib = result["checkpoint_quantized_bytes"] / 2**30
    lines = [f"W4A16 {result['size']}: checkpoint quantized bytes {gib:.3f} GiB",
             "| step | wall s | peak RSS GiB | exit |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['wall_s']} | {s['peak_rss_gib']} | {s['exit']} |" for s in result["steps"]]
    lines.append(f"MindIR bytes: {result['graphs_bytes']}")
    lines.append(f"quantized linears: {result.get('quantized_linears')}")
    if "token_exact" in result:
        lines.append(f"tokens equal transformers': {result['token_exact']} ({result['distinct_tokens']} distinct)")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
