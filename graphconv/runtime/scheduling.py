"""How a compile's work is scheduled for latency: every mechanism that changes *when* or *where* work runs,
never *what* it computes, is here, each with its own switch, all of them off with one master switch.

  oracle_beside_emit  in layer-streamed mode the layer-by-layer oracle (onnxruntime, in this process) runs
                      while the MindSpore child exports and runs the blocks (`beside`), when the weights take
                      at most OVERLAP_MEMORY_SHARE of the available memory (both then read them from the
                      page cache)
  oracle_nice         the oracle beside the emit runs in a thread ORACLE_NICE lower in priority: on 2 cores
                      the child is the critical path
  block_read_ahead    the block-by-block run reads each next block's weights in a second thread while a
                      block runs (graphconv/runtime/blocks.py)
  exit_without_teardown  the `graphconv` command and the MindSpore child end with os._exit once their work is
                      written (`end`), skipping the interpreter's teardown of ~1,400 modules

GRAPHCONV_SCHEDULING in the environment sets them (the child processes inherit it): "off" turns all off,
"-NAME,-NAME" turns those off, "off,+NAME" only those on. docs/performance.md has the interleaved A/B of each,
and of the two mechanisms measured and removed for not paying (a warm MindSpore child started with the
compile; the weight files asked of the kernel from the compile's start).
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
    oracle_beside_emit: bool = True
    oracle_nice: bool = True
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
