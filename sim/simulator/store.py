"""The simulated Mooncake store: MemoryStore semantics plus what a real one
does under load (measured against a real master on loopback): a capacity, -200 when full, background
eviction of the oldest objects (silently: the engine only sees a later miss),
latency per call, and the faults the run's swarm switched on.

The faults follow the store's contract (Mooncake's ``mooncake-store``: the
design document's Lease and Zombie Object Cleanup sections, ``types.h``,
``client_service.cpp``, ``master_service.cpp``):

* a master restart loses every object at once (its metadata is gone; clients
  remount their segments and work again right after), and every put in
  progress with them;
* a get whose lease ran out before its transfer ended answers -707
  (LEASE_EXPIRED) and returns nothing; a get answers other codes for a failed
  transfer, a checksum mismatch or an unreachable master, -704 for a key it
  does not hold and -703 for a key whose put has not ended;
* a put answers -200 (no space), -800 (transfer), -704 (``PutEnd`` found the
  object's metadata gone), -900/-901 (master unreachable, no answer);
* a put whose client went silent after ``PutStart`` leaves the key a put in
  progress: the existence check says absent, a put of it answers 0 and stores
  nothing (the client reports OBJECT_ALREADY_EXISTS as success), and only a
  put more than 30 s after that ``PutStart`` preempts it and stores the key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstate.memory_store import MemoryStore, StoreRaised
from kvstate.store_codes import StoreCode
from sim.simulator.faults import Faults
from sim.simulator.kernel import Kernel

# Latencies in seconds, from loopback measurements of a real master: one
# batch_is_exist ~0.07-0.09 ms; a 256 KiB put at 0.9 GB/s ~0.3 ms per key.
EXISTS_LATENCY = 0.00008
PUT_LATENCY_PER_KEY = 0.0003

# Mooncake's ErrorCode values, named once (`kvstate.store_codes`).
NO_AVAILABLE_HANDLE = StoreCode.NO_AVAILABLE_HANDLE
REPLICA_IS_NOT_READY = StoreCode.REPLICA_IS_NOT_READY
OBJECT_NOT_FOUND = StoreCode.OBJECT_NOT_FOUND
LEASE_EXPIRED = StoreCode.LEASE_EXPIRED
TRANSFER_FAIL = StoreCode.TRANSFER_FAIL
CHECKSUM_MISMATCH = StoreCode.CHECKSUM_MISMATCH
RPC_FAIL = StoreCode.RPC_FAIL
RPC_TIMEOUT = StoreCode.RPC_TIMEOUT

# What the ``get_error`` and ``put_codes`` sites answer. A get's -704 and -703
# are not drawn: the store answers them for itself, for a key it lost
# (eviction, restart) or one whose put never ended (``put_preempted``). A
# put's -200 and -800 have sites of their own (put_pressure, put_error); -705
# (OBJECT_ALREADY_EXISTS) reaches no caller: the client answers it as 0.
GET_CODES = (TRANSFER_FAIL, CHECKSUM_MISMATCH, RPC_FAIL, RPC_TIMEOUT)
PUT_CODES = (OBJECT_NOT_FOUND, RPC_FAIL, RPC_TIMEOUT)

# Seconds after a PutStart that neither PutEnd nor PutRevoke followed until a
# new PutStart of the key may preempt it: the master's
# put_start_discard_timeout_sec, DEFAULT_PUT_START_DISCARD_TIMEOUT = 30
# (mooncake-store/include/types.h).
PUT_START_DISCARD_TIMEOUT = 30.0


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
        # key -> virtual time of a PutStart no PutEnd or PutRevoke followed
        # (``put_preempted``): a put in progress, for ever unless preempted.
        self.put_started: dict[str, float] = {}
        self.preempted_puts = 0  # puts that took over such a key after the timeout
        self.restarts = 0
        self.lost_to_restarts = 0  # objects the restarts lost

    def exists(self, rank: int, keys: Sequence[str]) -> list[bool]:
        # `MemoryStore.exists` asks ``answer`` once per key; here only a
        # rank's check can fail (``exists_raise``, the engine's own lookups
        # never do), so the keys' visits are drawn in one loop: the same
        # draws in a third of the time (80 keys: 7.7 us against 22.8; a
        # FAST'25 soak at scale 16 checks 8.3 M keys).
        self.exists_keys += len(keys)
        if rank >= 0 and self.faults.fire_any("exists_raise", len(keys)):
            raise StoreRaised("batch_is_exist raised (injected)")
        present = [key in self.objects for key in keys]
        if rank >= 0:
            self.dedup_checked += len(present)
            self.dedup_hits += sum(present)
        return present

    def holds(self, key: str) -> bool:
        """A stored key, or one whose put is in progress (the master answers
        the new PutStart OBJECT_ALREADY_EXISTS, the client reports 0). A
        PutStart older than the discard timeout is preempted instead: the
        new put goes ahead and stores the key."""
        if key in self.objects:
            return True
        started = self.put_started.get(key)
        if started is None:
            return False
        # master_service.cpp PutStart: "put_start_time + discard_timeout >= now"
        # still refuses the new PutStart.
        if started + PUT_START_DISCARD_TIMEOUT >= self.kernel.now:
            return True
        del self.put_started[key]
        self.preempted_puts += 1
        return False

    def start_puts(self, keys: Sequence[str]) -> None:
        """A put call whose client goes silent after the master took its
        PutStart: each key neither stored nor in progress becomes a put in
        progress from now (a key already stored answers the PutStart
        OBJECT_ALREADY_EXISTS and starts nothing)."""
        for key in keys:
            if not self.holds(key):
                self.put_started[key] = self.kernel.now

    def restart_master(self) -> None:
        """The master restarts without a snapshot: its metadata is gone, so
        every object is lost at once, and every put in progress with it. The
        clients remount their segments and the store takes puts again right
        away. Each lost key is told as an eviction is, so the monitors and
        the router forget it (sorted: the loss has no order of its own)."""
        self.restarts += 1
        self.put_started.clear()
        lost = sorted(self.objects)
        self.objects.clear()
        self.lost_to_restarts += len(lost)
        for key in lost:
            self.on_evict(key)

    def _answer(self, op: str, rank: int, key: str) -> int | BaseException:
        faults = self.faults
        if op == "put":
            if faults.fire("put_raise"):
                return StoreRaised("put raised (injected)")
            if faults.fire("put_pressure"):
                return NO_AVAILABLE_HANDLE
            if faults.fire("put_error"):
                return TRANSFER_FAIL
            if faults.fire("put_codes"):
                return faults.rng.choice(PUT_CODES)
            if len(self.objects) >= self.capacity and key not in self.objects:
                self._schedule_eviction()
                return NO_AVAILABLE_HANDLE
        elif op == "get":  # (existence checks: `exists`)
            if key not in self.objects:
                # The query finds no readable replica and grants no lease:
                # -703 while a put of it is in progress, else -704 (`read`).
                return REPLICA_IS_NOT_READY if key in self.put_started else 0
            # The get's own query found the key and leased it (10 s,
            # default_kv_lease_ttl); Client::Get answers -707 when the transfer
            # outlived that lease. The simulator's gets take no virtual time,
            # so the race is a fault of its own rather than a clock.
            if faults.fire("lease_expired"):
                return LEASE_EXPIRED
            if faults.fire("get_error"):
                return faults.rng.choice(GET_CODES)
        return 0

    def _schedule_eviction(self) -> None:
        if self._evicting:
            return
        self._evicting = True
        self.kernel.schedule(0.001, self._evict_batch)

    def _evict_batch(self) -> None:
        """The master frees roughly the oldest tenth, in the background. A
        real master spares objects under a lease (10 s after an existence
        check or a get's query found them); this one does not, so a hit may
        be gone by its get: more failed loads than a real store, never fewer."""
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
