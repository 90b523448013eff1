"""`python -m sessionlog` runs the command line."""

from .cli import run

run()
