"""graphconv generate GEN_DIR: greedy decoding with the compiled prefill + decode pair reproduces transformers'
`model.generate(do_sample=False)` token for token on a batch of left-padded prompts of different lengths, and
--check finds every step's logits within 1e-4 of onnxruntime's on the same feed.

GEN_DIR is what `graphconv compile X -o GEN_DIR --target cpu` writes (graphconv/generation/build.py; with --target cpu
the target's MindIRs are the cpu ones, so each graph compiles once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from models.hf import INITIALIZER_RANGE  # noqa: E402
from test_hf_export import _gpt2, _llama, _save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]  # left-padded to 7
NEW = 16
TIE = 1e-4  # a step whose top-2 logits in PyTorch are closer than this may go either way


def _gen_dir(model, base: Path, dtype: str = "fp32") -> tuple[Path, Path, Path]:
    """(checkpoint, export folder X, GEN_DIR) for `model` (exported with --dtype `dtype`)."""
    from graphconv.frontend.hf_export import export_checkpoint
    from gen_folder import compile_folder

    src = _save(model, base / "ckpt")
    out = base / "out"
    export_checkpoint(src, out, "text-generation-with-past", dtype=dtype)
    gen = base / "gen"
    report = compile_folder(out, gen, target="cpu")
    # one graph serves both steps: the export found the decode graph at an empty cache equal to PyTorch's prompt;
    # by default its cache is held in place, and its cached steps were checked against onnxruntime
    assert report["status"] == "verified" and report["steps"] == {"prefill": "decode", "decode": "decode"}
    assert report["cache"].get("held_in_place", True), report["cache"]
    assert report["cache"]["cached_steps_check"]["argmax_match"]
    return src, out, gen


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", "generate", *args], capture_output=True, text=True,
                          cwd=ROOT)


def _ids_arg(prompts) -> str:
    return ";".join(",".join(str(t) for t in p) for p in prompts)


def _hf_generate(src: Path, prompts, new: int, eos: int | list[int], pad: int):
    """transformers' greedy generate on the left-padded prompts: per row the new ids (cut after the first eos)
    and the first step where the top-2 logits are within TIE (None if none)."""
    # fp32 compute, as the export's graphs (a bf16 checkpoint's weights are upcast where they are read)
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype=torch.float32).eval()
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), pad, dtype=torch.int64)
    mask = torch.zeros((len(prompts), length), dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = torch.tensor(p)
        mask[r, length - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                             eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True, output_scores=True,
                             output_logits=True)
    eos_set = set(eos if isinstance(eos, list) else [eos])
    rows, ties = [], []
    for r in range(len(prompts)):
        row = out.sequences[r, length:].tolist()
        stop = next((k for k, t in enumerate(row) if t in eos_set), None)
        rows.append(row if stop is None else row[:stop + 1])
        tie = None
        for k in range(len(rows[-1])):
            top2 = torch.topk(out.scores[k][r], 2).values
            if float(top2[0] - top2[1]) < TIE:
                tie = k
                break
        ties.append(tie)
    return rows, ties, [x.numpy() for x in out.logits]


def _match(got: list[list[int]], want: list[list[int]], ties: list) -> list[str]:
    """Compare row by row (up to a near-tie step, inclusive of the steps before it); the table lines."""
    lines = []
    for r, (g, w, tie) in enumerate(zip(got, want, ties)):
        if tie is None:
            assert g == w, f"prompt {r + 1}: graphconv {g} != transformers {w}"
            lines.append(f"prompt {r + 1}: {len(w)} tokens equal")
        else:
            assert g[:tie] == w[:tie], f"prompt {r + 1} (near-tie at step {tie}): {g[:tie]} != {w[:tie]}"
            lines.append(f"prompt {r + 1}: near-tie at step {tie}: the {tie} tokens before it equal")
    return lines


@pytest.fixture(scope="module")
def llama_gen(tmp_path_factory):
    torch.manual_seed(0)
    return _gen_dir(_llama(), tmp_path_factory.mktemp("gen-llama"))


def _generate_matches_transformers(src: Path, gen: Path, eos, pad: int) -> dict:
    t0 = time.perf_counter()
    proc = _run(str(gen), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens", str(NEW), "--check", "--json")
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    want, ties, hf_logits = _hf_generate(src, PROMPTS, NEW, eos, pad)
    for line in _match(result["sequences"], want, ties):
        print(line)
    # Every step's logits against PyTorch's (not only onnxruntime's), on the rows still generating.
    import graphconv

    api = graphconv.generate(gen, PROMPTS, NEW, check=True)
    worst = 0.0
    for k, ms_step in enumerate(api.step_logits):
        for r, w in enumerate(want):
            if k < len(w) and (ties[r] is None or k < ties[r]):
                worst = max(worst, float(np.abs(ms_step[r] - hf_logits[k][r]).max()))
    assert worst <= 1e-4, worst
    print(f"logits vs PyTorch, every step: max_abs {worst:.3g}")
    assert result["prompt_lengths"] == [len(p) for p in PROMPTS] and result["device"] == "cpu"
    assert "running the cpu MindIRs" in proc.stderr  # the one note line (no Ascend here)
    steps = result["steps"]
    assert [s["step"] for s in steps] == list(range(max(map(len, result["sequences"]))))
    assert all(s["argmax_match"] and s["max_abs"] <= 1e-4 for s in steps)
    print(f"generate --check: {seconds:.1f}s; max_abs {max(s['max_abs'] for s in steps):.3g}; decode "
          f"{1000 * np.median(result['timings']['decode']):.1f} ms/token (median)")
    return result


def test_llama_generate_matches_transformers_and_onnxruntime(llama_gen):
    src, _, gen = llama_gen
    meta = json.loads((gen / "generation.json").read_text())
    assert meta["pad_token_id"] is None and meta["eos_token_id"] == 2  # pad falls back to eos, as in transformers
    result = _generate_matches_transformers(src, gen, eos=2, pad=2)
    assert len(result["steps"]) == NEW or "eos" in result["finish_reasons"]


def test_llama_rows_stop_at_eos(llama_gen, tmp_path):
    """eos set to a token the second prompt makes early: that row stops (its sequence ends at the eos, then it
    is fed the pad id with its mask growing), the others go on; the same as transformers with that eos."""
    import graphconv

    src, _, gen = llama_gen
    free, _, _ = _hf_generate(src, PROMPTS, NEW, eos=2, pad=2)
    eos = free[1][3]  # prompt 2's fourth new token
    assert eos not in free[1][:3]
    other = tmp_path / "gen"
    other.mkdir()
    for f in ("prefill.cpu.mindir", "decode.cpu.mindir"):
        (other / f).symlink_to(gen / f)
    meta = json.loads((gen / "generation.json").read_text())
    (other / "generation.json").write_text(json.dumps({**meta, "eos_token_id": eos, "pad_token_id": 0}))

    result = graphconv.generate(other, PROMPTS, NEW, check=True)
    assert isinstance(result, graphconv.GenerationResult)
    want, ties, _ = _hf_generate(src, PROMPTS, NEW, eos=eos, pad=0)
    for line in _match(result.sequences, want, ties):
        print(f"eos {eos}: {line}")
    assert result.sequences[1] == free[1][:4] and result.finish_reasons[1] == "eos"
    for r, seq in enumerate(result.sequences):
        assert result.finish_reasons[r] == ("eos" if eos in seq else "length")
        assert eos not in seq[:-1] and (result.finish_reasons[r] == "eos" or len(seq) == NEW)
    assert all(s["argmax_match"] for s in result.steps)


def test_check_fails_beyond_the_tolerance(llama_gen):
    import graphconv

    _, _, gen = llama_gen
    with pytest.raises(graphconv.VerificationError, match=r"step 0 \(prefill\).*max_abs") as info:
        graphconv.generate(gen, PROMPTS[:1], 2, check=True, atol=1e-12)
    assert info.value.exit_code == 2 and info.value.result.steps


def _cli(capsys, *args: str) -> tuple[int, str]:
    from graphconv.cli import main

    with pytest.raises(SystemExit) as info:
        main(["generate", *args])
    err = capsys.readouterr().err.strip()
    return info.value.code, err


@pytest.mark.parametrize("case", ["no generation.json", "no mindirs", "empty prompt", "outside the vocab",
                                  "text without a tokenizer",
                                  "max-new-tokens 0", "ascend", "no onnx for --check", "both id options",
                                  "bad ids file"])
def test_bad_input_is_one_line_exit_1(llama_gen, tmp_path, capsys, case):
    from graphconv.generation.run import ascend_available

    _, _, gen = llama_gen
    empty = tmp_path / "empty"
    empty.mkdir()
    bare = tmp_path / "bare"
    bare.mkdir()
    meta = json.loads((gen / "generation.json").read_text())
    (bare / "generation.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "source_dir"}))
    ids_file = tmp_path / "ids.json"
    ids_file.write_text("[[1, 2], [3")
    args, match = {
        "no generation.json": ([str(empty), "--input-ids", "1,2"], "no generation.json"),
        "no mindirs": ([str(bare), "--input-ids", "1,2", "--device", "cpu"], "decode.cpu.mindir"),
        "empty prompt": ([str(gen), "--input-ids", "1,2;"], "prompt 2 is empty"),
        "outside the vocab": ([str(gen), "--input-ids", "1,2;3,128"], "token id 128 is outside the vocabulary"),
        "max-new-tokens 0": ([str(gen), "--input-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens"),
        "ascend": ([str(gen), "--input-ids", "1,2", "--device", "ascend"], "no Ascend device"),
        "no onnx for --check": ([str(bare), "--input-ids", "1,2", "--check"], "not in"),
        "both id options": ([str(gen), "--input-ids", "1,2", "--input-ids-file", str(ids_file)], "one of them"),
        "text without a tokenizer": ([str(gen), "--prompt", "hello"], "no tokenizer"),
        "bad ids file": ([str(gen), "--input-ids-file", str(ids_file)], "not JSON"),
    }[case]
    if case == "ascend" and ascend_available():
        pytest.skip("this host has an Ascend device")
    if case == "no onnx for --check":
        for f in gen.glob("*.cpu.mindir"):
            (bare / f.name).symlink_to(f)
    code, err = _cli(capsys, *args)
    assert code == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("graphconv: error: ") and match in err, err
    assert "Traceback" not in err


def test_a_model_too_large_for_this_hosts_memory_is_refused_before_mindspore(llama_gen, monkeypatch):
    """On MindSpore CPU a whole decoder needs several fp32 copies of its weights (the 1.1B benchmark was killed
    at 23 GiB): where the host has less than that, one line and exit 1, not a child killed by the kernel."""
    import collections

    import psutil

    import graphconv

    _, _, gen = llama_gen
    weights = (gen / "decode.cpu.mindir").stat().st_size
    memory = collections.namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(weights * 2))
    with pytest.raises(graphconv.UnsupportedError, match=r"need about .* to generate on MindSpore CPU"):
        graphconv.generate(gen, [[1, 2, 3]], 2, device="cpu")


def test_input_ids_file_and_plain_output(llama_gen, tmp_path):
    """A JSON file of prompts; the plain output is one line of new ids per prompt; --onnx-dir finds the pair."""
    _, out, gen = llama_gen
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(PROMPTS[1:]))
    proc = _run(str(gen), "--input-ids-file", str(ids_file), "--max-new-tokens", "3", "--check", "--onnx-dir",
                str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 3 for line in lines)
    assert "check: 3 steps match onnxruntime" in proc.stderr


def test_relative_paths_from_another_directory(llama_gen, tmp_path):
    """A user in some other directory names GEN_DIR and the ONNX pair relatively: the same tokens as the
    absolute paths give (the MindSpore child works in a directory of its own)."""
    _, out, gen = llama_gen
    ids = _ids_arg(PROMPTS[:2])
    absolute = _run(str(gen), "--input-ids", ids, "--max-new-tokens", "3")
    here = tmp_path / "elsewhere"
    here.mkdir()
    relative = subprocess.run([sys.executable, "-m", "graphconv", "generate", os.path.relpath(gen, here), "--input-ids",
                               ids, "--max-new-tokens", "3", "--check", "--onnx-dir", os.path.relpath(out, here)],
                              capture_output=True, text=True, cwd=here,
                              env={**os.environ,
                                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert absolute.returncode == 0 and relative.returncode == 0, relative.stderr
    assert relative.stdout == absolute.stdout and len(relative.stdout.splitlines()) == 2
    assert list(here.iterdir()) == []


def test_bf16_checkpoint_generates_as_transformers_in_fp32(tmp_path):
    """A bf16 checkpoint (as real ones are) exported with --dtype auto: the weights stay bf16, the cache and the
    compute fp32 (generation.json's cache_dtype), and the tokens are transformers' fp32 model's."""
    torch.manual_seed(0)
    src, out, gen = _gen_dir(_llama().to(torch.bfloat16), tmp_path, dtype="auto")
    meta = json.loads((out / "generation.json").read_text())
    assert (meta["dtype"], meta["cache_dtype"]) == ("bf16", "fp32")
    _generate_matches_transformers(src, gen, eos=2, pad=2)


def test_sliding_window_mistral_generates_as_transformers(tmp_path):
    """Mistral with a window of 4 (shorter than every prompt plus its new tokens): transformers' cache keeps only
    the window; the exported cache is kept whole and the model's sliding mask keeps the window. The window
    matters: the same weights with full attention generate other tokens."""
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(**_DECODER, sliding_window=4))
    src, _, gen = _gen_dir(model, tmp_path)
    _generate_matches_transformers(src, gen, eos=2, pad=2)
    full = tmp_path / "full-attention"
    model.config.sliding_window = None
    model.save_pretrained(full)
    assert _hf_generate(full, PROMPTS, NEW, 2, 2)[0] != _hf_generate(src, PROMPTS, NEW, 2, 2)[0]


