"""A ledger of every decoder-only text causal-LM type of the pinned transformers (issue 35, item 1).

For each model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: classify it (excluded with a reason:
encoders with a LM head, encoder-decoder decoders, multimodal wrappers; SSM / linear-attention hybrids ledgered
in their own row), build it from its config class with sizes shrunk generically, count the fused census a
perfect compiler should produce *from the PyTorch module tree* (forward hooks on one forward pass: norms,
attention modules, rotary applications, MLP activations, MoE routers), save it with `save_pretrained`, and run
the documented CLI on it, each stage in its own subprocess with a timeout:

    export        graphconv export CKPT -o exp --task text-generation
    compile       graphconv compile exp/model.onnx --report compile.json   (the census, max abs)
    export-past   graphconv export CKPT -o past --task text-generation-with-past   (classes with a cache)
    compile-past  graphconv compile past -o gen
    generate      graphconv generate gen --check --json   (tokens compared with transformers' greedy generate)

Results go to WORK/results.json (one entry per type, written after every stage, so `--resume` continues where a
run stopped); `--doc` writes docs/architectures.md from them. Expected counts never come from graphconv.

    python benchmarks/ledger.py --work /tmp/ledger [--types llama,qwen3] [--stages export,compile] [--resume]
                                [--timeout 600] [--doc docs/architectures.md] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("export", "compile", "export-past", "compile-past", "generate")
# Fused primitives the ledger counts, with the coverage family whose refusals explain a miss.
FAMILY = {"FlashAttentionScore": "attention", "RmsNorm": "norm", "LayerNorm": "norm",
          "RotaryPositionEmbedding": "rotary", "Swiglu": "gated_mlp", "GeLU": "gelu", "GeluExt": "gelu",
          "FastGeLU": "gelu", "MoeGating": "moe"}
PROMPTS = [[5, 6, 7, 8], [9, 10]]
NEW_TOKENS = 8
SEED = 0
# The fixed sample CI runs (tests/test_ledger.py): one fully fused dense decoder through every stage, a
# LayerNorm/GELU decoder, an SSM, and one type of each exclusion.
CI_SAMPLE = ["llama", "gpt_neox", "mamba", "bert", "bart", "mllama"]

# --- exit codes and reasons --------------------------------------------------------------------------------------

OUTCOME = {0: "ok", 1: "refused", 2: "verify-failed", 3: "INTERNAL ERROR", 130: "interrupted", 143: "interrupted"}


def outcome(code: int | None) -> str:
    """The ledger's word for a stage's exit code; exit 3 (graphconv's internal error) is spelled loudly."""
    if code is None:
        return "timeout"
    return OUTCOME.get(code, f"exit {code}")


def reason_from(stderr: str, limit: int = 240) -> str:
    """The one-line reason of a failed stage: graphconv's `error:` line, else the last non-empty line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    line = (errors[-1] if errors else lines[-1]) if lines else "(no output)"
    line = re.sub(r"^graphconv: (error: )?", "", line)
    line = line.replace(str(ROOT) + "/", "").replace("|", "/")
    return line if len(line) <= limit else line[: limit - 1] + "…"


# --- enumeration and classification ------------------------------------------------------------------------------

# Module class names marking a state-space or linear-attention layer (ledgered in their own row).
_HYBRID = re.compile(r"Mamba|SSM|Mixer$|DeltaNet|LinearAttention|Lightning|Recurrent|Rwkv|RWKV|xLSTM|mLSTM|sLSTM|"
                     r"ShortConv|Conv1dLayer|RGLRU|KimiDelta|Linear(Attn|Attention)")


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def static_exclusion(model_type: str) -> tuple[str, str] | None:
    """(category, reason) for a type the auto mappings alone exclude, else None."""
    from transformers.models.auto import modeling_auto as ma

    cls = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if model_type in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or \
            model_type in ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        seq2seq = (ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(model_type)
                   or ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES[model_type])
        return "encoder-decoder", f"{cls} is the decoder of the encoder-decoder {seq2seq}"
    if model_type in ma.MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES or \
            model_type in ma.MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES:
        return "multimodal", f"{cls}: a decoder of audio codes (a text-to-audio model), not of text"
    if model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder", (f"an encoder with a LM head: the type's masked LM is "
                           f"{ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type]}; {cls} runs it with is_decoder")
    if model_type in ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or "ConditionalGeneration" in cls:
        return "multimodal", f"{cls}: a multimodal wrapper (its text decoder is ledgered under its own type)"
    return None


def dynamic_exclusion(config, model) -> tuple[str, str] | None:
    """(category, reason) from the built config and module tree: sub-configs of other modalities, cross
    attention, encoder-decoder flags."""
    subs = [k for k in ("vision_config", "audio_config", "speech_config", "vq_config", "encoder_config",
                        "depth_decoder_config", "audio_encoder_config") if getattr(config, k, None) is not None]
    if subs:
        text = getattr(config, "text_config", None)
        tt = f"; its text decoder is type {text.model_type!r}" if text is not None else ""
        return "multimodal", f"a multimodal wrapper ({', '.join(subs)}){tt}"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder", "config.is_encoder_decoder"
    cross = [n for n, _ in model.named_modules() if re.search(r"(encoder_attn|crossattention|cross_attn)$", n)]
    if cross:
        return "encoder-decoder", f"the decoder of an encoder-decoder: cross attention ({cross[0]})"
    bert = [n for n, _ in model.named_modules() if n.endswith(".attention.self")]
    if bert:  # BertGeneration: BERT's layer layout, a causal mask on request (is_decoder)
        return "encoder", f"an encoder with a LM head: BERT's layer layout ({bert[0]}), causal with is_decoder"
    return None


def hybrid_reason(model) -> str:
    """The first state-space / linear-attention module of the tree, '' when there is none."""
    for name, m in model.named_modules():
        if name and _HYBRID.search(type(m).__name__):
            return f"{type(m).__name__} ({name})"
    return ""


# --- generic shrinking -------------------------------------------------------------------------------------------

# Config keys set when the config class has them (any of each group's spellings). Why these sizes: the issue's
# generic shrink (layers 2, hidden 64, heads 4/2, vocab ~300, experts 4), head_dim 16.
SHRINK = {
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"): 2,
    ("hidden_size", "n_embd", "d_model", "hidden_dim", "dim", "embed_dim"): 64,
    ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim", "d_ff", "inner_hidden_size"):
        128,
    ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
     "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size"): 64,
    ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups"): 2,
    ("head_dim", "kv_channels", "attention_head_dim"): 16,
    ("vocab_size", "n_vocab"): 300,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts"): 4,
    ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"): 2,
    ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"): 1,
    ("n_group", "topk_group"): 1,
    ("first_k_dense_replace", "first_k_dense", "moe_layer_start_index"): 1,
    ("kv_lora_rank",): 32, ("q_lora_rank",): 32, ("qk_rope_head_dim",): 16, ("qk_nope_head_dim",): 16,
    ("rotary_dim",): 8,  # GPT-J, CodeGen: partial rotary inside the shrunk head_dim 16
    ("v_head_dim",): 16,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"): 256,
    ("state_size", "ssm_state_size", "mamba_d_state"): 16,
    ("mamba_n_heads", "linear_num_value_heads"): 4, ("linear_num_key_heads",): 2,
    ("mamba_d_head", "linear_key_head_dim", "linear_value_head_dim", "mamba_head_dim"): 16,
    ("time_step_rank",): 8,
    ("initializer_range", "init_std"): 0.2,  # as models/hf.py: outputs of a useful size, misplaced terms show
}
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def shrink_kwargs(defaults: dict) -> dict:
    """Constructor kwargs shrinking a config whose default `to_dict()` is `defaults` (keys it has, set to a
    non-None value, only; None stays None: q_lora_rank None means no q compression)."""
    kw = {}
    for keys, value in SHRINK.items():
        for k in keys:
            v = defaults.get(k)
            if k in defaults and isinstance(v, (int, float)) and not isinstance(v, bool):
                kw[k] = value
    if "head_dim" in defaults and defaults["head_dim"] is None:  # Ministral, Hunyuan: None is not derived
        kw["head_dim"] = 16
    for k, v in defaults.items():  # Bamba's attn_layer_indices: the second layer attends
        if k.endswith("layer_indices") and isinstance(v, list) and v:
            kw[k] = [1]
    for k in TOKEN_KEYS:  # special ids inside the shrunk vocabulary
        v = defaults.get(k)
        if isinstance(v, int) and v >= 300:
            kw[k] = {"pad_token_id": 0, "bos_token_id": 1}.get(k, 2)
        elif isinstance(v, list):
            kw[k] = [i if i < 300 else 2 for i in v]
    layers = next((defaults[k] for k in SHRINK_LAYER_KEYS if isinstance(defaults.get(k), int)), None)
    for k, v in defaults.items():  # per-layer lists and patterns: two layers, of two kinds where there are two
        if isinstance(v, (list, str)) and layers and len(v) == layers and k not in ("architectures",):
            kw[k] = _two_layers(v)
    if isinstance(defaults.get("attention_types"), list):  # GPT-Neo: [[["global", "local"], 12]]
        kw["attention_types"] = [[defaults["attention_types"][0][0], 1]]
    for k in ("attn_layer_period", "expert_layer_period"):  # Jamba: every 2nd layer, the second one
        if isinstance(defaults.get(k), int):
            kw[k], kw[k.replace("period", "offset")] = 2, 1
    expand = defaults.get("mamba_expand") or defaults.get("expand")
    if isinstance(expand, (int, float)) and any(k in defaults for k in ("state_size", "ssm_state_size",
                                                                        "mamba_d_state")):
        # Mamba-2 heads tile the inner width expand x hidden: heads x head_dim 16 must equal it
        for k in ("mamba_n_heads", "num_heads"):
            if k in kw:
                kw[k] = int(expand * kw.get("hidden_size", 64)) // 16
        for k in ("n_groups", "mamba_n_groups"):
            if isinstance(defaults.get(k), int):
                kw[k] = 1
    if isinstance(defaults.get("kv_lora_rank"), int):  # MLA decompresses one k/v per query head: no GQA
        for k in ("num_key_value_heads",):
            if k in kw:
                kw[k] = 4
    for k in ("index_n_heads", "index_num_heads"):  # DeepSeek-V3.2's indexer: at most the query heads
        if isinstance(defaults.get(k), int):
            kw[k] = 2
    if isinstance(defaults.get("index_head_dim"), int):
        kw["index_head_dim"] = 16
    return kw


SHRINK_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _two_layers(v):
    """The first layer and the first of another kind (a hybrid keeps one attention layer), in order."""
    other = next((i for i, x in enumerate(v) if x != v[0]), 1)
    two = [v[0], v[other]]
    return "".join(two) if isinstance(v, str) else two


def build_config(model_type: str):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    kw = shrink_kwargs(defaults.to_dict())
    return AutoConfig.for_model(model_type, **kw), kw


# --- the expected census, from the PyTorch module tree ----------------------------------------------------------

_ACT = {"SiLUActivation": "silu", "SiLU": "silu", "NewGELUActivation": "GeLU", "GELUTanh": "GeLU",
        "PytorchGELUTanh": "GeLU", "FastGELUActivation": "GeLU", "GELUActivation": "GeluExt", "GELU": None,
        "QuickGELUActivation": "FastGeLU", "BloomGelu": "GeLU"}


def _act_primitive(m) -> str | None:
    name = type(m).__name__
    if name == "GELU":  # torch.nn.GELU: its approximate attribute decides
        return "GeLU" if getattr(m, "approximate", "none") == "tanh" else "GeluExt"
    if name == "GELUActivation" and getattr(m, "act", None) is not None:
        return "GeluExt"
    return _ACT.get(name)


def _gated(parent) -> bool:
    """An MLP whose activation gates a second projection (gate/up, w1/w3, merged gate_up, batched experts)."""
    names = {n for n, _ in parent.named_children()} | {n for n, _ in parent.named_parameters(recurse=False)}
    return bool({"gate_proj", "up_proj"} <= names or {"w1", "w3"} <= names or "gate_up_proj" in names
                or {"gate", "up"} <= names or "fc1_g" in names or "w_gate" in names)


def expected_census(model, inputs: dict) -> tuple[dict, dict]:
    """Call-weighted counts per fused primitive from one forward pass of `model` (forward hooks on the module
    tree, plus the modeling module's `apply_rotary*` functions), and the facts they came from."""
    import torch

    counts: dict[str, int] = {}
    facts: dict[str, set] = {}

    def add(prim: str, n: int, why: str):
        counts[prim] = counts.get(prim, 0) + n
        facts.setdefault(prim, set()).add(why)

    handles = []
    attention = [m for m in model.modules() if re.search(r"Attention\d*$|Attn$", type(m).__name__)
                 and not _HYBRID.search(type(m).__name__)]
    outer = set()
    for m in attention:  # outermost attention modules only (an attention holding an attention counts once)
        if not any(m is not a and any(c is m for c in a.modules()) for a in attention):
            outer.add(id(m))
    parents = {id(c): p for p in model.modules() for c in p.children()}
    for m in model.modules():
        cls = type(m).__name__
        prim = None
        if re.search(r"rms_?norm", cls, re.I):
            prim = "RmsNorm"
        elif isinstance(m, torch.nn.LayerNorm) or re.search(r"LayerNorm$", cls):
            prim = "LayerNorm"
        elif id(m) in outer:
            prim = "FlashAttentionScore"
        elif (re.search(r"Router$|TopkRouter$|TopKRouter$|Gate$", cls)
              and "Moe" in type(parents.get(id(m), m)).__name__
              or re.search(r"Router$|TopkRouter$|TopKRouter$", cls)):
            prim = "MoeGating"
        else:
            act = _act_primitive(m)
            if act is not None:
                parent = parents.get(id(m))
                gated = parent is not None and _gated(parent)
                if act == "silu":
                    prim = "Swiglu" if gated else None
                else:
                    prim = act
        if prim:
            handles.append(m.register_forward_hook(lambda mod, a, o, p=prim, c=cls: add(p, 1, c)))

    modeling = {sys.modules[type(m).__module__] for m in model.modules()
                if type(m).__module__.startswith("transformers.models.")}
    patched = []
    for module in modeling:
        for fname in dir(module):
            fn = getattr(module, fname)
            if fname.startswith("apply_rotary") and callable(fn):
                def counting(*a, _fn=fn, _name=fname, **k):
                    out = _fn(*a, **k)
                    add("RotaryPositionEmbedding", len(out) if isinstance(out, tuple) else 1, _name)
                    return out
                patched.append((module, fname, fn))
                setattr(module, fname, counting)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
        for module, fname, fn in patched:
            setattr(module, fname, fn)
    return counts, {k: sorted(v) for k, v in facts.items()}


# --- preparing one type (run in a child process) ----------------------------------------------------------------


def prepare(model_type: str, out: Path, save: bool = True) -> dict:
    """Classify, build, count and save one type: the entry's static part (`save` False: classify and count
    only, nothing written, no reference generation)."""
    import torch
    from transformers.models.auto import modeling_auto as ma
    from transformers.utils import logging as tf_logging

    tf_logging.set_verbosity_error()
    entry = {"type": model_type, "class": ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    ex = static_exclusion(model_type)
    if ex:
        entry.update(category="excluded", excluded=ex[0], reason=ex[1])
        return entry
    config, kw = build_config(model_type)
    entry["shrunk"] = {k: v for k, v in kw.items() if not isinstance(v, list)}
    cls = ma.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    extra = {"experts_implementation": "batched_mm"} if cls._can_set_experts_implementation() else {}
    torch.manual_seed(SEED)
    model = cls._from_config(config, dtype=torch.float32, **extra).eval()
    perturb(model)
    ex = dynamic_exclusion(config, model)
    if ex:
        entry.update(category="excluded", excluded=ex[0], reason=ex[1])
        return entry
    hybrid = hybrid_reason(model)
    entry["category"] = "hybrid" if hybrid else "decoder"
    if hybrid:
        entry["hybrid"] = hybrid
    entry["params"] = sum(p.numel() for p in model.parameters())
    entry["has_cache"] = bool(getattr(config, "use_cache", False)) and model.can_generate()
    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]])
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    census, facts = expected_census(model, {"input_ids": ids, "attention_mask": mask})
    entry["expected"] = census
    entry["expected_from"] = facts
    if not save:
        return entry
    model.save_pretrained(out / "ckpt")
    if entry["has_cache"]:
        entry["torch_tokens"] = _torch_greedy(model, config)
    return entry


