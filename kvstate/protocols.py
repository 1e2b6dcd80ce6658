"""The extension point, as typed interfaces.

The engine model (`kvstate.harness.Harness`), the Hypothesis machine
(`kvstate.testing.ConnectorMachine`) and the simulator drive *any* scheduler-side
planner and per-rank executor that offer these methods and attributes, not only
kvstate's own (`kvstate.planner.Planner`, `kvstate.executor.Executor`). To test
your own connector bookkeeping, implement `PlannerProtocol` and
`ExecutorProtocol` and hand their constructors to the harness::

    h = Harness(config, "e2", planner_factory=MyPlanner, executor_factory=MyExecutor)

Everything here is structural (`typing.Protocol`): nothing has to inherit
from these classes, and a type checker verifies that an implementation fits.
The records that flow through the interfaces (`SchedulerStep`, `Plan`,
`SaveMeta`, `ExistsCall`, `PutCall`, `GetCall`, `Report`, `LoadReport`,
`Settlement`) are in `kvstate.records`; `LookupQuery` and `LoadResult` in
`kvstate.planner`.

The *policies* a protocol variant (`kvstate.variants.Variant`) is made of are
typed here too (`MetadataPolicy`, `RetryPolicy`), next to the ones defined
with their defaults: `kvstate.pins.PinPolicy` (a no-op base class),
`kvstate.events.EventQuorum` and `kvstate.ledger.Ledger`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from kvstate.config import ConnectorConfig
    from kvstate.ledger import RankRequest
    from kvstate.observations import Observation
    from kvstate.planner import LoadResult, LookupQuery
    from kvstate.records import (
        ExistsCall,
        GetCall,
        LoadReport,
        Plan,
        PutCall,
        Report,
        SaveMeta,
        SchedulerStep,
        Settlement,
    )
    from kvstate.variants import Variant

__all__ = [
    "ExecutorFactory",
    "ExecutorProtocol",
    "JobProtocol",
    "MetadataPolicy",
    "PlannerFactory",
    "PlannerProtocol",
    "RetryPolicy",
    "StoreProtocol",
]


@runtime_checkable
class PlannerProtocol(Protocol):
    """The scheduler side (one per engine): vLLM's connector scheduler role.

    Called by the driver in this order within an engine step: ``lookup`` /
    ``lookup_answered`` and ``allocate`` while requests are admitted,
    ``on_load_reports`` when ranks finished loads, ``step`` once per scheduler
    step (its `Plan` goes to every rank), and ``on_reports`` with the ranks'
    reports of finished jobs (its `Settlement` names the blocks to unpin and
    the KV events to publish).
    """

    def step(self, sched: SchedulerStep) -> Plan:
        """One scheduler step: what every rank must save, load, forget."""
        ...

    def lookup(self, req_id: str, prompt_len: int, block_hashes: Sequence[bytes]) -> LookupQuery:
        """Start a store lookup for a waiting request: the keys to test."""
        ...

    def lookup_answered(self, query: LookupQuery, present: Sequence[bool]) -> int:
        """The store answered ``query``: how many prompt tokens it can provide."""
        ...

    def allocate(self, req_id: str, block_ids: Sequence[Sequence[int]],
                 num_computed_tokens: int, num_external_tokens: int, load_async: bool) -> None:
        """The engine allocated blocks (``update_state_after_alloc``)."""
        ...

    def on_load_reports(self, reports: Sequence[LoadReport]) -> list[LoadResult]:
        """Per-rank load reports; a result for each load every rank finished."""
        ...

    def on_reports(self, reports: Sequence[Report]) -> Settlement:
        """Per-rank job reports (``update_connector_output``)."""
        ...

    def has_pending_push_work(self) -> bool:
        """True while a job awaits reports (the engine keeps stepping)."""
        ...

    def live_state_size(self) -> dict[str, int]:
        """What is still held, by name; every value 0 once the engine is idle
        and settled (the liveness check reports nonzero ones)."""
        ...


@runtime_checkable
class JobProtocol(Protocol):
    """A save job on one rank, as `ExecutorProtocol.dequeue` returns it. The
    driver reads only ``meta`` (for observations: job id, request id,
    generation) and otherwise hands the object back to the executor."""

    @property
    def meta(self) -> SaveMeta: ...


JobT = TypeVar("JobT", bound=JobProtocol)


@runtime_checkable
class ExecutorProtocol(Protocol[JobT]):
    """One tensor-parallel rank's worker side (sans-IO): the driver performs
    every store call the executor asks for and feeds the answer back.

    Besides the methods, a driver reads two attributes:

    - ``rank`` (int): this executor's tensor-parallel rank, ``0 <= rank < world_size``;
    - ``queue``: the jobs received and not yet dequeued (any sized collection;
      the harness and the model checker test it for emptiness).

    A job's life: ``receive`` enqueues it, ``dequeue`` pops it, ``start``
    returns its first store call (or its report), then ``exists_answered`` /
    ``put_answered`` / ``raised`` answer each call until a `Report` comes out
    (``raised`` may return ``None``: the job is lost, which variants use to
    model a missing ``finally``).
    """

    rank: int

    @property
    def queue(self) -> Collection[Any]: ...

    def receive(self, plan: Plan, *, loads: bool = True) -> list[GetCall]:
        """Take a step's plan; return the store reads of its loads."""
        ...

    def dequeue(self) -> JobT | None: ...

    def start(self, job: JobT) -> ExistsCall | PutCall | Report: ...

    def exists_answered(self, job: JobT, present: Sequence[bool]) -> PutCall | Report: ...

    def put_answered(self, job: JobT, codes: Sequence[int]) -> Report: ...

    def raised(self, job: JobT, error: str) -> Report | None: ...

    def load_answered(self, call: GetCall, ok: Sequence[bool]) -> LoadReport: ...

    def live_state_size(self) -> dict[str, int]:
        """What the rank still holds, by name (see `PlannerProtocol.live_state_size`)."""
        ...


