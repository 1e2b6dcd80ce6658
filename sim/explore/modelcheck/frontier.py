"""A breadth-first level of the model checker, in memory or on disk.

The driver of the compact engine (`sim.explore.modelcheck.compact`) holds two levels at a
time: the one being expanded and the next one being found. Each state waits
there pickled (~7 KB on ``upstream`` and ``large``), and wide scopes have
wide levels: after a minute on two cores ``large`` had 668 MB resident, of
which ~460 MB were its two levels (205 MB with them on disk), so a search of
an hour would outgrow the machine long before its time ran out, and on a
cluster, which expands levels many times faster, sooner still. So a level
keeps its states in memory up to `SPILL_BYTES` and then moves them, in
order, to an anonymous temporary file (deleted when closed or when the
process ends), read back sequentially a batch at a time. What is left in
memory grows with the visited table (a key and how it was reached, per
state), not with the width of a level.

Why a file and not compression: ``zlib`` at level 1 took ~80 us a state
and halved it (with a preset dictionary ~55 us for ~5.5x), a tenth or more
of a transition's time for every state kept; writing a state to a file and
reading it back once costs a few microseconds, and the page cache keeps the
recent part in memory anyway.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO

# Pickled states a level keeps in memory before it moves them to disk: two
# levels at most 128 MB between them, whatever the scope. Spilling costs
# little (``large`` for 60 s on two workers with a 1 MB limit: 127,429 states
# against 128,989 unlimited, within the run-to-run noise; 195 MB resident
# against 668 MB), so the limit only keeps small searches off the disk.
SPILL_BYTES = 64 * 1024 * 1024

# A record on disk: key length, state length, then the two.
_HEAD = struct.Struct("<HI")


class Frontier:
    """States of one level, (key, pickled state), in frontier order."""

    def __init__(self, states: Iterable[tuple[bytes, bytes]] = (),
                 spill_bytes: int | None = None) -> None:
        self.spill_bytes = SPILL_BYTES if spill_bytes is None else spill_bytes
        self.memory: list[tuple[bytes, bytes]] = []
        self.held = 0  # bytes of pickled states in `memory`
        self.file: IO[bytes] | None = None
        self.count = 0
        self.closed = False  # let go of: reading it again is an error, not "empty"
        self.extend(states)

    def append(self, key: bytes, blob: bytes) -> None:
        self.count += 1
        if self.file is not None:
            self._write(key, blob)
            return
        self.memory.append((key, blob))
        self.held += len(blob)
        if self.held > self.spill_bytes:
            self.file = tempfile.TemporaryFile(prefix="kvstate-frontier-")
            for k, b in self.memory:
                self._write(k, b)
            self.memory = []
            self.held = 0

    def extend(self, states: Iterable[tuple[bytes, bytes]]) -> None:
        for key, blob in states:
            self.append(key, blob)

    def _write(self, key: bytes, blob: bytes) -> None:
        assert self.file is not None
        self.file.seek(0, os.SEEK_END)  # a read may have moved the position
        self.file.write(_HEAD.pack(len(key), len(blob)))
        self.file.write(key)
        self.file.write(blob)

    @property
    def spilled(self) -> bool:
        return self.file is not None

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def batches(self, size: int) -> Iterator[list[tuple[bytes, bytes]]]:
        """The states in order, ``size`` at a time (nothing may be appended
        while this runs)."""
        if self.closed:
            raise RuntimeError("this frontier was let go of (closed): its states are gone")
        if self.file is None:
            memory = self.memory
            for start in range(0, len(memory), size):
                yield memory[start:start + size]
            return
        file = self.file
        file.flush()
        file.seek(0)
        batch: list[tuple[bytes, bytes]] = []
        for _ in range(self.count):
            key_len, blob_len = _HEAD.unpack(file.read(_HEAD.size))
            batch.append((file.read(key_len), file.read(blob_len)))
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        for batch in self.batches(1024):
            yield from batch

    def close(self) -> None:
        """Let go of the states (the file is deleted); the frontier is empty."""
        if self.file is not None:
            self.file.close()
            self.file = None
        self.memory = []
        self.held = self.count = 0
        self.closed = True


__all__ = ["SPILL_BYTES", "Frontier"]
