"""A path that a file of a folder names stays in that folder: genai_config.json's model file, a safetensors
index's shards, transformers' export.json's graphs, ONNX external-data locations, generation.json's files.

Why: a model folder comes from someone else (a download, a share), and so do the names inside its files. A
name such as `../../root/.ssh/id_rsa` or `/etc/shadow` would have graphconv read, copy or embed a file the
user never handed over. The rule is on the name as written (a non-empty relative path, no `..`, no root or
drive, on either platform's separators) plus its directory resolving inside the folder's real path. The
named file itself may be a symlink: a Hugging Face cache snapshot's files are symlinks into ../../blobs/, and
what a user links into the folder is theirs to give; a symlinked directory on the way cannot lead out.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from graphconv.errors import InputError


def inside(folder: Path, name, source: Path, field: str, *, directory: bool = False) -> Path:
    """`folder / name`, where `name` is the value of `field` in the file `source`; otherwise an InputError
    such as `SOURCE: FIELD '../x.onnx' leaves the folder`. `directory`: the name is a folder whose files are
    read (a tokenizer's), so it must itself resolve inside, not only its parent."""

    def refuse(why: str):
        raise InputError(f"{source}: {field} {name!r} {why}")

    if not isinstance(name, str) or not name or "\0" in name:
        refuse("is not a relative file path")
    windows = PureWindowsPath(name)  # splits on / and \ and knows drives (C:, \\server\share)
    if windows.anchor or PurePosixPath(name).is_absolute():
        refuse("is absolute: only paths inside the folder are accepted")
    if ".." in windows.parts:
        refuse("leaves the folder")
    path = Path(folder) / name
    base = os.path.realpath(folder)
    where = os.path.realpath(path if directory else path.parent)
    if os.path.commonpath([base, where]) != base:
        refuse("leaves the folder (through a symlinked directory)")
    return path