def perturb(model, std: float = 0.1) -> None:
    """Add N(0, std) to every norm weight, every bias and every parameter initialised to zeros: transformers
    initialises them to constants (1 or 0; Gemma's (1 + w) norms to 0), which would hide a dropped gamma, beta
    or bias, and would let two norms of one input (GPT-NeoX's parallel residual) be merged as duplicates. A
    router left at zeros (AFMoE's) scores every expert alike, and which of equal scores a top-k keeps is the
    kernel's choice (PyTorch's and onnxruntime's differ): a trained checkpoint has no such ties. Adding keeps
    each init's centre."""
    import torch

    with torch.no_grad():
        for m in model.modules():
            norm = "norm" in type(m).__name__.lower()
            for name, p in m.named_parameters(recurse=False):
                if name == "bias" or (norm and name == "weight") or (p.is_floating_point() and not p.any()):
                    p.add_(torch.randn_like(p) * std)


def _pad_id(config) -> int:
    """graphconv generate's pad id: pad_token_id, else the first eos_token_id, else 0."""
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    if pad is not None:
        return pad
    if isinstance(eos, list):
        return eos[0] if eos else 0
    return eos if eos is not None else 0


def _torch_greedy(model, config) -> list[list[int]] | str:
    """transformers' own greedy generate on the ledger's prompts (left padded), new tokens up to the eos."""
    import torch

    width = max(map(len, PROMPTS))
    pad = _pad_id(config)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    eos = getattr(config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 num_beams=1, pad_token_id=pad, min_new_tokens=0)
    except Exception as e:  # noqa: BLE001 - recorded, the stage compares nothing then
        return f"transformers' generate failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    rows = []
    for row in out[:, width:].tolist():
        new = []
        for t in row:
            new.append(t)
            if t in eos:
                break
        rows.append(new)
    return rows


