#!/usr/bin/env python3
"""Route (b): run lite/tiny_llama_ascend.mindir (from lite/convert_lite.sh) with MindSpore Lite on the
reference inputs and write one .npz per case (keyed by output name) for compare_outputs.py.

ASCEND HOST ONLY (mindspore_lite wheel of the cloud-side package, CANN installed). With dynamic profiles
the model runs only at profile shapes; the reference case shapes are among the profiles.

    python lite/infer_lite.py [--device-id 0] [--out outputs/lite]
    python compare_outputs.py outputs/lite --precision fp16
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(__file__).resolve().parents[1]
MODEL = BUNDLE / "lite" / "tiny_llama_ascend.mindir"
INPUTS = [{'name': 'input_ids', 'dtype': 'int64', 'shape': ['batch', 'seq']}, {'name': 'attention_mask', 'dtype': 'int64', 'shape': ['batch', 'seq']}]
OUTPUTS = ['output']


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--out", type=Path, default=BUNDLE / "outputs" / "lite")
    args = p.parse_args(argv)
    if not MODEL.is_file():
        sys.exit(f"{MODEL} is missing: run lite/convert_lite.sh first")

    import mindspore_lite as mslite

    context = mslite.Context()
    context.target = ["ascend"]
    context.ascend.device_id = args.device_id
    model = mslite.Model()
    model.build_from_file(str(MODEL), mslite.ModelType.MINDIR, context)
    meta = json.loads((BUNDLE / "reference" / "cases.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for case in meta["cases"]:
        with np.load(BUNDLE / case["inputs"]) as data:
            arrays = [data[s["name"]] for s in INPUTS]
        inputs = model.get_inputs()
        model.resize(inputs, [list(a.shape) for a in arrays])
        for tensor, arr in zip(inputs, arrays):
            tensor.set_data_from_numpy(np.ascontiguousarray(arr))
        outputs = model.predict(inputs)
        np.savez(args.out / f"{case['name']}.npz", **{n: t.get_data_to_numpy() for n, t in zip(OUTPUTS, outputs)})
        print(f"{case['name']}: wrote {args.out / (case['name'] + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
