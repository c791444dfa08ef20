"""The exceptions that end a graphconv run, each carrying the exit code of the shared contract.

Exit codes (docs/design.md, contracts): 0 verified or unverified-by-request, 1 bad input or unsupported model,
2 verification failed, 3 internal error. The CLI turns these into one line on stderr; anything that is
not a GraphconvError is an internal error.
"""


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
