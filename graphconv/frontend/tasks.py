"""The export tasks, by the names optimum and the Hub use, and the task a checkpoint's config implies.

`graphconv export CKPT` without --task (`--task auto`) takes the task from the config: the first transformers
auto class that maps the config and names the checkpoint's architecture, in this order: causal LM, seq2seq
LM, speech seq2seq, image-text-to-text, image and audio classification, then the base model. A causal LM
exports with its KV cache where every layer keeps one, as optimum exports it. Tasks that graphconv names but
does not export yet are refused in one line that names them.
"""

from __future__ import annotations

import dataclasses

from graphconv.errors import UnsupportedError

EXPORTED = ("text-generation", "text-generation-with-past", "feature-extraction")
# optimum's task names that graphconv does not export yet, with what they are
NOT_EXPORTED = {
    "text2text-generation": "an encoder-decoder's text generation",
    "text2text-generation-with-past": "an encoder-decoder's text generation",
    "automatic-speech-recognition": "speech-to-text generation",
    "image-classification": "image classification",
    "audio-classification": "audio classification",
    "image-text-to-text": "a vision-language model's generation",
}
NAMES = ("auto", *EXPORTED, *NOT_EXPORTED)


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    why: str  # how the config implies it, or "given"


def check_exported(task: str, model_type: str) -> None:
    """Refuse, in one line, a task graphconv knows by name but does not export yet."""
    if task in NOT_EXPORTED:
        raise UnsupportedError(f"model type {model_type!r}: task {task} ({NOT_EXPORTED[task]}) is not exported "
                               f"by graphconv yet (it exports {', '.join(EXPORTED)})")


def infer(config, with_past_refusal) -> Task:
    """The task `config` implies. `with_past_refusal(config)` gives why a causal LM cannot keep its cache in
    the with-past export (None when it can)."""
    from transformers.models.auto import modeling_auto as auto

    archs = set(getattr(config, "architectures", None) or [])

    def names(mapping) -> bool:
        try:
            cls = mapping[type(config)]
        except KeyError:
            return False
        classes = cls if isinstance(cls, (list, tuple)) else [cls]
        return not archs or any(c.__name__ in archs for c in classes if isinstance(c, type))

    causal_names = {c.__name__ for c in auto.MODEL_FOR_CAUSAL_LM_MAPPING.values() if isinstance(c, type)}
    if type(config) in auto.MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(config, "is_encoder_decoder", False) \
            and (not archs or archs & causal_names):
        refusal = with_past_refusal(config)
        if refusal is None:
            return Task("text-generation-with-past", "a causal LM whose layers all keep a KV cache")
        return Task("text-generation", f"a causal LM; not with its cache: {refusal}")
    for mapping, task in ((auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, "text2text-generation-with-past"),
                          (auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING, "automatic-speech-recognition"),
                          (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, "image-text-to-text"),
                          (auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING, "image-classification"),
                          (auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING, "audio-classification")):
        if names(mapping):
            return Task(task, f"its architecture {', '.join(sorted(archs)) or type(config).__name__} "
                              f"is a {task} model")
    if type(config) in auto.MODEL_MAPPING:
        return Task("feature-extraction", "a base model (no generation or classification head is known)")
    raise UnsupportedError(f"model type {config.model_type!r}: no transformers auto class maps it, so no task is "
                           "implied; give --task")


def check_text_inputs(cls, task: str) -> None:
    """Refuse, in one line, a model whose main input is not token ids: the export feeds it text inputs."""
    main = getattr(cls, "main_input_name", "input_ids")
    if main not in ("input_ids", "inputs_embeds"):
        raise UnsupportedError(f"{cls.__name__} takes {main}: graphconv exports {task} of models that take "
                               "input_ids only, so far")
