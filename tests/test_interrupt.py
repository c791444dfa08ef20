"""A compile killed during export leaves nothing at the output path; the next run removes its temporary files.
Children end without the interpreter's teardown (graphconv.runtime.scheduling.end)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import graphconv
from graphconv.runtime import child
from models import EXAMPLES_DIR


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_during_export(tmp_path, sig):
    out = tmp_path / "m.mindir"
    proc = subprocess.Popen([sys.executable, "-m", "graphconv", "compile", str(EXAMPLES_DIR / "tiny_llama.onnx"),
                             "-o", str(out), "--no-simplify"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GRAPHCONV_PROGRESS": "1"})  # progress lines off a terminal
    deadline = time.time() + 120
    for line in proc.stderr:
        if "emit (mindspore.export)" in line or time.time() > deadline:
            break
    time.sleep(1.0)  # inside mindspore.export
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143)  # (SIGTERM: 128 + 15)
    assert not out.exists()
    leftovers = list(tmp_path.glob(".graphconv-tmp-*"))
    if sig == signal.SIGTERM:
        assert leftovers == []  # cleaned on the way out
    # The next run into the same folder removes directories of dead runs.
    time.sleep(1.0)  # let the orphaned child see its parent die (PR_SET_PDEATHSIG) and go
    subprocess.run([sys.executable, "-m", "graphconv", "compile", str(EXAMPLES_DIR / "tiny_llama.onnx"), "-o",
                    str(tmp_path / "other.mindir"), "--no-verify", "--no-simplify", "-q"], check=True)
    assert list(tmp_path.glob(".graphconv-tmp-*")) == []
    assert not out.exists()


def test_a_child_ends_without_the_teardown_once_its_result_is_written(tmp_path):
    """scheduling.end in the child: the parent waits for its child's exit, which MindSpore's teardown would
    lengthen; the child ends as soon as its result is written (an object a module holds is never finalized),
    exit code and result as before."""
    src = tmp_path / "in.onnx"
    shutil.copy(EXAMPLES_DIR / "tiny_llama.onnx", src)
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"kind": "simplify", "input": str(src), "output": str(tmp_path / "out.onnx"),
                                "result": str(tmp_path / "result.json")}))
    script = ("import runpy, sys\n"
              "class Held:\n"
              "    def __del__(self): print('torn down', flush=True)\n"
              "held = Held()\n"
              f"sys.argv = ['worker', {str(task)!r}]\n"
              "runpy.run_module('graphconv.runtime.worker', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env=child.child_env())
    assert proc.returncode == 0, proc.stderr
    assert "torn down" not in proc.stdout
    assert json.loads((tmp_path / "result.json").read_text())["ok"] and (tmp_path / "out.onnx").exists()


def test_a_compile_failing_before_its_emit_leaves_no_child(tmp_path, monkeypatch):
    """A compile failing before its emit leaves no child running, and nothing in the output folder."""
    import psutil

    from graphconv import pipeline
    from graphconv.errors import UnsupportedError

    def refuse(self, *args, **kwargs):
        raise UnsupportedError("refused by the test")

    def workers() -> set[int]:  # (another test's long-lived server child may run beside: only new ones count)
        return {p.pid for p in psutil.Process().children(recursive=True)
                if "graphconv.runtime.worker" in " ".join(p.cmdline())}

    before = workers()
    monkeypatch.setattr(pipeline.Compiler, "fuse", refuse)
    with pytest.raises(UnsupportedError, match="refused by the test"):
        graphconv.compile(EXAMPLES_DIR / "tiny_llama.onnx", tmp_path / "m.mindir", simplify=False)
    assert workers() - before == set()
    assert list(tmp_path.iterdir()) == []
