"""SIGINT and SIGTERM end a graphconv command cleanly: the signal raises KeyboardInterrupt, which unwinds
through every cleanup (the workspace and staging directories removed, the child processes killed), and the
command exits 128 + the signal's number (130, 143), as a shell reports a process the signal ended, with one
line on stderr. A second signal during that cleanup is ignored, so that the cleanup completes; SIGKILL still
ends it, and the next run removes what it left (graphconv.workspace.remove_stale).

Kept free of heavy imports: `python -m graphconv` installs the handler before importing the command line
(most of a second), so that a signal in that time ends the same way.
"""

from __future__ import annotations

import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: dict = {"number": None}


def _handler(signum, frame):
    if _received["number"] is None:
        _received["number"] = signum
        raise KeyboardInterrupt


def install() -> dict:
    """Handle SIGINT and SIGTERM from now on (a fresh run: none received yet); returns the handlers replaced."""
    _received["number"] = None
    return {number: signal.signal(number, _handler) for number in SIGNALS}


def restore(previous: dict) -> None:
    for number, handler in previous.items():
        signal.signal(number, handler)


def ignore() -> None:
    """The run's outcome is decided: a signal now changes nothing."""
    for number in SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def received() -> int | None:
    return _received["number"]


def interrupted() -> int:
    """Says so in one line; the exit code of an interrupted run (Ctrl-C's, when no signal was seen)."""
    number = _received["number"] or signal.SIGINT
    print(f"graphconv: interrupted ({signal.Signals(number).name})", file=sys.stderr, flush=True)
    return 128 + number


def exit_interrupted() -> None:
    sys.exit(interrupted())
