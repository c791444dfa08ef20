"""Regenerate the shipped example models: `python -m models.examples.make_examples`.

tiny_llama.onnx: models.llama (2 layers, GQA, RoPE, SwiGLU, RMSNorm) exported by dynamo at opset 18 with
dynamic batch and seq, checked against PyTorch at two shapes by graphconv.frontend.export.
"""

from pathlib import Path

from graphconv.frontend.export import zoo_export
from .. import load_factory

HERE = Path(__file__).resolve().parent


def main() -> None:
    result = zoo_export(load_factory("llama"), HERE / "tiny_llama.onnx", opset=18, exporter="dynamo")
    print(f"wrote {result.path} (max abs diff vs PyTorch {max(c['max_abs'] for c in result.checks):.2e})")


if __name__ == "__main__":
    main()
