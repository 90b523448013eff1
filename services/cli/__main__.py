"""`python -m services.cli` runs the command line."""

from . import run

run()