# --- stages ------------------------------------------------------------------------------------------------------


def _graphconv() -> list[str]:
    exe = Path(sys.executable).with_name("graphconv")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "graphconv.cli"]


def run_stage(stage: str, d: Path, timeout: float) -> dict:
    """One CLI stage of one type in a subprocess: exit code, outcome, reason, seconds, and what it measured."""
    g = _graphconv()
    cmd = {
        "export": g + ["export", str(d / "ckpt"), "-o", str(d / "exp"), "--task", "text-generation"],
        "compile": g + ["compile", str(d / "exp" / "model.onnx"), "-o", str(d / "model.mindir"), "--report",
                        str(d / "compile.json"), "-q"],
        "export-past": g + ["export", str(d / "ckpt"), "-o", str(d / "past"), "--task",
                            "text-generation-with-past"],
        "compile-past": g + ["compile", str(d / "past"), "-o", str(d / "gen"), "-q"],
        "generate": g + ["generate", str(d / "gen"), "--input-ids", ";".join(",".join(map(str, p)) for p in PROMPTS),
                         "--max-new-tokens", str(NEW_TOKENS), "--check", "--json"],
    }[stage]
    for out in {"export": ["exp"], "compile": ["model.mindir", "compile.json"], "export-past": ["past"],
                "compile-past": ["gen"]}.get(stage, []):
        p = d / out
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    t0 = time.time()
    code, stdout, stderr = _run(cmd, timeout, cwd=d)
    res = {"exit": code, "outcome": outcome(code), "seconds": round(time.time() - t0, 1)}
    if code != 0:
        res["reason"] = f"timed out after {timeout:.0f} s" if code is None else reason_from(stderr)
    if stage == "compile" and (d / "compile.json").exists():
        res.update(read_compile_report(d / "compile.json"))
    if stage == "generate" and code in (0, 2):
        try:
            res.update(read_generate(json.loads(stdout)))
        except ValueError:
            pass
    return res


