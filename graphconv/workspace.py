"""A run's private temporary directory next to its output, and the all-or-nothing move of the artifacts.

Every file a run writes goes into `.graphconv-tmp-XXXX/` beside the output (same filesystem, so the final
move is a rename). The artifacts are moved into place together at the end; if any move fails, the ones
already moved are moved back. The directory records its owner's pid and start time, so a later run can
delete directories whose owner is dead (a compile killed with SIGKILL) without touching a live run's. So do
the staging directories `partial_dir` makes beside an output (a generation folder's, an export's, a bundle's):
they are the largest leftovers a killed run can leave (a 7B's are tens of GB).
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

from graphconv import interrupts
from graphconv.errors import InputError

PREFIX = ".graphconv-tmp-"
OWNER_FILE = "owner.json"
# A directory without an owner file may be one that another run created a moment ago.
_UNOWNED_GRACE_SECONDS = 300


PARTIAL = ".partial-"  # partial_dir's names: .<target name>.partial-XXXX


def partial_dir(target: Path) -> Path:
    """A new directory beside `target` under a private name, to be renamed to `target` when complete (a
    failure leaves nothing under the target's name); it gets the permissions the umask gives a new directory,
    not mkdtemp's 0700, since the rename makes it the user's result. It holds an owner record (so a later run
    can remove it if this process dies without cleaning up) until `release` takes it out before the rename;
    the dead runs' ones beside it are removed first."""
    parent = target.parent.absolute()
    remove_stale(parent)
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}{PARTIAL}", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(path, 0o777 & ~umask)
        _write_owner(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def release(staging: Path) -> Path:
    """A complete partial_dir without its owner record, ready to be renamed to its target: the record is
    this run's, not part of the result. Not after an interrupt (interrupts.check)."""
    interrupts.check()
    (staging / OWNER_FILE).unlink(missing_ok=True)
    return staging


def _write_owner(directory: Path) -> None:
    me = psutil.Process()
    (directory / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "created": me.create_time()}))


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
    """Delete temporary directories in `parent` whose owning process is gone, and partial_dir's staging
    directories whose owner record names a dead process (one without a record may be a user's, or another
    version's: left alone). Returns what was removed."""
    removed = []
    for d in [*parent.glob(PREFIX + "*"), *parent.glob(f".*{PARTIAL}*")]:
        if not d.is_dir() or d.is_symlink() or (PARTIAL in d.name and not (d / OWNER_FILE).is_file()):
            continue
        if not _owner_alive(d):
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
        try:
            _write_owner(self.dir)
        except BaseException:  # (a full disk: even the record does not fit)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

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
        """Move each temporary artifact to its final path; all of them, or (on failure) none. Not after an
        interrupt, nor cut short by one (interrupts.final_moves)."""
        backup = self.dir / "replaced"
        backup.mkdir(exist_ok=True)
        with interrupts.final_moves():
            self._move(moves, backup)

    def _move(self, moves: dict[Path, Path], backup: Path) -> None:
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
