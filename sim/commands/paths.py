"""Where a command writes: checked before the work, written whole or not at all.

A command that runs for minutes and only then finds it cannot write has lost
the minutes, and a search its counterexample; one that truncates its output
before the run and then stops on a bad input has lost the user's previous
file (or, given its own input as output, the input). So:

* every output path is checked when the command starts (`output_file`,
  `output_dir`), with the option's name in the error;
* a file is written beside its destination and renamed over it once complete
  (`written_whole`): an error or Ctrl-C leaves whatever was there. A path that
  exists and is no regular file (``/dev/null``, ``/dev/stdout``, a FIFO) is
  written in place: renaming over it would replace the device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kvstate.trace.destination import cannot_create_in, unwritable
from sim.commands.errors import UsageError


def output_file(path: str, option: str) -> Path:
    """``path`` as a file this process can create or overwrite, or a
    `UsageError` naming ``option`` and why not."""
    if not path:
        raise UsageError(f"{option}: an empty path")
    if path == "-":
        raise UsageError(f"{option} -: not standard output here (it carries the command's "
                         "report); give a file")
    why = unwritable(path)
    if why is not None:
        raise UsageError(f"{option} {path}: {why}")
    return Path(path)


def output_dir(path: str, option: str) -> Path:
    """``path`` as a directory files can be written into (it, or the first
    of its parents that exists, must be a writable directory; missing ones
    are made when something is written), or a `UsageError` naming ``option``."""
    if not path:
        raise UsageError(f"{option}: an empty path")
    out = Path(path)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{option} {path}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: directory {str(existing)!r} is not writable")
    why = cannot_create_in(existing)
    if why is not None:
        raise UsageError(f"{option} {path}: {why}")
    return out


@contextlib.contextmanager
def written_whole(path: str | Path) -> Iterator[IO[str]]:
    """A text file that becomes ``path`` only if the block completes."""
    target = Path(path)
    if target.exists() and not target.is_file():
        with _named(target), open(target, "w") as out:
            yield out
        return
    partial = target.with_name(target.name + ".partial")
    try:
        with _named(target):
            with open(partial, "w") as out:
                yield out
            os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def _named(target: Path) -> Iterator[None]:
    """An `OSError` from writing (a full disk has no file name) names the
    file the user asked for, not the temporary one."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None or str(exc.filename).endswith(".partial"):
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        raise
