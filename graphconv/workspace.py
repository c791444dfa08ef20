"""A run's private temporary directory next to its output, and the all-or-nothing move of the artifacts.

Every file a run writes goes into `.graphconv-tmp-XXXX/` beside the output (same filesystem, so the final
move is a rename). The artifacts are moved into place together at the end; if any move fails, the ones
already moved are moved back. The directory records its owner's pid and start time, so a later run can
delete directories whose owner is dead (a compile killed with SIGKILL) without touching a live run's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

from graphconv.errors import InputError

PREFIX = ".graphconv-tmp-"
OWNER_FILE = "owner.json"
# A directory without an owner file may be one that another run created a moment ago.
_UNOWNED_GRACE_SECONDS = 300


def partial_dir(target: Path) -> Path:
    """A new directory beside `target` under a private name, to be renamed to `target` when complete (a
    failure leaves nothing under the target's name); it gets the permissions the umask gives a new directory,
    not mkdtemp's 0700, since the rename makes it the user's result."""
    parent = target.parent.absolute()
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    return path


def _owner_alive(directory: Path) -> bool:
    try:
        owner = json.loads((directory / OWNER_FILE).read_text())
    except (OSError, ValueError):
        try:
            return time.time() - directory.stat().st_mtime < _UNOWNED_GRACE_SECONDS
        except OSError:
            return False
    try:
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner["created"])) < 1.0
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def remove_stale(parent: Path) -> list[Path]:
    """Delete temporary directories in `parent` whose owning process is gone. Returns what was removed."""
    removed = []
    for d in parent.glob(PREFIX + "*"):
        if d.is_dir() and not _owner_alive(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class Workspace:
    """Use as a context manager; the directory is removed on exit whatever happened."""

    def __init__(self, output_path: Path):
        self.output_path = Path(output_path)
        parent = self.output_path.parent.absolute()
        if not parent.is_dir():
            raise InputError(f"output directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise InputError(f"output directory {parent} is not writable")
        remove_stale(parent)
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        me = psutil.Process()
        (self.dir / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "created": me.create_time()}))

    def path(self, name: str) -> Path:
        return self.dir / name

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        if os.environ.get("GRAPHCONV_KEEP_TEMP"):  # for debugging graphconv itself
            print(f"graphconv: kept {self.dir}", file=sys.stderr)
            return
        shutil.rmtree(self.dir, ignore_errors=True)

    def commit(self, moves: dict[Path, Path]) -> None:
        """Move each temporary artifact to its final path; all of them, or (on failure) none."""
        backup = self.dir / "replaced"
        backup.mkdir(exist_ok=True)
        done: list[tuple[Path, Path, Path | None]] = []
        try:
            for src, dst in moves.items():
                old = None
                if dst.exists() or dst.is_symlink():
                    old = backup / f"{len(done)}-{dst.name}"
                    os.replace(dst, old)
                os.replace(src, dst)
                done.append((src, dst, old))
        except OSError as e:
            for src, dst, old in reversed(done):
                os.replace(dst, src)
                if old is not None:
                    os.replace(old, dst)
            raise InputError(f"could not move the results into place: {e}") from e
