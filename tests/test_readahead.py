"""graphconv/frontend/readahead.py: the weight files asked of the kernel from the compile's start, in chunks
the kernel reads whole, in file order, stopping when the compile ends."""

from __future__ import annotations

import os
import threading

from graphconv.frontend import readahead
from graphconv.frontend.weights import WeightRef


def _ref(path, offset, length):
    return WeightRef("w", str(path), offset, length, "float32", (length // 4,))


def test_file_ranges_cover_each_file_once_in_order(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    refs = [_ref(a, 4096, 100), _ref(b, 0, 8), _ref(a, 0, 64), _ref(a, 8192, 4096), _ref(b, 4096, 0)]
    # the gaps between a file's weights are read too (one sequential read); empty refs add nothing
    assert readahead.file_ranges(refs) == [(str(a), 0, 12288), (str(b), 0, 8)]


def _recording(monkeypatch):
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: asked.append((offset, length, advice)))
    return asked


def test_ask_splits_into_chunks_the_kernel_reads_whole(monkeypatch, tmp_path):
    """One WILLNEED call reads at most max(read_ahead_kb, max_sectors_kb) (8 MiB here): the rest of a larger
    call is dropped, so a range is asked CHUNK_BYTES at a time, covering it exactly."""
    asked = _recording(monkeypatch)
    length = 5 * readahead.CHUNK_BYTES + 123
    assert readahead.ask(3, 1000, length) == length
    assert all(n <= readahead.CHUNK_BYTES and advice == os.POSIX_FADV_WILLNEED for _, n, advice in asked)
    assert [o for o, _, _ in asked] == [1000 + k * readahead.CHUNK_BYTES for k in range(6)]
    assert sum(n for _, n, _ in asked) == length


def test_readahead_asks_every_byte_then_stops_with_the_compile(monkeypatch, tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 64)
    asked = _recording(monkeypatch)
    with readahead.Readahead([(str(path), 0, 3 * readahead.CHUNK_BYTES)]) as ahead:
        ahead._thread.join()
    assert ahead.asked == 3 * readahead.CHUNK_BYTES and len(asked) == 3
    # left early: the thread stops between two chunks and is joined on the way out
    gate, started, calls = threading.Event(), threading.Event(), []

    def slow(fd, offset, length, advice):
        calls.append(offset)
        started.set()
        gate.wait()

    monkeypatch.setattr(os, "posix_fadvise", slow)
    with readahead.Readahead([(str(path), 0, 1000 * readahead.CHUNK_BYTES)]) as ahead:
        assert started.wait(10)
        gate.set()
    assert not ahead._thread.is_alive() and len(calls) < 1000
    # nothing to read: no thread
    with readahead.Readahead([]) as ahead:
        assert not ahead._thread.is_alive()


def test_ask_files_opens_each_file_once_and_passes_over_one_it_cannot_open(monkeypatch, tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"\0" * 64)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags: opened.append(str(path)) or real_open(path, flags))
    asked = _recording(monkeypatch)
    n = readahead.ask_files([(a, 0, 4096), (tmp_path / "missing.bin", 0, 4096), (a, 8192, 4096), (a, 0, 0)])
    assert n == 8192 and [(o, length) for o, length, _ in asked] == [(0, 4096), (8192, 4096)]
    assert opened == [str(a), str(tmp_path / "missing.bin")]