@pytest.mark.parametrize("multi_token_decode", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_folder_from_transformers_own_exporter_generates_as_transformers(tmp_path, multi_token_decode):
    """`transformers.exporters.OnnxExporter().export_for_generation(...)` + `save_pretrained` (prefill.onnx,
    decode.onnx with a one-token or a multi-token query, export.json): `graphconv compile` takes the folder as
    a generation source (its cache names and unrelated mask symbols translated) and `generate` gives
    transformers' tokens."""
    from transformers.exporters import OnnxConfig, OnnxExporter

    from gen_folder import compile_folder

    torch.manual_seed(0)
    model = _llama().eval()
    src = _save(model, tmp_path / "ckpt")
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    exported = OnnxExporter().export_for_generation(model, {"input_ids": ids, "attention_mask": mask},
                                                    OnnxConfig(dynamic=True), multi_token_decode=multi_token_decode)
    folder = tmp_path / "exported"
    exported.save_pretrained(folder)
    assert {"prefill.onnx", "decode.onnx", "export.json"} <= {p.name for p in folder.iterdir()}
    gen = tmp_path / "gen"
    report = compile_folder(folder, gen, target="cpu")
    # a multi-token decode graph serves the prompt: one graph, its cache held in place; a one-token one cannot
    one = "decode" if multi_token_decode else "prefill"
    assert report["status"] == "verified" and report["steps"] == {"prefill": one, "decode": "decode"}
    assert multi_token_decode or "takes 1 token(s) a call" in report["cache"]["why"]
    _generate_matches_transformers(src, gen, eos=2, pad=2)


def test_a_static_cache_folder_from_transformers_exporter_is_refused_with_the_reason(tmp_path):
    """export_for_generation with `cache_implementation="static"` writes graphs whose cache is a fixed-size
    buffer written by ScatterND at a cumulative length, with a 4-D mask: refused in one line naming that
    (it was an internal error), exit 1, nothing written."""
    from transformers import GenerationConfig
    from transformers.exporters import OnnxConfig, OnnxExporter

    torch.manual_seed(0)
    model = _llama().eval()
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    exported = OnnxExporter().export_for_generation(
        model, {"input_ids": ids, "attention_mask": mask}, OnnxConfig(dynamic=True),
        generation_config=GenerationConfig(cache_implementation="static", max_length=32))
    exported.save_pretrained(tmp_path / "exported")
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(tmp_path / "exported"), "-o",
                           str(tmp_path / "gen")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "a static cache (written by ScatterND at cumulative_length)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "gen").exists(), proc.stderr


def test_text_prompts_are_encoded_and_the_output_decoded(tmp_path):
    """--prompt TEXT: the checkpoint's tokenizer (a WordLevel one here, saved beside the weights) travels with
    the export and the compile; the prompts are encoded by it and the new tokens decoded, as transformers'
    tokenizer does for its own generate."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = _llama()
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2")
    base = tmp_path / "m"
    base.mkdir()
    tok.save_pretrained(base / "ckpt")
    src, out, gen = _gen_dir(model, base)
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (gen / "tokenizer" / "tokenizer.json").is_file()
    texts = ["t5 t6 t7 t8 t9 t10 t11", "t12 t13", "t15 t16 t17 t18 t19"]
    proc = _run(str(gen), *[a for t in texts for a in ("--prompt", t)], "--max-new-tokens", str(NEW), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    user = tf.AutoTokenizer.from_pretrained(str(src), local_files_only=True)  # as a user loads it
    prompts = [user(t)["input_ids"] for t in texts]
    assert result["prompt_lengths"] == [len(p) for p in prompts]
    want, ties, _ = _hf_generate(src, prompts, NEW, 2, 2)
    assert not any(t is not None for t in ties) and result["sequences"] == want
    assert result["texts"] == [user.decode(w, skip_special_tokens=True) for w in want]
    plain = _run(str(gen), "--prompt", texts[1], "--max-new-tokens", str(NEW))
    assert plain.returncode == 0 and plain.stdout.splitlines() == [json.dumps(result["texts"][1])]


def test_gpt2_generate_matches_transformers_and_onnxruntime(tmp_path):
    """GPT-2: learned absolute positions (the left-padded rows' position_ids matter), eos = pad = 127."""
    torch.manual_seed(0)
    src, _, gen = _gen_dir(_gpt2(), tmp_path)
    _generate_matches_transformers(src, gen, eos=127, pad=127)


_DECODER = dict(vocab_size=128, initializer_range=INITIALIZER_RANGE, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                bos_token_id=1, eos_token_id=2)
ARCHITECTURES = {  # transformers classes from tiny configs, default settings (sdpa)
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_DECODER)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_DECODER, head_dim=16)),  # q/k RMSNorms
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**_DECODER, head_dim=16)),  # scaled embeddings, GeGLU
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**_DECODER, pad_token_id=0)),  # fused qkv and gate_up
    # sliding windows of 4 (prompts of 3-7 tokens, 16 new): sliding and global layers mixed, soft-capped scores
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**_DECODER, head_dim=16, sliding_window=4)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_DECODER, head_dim=16, sliding_window=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architecture_generate_matches_transformers(arch, tmp_path):
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]()
    src, _, gen = _gen_dir(model, tmp_path)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 2
    _generate_matches_transformers(src, gen, eos=2, pad=pad)


