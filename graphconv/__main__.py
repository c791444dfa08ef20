from graphconv.cli import run

run()
