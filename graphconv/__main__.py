from graphconv.cli import main

main()
