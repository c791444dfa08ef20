"""The child process: everything that can abort the interpreter from C++ (onnxsim, MindSpore) runs here.

A task is a JSON dict whose "kind" names a function of TASKS (the export tasks, the run tasks, generation);
its result is {"ok": true, ...} or {"ok": false, "error": "..."}. `python -m graphconv.runtime.worker TASK.json`
does one task and writes the result to the task's "result" file; `--serve` does one task per stdin line and
writes one result line to stdout each. A crash leaves no result; the parent (graphconv.runtime.child) turns
that into a clean error. The working directory is the run's private temporary directory, so files that
MindSpore drops in the cwd (rank_0/, kernel_meta/) stay in it.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from graphconv.runtime import scheduling
from graphconv.runtime.network import first_line

# kind -> (module of graphconv.runtime, function): imported when a task of that kind comes
TASKS = {
    "simplify": ("export_tasks", "simplify"),
    "export": ("export_tasks", "export"),
    "export_and_verify": ("export_tasks", "export_and_verify"),
    "run_mindir": ("run_tasks", "run_mindir"),
    "run_network": ("run_tasks", "run_network"),
    "export_and_run": ("run_tasks", "export_and_run"),
    "generate": ("generate_task", "generate"),
    "quantize": ("quantize_task", "quantize"),
}


def handle(task: dict) -> dict:
    """The task done, as its result."""
    try:
        module, function = TASKS[task["kind"]]
        return {"ok": True, **getattr(importlib.import_module(f"graphconv.runtime.{module}"), function)(task)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides what it means
        return {"ok": False, "error": f"{type(e).__name__}: {first_line(str(e))}",
                "traceback": traceback.format_exc()}


def serve() -> int:
    """Tasks from stdin, one JSON line each, until it closes; one result line each on stdout. A result with
    "retire": true is the last (run_tasks.RETIRE_AFTER): the parent starts a new server for the next task."""
    from graphconv.runtime import run_tasks

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what MindSpore (or anything else) prints goes to the log, not between the results
    for line in sys.stdin:
        result = handle(json.loads(line))
        retire = run_tasks.loads() >= run_tasks.RETIRE_AFTER
        replies.write(json.dumps({**result, "retire": True} if retire else result) + "\n")
        replies.flush()
        if retire:
            break
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--serve"]:
        return serve()
    task = json.loads(Path(argv[1]).read_text())
    result_path = Path(task["result"])
    result = handle(task)
    tmp = result_path.with_suffix(".partial")
    try:
        tmp.write_text(json.dumps(result))
    except OSError as e:  # the parent reads this exit code as a full disk (graphconv.runtime.child._died)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return errno.ENOSPC
        raise
    os.replace(tmp, result_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    scheduling.end(main(sys.argv))
