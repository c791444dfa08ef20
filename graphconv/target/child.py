"""Run a graphconv.target.worker task in a child process and turn every way it can end into a result or an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from graphconv.errors import InternalError


class ChildError(InternalError):
    """The task raised in the child; `.error` holds its one-line message, `.traceback` the details."""

    def __init__(self, message: str, error: str, tb: str = ""):
        super().__init__(message)
        self.error = error
        self.traceback = tb


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("GLOG_v", "3")  # MindSpore: errors only
    env.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "upb")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] +
                                         [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGKILL it when graphconv dies (a killed compile must not
    leave a MindSpore export running and writing)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_task(kind: str, task: dict, workdir: Path, label: str, tracker=None) -> dict:
    """Runs the task with cwd=workdir; returns the worker's result dict or raises ChildError/InternalError.
    With a graphconv.progress.Tracker the child reports how far it is (bytes of weights read) through a
    small file the parent polls."""
    n = len(list(workdir.glob("task-*.json")))
    task_path = workdir / f"task-{n}-{kind}.json"
    result_path = workdir / f"task-{n}-{kind}.result.json"
    log_path = workdir / f"task-{n}-{kind}.log"
    progress_path = workdir / f"task-{n}-{kind}.progress"
    extra = {"progress_file": str(progress_path)} if tracker is not None else {}
    task_path.write_text(json.dumps({**task, **extra, "kind": kind, "result": str(result_path)}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "graphconv.target.worker", str(task_path)], cwd=workdir,
                                env=child_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        try:
            while True:
                try:
                    proc.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    if tracker is not None:
                        _report_progress(progress_path, tracker)
        except BaseException:
            proc.kill()  # interrupted: the child must not go on writing
            proc.wait()
            raise
    if not result_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        raise InternalError(f"{label}: the child process died ({how}): {' | '.join(tail)[-400:]}")
    result = json.loads(result_path.read_text())
    if not result.get("ok"):
        raise ChildError(f"{label} failed: {result.get('error')}", result.get("error", ""), result.get("traceback", ""))
    return result


def _report_progress(path: Path, tracker) -> None:
    try:
        done = float(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return
    tracker.update(done)
