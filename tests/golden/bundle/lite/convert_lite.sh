#!/usr/bin/env bash
# ASCEND HOST ONLY: route (b), MindSpore Lite. Converts model/tiny_llama.mindir for Ascend with converter_lite
# (MindSpore Lite cloud-side package; add tools/converter/lib to LD_LIBRARY_PATH) and lite/converter.cfg.
# Writes lite/tiny_llama_ascend.mindir; then run: python lite/infer_lite.py
set -euo pipefail
cd "$(dirname "$0")/.."
command -v converter_lite >/dev/null || { echo "converter_lite not found: install the MindSpore Lite cloud-side package on the Ascend host and put tools/converter/converter on PATH" >&2; exit 1; }
converter_lite --fmk=MINDIR --modelFile=model/tiny_llama.mindir --outputFile=lite/tiny_llama_ascend --optimize=ascend_oriented --configFile=lite/converter.cfg
