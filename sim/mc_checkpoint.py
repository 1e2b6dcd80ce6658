"""Model-checker checkpoints: a long search that can stop and go on.

A scope that takes hours (``large``, or a wider one on a cluster) is lost
whole to a Ctrl-C, a budget, a driver restarted or a machine taken back,
unless the search can be written down and picked up again. The compact
engine (`sim.mc_compact`) searches level by level and merges in frontier
order, so its whole state between two frontier states is plain data:

* ``parents``: every key visited, with the key and action it was reached by
  (a `sim.mc_visited.Visited`, ~43 bytes a state; its order is the
  discovery order the workers are told);
* ``rest``: the current level's states not expanded yet, as (key, pickled
  state), in frontier order (a `sim.mc_frontier.Frontier`: in memory or on
  disk, streamed to and from the file record by record);
* ``following``: the next level's states found so far (the same);
* ``depth`` and the counters of the `sim.modelcheck.Result` so far.

Going on from exactly that makes the same merges in the same order, so a
resumed search ends with the same states, transitions, depth, verdict and
shortest counterexample as one that never stopped, whatever the number of
workers on either side, and whether its levels were on disk or not
(`tests/test_mc_checkpoint.py` interrupts searches every few dozen states
and compares). The workers' own key sets are not saved: a
worker knowing fewer keys only pickles more children, never other ones.

A checkpoint holds pickled core objects, so it only means something to the
same code: it records `sim.cluster.code_fingerprint` and refuses to resume
under other sources (the states would load into other classes, and their
digests would differ). Like every pickle, loading one runs code: resume only
checkpoints you wrote. Files are written whole or not at all (a temporary
file beside it, then a rename), so a crash while writing leaves the previous
checkpoint.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence

import attrs

from sim.mc_frontier import Frontier
from sim.mc_visited import Visited
from sim.modelcheck import Scope

# Bumped whenever the layout below changes meaning: an older file is refused
# with both numbers rather than misread.
FORMAT = 3  # 3: the visited table packed (sim.mc_visited); 2 held a dict
# The first thing in the file, with the format: what says it is one at all.
MAGIC = "kvstate model-checker checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here: unreadable, not one, another
    format, other code, or another search than the one asked for."""


@attrs.frozen
class Checkpoint:
    """One search, stopped between two frontier states (module docstring)."""

    scope: Scope
    protocol: str
    reduce: bool
    only: tuple[str, ...] | None
    code: str  # sim.cluster.code_fingerprint() of the writer
    parents: Visited
    depth: int  # of the states in ``rest``
    transitions: int
    quiet_states: int
    max_depth: int  # Result.depth so far
    seconds: float  # searched before this checkpoint, all runs together
    rest: Frontier = attrs.field(factory=Frontier)
    following: Frontier = attrs.field(factory=Frontier)

    def describe(self) -> str:
        waiting = len(self.rest) + len(self.following)
        return (f"{self.protocol}/{self.scope.name}: {len(self.parents)} states, "
                f"{self.transitions} transitions, depth {self.depth}, {waiting} states "
                f"waiting, {self.seconds:.1f} s searched")


# What the file holds, in order, each pickled on its own: (MAGIC, FORMAT),
# the fields of a `Checkpoint` but its two frontiers (a dict), then each
# frontier as its count and that many (key, pickled state) pairs. A level
# is streamed from or to its frontier, so a level on disk (`Frontier`) never
# needs to fit in memory to be saved or resumed.
_FRONTIERS = ("rest", "following")


def _temporary(path: str) -> str:
    """Where a checkpoint is written before it is renamed to ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")


def probe(path: str) -> None:
    """Fail now, as `save` would, if a checkpoint cannot be written at
    ``path``: before a search's work rather than after hours of it, and
    without writing a resumed search's whole frontier again to find out."""
    temporary = _temporary(path)
    try:
        with open(temporary, "wb"):
            pass
    except OSError as e:
        raise OSError(e.errno, f"cannot write the checkpoint ({e.strerror})", path) from e
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def save(path: str, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path`` whole or not at all."""
    temporary = _temporary(path)
    header = {f.name: getattr(checkpoint, f.name) for f in attrs.fields(Checkpoint)
              if f.name not in _FRONTIERS}
    try:
        with open(temporary, "wb") as f:
            pickler = pickle.Pickler(f, protocol=5)
            pickler.dump((MAGIC, FORMAT))
            pickler.dump(header)
            for name in _FRONTIERS:
                frontier: Frontier = getattr(checkpoint, name)
                pickler.dump(len(frontier))
                for state in frontier:
                    pickler.dump(state)
                    pickler.clear_memo()
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as e:  # named by the user's path, not the temporary one
        raise OSError(e.errno, f"cannot write the checkpoint ({e.strerror})", path) from e
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def load(path: str) -> Checkpoint:
    """The checkpoint at ``path``, or a `CheckpointError` saying what is wrong.
    Its frontiers are read into `Frontier`s (on disk past their limit)."""
    try:
        with open(path, "rb") as f:
            if f.read(1) != b"\x80":  # every pickle of protocol 2 or later starts so
                raise CheckpointError(f"{path}: not a model-checker checkpoint (it does not "
                                      "start like one)")
            f.seek(0)
            unpickler = pickle.Unpickler(f)
            head = unpickler.load()
            if not (isinstance(head, tuple) and len(head) == 2 and head[0] == MAGIC):
                raise CheckpointError(f"{path}: not a model-checker checkpoint (it starts "
                                      f"with a {type(head).__name__})")
            if head[1] != FORMAT:
                raise CheckpointError(f"{path}: checkpoint format {head[1]}; this kvstate "
                                      f"reads format {FORMAT}")
            header = unpickler.load()
            if not isinstance(header, dict):
                raise CheckpointError(f"{path}: not a readable model-checker checkpoint (its "
                                      f"header is a {type(header).__name__})")
            _same_code(path, header.get("code"))
            rest, following = Frontier(), Frontier()
            for frontier in (rest, following):
                for _ in range(int(unpickler.load())):
                    key, blob = unpickler.load()
                    frontier.append(key, blob)
            return Checkpoint(**header, rest=rest, following=following)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from e
    except Exception as e:  # truncated, or pickled classes this code does not have
        raise CheckpointError(f"{path}: not a readable model-checker checkpoint "
                              f"({type(e).__name__}: {e})") from e


def _same_code(path: str, code: object) -> None:
    from sim.cluster import code_fingerprint

    here = code_fingerprint()
    if code != here:
        raise CheckpointError(
            f"{path}: written by other kvstate code (sources {code}; these are "
            f"{here}): its states would not load or digest the same. Resume it with the "
            "code that wrote it, or start the search again")


def require_same(checkpoint: Checkpoint, path: str, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None) -> None:
    """Refuse to go on with another search than the checkpoint's."""
    if scope != checkpoint.scope:
        differs = "the same name, other contents" if scope.name == checkpoint.scope.name \
            else repr(checkpoint.scope.name)
        raise CheckpointError(f"{path}: a checkpoint of another scope ({differs}), not "
                              f"{scope.name!r}")
    asked = (protocol, reduce, tuple(only) if only else None)
    saved = (checkpoint.protocol, checkpoint.reduce, checkpoint.only)
    for what, mine, theirs in zip(("protocol", "reduction", "invariants"), asked, saved):
        if mine != theirs:
            raise CheckpointError(f"{path}: a checkpoint of another search ({what} "
                                  f"{theirs!r}, not {mine!r})")


__all__ = ["FORMAT", "MAGIC", "Checkpoint", "CheckpointError", "load", "probe",
           "require_same", "save"]
