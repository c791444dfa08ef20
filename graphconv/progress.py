"""Progress and log lines on stderr. stdout is kept for results (`--json`)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints one line when a stage starts and one when it ends, with its duration.

    quiet=True silences everything (errors are printed by the CLI, not here).
    """

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self._t0 = time.perf_counter()

    def info(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self._t0:7.1f}s] {message}", file=self.stream, flush=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            print(f"warning: {message}", file=self.stream, flush=True)


SILENT = Progress(quiet=True)