class PlannerFactory(Protocol):
    """What builds the planner: ``kvstate.planner.Planner`` fits."""

    def __call__(self, config: ConnectorConfig, variant: Variant, /) -> PlannerProtocol: ...


class ExecutorFactory(Protocol):
    """What builds each rank's executor: ``kvstate.executor.Executor`` fits.
    ``clock`` gives the driver's time (seconds, virtual in the simulator);
    every observation the executor makes goes to ``observer``."""

    def __call__(self, config: ConnectorConfig, rank: int, variant: Variant, /, *,
                 clock: Callable[[], float],
                 observer: Callable[[Observation], None] | None) -> ExecutorProtocol[Any]: ...


@runtime_checkable
class StoreProtocol(Protocol):
    """The store as the harness drives it (`kvstate.memory_store.MemoryStore`
    is the reference). Content is a string tag standing for a block's bytes.
    A call may raise (`kvstate.memory_store.StoreRaised` or `TimeoutError`):
    the executor is then told the call raised."""

    @property
    def objects(self) -> Mapping[str, str]:
        """Key to content of everything stored (eviction picks from it)."""
        ...

    def exists(self, rank: int, keys: Sequence[str]) -> list[bool]: ...

    def put_many(self, rank: int, keys: Sequence[str], groups: Sequence[int],
                 blocks: Sequence[int], contents: Sequence[str]) -> list[tuple[int, bool]]:
        """One batched put: ``(code, accepted)`` per key; code 0 is success
        (Mooncake: -200 store full, -800 transfer failure), ``accepted`` is
        False for a failure or a key already present (first write wins)."""
        ...

    def load(self, rank: int, key: str, group: int, block: int) -> str | None:
        """Read ``key`` into engine block ``block``: the content, or None."""
        ...

    def evict(self, key: str) -> bool:
        """Drop ``key``; True if it was there."""
        ...


# --------------------------------------------------------------------------
# Policies of a variant (kvstate.variants.Variant fields). The defaults are
# classes with static methods, used as the class object itself.


class MetadataPolicy(Protocol):
    """``Variant.metadata``: what block table and hash list a job carries."""

    name: str

    def slice(self, tracker: Any) -> tuple[int, tuple[tuple[int, ...], ...], int,
                                           tuple[bytes, ...]]:
        """Scheduler side: ``(block_ids_start, block_ids, hashes_start,
        block_hashes)`` for the tracker's next job."""
        ...

    def resolve(self, entry: RankRequest, meta: SaveMeta) -> tuple[Sequence[Sequence[int]],
                                                                   Sequence[bytes]]:
        """Rank side: the full block table and hashes the job refers to."""
        ...


class RetryPolicy(Protocol):
    """``Variant.retry``: where a rank keeps a failed save's token suffix (for
    the next job's KV events). ``live`` is the generation's ledger entry when
    the job is still live, else None; ``put`` returns whether it wrote."""

    name: str

    def get(self, executor: Any, live: RankRequest | None,
            meta: SaveMeta) -> tuple[int, tuple[int, ...], int] | None: ...

    def put(self, executor: Any, live: RankRequest | None, meta: SaveMeta,
            value: tuple[int, tuple[int, ...], int] | None) -> bool: ...