# A build's address space: a class whose generic shrink still builds a huge model (blt took 18.5 GiB of the
# host's 24 before it was stopped) fails with MemoryError instead of taking the host down.
BUILD_MEMORY_BYTES = 10 * 2**30


def _limit_memory(nbytes: int):
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    return apply


def _run(cmd: list[str], timeout: float, cwd: Path | None = None,
         memory: int | None = None) -> tuple[int | None, str, str]:
    """Run cmd in a session of its own; on timeout kill the whole session (graphconv's MindSpore and
    onnxruntime children too), exit code None. `memory`: its address space limit in bytes."""
    import signal

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True, preexec_fn=_limit_memory(memory) if memory else None)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, f"timed out after {timeout:.0f} s\n{err}"


def read_compile_report(path: Path) -> dict:
    """The fused census (FUSED primitives of the MindIR census, MoE gating summed), coverage refusals and the
    verification's max abs from a compile report."""
    rep = json.loads(path.read_text())
    got: dict[str, int] = {}
    for prim, n in (rep.get("census") or {}).items():
        key = "MoeGating" if prim.startswith("MoeGating") else prim
        if key in FAMILY:
            got[key] = got.get(key, 0) + n
    worst = None
    for case in (rep.get("validation") or {}).get("cases", []):
        for o in case.get("outputs", []):
            if o.get("max_abs") is not None:
                worst = max(worst or 0.0, o["max_abs"])
    cov = {fam: {"candidates": c.get("candidates", 0), "fused": c.get("fused", 0), "refused": c.get("refused", {})}
           for fam, c in (rep.get("coverage") or {}).items()}
    return {"census": got, "coverage": cov, "max_abs": worst, "status": rep.get("status")}


