"""The worker side (sans-IO): one ``Executor`` per tensor-parallel rank.

Design notes
------------
Upstream runs each rank's saves on a send thread with a FIFO queue. Here the
queue lives in the executor and the caller drives it: ``receive`` takes a
step's ``Plan`` (the worker's main thread: preemptions, finishes, ledger
entries *before* enqueueing — S5), ``dequeue`` pops the next job, ``start``
returns the first store call the job needs, and ``exists_answered`` /
``put_answered`` / ``raised`` feed the store's answers back until a ``Report``
comes out. Because the caller performs every store call, the same executor runs
under the simulator's virtual clock, under a Hypothesis machine that picks the
interleaving, and against a real Mooncake store (``adapters``).

Every path ends in a report (``raised`` included: upstream's ``finally``,
vLLM#43743), because the planner releases a job's pins only when every rank has
reported it. Every write to a generation's rank state (saved offset, pressure
skip, retry suffix) re-checks that the job is still live at the moment of the
write: a preemption may arrive between a job's store calls.

The incremental store (docs/background.md): a rank remembers, per generation, the offset up
to which it has really saved (``saved_offset``); a job checks and stores only
chunks from there on, so a decode save touches one chunk, and the first job
after a failure resumes exactly where the failure left off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvstate.config import ConnectorConfig, GroupKind
from kvstate.events import BlockStored
from kvstate.keys import (
    cdiv,
    chunk_hash,
    chunk_ids,
    key_for,
    key_head,
    key_prefix,
    store_mask,
    stride_residue,
)
from kvstate.ledger import RankRequest
from kvstate.observations import JobFinished, JobStarted, Observation, StateWritten
from kvstate.records import (
    NULL_BLOCK_ID,
    ExistsCall,
    GetCall,
    LoadMeta,
    LoadReport,
    Plan,
    PutCall,
    Report,
    SaveMeta,
)
from kvstate.store_codes import StoreCode
from kvstate.tables import JOB, PRESSURE, JobEvent, JobState, PressureEvent, PressureState
from kvstate.variants import KVSTATE, Variant

NO_AVAILABLE_HANDLE = StoreCode.NO_AVAILABLE_HANDLE  # the store is full

# What became of each key of a job (for KV events).
PRESENT, PUT, FAILED = 0, 1, 2

_JE = JobEvent


class RankJob:
    """One job on one rank while it runs."""

    __slots__ = (
        "meta", "state", "block_ids", "hashes", "save_start", "token_len", "keys",
        "groups", "blocks", "chunks", "pending", "tokens_start", "tokens",
    )

    def __init__(self, meta: SaveMeta, block_ids: Sequence[Sequence[int]], hashes: Sequence[bytes]):
        self.meta = meta
        self.state = JobState.EMITTED
        self.block_ids = block_ids
        self.hashes = hashes
        self.save_start = 0
        self.token_len = 0
        self.keys: tuple[str, ...] = ()
        self.groups: list[int] = []
        self.blocks: list[int] = []
        self.chunks: list[int] = []
        self.pending: list[int] = []  # indexes into keys awaiting a put
        self.tokens_start = meta.token_ids_start
        self.tokens = meta.token_ids

    def fire(self, rank: int, event: JobEvent) -> None:
        """Move along the JOB table (`kvstate.tables`) for this job on ``rank``;
        an event the table does not allow here raises ``IllegalTransition``."""
        self.state = JOB.fire((self.meta.job_id, rank), self.state, event)


class Executor:
    def __init__(
        self,
        config: ConnectorConfig,
        rank: int,
        variant: Variant = KVSTATE,
        clock: Callable[[], float] = lambda: 0.0,
        observer: Callable[[Observation], None] | None = None,
    ) -> None:
        if not 0 <= rank < config.world_size:
            raise ValueError(f"Executor.rank={rank!r}: must be in [0, {config.world_size})")
        self.config = config
        self.rank = rank
        self.variant = variant
        self.clock = clock
        self.observer = observer
        self.ledger = variant.ledger(len(config.groups))
        self.queue: deque[RankJob] = deque()
        self.pressure = PressureState.CLEAR
        # Keyed by the entry itself (identity hash), not id(): survives a copy.
        self.skipped: dict[RankRequest, RankRequest] = {}
        self.retry_by_request: dict[str, tuple[int, tuple[int, ...], int]] = {}
        key_rank = variant.key_rank(rank)
        self.prefixes = [key_prefix(config, key_rank, g) for g in range(len(config.groups))]
        self.residues = [stride_residue(rank, g, config.put_step) for g in range(len(config.groups))]
        self._masked = any(g.kind is GroupKind.SLIDING_WINDOW for g in config.groups)
        self._no_masks: tuple[list[bool] | None, ...] = (None,) * len(config.groups)

    # ------------------------------------------------------------------
    # Main thread: take a step's metadata.

    def receive(self, plan: Plan, *, loads: bool = True) -> list[GetCall]:
        """Take a step's metadata: end generations, register and enqueue its
        jobs, and return the store reads of its loads (``loads=False`` when the
        caller already performed them: vLLM loads before the forward pass and
        enqueues saves after it)."""
        ledger = self.ledger
        for gen in plan.preempted:
            entry = ledger.preempt(gen)
            if entry is not None:
                self.skipped.pop(entry, None)
        for gen in plan.finished:
            ledger.finish(gen)
        resolve = self.variant.metadata.resolve
        for meta in plan.saves:
            entry = ledger.register(meta)  # before the queue put: S5
            block_ids, hashes = resolve(entry, meta)
            job = RankJob(meta, block_ids, hashes)
            job.fire(self.rank, _JE.ENQUEUE)
            self.queue.append(job)
        for entry in ledger.sweep():
            self.skipped.pop(entry, None)
        return [self.load_call(load) for load in plan.loads] if loads else []

    def dequeue(self) -> RankJob | None:
        return self.queue.popleft() if self.queue else None

    # ------------------------------------------------------------------
    # Send thread: run one job.

    def start(self, job: RankJob) -> ExistsCall | PutCall | Report:
        meta = job.meta
        job.fire(self.rank, _JE.DEQUEUE)
        config = self.config
        variant = self.variant
        entry = self.ledger.live_entry(meta)
        lcm = config.lcm_block_size
        job.token_len = token_len = meta.token_len // lcm * lcm
        if entry is None:
            self._observe_start(job, None, None)
            job.fire(self.rank, _JE.FOUND_STALE)
            return self._report(job, None)

        retry = variant.retry.get(self, entry, meta)
        if retry is not None and job.tokens is not None:
            start, ids = retry[0], retry[1]
            if start + len(ids) == meta.token_ids_start:
                job.tokens_start = start
                job.tokens = ids + job.tokens
        job.save_start = save_start = variant.save_start(entry.saved_offset, meta.token_ids_start)
        self._observe_start(job, entry, retry)

        if self.pressure is PressureState.PRESSURED and entry.skipped_since is not None:
            if variant.skip_expired(entry.skipped_since, self.clock(), config.pressure_backoff):
                entry.clear_skip(expired=True)
                self.skipped.pop(entry, None)
            else:
                job.fire(self.rank, _JE.SKIP_FOR_PRESSURE)
                if self.variant.skip_keeps_retry:
                    self._hold_retry(job)
                return self._report(job, entry)

        masks = store_mask(config, token_len, save_start) if self._masked else self._no_masks
        bs = config.block_size
        put_step = config.put_step
        per_block = config.hashes_per_block
        hashes = job.hashes
        origin = variant.stride_origin(cdiv(save_start, bs))
        limit = len(hashes) // per_block
        keys: list[str] = []
        groups, blocks, chunks = job.groups, job.blocks, job.chunks
        for g, mask in enumerate(masks):
            table = job.block_ids[g]
            size = len(table)
            # `key_for` and `chunk_hash` written out: this loop runs once per
            # chunk a job checks (8 M times in a FAST'25 soak at scale 16).
            head = key_head(self.prefixes[g])
            for cid in chunk_ids(save_start, token_len, bs, mask, put_step, self.residues[g],
                                 limit=limit, origin=origin):
                block = table[cid] if cid < size else NULL_BLOCK_ID
                if block == NULL_BLOCK_ID:
                    continue
                keys.append(head + hashes[(cid + 1) * per_block - 1].hex())
                groups.append(g)
                blocks.append(block)
                chunks.append(cid)
        if not keys:
            job.fire(self.rank, _JE.NOTHING_TO_STORE)
            return self._succeeded(job)
        job.keys = tuple(keys)
        to_check = variant.exists_keys(job.keys)
        if not to_check:
            job.fire(self.rank, _JE.CHECK_EXISTS)
            return self.exists_answered(job, (False,) * len(keys))
        job.fire(self.rank, _JE.CHECK_EXISTS)
        return ExistsCall(self.rank, meta.job_id, to_check)

    def exists_answered(self, job: RankJob, present: Sequence[bool]) -> PutCall | Report:
        if len(present) != len(job.keys):
            raise ValueError(
                f"job {job.meta.job_id} rank {self.rank}: {len(present)} exists answers for "
                f"{len(job.keys)} keys")
        job.pending = [i for i, p in enumerate(present) if not p]
        if not job.pending:
            job.fire(self.rank, _JE.ALL_PRESENT)
            return self._succeeded(job)
        job.fire(self.rank, _JE.PUT_MISSING)
        idx = job.pending
        if len(idx) == len(job.keys):  # the common case on a decode save: nothing deduped
            return PutCall(self.rank, job.meta.job_id, job.keys, tuple(job.groups),
                           tuple(job.blocks), tuple(job.chunks))
        return PutCall(
            self.rank, job.meta.job_id,
            tuple([job.keys[i] for i in idx]),
            tuple([job.groups[i] for i in idx]),
            tuple([job.blocks[i] for i in idx]),
            tuple([job.chunks[i] for i in idx]),
        )

    def put_answered(self, job: RankJob, codes: Sequence[int]) -> Report:
        meta = job.meta
        idx = job.pending
        if len(codes) != len(idx):
            raise ValueError(
                f"job {meta.job_id} rank {self.rank}: {len(codes)} put codes for {len(idx)} puts")
        ok = [c == StoreCode.OK for c in codes]
        if all(ok):
            job.fire(self.rank, _JE.PUT_OK)
            return self._succeeded(job, idx)
        job.fire(self.rank, _JE.PUT_PARTIAL if any(ok) else _JE.PUT_FAILED)
        if NO_AVAILABLE_HANDLE in codes:
            self.pressure = PRESSURE.fire(self.rank, self.pressure, PressureEvent.PUT_REJECTED)
            entry = self.ledger.live_entry(meta)
            if entry is not None:
                entry.mark_skipped(self.clock())
                self.skipped[entry] = entry
                self._written(job, "skip", 1, entry)
        stored = [i for i, good in zip(idx, ok) if good]
        failed = [i for i, good in zip(idx, ok) if not good]
        entry = self.ledger.live_entry(meta)
        if entry is not None:
            first_failed = min(job.chunks[i] for i in failed) * self.config.block_size
            advanced = self.variant.offset_after_failure(
                entry.saved_offset, first_failed, job.token_len)
            if advanced != entry.saved_offset:
                entry.record_saved(advanced)
                self._written(job, "offset", advanced, entry)
        status = [PRESENT] * len(job.keys)
        for i in stored:
            status[i] = PUT
        for i in failed:
            status[i] = FAILED
        events = self._events(job, status)
        self._hold_retry(job)
        return self._report(job, self.ledger.live_entry(meta), stored, failed, events)

    def raised(self, job: RankJob, error: str) -> Report | None:
        """A store call raised. The job still reports (unless the variant lost
        its ``finally``); the offset stays where it was, so the next job retries."""
        job.fire(self.rank, _JE.RAISED)
        self._hold_retry(job)
        if self.variant.after_raise(job) is None:
            return None  # never reported: its ledger entry and pins leak (S4, S6)
        return self._report(job, self.ledger.live_entry(job.meta), (), job.pending)

    # ------------------------------------------------------------------

    def _succeeded(self, job: RankJob, put: Sequence[int] = ()) -> Report:
        meta = job.meta
        entry = self.ledger.live_entry(meta)
        if entry is not None:
            if job.token_len != entry.saved_offset:
                entry.record_saved(job.token_len)
                self._written(job, "offset", job.token_len, entry)
        self.variant.retry.put(self, entry, meta, None)
        if (self.pressure is PressureState.PRESSURED or self.skipped) and \
                self.variant.success_clears_pressure(bool(put)):
            self.pressure = PRESSURE.fire(self.rank, self.pressure, PressureEvent.PUT_SUCCEEDED)
            for skipped in self.skipped.values():
                skipped.clear_skip(expired=False)
            self.skipped.clear()
        status = [PRESENT] * len(job.keys)
        for i in put:
            status[i] = PUT
        events = self._events(job, status)
        return self._report(job, entry, range(len(job.keys)), (), events)

    def _hold_retry(self, job: RankJob) -> None:
        """Keep the failed suffix so the next live job can still emit its events."""
        if job.tokens is None:
            return
        meta = job.meta
        entry = self.ledger.live_entry(meta)
        value = (job.tokens_start, job.tokens, meta.generation)
        if self.variant.retry.put(self, entry, meta, value):
            self._written(job, "retry", job.tokens_start, entry)

    def _events(self, job: RankJob, status: Sequence[int]) -> tuple[BlockStored, ...]:
        """KV events for the chunks the variant announces (``status[i]`` is
        PRESENT, PUT or FAILED for ``job.keys[i]``), parent always computed
        from the request's own hash chain in the default protocol (S15)."""
        if not self.config.enable_kv_events:
            return ()
        config = self.config
        bs = config.block_size
        per_block = config.hashes_per_block
        hash_block = config.hash_block
        parent_of = self.variant.parent
        tokens, tstart = job.tokens, job.tokens_start
        out: list[BlockStored] = []
        prev_emitted: list[bytes | None] = [None] * len(config.groups)
        prev_missing: list[bytes | None] = [None] * len(config.groups)
        for i in self.variant.event_chunks(job.groups, status):
            g = job.groups[i]
            cid = job.chunks[i]
            digest = chunk_hash(job.hashes, cid, per_block)
            if status[i] == FAILED:
                prev_missing[g] = digest
                continue
            start = cid * bs
            if tokens is not None and start >= tstart and start + bs <= tstart + len(tokens):
                ids = tokens[start - tstart:start - tstart + bs]
            else:
                ids = ()
            parent = parent_of(job.hashes, start, hash_block, prev_emitted[g], prev_missing[g])
            out.append(BlockStored((digest,), parent, tuple(ids), bs, g))
            prev_emitted[g] = digest
            if status[i] == PUT:
                prev_missing[g] = digest
        return tuple(out)

    def _report(
        self,
        job: RankJob,
        entry: RankRequest | None,
        stored: Sequence[int] = (),
        failed: Sequence[int] = (),
        events: tuple[BlockStored, ...] = (),
    ) -> Report:
        meta = job.meta
        self.ledger.retire_job(meta)
        outcome = job.state
        job.fire(self.rank, _JE.REPORT)
        confirmed = entry.saved_offset if entry is not None else 0
        if self.observer is not None:
            self.observer(JobFinished(
                self.rank, meta.job_id, meta.req_id, meta.generation, outcome.value,
                job.save_start, job.token_len,
                tuple((job.groups[i], job.chunks[i]) for i in stored),
                tuple((job.groups[i], job.chunks[i]) for i in failed),
                events,
                self.clock(),
                entry.skipped_since if entry is not None else None,
            ))
        return Report(meta.job_id, self.rank, meta.req_id, meta.generation, outcome,
                      confirmed, events)

    def _observe_start(
        self, job: RankJob, entry: RankRequest | None,
        retry: tuple[int, tuple[int, ...], int] | None,
    ) -> None:
        if self.observer is None:
            return
        meta = job.meta
        self.observer(JobStarted(
            self.rank, meta.job_id, meta.req_id, meta.generation, entry is not None,
            job.save_start, job.token_len,
            entry.generation if entry is not None else None,
            retry[2] if retry is not None else None,
        ))

    def _written(self, job: RankJob, field: str, value: int, entry: RankRequest | None) -> None:
        if self.observer is None:
            return
        meta = job.meta
        scope = entry.generation if entry is not None and self.ledger.per_generation else None
        self.observer(StateWritten(
            self.rank, meta.job_id, meta.req_id, meta.generation, field, value, scope))

    # ------------------------------------------------------------------
    # Loads.

    def load_call(self, load: LoadMeta) -> GetCall:
        """The store reads of one load on this rank (keys, groups, target blocks)."""
        bs = self.config.block_size
        per_block = self.config.hashes_per_block
        keys: list[str] = []
        groups: list[int] = []
        blocks: list[int] = []
        first = load.start_token // bs
        last = min(cdiv(load.end_token, bs), len(load.block_hashes) // per_block)
        for g, table in enumerate(load.block_ids):
            for cid in range(first, last):
                if cid >= len(table) or table[cid] == NULL_BLOCK_ID:
                    continue
                keys.append(key_for(self.prefixes[g], chunk_hash(load.block_hashes, cid, per_block)))
                groups.append(g)
                blocks.append(table[cid])
        return GetCall(self.rank, load.req_id, load.generation, tuple(keys), tuple(groups),
                       tuple(blocks))

    def load_answered(self, call: GetCall, ok: Sequence[bool]) -> LoadReport:
        """A get that returned nothing (evicted since the lookup) or failed is a
        load error: the engine must recompute those blocks (S19)."""
        failed = tuple(b for b, good in zip(call.block_ids, ok) if not good)
        return LoadReport(call.req_id, call.generation, self.rank, self.variant.load_errors(failed))

    # ------------------------------------------------------------------

    def live_state_size(self) -> dict[str, int]:
        return {
            "ledger_entries": len(self.ledger),
            "queued_jobs": len(self.queue),
            "skipped": len(self.skipped),
            "retry_by_request": len(self.retry_by_request),
        }
