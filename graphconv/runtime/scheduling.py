"""How a compile's work is scheduled for latency: every mechanism that changes *when* or *where* work runs,
never *what* it computes, is here, each with its own switch, all of them off with one master switch.

  warm_child          the emit stage's MindSpore child starts with the compile and imports MindSpore (and
                      compiles a tiny network) while the stages before the emit run (`warm_up`, in the child)
  oracle_beside_emit  in layer-streamed mode the layer-by-layer oracle (onnxruntime, in this process) runs
                      while the MindSpore child exports and runs the blocks (`beside`), when the weights take
                      at most OVERLAP_MEMORY_SHARE of the available memory (both then read them from the
                      page cache)
  oracle_nice         the oracle beside the emit runs in a thread ORACLE_NICE lower in priority: on 2 cores
                      the child is the critical path
  weights_read_ahead  in layer-streamed mode, while the weights fit the page cache easily, the kernel is asked
                      for the weight files from the compile's start (posix_fadvise WILLNEED, `ReadAhead`):
                      the oracle and the child read them twice after the passes, which leave the disk idle
  block_read_ahead    the block-by-block run reads each next block's weights in a second thread while a
                      block runs (graphconv/runtime/blocks.py)
  exit_without_teardown  the `graphconv` command and the MindSpore child end with os._exit once their work is
                      written (`end`), skipping the interpreter's teardown of ~1,400 modules

GRAPHCONV_SCHEDULING in the environment sets them (the child processes inherit it): "off" turns all off,
"-NAME,-NAME" turns those off, "off,+NAME" only those on. docs/performance.md has the interleaved A/B of each.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import psutil

ENV = "GRAPHCONV_SCHEDULING"
# the layer-by-layer oracle runs beside the MindSpore child while the weights take at most this share of the
# available memory
OVERLAP_MEMORY_SHARE = 0.25
ORACLE_NICE = 10


@dataclasses.dataclass(frozen=True)
class Schedule:
    warm_child: bool = True
    oracle_beside_emit: bool = True
    oracle_nice: bool = True
    weights_read_ahead: bool = True
    block_read_ahead: bool = True
    exit_without_teardown: bool = True

    @classmethod
    def from_env(cls, text: str | None = None) -> "Schedule":
        """The schedule GRAPHCONV_SCHEDULING (or `text`) asks for; unknown names are ignored (a hint only)."""
        text = os.environ.get(ENV, "") if text is None else text
        on = {f.name: True for f in dataclasses.fields(cls)}
        for word in (w.strip() for w in text.split(",") if w.strip()):
            if word == "off":
                on = dict.fromkeys(on, False)
            elif word[:1] in "+-" and word[1:] in on:
                on[word[1:]] = word[0] == "+"
        return cls(**on)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def beside(self, weight_bytes: int) -> bool:
        """Whether the oracle runs beside the emit for weights of this size (OVERLAP_MEMORY_SHARE)."""
        return self.oracle_beside_emit and _fits_page_cache(weight_bytes)


def _fits_page_cache(nbytes: int) -> bool:
    """Whether weights of this size stay in the page cache between two reads of them."""
    return nbytes <= OVERLAP_MEMORY_SHARE * psutil.virtual_memory().available


# The kernel reads at most max(read_ahead_kb, max_sectors_kb) of one WILLNEED call and drops the rest: asked in
# 1 MiB calls a file is read whole.
READ_AHEAD_CHUNK = 1 << 20


class ReadAhead:
    """A thread asking the kernel to read these (path, offset, length) ranges into the page cache, a
    READ_AHEAD_CHUNK at a time (posix_fadvise WILLNEED: nothing is copied into this process), from `with`
    to its end; `asked`: the bytes asked for so far."""

    def __init__(self, ranges: list[tuple[str, int, int]]):
        self.ranges = ranges if hasattr(os, "posix_fadvise") else []
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)

    def __enter__(self) -> "ReadAhead":
        if self.ranges:
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for path, offset, length in self.ranges:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # (a hint only)
                continue
            try:
                at, end = offset, offset + length
                while at < end and not self._stop.is_set():
                    n = min(READ_AHEAD_CHUNK, end - at)
                    os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED)
                    at += n
                    self.asked += n
            except OSError:
                pass
            finally:
                os.close(fd)


def weight_files_ahead(schedule: Schedule, refs, nbytes: int, wanted: bool) -> ReadAhead:
    """The ReadAhead of the weight files these refs (graphconv.frontend.weights.WeightRef) are in, one span per
    file in file order, when the schedule and `wanted` (a layer-streamed, verified compile) say so and the
    weights fit the page cache; else one that asks for nothing."""
    if not (schedule.weights_read_ahead and wanted and _fits_page_cache(nbytes)):
        return ReadAhead([])
    spans: dict[str, list[int]] = {}
    for ref in refs:
        if ref.length > 0 and ref.path:
            span = spans.setdefault(ref.path, [ref.offset, ref.offset + ref.length])
            span[0], span[1] = min(span[0], ref.offset), max(span[1], ref.offset + ref.length)
    return ReadAhead([(path, begin, end - begin) for path, (begin, end) in spans.items()])


def yielding_the_cores(call):
    """call() in a thread of its own whose scheduling priority is ORACLE_NICE lower, its value returned or its
    error raised. On Linux a nice value is a thread's, and the threads it starts (onnxruntime's pools) inherit
    it: a thread of its own, so that the caller's thread (a user's, through the Python API) keeps its priority;
    unprivileged, a thread cannot take a lowered priority back. Elsewhere call() runs as it is."""
    if not sys.platform.startswith("linux"):
        return call()
    outcome: dict = {}

    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + ORACLE_NICE))
        except OSError:  # (a scheduler that refuses: the oracle runs at the priority it has)
            pass
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="oracle", daemon=True)  # (Ctrl-C in join: the compile unwinds)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def both(work, oracle, schedule: Schedule, weight_bytes: int, cancel, progress) -> tuple[tuple, dict]:
    """`work()` (the emit: a MindSpore child's export and block run) and `oracle()` (onnxruntime layer by layer,
    in this process), and how they ran (for the report's scheduling section). The two are independent until
    their values are compared. Beside each other where the schedule says so and the weights fit
    (Schedule.beside): `work` in a thread, its progress lines held until the oracle's end, the oracle at lower
    priority with oracle_nice; if the oracle fails, `cancel()` kills the work's child. Else the oracle first,
    then the work."""
    if not schedule.beside(weight_bytes):
        values = oracle()
        return (work(), values), {"oracle": "before the emit"}
    outcome: dict = {}

    def run() -> None:
        try:
            with progress.held(until=done):
                outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            outcome["error"] = e

    done = threading.Event()
    thread = threading.Thread(target=run, name="emit", daemon=True)
    thread.start()
    try:
        values = yielding_the_cores(oracle) if schedule.oracle_nice else oracle()
    except BaseException:
        cancel()
        raise
    finally:
        done.set()
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return (outcome["value"], values), {"oracle": "beside the emit" + (f", at nice +{ORACLE_NICE}"
                                                                        if schedule.oracle_nice else "")}


def end(code: int) -> None:
    """End the process with `code`. With exit_without_teardown: exit handlers run (atexit) and threads that are
    not daemons are waited for, as CPython's own exit does, then the standard streams are flushed and the
    process ends by os._exit, without the interpreter's teardown (the release of every module and object).
    The caller has nothing pending: every file is closed and every child reaped before this is called."""
    if not Schedule.from_env().exit_without_teardown:
        sys.exit(code)
    import atexit

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # (CPython's own exit path runs these the same way)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def warm_up() -> dict:
    """What the warm child does while the parent still runs the stages before the emit (in the child): import
    what every export task imports (MindSpore, onnx_ir, the streamed writer and the block run), then compile,
    run and export a tiny network, so that MindSpore's first-use set-up is done before the task comes. The
    imported objects are frozen out of the collector's walks (MindSpore collects on every graph compile).
    Returns its seconds, or the error it met, which is the task's to meet again."""
    import gc
    import time

    t0 = time.perf_counter()
    import mindspore as ms
    import numpy as np
    import onnx_ir  # noqa: F401
    from mindspore import Tensor, nn, ops

    from graphconv.runtime import blocks, export_tasks, mindir_stream  # noqa: F401

    class Tiny(nn.Cell):
        def construct(self, x):
            return ops.softmax(ops.dense(x * ops.sigmoid(x), ops.ones((4, 4), ms.float32)), -1)

    outcome = {}
    try:
        ms.set_device("CPU")
        ms.set_context(mode=ms.GRAPH_MODE)
        Tiny()(Tensor(np.ones((2, 4), np.float32)))
        mindir_stream.export_graph(Tiny(), Tensor(shape=[None, 4], dtype=ms.float32), file_name="warm-up")
    except Exception as e:  # noqa: BLE001 - an optimization only
        outcome["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    gc.collect()
    gc.freeze()
    return {**outcome, "seconds": round(time.perf_counter() - t0, 2)}
