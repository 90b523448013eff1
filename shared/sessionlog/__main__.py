"""`python -m sessionlog` runs the command line this install declares as the `sessionlog` console script (it adds
the commands that start services, from a layer above the library); without one, the library's own commands."""

import sys
from importlib.metadata import entry_points

from .cli import main

scripts = entry_points(group="console_scripts", name="sessionlog")
sys.exit(next(iter(scripts)).load()() if scripts else main())
