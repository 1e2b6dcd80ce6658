"""Model-checker checkpoints: a long search that can stop and go on.

A scope that takes hours (``large``, or a wider one on a cluster) is lost
whole to a Ctrl-C, a budget, a driver restarted or a machine taken back,
unless the search can be written down and picked up again. The compact
engine (`sim.explore.modelcheck.compact`) searches level by level and merges in frontier
order, so its whole state between two frontier states is plain data:

* ``parents``: every key visited, with the key and action it was reached by
  (a `sim.explore.modelcheck.visited.Visited`, ~43 bytes a state; its order is the
  discovery order the workers are told);
* ``rest``: the current level's states not expanded yet, as (key, stored
  state: its value, `sim.explore.modelcheck.values`), in frontier order (a `sim.explore.modelcheck.frontier.Frontier`: in memory or on
  disk, streamed to and from the file record by record);
* ``following``: the next level's states found so far (the same);
* ``depth`` and the counters of the `sim.explore.modelcheck.model.Result` so far.

Going on from exactly that makes the same merges in the same order, so a
resumed search ends with the same states, transitions, depth, verdict and
shortest counterexample as one that never stopped, whatever the number of
workers on either side, and whether its levels were on disk or not
(`tests/test_mc_checkpoint.py` interrupts searches every few dozen states
and compares). The workers' own key sets are not saved: a
worker knowing fewer keys only stores more children, never other ones.

A checkpoint's states are values of the core's classes, so it only means
something to the same code: it records `sim.explore.cluster.code_fingerprint`
and refuses to resume under other sources (the states would be rebuilt into
other classes, and their keys would differ). The file itself is a pickle, and
loading a pickle runs code: resume only checkpoints you wrote. Files are written whole or not at all (a temporary
file beside it, then a rename), so a crash while writing leaves the previous
checkpoint.

A file damaged afterwards (cut short by a full disk or a copy, a bit flipped
on a disk or on the way between machines, overwritten in part) is refused
when it is loaded, as damaged, before the search starts: its last 32 bytes
are a blake2b digest of every byte before them, computed as the file is
streamed out, and `load` knows a file of its format by its first bytes and
reads it through once, a chunk at a time, to check the digest before it
unpickles anything in it (damage to those first bytes is told from another
format by the digest too). Without it the stored states were only unpickled as the
search reached them, so a damaged file failed mid-search with a traceback,
or went on from wrong states to a verdict without a word. The digest detects
damage; it is not a signature: whoever can write the file can write a digest
that matches, and a checkpoint is still a pickle that runs code when it is
loaded. Resume only checkpoints you wrote.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import stat
from collections.abc import Sequence
from typing import BinaryIO, NoReturn

import attrs

from sim.explore.modelcheck.frontier import Frontier
from sim.explore.modelcheck.model import Scope
from sim.explore.modelcheck.visited import Visited

# Bumped whenever the layout below changes meaning: an older file is refused
# with both numbers rather than misread.
FORMAT = 6
# 6: states stored as values (sim.explore.modelcheck.values) under value
#    keys; a format-5 file holds pickled states under pickled digests;
# 5: the model checker's classes pickled at their sub-package paths
#    (sim.explore.modelcheck.model.Scope, ...: issue 31); a format-4 file names
#    sim.modelcheck, which no longer exists, and is refused by its number;
# 4: the file ends with a blake2b digest of all of it, checked before anything
#    in it is unpickled (a damaged file failed mid-search, or went on from
#    wrong states without a word); 3: the visited table packed
#    (sim.explore.modelcheck.visited); 2 held a dict
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
    code: str  # sim.explore.cluster.code_fingerprint() of the writer
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


# What the file holds, in order, each a dump() of one pickler (they share its
# memo, so one unpickler reads them back): (MAGIC, FORMAT), the fields of a
# `Checkpoint` but its two frontiers (a dict), then each frontier as its
# count and that many (key, pickled state) pairs; then, not pickled, the
# blake2b digest (`DIGEST_BYTES`) of every byte before it. A level is
# streamed from or to its frontier, and hashed as it goes, so a level on disk
# (`Frontier`) never needs to fit in memory to be saved, checked or resumed.
_FRONTIERS = ("rest", "following")
DIGEST_BYTES = 32
# How every file of this format starts: (MAGIC, FORMAT), `save`'s first dump.
# `load` knows a file of its own format by these bytes, unpickling nothing
# before the digest is checked; a start a few bytes off is a damaged one if
# the rest matches the digest with these bytes in its place.
_START = pickle.dumps((MAGIC, FORMAT), protocol=5)
_NEAR = 4  # bytes off
# Read to find the (MAGIC, FORMAT) of another format, or of no checkpoint
# (51 bytes in formats 2 to 4), so that a damaged start cannot ask for more.
_START_BYTES = 256
_CHUNK = 1024 * 1024  # read at a time to check the digest


def _digest() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"kvstate-ckpt")


class _Hashing:
    """The file being written, hashing what `pickle.Pickler` writes to it."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.hash = _digest()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.file.write(data)


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
            hashing = _Hashing(f)
            pickler = pickle.Pickler(hashing, protocol=5)
            pickler.dump((MAGIC, FORMAT))
            pickler.dump(header)
            for name in _FRONTIERS:
                frontier: Frontier = getattr(checkpoint, name)
                pickler.dump(len(frontier))
                for state in frontier:
                    pickler.dump(state)
                    pickler.clear_memo()
            f.write(hashing.hash.digest())  # every dump() has written all it pickled
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
    The whole file is checked against its digest before anything in it is
    unpickled (of a file that does not start as this format's do, only its
    start is, to say what it is). Its frontiers are read into `Frontier`s (on
    disk past their limit)."""
    from kvstate.trace.reader import trace_name

    name = trace_name(path)  # as errors show it (quoted when blank or not text)
    if not path:
        raise CheckpointError(f"{name}: an empty path: give the checkpoint file")
    try:
        # Only a regular file: opening a FIFO waits for a writer for ever, a
        # device may never end (issue 32, class 2).
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise CheckpointError(f"{name}: not a regular file (a checkpoint is a file "
                                  "--checkpoint wrote)")
        with open(path, "rb") as f:
            start = f.read(_START_BYTES)
            if not start.startswith(_START):
                _refuse_start(name, f, start)
            content = _check_digest(name, f)
            f.seek(0)
            unpickler = pickle.Unpickler(f)  # one, as one pickler wrote: they share a memo
            unpickler.load()  # (MAGIC, FORMAT): `_START`
            header = unpickler.load()
            if not isinstance(header, dict):
                raise CheckpointError(f"{name}: not a readable model-checker checkpoint (its "
                                      f"header is a {type(header).__name__})")
            _same_code(name, header.get("code"))
            rest, following = Frontier(), Frontier()
            for frontier in (rest, following):
                for _ in range(int(unpickler.load())):
                    key, blob = unpickler.load()
                    frontier.append(key, blob)
            if f.tell() != content:
                raise CheckpointError(f"{name}: not a readable model-checker checkpoint "
                                      f"({content - f.tell():,} bytes after its last state)")
            return Checkpoint(**header, rest=rest, following=following)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{name}: cannot open ({e.strerror})") from e
    except Exception as e:  # another start, or pickled classes this code does not have
        raise CheckpointError(f"{name}: not a readable model-checker checkpoint "
                              f"({type(e).__name__}: {e})") from e


def _refuse_start(path: str, f: io.BufferedReader, start: bytes) -> NoReturn:
    """Say why a file that does not start as this format's do is refused:
    one of them damaged there, no checkpoint, or another format's."""
    off = sum(a != b for a, b in zip(start, _START))
    if len(start) >= len(_START) and off <= _NEAR:
        size = os.fstat(f.fileno()).st_size
        if size >= len(_START) + DIGEST_BYTES:
            computed, recorded = _digests(f, size - DIGEST_BYTES)
            if computed.digest() == recorded:
                raise CheckpointError(
                    f"{path}: a damaged checkpoint: {off} of its first {len(_START)} bytes "
                    f"(what says it is a checkpoint of format {FORMAT}) changed since it was "
                    "written; the rest matches its checksum. Resume an intact copy, or start "
                    "the search again")
    if start[:1] != b"\x80":  # every pickle of protocol 2 or later starts so
        raise CheckpointError(f"{path}: not a model-checker checkpoint (it does not start "
                              "like one)")
    head = pickle.Unpickler(io.BytesIO(start)).load()
    if not (isinstance(head, tuple) and len(head) == 2 and head[0] == MAGIC):
        raise CheckpointError(f"{path}: not a model-checker checkpoint (it starts with a "
                              f"{type(head).__name__})")
    if head[1] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {head[1]}; this kvstate reads "
                              f"format {FORMAT}")
    raise CheckpointError(f"{path}: not a readable model-checker checkpoint (it does not "
                          f"start as a checkpoint of format {FORMAT} does)")


