"""The opset matrix: CI runs dynamo/opset 18 for one plain zoo model per family and for the architecture zoo's
CI slice (Llama, Qwen3, Gemma-2, Gemma-3, Phi-3, GPT-2, BERT, ViT with transformers' default settings), and
Qwen3-MoE at dynamo/opset 24; the rest with --runslow or `graphconv matrix --full`. A cell passes when its export
verifies and its fused census equals the one written down from the architecture; a cell that passed in
docs/opset-matrix.json must still pass."""

from __future__ import annotations

import pytest

from graphconv.tools import matrix
from models import PLAIN_TORCH, ZOO, architectures


# The CI slice: one model per family at dynamo/opset 18 (the fusion tests compile the others at 18 and 17);
# `pytest --runslow tests/test_matrix.py` or `graphconv matrix --full` runs every cell.
CI_MODELS = ("llama", "gpt2", "bert", "cnn")
# Plus one cell at an opset above 23 (dynamo writes the transformers models at 24 and 25; at 26-28 its opset
# converter fails): a MoE architecture, whose opset-24 export has the native Attention and the router's TopK at
# their opset-24 versions, with q/k RmsNorm, rotary and SwiGLU experts to fuse around them. About 10 s.
CI_NEW_OPSET = ("hf/qwen3_moe", "dynamo", 24)


def _params():
    for model in ZOO:
        for exporter in matrix.EXPORTERS:
            for opset in matrix.OPSETS:
                in_ci = (exporter, opset) == ("dynamo", 18) and model in CI_MODELS
                marks = [] if in_ci else [pytest.mark.slow]
                yield pytest.param(model, exporter, opset, marks=marks, id=f"{model}-{exporter}-{opset}")
    for name in architectures.names("all"):
        for exporter, opset in matrix.model_cells(matrix.HF_PREFIX + name, matrix.EXPORTERS, matrix.HF_OPSETS):
            in_ci = ((exporter, opset) == ("dynamo", 18) and name in architectures.CI_SLICE
                     or (matrix.HF_PREFIX + name, exporter, opset) == CI_NEW_OPSET)
            yield pytest.param(matrix.HF_PREFIX + name, exporter, opset, marks=[] if in_ci else [pytest.mark.slow],
                               id=f"hf-{name}-{exporter}-{opset}")


@pytest.mark.parametrize("model,exporter,opset", list(_params()))
def test_matrix_cell(model, exporter, opset, tmp_path):
    if model not in PLAIN_TORCH:
        pytest.importorskip("transformers")
    cell = matrix.run_cell(model, exporter, opset, tmp_path)
    assert matrix.regressions([cell], matrix.load_baseline()) == []
    if cell.status == "exporter":
        pytest.skip(f"PyTorch's exporter: {cell.reason[:200]}")
    if cell.status == "unsupported":  # only where the architecture records it (MoE routing's TopK)
        pytest.xfail(f"known unsupported: {cell.reason[:200]}")
    assert cell.status == "pass", cell.reason
    assert cell.max_abs is not None and cell.max_abs <= 1e-4
    assert cell.torch_max_abs is not None and cell.torch_max_abs <= 1e-4


def test_markdown_lists_every_cell_and_reason(tmp_path):
    cells = [matrix.Cell("m", "dynamo", 18, "pass"), matrix.Cell("m", "dynamo", 17, "exporter", "refused"),
             matrix.Cell("n", "dynamo", 18, "fail", "too few fused primitives: RmsNorm 0 < 5")]
    matrix.write_docs(cells, tmp_path)
    text = (tmp_path / "opset-matrix.md").read_text()
    assert "1 of 3 cells pass" in text
    assert "| m | exporter [1] | pass |" in text and "| n | not run | fail [2] |" in text
    assert "1. exporter: refused" in text and "2. fail: too few fused primitives" in text
    baseline = matrix.load_baseline(tmp_path / "opset-matrix.json")
    now = [matrix.Cell("m", "dynamo", 18, "fail", "broke")]
    assert matrix.regressions(now, baseline) == ["m/dynamo/18: passed before, now fail: broke"]


def test_a_repeated_reason_is_listed_once(tmp_path):
    refused = "PyTorch's torchscript exporter refused the model at opset 24: Unsupported onnx_opset_version: 24"
    cells = [matrix.Cell("m", "torchscript", 24, "exporter", refused), matrix.Cell("n", "torchscript", 24,
             "exporter", refused), matrix.Cell("n", "dynamo", 24, "fail", "broke")]
    matrix.write_docs(cells, tmp_path)
    text = (tmp_path / "opset-matrix.md").read_text()
    assert "| m | not run | exporter [1] |" in text and "| n | fail [2] | exporter [1] |" in text
    assert text.count("Unsupported onnx_opset_version") == 1 and "2. fail: broke" in text


def test_torchscript_is_not_run_beyond_its_opsets_for_the_architectures():
    assert matrix.model_cells("hf/llama", matrix.EXPORTERS, (23, 24)) == [
        ("dynamo", 23), ("dynamo", 24), ("torchscript", 23)]
    assert len(matrix.model_cells("llama", matrix.EXPORTERS, (23, 24))) == 4  # the plain zoo records the refusal
    assert matrix.OPSETS[-1] == 28 and {24, 28} <= set(matrix.HF_OPSETS)


def test_the_exporters_conversion_log_is_the_cause():
    """Dynamo beyond 25 converts with the onnx C API, which only logs its failure (the model it returns keeps
    newer ops than its opset import): the cell's reason quotes the missing adapter, and it stays off stderr."""
    import logging

    logger = logging.getLogger("onnxscript.version_converter")
    with matrix._ConversionLog() as log:
        logger.warning("The model version conversion is not supported by the onnxscript version converter")
        logger.warning("Failed to convert the model to the target version %d using the ONNX C API.", 26,
                       exc_info=RuntimeError("Traceback\nBaseConverter.h:66: adapter_lookup: Assertion `false` "
                                             "failed: No Adapter From Version $22 for Attention"))
    assert matrix._cause(log) == (" (its opset conversion failed in onnx's version converter: No Adapter From "
                                  "Version $22 for Attention)")
    assert matrix._cause(None) == "" and log not in logger.handlers and logger.propagate


def test_census_must_equal_the_expectation():
    """More fused primitives than the architecture has is as wrong as fewer (a fusion that fires on
    something that is not what it claims)."""
    expected = {"RmsNorm": 5, "FlashAttentionScore": 2}
    assert matrix.census_mismatch(expected, {"RmsNorm": 5, "FlashAttentionScore": 2, "Add": 9}) == {}
    assert matrix.census_mismatch(expected, {"RmsNorm": 6, "FlashAttentionScore": 2}) == {"RmsNorm": (6, 5)}
    assert matrix.census_mismatch(expected, {"RmsNorm": 5}) == {"FlashAttentionScore": (0, 2)}
    assert matrix.census_mismatch(expected, {"RmsNorm": 5, "FlashAttentionScore": 2, "Swiglu": 1}) == {
        "Swiglu": (1, 0)}


def test_every_architecture_is_a_matrix_model_with_its_census():
    names = matrix.model_names(full=True)
    for name, arch in architectures.ARCHITECTURES.items():
        assert matrix.HF_PREFIX + name in names
        assert matrix.expected_census(matrix.HF_PREFIX + name) == arch.census
    ci = matrix.model_names(full=False)
    assert [n for n in ci if n.startswith(matrix.HF_PREFIX)] == [matrix.HF_PREFIX + n for n in architectures.CI_SLICE]
