"""The errors a command raises for bad usage or input (exit 2, no traceback)."""

from __future__ import annotations


class UsageError(Exception):
    """A bad option or input, said in words (the command line prints it, exit 2)."""
