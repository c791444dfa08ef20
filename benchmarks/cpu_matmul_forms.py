"""cpu_matmul_forms: what MindSpore 2.10's CPU backend costs for a [batch, seq, in] input times a 2-D weight,
by the form the lowering emits, under dynamic shapes (Cell.set_inputs with None dims, as generation runs).

Forms: `matmul` (ops.matmul, the MatMulExt primitive: numpy semantics), `dense` (ops.dense on the weight stored
[out, in]: what graphconv.compiler.lowering.dense_weights picks), `dense_cast` (ops.dense of a bf16 weight cast to
fp32 each call: a `--dtype auto` export's weights), `matmul_cast`. Each form runs in its own process: 8 layers
of two [2048, 5632] weights (the 1.1B's MLP shape), an input [2, S, 2048] at S = 3, 1, 1; it prints the seconds
per call and the process's RSS after the calls, against the weights' bytes.

    .venv/bin/python benchmarks/cpu_matmul_forms.py
"""

from __future__ import annotations

import subprocess
import sys

FORMS = ("matmul", "dense", "matmul_cast", "dense_cast")
LAYERS, HIDDEN, INTER = 8, 2048, 5632


def child(form: str) -> None:
    import time

    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    dense, cast = form.startswith("dense"), form.endswith("_cast")
    dtype = ms.bfloat16 if cast else ms.float32
    rng = np.random.default_rng(0)

    def weight(rows, cols, name):
        shape = (cols, rows) if dense else (rows, cols)  # dense: stored [out, in]
        return Parameter(Tensor(rng.normal(0, 0.02, shape).astype(np.float32)).astype(dtype), name=name)

    class Layers(nn.Cell):
        def __init__(self):
            super().__init__()
            self.up = ParameterTuple([weight(HIDDEN, INTER, f"up{i}") for i in range(LAYERS)])
            self.down = ParameterTuple([weight(INTER, HIDDEN, f"down{i}") for i in range(LAYERS)])

        def product(self, x, w):
            if cast:
                w = ops.cast(w, ms.float32)
            return ops.dense(x, w) if dense else ops.matmul(x, w)

        def construct(self, x):
            for i in range(LAYERS):
                x = self.product(self.product(x, self.up[i]), self.down[i])
            return x

    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**30

    net = Layers()
    weights = sum(p.nbytes for p in net.get_parameters()) / 2**30
    net.set_inputs(Tensor(shape=[None, None, HIDDEN], dtype=ms.float32))
    seconds = []
    for s in (3, 1, 1):
        x = Tensor(rng.random((2, s, HIDDEN), dtype=np.float32))
        t = time.perf_counter()
        net(x).asnumpy()
        seconds.append(time.perf_counter() - t)
    print(f"{form:<12} weights {weights:.2f} GiB  rss {rss():.2f} GiB  first call {seconds[0]:.2f} s  "
          f"then {min(seconds[1:]):.3f} s a call", flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    for form in FORMS:
        out = subprocess.run([sys.executable, __file__, "--child", form], capture_output=True, text=True)
        print(out.stdout.strip() or f"{form}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)


if __name__ == "__main__":
    main()
