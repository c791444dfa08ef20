#!/usr/bin/env bash
# ASCEND HOST ONLY (CANN toolkit with atc; source set_env.sh first): route (c), ONNX -> .om with
# `atc --framework=5`. Mode "range" builds one dynamic-shape model over the --shape-range ranges (-1 where no
# range was given); mode "profiles" builds one model per --dynamic_dims profile (it runs only at those shapes).
#   bash atc/atc_onnx.sh [range|profiles]     (default: range)    -> om/tiny_llama*.om
set -euo pipefail
cd "$(dirname "$0")/.."
command -v atc >/dev/null || { echo "atc not found: run on a host with the CANN toolkit (source .../set_env.sh)" >&2; exit 1; }
mkdir -p om
case "${1:-range}" in
  range)
    atc --model=onnx/tiny_llama.onnx --framework=5 --output=om/tiny_llama --soc_version=Ascend910B --input_shape="input_ids:1~8,1~2048;attention_mask:1~8,1~2048" --input_format=ND --precision_mode=must_keep_origin_dtype --log=error
    ;;
  profiles)
    atc --model=onnx/tiny_llama.onnx --framework=5 --output=om/tiny_llama_profiles --soc_version=Ascend910B --input_shape="input_ids:-1,-1;attention_mask:-1,-1" --input_format=ND --dynamic_dims="1,1,1,1;1,2,1,2;1,4,1,4;1,8,1,8;1,16,1,16;1,32,1,32;1,64,1,64;1,128,1,128;1,256,1,256;1,512,1,512;1,1024,1,1024;1,2048,1,2048;2,1,2,1;2,2,2,2;2,4,2,4;2,8,2,8;2,16,2,16;2,32,2,32;2,64,2,64;2,128,2,128;2,256,2,256;2,512,2,512;2,1024,2,1024;2,2048,2,2048;3,5,3,5;4,1,4,1;4,2,4,2;4,4,4,4;4,8,4,8;4,16,4,16;4,32,4,32;4,64,4,64;4,128,4,128;4,256,4,256;4,512,4,512;4,1024,4,1024;4,2048,4,2048;5,11,5,11;8,1,8,1;8,2,8,2;8,4,8,4;8,8,8,8;8,16,8,16;8,32,8,32;8,64,8,64;8,128,8,128;8,256,8,256;8,512,8,512;8,1024,8,1024;8,2048,8,2048" --precision_mode=must_keep_origin_dtype --log=error
    ;;
  *)
    echo "usage: $0 [range|profiles]" >&2
    exit 2
    ;;
esac