def test_gen_dir_layout_is_what_generate_reads(llama_gen):
    """What `graphconv compile X -o GEN_DIR` writes and generate reads: no ONNX copied into GEN_DIR, --check
    reads source_dir."""
    _, out, gen = llama_gen
    assert sorted(p.name for p in gen.iterdir()) == ["decode.cpu.mindir", "decode.mindir", "generation.json",
                                                     "report.json"]
    meta = json.loads((gen / "generation.json").read_text())
    assert meta["source_dir"] == str(out.resolve())
    # one graph for both steps: the prompt is the decode graph's at an empty cache
    assert meta["graphs"]["prefill"] == {**meta["graphs"]["decode"], "empty_cache": True}
    assert meta["graphs"]["decode"]["mindir"] == "decode"


def test_sampling_repeats_with_its_seed_and_top_k_1_is_greedy(llama_gen):
    """--do-sample: the seed repeats the tokens and another seed changes them (temperature 3 over the tiny
    model's vocabulary); top_k 1 leaves one token, so it gives greedy's tokens; --check holds (it compares the
    logits on the sampled feed, and each step's argmax with onnxruntime's); the settings used are reported."""
    _, _, gen = llama_gen
    args = (str(gen), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens", "8")
    greedy = _run(*args)
    first = _run(*args, "--do-sample", "--temperature", "3", "--seed", "5", "--check", "--json")
    again = _run(*args, "--do-sample", "--temperature", "3", "--seed", "5")
    other = _run(*args, "--do-sample", "--temperature", "3", "--seed", "6")
    top1 = _run(*args, "--do-sample", "--top-k", "1", "--seed", "9")
    for proc in (greedy, first, again, other, top1):
        assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(first.stdout)
    assert result["sampling"] == {"temperature": 3.0, "top_k": 50, "top_p": 1.0, "seed": 5}
    assert len(result["steps"]) == 8 and all(s["argmax_match"] for s in result["steps"])
    sampled = [" ".join(map(str, s)) for s in result["sequences"]]
    assert again.stdout.split("\n")[:3] == sampled
    assert other.stdout.split("\n")[:3] != sampled
    assert sampled != greedy.stdout.split("\n")[:3]
    assert top1.stdout == greedy.stdout
    assert "note: sampling: temperature 1.0, top_k 1, top_p 1.0, seed 9" in top1.stderr


@pytest.mark.parametrize("flags, code, says", [
    (["--temperature", "0.5", "--seed", "1"], 1, "--temperature, --seed go(es) with --do-sample"),
    (["--do-sample", "--temperature", "0"], 1, "temperature must be > 0"),
    (["--do-sample", "--top-p", "1.5"], 1, "top_p must be in (0, 1]"),
])
def test_sampling_flags_are_checked(llama_gen, flags, code, says):
    _, _, gen = llama_gen
    proc = _run(str(gen), "--input-ids", "5,6", *flags)
    assert proc.returncode == code and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_pair_bundle_generates_the_same_tokens_with_its_own_script(llama_gen, tmp_path):
    """--bundle on a pair: each graph's bundle and generate_mindspore.py, which carries graphconv's greedy loop
    verbatim and, run with MindSpore alone (--device CPU: a --target cpu pair), prints the tokens
    `graphconv generate` does."""
    import inspect

    from gen_folder import compile_folder
    from graphconv.runtime import decoding

    _, out, gen = llama_gen
    bundle = tmp_path / "bundle"
    compile_folder(out, tmp_path / "gen", target="cpu", bundle=bundle)
    assert sorted(p.name for p in bundle.iterdir()) == ["README.md", "decode", "generate_mindspore.py",
                                                        "generation.json"]
    assert (bundle / "decode" / "model" / "decode.mindir").is_file()
    script = (bundle / "generate_mindspore.py").read_text()
    assert inspect.getsource(decoding.decode_loop) in script  # the loop, copied
    assert "import graphconv" not in script and "from graphconv" not in script
    ran = subprocess.run([sys.executable, str(bundle / "generate_mindspore.py"), "--input-ids", _ids_arg(PROMPTS),
                          "--max-new-tokens", "6", "--device", "CPU"], capture_output=True, text=True,
                         cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    ours = _run(str(gen), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens", "6")
    assert ours.returncode == 0 and ran.stdout.split("\n") == ours.stdout.split("\n")
    sample = ["--do-sample", "--temperature", "3", "--seed", "11"]
    ran = subprocess.run([sys.executable, str(bundle / "generate_mindspore.py"), "--input-ids", _ids_arg(PROMPTS),
                          "--max-new-tokens", "6", "--device", "CPU", *sample], capture_output=True, text=True,
                         cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=300)
    ours_sampled = _run(str(gen), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens", "6", *sample)
    assert ran.returncode == 0 and ours_sampled.returncode == 0, ran.stderr[-2000:] + ours_sampled.stderr[-2000:]
    assert ran.stdout == ours_sampled.stdout != ours.stdout


def test_the_cpu_twin_is_written_only_where_this_host_can_run_it(llama_gen, tmp_path, monkeypatch):
    """An ascend compile writes decode.cpu.mindir where `generate` could run it here (its memory rule); where
    it could not, the MindIR is not written (the ascend MindIR is verified all the same, on its twin network),
    the report and generation.json say why, and a cpu generate names the reason and --cpu-twin. --cpu-twin
    writes it anyway."""
    from graphconv.generation import run as generation
    from gen_folder import compile_folder

    _, out, _ = llama_gen
    monkeypatch.setattr(generation, "fits_in_memory", lambda mindirs, gen: "needs about 25 GiB, 23.0 available")
    gen = tmp_path / "gen"
    report = compile_folder(out, gen, target="ascend")
    assert report["status"] == "verified" and (gen / "decode.mindir").is_file()
    assert not (gen / "decode.cpu.mindir").exists() and "decode_cpu" not in report["artifacts"]
    assert report["cpu_twins"]["decode"] == {"status": "not written", "reason": "needs about 25 GiB, 23.0 available"}
    import graphconv

    with pytest.raises(graphconv.UnsupportedError, match=r"no cpu MindIR, the compile did not write it: needs about 25 "
                                                          r"GiB.*--cpu-twin"):
        graphconv.generate(gen, [[1, 2, 3]], 2, device="cpu")
    forced = compile_folder(out, tmp_path / "forced", target="ascend", cpu_twin=True)
    assert (tmp_path / "forced" / "decode.cpu.mindir").is_file()
    assert forced["cpu_twins"]["decode"]["status"] == "verified"


def test_a_failed_verification_writes_the_report_and_nothing_else(llama_gen, tmp_path):
    """As a plain compile does: exit 2, the --report file says how the run ended and holds each failed
    comparison (the error's message points there), and no generation folder is left."""
    _, out, _ = llama_gen
    gen, report = tmp_path / "gen", tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(out), "-o", str(gen), "--target", "cpu",
                           "--atol", "0", "--rtol", "0", "--report", str(report), "-q"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("graphconv: error: verification failed") and proc.stderr.count("\n") == 1
    written = json.loads(report.read_text())
    assert written["status"] == "failed" and written["exit_code"] == 2
    failed = written["graphs"]["decode"]["validation"]
    assert failed["status"] == "failed"
    assert any(not o["ok"] for c in failed["cases"] for o in c["outputs"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_pad_id_outside_the_vocabulary_is_passed_over():
    """GPTJConfig's default eos 50256 with a 256-token vocabulary: padding with it failed MindSpore's Gather
    (exit 3 in the generation check); the next candidate inside the vocabulary pads instead."""
    from graphconv.runtime.decoding import pad_id

    assert pad_id({"eos_token_id": 50256, "vocab_size": 256}) == 0
    assert pad_id({"pad_token_id": 300, "eos_token_id": [7, 9], "vocab_size": 256}) == 7
    assert pad_id({"pad_token_id": 5, "eos_token_id": 7, "vocab_size": 256}) == 5
    assert pad_id({"eos_token_id": 50256}) == 50256  # (no vocabulary size known: as configured)


def test_the_checks_onnxruntime_takes_bf16_weights_from_external_data(tmp_path):
    """`generate --check` (and the compile's cached-steps check) feeds onnxruntime the weights from their files:
    a --dtype auto export's bf16 weights go in as OrtValues (onnxruntime's numpy bridge does not know
    ml_dtypes' bfloat16: an internal error on the 1.1B's folder before)."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from graphconv.generation import check

    w = (np.arange(64 * 64) % 16).astype(np.float32).reshape(64, 64) / 8  # (large enough to stay in its file)
    nodes = [helper.make_node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w32"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])],
                          [numpy_helper.from_array(w.astype(ml_dtypes.bfloat16), "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.external_data_helper.convert_model_to_external_data(model, location="m.onnx.data", size_threshold=0)
    onnx.save(model, tmp_path / "m.onnx")
    session, feeds = check.oracle_session(tmp_path / "m.onnx")
    assert list(feeds) == ["w"]
    x = np.ones((2, 64), np.float32)
    (y,) = session.run(None, {"x": x, **feeds})
    np.testing.assert_array_equal(y, x @ w)  # (these values are exact in bf16)
