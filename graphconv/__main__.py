import os
import sys

from graphconv import interrupts

interrupts.install()  # before the command line's imports (most of a second): a signal then ends cleanly too
try:
    from graphconv.cli import run
except KeyboardInterrupt:  # (nothing written yet; os._exit: an interrupt an import swallowed must not end the
    code = interrupts.interrupted()  # interpreter with SIGINT itself, as Python then does)
    sys.stderr.flush()
    os._exit(code)

run()
