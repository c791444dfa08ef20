"""onnxruntime-genai's model builder output: the graphs behind the "*-onnx" LLM repositories users download
(opset 22 + com.microsoft GroupQueryAttention with rotary and KV cache inside, SkipSimplifiedLayerNormalization,
SimplifiedLayerNormalization, and in int4 MatMulNBits). Made here from tiny random checkpoints saved with
save_pretrained and a WordLevel tokenizer (the builder needs one; nothing is downloaded), built in fp32 and
int4, compiled for ascend (the census shows the fused attention and RmsNorm), verified against onnxruntime at
a prompt (past length 0) and a decode step (past length 7), and the builder folder compiled into a generation
directory whose `graphconv generate` gives onnxruntime-genai's own greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

import graphconv
from gen_folder import compile_folder

from graphconv.generation import run as generation

VOCAB, LAYERS = 256, 2
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM"}
PROMPT = [5, 9, 17, 33, 70]


def save_checkpoint(arch: str, folder) -> None:
    """A tiny random checkpoint of `arch` with a WordLevel tokenizer, as save_pretrained writes them."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "phi3":  # the builder takes a Phi-3 whose two context lengths agree as Phi-3-mini-4k
        config = transformers.Phi3Config(**common, pad_token_id=0, original_max_position_embeddings=256)
    else:
        config = getattr(transformers, f"{ARCHS[arch][:-len('ForCausalLM')]}Config")(**common)
    getattr(transformers, ARCHS[arch])(config).eval().save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(folder)


def build(checkpoint, out, precision: str) -> None:
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
                           "-o", str(out), "-p", precision, "-e", "cpu"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """(arch, precision) -> the builder's output folder, built on first use."""
    made = {}

    def get(arch: str, precision: str):
        if (arch, precision) not in made:
            root = tmp_path_factory.mktemp(f"{arch}_{precision}")
            if not (root.parent / f"hf_{arch}").exists():
                save_checkpoint(arch, root.parent / f"hf_{arch}")
            build(root.parent / f"hf_{arch}", root / "model", precision)
            made[(arch, precision)] = root / "model"
        return made[(arch, precision)]

    return get


CASES = [pytest.param("llama", "fp32"), pytest.param("llama", "int4")] + [
    pytest.param(a, p, marks=pytest.mark.slow) for a in ("qwen2", "phi3") for p in ("fp32", "int4")]


def live_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """Per op type, the nodes whose first output reaches a graph output: what the architecture asks graphconv
    to fuse. (onnxruntime-genai 0.18 builds Phi-3's lm_head from layer 0's post-attention norm, so layer 1's
    attention output and later norms are dead there and onnxsim drops them.)"""
    producer = {o: n for n in graph.node for o in n.output if o}  # "" is an absent optional value
    live, todo = set(), [o.name for o in graph.output]
    while todo:
        value = todo.pop()
        if value in live or value not in producer:
            continue
        live.add(value)
        todo.extend(producer[value].input)
    counts: dict[str, int] = {}
    for n in graph.node:
        if n.output and n.output[0] in live:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("arch,precision", CASES)
