"""Standard ONNX ops with no lowering, each with a one-line reason: graphconv/compiler/lowering.unsupported_ops
adds it to the refusal (which lists ops comma-separated, so reasons have no commas). tests/test_opmap_opset28.py
checks that every op onnx defines has a handler or a reason here."""

from __future__ import annotations

from graphconv.onnx_domains import is_default_domain

_RANDOM = ("draws random numbers; onnxruntime's generator cannot be reproduced in MindSpore and the compile "
           "could not be verified")
_SEQUENCE = "takes or makes a sequence value; graphconv lowers tensors only"
_STRING = "works on string tensors; MindSpore has none"

REASONS: dict[str, str] = {
    **{op: _RANDOM for op in ("Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
                              "RandomUniformLike")},
    **{op: _SEQUENCE for op in ("ConcatFromSequence", "SequenceAt", "SequenceConstruct", "SequenceEmpty",
                                "SequenceErase", "SequenceInsert", "SequenceLength", "SequenceMap",
                                "SplitToSequence")},
    **{op: _STRING for op in ("RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit")},
    "ImageDecoder": "decodes JPEG/PNG/TIFF/WebP byte streams; MindSpore has no such operator",
    "MelWeightMatrix": "its scalar inputs decide the output's shape and values; compute the matrix ahead of time "
                       "(an initializer)",
    "Upsample": "deprecated since opset 10; models at opsets 7-9 are upgraded on load and "
                "onnx.version_converter rewrites it to Resize",
    "Scatter": "deprecated since opset 11; models at opsets 7-10 are upgraded on load and "
               "onnx.version_converter rewrites it to ScatterElements",
}


def reason(op_type: str, domain: str = "") -> str | None:
    return REASONS.get(op_type) if is_default_domain(domain) else None
