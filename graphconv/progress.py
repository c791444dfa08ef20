"""Progress and log lines on stderr. stdout is kept for results (`--json`).

Stage lines ("[   3.1s] emit (mindspore.export)") and, for work measured in bytes or items, a live line with
done / total, rate and ETA. All of it is silent with --quiet and when stdout is not a terminal (a script or a
CI log gets the report, not the chatter); GRAPHCONV_PROGRESS=1 turns it on anyway.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f}{' ' + unit if unit else ''}"
    for suffix, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {suffix}"
    return f"{n:.0f} B"


class Progress:
    """Prints one line when a stage starts; `track()` gives a live done/total line with an ETA.

    quiet=True silences everything (errors are printed by the CLI, not here).
    """

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self._t0 = time.perf_counter()
        self._holds: dict[int, threading.Event] = {}  # thread -> the event its new trackers wait for (held)

    @classmethod
    def for_cli(cls, quiet: bool) -> "Progress":
        """What a command prints: nothing with --quiet or when stdout is not a terminal, unless
        GRAPHCONV_PROGRESS=1."""
        forced = os.environ.get("GRAPHCONV_PROGRESS", "") not in ("", "0")
        return cls(quiet=quiet or not (forced or sys.stdout.isatty()))

    def info(self, message: str) -> None:
        if not self.quiet:
            self._line(f"[{time.perf_counter() - self._t0:7.1f}s] {message}")

    def _line(self, text: str) -> None:
        """One write with its newline: an interrupt between two (print's) would leave the line open, and the
        run's last line would follow on it."""
        self.stream.write(text + "\n")
        self.stream.flush()

    def warn(self, message: str) -> None:
        if not self.quiet:
            self._line(f"warning: {message}")

    def track(self, label: str, total: float, unit: str = "B") -> "Tracker":
        tracker = Tracker(self, label, total, unit)
        tracker.hold = self._holds.get(threading.get_ident())
        return tracker

    @contextlib.contextmanager
    def held(self, until: threading.Event):
        """The lines of trackers this thread starts in the body wait until `until` is set (a step running
        beside another whose own line is on the terminal meanwhile)."""
        self._holds[threading.get_ident()] = until
        try:
            yield
        finally:
            self._holds.pop(threading.get_ident(), None)


class Tracker:
    """done / total of one long step, printed at most twice a second, with rate and ETA. `hold` (a
    threading.Event, or None): the line is not printed until it is set, for a step that runs beside another
    whose own line is on the terminal meanwhile (the rate still counts from the first unit done)."""

    def __init__(self, progress: Progress, label: str, total: float, unit: str):
        self.progress, self.label, self.total, self.unit = progress, label, max(total, 1), unit
        self._start = time.perf_counter()
        self._last = 0.0
        self.done = 0.0
        self.hold = None

    def update(self, done: float) -> None:
        now = time.perf_counter()
        if self.done == 0 and done > 0:
            self._start = now - 1e-3  # the rate counts from the first unit done (not from a child's start-up)
        finished_before = self.done >= self.total
        self.done = done
        held = self.hold is not None and not self.hold.is_set()
        if self.progress.quiet or held or finished_before or (now - self._last < 0.5 and done < self.total):
            return
        self._last = now
        elapsed = now - self._start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        eta_text = f"ETA {eta:.0f}s" if eta != float("inf") else "ETA -"
        line = (f"  {self.label}: {_human(done, self.unit)} / {_human(self.total, self.unit)} "
                f"({100 * done / self.total:.0f}%), {_human(rate, self.unit)}/s, {eta_text}")
        stream = self.progress.stream
        if getattr(stream, "isatty", lambda: False)():  # one line, rewritten in place
            end = "\n" if done >= self.total else ""
            print(f"\r{line}\033[K", end=end, file=stream, flush=True)
        else:
            stream.write(line + "\n")  # (one write: Progress._line)
            stream.flush()


SILENT = Progress(quiet=True)
