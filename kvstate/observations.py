"""What monitors see: records emitted at the connector boundary.

The planner's ``Plan``/``Settlement`` and the ranks' ``Report``s are
observations already; this module adds what only the rank or its caller sees —
a job starting (and which generation's state it read), writes to per-request
rank state, store calls with their answers, block-pool changes — so the
invariant monitors (`kvstate.invariants`) can judge a run from the outside,
the same way they will judge a trace recorded from a production engine.
"""

from __future__ import annotations

import attrs

from kvstate.events import BlockStored
from kvstate.records import Plan, Report, SchedulerStep, Settlement


@attrs.frozen(slots=True)
class StepScheduled:
    step: SchedulerStep


@attrs.frozen(slots=True)
class Planned:
    plan: Plan


@attrs.frozen(slots=True)
class Settled:
    settlement: Settlement


@attrs.frozen(slots=True)
class JobStarted:
    """A rank dequeued a job. ``state_generation`` is the generation that
    created the rank state the job reads (``None`` if none/stale);
    ``retry_generation`` the one that wrote the retry suffix it found."""

    rank: int
    job_id: int
    req_id: str
    generation: int
    live: bool
    save_start: int
    token_len: int
    state_generation: int | None
    retry_generation: int | None


@attrs.frozen(slots=True)
class StateWritten:
    """A job wrote per-request rank state (``field``: offset, skip or retry).
    ``scope_generation`` is the generation that state belongs to, ``None``
    when every generation of the request id shares it."""

    rank: int
    job_id: int
    req_id: str
    generation: int
    field: str
    value: int
    scope_generation: int | None


@attrs.frozen(slots=True)
class JobFinished:
    """A rank's verdict on a job: chunks it holds as stored (put or found) and
    chunks whose put failed, as (group, chunk id)."""

    rank: int
    job_id: int
    req_id: str
    generation: int
    outcome: str
    save_start: int
    token_len: int
    stored: tuple[tuple[int, int], ...]
    failed: tuple[tuple[int, int], ...]
    events: tuple[BlockStored, ...]
    now: float = 0.0
    skipped_since: float | None = None


@attrs.frozen(slots=True)
class ReportDelivered:
    report: Report


@attrs.frozen(slots=True)
class ExistsAnswered:
    rank: int
    job_id: int
    keys: tuple[str, ...]
    present: tuple[bool, ...]


@attrs.frozen(slots=True)
class PutDone:
    """One key put. ``content`` is what the rank read from the block (the
    simulator's stand-in for KV bytes); ``accepted`` whether the store kept it
    (first write wins)."""

    rank: int
    job_id: int
    req_id: str
    generation: int
    key: str
    group: int
    chunk_id: int
    block_id: int
    content: str
    code: int
    accepted: bool


@attrs.frozen(slots=True)
class LookupDone:
    """A lookup's inputs (prompt length, hash chain), the store's answers and
    the hit the planner concluded."""

    req_id: str
    generation: int
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...]
    keys: tuple[str, ...]
    present: tuple[bool, ...]
    hit_tokens: int


@attrs.frozen(slots=True)
class Allocated:
    """The engine allocated a request's blocks (``update_state_after_alloc``)."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_external_tokens: int
    load_async: bool


@attrs.frozen(slots=True)
class StoreCallRaised:
    """A rank's store call raised (or timed out) instead of answering."""

    rank: int
    job_id: int
    error: str


@attrs.frozen(slots=True)
class LoadDone:
    """A rank's load: which block ids got wrong or no data, and which it reported."""

    rank: int
    req_id: str
    generation: int
    failed_block_ids: tuple[int, ...]
    reported_block_ids: tuple[int, ...]


@attrs.frozen(slots=True)
class BlockAllocated:
    block_id: int
    req_id: str


@attrs.frozen(slots=True)
class BlockWritten:
    block_id: int
    content: str


@attrs.frozen(slots=True)
class BlockFreed:
    block_id: int


@attrs.frozen(slots=True)
class KeyEvicted:
    key: str


@attrs.frozen(slots=True)
class Quiescent:
    """No request runs, every queue drained: liveness invariants are due.
    ``leftovers`` names state that should be gone (empty when settled)."""

    pinned_blocks: int
    leftovers: tuple[tuple[str, int], ...]


Observation = (
    StepScheduled | Planned | Settled | JobStarted | StateWritten | JobFinished
    | ReportDelivered | ExistsAnswered | PutDone | LookupDone | Allocated | StoreCallRaised
    | LoadDone | BlockAllocated
    | BlockWritten | BlockFreed | KeyEvicted | Quiescent
)
