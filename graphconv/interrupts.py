"""SIGINT and SIGTERM end a graphconv command cleanly: the signal raises KeyboardInterrupt, which unwinds
through every cleanup (the workspace and staging directories removed, the child processes killed), and the
command exits 128 + the signal's number (130, 143), as a shell reports a process the signal ended, with one
line on stderr. A second signal during that cleanup is ignored, so that the cleanup completes; SIGKILL still
ends it, and the next run removes what it left (graphconv.workspace.remove_stale).

Kept free of heavy imports: `python -m graphconv` installs the handler before importing the command line
(most of a second), so that a signal in that time ends the same way.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# `lost`: the KeyboardInterrupt was raised where Python cannot raise it (a weakref callback, a __del__: torch's
# export has them) and only printed "Exception ignored"; it is raised again, at the next instruction.
# `deferred`: the moves that put results in place are under way (final_moves); `settled`: this command's one
# result is in place, and a signal now changes nothing (exit 0); `one_result`: the command makes one result
# (compile, export: not matrix, whose exports and compiles are many); `nested`: compiles into a staging folder.
_received: dict = {"number": None, "lost": False, "deferred": False, "settled": False, "one_result": False,
                   "nested": 0}


def _handler(signum, frame):
    if _received["settled"]:
        return
    if _received["number"] is None or _received["lost"]:
        _received["number"] = _received["number"] or signum
        _received["lost"] = False
        if not _received["deferred"]:
            raise KeyboardInterrupt


def _unraisable(hook_args) -> None:
    """An interrupt raised in a callback Python ignores errors of: said nowhere, raised again in the main
    thread (_thread.interrupt_main calls the handler as the signal would), from another thread a moment
    later: called from here, the handler would run within this hook, whose errors are ignored too. Anything
    else: as Python's hook."""
    if issubclass(hook_args.exc_type, KeyboardInterrupt) and _received["number"] is not None:
        _received["lost"] = True
        again = threading.Timer(0.01, _thread.interrupt_main, (signal.SIGINT,))  # (the number stays the first)
        again.daemon = True
        again.start()
        return
    sys.__unraisablehook__(hook_args)


def install() -> dict:
    """Handle SIGINT and SIGTERM from now on (a fresh run: none received yet); returns the handlers replaced."""
    _received.update(number=None, lost=False, deferred=False, settled=False, one_result=False, nested=0)
    previous = {"unraisablehook": sys.unraisablehook}
    sys.unraisablehook = _unraisable
    return {**previous, **{number: signal.signal(number, _handler) for number in SIGNALS}}


def check() -> None:
    """Before a run puts its results in place: an interrupt that was swallowed on its way (a library's
    `except BaseException` that did not re-raise) still stops it here."""
    if _received["number"] is not None and not _received["settled"]:
        raise KeyboardInterrupt


def restore(previous: dict) -> None:
    """The handlers install replaced. Back to another caller's (in-process: not `python -m graphconv`'s own),
    a clean state too: what the run received is not that caller's next API compile's."""
    previous = dict(previous)
    sys.unraisablehook = previous.pop("unraisablehook")
    for number, handler in previous.items():
        signal.signal(number, handler)
    if previous.get(signal.SIGINT) is not _handler:
        _received.update(number=None, lost=False, deferred=False, settled=False, one_result=False, nested=0)


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


def one_result() -> None:
    """This command puts one result in place (compile, export): once it is (final_moves), a signal is too late
    to interrupt it, and the command ends as it would have."""
    _received["one_result"] = True


@contextlib.contextmanager
def nested():
    """Compiles whose results are moved into a staging folder (a generation folder's), not into place."""
    _received["nested"] += 1
    try:
        yield
    finally:
        _received["nested"] -= 1


@contextlib.contextmanager
def final_moves():
    """The renames that put a run's results in place: none after an interrupt, none cut short by one (a signal
    during them is raised after them); after them, for a command of one result, a signal changes nothing."""
    check()
    _received["deferred"] = True
    try:
        yield
    finally:
        _received["deferred"] = False
    if _received["one_result"] and not _received["nested"]:
        _received["settled"] = True
    check()
