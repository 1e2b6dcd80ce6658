"""A rank's ledger: which store jobs are live, and the per-request state they own.

The ledger answers one question on every write a job makes — *is this job
still live?* — and owns the per-request state (saved offset, retry suffix,
pressure skip, block-table mirror) that only live jobs may touch.

Three ledgers, one per era (docs/background.md, "Eras"):

``GenerationLedger`` (kvstate) keys everything by (request id, generation).
    A job can only ever reach its own generation's state, so id reuse and
    preemption cannot cross-contaminate; a finished generation keeps running its
    queued jobs against its own offset while a reused id starts fresh.
``RequestIdLedger`` (upstream E2) keys by request id with a set of live job
    ids. Preemption drops the entry at once, so queued jobs become stale; a
    finished id's entry is deleted only once drained — so a client reusing the
    id before that shares the entry with the old generation's jobs.
``CounterLedger`` (E0/E1) counts jobs per request id. A job of a retired
    generation sees the new generation's count and believes itself live, and a
    stale job's decrement drives a fresh entry negative (vLLM#51637).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from kvstate.records import GenKey, SaveMeta
from kvstate.tables import (
    RETRY,
    SAVED_MARK,
    SKIP,
    RetryEvent,
    RetryState,
    SavedMarkEvent,
    SavedMarkState,
    SkipEvent,
    SkipState,
)


class RankRequest:
    """Per-request state on one rank."""

    __slots__ = (
        "req_id",
        "generation",
        "live",
        "count",
        "saved_offset",
        "retry",
        "skipped_since",
        "block_ids",
        "hashes",
        "mark",
        "skip",
        "retry_state",
    )

    def __init__(self, req_id: str, generation: int, num_groups: int) -> None:
        self.req_id = req_id
        self.generation = generation
        self.live: set[int] = set()
        self.count = 0
        self.saved_offset = 0
        self.retry: tuple[int, tuple[int, ...], int] | None = None  # (start, ids, writer gen)
        self.skipped_since: float | None = None
        self.block_ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.hashes: list[bytes] = []
        self.mark = SavedMarkState.UNSAVED
        self.skip = SkipState.NOT_SKIPPED
        self.retry_state = RetryState.CLEAN

    # Every write goes through its machine: a write the table does not allow
    # (say, a saved mark recorded after the entry retired) raises instead of
    # silently corrupting state.

    def record_saved(self, offset: int) -> None:
        self.mark = SAVED_MARK.fire(self.key, self.mark, SavedMarkEvent.RECORD_SAVED)
        self.saved_offset = offset

    def retire(self) -> None:
        self.mark = SAVED_MARK.fire(self.key, self.mark, SavedMarkEvent.RETIRE)

    def mark_skipped(self, now: float) -> None:
        self.skip = SKIP.fire(self.key, self.skip, SkipEvent.MARK)
        if self.skipped_since is None:
            self.skipped_since = now

    def clear_skip(self, expired: bool) -> None:
        self.skip = SKIP.fire(
            self.key, self.skip, SkipEvent.BACKOFF_EXPIRED if expired else SkipEvent.CLEAR)
        self.skipped_since = None

    def set_retry(self, value: tuple[int, tuple[int, ...], int] | None) -> None:
        event = RetryEvent.SAVE_COMPLETED if value is None else RetryEvent.FAILED_WITH_SUFFIX
        self.retry_state = RETRY.fire(self.key, self.retry_state, event)
        self.retry = value

    @property
    def key(self) -> tuple[str, int]:
        return (self.req_id, self.generation)


class Ledger(Protocol):
    #: ``True`` when an entry belongs to one generation; ``False`` when every
    #: generation of a request id shares it (what monitors call the write's scope).
    per_generation: bool

    def register(self, meta: SaveMeta) -> RankRequest: ...

    def live_entry(self, meta: SaveMeta) -> RankRequest | None: ...

    def retire_job(self, meta: SaveMeta) -> None: ...

    def preempt(self, gen: GenKey) -> RankRequest | None: ...

    def finish(self, gen: GenKey) -> None: ...

    def sweep(self) -> list[RankRequest]: ...

    def __len__(self) -> int: ...


_K = TypeVar("_K", bound=Hashable)


class _KeyedLedger(Generic[_K]):
    """The ledger's one algorithm; subclasses say what an entry is keyed by
    (``_key``: of a job's metadata; ``_key_of``: of a generation key)."""

    per_generation: bool

    __slots__ = ("num_groups", "entries", "finishing")

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.entries: dict[_K, RankRequest] = {}
        self.finishing: set[_K] = set()

    @staticmethod
    def _key(meta: SaveMeta) -> _K:
        raise NotImplementedError

    @staticmethod
    def _key_of(gen: GenKey) -> _K:
        raise NotImplementedError

    def register(self, meta: SaveMeta) -> RankRequest:
        key = self._key(meta)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = RankRequest(meta.req_id, meta.generation, self.num_groups)
        entry.live.add(meta.job_id)
        return entry

    def live_entry(self, meta: SaveMeta) -> RankRequest | None:
        entry = self.entries.get(self._key(meta))
        if entry is not None and meta.job_id in entry.live:
            return entry
        return None

    def retire_job(self, meta: SaveMeta) -> None:
        entry = self.entries.get(self._key(meta))
        if entry is not None:
            entry.live.discard(meta.job_id)

    def preempt(self, gen: GenKey) -> RankRequest | None:
        key = self._key_of(gen)
        self.finishing.discard(key)
        entry = self.entries.pop(key, None)
        if entry is not None:
            entry.retire()
        return entry

    def finish(self, gen: GenKey) -> None:
        key = self._key_of(gen)
        if key in self.entries:
            self.finishing.add(key)

    def _drained(self, entry: RankRequest) -> bool:
        return not entry.live

    def sweep(self) -> list[RankRequest]:
        gone: list[RankRequest] = []
        if self.finishing:
            for key in [k for k in self.finishing if self._drained(self.entries[k])]:
                self.finishing.discard(key)
                entry = self.entries.pop(key)
                entry.retire()
                gone.append(entry)
        return gone

    def __len__(self) -> int:
        return len(self.entries)


class GenerationLedger(_KeyedLedger[GenKey]):
    """Entries per generation (the default protocol): a stale job of an
    earlier generation never finds the newer generation's entry."""

    per_generation = True
    __slots__ = ()

    @staticmethod
    def _key(meta: SaveMeta) -> GenKey:
        return (meta.req_id, meta.generation)

    @staticmethod
    def _key_of(gen: GenKey) -> GenKey:
        return gen


class RequestIdLedger(_KeyedLedger[str]):
    """Entries per request id (upstream): every generation of an id shares one."""

    per_generation = False
    __slots__ = ()

    @staticmethod
    def _key(meta: SaveMeta) -> str:
        return meta.req_id

    @staticmethod
    def _key_of(gen: GenKey) -> str:
        return gen[0]


class CounterLedger(RequestIdLedger):
    """``stored_requests[req_id] += 1`` (E0/E1): liveness is "count > 0"."""

    __slots__ = ()

    def register(self, meta: SaveMeta) -> RankRequest:
        entry = self.entries.get(meta.req_id)
        if entry is None:
            entry = self.entries[meta.req_id] = RankRequest(
                meta.req_id, meta.generation, self.num_groups
            )
        entry.count += 1
        return entry

    def live_entry(self, meta: SaveMeta) -> RankRequest | None:
        entry = self.entries.get(meta.req_id)
        return entry if entry is not None and entry.count > 0 else None

    def retire_job(self, meta: SaveMeta) -> None:
        entry = self.entries.get(meta.req_id)
        if entry is None:
            # The defaultdict of the original: a stale job's decrement after the
            # entry was dropped recreates it below zero, and it never drains.
            entry = self.entries[meta.req_id] = RankRequest(
                meta.req_id, meta.generation, self.num_groups
            )
        entry.count -= 1

    def _drained(self, entry: RankRequest) -> bool:
        return entry.count == 0
