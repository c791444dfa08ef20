"""Running N ranks under MindSpore's own launcher, msrun: the parent side (`run`) and the script each rank
runs (`python graphconv/runtime/msrun.py TASKS.json`, msrun's argument).

msrun starts a scheduler and N workers with `python` from PATH (the interpreter running graphconv is put
first), on a master port: a free one is taken per run, so parallel compiles do not collide. Its logs go to the
run's private directory. msrun is started in a new session and its whole process group is killed on failure,
timeout or interrupt: no rank outlives the compile. Each rank does the worker task `tasks[rank]` (the same
tasks a single child does: graphconv/runtime/worker.py) and writes its result file; a rank that dies leaves
none, which is reported with the tail of its log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from graphconv.errors import InputError, InternalError

TIMEOUT_SECONDS = 1800
JOIN_SECONDS = 300  # a rank joins its group within seconds (the imports, then init()); on a loaded host, more


class LaunchError(InputError):
    """msrun could not start the ranks (an environment's failure, not the model's: exit 1)."""


def launch_script(n: int, about: str, script: str, after: str = "") -> str:
    """An Ascend host's launch_ascend.sh: `about` (comment lines), then msrun starting `n` ranks of `script`
    (run from the script's own folder, the port from MASTER_PORT), then `after`."""
    return (f"#!/bin/sh\n{about}set -e\ncd \"$(dirname \"$0\")\"\nPORT=${{MASTER_PORT:-8118}}\n"
            f"msrun --worker_num={n} --local_worker_num={n} --master_port=$PORT --log_dir=msrun_logs --join=True \\\n"
            f"    {script} \"$@\"\n{after}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_msrun() -> str:
    """msrun beside this interpreter (a venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "msrun"
    found = str(here) if here.is_file() else shutil.which("msrun")
    if found is None:
        raise InputError("--tp: msrun (MindSpore's launcher) is not installed beside this Python nor on PATH")
    return found


def run(tasks: list[dict], workdir: Path, label: str = "msrun", timeout: float = TIMEOUT_SECONDS) -> list[dict]:
    """Every rank's worker task under msrun (rank i does tasks[i]); their results, or an InternalError naming
    the first rank that failed. msrun that cannot start the ranks (its scheduler failed, or no rank joined the
    group in JOIN_SECONDS) is tried once more on another port (another process may have taken the free one),
    then a LaunchError."""
    for r, task in enumerate(tasks):
        task["result"] = str(workdir / f"rank{r}.result.json")
    spec = workdir / "msrun-tasks.json"
    spec.write_text(json.dumps(tasks))
    for attempt in (1, 2):
        try:
            return _run_once(tasks, workdir, spec, label, timeout, workdir / f"msrun-logs-{attempt}")
        except LaunchError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(tasks: list[dict], workdir: Path, spec: Path, label: str, timeout: float, logs: Path) -> list[dict]:
    from graphconv.runtime.child import _die_with_parent, child_env

    n = len(tasks)
    env = child_env(workdir)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    port = free_port()
    cmd = [find_msrun(), f"--worker_num={n}", f"--local_worker_num={n}", f"--master_port={port}",
           f"--log_dir={logs}", "--join=True", str(Path(__file__).resolve()), str(spec)]
    joined = [_joined(spec, r) for r in range(n)]
    for j in joined:  # (from an attempt that did not start)
        j.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(logs.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        try:
            while proc.poll() is None:
                waited = time.perf_counter() - t0
                if waited > timeout:
                    raise InternalError(f"{label}: the ranks did not finish within {timeout:.0f} s")
                if any(_failed(t) for t in tasks):  # (the others may wait for it in a collective: no use waiting)
                    break
                if not all(j.exists() for j in joined):
                    failure = _scheduler_failure(logs)
                    if failure or waited > JOIN_SECONDS:
                        raise LaunchError(f"{label}: msrun could not start the ranks (master port {port}): "
                                          f"{failure or f'they had not joined their group after {JOIN_SECONDS} s'}")
                time.sleep(0.25)
        finally:
            _kill_group(proc)  # (on failure, timeout or interrupt; after success, any rank msrun left behind)
    results = {}
    for r, task in enumerate(tasks):
        path = Path(task["result"])
        results[r] = json.loads(path.read_text()) if path.exists() else None
    for r, result in results.items():
        if result is not None and not result.get("ok"):
            raise InternalError(f"{label}: rank {r} failed: {result.get('error')}")
    for r, result in results.items():
        if result is None:
            tail = _tail(logs / f"worker_{r}.log") or _tail(logs.with_suffix(".log"))
            raise InternalError(f"{label}: rank {r} left no result (msrun exit code {proc.returncode}): {tail}")
    results[0]["msrun_seconds"] = round(time.perf_counter() - t0, 2)
    return list(results.values())


def _joined(spec: Path, rank: int) -> Path:
    """The file rank `rank` writes once it joined the group (rank_main)."""
    return spec.with_name(f"rank{rank}.joined")


def _scheduler_failure(logs: Path) -> str | None:
    """What ended msrun's scheduler before the ranks joined (its log's first ERROR, e.g. "Failed to init the
    tcp server." for a taken port), or None while it runs."""
    path = logs / "scheduler.log"
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    if "Traceback (most recent call last)" not in text:
        return None
    first = next((ln for ln in text.splitlines() if "[ERROR]" in ln), "")
    return f"its scheduler failed: {first.rpartition('] ')[2].strip() or 'see its log'}"


def _failed(task: dict) -> bool:
    path = Path(task["result"])
    if not path.exists():
        return False
    try:
        result = json.loads(path.read_text())
    except ValueError:
        return False
    return not result.get("ok") or "verify_error" in result


def _kill_group(proc: subprocess.Popen) -> None:
    """msrun, the scheduler in its process group, and the ranks, which msrun starts each in a session of its own
    (mindspore's process_entity: preexec_fn=os.setsid), out of reach of a signal to msrun's group. msrun is
    stopped first, so that it starts no rank while they are found."""
    import psutil

    try:
        os.killpg(proc.pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        ranks = []
    for p in ranks:
        try:
            os.killpg(os.getpgid(p.pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    psutil.wait_procs(ranks, timeout=10)


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip() and "[INFO]" not in ln]
    return " | ".join(lines[-3:])[-400:]


def _peak_rss() -> int | None:
    """This rank's peak resident memory (ru_maxrss, in KiB on Linux): what one device's host process needs."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_main(spec: str) -> int:
    """In each rank: join the group, do this rank's task, write its result."""
    from mindspore.communication import get_rank, init

    from graphconv.runtime import network, worker

    network.cpu_graph_mode()
    init()
    _joined(Path(spec), get_rank()).touch()
    task = json.loads(Path(spec).read_text())[get_rank()]
    result = worker.handle(task)
    result["peak_rss_bytes"] = _peak_rss()
    tmp = Path(task["result"]).with_suffix(".partial")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, task["result"])
    return 0  # (a failed task is in its result: a rank exiting non-zero holds msrun up until its cluster times out)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # (run as a script: this folder's modules must not shadow others)
    sys.exit(rank_main(sys.argv[1]))