def read_generate(out: dict) -> dict:
    steps = out.get("steps") or []
    return {"sequences": out.get("sequences"), "prompt_lengths": out.get("prompt_lengths"),
            "gen_max_abs": max((s.get("max_abs") or 0.0 for s in steps), default=None),
            "argmax_match": all(s.get("argmax_match", True) for s in steps)}


def new_tokens(entry: dict) -> list[list[int]] | None:
    """graphconv's new tokens per prompt (generate prints new ids only, up to the eos)."""
    g = entry.get("stages", {}).get("generate", {})
    return g.get("sequences")


def census_misses(entry: dict) -> list[str]:
    """One line per fused primitive whose count differs from the expected census, with the compile's own
    coverage reason (refusals, or the missing candidates)."""
    comp = entry.get("stages", {}).get("compile", {})
    if "census" not in comp:
        return []
    exp, got, cov = entry.get("expected", {}), comp["census"], comp.get("coverage", {})
    lines = []
    for prim in FAMILY:
        e, g = exp.get(prim, 0), got.get(prim, 0)
        if e == g:
            continue
        c = cov.get(FAMILY[prim], {})
        why = "; ".join(f"{r} ({n})" for r, n in c.get("refused", {}).items())
        if not why:
            why = (f"{c.get('candidates', 0)} candidate(s) found" if c.get("candidates", 0) < e
                   else "more fused than the module tree has" if g > e else "candidates found, none refused")
        lines.append(f"{prim} {g}/{e}: {why}")
    return lines


# --- the run -----------------------------------------------------------------------------------------------------


def classify(model_type: str, timeout: float) -> dict:
    """`prepare` in this process, without a checkpoint; a failure to build is the entry's reason."""
    import signal

    def alarm(*_):
        raise TimeoutError(f"build timed out after {timeout:.0f} s")

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(timeout))
    t0 = time.time()
    try:
        entry = prepare(model_type, Path("."), save=False)
    except Exception as e:  # noqa: BLE001 - the ledger records why a type does not build
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        entry = {"type": model_type, "class": names[model_type], "category": "build-failed",
                 "reason": f"{type(e).__name__}: {first[:200]}".replace("|", "/")}
    finally:
        signal.alarm(0)
    entry["build_seconds"] = round(time.time() - t0, 1)
    entry["stages"] = {}
    return entry


def run_prepare_child(model_type: str, d: Path, timeout: float) -> dict:
    t0 = time.time()
    code, _, err = _run([sys.executable, __file__, "--prepare", model_type, "--work", str(d)], timeout,
                        memory=BUILD_MEMORY_BYTES)
    if code is None:
        return {"type": model_type, "category": "build-failed", "reason": f"build timed out after {timeout:.0f} s"}
    f = d / "prepare.json"
    if code != 0 or not f.exists():
        return {"type": model_type, "category": "build-failed", "reason": reason_from(err),
                "seconds": round(time.time() - t0, 1)}
    entry = json.loads(f.read_text())
    entry["build_seconds"] = round(time.time() - t0, 1)
    return entry


def wanted_stages(entry: dict, stages: list[str]) -> list[str]:
    if entry.get("category") not in ("decoder", "hybrid"):
        return []
    return [s for s in stages if entry.get("has_cache") or s in ("export", "compile")]


