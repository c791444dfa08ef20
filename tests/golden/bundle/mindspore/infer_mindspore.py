#!/usr/bin/env python3
"""Route (a): run tiny_llama.mindir with MindSpore (mindspore.load + nn.GraphCell) on the reference inputs and
write one .npz per case (keyed by output name) for compare_outputs.py.

ASCEND HOST ONLY by default (MindSpore with the Ascend backend and CANN installed). `--device CPU` runs it
on a CPU only for bundles compiled with --target cpu; an ascend MindIR holds fused primitives (RmsNorm,
FlashAttentionScore...) without CPU kernels. `--load-only` stops after loading (works on any MindSpore).

    python mindspore/infer_mindspore.py [--device Ascend] [--device-id 0] [--out outputs/mindspore]
    python compare_outputs.py outputs/mindspore --precision fp16
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(__file__).resolve().parents[1]
MINDIR = BUNDLE / "model" / "tiny_llama.mindir"
INPUTS = [{'name': 'input_ids', 'dtype': 'int64', 'shape': ['batch', 'seq']}, {'name': 'attention_mask', 'dtype': 'int64', 'shape': ['batch', 'seq']}]
OUTPUTS = ['output']
PRECISION_MODE = "must_keep_origin_dtype"  # Ascend operator precision: keep the model's dtypes
JIT_CONFIG = {'infer_boost': 'off'}  # the execution context the MindIR is written for (README, "Context")
WRITTEN_BY = "2.10.0"  # the MindSpore that exported the MindIR
MS_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64",
             "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool_"}


def check_case(name, arrays):
    for spec in INPUTS:
        arr = arrays[spec["name"]]
        if arr.ndim != len(spec["shape"]):
            sys.exit(f"{name}: {spec['name']} has rank {arr.ndim}, the model wants {len(spec['shape'])}")
        for axis, d in enumerate(spec["shape"]):
            if isinstance(d, int) and arr.shape[axis] != d:
                sys.exit(f"{name}: {spec['name']} dim {axis} is {arr.shape[axis]}, the model wants {d}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="Ascend", choices=["Ascend", "CPU"])
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--out", type=Path, default=BUNDLE / "outputs" / "mindspore")
    p.add_argument("--load-only", action="store_true", help="load the MindIR and build the GraphCell, run nothing")
    args = p.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor, nn

    try:
        ms.set_device(args.device, args.device_id)
    except AttributeError:  # MindSpore before set_device
        ms.set_context(device_target=args.device, device_id=args.device_id)
    # the context the MindIR is written for (README, "Context"): the default aclnn kernels, not infer_boost's
    ms.set_context(mode=ms.GRAPH_MODE, jit_config=JIT_CONFIG)
    if ms.__version__ != WRITTEN_BY:
        print(f"note: MindSpore {ms.__version__} loading a MindIR written by MindSpore {WRITTEN_BY}", file=sys.stderr)
    if args.device == "Ascend":
        try:
            from mindspore.device_context.ascend.op_precision import precision_mode
            precision_mode(PRECISION_MODE)
        except ImportError:
            ms.set_context(ascend_config={"precision_mode": PRECISION_MODE})
    # MindIRs with weights over 1 GiB keep them in model/tiny_llama_variables/: it must stay beside the .mindir.
    graph = ms.load(str(MINDIR))
    cell = nn.GraphCell(graph)
    # Declare the dynamic dims before the first call: without these placeholders a GraphCell keeps some shapes
    # of its first call and fails at the next shape (found by graphconv with MindSpore 2.10).
    dtype = {s["name"]: getattr(ms, MS_DTYPES[s["dtype"]]) for s in INPUTS}
    cell.set_inputs(*[Tensor(shape=[d if isinstance(d, int) else None for d in s["shape"]], dtype=dtype[s["name"]])
                      for s in INPUTS])
    print(f"loaded {MINDIR.name} on {args.device} (jit_config {ms.get_context('jit_config')})")
    if args.load_only:
        return 0
    meta = json.loads((BUNDLE / "reference" / "cases.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for case in meta["cases"]:
        with np.load(BUNDLE / case["inputs"]) as data:
            arrays = {s["name"]: data[s["name"]] for s in INPUTS}
        check_case(case["name"], arrays)
        outs = cell(*[Tensor(arrays[s["name"]], dtype=dtype[s["name"]]) for s in INPUTS])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        result = {}
        for name, t in zip(OUTPUTS, outs):
            if t.dtype == ms.bfloat16:
                t = t.astype(ms.float32)
            result[name] = t.asnumpy()
        np.savez(args.out / f"{case['name']}.npz", **result)
        print(f"{case['name']}: wrote {args.out / (case['name'] + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
