"""The simulated Mooncake store: MemoryStore semantics plus what a real one
does under load (measured against a real master on loopback): a capacity, -200 when full, background
eviction of the oldest objects (silently: the engine only sees a later miss),
latency per call, and the faults the run's swarm switched on."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstate.memory_store import MemoryStore, StoreRaised
from sim.faults import Faults
from sim.kernel import Kernel

# Latencies in seconds, from loopback measurements of a real master: one
# batch_is_exist ~0.07-0.09 ms; a 256 KiB put at 0.9 GB/s ~0.3 ms per key.
EXISTS_LATENCY = 0.00008
PUT_LATENCY_PER_KEY = 0.0003
NO_AVAILABLE_HANDLE = -200
TRANSFER_FAIL = -800


class SimStore(MemoryStore):
    def __init__(self, kernel: Kernel, faults: Faults, capacity: int,
                 on_evict: Callable[[str], None]) -> None:
        super().__init__(self._answer)
        self.kernel = kernel
        self.faults = faults
        self.capacity = capacity
        self.on_evict = on_evict
        self.evictions = 0
        self._evicting = False
        # A rank's existence check that finds a key present saves its put
        # (dedup); the engine's own lookups (rank -1) are not counted.
        self.dedup_checked = 0
        self.dedup_hits = 0

    def exists(self, rank: int, keys: Sequence[str]) -> list[bool]:
        present = super().exists(rank, keys)
        if rank >= 0:
            self.dedup_checked += len(present)
            self.dedup_hits += sum(present)
        return present

    def _answer(self, op: str, rank: int, key: str) -> int | BaseException:
        faults = self.faults
        if op == "put":
            if faults.fire("put_raise"):
                return StoreRaised("put raised (injected)")
            if faults.fire("put_pressure"):
                return NO_AVAILABLE_HANDLE
            if faults.fire("put_error"):
                return TRANSFER_FAIL
            if len(self.objects) >= self.capacity and key not in self.objects:
                self._schedule_eviction()
                return NO_AVAILABLE_HANDLE
        elif op == "exists" and rank >= 0 and faults.fire("exists_raise"):
            return StoreRaised("batch_is_exist raised (injected)")
        return 0

    def _schedule_eviction(self) -> None:
        if self._evicting:
            return
        self._evicting = True
        self.kernel.schedule(0.001, self._evict_batch)

    def _evict_batch(self) -> None:
        """The master frees roughly the oldest tenth, in the background."""
        self._evicting = False
        for _ in range(max(1, self.capacity // 10)):
            if not self.objects:
                break
            self.evict_oldest()

    def evict_oldest(self) -> None:
        if self.objects:
            key = next(iter(self.objects))
            del self.objects[key]
            self.evictions += 1
            self.on_evict(key)

    def latency(self, op: str, keys: int) -> float:
        base = EXISTS_LATENCY if op == "exists" else PUT_LATENCY_PER_KEY * max(1, keys)
        if self.faults.fire("store_slow"):
            base *= 50
        return base
