"""The parent side of graphconv.runtime.worker: start the child, hand it tasks, and turn every way it can end into a
result or an error. `run_task`: one task, one process (a compile's stages); `Server`: one process for many
tasks (the ONNX backend, which runs thousands of small networks)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from graphconv.errors import InternalError

# A child that died without a result while its directory's filesystem has less than this free: the disk was full.
FULL_BELOW_BYTES = 1 << 20


class ChildError(InternalError):
    """The task raised in the child; `.error` holds its one-line message, `.traceback` the details."""

    def __init__(self, message: str, error: str, tb: str = ""):
        super().__init__(message)
        self.error = error
        self.traceback = tb


def child_env(workdir: Path | None = None) -> dict:
    """The environment of a child working in `workdir` (a run's private directory): its temporary files go
    there too (MindSpore's imports make some, onnxruntime its session id file)."""
    env = dict(os.environ)
    if workdir is not None:
        env["TMPDIR"] = str(Path(workdir).absolute())
    env.setdefault("GLOG_v", "3")  # MindSpore: errors only
    env.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "upb")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] +
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


def _start(args: list[str], workdir: Path, log, stdin, stdout) -> subprocess.Popen:
    """`python -m graphconv.runtime.worker ARGS` with cwd=workdir (MindSpore drops files in the cwd), errors to
    `log`."""
    return subprocess.Popen([sys.executable, "-m", "graphconv.runtime.worker", *args], cwd=workdir,
                            env=child_env(workdir), stdin=stdin, stdout=stdout, stderr=log,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


# The one-shot children running for each working directory (a compile's private directory), so that another
# thread can kill them (kill_children: the oracle beside the emit failed), and the directories whose children
# are called off.
_running: dict[str, set[subprocess.Popen]] = {}
_called_off: set[str] = set()
_lock = threading.Lock()


def kill_children(workdir: Path) -> None:
    """Kill the one-shot children running for `workdir`, and any started for it later within its `children`
    block (their tasks fail as a dead child's do)."""
    with _lock:
        _called_off.add(str(workdir))
        for proc in _running.get(str(workdir), ()):
            proc.kill()


def _wait(proc: subprocess.Popen, done, progress_path: Path, tracker) -> None:
    """Poll `done(seconds)` until it is true, passing the child's progress file to `tracker` meanwhile. An
    interrupt kills the child: it must not go on writing."""
    try:
        while not done(0.25):
            if tracker is not None:
                _report_progress(progress_path, tracker)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _exited(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _died(label: str, code: int, log_path: Path) -> InternalError:
    """A child that left no result. With its disk full (it could not write the result, or its log), the full
    disk is the error: the user's to fix (graphconv.errors.disk_full), not a crash."""
    if code == errno.ENOSPC or _full(log_path.parent):
        return InternalError(f"{label}: the child process died: [Errno 28] No space left on device")
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path.exists() else []
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return InternalError(f"{label}: the child process died ({how}): {' | '.join(tail)[-400:]}")


def _full(directory: Path) -> bool:
    """Whether the filesystem of `directory` has (next to) no space left."""
    try:
        return shutil.disk_usage(directory).free < FULL_BELOW_BYTES
    except OSError:
        return False


def _outcome(result: dict, label: str) -> dict:
    if not result.get("ok"):
        raise ChildError(f"{label} failed: {result.get('error')}", result.get("error", ""), result.get("traceback", ""))
    return result


def _report_progress(path: Path, tracker) -> None:
    try:
        done = float(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return
    tracker.update(done)


def run_task(kind: str, task: dict, workdir: Path, label: str, tracker=None) -> dict:
    """Runs the task in a new child with cwd=workdir; returns the worker's result dict or raises
    ChildError/InternalError.
    With a graphconv.progress.Tracker the child reports how far it is (bytes of weights read) through a small
    file the parent polls."""
    n = len(list(workdir.glob("task-*.json")))
    task_path = workdir / f"task-{n}-{kind}.json"
    result_path = workdir / f"task-{n}-{kind}.result.json"
    log_path = workdir / f"task-{n}-{kind}.log"
    progress_path = workdir / f"task-{n}-{kind}.progress"
    extra = {"progress_file": str(progress_path)} if tracker is not None else {}
    task_path.write_text(json.dumps({**task, **extra, "kind": kind, "result": str(result_path)}))
    with open(log_path, "wb") as log:
        proc = _start([str(task_path)], workdir, log, subprocess.DEVNULL, log)
        with _lock:
            _running.setdefault(str(workdir), set()).add(proc)
            if str(workdir) in _called_off:
                proc.kill()
        try:
            _wait(proc, lambda seconds: _exited(proc, seconds), progress_path, tracker)
        finally:
            with _lock:
                _running[str(workdir)].discard(proc)
    if not result_path.exists():
        raise _died(label, proc.returncode, log_path)
    return _outcome(json.loads(result_path.read_text()), label)


@contextlib.contextmanager
def children(workdir: Path):
    """The children a compile runs in `workdir`, for the `with` body (kill_children may call them off). A
    body that fails (an interrupt in another thread's wait, say) kills those still running and waits for
    them: none outlives the compile, nor writes into the directory its cleanup removes."""
    try:
        yield
    except BaseException:
        kill_children(workdir)
        with _lock:
            procs = list(_running.get(str(workdir), ()))
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        raise
    finally:
        with _lock:
            _called_off.discard(str(workdir))
            _running.pop(str(workdir), None)


class Server:
    """One long-lived child (`python -m graphconv.runtime.worker --serve`) that does task after task: one JSON task a
    line on its stdin, one result line on its stdout. Started by the first request; a crash fails that request
    and the next one starts a new child; a child that asks to retire (graphconv.runtime.worker.serve) is replaced."""

    def __init__(self, workdir: Path, log_name: str = "worker-server.log"):
        self.workdir = workdir
        self.log_path = workdir / log_name
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._requests = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def request(self, kind: str, task: dict, label: str, tracker=None) -> dict:
        """Like run_task, in this server's child."""
        if not self.alive():
            self.close()
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
            self.proc = _start(["--serve"], self.workdir, self._log, subprocess.PIPE, subprocess.PIPE)
        proc = self.proc
        self._requests += 1
        progress_path = self.workdir / f"server-{self._requests}.progress"
        extra = {"progress_file": str(progress_path)} if tracker is not None else {}
        try:
            proc.stdin.write((json.dumps({**task, **extra, "kind": kind}) + "\n").encode())
            proc.stdin.flush()
            _wait(proc, lambda seconds: bool(select.select([proc.stdout], [], [], seconds)[0]), progress_path,
                  tracker)
            line = proc.stdout.readline()
        except OSError:  # a broken pipe: the child died
            line = b""
        except BaseException:  # interrupted: the child must not go on with a half-sent task
            proc.kill()
            self.close()
            raise
        try:
            result = json.loads(line)
        except ValueError:  # no (whole) result line: the child died, or is dying
            if line:
                proc.kill()  # (a line that is no result: nothing more can be trusted from it)
            self.close()
            raise _died(label, proc.returncode, self.log_path) from None
        if result.pop("retire", False):
            self.close()
        return _outcome(result, label)

    def close(self) -> None:
        """Ends the child (its stdin closed, it finishes; killed if it does not within 10 s)."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
