"""Where a trace is to be written: whether it can be, asked before the run.

A writer that finds out at its first line has already run (a simulation, an
engine's first steps); so the command line (`sim.commands.paths`) and the vLLM
connector's options (`adapters.vllm.options`) ask here first, with the same
answers.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable(path: str) -> str | None:
    """Why a file at ``path`` cannot be created or overwritten by this
    process (``None`` when it can)."""
    if "\x00" in path:
        return "holds a NUL character (no file name can)"
    try:
        os.fsencode(path)
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        return "not a file name (a lone surrogate, not text)"
    try:
        return _unwritable(path)
    except OSError as exc:  # a name too long, a loop of links, ...
        return exc.strerror or str(exc)


def _unwritable(path: str) -> str | None:
    out = Path(path)
    if out.is_dir():
        return "is a directory"
    parent = out.parent
    if not parent.is_dir():
        return f"no directory {str(parent)!r}"
    if out.exists():
        if not os.access(out, os.W_OK):
            return "not writable"
        # A regular file is replaced by one written beside it (a device is
        # written in place), so its directory must take a new file.
        return cannot_create_in(parent) if out.is_file() else None
    if not os.access(parent, os.W_OK):
        return f"directory {str(parent)!r} is not writable"
    return cannot_create_in(parent)


def cannot_create_in(directory: str | Path) -> str | None:
    """Why no file can be created in ``directory`` (``None`` when one can),
    found by creating and removing one: ``os.access`` answers yes to root
    for every directory, ``/proc`` and read-only mounts included."""
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".kvstate-probe-"):
            pass
    except OSError as e:
        return f"no file can be created in {str(directory)!r} ({e.strerror or e})"
    return None
