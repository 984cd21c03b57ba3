"""`python -m recguide_hf ...`: the `recguide` command line."""

from .tools.cli import entry

entry()
