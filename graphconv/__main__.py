from graphconv import interrupts

interrupts.install()  # before the command line's imports (most of a second): a signal then ends cleanly too
try:
    from graphconv.cli import run
except KeyboardInterrupt:
    interrupts.exit_interrupted()

run()
