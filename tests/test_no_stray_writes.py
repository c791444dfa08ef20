"""A compile writes nothing outside its output and its private temporary directory (which sits beside the
output): not into the current directory, the model's folder, the home directory or the system's temp dir.
Run as a user runs it: `python -m graphconv compile` from another working directory, with a relative model
path. Where strace is installed, every file the compile and its children create or open for writing is
traced too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models import EXAMPLES_DIR

ROOT = Path(__file__).resolve().parent.parent

# Opened for writing without being files of the user's: the terminal and the null device, the kernel's
# pseudo-files, POSIX semaphores and shared memory.
_SYSTEM = re.compile(r"^(/dev/|/proc/|/sys/)")
# onnxruntime 1.32 writes its telemetry device id under ~/.cache (or $XDG_CACHE_HOME) and a session id file
# $TMPDIR/.ses when it is imported, whatever ORT_TELEMETRY_DISABLED says (graphconv sets it: no usage events);
# onnxruntime's pull request 29843 makes that variable stop the files too. `python -c "import onnxruntime"`
# writes the same: the only writes outside the output a compile makes, and not graphconv's.
_ORT_DEVICE_ID = ".cache/Microsoft/DeveloperTools/.onnxruntime"
_ORT_SESSION_ID = ".ses"


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _compile(tmp_path: Path, wrapper: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, Path]]:
    places = {name: tmp_path / name for name in ("cwd", "home", "tmp", "models", "out")}
    for p in places.values():
        p.mkdir()
    shutil.copy(EXAMPLES_DIR / "tiny_llama.onnx", places["models"] / "tiny.onnx")
    env = {**os.environ, "HOME": str(places["home"]), "TMPDIR": str(places["tmp"]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    model = os.path.relpath(places["models"] / "tiny.onnx", places["cwd"])
    out = os.path.relpath(places["out"] / "tiny.mindir", places["cwd"])
    done = subprocess.run([*wrapper, sys.executable, "-m", "graphconv", "compile", model, "-o", out,
                           "--report", os.path.relpath(places["out"] / "report.json", places["cwd"]), "-q"],
                          cwd=places["cwd"], env=env, capture_output=True, text=True, timeout=900)
    return done, places


def test_a_compile_writes_only_its_artifacts(tmp_path):
    done, places = _compile(tmp_path, [])
    assert done.returncode == 0, done.stderr
    assert _tree(places["out"]) == ["report.json", "tiny.mindir"]  # (the private directory is gone)
    for name in ("cwd", "home", "tmp"):
        found = [p for p in _tree(places[name])
                 if not (name == "home" and (_ORT_DEVICE_ID.startswith(p) or p.startswith(_ORT_DEVICE_ID)))
                 and not (name == "tmp" and p == _ORT_SESSION_ID)]
        assert found == [], f"the compile wrote into {name}: {found}"
    assert _tree(places["models"]) == ["tiny.onnx"]


def test_traced_writes_stay_in_the_output_folder(tmp_path):
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: the directory listings of test_a_compile_writes_only_its_artifacts "
                    "are the check here")
    trace = tmp_path / "trace"
    probe = subprocess.run([strace, "-f", "-qq", "--seccomp-bpf", "-e", "trace=none", "true"], capture_output=True)
    fast = ["--seccomp-bpf"] if probe.returncode == 0 else []
    done, places = _compile(tmp_path, [strace, "-f", "-qq", *fast, "-o", str(trace), "-e",
                                       "trace=open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2"])
    assert done.returncode == 0, done.stderr
    written = set()
    for line in trace.read_text(errors="replace").splitlines():
        m = re.search(r'(open|openat|creat)\((?:AT_FDCWD|\d+), "([^"]+)", ([A-Z_|]+)', line) or \
            re.search(r'(creat)\("([^"]+)"', line)
        if m and ("O_WRONLY" in line or "O_RDWR" in line or "O_CREAT" in line or m.group(1) == "creat") \
                and "= -1" not in line:
            written.add(m.group(2))
        m = re.search(r'(mkdir|mkdirat)\((?:AT_FDCWD, )?"([^"]+)"', line)
        if m and "= -1" not in line:
            written.add(m.group(2))
        m = re.search(r'rename(?:at2?)?\((?:AT_FDCWD, )?"[^"]+", (?:AT_FDCWD, )?"([^"]+)"', line)
        if m and "= -1" not in line:
            written.add(m.group(1))
    outside = []
    for path in written:
        if not os.path.isabs(path):  # relative to a child's working directory: the private directory (the parent's
            continue                 # own cwd is checked by the listing test)
        full = Path(os.path.normpath(path))
        if _SYSTEM.match(path) or full.is_relative_to(places["out"]) or full == places["tmp"] / _ORT_SESSION_ID or \
                str(places["home"] / _ORT_DEVICE_ID).startswith(str(full)) or \
                full.is_relative_to(places["home"] / _ORT_DEVICE_ID):
            continue
        outside.append(path)
    assert written, "the trace saw no write at all: the parsing is wrong"
    assert not outside, f"written outside the output folder: {sorted(outside)[:10]}"
