"""An install without the torch extra (`pip install -e .`): compile and inspect work, export and matrix say in
one line what to install. Simulated by an import hook that refuses torch and transformers in the child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "models" / "examples" / "tiny_llama.onnx"

NO_TORCH = '''
import importlib.abc, sys


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None


sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture
def no_torch_env(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NO_TORCH)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}


def _graphconv(env, *args, cwd):
    return subprocess.run([sys.executable, "-m", "graphconv", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_the_hook_hides_torch(no_torch_env, tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=no_torch_env)
    assert proc.returncode != 0 and "hidden by the test" in proc.stderr


def test_compile_and_inspect_work_without_torch(no_torch_env, tmp_path):
    src = tmp_path / "src"
    proc = _graphconv(no_torch_env, "compile", str(EXAMPLE), "-o", str(tmp_path / "m.mindir"), "--target", "cpu",
                      "--emit-source", str(src), "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _graphconv(no_torch_env, "inspect", str(src / "network.ckpt"), cwd=tmp_path)
    assert proc.returncode == 0 and "model.embed_tokens.weight" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("args", [("export", "llama", "-o", "x.onnx"), ("matrix", "--model", "mlp", "--no-docs")])
def test_export_and_matrix_name_what_to_install(no_torch_env, tmp_path, args):
    proc = _graphconv(no_torch_env, *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert "needs torch" in lines[0] and "pip install -e '.[torch]'" in lines[0]
    assert not (tmp_path / "x.onnx").exists()


RECORD_TORCH = '''
import atexit, os, sys


def _record():
    with open(os.path.join(os.environ["GRAPHCONV_TEST_RECORD"], f"{os.getpid()}.txt"), "w") as f:
        f.write(str("torch" in sys.modules))


atexit.register(_record)
'''


def test_a_compile_with_torch_installed_does_not_import_it(tmp_path):
    """onnxruntime.tools' __init__ imports torch when it is installed (2.5 s of a compile): the symbolic shape
    inference that the loader and refine-shapes use is loaded without it."""
    pytest.importorskip("torch")
    hook, record = tmp_path / "hook", tmp_path / "record"
    hook.mkdir()
    record.mkdir()
    (hook / "sitecustomize.py").write_text(RECORD_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)]), "GRAPHCONV_TEST_RECORD": str(record)}
    proc = subprocess.Popen([sys.executable, "-m", "graphconv", "compile", str(EXAMPLE),
                             "-o", str(tmp_path / "m.mindir"), "-q", "--report", str(tmp_path / "r.json")],
                            env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fusions"]["refine-shapes"] is not None and report["fusions"]["fuse-rope"] > 0  # (it ran)
    assert (record / f"{proc.pid}.txt").read_text() == "False"
