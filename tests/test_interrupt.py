"""A compile killed during export leaves nothing at the output path; the next run removes its temporary files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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
    assert proc.returncode != 0
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
