"""The decoder ledger (benchmarks/ledger.py): its census comes from the PyTorch module tree and agrees with the
zoo's hand-written census; its classification gives every exclusion a reason; an exit 3 is reported as an internal
error; and its fixed CI sample of 6 types (ledger.CI_SAMPLE) runs through the CLI, Llama through every stage
(about 1.5 minutes), the other five through export and compile (about 1 minute): two tests, so `-n 2` runs them
side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ledger


# --- the expected census, from PyTorch only -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3", "gpt_neox", "bloom", "smollm3", "mixtral"])
def test_census_from_the_module_tree_matches_the_zoo(name):
    """The zoo's census was written by reading the modeling code; the ledger's is counted by hooks. They agree,
    except that the ledger counts every attention computation (the zoo counts only those a perfect compiler
    fuses: Gemma 2's soft-capped ones are refused)."""
    from models import load_factory
    from models.architectures import ARCHITECTURES

    arch = ARCHITECTURES[name]
    module, inputs, _ = load_factory(arch.factory)()
    got, facts = ledger.expected_census(module, inputs)
    want = {("MoeGating" if k.startswith("MoeGating") else k): v for k, v in arch.census.items() if v}
    want["FlashAttentionScore"] = sum(k["attention"] for k in arch.layer_kinds.values())
    assert got == want, facts


def test_shrink_is_generic():
    """Known keys shrunk, None kept, ids inside the vocabulary, per-layer lists cut to two layers of two kinds
    (a hybrid keeps an attention layer)."""
    kw = ledger.shrink_kwargs({"num_hidden_layers": 4, "hidden_size": 4096, "num_key_value_heads": 8,
                               "q_lora_rank": None, "vocab_size": 151936, "eos_token_id": 151645,
                               "tie_word_embeddings": True, "layer_types": ["lin", "lin", "lin", "full"],
                               "pattern": "MM*M"})
    assert kw == {"num_hidden_layers": 2, "hidden_size": 64, "num_key_value_heads": 2, "vocab_size": 300,
                  "eos_token_id": 2, "layer_types": ["lin", "full"], "pattern": "M*"}


# --- classification and outcomes ---------------------------------------------------------------------------------


def test_exclusions_carry_their_reason():
    enc = ledger.static_exclusion("bert")
    assert enc[0] == "encoder" and "BertForMaskedLM" in enc[1]
    assert ledger.static_exclusion("bart")[0] == "encoder-decoder"
    assert ledger.static_exclusion("mllama")[0] == "multimodal"
    assert ledger.static_exclusion("llama") is None
    assert set(ledger.CI_SAMPLE) <= set(ledger.model_types())


def test_exit_3_is_an_internal_error(tmp_path, monkeypatch):
    """A stage whose graphconv exits 3 is recorded as INTERNAL ERROR with its error line, and the document's
    summary names it in bold."""
    fake = tmp_path / "graphconv"
    fake.write_text("#!/bin/sh\necho 'graphconv: error: internal error: KeyError: boom (--debug for the traceback)'"
                    " >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(ledger, "_graphconv", lambda: [str(fake)])
    res = ledger.run_stage("export", tmp_path, timeout=30)
    assert res["exit"] == 3 and res["outcome"] == "INTERNAL ERROR"
    assert res["reason"] == "internal error: KeyError: boom (--debug for the traceback)"
    data = {"types": {"llama": {"type": "llama", "category": "decoder", "has_cache": True, "expected": {},
                                "stages": {"export": res}}}, "runs": []}
    doc = ledger.render(data, ["llama"], "x")
    assert "| **internal errors (exit 3)** | **1**: llama |" in doc
    assert "**EXIT 3**" in doc
    assert ledger.verdict(data["types"]["llama"]) == "INTERNAL ERROR"
    assert ledger.outcome(None) == "timeout" and ledger.outcome(2) == "verify-failed"


# --- the CI sample through the CLI -----------------------------------------------------------------------------


@pytest.mark.ledger
def test_llama_through_every_stage(tmp_path):
    """Llama: exported, compiled with the fully fused census the module tree expects, exported with its cache,
    compiled to a generation folder and generating transformers' own greedy tokens."""
    doc = tmp_path / "architectures.md"
    assert ledger.main(["--work", str(tmp_path), "--types", "llama", "--timeout", "300", "--doc", str(doc)]) == 0
    e = json.loads((tmp_path / "results.json").read_text())["types"]["llama"]
    assert e["category"] == "decoder" and e["has_cache"]
    assert e["expected"] == {"RmsNorm": 5, "FlashAttentionScore": 2, "RotaryPositionEmbedding": 4, "Swiglu": 2}
    assert [e["stages"][s]["outcome"] for s in ledger.STAGES] == ["ok"] * 5, e["stages"]
    assert e["stages"]["compile"]["census"] == e["expected"]
    assert e["stages"]["compile"]["max_abs"] < 1e-4
    assert e["stages"]["generate"]["token_exact"] and e["stages"]["generate"]["argmax_match"]
    assert ledger.census_misses(e) == [] and ledger.verdict(e) == "verified"
    text = doc.read_text()
    assert "| llama | LlamaForCausalLM | verified | ok | ok | ok | ok | ok | FA 2/2, RMS 5/5, RoPE 4/4, SwiGLU 2/2 |" \
        in text


@pytest.mark.ledger
def test_the_rest_of_the_sample(tmp_path):
    """GPT-NeoX (LayerNorm, exact GELU, partial rotary) through export and compile; Mamba classified a hybrid,
    its export refused with a reason; BERT, BART and Mllama excluded with theirs. No internal error."""
    rest = [t for t in ledger.CI_SAMPLE if t != "llama"]
    assert ledger.main(["--work", str(tmp_path), "--types", ",".join(rest), "--stages", "export,compile",
                        "--timeout", "300"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())["types"]
    neox = res["gpt_neox"]
    assert neox["expected"] == {"LayerNorm": 5, "FlashAttentionScore": 2, "RotaryPositionEmbedding": 4, "GeluExt": 2}
    assert neox["stages"]["compile"]["outcome"] == "ok"
    assert neox["stages"]["compile"]["census"] == neox["expected"], ledger.census_misses(neox)
    mamba = res["mamba"]
    assert mamba["category"] == "hybrid" and "Mamba" in mamba["hybrid"]
    assert mamba["stages"]["export"]["outcome"] == "refused" and mamba["stages"]["export"]["reason"]
    assert {t: res[t]["excluded"] for t in ("bert", "bart", "mllama")} == {
        "bert": "encoder", "bart": "encoder-decoder", "mllama": "multimodal"}
    assert all(s.get("exit") != 3 for e in res.values() for s in e["stages"].values())
