"""The exceptions that end a graphconv run, each carrying the exit code of the shared contract.

Exit codes (docs/design.md, contracts): 0 verified or unverified-by-request, 1 bad input or unsupported model,
2 verification failed, 3 internal error. The CLI turns these into one line on stderr; anything that is
not a GraphconvError is an internal error.
"""

import re


class GraphconvError(Exception):
    """Base class: a failure graphconv understands and can explain in one line."""

    exit_code = 3


class InputError(GraphconvError):
    """The model or the command line is unusable: missing file, bad protobuf, unsafe external data..."""

    exit_code = 1


class UnsupportedError(InputError):
    """The model is well formed but uses something graphconv cannot lower (ops, opsets, dtypes)."""


class CacheNotHeld(UnsupportedError):
    """A generation graph whose KV cache cannot be held in place (the reason): by default its folder then
    passes the cache in and out instead; with --stateful-cache it is an error."""


class VerificationError(GraphconvError):
    """The emitted network ran but disagrees with the oracle beyond tolerance."""

    exit_code = 2


class InternalError(GraphconvError):
    """A bug or a crash in a dependency (a child process that died, say)."""

    exit_code = 3


class DiskFullError(InputError):
    """The disk (or the user's quota) filled up while graphconv wrote: the user's to fix, so exit 1, not an
    internal error; the message names where and, when known up front, the bytes needed."""


_FULL = {28: "no space left on device", 122: "disk quota exceeded"}  # ENOSPC, EDQUOT (Linux)
_FULL_TEXT = {"No space left on device": 28, "[Errno 28]": 28, "Disk quota exceeded": 122, "[Errno 122]": 122}


def disk_full(error: BaseException, writing: str | None = None) -> DiskFullError | None:
    """`error` as a DiskFullError when a full disk caused it, else None. It may be an OSError (ENOSPC/EDQUOT)
    itself, have one in its chain of causes, or carry one's text only (a child process's error crosses the
    process boundary as text). `writing`: the user's output, named in the message (the file that failed is a
    temporary one)."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return e
        if isinstance(e, OSError) and e.errno in _FULL:
            return DiskFullError(f"{_FULL[e.errno]} writing {writing or e.filename or 'the output'}")
        for text, code in _FULL_TEXT.items():
            if text in str(e):
                return DiskFullError(f"{_FULL[code]} writing {writing or 'the output'}")
        e = e.__cause__ or e.__context__
    return None


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes (torch.onnx colours its messages)


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first non-empty line of `e`'s message, stripped, at most `limit` characters: how a report or an
    error of graphconv quotes another library's failure in one line. An empty message gives the exception's
    type name, so the quote is never empty and never raises."""
    text = _COLOUR.sub("", str(e))
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return line if limit is None else line[:limit]
