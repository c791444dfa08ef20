import os
import sys

from graphconv import interrupts

interrupts.install()  # before the command line's imports (most of a second): a signal then ends cleanly too
try:
    from graphconv.cli import run
except BaseException as e:  # the interrupt, or an error it caused mid-import
    # (a KeyboardInterrupt raised in a dataclass's __set_name__ comes out as a RuntimeError): as cli.main rules
    if not isinstance(e, KeyboardInterrupt) and interrupts.received() is None:
        raise
    code = interrupts.interrupted()  # (nothing written yet; os._exit: an interrupt an import swallowed must not
    sys.stderr.flush()  # end the interpreter with SIGINT itself, as Python then does)
    os._exit(code)

run()
