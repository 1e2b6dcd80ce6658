"""A test double of the Mooncake store with its observable semantics.

``put`` of an existing key answers 0 and keeps the old value (first write
wins); ``exists`` answers per key; ``get`` of a missing key answers ``None``
(Mooncake returns ``b''``), and ``read``, the same get with its code, answers
-704 (OBJECT_NOT_FOUND) for it. Faults are scripted by tests through ``answer``:
a function from (operation, rank, key) to a return code, or an exception
instance to raise (`kvstate.store_codes.StoreCode`: -200 no space, -800
transfer failure, -900 RPC failure).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstate.store_codes import StoreCode


class StoreRaised(Exception):
    """What a scripted store call raises."""


Answer = Callable[[str, int, str], "int | BaseException"]


def always_ok(op: str, rank: int, key: str) -> int:
    return 0


class MemoryStore:
    def __init__(self, answer: Answer = always_ok) -> None:
        self.objects: dict[str, str] = {}
        self.answer = answer
        self.puts = 0
        self.exists_keys = 0

    def _ask(self, op: str, rank: int, key: str) -> int:
        got = self.answer(op, rank, key)
        if isinstance(got, BaseException):
            raise got
        return got

    def holds(self, key: str) -> bool:
        """Whether a put of ``key`` finds it taken: it answers 0 and stores
        nothing (Mooncake's ``PutStart`` answers OBJECT_ALREADY_EXISTS, which
        the client reports as success). Here: the key is stored."""
        return key in self.objects

    def exists(self, rank: int, keys: Sequence[str]) -> list[bool]:
        self.exists_keys += len(keys)
        for key in keys:
            self._ask("exists", rank, key)
        return [k in self.objects for k in keys]

    def put(self, rank: int, key: str, content: str) -> tuple[int, bool]:
        """(code, accepted): accepted is False for a failure or an existing key."""
        code = self._ask("put", rank, key)
        self.puts += 1
        if code != 0:
            return code, False
        if self.holds(key):
            return 0, False
        self.objects[key] = content
        return 0, True

    def put_many(self, rank: int, keys: Sequence[str], groups: Sequence[int],
                 blocks: Sequence[int], contents: Sequence[str]) -> list[tuple[int, bool]]:
        """One batched put call: (code, accepted) per key. The answers are
        drawn first, so a raise aborts the whole call before anything is stored
        (a failed batch RPC); otherwise each key is put as ``put`` would."""
        codes = [self._ask("put", rank, key) for key in keys]
        out = []
        for key, content, code in zip(keys, contents, codes):
            self.puts += 1
            if code != 0:
                out.append((code, False))
            elif self.holds(key):
                out.append((0, False))
            else:
                self.objects[key] = content
                out.append((0, True))
        return out

    def load(self, rank: int, key: str, group: int, block: int) -> str | None:
        """Read ``key`` into engine block ``block``; the content read, or None."""
        return self.get(rank, key)

    def get(self, rank: int, key: str) -> str | None:
        return self.read(rank, key)[1]

    def read(self, rank: int, key: str) -> tuple[int, str | None]:
        """One get with its code: (0, content); (-704, None) for a key the
        store does not hold; (the scripted code, None) for a failure."""
        code = self._ask("get", rank, key)
        if code != 0:
            return code, None
        content = self.objects.get(key)
        if content is None:
            return int(StoreCode.OBJECT_NOT_FOUND), None
        return 0, content

    def evict(self, key: str) -> bool:
        return self.objects.pop(key, None) is not None
