"""Where a trace is to be written: whether it can be, asked before the run.

A writer that finds out at its first line has already run (a simulation, an
engine's first steps); so the command line (`sim.commands.paths`) and the vLLM
connector's options (`adapters.vllm.options`) ask here first, with the same
answers.
"""

from __future__ import annotations

import os
from pathlib import Path


def unwritable(path: str) -> str | None:
    """Why a file at ``path`` cannot be created or overwritten by this
    process (``None`` when it can)."""
    out = Path(path)
    if out.is_dir():
        return "is a directory"
    parent = out.parent
    if not parent.is_dir():
        return f"no directory {str(parent)!r}"
    if out.exists():
        return None if os.access(out, os.W_OK) else "not writable"
    return None if os.access(parent, os.W_OK) else f"directory {str(parent)!r} is not writable"
