"""The model checker's visited table: every key reached, packed.

A long search is bounded by memory before time: the visited table grows with
every state and is never let go of (the frontier goes to disk,
`sim.explore.modelcheck.frontier`). Kept as Python objects, a state's entry cost ~166 bytes
in the search's process (its 16-byte key as a ``bytes`` object, 57; the dict
entry, the (parent, action) tuple and the discovery-order list; more where
each action is a tuple of its own) and ~91 in every worker process or Ray
actor, each of which keeps every key to skip the children it already knows.

`KeySet` packs the keys end to end in one ``bytearray``, in the order they
were added, with an open-addressing index beside it (an ``array`` of
positions, linear probing, at most half full:
https://en.wikipedia.org/wiki/Open_addressing); the digests are uniformly
random already, so a key's first bytes pick its slot (as a number, the
same in every process: the index pickles with the keys). `Visited` adds, per
key, the position of the key it was reached from and the number of the
action (actions are few: an engine step, a rank's call with one of four
answers, ...), which is all a shortest counterexample needs
(`sim.explore.modelcheck.model.path_to` walks it as it walks the dict). 16 bytes of key,
8 to 16 of index (4-byte positions, the table between a quarter and half
full), 8 of parent and 4 of action: ~39 bytes a state for the search, ~27
for a worker (``kvstate bench modelcheck`` measures both, beside the dict
and set, with `tracemalloc`, in its ``visited_*`` rows). Probing is Python:
~1.6 us an insert and ~0.5 us a lookup against ~0.3 and ~0.06 for the dict;
a state costs ~0.7 ms to expand and merge, so under 1 %.

The order of the keys is the discovery order: a worker is told the keys
merged since its last call as one slice of the packed bytes
(`KeySet.packed_from`), which pickles as one object instead of a list of
thousands.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

# Bytes in a key: the canonical digest's size (sim.explore.modelcheck.model.digest).
WIDTH = 16
# Slots to start with (a power of two); doubled whenever the table would be
# more than half full, where linear probing's expected probes stay under 2.5
# for a miss (Knuth, TAOCP vol. 3, 6.4).
START_SLOTS = 1024


class KeySet:
    """Fixed-width keys in the order added, with membership (module docstring)."""

    __slots__ = ("_keys", "_slots", "_mask", "_count")

    def __init__(self) -> None:
        self._keys = bytearray()
        self._slots = array("i", [-1]) * START_SLOTS
        self._mask = START_SLOTS - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _find(self, key: bytes) -> tuple[int, int]:
        """(slot, position of ``key``), or (the empty slot it would take, -1)."""
        if len(key) != WIDTH:
            raise ValueError(f"a visited-table key is {WIDTH} bytes, not {len(key)}")
        keys, slots, mask = self._keys, self._slots, self._mask
        slot = int.from_bytes(key, "little") & mask
        while True:
            n = slots[slot]
            if n < 0:
                return slot, -1
            start = n * WIDTH
            if keys[start:start + WIDTH] == key:
                return slot, n
            slot = (slot + 1) & mask

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and len(key) == WIDTH and self._find(key)[1] >= 0

    def position(self, key: bytes) -> int:
        """The key's place in the order added (KeyError if absent)."""
        n = self._find(key)[1]
        if n < 0:
            raise KeyError(key)
        return n

    def add(self, key: bytes) -> int:
        """Add ``key`` if new; its position either way."""
        slot, n = self._find(key)
        if n >= 0:
            return n
        n = self._count
        self._keys += key
        self._slots[slot] = n
        self._count = n + 1
        if 2 * self._count > len(self._slots):
            self._grow()
        return n

    def update(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.add(key)

    def add_packed(self, packed: bytes) -> None:
        """Add the keys of `packed_from`'s bytes, in their order."""
        if len(packed) % WIDTH:
            raise ValueError(f"packed keys are whole {WIDTH}-byte keys, not {len(packed)} bytes")
        for start in range(0, len(packed), WIDTH):
            self.add(packed[start:start + WIDTH])

    def key(self, n: int) -> bytes:
        if not 0 <= n < self._count:
            raise IndexError(n)
        return bytes(self._keys[n * WIDTH:(n + 1) * WIDTH])

    def packed_from(self, n: int) -> bytes:
        """The keys from position ``n`` on, end to end."""
        return bytes(self._keys[n * WIDTH:])

    def __iter__(self) -> Iterator[bytes]:
        keys = self._keys
        for start in range(0, self._count * WIDTH, WIDTH):
            yield bytes(keys[start:start + WIDTH])

    def _grow(self) -> None:
        size = 2 * len(self._slots)
        slots = array("i", [-1]) * size
        mask = size - 1
        keys = self._keys
        for n in range(self._count):
            slot = int.from_bytes(keys[n * WIDTH:(n + 1) * WIDTH], "little") & mask
            while slots[slot] >= 0:
                slot = (slot + 1) & mask
            slots[slot] = n
        self._slots, self._mask = slots, mask

    def nbytes(self) -> int:
        """Bytes held by the table's buffers (what ``python -m sim.explore.modelcheck.visited``
        reports; the Python objects around them are a few hundred bytes)."""
        return len(self._keys) + self._slots.itemsize * len(self._slots)

    def __getstate__(self) -> Any:
        return bytes(self._keys), self._slots.tobytes()

    def __setstate__(self, state: Any) -> None:
        packed, slots = state
        KeySet.__init__(self)
        self._keys = bytearray(packed)
        self._count = len(packed) // WIDTH
        self._slots = array("i")
        self._slots.frombytes(slots)
        self._mask = len(self._slots) - 1
        if len(packed) % WIDTH or not self._slots or len(self._slots) & self._mask or \
                2 * self._count > len(self._slots):
            raise ValueError(f"not a packed key table ({len(packed)} bytes of keys, "
                             f"{len(self._slots)} slots)")


class Visited(KeySet, Mapping[bytes, "tuple[bytes, Any] | None"]):
    """`KeySet` plus how each key was reached: ``visited[key]`` is None for
    the initial state, else (the parent's key, the action), as the dict it
    replaces gave (`sim.explore.modelcheck.model.path_to`)."""

    __slots__ = ("_parents", "_action_of", "_actions", "_action_numbers")

    def __init__(self) -> None:
        KeySet.__init__(self)
        self._parents = array("q")
        self._action_of = array("i")
        self._actions: list[Any] = []
        self._action_numbers: dict[Any, int] = {}

    def reach(self, key: bytes, parent: bytes | None = None, action: Any = None) -> bool:
        """Record ``key`` as reached from ``parent`` by ``action`` (the initial
        state: neither). False, and nothing changed, if it was known."""
        before = len(self)
        n = self.add(key)
        if n < before:
            return False
        if parent is None:
            self._parents.append(-1)
            self._action_of.append(-1)
            return True
        self._parents.append(self.position(parent))
        number = self._action_numbers.get(action)
        if number is None:
            number = self._action_numbers[action] = len(self._actions)
            self._actions.append(action)
        self._action_of.append(number)
        return True

    def __getitem__(self, key: bytes) -> tuple[bytes, Any] | None:
        n = self.position(key)
        parent = self._parents[n]
        if parent < 0:
            return None
        return self.key(parent), self._actions[self._action_of[n]]

    # ``in``, ``len`` and iteration are KeySet's (first in the MRO, so
    # Mapping's generic ``__contains__`` is not used).

    def copy(self) -> Visited:
        other = Visited()
        other.__setstate__(self.__getstate__())
        return other

    def nbytes(self) -> int:
        return KeySet.nbytes(self) + self._parents.itemsize * len(self._parents) + \
            self._action_of.itemsize * len(self._action_of)

    def __getstate__(self) -> Any:
        return (KeySet.__getstate__(self), self._parents.tobytes(), self._action_of.tobytes(),
                self._actions)

    def __setstate__(self, state: Any) -> None:
        keys, parents, action_of, actions = state
        Visited.__init__(self)
        KeySet.__setstate__(self, keys)
        self._parents.frombytes(parents)
        self._action_of.frombytes(action_of)
        self._actions = list(actions)
        self._action_numbers = {a: i for i, a in enumerate(self._actions)}
        if not len(self._parents) == len(self._action_of) == len(self):
            raise ValueError(f"a visited table of {len(self)} keys with {len(self._parents)} "
                             f"parents and {len(self._action_of)} actions")