def test_builder_model_compiles_for_ascend_fused_and_verifies(arch, precision, builds, tmp_path):
    folder = builds(arch, precision)
    given = onnx.load(folder / "model.onnx", load_external_data=False)
    ops = {(n.domain, n.op_type) for n in given.graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops and ("", "SimplifiedLayerNormalization") in ops
    assert (("com.microsoft", "MatMulNBits") in ops) == (precision == "int4")
    report = graphconv.compile(folder / "model.onnx", tmp_path / "m.mindir", target="ascend")
    assert report.status == "verified", report.error
    # The architecture: one attention per layer, an RMSNorm before each of its two blocks and a final one
    # (2 * LAYERS + 1), each a builder node; those whose result is used are fused.
    live = live_counts(given.graph)
    attentions = live["GroupQueryAttention"]
    norms = live["SimplifiedLayerNormalization"] + live["SkipSimplifiedLayerNormalization"]
    assert attentions == LAYERS and norms == 2 * LAYERS + 1 or arch == "phi3"
    assert report.coverage["attention"]["fused"] == attentions, report.coverage["attention"]
    assert report.fusions["fuse-rmsnorm"] == norms
    fused = report.census.get("FusedInferAttentionScore", 0) + report.census.get("FlashAttentionScore", 0)
    assert fused == attentions and report.census.get("RmsNorm") == norms
    cases = report.validation["cases"]
    assert len(cases) == 2
    pasts = sorted(c["inputs"]["past_key_values.0.key"][2] for c in cases)
    assert pasts[0] == 0 and pasts[1] > 0  # a prompt with an empty cache and a decode step
    for case in cases:
        for out in case["outputs"]:
            assert out["max_abs"] <= 1e-4 and out["cosine"] > 0.9999, (case["inputs"], out)


def genai_tokens(folder, prompt: list[int], new_tokens: int) -> list[int]:
    """onnxruntime-genai's own greedy generation on the builder folder: the new token ids."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]


def transformers_tokens(checkpoint, prompt: list[int], new_tokens: int, eos: list[int]) -> list[int]:
    """transformers' greedy generate on the checkpoint the builder read: the new ids, up to and including eos."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_builder_folder_compiles_into_a_generation_directory(arch, builds, tmp_path):
    """The builder's one graph, with its KV cache held in place (the default): GroupQueryAttention's
    decomposition is past -> Concat -> present, rewritten like any export's; the prompts run grouped by length
    (the graph reads the mask as lengths). The tokens are onnxruntime-genai's and transformers'. (Not Phi-3:
    the builder's Phi-3 graph is not transformers' model, see live_counts.)"""
    from test_stateful_cache import _cache_paths

    from graphconv.verify.census import primitive_census

    folder = builds(arch, "fp32")
    gen_dir = tmp_path / "gen"
    report = compile_folder(folder, gen_dir, target="ascend")
    assert report["status"] == "verified"
    assert report["cache"]["max_seq"] == 256  # genai_config's context_length (the checkpoint's 256)
    check = report["cache"]["cached_steps_check"]  # against onnxruntime's GroupQueryAttention on model.onnx
    assert check["argmax_match"] and check["max_abs"] <= 1e-4 and check["steps"] == 3 * 4
    assert sorted(p.name for p in gen_dir.iterdir()) == ["generation.json", "model.cpu.mindir", "model.mindir",
                                                         "report.json", "tokenizer"]  # (the builder folder's)
    meta = json.loads((gen_dir / "generation.json").read_text())
    assert meta["graphs"]["decode"]["state"]["inputs"] == ["input_ids", "attention_mask"]
    # per layer one attention reading the cache and one write per cache tensor, with no Concat on the path
    assert primitive_census(gen_dir / "model.mindir").get("FusedInferAttentionScore") == LAYERS
    assert _cache_paths(gen_dir / "model.mindir") == [
        ["ScatterNdUpdate", "StridedSlice", "Cast", "MakeTuple", "FusedInferAttentionScore"]] * 2 * LAYERS
    prompts = [PROMPT, PROMPT[::-1], PROMPT[:3]]
    result = generation.generate(gen_dir, prompts, 12, check=True, device="cpu")
    assert all(s["argmax_match"] and s["max_abs"] <= 1e-4 for s in result.steps)
    eos = meta["eos_token_id"] if isinstance(meta["eos_token_id"], list) else [meta["eos_token_id"]]
    hf = [transformers_tokens(folder.parent.parent / f"hf_{arch}", p, 12, eos) for p in prompts]
    assert result.sequences == hf
    assert result.sequences == [genai_tokens(folder, p, 12) for p in prompts]
    # passed in and out on request: the same tokens
    plain = compile_folder(folder, tmp_path / "plain", target="cpu", stateful_cache=False)
    assert plain["cache"] == {"held_in_place": False, "why": "not asked for (--no-stateful-cache)"}
    assert generation.generate(tmp_path / "plain", prompts, 12, device="cpu").sequences == hf


def test_int4_builder_folder_generates_the_exact_semantics_tokens(builds, tmp_path):
    """int4: the compiled network computes MatMulNBits exactly (accuracy_level 0); onnxruntime-genai's default
    accuracy_level 4 quantizes activations to int8. So the tokens are onnxruntime-genai's on a copy of the
    folder at level 0, and --check (onnxruntime at level 0, as the compile's oracle) agrees step by step."""
    import shutil

    from graphconv.frontend.contrib import quant

    folder = builds("llama", "int4")
    exact_folder = tmp_path / "level0"
    shutil.copytree(folder, exact_folder)
    given = onnx.load(exact_folder / "model.onnx", load_external_data=False)
    exact, levels = quant.at_accuracy_level_0(given)
    assert levels == [4] and exact is not None
    onnx.save(exact, exact_folder / "model.onnx")  # weights stay in model.onnx.data, referenced as before
    gen_dir = tmp_path / "gen"
    assert compile_folder(folder, gen_dir, target="cpu")["status"] == "verified"
    result = generation.generate(gen_dir, [PROMPT], 12, check=True, device="cpu")
    assert result.sequences[0] == genai_tokens(exact_folder, PROMPT, 12)
    assert all(s["argmax_match"] and s["max_abs"] <= 1e-4 for s in result.steps)


def test_builder_folder_bundle_script_runs_prompts_grouped_by_length(builds, tmp_path):
    """--bundle of a builder folder: the bundle's generate_mindspore.py (MindSpore alone, --device CPU on a --target
    cpu compile) runs the prompts of one length together, as the graph reads the mask as lengths, and prints
    transformers' greedy tokens for prompts of three lengths, in the order given."""
    import os

    folder = builds("llama", "fp32")
    bundle = tmp_path / "bundle"
    report = compile_folder(folder, tmp_path / "gen", target="cpu", bundle=bundle)
    assert report["status"] == "verified" and report["cache"]["max_seq"] == 256  # (held in place)
    assert json.loads((bundle / "generation.json").read_text())["prompt_padding"] == "none"
    prompts = [PROMPT, PROMPT[:3], PROMPT[::-1], PROMPT[1:]]
    ran = subprocess.run([sys.executable, str(bundle / "generate_mindspore.py"), "--input-ids",
                          ";".join(",".join(map(str, p)) for p in prompts), "--max-new-tokens", "8", "--device", "CPU"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert ran.returncode == 0, ran.stderr[-2000:]
    meta = json.loads((tmp_path / "gen" / "generation.json").read_text())
    eos = meta["eos_token_id"] if isinstance(meta["eos_token_id"], list) else [meta["eos_token_id"]]
    hf = [transformers_tokens(folder.parent.parent / "hf_llama", p, 8, eos) for p in prompts]
    assert [[int(t) for t in line.split()] for line in ran.stdout.strip().splitlines()] == hf
