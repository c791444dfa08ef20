"""The model's weight files read into the page cache while the compile's first stages run.

A layer-streamed compile reads every weight twice, after the passes: the oracle (onnxruntime, layer by
layer) and the MindSpore child (the block run, which also writes the MindIR). From a model whose files are
not in the page cache, both wait for the disk then, while load, onnxsim, the passes and the lowering
(~4 s on the 1.1B benchmark model) leave it idle. `Readahead` asks the kernel for the files' bytes from
the compile's start, in file order (the layers' order in every exporter's file), a chunk at a time
(posix_fadvise WILLNEED: the kernel reads them in; nothing is copied into this process), by a thread that
stops when the compile leaves it. Measured on the 1.1B benchmark model with its file out of the page cache
(4.4 GB): the oracle took 7.3-11.2 s with it (six compiles), 14.4-20.1 s without (three); the compile's wall
time did not differ beyond this machine's noise (21.3-27.8 s against 22.1-30.4 s), as the MindSpore child,
not the oracle, was the longer of the two there. Without it the oracle's page faults read the file 8 MiB
at a time, while the child's reads compete with them. The compile does it only when the weights fit the page cache easily
(Compiler.run: the share of available memory the oracle beside the emit needs too); for a larger model
the first pages would be gone before they were read.
"""

from __future__ import annotations

import os
import threading

# The kernel reads at most max(read_ahead_kb, max_sectors_kb) of one WILLNEED call and drops the rest
# (measured here, read_ahead_kb 8192: 64 MiB calls over the 1.1B model's 4.2 GiB file had read 528 MiB after
# 30 s). In 1 MiB calls the whole file was in the page cache after 2.5 s (0.96 s of kernel time), in 8 MiB
# calls after 3.0 s; `dd bs=64M` read it in 7.3 s.
CHUNK_BYTES = 1 << 20


def ask(fd: int, offset: int, length: int, stop: threading.Event | None = None) -> int:
    """Ask the kernel to read [offset, offset + length) of `fd` into the page cache, CHUNK_BYTES per call
    (each returns once its reads are queued); until `stop` is set. Returns the bytes asked for."""
    at, end = offset, offset + length
    while at < end and not (stop is not None and stop.is_set()):
        n = min(CHUNK_BYTES, end - at)
        os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED)
        at += n
    return at - offset


def ask_files(ranges, stop: threading.Event | None = None) -> int:
    """Ask the kernel for these (path, offset, length) ranges (`ask`), each file opened once; a file that
    cannot be opened or advised is passed over (a hint only). Until `stop` is set. Returns the bytes asked for."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    by_path: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in ranges:
        if length > 0:
            by_path.setdefault(str(path), []).append((offset, length))
    asked = 0
    for path, spans in by_path.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for offset, length in spans:
                asked += ask(fd, offset, length, stop)
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def file_ranges(refs) -> list[tuple[str, int, int]]:
    """(path, offset, length) per file, in file order, covering these weight refs (graphconv.frontend.weights.
    WeightRef) with their gaps closed: one sequential read per file."""
    spans: dict[str, list[int]] = {}
    for ref in refs:
        if ref.length <= 0 or not ref.path:
            continue
        span = spans.setdefault(ref.path, [ref.offset, ref.offset + ref.length])
        span[0], span[1] = min(span[0], ref.offset), max(span[1], ref.offset + ref.length)
    return [(path, begin, end - begin) for path, (begin, end) in spans.items()]


class Readahead:
    """A thread asking for `ranges` (file_ranges) a CHUNK_BYTES chunk at a time, from `with` to its end."""

    def __init__(self, ranges: list[tuple[str, int, int]]):
        self.ranges = ranges
        self.asked = 0  # bytes asked for so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readahead", daemon=True)

    def __enter__(self) -> "Readahead":
        if self.ranges and hasattr(os, "posix_fadvise"):
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for one in self.ranges:  # (a file at a time: `asked` grows as it goes)
            self.asked += ask_files([one], self._stop)
