#!/usr/bin/env python3
"""ocr_agreement: ddddocr's default OCR model (common_old.onnx: dynamically quantized convolutions and a
DynamicQuantizeLSTM) compiled by graphconv, read on rendered text as ddddocr reads it, against onnxruntime.

    .venv/bin/python benchmarks/ocr_agreement.py --workdir DIR   (DIR: benchmarks/wild_onnx.py's, or a new one)

The model quantizes its activations at run time, so a float tolerance of 1e-4 does not hold between any two
runtimes (graphconv.verification._rounding_note): what its users see is the text it reads. Per word: the
text onnxruntime reads with the model as given (its int8 kernels), with graphconv's decomposition (the oracle
a compile uses) and with the compiled MindIR (MindSpore on CPU), and the logits' differences. Images as ddddocr
makes them (grayscale, 64 high, /255; ddddocr/core/ocr_engine.py); the text decoded by CTC with the package's
own charset (CHARSET_OLD in ddddocr/charsets.py, read from the wheel).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WORDS = ["3a8K", "x7pq2", "HELLO", "9527", "mind", "spore", "aZ3k9", "qwert", "7Xb2", "ocr42", "r4nd0m", "TEST1",
         "Ascend", "k8s", "Zq4", "onnx23"]


def charset(wheel: Path) -> list[str]:
    tree = ast.parse(zipfile.ZipFile(wheel).read("ddddocr/charsets.py").decode())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHARSET_OLD":
            return ast.literal_eval(node.value)
    raise SystemExit("CHARSET_OLD not found in the wheel")


def image(word: str) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("L", (40 * len(word) + 20, 64), 255)
    ImageDraw.Draw(img).text((10, 8), word, fill=0, font=ImageFont.load_default(size=40))
    return (np.asarray(img, np.float32) / 255.0)[None, None]


def read(logits: np.ndarray, chars: list[str]) -> str:
    """CTC: the best class per step, repeats merged, blanks (0) dropped."""
    out, prev = [], -1
    for i in logits[:, 0, :].argmax(-1):
        if i != prev and i != 0:
            out.append(chars[i])
        prev = i
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    args = ap.parse_args()
    import onnx
    import onnxruntime as ort

    import wild_onnx
    from graphconv.frontend import contrib

    model_path = next(p for pkg, p in wild_onnx.fetch(args.workdir) if p.name == "common_old.onnx")
    wheel = next((args.workdir / "wheels").glob(f"ddddocr-{wild_onnx.PACKAGES['ddddocr']}-*.whl"))
    chars = charset(wheel)
    out = args.workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    compile_cmd = [sys.executable, "-m", "graphconv", "compile", str(model_path), "--target", "cpu", "-q"]
    first = subprocess.run([*compile_cmd, "-o", str(out / "ocr_default.mindir")], capture_output=True, text=True)
    print(f"compile with default options: exit {first.returncode}: {first.stderr.strip()[:400]}")
    mindir = out / "ocr_unverified.mindir"
    subprocess.run([*compile_cmd, "-o", str(mindir), "--no-verify"], check=True, capture_output=True)

    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    network = ms.nn.GraphCell(ms.load(str(mindir)))
    given = onnx.load(str(model_path))
    oracle = contrib.oracle_semantics(given)[0]  # the decomposition a compile's oracle runs
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = {"as given": ort.InferenceSession(given.SerializeToString(), options),
                "decomposed": ort.InferenceSession(oracle.SerializeToString(), options)}
    same, worst, cosines = 0, 0.0, []
    print(f"{'word':<8} {'onnxruntime':<12} {'decomposed':<12} {'MindIR':<12} max abs vs decomposed, cosine")
    for word in WORDS:
        x = image(word)
        ref = {k: s.run(None, {"input1": x})[0] for k, s in sessions.items()}
        got = network(ms.Tensor(x)).asnumpy()
        texts = [read(ref["as given"], chars), read(ref["decomposed"], chars), read(got, chars)]
        d = float(np.abs(got - ref["decomposed"]).max())
        cos = float((got * ref["decomposed"]).sum() / np.linalg.norm(got) / np.linalg.norm(ref["decomposed"]))
        same += texts[0] == texts[2]
        worst, cosines = max(worst, d), cosines + [cos]
        print(f"{word:<8} {texts[0]:<12} {texts[1]:<12} {texts[2]:<12} {d:.3g}, {cos:.6f}")
    print(f"\nthe MindIR reads what onnxruntime reads on {same} of {len(WORDS)} words; logits max abs {worst:.3g}, "
          f"cosine >= {min(cosines):.6f}")
    # Two ONNX runtimes on the compile's own reference inputs: onnx's reference evaluator (numpy) against
    # onnxruntime, both running the decomposition (at opset 21, the lowest whose DequantizeLinear it runs).
    from onnx.reference import ReferenceEvaluator

    from graphconv.verify import reference

    decomposed = onnx.version_converter.convert_version(oracle, 21)
    evaluator = ReferenceEvaluator(decomposed)
    for case in reference.make_cases(decomposed):
        x = case.inputs["input1"]
        a, b = evaluator.run(None, {"input1": x})[0], sessions["decomposed"].run(None, {"input1": x})[0]
        print(f"generated case {list(x.shape)}: onnx.reference vs onnxruntime max abs {np.abs(a - b).max():.3g}, "
              f"MindIR vs onnxruntime {np.abs(network(ms.Tensor(x)).asnumpy() - b).max():.3g}")


if __name__ == "__main__":
    main()