def _check_digest(path: str, f: io.BufferedReader) -> int:
    """Refuse the file unless its last `DIGEST_BYTES` are the digest of all
    the bytes before them; how many bytes those are."""
    size = os.fstat(f.fileno()).st_size
    content = size - DIGEST_BYTES
    if content < len(_START):
        raise CheckpointError(f"{path}: a damaged checkpoint: {size:,} bytes, too few for "
                              "its start and the checksum that ends it (cut short?)")
    computed, recorded = _digests(f, content)
    if computed.digest() != recorded:
        raise CheckpointError(
            f"{path}: a damaged checkpoint: its content does not match the checksum that "
            f"ends it (blake2b of its first {content:,} bytes: {computed.hexdigest()[:16]}..., "
            f"recorded: {recorded.hex()[:16]}...): cut short, or changed since it was "
            "written. Resume an intact copy, or start the search again")
    return content


def _digests(f: io.BufferedReader, content: int) -> tuple[hashlib.blake2b, bytes]:
    """The digest of the first ``content`` bytes of ``f`` with `_START` in
    place of its first bytes (the same, in a file that starts right), and the
    `DIGEST_BYTES` after them, the one recorded. Reads a chunk at a time."""
    digest = _digest()
    digest.update(_START)
    f.seek(len(_START))
    buffer = memoryview(bytearray(_CHUNK))
    left = content - len(_START)
    while left > 0:
        n = f.readinto(buffer[:min(left, _CHUNK)])
        if not n:
            break  # shorter than it was a moment ago: the digests differ
        digest.update(buffer[:n])
        left -= n
    return digest, f.read(DIGEST_BYTES)


def _same_code(path: str, code: object) -> None:
    from sim.explore.cluster import code_fingerprint

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


__all__ = ["DIGEST_BYTES", "FORMAT", "MAGIC", "Checkpoint", "CheckpointError", "load", "probe",
           "require_same", "save"]
