"""The records that cross the connector's boundaries.

Inputs from the engine (``SchedulerStep`` and its request records), the
planner's output to the ranks (``SaveMeta``, ``LoadMeta`` inside a ``Plan``),
the store calls a rank asks its caller to make, and the reports a rank sends
back (``Report``, ``LoadReport``). All frozen and slotted: once a record has
crossed a boundary nobody may change it (upstream's stale-metadata bugs,
vLLM#54853, were records mutated after they were handed over).

A *generation* is identified by ``GenKey = (request id, generation number)``.
Generation numbers come from one counter per planner, so they are unique for
the planner's lifetime and need no per-request memory after a request settles.
"""

from __future__ import annotations

import attrs

from kvstate.events import BlockStored
from kvstate.tables import JobState

GenKey = tuple[str, int]
BlockTable = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV-cache group

# vLLM's null block: a placeholder in a table (e.g. a sliding-window group's
# dropped prefix); never read, never pinned.
NULL_BLOCK_ID = 0


@attrs.frozen(slots=True)
class NewRequest:
    """A request scheduled for the first time in this step (a prefill)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: BlockTable
    block_hashes: tuple[bytes, ...]


@attrs.frozen(slots=True)
class CachedRequest:
    """A running request scheduled again: more prefill chunks or one decode token.

    ``new_token_ids`` are the real tokens whose KV this step computes
    (speculative drafts excluded); ``new_block_hashes`` the hashes of blocks the
    engine completed since the last step.

    ``freed_positions``: per group, the positions in the request's table
    whose block the engine freed since the last step (the table holds the null
    block there now): a sliding-window group's blocks that left the window
    (vLLM's ``SlidingWindowManager.remove_skipped_blocks``, run when the
    request is allocated). Empty when nothing was freed, or one tuple per
    group. The engine may hand those blocks to another request in this very
    step, so no job planned from now on may read or pin them.
    """

    req_id: str
    num_computed_tokens: int
    new_token_ids: tuple[int, ...]
    new_block_ids: BlockTable
    new_block_hashes: tuple[bytes, ...] = ()
    freed_positions: BlockTable = ()


@attrs.frozen(slots=True)
class ResumedRequest:
    """A preempted request scheduled again with a *replaced* block table."""

    req_id: str
    all_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: BlockTable
    block_hashes: tuple[bytes, ...]


@attrs.frozen(slots=True)
class SchedulerStep:
    new: tuple[NewRequest, ...] = ()
    cached: tuple[CachedRequest, ...] = ()
    resumed: tuple[ResumedRequest, ...] = ()
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()


@attrs.frozen(slots=True)
class SaveMeta:
    """One store job, as every rank receives it.

    ``block_ids``/``block_hashes`` are a *slice* starting at
    ``block_ids_start``/``hashes_start``: the default protocol ships only what
    is new since the generation's previous job (ranks keep a mirror), upstream
    ships the whole table every time (start 0).
    ``token_ids`` is the snapshot ``[token_ids_start, token_len)`` for KV
    events (``None`` when events are off).
    """

    req_id: str
    generation: int
    job_id: int
    token_ids_start: int
    token_len: int
    num_prompt_tokens: int
    is_decode: bool
    block_ids_start: int
    block_ids: BlockTable
    hashes_start: int
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...] | None = None

    @property
    def gen_key(self) -> GenKey:
        return (self.req_id, self.generation)


@attrs.frozen(slots=True)
class LoadMeta:
    """Load ``[start_token, end_token)`` of a generation from the store."""

    req_id: str
    generation: int
    start_token: int
    end_token: int
    block_ids: BlockTable
    block_hashes: tuple[bytes, ...]


@attrs.frozen(slots=True)
class GenerationStart:
    req_id: str
    generation: int
    reason: str  # "new" | "resumed"
    num_prompt_tokens: int


@attrs.frozen(slots=True)
class GenerationEnd:
    req_id: str
    generation: int
    reason: str  # "finished" | "preempted"


@attrs.frozen(slots=True)
class Violation:
    """A broken invariant or a broken protocol assumption, never silently ignored."""

    invariant: str
    message: str


@attrs.frozen(slots=True)
class Plan:
    """One scheduler step's connector metadata plus what the engine must do.

    ``pins`` and ``releases`` are block ids (with multiplicity): +1 / -1
    references on engine blocks, applied by the engine's block pool.
    ``started``/``ended`` are audit records for monitors; ranks read
    ``saves``, ``loads``, ``preempted`` and ``finished``.
    """

    step: int
    saves: tuple[SaveMeta, ...] = ()
    loads: tuple[LoadMeta, ...] = ()
    preempted: tuple[GenKey, ...] = ()
    finished: tuple[GenKey, ...] = ()
    pins: tuple[int, ...] = ()
    releases: tuple[int, ...] = ()
    started: tuple[GenerationStart, ...] = ()
    ended: tuple[GenerationEnd, ...] = ()
    violations: tuple[Violation, ...] = ()


@attrs.frozen(slots=True)
class Report:
    """A rank is done with a job (every path, exceptions included).

    ``confirmed_offset`` is the rank's saved offset for the generation after
    the job (what the default protocol's incremental pins release against).
    """

    job_id: int
    rank: int
    req_id: str
    generation: int
    outcome: JobState
    confirmed_offset: int
    events: tuple[BlockStored, ...] = ()


@attrs.frozen(slots=True)
class LoadReport:
    """A rank finished a load; ``failed_block_ids`` must be recomputed (S19)."""

    req_id: str
    generation: int
    rank: int
    failed_block_ids: tuple[int, ...]


@attrs.frozen(slots=True)
class Settlement:
    """What the planner concluded from a batch of reports."""

    releases: tuple[int, ...] = ()
    released_jobs: tuple[int, ...] = ()
    published: tuple[BlockStored, ...] = ()
    dropped_events: int = 0
    violations: tuple[Violation, ...] = ()
    # The generation whose report completed each published event's quorum.
    published_by: tuple[GenKey, ...] = ()


# Store calls a rank asks its caller to perform (sans-IO).


@attrs.frozen(slots=True)
class ExistsCall:
    rank: int
    job_id: int
    keys: tuple[str, ...]


@attrs.frozen(slots=True)
class PutCall:
    """Put ``keys[i]`` from engine block ``block_ids[i]`` of group ``groups[i]``."""

    rank: int
    job_id: int
    keys: tuple[str, ...]
    groups: tuple[int, ...]
    block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]


@attrs.frozen(slots=True)
class GetCall:
    rank: int
    req_id: str
    generation: int
    keys: tuple[str, ...]
    groups: tuple[int, ...]
    block_ids: tuple[int, ...]
