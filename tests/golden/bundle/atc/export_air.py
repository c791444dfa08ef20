#!/usr/bin/env python3
"""Route (c), AIR: export the compiled network (source/network.py + source/network.ckpt) to AIR, one file per
reference case at that case's static shapes, for atc/atc_air.sh (`atc --framework=1`).

ASCEND HOST ONLY: mindspore.export(file_format="AIR") works only with the Ascend backend; MindSpore documents
AIR as deprecated (to be removed) and limits each tensor of an AIR file to 2 GB.

    python atc/export_air.py [--device-id 0] [--case case0 ...]
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(__file__).resolve().parents[1]
INPUTS = [{'name': 'input_ids', 'dtype': 'int64', 'shape': ['batch', 'seq']}, {'name': 'attention_mask', 'dtype': 'int64', 'shape': ['batch', 'seq']}]
CASES = ['case0', 'case1']
PRECISION_MODE = "must_keep_origin_dtype"


def load_network():
    spec = importlib.util.spec_from_file_location("network", BUNDLE / "source" / "network.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["network"] = module
    spec.loader.exec_module(module)
    return module.Network


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--case", action="append", choices=CASES, help="export only this case (repeatable)")
    args = p.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor

    try:
        ms.set_device("Ascend", args.device_id)
    except AttributeError:
        ms.set_context(device_target="Ascend", device_id=args.device_id)
    ms.set_context(mode=ms.GRAPH_MODE)
    net = load_network()()  # parameters as zeros, then the checkpoint
    missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(str(BUNDLE / "source" / "network.ckpt")))
    if missing:
        sys.exit(f"parameters missing from network.ckpt: {missing[:5]}")
    net.set_train(False)
    out_dir = BUNDLE / "air"
    out_dir.mkdir(exist_ok=True)
    for case in args.case or CASES:
        with np.load(BUNDLE / "reference" / f"{case}.inputs.npz") as data:
            arrays = [data[s["name"]] for s in INPUTS]
        ms.export(net, *[Tensor(a) for a in arrays], file_name=str(out_dir / f"tiny_llama_{case}"), file_format="AIR")
        print(f"wrote {out_dir / ('tiny_llama_' + case + '.air')} at shapes {[list(a.shape) for a in arrays]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
