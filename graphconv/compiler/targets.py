"""The compile targets: for each, which graph is lowered, how its MindIR is built and how it is verified.

The pipeline (graphconv/pipeline.py) asks its Target rather than testing the target's name:

  ascend  lowers the fused graph: `mindspore`-domain ops become MindSpore's fused primitives
          (FlashAttentionScore, RmsNorm, ...), which have no CPU kernel. Its layer classes are compiled once
          for all their instances (lazy_inline). The numbers are checked on the cpu twin (the cpu form,
          built from the exported network's own Parameters), the primitives' own precision (fp16 q/k/v around
          FlashAttentionScore) separately, by onnxruntime on bodies that round the same way.
  cpu     lowers the cpu form (every fused op replaced by its reference body): a MindIR that runs on
          MindSpore's CPU, which a plain GraphCell loads and runs at shape after shape (no lazy_inline: such a
          MindIR fails at the second shape, mindspore 2.10). Verified on the MindIR itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from graphconv.errors import InputError, UnsupportedError

if TYPE_CHECKING:  # (the CLI imports this module for --target's choices: it stays light)
    import onnx


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    help: str
    fused_primitives: bool  # lowers MindSpore's fused primitives (no CPU kernels) rather than their bodies

    def network_graph(self, fused: onnx.ModelProto, cpu_form: onnx.ModelProto) -> onnx.ModelProto:
        """The graph whose lowering is this target's MindIR."""
        return fused if self.fused_primitives else cpu_form

    @property
    def lazy_inline(self) -> bool:
        """Whether the MindIR's layer classes are compiled once for all instances (graphconv/compiler/codegen.py)."""
        return self.fused_primitives

    def needs_twin(self, twin: onnx.ModelProto, fused: onnx.ModelProto) -> bool:
        """Whether the numbers are checked on a separate cpu twin rather than on the MindIR itself: the MindIR
        holds primitives MindSpore's CPU cannot run, and the twin is another graph (it is not when the fused
        graph has no fused op and no emulated precision)."""
        return self.fused_primitives and twin is not fused

    def measures_primitive_precision(self, compile_precision: str) -> bool:
        """Whether the fused primitives' own lower precision is measured apart (at fp32; at fp16/bf16 the
        compile's tolerance covers it)."""
        return self.fused_primitives and compile_precision == "fp32"

    def check_network(self, program) -> None:
        """Refuse a lowered network holding a primitive MindSpore cannot run on this target's device."""
        if not self.fused_primitives:
            return
        for call, why in HOST_ONLY.items():
            if program.calls(call):
                raise UnsupportedError(f"{why}; --target cpu compiles this model")

    def check(self, compile_precision: str) -> None:
        """Refuse a precision this target cannot run."""
        from passes import precision

        if not self.fused_primitives and compile_precision != "fp32" and precision.CPU_EMULATED[compile_precision]:
            raise InputError(f"--precision {compile_precision} needs --target ascend: MindSpore CPU has no "
                             f"{compile_precision} kernels for MatMul, Softmax, Exp, ...")


# Primitives the lowering emits that have no Ascend kernel (their call in the generated code -> why).
HOST_ONLY = {"ops.LSTM": "an LSTM over a dynamic sequence runs MindSpore's LSTM primitive, which has CPU and GPU "
                         "kernels only (fuse-lstm makes Ascend's DynamicRNN where it can: disabled or refused here, "
                         "the coverage's recurrent family says why)"}

ASCEND = Target("ascend", "MindSpore fused primitives", fused_primitives=True)
CPU = Target("cpu", "a network that runs on CPU", fused_primitives=False)
TARGETS: dict[str, Target] = {t.name: t for t in (ASCEND, CPU)}


def get(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise InputError(f"unknown target {name!r} (choose from {', '.join(TARGETS)})") from None