def run_type(model_type: str, work: Path, stages: list[str], timeout: float, results: dict, save) -> dict:
    d = work / model_type
    entry = results.get(model_type)
    ex = static_exclusion(model_type)
    if ex and (entry is None or "category" not in entry):  # the auto mappings say it: no child needed
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

        entry = results[model_type] = {"type": model_type, "class": names[model_type], "category": "excluded",
                                       "excluded": ex[0], "reason": ex[1], "stages": {}}
        save()
    if entry is None or "category" not in entry or (entry["category"] in ("decoder", "hybrid")
                                                    and not (d / "ckpt").is_dir()):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        entry = run_prepare_child(model_type, d, timeout)
        entry["stages"] = {}
        results[model_type] = entry
        save()
    entry.setdefault("stages", {})
    for stage in wanted_stages(entry, stages):
        if stage in entry["stages"]:
            continue
        before = STAGES[: STAGES.index(stage)]
        needs = {"compile": "export", "compile-past": "export-past", "generate": "compile-past"}.get(stage)
        if needs and entry["stages"].get(needs, {}).get("exit") != 0:
            # verify-failed compiles still write their folder; anything else leaves nothing to run
            if not (needs == "compile-past" and entry["stages"].get(needs, {}).get("exit") == 2):
                entry["stages"][stage] = {"outcome": "skipped", "reason": f"{needs} did not pass"}
                continue
        del before
        print(f"  {model_type}: {stage} ...", end="", flush=True)
        res = run_stage(stage, d, timeout)
        if stage == "generate" and isinstance(entry.get("torch_tokens"), list) and res.get("sequences"):
            res["token_exact"] = res["sequences"] == entry["torch_tokens"]
        entry["stages"][stage] = res
        print(f" {res['outcome']} ({res['seconds']} s){': ' + res['reason'] if res.get('reason') else ''}",
              flush=True)
        save()
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/graphconv-ledger"))
    ap.add_argument("--types", help="comma-separated model types (default: all); 'ci' = the CI sample")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--resume", action="store_true", help="keep WORK/results.json's finished stages")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per stage")
    ap.add_argument("--doc", type=Path, help="write the markdown ledger here (e.g. docs/architectures.md)")
    ap.add_argument("--list", action="store_true", help="print the enumerated types and exit")
    ap.add_argument("--doc-only", action="store_true", help="write --doc from WORK/results.json, run nothing")
    ap.add_argument("--classify", action="store_true",
                    help="classify, build and count every type in this process (no CLI stages, no checkpoint)")
    ap.add_argument("--merge", type=Path, help="with --doc-only: fill types missing from WORK from this "
                                               "other work dir's results.json (a --classify run)")
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.prepare:  # the child: classify, build, count, save
        a.work.mkdir(parents=True, exist_ok=True)
        (a.work / "prepare.json").write_text(json.dumps(prepare(a.prepare, a.work), indent=1))
        return 0
    types = model_types()
    if a.list:
        print("\n".join(types))
        return 0
    chosen = types if not a.types else CI_SAMPLE if a.types == "ci" else a.types.split(",")
    unknown = sorted(set(chosen) - set(types))
    if unknown:
        ap.error(f"not causal-LM types of this transformers: {', '.join(unknown)}")
    stages = [s for s in a.stages.split(",") if s and s != "none"]
    if set(stages) - set(STAGES):
        ap.error(f"stages: {', '.join(STAGES)}")
    rfile = a.work / "results.json"
    if a.doc_only:
        from transformers import __version__ as tv

        data = json.loads(rfile.read_text())
        if a.merge:
            for t, e in json.loads((a.merge / "results.json").read_text())["types"].items():
                data["types"].setdefault(t, e)
        a.doc.write_text(render(data, types, tv).replace(f"{a.work.resolve()}/", "WORK/"))  # (no host paths)
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    data = json.loads(rfile.read_text()) if a.resume and rfile.exists() else {"types": {}, "runs": []}
    results = data["types"]

    def save():
        tmp = rfile.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(rfile)

    t0 = time.time()
    for i, t in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {t}", flush=True)
        if a.classify:
            if t not in results:
                results[t] = classify(t, a.timeout)
                save()
            continue
        run_type(t, a.work, stages, a.timeout, results, save)
    data["runs"].append({"types": len(chosen), "seconds": round(time.time() - t0, 1),
                         "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    save()
    if a.doc:
        from transformers import __version__ as tv

        a.doc.write_text(render(data, types, tv).replace(f"{a.work.resolve()}/", "WORK/"))  # (no host paths)
        print(f"wrote {a.doc}")
    internal = [t for t, e in results.items() if any(s.get("exit") == 3 for s in e.get("stages", {}).values())]
    if internal:
        print(f"INTERNAL ERRORS (exit 3): {', '.join(internal)}", flush=True)
    return 0


# --- the markdown ---------------------------------------------------------------------------------------------


def verdict(entry: dict) -> str:
    """One word per ledgered type: its furthest result."""
    st = entry.get("stages", {})
    if entry.get("category") == "build-failed":
        return "build-failed"
    if not st:
        return "not run"
    if any(s.get("exit") == 3 for s in st.values()):
        return "INTERNAL ERROR"
    if st.get("export", {}).get("exit") not in (0, None) or st.get("export", {}).get("outcome") == "timeout":
        return "export-failed"
    c = st.get("compile")
    if c is None:
        return "not run"
    if c.get("exit") != 0:
        return "compile-failed" if c.get("exit") != 2 else "verify-failed"
    return "verified" if not census_misses(entry) else "verified, census short"


def _fmt_stage(s: dict | None) -> str:
    if not s:
        return "·"
    o = s["outcome"]
    return {"ok": "ok", "skipped": "–", "INTERNAL ERROR": "**EXIT 3**"}.get(o, o)


def _census(entry: dict) -> str:
    exp = entry.get("expected", {})
    got = entry.get("stages", {}).get("compile", {}).get("census")
    short = {"FlashAttentionScore": "FA", "RmsNorm": "RMS", "LayerNorm": "LN", "RotaryPositionEmbedding": "RoPE",
             "Swiglu": "SwiGLU", "GeLU": "GeLU", "GeluExt": "GeluExt", "FastGeLU": "FastGeLU", "MoeGating": "MoE"}
    parts = []
    for prim in FAMILY:
        e = exp.get(prim, 0)
        g = None if got is None else got.get(prim, 0)
        if e or g:
            parts.append(f"{short[prim]} {'?' if g is None else g}/{e}")
    return ", ".join(parts) or "–"


def miss_causes(entry: dict) -> list[str]:
    """Each miss of a type as a groupable key: a failed stage's reason without its numbers and names, a census
    miss's primitive and reason."""
    keys = []
    for stage, res in entry.get("stages", {}).items():
        if res.get("reason") and res["outcome"] != "skipped":
            r = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", res["reason"])
            r = re.sub(r"model type '[^']*'", "model type T", r)
            keys.append(f"{stage} {res['outcome']}: {r[:110]}")
    for line in census_misses(entry):
        prim, _, why = line.partition(" ")
        got, want = map(int, why.partition(":")[0].split("/"))
        keys.append(f"{prim} {'unfused' if got < want else 'over-counted'}: "
                    f"{re.sub(r'[0-9]+', 'N', why.partition(': ')[2])[:110]}")
    return keys


def type_seconds(entry: dict) -> float:
    """What one type cost: its build child plus every stage it ran."""
    return entry.get("build_seconds", 0.0) + sum(s.get("seconds", 0.0) for s in entry.get("stages", {}).values())


def render(data: dict, all_types: list[str], tf_version: str) -> str:
    res = data["types"]
    entries = [res.get(t, {"type": t}) for t in all_types]
    excluded = [e for e in entries if e.get("category") == "excluded"]
    decoders = [e for e in entries if e.get("category") == "decoder"]
    hybrids = [e for e in entries if e.get("category") == "hybrid"]
    failed_build = [e for e in entries if e.get("category") == "build-failed"]
    unknown = [e for e in entries if "category" not in e]
    internal = [e["type"] for e in entries if any(s.get("exit") == 3 for s in e.get("stages", {}).values())]
    runs = data.get("runs", [])

    def stage_counts(group, stage):
        c: dict[str, int] = {}
        for e in group:
            s = e.get("stages", {}).get(stage)
            if s:
                c[s["outcome"]] = c.get(s["outcome"], 0) + 1
        return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "–"

    def tokens(group):
        ran = [e for e in group if e.get("stages", {}).get("generate", {}).get("exit") in (0, 2)]
        exact = sum(1 for e in ran if e["stages"]["generate"].get("token_exact"))
        return f"{exact} of {len(ran)}"

    def census_full(group):
        comp = [e for e in group if e.get("stages", {}).get("compile", {}).get("exit") == 0]
        return f"{sum(1 for e in comp if not census_misses(e))} of {len(comp)}"

    L = [f"# Architectures: the decoder ledger (transformers {tf_version})", "",
         "Generated by `benchmarks/ledger.py` (issue 35): every model type of transformers' "
         "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, classified, built from its config class with sizes shrunk "
         "generically (2 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, vocab 300, 4 experts top-2), "
         "random weights (seed 0), saved with `save_pretrained` and run through the CLI: `export` "
         "(text-generation) → `compile --report` → `export` (text-generation-with-past, classes with a cache) → "
         "`compile` of that folder → `generate --check` (prompts `5,6,7,8;9,10`, 8 new tokens, compared with "
         "transformers' own greedy `generate`). The expected census is counted from the PyTorch module tree in one "
         "forward pass (RMSNorm / LayerNorm modules, outermost attention modules, tensors returned by the modeling "
         "module's `apply_rotary*`, gated-MLP and GELU activations, MoE routers), never from graphconv's output; "
         "an activation written inline rather than as a module (gpt-oss's x·sigmoid(1.702x) GLU) is not counted, "
         "and shows as over-counted. "
         "Regenerate: `python benchmarks/ledger.py --work DIR --resume --doc docs/architectures.md`.", "",
         "## Summary", "",
         "| | count |", "|---|---|",
         f"| causal-LM types enumerated | {len(entries)} |",
         f"| excluded (listed below with why) | {len(excluded)} |"]
    for cat in ("encoder", "encoder-decoder", "multimodal"):
        L.append(f"| &nbsp;&nbsp;{cat} | {sum(1 for e in excluded if e.get('excluded') == cat)} |")
    L += [f"| decoder-only text types | {len(decoders)} |",
          f"| SSM / linear-attention hybrids | {len(hybrids)} |",
          f"| build failed (generic shrink refused) | {len(failed_build)} |",
          f"| not yet classified | {len(unknown)} |",
          f"| decoders + hybrids run through the CLI so far | "
          f"{sum(1 for e in decoders + hybrids if e.get('stages'))} of {len(decoders) + len(hybrids)} |",
          f"| **internal errors (exit 3)** | **{len(internal)}**{': ' + ', '.join(internal) if internal else ''} |",
          ""]
    order = ["verified", "verified, census short", "verify-failed", "compile-failed", "export-failed",
             "INTERNAL ERROR", "not run"]
    L += ["| verdict (furthest result) | decoders | hybrids |", "|---|---|---|"]
    for v in order:
        L.append(f"| {v} | {sum(1 for e in decoders if verdict(e) == v)} | "
                 f"{sum(1 for e in hybrids if verdict(e) == v)} |")
    L += ["", "| stage | decoders | hybrids |", "|---|---|---|"]
    for stage in STAGES:
        L.append(f"| {stage} | {stage_counts(decoders, stage)} | {stage_counts(hybrids, stage)} |")
    L += [f"| fused census complete (of compiled) | {census_full(decoders)} | {census_full(hybrids)} |",
          f"| generate token-exact vs transformers (of generated) | {tokens(decoders)} | {tokens(hybrids)} |", ""]
    ran = [e for e in decoders + hybrids if e.get("stages")]
    spent = sum(type_seconds(e) for e in ran)
    if ran:
        full = spent / len(ran) * (len(decoders) + len(hybrids))
        L.append(f"Time: {spent / 60:.1f} min for the {len(ran)} types run through the CLI (build + every stage, "
                 f"one type at a time, a 2-core host shared with other jobs: {spent / len(ran):.0f} s a type); "
                 f"the full run of all {len(decoders) + len(hybrids)} decoders and hybrids at that rate: about "
                 f"{full / 3600:.1f} h." + (" Completed runs: " + "; ".join(
                     f"{r['types']} types in {r['seconds'] / 60:.1f} min ({r['finished']})" for r in runs) + "."
                     if runs else ""))
        L.append("")
    causes: dict[str, list[str]] = {}
    for e in decoders + hybrids:
        for key in miss_causes(e):
            causes.setdefault(key, []).append(e["type"])
    if causes:
        L += ["## Misses by cause", "", "| cause | types |", "|---|---|"]
        for key, ts in sorted(causes.items(), key=lambda kv: -len(kv[1])):
            L.append(f"| {key} | {len(ts)}: {', '.join(ts)} |")
        L.append("")
    header = ["| type | class | verdict | " + " | ".join(STAGES) + " | census fused/expected | max abs | misses |",
              "|---" * (len(STAGES) + 6) + "|"]
    for title, group in (("Decoder-only text types", decoders), ("SSM and linear-attention hybrids", hybrids)):
        L += [f"## {title}", "", "Types run through the CLI first, then those only classified and counted "
              "(their census shows ?/expected).", ""] + header
        for e in sorted(group, key=lambda e: not e.get("stages")):
            st = e.get("stages", {})
            mx = st.get("compile", {}).get("max_abs")
            misses = [f"{s}: {st[s]['reason']}" for s in STAGES if st.get(s, {}).get("reason")
                      and st[s]["outcome"] != "skipped"]
            misses += census_misses(e)
            g = st.get("generate", {})
            if g.get("exit") in (0, 2) and g.get("token_exact") is False:
                misses.append(f"generate: tokens {g.get('sequences')} != transformers' {e.get('torch_tokens')}")
            if not e.get("has_cache"):
                misses.append("no cache (config.use_cache unset): with-past stages not run")
            if e.get("category") == "hybrid":
                misses.append(f"hybrid: {e['hybrid']}")
            cells = [_fmt_stage(st.get(s)) if s in wanted_stages(e, list(STAGES)) else "n/a" for s in STAGES]
            L.append(f"| {e['type']} | {e.get('class', '')} | {verdict(e)} | " + " | ".join(cells) +
                     f" | {_census(e)} | {'' if mx is None else f'{mx:.1e}'} | {'<br>'.join(misses) or '–'} |")
        L.append("")
    L += ["## Build failed", "", "The generic shrink (or the class itself) refused: these need sizes of their own.",
          "", "| type | why |", "|---|---|"]
    L += [f"| {e['type']} | {e.get('reason', '')} |" for e in failed_build] + [""]
    L += ["## Excluded", "", "| type | class | excluded as | why |", "|---|---|---|---|"]
    L += [f"| {e['type']} | {e.get('class', '')} | {e['excluded']} | {e['reason']} |" for e in excluded] + [""]
    if unknown:
        L += ["## Not yet run", "", ", ".join(e["type"] for e in unknown), ""]
    L += ["Stage cells: ok; refused (exit 1: unsupported or bad input); verify-failed (exit 2); **EXIT 3** "
          "(graphconv's internal error); timeout; – (skipped: the stage it needs did not pass); · (not run yet); "
          "n/a (no cache: with-past stages do not apply). Census: fused/expected per primitive (FA "
          "FlashAttentionScore, RMS RmsNorm, LN LayerNorm, RoPE RotaryPositionEmbedding, MoE MoeGating*). Max abs: "
          "the compile's verification against onnxruntime, worst output over both reference shapes.", ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
