"""The simulator's kernel: virtual time and one seeded random source.

Events sit in a heap keyed by (time, sequence number), so two events at the
same virtual time run in the order they were scheduled — the tie-break that
makes a run byte-for-byte repeatable. Nothing here (or anywhere in ``sim`` or
``kvstate``) reads the wall clock or the global ``random`` module: every
random draw comes from ``Kernel.rng``, seeded once.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable


class Kernel:
    __slots__ = ("rng", "now", "processed", "_heap", "_seq")

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.processed = 0
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = 0

    def schedule(self, delay: float, action: Callable[[], object]) -> None:
        if delay < 0:
            raise ValueError(f"Kernel.schedule: negative delay {delay}")
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, action))

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None,
            max_events: int | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        budget = max_events if max_events is not None else -1
        while heap and budget != 0:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            when, _, action = pop(heap)
            self.now = when
            action()
            self.processed += 1
            budget -= 1
            if stop is not None and stop():
                return

    @property
    def pending(self) -> int:
        return len(self._heap)
