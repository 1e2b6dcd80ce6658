"""``ObservedMooncakeStoreConnector``: vLLM 0.33.0's shipped connector, watched.

Load it where ``MooncakeStoreConnector`` was loaded, with the same extra
config plus kvstate's trace and monitor fields::

    KVTransferConfig(kv_connector="ObservedMooncakeStoreConnector",
                     kv_connector_module_path="adapters.vllm", kv_role="kv_both",
                     kv_connector_extra_config={...upstream's fields...,
                         "kvstate_trace": "/var/log/engine.trace",
                         "kvstate_monitor": "log"})

Theory of operation
-------------------
The class *is* upstream's ``MooncakeStoreConnector`` (a subclass: every call
on both roles runs the shipped code, with its own arguments and answers;
nothing it decides is changed). Around it the observer writes kvstate's
**observed layer** (`specs/trace.md`) from what it can see:

- vLLM's own objects: the ``SchedulerOutput`` (``StepScheduled``, built by
  the same translation ``KvstateConnector`` uses), the ``Request`` objects,
  the block tables ``update_state_after_alloc`` gets (``Allocated``);
- the shipped classes' outputs: the connector metadata
  ``build_connector_meta`` returns (every ``ReqMeta`` that saves is a store
  job, every ``ReqMeta`` that loads a load: ``Planned``), the references it
  takes and drops on vLLM's ``BlockPool`` (a pool tap records ``touch`` and
  ``free_blocks``: the plan's pins and the settlement's releases), the KV
  events ``take_events`` publishes;
- each rank's store traffic: a store tap stands in front of the rank's
  ``MooncakeDistributedStore`` handle (the send thread's, the receive
  threads' and the lookup server's) and records every
  ``batch_is_exist`` / ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` with its answers, attributed to the job,
  load or lookup the calling thread is running. A job's start (is it live,
  the rank's saved offset) and end are read where the send thread starts
  ``_handle_request`` and calls ``finish_store_job``; a load's reported
  blocks where the receive thread calls ``_report_load_error``.

What a rank saw travels to the scheduler inside the worker metadata (a
wrapper around upstream's ``MooncakeStoreWorkerMetadata``, unwrapped before
upstream's ``update_connector_output`` sees it), and `EngineLog` puts it in
causal order, as for ``KvstateConnector``. A job's report is recorded
*before* upstream's ``finish_store_job`` counts it (both under the rank's
tap lock, which ``build_connector_worker_meta`` also takes), so a report
never reaches the scheduler after the release it causes.

The observer knows no generations: records carry a placeholder and the log
writes the observed layer, whose generations ``kvstate check`` derives
(`kvstate.derive`); the online monitor judges exactly those lines. Two
annotations are facts the observer saw itself and are kept: a skipped job's
``now`` and ``skipped_since`` (the step the rank's put was answered
``NO_AVAILABLE_HANDLE``), so K6 is judged (upstream has no backoff: hazard
H3). A load's ``failed_block_ids`` are the blocks whose get answered an
error or fewer bytes than asked, judged from the store's answers, not from
upstream's report (so a short read upstream takes for a load is S19:
hazard H6).

Not observed: several KV-cache groups (the observer refuses them at start,
as ``KvstateConnector`` does), boundary-state (Mamba) puts and partial-tail
puts (none are made without such groups), lookups of a scheduler in another
process than rank 0's lookup server are still matched (they travel in the
worker metadata) but a lookup the client abandoned (``discard``) is not.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)

from kvstate.contract import UNKNOWN
from kvstate.events import BlockStored
from kvstate.observations import (
    Allocated,
    ExistsAnswered,
    JobFinished,
    JobStarted,
    LoadDone,
    LookupDone,
    Planned,
    PutDone,
    ReportDelivered,
    Settled,
    StepScheduled,
    StoreCallRaised,
)
from kvstate.records import LoadMeta, Plan, Report, SaveMeta, Settlement
from kvstate.tables import JobState

from .connector import trace_header
from .options import ConnectorOptions, connector_config
from .recorder import EngineLog
from .scheduler_side import _table, scheduler_step
from .worker_side import RankObservation

logger = logging.getLogger("kvstate.vllm")

# kvstate fields that configure kvstate's own protocol: upstream's connector
# decides everything they would, so the observer refuses them by name.
NOT_FOR_THE_OBSERVER = ("kvstate_protocol", "kvstate_store_timeout", "kvstate_put_step",
                        "kvstate_load_async")
# The value a left-out generation reads as (`kvstate.contract`): the
# observed layer drops it, and ``kvstate check`` and the online monitor
# number generations themselves (`kvstate.derive`).
NO_GENERATION = UNKNOWN
_KEY = re.compile(r"@group:(\d+)@([0-9a-f]+)$")
# Mooncake's "no space": upstream marks the request skipped (hazard H3).
NO_AVAILABLE_HANDLE = -200
# Rank 0's lookup answers kept unpaired: lookups are paired within a step
# or two; more than this many waiting means their lookups were abandoned.
ANSWERS_KEPT = 64
# Hashes remembered to name published events (`short_hash`): reported events
# are published within a step or two; this bounds the map on a long run.
FULL_HASHES_KEPT = 1 << 16


def _hash_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int):
        return value.to_bytes(8, "big")
    return bytes(value)


def short_hash(full: bytes) -> int:
    """What vLLM's events carry for a block hash when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on (its default): the low 64
    bits (``maybe_convert_block_hash``). The trace keeps the full hash, so
    the checker can recompute the chain (S15, S17)."""
    return int.from_bytes(full, "big") & ((1 << 64) - 1)


def _event(event: Any, full: Mapping[int, bytes]) -> BlockStored:
    """vLLM's ``BlockStored`` as kvstate's record; ``full`` maps the short
    form of the hashes it may name back to the hashes themselves."""

    def whole(value: Any) -> bytes:
        if isinstance(value, int):
            return full.get(value) or _hash_bytes(value)
        return _hash_bytes(value)

    parent = event.parent_block_hash
    return BlockStored(tuple(whole(h) for h in event.block_hashes),
                       None if parent is None else whole(parent),
                       tuple(event.token_ids or ()), event.block_size,
                       event.group_idx or 0, event.medium or "cpu")


class ObservedWorkerMetadata(KVConnectorWorkerMetadata):
    """Upstream's worker metadata (``inner``, may be None) plus what each rank
    saw: observations, job reports and lookups, summed by ``aggregate``."""

    def __init__(self, inner: Any, observations: list[RankObservation],
                 reports: list[tuple[tuple[int, int, int], Report]],
                 lookups: list[tuple[int, tuple[str, ...], tuple[bool, ...], int]]) -> None:
        self.inner = inner
        self.observations = observations
        self.reports = reports
        self.lookups = lookups

    def aggregate(self, other: KVConnectorWorkerMetadata) -> ObservedWorkerMetadata:
        assert isinstance(other, ObservedWorkerMetadata)
        if self.inner is None:
            self.inner = other.inner
        elif other.inner is not None:
            self.inner = self.inner.aggregate(other.inner)
        self.observations.extend(other.observations)
        self.reports.extend(other.reports)
        self.lookups.extend(other.lookups)
        return self


# What a generation's previous job carried, per group: (blocks, last block
# id); and how many hashes.
Shipped = tuple[tuple[tuple[int, int], ...], int]


def _new_since(previous: Shipped | None, block_ids: Any, hashes: int) -> tuple[int, int]:
    """Where a job's block table and hash chain start to be new since its
    generation's previous job: the trace writes only that slice.

    Upstream ships the whole table with every job; written whole, a request
    at 128k tokens would put 8,192 block ids and hashes on every decode
    job's line (and cost as much to write). The contract allows slices
    (`kvstate.records.SaveMeta`) and the checker rebuilds the table from
    them. Within a generation vLLM only appends blocks to a request's table
    (a replaced table is a resumption, a new generation, shipped whole); a
    table whose last shipped block moved is shipped whole all the same."""
    if previous is None:
        return 0, 0
    groups, old_hashes = previous
    start = None
    for (count, last), table in zip(groups, block_ids):
        if count > len(table) or (count and table[count - 1] != last):
            return 0, 0
        start = count if start is None else min(start, count)
    return start or 0, min(old_hashes, hashes)


def _shipped(block_ids: Any, hashes: int) -> Shipped:
    return tuple((len(t), t[-1] if t else -1) for t in block_ids), hashes


# ----------------------------------------------------------------------
# The scheduler role: a tap on vLLM's block pool.


class _PoolTap:
    """vLLM's ``BlockPool`` as upstream's scheduler sees it: every call goes
    to the pool; ``touch`` and ``free_blocks`` also note the block ids."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        # Read on every pin upstream takes: an attribute, not a __getattr__.
        self.blocks = pool.blocks
        self.touched: list[int] = []
        self.freed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def touch(self, blocks: Any) -> None:
        blocks = list(blocks)
        self.touched.extend(b.block_id for b in blocks)
        self._pool.touch(blocks)

    def free_blocks(self, blocks: Iterable[Any]) -> None:
        blocks = list(blocks)
        self.freed.extend(b.block_id for b in blocks)
        self._pool.free_blocks(blocks)

    def take(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        touched, freed = tuple(self.touched), tuple(self.freed)
        self.touched, self.freed = [], []
        return touched, freed


# ----------------------------------------------------------------------
# A rank: a tap on its store handle.


class _Job:
    """What the send thread does for one store job, as the tap sees it."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta
        self.present: dict[str, bool] = {}
        self.put: dict[str, int] = {}
        self.raised = False
        self.raised_keys: tuple[str, ...] = ()
        self.events: list[Any] = []
        # Read where the send thread starts the job (`_RankTap.job_started`).
        self.live = False
        self.skipped = False
        self.save_start = 0
        self.token_len = 0


class _Load:
    def __init__(self, meta: Any) -> None:
        self.meta = meta
        self.failed: list[int] = []
        self.reported: list[int] = []


class _Lookup:
    def __init__(self) -> None:
        self.keys: tuple[str, ...] = ()
        self.present: tuple[bool, ...] = ()


class _StoreTap:
    """One rank's ``MooncakeDistributedStore`` as the shipped threads see it:
    every call goes to the store; the three batch calls also report their
    keys and answers to the rank, for the job, load or lookup the calling
    thread runs (``current``)."""

    def __init__(self, store: Any, rank: _RankTap) -> None:
        self._store = store
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_is_exist(self, keys: list[str]) -> Any:
        work = self._rank.current()
        try:
            answers = self._store.batch_is_exist(keys)
        except Exception as exc:
            self._rank.raised(work, f"batch_is_exist: {exc}", keys)
            raise
        if isinstance(work, _Job):
            present = tuple(a == 1 for a in answers)
            work.present.update(zip(keys, present))
            self._rank.observe(ExistsAnswered(self._rank.rank, work.meta.store_job_id,
                                              tuple(keys), present))
        elif isinstance(work, _Lookup):
            work.keys = tuple(keys)
            work.present = tuple(a == 1 for a in answers)
        return answers

    def batch_put_from_multi_buffers(self, keys: list[str], *args: Any, **kwargs: Any) -> Any:
        work = self._rank.current()
        try:
            codes = self._store.batch_put_from_multi_buffers(keys, *args, **kwargs)
        except Exception as exc:
            self._rank.raised(work, f"batch_put_from_multi_buffers: {exc}", keys)
            raise
        if isinstance(work, _Job):
            for key, code in zip(keys, codes):
                work.put[key] = int(code)
                self._rank.put_done(work, key, int(code))
        return codes

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any,
                                     *args: Any, **kwargs: Any) -> Any:
        work = self._rank.current()
        try:
            answers = self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *args,
                                                               **kwargs)
        except Exception as exc:
            self._rank.raised(work, f"batch_get_into_multi_buffers: {exc}", keys)
            raise
        if isinstance(work, _Load):
            for key, got, want in zip(keys, answers, sizes):
                # A get answers the bytes it read: fewer than asked is a
                # failed load as much as an error code is (hazard H6).
                if got < 0 or got != sum(want):
                    block = self._rank.block_of(work.meta, key)
                    if block is not None:
                        work.failed.append(block)
        return answers


class _RankTap:
    """What one rank saw, until ``build_connector_worker_meta`` ships it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.local = threading.local()
        self.plan_step = 0
        self.shipped = 0
        self._seq = 0
        self.observations: list[RankObservation] = []
        self.reports: list[tuple[tuple[int, int, int], Report]] = []
        self.lookups: list[tuple[int, tuple[str, ...], tuple[bool, ...], int]] = []
        self._skipped_since: dict[str, float] = {}

    def current(self) -> Any:
        return getattr(self.local, "work", None)

    def observe(self, obs: Any) -> None:
        with self.lock:
            self._seq += 1
            self.observations.append(RankObservation(self.plan_step, self.shipped + 1,
                                                     self.rank, self._seq, obs))

    def raised(self, work: Any, error: str, keys: list[str]) -> None:
        if isinstance(work, _Job):
            work.raised = True
            work.raised_keys = tuple(keys)
            self.observe(StoreCallRaised(self.rank, work.meta.store_job_id, error[:300]))

    @staticmethod
    def chunk_of(meta: Any, key: str) -> tuple[int, int] | None:
        """(group, chunk id) of ``key``: where its hash sits in the request's chain."""
        match = _KEY.search(key)
        if match is None:
            return None
        digest = match.group(2)
        for i, h in enumerate(meta.block_hashes):
            if _hash_bytes(h).hex() == digest:
                return int(match.group(1)), i
        return None

    def block_of(self, meta: Any, key: str) -> int | None:
        where = self.chunk_of(meta, key)
        if where is None:
            return None
        group, chunk = where
        table = meta.block_ids[group] if group < len(meta.block_ids) else []
        return table[chunk] if chunk < len(table) else None

    def put_done(self, job: _Job, key: str, code: int) -> None:
        meta = job.meta
        where = self.chunk_of(meta, key) or (0, -1)
        block = self.block_of(meta, key)
        self.observe(PutDone(self.rank, meta.store_job_id, meta.req_id, NO_GENERATION, key,
                             where[0], where[1], -1 if block is None else block, "", code,
                             code == 0))
        if code == NO_AVAILABLE_HANDLE:
            self._skipped_since.setdefault(meta.req_id, float(self.plan_step))

    # -- the send thread -------------------------------------------------

    def job_started(self, thread: Any, meta: Any) -> _Job:
        job = _Job(meta)
        self.local.work = job
        live = thread.is_live_store_job(meta)
        job.skipped = live and thread._should_skip_request(meta.req_id)
        lcm = thread.coord.lcm_block_size
        job.token_len = meta.token_len_chunk // lcm * lcm
        job.save_start = thread._saved_offset.get(meta.req_id, 0) if live else 0
        job.live = live
        self.observe(JobStarted(self.rank, meta.store_job_id, meta.req_id, NO_GENERATION,
                                live, job.save_start, job.token_len, None, None))
        return job

    def job_finished(self, job: _Job) -> None:
        """Called inside the send thread's ``finish_store_job``, under ``lock``."""
        meta = job.meta
        # kvstate's executor is the reference producer of verdicts: a job
        # whose puts all succeeded holds every chunk of its range (found or
        # put); one with a failed put lists the puts that succeeded and
        # those that failed; one whose store call raised, the keys of that
        # call as failed.
        def chunks(keys: Iterable[str]) -> list[tuple[int, int]]:
            return [w for k in keys if (w := self.chunk_of(meta, k)) is not None]

        if job.raised:
            stored, failed = [], chunks(job.raised_keys)
        elif any(code != 0 for code in job.put.values()):
            stored = chunks(k for k, code in job.put.items() if code == 0)
            failed = chunks(k for k, code in job.put.items() if code != 0)
        else:
            stored = chunks(dict.fromkeys([*(k for k, there in job.present.items() if there),
                                           *job.put]))
            failed = []
        if not job.live:
            outcome = JobState.STALE
        elif job.skipped:
            outcome = JobState.SKIPPED
        elif job.raised or (failed and not stored):
            outcome = JobState.FAILED
        elif failed:
            outcome = JobState.PARTIALLY_STORED
        else:
            outcome = JobState.STORED
        full = {short_hash(_hash_bytes(h)): _hash_bytes(h) for h in meta.block_hashes}
        events = tuple(_event(e, full) for e in job.events)
        now = float(self.plan_step)
        since = self._skipped_since.get(meta.req_id) if outcome is JobState.SKIPPED else None
        if outcome is JobState.STORED and not failed:
            self._skipped_since.pop(meta.req_id, None)
        self._seq += 1
        self.observations.append(RankObservation(
            self.plan_step, self.shipped + 1, self.rank, self._seq,
            JobFinished(self.rank, meta.store_job_id, meta.req_id, NO_GENERATION,
                        outcome.value, job.save_start, job.token_len, tuple(sorted(stored)),
                        tuple(sorted(failed)), events, now, since)))
        self.reports.append(((self.plan_step, self.rank, self._seq), Report(
            meta.store_job_id, self.rank, meta.req_id, NO_GENERATION, outcome, UNKNOWN, events)))
        self.local.work = None

    # -- the receive threads ---------------------------------------------

    def load_finished(self, load: _Load) -> None:
        """Called inside the receive thread's ``set_finished_request``."""
        self.local.work = None
        self.observe(LoadDone(self.rank, load.meta.req_id, NO_GENERATION,
                              tuple(sorted(set(load.failed))),
                              tuple(sorted(set(load.reported)))))

    def take(self) -> tuple[list[RankObservation], list[Any], list[Any]]:
        """Everything seen so far; the caller holds ``lock``."""
        out = self.observations, self.reports, self.lookups
        self.observations, self.reports, self.lookups = [], [], []
        self.shipped += 1
        return out


def _tap_send_thread(thread: Any, tap: _RankTap) -> None:
    handle = thread._handle_request
    finish = thread.finish_store_job
    update_kv_event = thread.update_kv_event

    def handle_request(meta: Any) -> None:
        tap.job_started(thread, meta)
        try:
            handle(meta)
        finally:
            tap.local.work = None

    def finish_store_job(meta: Any) -> None:
        with tap.lock:
            job = tap.current()
            if isinstance(job, _Job) and job.meta is meta:
                tap.job_finished(job)
            finish(meta)

    def events(stored: list[Any]) -> None:
        job = tap.current()
        if isinstance(job, _Job):
            job.events.extend(stored)
        update_kv_event(stored)

    thread._handle_request = handle_request
    thread.finish_store_job = finish_store_job
    thread.update_kv_event = events


def _tap_recv_thread(thread: Any, tap: _RankTap) -> None:
    handle = thread._handle_request
    report = thread._report_load_error
    finished = thread.set_finished_request

    def handle_request(meta: Any) -> None:
        tap.local.work = _Load(meta)
        try:
            handle(meta)
        finally:
            tap.local.work = None

    def report_load_error(req_id: str, block_ids: list[int]) -> None:
        load = tap.current()
        if isinstance(load, _Load):
            load.reported.extend(block_ids)
        report(req_id, block_ids)

    def set_finished_request(req_id: str) -> None:
        load = tap.current()
        if isinstance(load, _Load):
            tap.load_finished(load)
        finished(req_id)

    thread._handle_request = handle_request
    thread._report_load_error = report_load_error
    thread.set_finished_request = set_finished_request


# ----------------------------------------------------------------------
# The connector.


def observer_options(extra: Any) -> ConnectorOptions:
    """Upstream's extra config plus ``kvstate_trace`` / ``kvstate_trace_layer``
    (``observed`` only: the observer knows no annotations) /
    ``kvstate_monitor``; the fields that configure kvstate's own protocol are
    refused by name."""
    options = ConnectorOptions.from_extra_config(extra)
    for field in NOT_FOR_THE_OBSERVER:
        if field in (extra or {}):
            raise ValueError(
                f"kv_connector_extra_config[{field!r}]={extra[field]!r}: the observer runs "
                "upstream's MooncakeStoreConnector, which decides this itself; use "
                "KvstateConnector to run kvstate's protocol")
    if "kvstate_trace_layer" in (extra or {}) and options.trace_layer != "observed":
        raise ValueError(
            f"kv_connector_extra_config['kvstate_trace_layer']={options.trace_layer!r}: the "
            "observer writes the observed layer only (it sees no kvstate internals)")
    return options


class ObservedMooncakeStoreConnector(MooncakeStoreConnector):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        transfer = vllm_config.kv_transfer_config
        self._options = observer_options(transfer.kv_connector_extra_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._kv_config = connector_config(vllm_config, kv_cache_config, self._options)
        self._groups = len(self._kv_config.groups)
        if self._groups != 1:
            # Upstream serves hybrid models; the observer has not been shown
            # to record them faithfully (store groups, window masks, Mamba
            # boundary puts), and a trace it cannot vouch for is worse than none.
            raise ValueError(
                f"ObservedMooncakeStoreConnector records models with one KV-cache group; "
                f"this one has {self._groups} (hybrid): run MooncakeStoreConnector itself")
        self._hash_algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "")
        self._log: EngineLog | None = None
        self._rank: _RankTap | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # -- scheduler role --------------------------------------------------

    def _init_scheduler(self) -> None:
        options = self._options
        self._log = EngineLog(
            self._kv_config, None, path=options.trace, monitor=options.monitor,
            header=lambda: trace_header(self._hash_algo,
                                        "vLLM MooncakeStoreConnector, observed by kvstate"),
            derive_generations=True, keep={"JobFinished": ("now", "skipped_since")},
            background=True)
        self._step = 0
        self._pool: _PoolTap | None = None
        self._requests: dict[str, Any] = {}
        self._sent_hashes: dict[str, int] = {}
        self._computed: dict[str, int] = {}  # num_computed_tokens at the lookup
        self._preempted: set[str] = set()
        # Preempted requests looked up again on re-admission: their next
        # generation starts at that lookup (`kvstate.derive`), so their
        # allocation is recorded, as KvstateConnector records it.
        self._relooked: set[str] = set()
        self._admitted: set[str] = set()  # allocated, not scheduled yet
        # Lookups answered to vLLM, waiting for rank 0's store answers:
        # (step, place in the order, request, tokens, hashes, hit).
        self._lookups: list[tuple[int, int, str, int, tuple[bytes, ...], int]] = []
        # Rank 0's answers not paired yet: (tokens, keys, present, hit).
        self._answers: list[tuple[int, tuple[str, ...], tuple[bool, ...], int]] = []
        self._events: list[Any] = []
        self._full_hashes: dict[int, bytes] = {}  # short_hash -> hash, from the reports
        # Per request: the block table and hash count its generation's last
        # job shipped (`_new_since`).
        self._shipped: dict[str, Shipped] = {}
        sched = self.connector_scheduler
        if sched is not None and getattr(sched, "client", None) is not None:
            client_lookup = sched.client.lookup

            def lookup(req_id: str, num_tokens: int, block_hashes: Any,
                       non_block: bool = False) -> Any:
                result = client_lookup(req_id, num_tokens, block_hashes, non_block=non_block)
                if result is not None and self._log is not None and self._log.active:
                    if req_id in self._preempted:
                        self._relooked.add(req_id)
                    self._lookups.append((self._step + 1, self._log.reserve(), req_id,
                                          num_tokens,
                                          tuple(_hash_bytes(h) for h in block_hashes),
                                          result.hit_length))
                    self._pair_lookups()
                return result

            sched.client.lookup = lookup  # type: ignore[method-assign]

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._pool = _PoolTap(gpu_block_pool)
        super().bind_gpu_block_pool(self._pool)  # type: ignore[arg-type]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        self._computed[request.request_id] = num_computed_tokens
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        log = self._log
        req_id = request.request_id
        self._requests[req_id] = request
        if log is None or not log.active or (req_id in self._preempted
                                             and req_id not in self._relooked):
            return  # a resumption: the step's record starts the generation
        if req_id in self._admitted and num_external_tokens == 0:
            return  # vLLM allocates again after an asynchronous load landed
        self._admitted.add(req_id)
        load_async = bool(self.connector_scheduler and self.connector_scheduler.load_async)
        log.scheduling(self._step + 1, Allocated(
            req_id, _table(blocks.get_block_ids(), self._groups),
            self._computed.pop(req_id, 0), num_external_tokens,
            load_async and num_external_tokens > 0))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        pool = self._pool
        if pool is not None:
            pool.take()
        meta: Any = super().build_connector_meta(scheduler_output)
        self._step += 1
        step = self._step
        meta.kvstate_step = step  # the plan's step, for the ranks' observations
        log = self._log
        if log is None or not log.active:
            return meta
        so = scheduler_output
        sched = scheduler_step(so, self._requests, self._sent_hashes, self._groups,
                               lambda req_id: req_id in self._preempted)
        decoding = {req_id: computed for req_id, computed in
                    zip(so.scheduled_cached_reqs.req_ids,
                        so.scheduled_cached_reqs.num_computed_tokens)
                    if req_id not in so.scheduled_cached_reqs.resumed_req_ids}
        saves: list[SaveMeta] = []
        loads: list[LoadMeta] = []
        shipped = self._shipped
        for req_id in (*sched.preempted, *sched.finished, *(r.req_id for r in sched.new),
                       *(r.req_id for r in sched.resumed)):
            shipped.pop(req_id, None)  # a new generation: its first job ships it whole
        for rm in meta.requests:
            if rm.can_save and rm.store_job_id is not None:
                prefill_end = rm.prefill_end_tokens or 0
                is_decode = rm.req_id in decoding and decoding[rm.req_id] >= prefill_end
                num_hashes = len(rm.block_hashes)
                bstart, hstart = _new_since(shipped.get(rm.req_id), rm.block_ids, num_hashes)
                shipped[rm.req_id] = _shipped(rm.block_ids, num_hashes)
                saves.append(SaveMeta(
                    rm.req_id, NO_GENERATION, rm.store_job_id, rm.token_ids_start,
                    rm.token_len_chunk, prefill_end, is_decode, bstart,
                    tuple(tuple(t[bstart:]) for t in rm.block_ids), hstart,
                    tuple(_hash_bytes(h) for h in rm.block_hashes[hstart:]),
                    None if rm.token_ids is None else tuple(rm.token_ids)))
            spec = rm.load_spec
            if spec is not None and spec.can_load:
                start = spec.vllm_cached_tokens // self._kv_config.block_size \
                    * self._kv_config.block_size
                loads.append(LoadMeta(rm.req_id, NO_GENERATION, start,
                                      spec.kvpool_cached_tokens,
                                      _table(rm.block_ids, self._groups),
                                      tuple(_hash_bytes(h) for h in rm.block_hashes)))
        pins, releases = pool.take() if pool is not None else ((), ())
        log.scheduling(step, StepScheduled(sched))
        log.scheduling(step, Planned(Plan(step, tuple(saves), tuple(loads), pins=pins,
                                          releases=releases)))
        for req_id in (*sched.preempted, *sched.finished):
            self._admitted.discard(req_id)
        self._preempted.difference_update(r.req_id for r in sched.resumed)
        self._relooked.difference_update(r.req_id for r in sched.resumed)
        self._preempted.update(sched.preempted)
        for req_id in (*(r.req_id for r in sched.new), *(r.req_id for r in sched.resumed)):
            self._admitted.discard(req_id)
        reused = {r.req_id for r in sched.new}
        for req_id in sched.finished:
            if req_id not in reused:
                self._preempted.discard(req_id)
                self._relooked.discard(req_id)
                self._sent_hashes.pop(req_id, None)
                self._requests.pop(req_id, None)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        observed = meta if isinstance(meta, ObservedWorkerMetadata) else None
        if observed is not None:
            connector_output.kv_connector_worker_meta = observed.inner
        pool = self._pool
        if pool is not None:
            pool.take()
        try:
            super().update_connector_output(connector_output)
        finally:
            if observed is not None:
                connector_output.kv_connector_worker_meta = observed
        # Events at quorum now, handed to vLLM by take_events (same events,
        # same call): the settlement names what it published.
        published = list(super().take_events())
        self._events.extend(published)
        log = self._log
        if log is None or not log.active:
            return
        step = self._step
        full = self._full_hashes
        if observed is not None:
            self._answers.extend(observed.lookups)
            self._pair_lookups()
            log.ranks(observed.observations)
            for _, report in observed.reports:
                for event in report.events:
                    for h in (*event.block_hashes, event.parent_block_hash):
                        if h is not None:
                            full[short_hash(h)] = h
        _, releases = pool.take() if pool is not None else ((), ())
        reports = [r for _, r in sorted(observed.reports, key=lambda r: r[0])] \
            if observed is not None else []
        for report in reports:
            log.settlement(step, ReportDelivered(report))
        if reports or releases or published:
            log.settlement(step, Settled(Settlement(
                releases=releases, published=tuple(_event(e, full) for e in published))))
        if len(full) > FULL_HASHES_KEPT:
            # Oldest first: an event still short of its quorum that long is
            # K3's business, not the map's.
            for stale in list(full)[:len(full) - FULL_HASHES_KEPT]:
                del full[stale]
        log.flush(step)

    def _pair_lookups(self) -> None:
        """Pair the scheduler's lookups with rank 0's store answers, in order
        (one lookup server answers them one at a time). Either may come
        first: a synchronous lookup's answers arrive in the step's worker
        metadata, after vLLM got the hit; an asynchronous one's may arrive a
        step before vLLM collects the hit."""
        log = self._log
        assert log is not None
        answers = self._answers
        waiting = []
        for pending in self._lookups:
            step, seq, req_id, asked, hashes, hit = pending
            match = next((i for i, answer in enumerate(answers) if answer[0] == asked), None)
            if match is None:
                waiting.append(pending)
                continue
            _, keys, present, _hit = answers.pop(match)
            log.scheduling(step, LookupDone(req_id, NO_GENERATION, asked, hashes, keys,
                                            present, hit), seq=seq)
        self._lookups = waiting
        # An answer no lookup claims (one the client abandoned) must not pair
        # with a later lookup of the same length for ever: keep the newest.
        del answers[:-ANSWERS_KEPT]

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        yield from events

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._computed.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    @property
    def violations(self) -> list[Any]:
        """What the online monitor found so far (``kvstate_monitor`` log/raise)."""
        return list(self._log.violations) if self._log is not None else []

    def shutdown(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not getattr(self, "_closed", False):
            self._closed = True
            log.close()
        super().shutdown()

    # -- worker role -----------------------------------------------------

    def _init_worker(self) -> None:
        worker = self.connector_worker
        assert worker is not None
        self._rank = tap = _RankTap(worker.tp_rank)
        self._recording = self._options.trace is not None or self._options.monitor != "off"
        lookup = worker.lookup

        def observed_lookup(num_tokens: int, block_hashes: Any) -> Any:
            work = _Lookup()
            tap.local.work = work
            try:
                result = lookup(num_tokens, block_hashes)
            finally:
                tap.local.work = None
            with tap.lock:
                tap.lookups.append((num_tokens, work.keys, work.present, result.hit_length))
            return result

        worker.lookup = observed_lookup  # type: ignore[method-assign]
        if getattr(worker, "store", None) is not None:
            worker.store = _StoreTap(worker.store, tap)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.connector_worker
        tap = self._rank
        assert worker is not None and tap is not None
        send = worker.kv_send_thread
        if send is not None:
            send.store = _StoreTap(send.store, tap) if not isinstance(
                send.store, _StoreTap) else send.store
            _tap_send_thread(send, tap)
        for recv in worker.kv_recv_threads or ():
            if not isinstance(recv.store, _StoreTap):
                recv.store = _StoreTap(recv.store, tap)
            _tap_recv_thread(recv, tap)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._rank is not None:
            step = getattr(connector_metadata, "kvstate_step", None)
            if step is not None:
                self._rank.plan_step = step

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        tap = self._rank
        if tap is None:
            return super().build_connector_worker_meta()
        # One hold of the lock: upstream's count of a finished job and the
        # job's report leave in the same metadata (`_tap_send_thread`).
        with tap.lock:
            inner = super().build_connector_worker_meta()
            observations, reports, lookups = tap.take()
        if inner is None and not (observations or reports or lookups or self._recording):
            return None  # a recording engine ships every step (KvstateConnector says why)
        return ObservedWorkerMetadata(inner, observations, reports, lookups)


__all__ = ["ObservedMooncakeStoreConnector", "ObservedWorkerMetadata"]
