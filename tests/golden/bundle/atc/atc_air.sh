#!/usr/bin/env bash
# ASCEND HOST ONLY (CANN toolkit with atc): route (c), AIR -> .om with `atc --framework=1`. First export the
# AIR files on an Ascend host with MindSpore: python atc/export_air.py  (one static-shape AIR per reference
# case: --input_shape and --dynamic_dims are not honoured with --framework=1).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v atc >/dev/null || { echo "atc not found: run on a host with the CANN toolkit (source .../set_env.sh)" >&2; exit 1; }
ls air/*.air >/dev/null 2>&1 || { echo "no air/*.air: run python atc/export_air.py on an Ascend host first" >&2; exit 1; }
mkdir -p om
atc --model=air/tiny_llama_case0.air --framework=1 --output=om/tiny_llama_air_case0 --soc_version=Ascend910B --precision_mode=must_keep_origin_dtype --log=error
atc --model=air/tiny_llama_case1.air --framework=1 --output=om/tiny_llama_air_case1 --soc_version=Ascend910B --precision_mode=must_keep_origin_dtype --log=error
