"""`python -m trainguard`: the same command line as the `trainguard` script."""

from trainguard.cli import main

main()
