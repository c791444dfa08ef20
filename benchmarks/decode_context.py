#!/usr/bin/env python3
"""decode_context: decode time per token against context length, the cache passed in and out (the ONNX pair's
way) against the cache held in place (`compile --stateful-cache`).

    .venv/bin/python benchmarks/decode_context.py [--contexts 128,2048] [--tokens 17] [--repeats 3]

A Llama of 4 layers, hidden 256 (4 heads, 2 kv heads, head dim 64, vocab 32,000) with 4,096 positions, random
weights, saved with `save_pretrained`, exported with `graphconv export --task text-generation-with-past` and
compiled twice for MindSpore CPU: with --no-stateful-cache, and with --stateful-cache --max-batch 1
--max-seq-len 4096. For each
context C one prompt of C tokens is generated from, `--tokens` new tokens; the decode steps' times are the
child's own per-step timings (graphconv.generate's `timings.decode`: the graph call and the logits to the host),
median per run, the median of `--repeats` runs interleaved (pair, stateful, pair, ...). Both directories must give
the same tokens. Prints a table and the ratios issue 32 names, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(work: Path) -> tuple[Path, Path]:
    import torch
    import transformers as tf

    from graphconv.frontend.hf_export import export_checkpoint
    from graphconv.generation import compile_generation
    from graphconv.options import CompileOptions, GenerationOptions

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=4096, vocab_size=32000)
    tf.LlamaForCausalLM(config).save_pretrained(work / "ckpt")
    export_checkpoint(work / "ckpt", work / "export", "text-generation-with-past")
    compile_generation(work / "export", CompileOptions(output=work / "pair", target="cpu",
                                                       generation=GenerationOptions(stateful_cache=False)))
    compile_generation(work / "export", CompileOptions(
        output=work / "stateful", target="cpu",
        generation=GenerationOptions(stateful_cache=True, max_batch=1, max_seq_len=4096)))
    return work / "pair", work / "stateful"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    import graphconv

    work = Path(tempfile.mkdtemp(prefix="decode-context-"))
    try:
        dirs = dict(zip(("pair", "stateful"), build(work)))
        contexts = [int(c) for c in args.contexts.split(",")]
        rows = {}
        for context in contexts:
            prompt = [[1 + (7 * k) % 31000 for k in range(context)]]
            times = {name: [] for name in dirs}
            tokens = {}
            for _ in range(args.repeats):
                for name, gen in dirs.items():
                    result = graphconv.generate(gen, prompt, args.tokens, device="cpu")
                    times[name].append(statistics.median(result.timings["decode"]) * 1000)
                    tokens[name] = result.sequences
            assert tokens["pair"] == tokens["stateful"], (context, tokens)
            rows[context] = {name: statistics.median(t) for name, t in times.items()}
            rows[context]["runs"] = times
            print(f"context {context:5d}: pair {rows[context]['pair']:7.2f} ms/token, stateful "
                  f"{rows[context]['stateful']:7.2f} ms/token (runs: pair {[round(t, 1) for t in times['pair']]}, "
                  f"stateful {[round(t, 1) for t in times['stateful']]})", flush=True)
        lo, hi = min(contexts), max(contexts)
        ratios = {f"stateful {hi} / stateful {lo}": rows[hi]["stateful"] / rows[lo]["stateful"],
                  f"stateful {lo} / pair {lo}": rows[lo]["stateful"] / rows[lo]["pair"],
                  f"stateful {hi} / pair {hi}": rows[hi]["stateful"] / rows[hi]["pair"]}
        for k, v in ratios.items():
            print(f"{k}: {v:.2f}")
        print(json.dumps({"ms_per_token": {c: {k: v for k, v in r.items() if k != "runs"} for c, r in rows.items()},
                          "ratios": ratios}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    main()
