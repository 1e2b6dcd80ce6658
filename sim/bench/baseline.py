"""Another revision of this checkout, for a same-run comparison.

A speed-up is only believable when the old code and the new ran on the same
machine at the same moment (these machines are shared: a neighbour's job can
halve a figure between two runs). `revision_tree` checks a git revision out
into a temporary worktree; `run_in` runs a snippet there in a fresh process
(its own ``PYTHONPATH``, so it imports that revision's ``kvstate`` and
``sim``) and reads back the JSON object the snippet prints last. The benches
alternate ours and theirs, best of a few rounds each, so a load spike hits
both alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class BaselineError(RuntimeError):
    """The revision to compare with could not be checked out or run."""


def check_revision(revision: str) -> str:
    """``revision`` as a commit id; `BaselineError` naming it if this
    checkout has no such commit (asked before any benchmark runs, so a typo
    costs nothing)."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                            f"{revision}^{{commit}}"], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        said = found.stderr.strip().splitlines()
        raise BaselineError(f"--against {revision!r}: no such commit in {ROOT} (give a "
                            "branch, tag or commit id of this checkout, e.g. HEAD~3)"
                            + (f"; git: {said[-1]}" if said else ""))
    return found.stdout.strip()


@contextmanager
def revision_tree(revision: str) -> Iterator[Path]:
    """``revision`` checked out in a temporary worktree (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="kvstate-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                                str(tree), revision], capture_output=True, text=True)
        if added.returncode != 0:
            raise BaselineError(f"--against {revision}: cannot check it out here "
                                f"({added.stderr.strip() or 'git failed'})")
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], capture_output=True)


def run_in(tree: Path, revision: str, what: str, snippet: str, *args: str) -> dict[str, Any]:
    """Run ``snippet`` with ``args`` in ``tree``'s code; the JSON object it
    printed last. ``what`` names the thing run, for the error."""
    run = subprocess.run([sys.executable, "-c", snippet, *args], cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise BaselineError(f"--against {revision}: its {what} failed: "
                            f"{run.stderr.strip().splitlines()[-1:]}")
    lines = run.stdout.strip().splitlines()
    if not lines:
        raise BaselineError(f"--against {revision}: its {what} printed nothing")
    result: dict[str, Any] = json.loads(lines[-1])
    return result
