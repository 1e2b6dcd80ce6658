"""Differential conformance: vLLM 0.33.0's shipped MooncakeStore bookkeeping against
kvstate's protocol variant ``e2``, step by step, on one schedule.

Theory of operation
-------------------
One small engine (``Engine``) plays vLLM's scheduler: it holds real vLLM
``Request`` objects (so block hashes are the engine's own sha256 chain), allocates
blocks through vLLM's own ``KVCacheManager`` (prefix caching off; one real
``BlockPool``) and, each step, writes the *same* schedule twice: as vLLM's
``SchedulerOutput`` (``NewRequestData`` / ``CachedRequestData``, preempted and
finished ids, the current block tables) and as kvstate's ``SchedulerStep``.

Two KV-cache groups (``Setup(sliding_window=W)``): full attention and a sliding
window of ``W`` tokens with one block size, the same config on both sides
(vLLM's ``KVCacheConfig`` with a ``SlidingWindowSpec`` group; kvstate's
``GroupSpec(SLIDING_WINDOW, W)``). vLLM's ``SlidingWindowManager`` frees the
blocks that left the window and nulls them in the request's table, so
upstream's jobs read (and pin) only what is still held. Between steps both
sides can look a prompt up (``Conformance.lookup``: upstream's
``MooncakeStoreWorker.lookup`` against kvstate's ``Planner.lookup`` /
``lookup_answered``: keys asked, answers, hit length) and lose a stored chunk
(``evict``).

Upstream side: the shipped ``MooncakeStoreConnector`` in the scheduler role (its
``MooncakeStoreScheduler`` pins through the real block pool), and per rank the
shipped connector and ``MooncakeStoreWorker`` methods (``wait_for_save``,
``get_finished``, ``build_connector_worker_meta``, the KV-event container) around a
``KVCacheStoreSendingThread`` that is never started: the harness pops its queue and
calls ``_handle_request`` itself, so every interleaving is the scenario's choice.
Worker outputs go through vLLM's own ``KVOutputAggregator``. The rank's Mooncake
client is a scripted in-memory store (``StoreClient``) that decodes each put's
buffer address back into the engine block it reads.

kvstate side: ``Planner`` and one ``Executor`` per rank, driven through their
sans-IO calls against an identical scripted store.

A step is: schedule → scheduler metadata → every rank takes it (enqueue, retire
ended requests) → the *send-thread window* (which rank runs how many jobs, which
blocked put returns: the scenario says) → worker metadata, aggregation, pin
releases and published events → sampled tokens, finishes. After every step the
harness compares, in causal order, save jobs, each rank's store calls (keys,
answers, blocks read), completions, emitted KV events, rank state (ledger, saved
offsets, skip set, pressure flag, retry suffix), pins, block reference counts and
published events, and records every difference as a ``Divergence`` naming the
step, the rank and the field. Job ids are normalised (upstream counts from 0,
kvstate from 1), and three named differences (specs/conformance.md): the order
of one step's published events (D1, ``strict_event_order``), the window
group's blocks vLLM freed as kvstate's planner still lists them in job tables,
pins and reference counts (D8, ``strict_window_tables``), and the order of
keys in one lookup call (D9). ``normalised`` counts how often D8 and D9 changed
what was compared.

F4 (kvstate's planner did not see vLLM free window blocks, so a retry read a
freed block) is fixed: the harness tells kvstate what each allocation freed
(``CachedRequest.freed_positions``), as the connector does from vLLM's
current tables. `AppendOnlyTablesPlanner` is the planner as it was, the
negative control; ``f4_explains`` names a divergence of F4's shape.
`RULE_MUTANTS` break one group rule each.

A put that blocks is the one place where a send thread must be *inside* a store
call while the engine keeps stepping. Upstream's job then runs on a helper thread
with a strict hand-off (the main thread waits until the job either finishes or
parks in the store), so only one side ever runs and the result stays
deterministic.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import attrs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (  # noqa: E402
    worker as upstream_worker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (  # noqa: E402
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (  # noqa: E402
    ChunkedTokenDatabase,
    KeyMetadata,
    MooncakeStoreWorkerMetadata,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (  # noqa: E402
    MooncakeStoreScheduler,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    KVConnectorBlockState,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec  # noqa: E402
from kvstate.executor import Executor, RankJob  # noqa: E402
from kvstate.keys import key_for, key_prefix  # noqa: E402
from kvstate.pins import PerJobPins  # noqa: E402
from kvstate.planner import Planner  # noqa: E402
from kvstate.records import (  # noqa: E402
    NULL_BLOCK_ID,
    CachedRequest,
    ExistsCall,
    NewRequest,
    PutCall,
    Report,
    ResumedRequest,
    SchedulerStep,
)
from kvstate.tables import PressureState  # noqa: E402
from kvstate.variants import FullMetadata, Variant, get_variant  # noqa: E402

MODEL = "tiny-llama"
# kvstate numbers store jobs from 1, vLLM from 0: kvstate id - JOB_ID_SHIFT = upstream id.
JOB_ID_SHIFT = 1
ALL = -1  # "run every queued job" in a send-thread window

init_none_hash(sha256)


# --------------------------------------------------------------------------
# Records.


@attrs.frozen(slots=True)
class Divergence:
    """The first place two implementations of one protocol part ways."""

    step: int
    rank: int | None
    field: str
    upstream: Any
    kvstate: Any

    def __str__(self) -> str:
        where = f"step {self.step}" + (f", rank {self.rank}" if self.rank is not None else "")
        return (f"{where}, {self.field}:\n  upstream: {self.upstream!r}\n"
                f"  kvstate:  {self.kvstate!r}")


@attrs.frozen(slots=True)
class Fault:
    """One scripted store answer: the ``nth`` call of ``op`` on ``rank`` (1-based,
    counted per side) answers ``code`` for every key, or only for key ``index``
    (a partial failure), or raises, or blocks until the scenario releases it."""

    op: str  # "exists" | "put"
    rank: int
    nth: int
    code: int = 0
    index: int | None = None
    raises: bool = False
    blocks: bool = False


@attrs.frozen(slots=True)
class StoreCall:
    op: str
    keys: tuple[str, ...]
    answers: tuple[Any, ...]  # exists: 1/0 per key; put: code per key; ("raised",) when it raised
    blocks: tuple[int, ...] = ()  # put: the engine block each key was read from


class StoreRaised(RuntimeError):
    """What a scripted store call raises (a failed RPC)."""


# --------------------------------------------------------------------------
# The scripted store: one backing per side, one client per rank.


class StoreBacking:
    """First write wins, like Mooncake; content is the engine block the put read."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.objects: dict[str, int] = {}
        self.faults = list(faults)
        self.counts: dict[tuple[str, int], int] = {}
        self.calls: dict[int, list[StoreCall]] = {}

    def fault_for(self, op: str, rank: int) -> Fault | None:
        n = self.counts[(op, rank)] = self.counts.get((op, rank), 0) + 1
        for fault in self.faults:
            if fault.op == op and fault.rank == rank and fault.nth == n:
                return fault
        return None

    def log(self, rank: int, call: StoreCall) -> None:
        self.calls.setdefault(rank, []).append(call)

    def exists(self, rank: int, keys: Sequence[str], fault: Fault | None) -> list[int]:
        if fault is not None and fault.raises:
            self.log(rank, StoreCall("exists", tuple(keys), ("raised",)))
            raise StoreRaised(f"scripted batch_is_exist failure on rank {rank}")
        answers = [1 if k in self.objects else 0 for k in keys]
        self.log(rank, StoreCall("exists", tuple(keys), tuple(answers)))
        return answers

    def put(self, rank: int, keys: Sequence[str], blocks: Sequence[int],
            fault: Fault | None) -> list[int]:
        if fault is not None and fault.raises:
            self.log(rank, StoreCall("put", tuple(keys), ("raised",), tuple(blocks)))
            raise StoreRaised(f"scripted batch_put failure on rank {rank}")
        codes = []
        for i, (key, block) in enumerate(zip(keys, blocks)):
            code = 0
            if fault is not None and (fault.index is None or fault.index == i):
                code = fault.code
            if code == 0:
                self.objects.setdefault(key, block)
            codes.append(code)
        self.log(rank, StoreCall("put", tuple(keys), tuple(codes), tuple(blocks)))
        return codes


class Gate:
    """A put that blocks: the store parks the caller until ``release``."""

    def __init__(self) -> None:
        self.parked = threading.Event()
        self.go = threading.Event()


class StoreClient:
    """Stands in for ``MooncakeDistributedStore`` on one upstream rank."""

    def __init__(self, backing: StoreBacking, rank: int) -> None:
        self.backing = backing
        self.rank = rank
        self.gate: Gate | None = None

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self.backing.exists(self.rank, keys, self.backing.fault_for("exists", self.rank))

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any
    ) -> list[int]:
        fault = self.backing.fault_for("put", self.rank)
        if fault is not None and fault.blocks:
            gate = self.gate = Gate()
            gate.parked.set()
            gate.go.wait()
            fault = None
        # The token database lays block b of every layer at address b (block_len 1).
        return self.backing.put(self.rank, keys, [a[0] for a in addrs], fault)


# --------------------------------------------------------------------------
# The engine: one schedule, written for both sides.


class EngineRequest:
    def __init__(self, req: Request, max_tokens: int) -> None:
        self.req = req
        self.max_tokens = max_tokens
        self.status = "waiting"  # waiting | running | preempted | finished
        self.resume = False
        self.sent_hashes = 0
        self.scheduled = 0  # tokens scheduled in the current step

    @property
    def req_id(self) -> str:
        return self.req.request_id


def sampled_token(req_id: str, position: int) -> int:
    """Deterministic "sampled" token ids (no global randomness)."""
    return (sum(map(ord, req_id)) * 7919 + position * 104729) % 31991 + 1


Tables = tuple[list[int], ...]  # one list of block ids per KV-cache group


@attrs.frozen(slots=True)
class Schedule:
    upstream: SchedulerOutput
    kvstate: SchedulerStep
    scheduled: tuple[str, ...]
    # The current block tables of the step's scheduled requests, as vLLM's
    # ``KVConnectorBlockState`` gives them to upstream (a sliding-window
    # group's blocks that left the window are the null block).
    tables: Mapping[str, Tables]


class Engine:
    """Waiting and running requests, chunked prefill under ``chunk`` tokens per
    request, one decode token per step; preemption, resumption and finishes
    happen when the scenario says. Blocks come from vLLM's own
    ``KVCacheManager`` (prefix caching off): one ``BlockPool``, whose reference
    counts the upstream scheduler's pins also move, and one single-type
    manager per KV-cache group, so a sliding-window group frees the blocks
    that left the window and nulls them in the request's table exactly as
    vLLM's ``SlidingWindowManager`` does (``remove_skipped_blocks`` before
    each allocation, and before a finished request is freed)."""

    def __init__(self, kv_config: KVCacheConfig, block_size: int, chunk: int) -> None:
        self.block_size = block_size
        self.chunk = chunk
        self.manager = KVCacheManager(kv_config, max_model_len=1 << 16,
                                      scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=False)
        self.pool = self.manager.block_pool
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.requests: dict[str, EngineRequest] = {}
        self.finished_ids: set[str] = set()

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int) -> Request:
        old = self.requests.get(req_id)
        if old is not None and old.status != "finished":
            raise ValueError(f"request {req_id!r} is still {old.status}")
        req = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens), None,
                      block_hasher=self.hasher)
        self.requests[req_id] = EngineRequest(req, max_tokens)
        return req

    def tables(self, req_id: str) -> Tables:
        """The request's current block tables (fresh lists)."""
        return self.manager.get_block_ids(req_id)

    def holdings(self) -> dict[int, int]:
        """What the engine itself holds per block: every non-null block of a
        running request's tables (kvstate's pins are compared on top)."""
        refs: dict[int, int] = {}
        for er in self.requests.values():
            if er.status != "running":
                continue
            for table in self.tables(er.req_id):
                for b in table:
                    if b != NULL_BLOCK_ID:
                        refs[b] = refs.get(b, 0) + 1
        return refs

    def _allocate(self, er: EngineRequest, num_new_tokens: int) -> Tables:
        """``allocate_slots`` for the step's tokens: frees what left a
        sliding window, then the new blocks of every group."""
        new = self.manager.allocate_slots(er.req, num_new_tokens)
        if new is None:
            raise RuntimeError(f"out of blocks allocating {num_new_tokens} tokens for "
                               f"{er.req_id!r}: raise Setup.num_blocks")
        return new.get_block_ids()

    def _free(self, er: EngineRequest) -> None:
        # vLLM frees tail first, group by group.
        self.manager.free(er.req)

    def schedule(self, preempt: Sequence[str], resume: Sequence[str],
                 on_admit: Callable[[Request, int], None]) -> Schedule:
        preempted: list[str] = []
        for req_id in preempt:
            er = self.requests[req_id]
            if er.status != "running":
                raise ValueError(f"cannot preempt {req_id!r}: it is {er.status}")
            self._free(er)
            er.status = "preempted"
            er.req.num_computed_tokens = 0
            preempted.append(req_id)
        for req_id in resume:
            er = self.requests[req_id]
            if er.status != "preempted":
                raise ValueError(f"cannot resume {req_id!r}: it is {er.status}")
            er.status = "running"
            er.resume = True

        new_up: list[NewRequestData] = []
        new_ks: list[NewRequest] = []
        cached_ids: list[str] = []
        resumed_ids: set[str] = set()
        cached_new_blocks: list[Tables | None] = []
        cached_computed: list[int] = []
        cached_ks: list[CachedRequest] = []
        resumed_ks: list[ResumedRequest] = []
        num_scheduled: dict[str, int] = {}
        # vLLM lists running requests before resumed ones in the cached data
        # (``Scheduler._make_cached_request_data``); the job-id order follows.
        order = [er for er in self.requests.values() if not er.resume]
        order += [er for er in self.requests.values() if er.resume]
        for er in order:
            req = er.req
            if er.status == "waiting":
                er.status = "running"
                n = min(self.chunk, req.num_tokens)
                self._allocate(er, n)
                on_admit(req, 0)
                num_scheduled[er.req_id] = n
                tables = self.tables(er.req_id)
                new_up.append(NewRequestData.from_request(req, tables))
                new_ks.append(NewRequest(
                    er.req_id, tuple(req.prompt_token_ids or ()), 0, n,
                    tuple(tuple(t) for t in tables), tuple(req.block_hashes)))
                er.sent_hashes = len(req.block_hashes)
            elif er.status == "running":
                computed = req.num_computed_tokens
                n = min(self.chunk, req.num_tokens - computed)
                before = self.tables(er.req_id)
                new_blocks = self._allocate(er, n)
                # What vLLM's sliding-window manager nulled (and freed) in
                # this allocation: told to kvstate with the request.
                freed = _freed_positions(before, self.tables(er.req_id))
                num_scheduled[er.req_id] = n
                cached_ids.append(er.req_id)
                cached_computed.append(computed)
                if er.resume:
                    er.resume = False
                    on_admit(req, 0)
                    resumed_ids.add(er.req_id)
                    tables = self.tables(er.req_id)
                    cached_new_blocks.append(tables)
                    resumed_ks.append(ResumedRequest(
                        er.req_id, tuple(req.all_token_ids), computed, n,
                        tuple(tuple(t) for t in tables), tuple(req.block_hashes)))
                    er.sent_hashes = len(req.block_hashes)
                    continue
                # ``get_block_ids(allow_none=True)``: None when no group grew.
                cached_new_blocks.append(new_blocks if any(new_blocks) else None)
                hashes = tuple(req.block_hashes[er.sent_hashes:])
                er.sent_hashes = len(req.block_hashes)
                cached_ks.append(CachedRequest(
                    er.req_id, computed, tuple(req.all_token_ids[computed:computed + n]),
                    tuple(tuple(t) for t in new_blocks), hashes, freed))
        cached = CachedRequestData(
            req_ids=cached_ids, resumed_req_ids=resumed_ids,
            new_token_ids=[[] for _ in cached_ids], all_token_ids={},
            new_block_ids=cached_new_blocks, num_computed_tokens=cached_computed,
            num_output_tokens=[self.requests[r].req.num_output_tokens for r in cached_ids])
        finished, self.finished_ids = self.finished_ids, set()
        scheduled = tuple(num_scheduled)
        current = {r: self.tables(r) for r in scheduled}
        block_state = KVConnectorBlockState(
            req_ids=set(scheduled),
            resolve_block_ids=lambda r: tuple(list(t) for t in current[r]),
            boundary_state_offloads={})
        upstream = SchedulerOutput(
            scheduled_new_reqs=new_up, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(finished), free_encoder_mm_hashes=[],
            preempted_req_ids=set(preempted), kv_connector_block_state=block_state)
        kvstate = SchedulerStep(
            new=tuple(new_ks), cached=tuple(cached_ks), resumed=tuple(resumed_ks),
            preempted=tuple(preempted), finished=tuple(sorted(finished)))
        for req_id, n in num_scheduled.items():
            self.requests[req_id].scheduled = n
        return Schedule(upstream, kvstate, scheduled, current)

    def after_step(self, scheduled: Sequence[str], finish: Sequence[str]) -> None:
        """The forward pass ran: computed tokens advance, a request whose known
        tokens are all computed samples one, and finished requests free their blocks."""
        for req_id in scheduled:
            er = self.requests[req_id]
            req = er.req
            req.num_computed_tokens += er.scheduled
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(sampled_token(req_id, req.num_tokens))
                if req.num_output_tokens >= er.max_tokens:
                    self._finish(er)
        for req_id in finish:
            er = self.requests[req_id]
            if er.status in ("running", "preempted"):
                self._finish(er)

    def _finish(self, er: EngineRequest) -> None:
        if er.status == "running":
            # ``Scheduler._connector_finished`` frees what left the window
            # first, then the request's blocks are freed.
            self.manager.remove_skipped_blocks(
                er.req_id, er.req.num_computed_tokens,
                num_prompt_tokens=er.req.num_prompt_tokens)
            self._free(er)
        er.status = "finished"
        self.finished_ids.add(er.req_id)


# --------------------------------------------------------------------------
# Upstream's worker role without a Mooncake client or a GPU.


class HostEvent:
    """Stands in for ``torch.cuda.Event`` (CPU tensors need no fence)."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def host_events() -> Iterator[None]:
    """``wait_for_save`` records a CUDA event per step; a CPU build raises on
    that, so the stand-in is installed only around the call."""
    saved = torch.cuda.Event
    torch.cuda.Event = HostEvent  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.cuda.Event = saved  # type: ignore[misc]


class HostWorker(upstream_worker.MooncakeStoreWorker):
    """``MooncakeStoreWorker`` with the attributes its save path and its
    ``lookup`` read, built without a Mooncake client (``__init__`` would dial
    a master). ``lookup`` is upstream's own, on the rank's scripted store."""

    def __init__(self, thread: upstream_worker.KVCacheStoreSendingThread, tp_rank: int,
                 setup: Setup, coord: Any, dbs: list[ChunkedTokenDatabase],
                 store: StoreClient) -> None:
        replication = (setup.put_step,) * len(dbs)
        self._capacity_only = False
        self.can_put = True
        self.load_async = True
        self.kv_recv_threads = []
        self.finished_store_req = set()
        self.kv_send_thread = thread
        self.tp_rank = tp_rank
        self.enable_kv_events = setup.kv_events
        self._group_tp_replication_factors = replication
        self._kv_connector_stats_lock = threading.Lock()
        self.kv_connector_stats = upstream_worker.MooncakeStoreConnectorStats()
        # What ``lookup`` reads (``register_kv_caches`` sets them upstream).
        self.store = store
        self.coord = coord
        self.token_dbs = dbs
        self._kv_cache_groups = coord.kv_cache_groups
        self.hash_block_size = setup.block_size
        self.tp_size = setup.world_size
        self.pcp_size = self.dcp_size = self.pp_size = 1
        self._init_lookup_key_prefixes()

    def close(self) -> None:
        pass


class UpstreamRank:
    def __init__(self, rank: int, coord: Any, setup: Setup, backing: StoreBacking) -> None:
        self.rank = rank
        self.client = StoreClient(backing, rank)
        dbs = []
        for g in range(setup.num_groups):
            db = ChunkedTokenDatabase(
                KeyMetadata(MODEL, rank // setup.put_step, 0, 0, 0, group_id=g),
                setup.block_size, setup.block_size)
            db.set_kv_caches_base_addr([0])
            db.set_block_len([1])
            dbs.append(db)
        self.thread = upstream_worker.KVCacheStoreSendingThread(
            self.client, coord, dbs, setup.block_size, rank,
            (setup.put_step,) * setup.num_groups, "kv_both",
            threading.Event(), enable_kv_event=setup.kv_events, replicate_config=object())
        self.worker = HostWorker(self.thread, rank, setup, coord, dbs, self.client)
        connector = MooncakeStoreConnector.__new__(MooncakeStoreConnector)
        connector.connector_worker = self.worker
        connector.connector_scheduler = None
        self.connector = connector
        self.blocked: threading.Thread | None = None
        self.raised: list[str] = []

    def run_job(self) -> bool:
        """Pop and handle one queued job; False if none (or the thread is parked)."""
        if self.blocked is not None or self.thread.request_queue.empty():
            return False
        meta = self.thread.request_queue.get_nowait()
        done = threading.Event()

        def handle() -> None:
            try:
                self.thread._handle_request(meta)
            except Exception as exc:  # the thread's run loop logs and carries on
                self.raised.append(f"{type(exc).__name__}: {exc}")
            finally:
                done.set()

        helper = threading.Thread(target=handle, daemon=True)
        self.client.gate = None
        helper.start()
        while not done.is_set():
            gate = self.client.gate
            if gate is not None and gate.parked.wait(0.001):
                self.blocked = helper
                return True
            done.wait(0.001)
        helper.join()
        return True

    def release(self) -> None:
        gate = self.client.gate
        if self.blocked is None or gate is None:
            raise ValueError(f"rank {self.rank} has no blocked put")
        gate.go.set()
        self.blocked.join()
        self.blocked = None
        self.client.gate = None


# --------------------------------------------------------------------------
# kvstate's side.


class KvstateRank:
    def __init__(self, executor: Executor, backing: StoreBacking) -> None:
        self.executor = executor
        self.backing = backing
        self.reports: list[Report] = []
        self.blocked: tuple[RankJob, PutCall] | None = None

    @property
    def rank(self) -> int:
        return self.executor.rank

    def run_job(self) -> bool:
        if self.blocked is not None:
            return False
        job = self.executor.dequeue()
        if job is None:
            return False
        self._drive(job, self.executor.start(job))
        return True

    def _drive(self, job: RankJob, out: Any) -> None:
        ex = self.executor
        while out is not None and not isinstance(out, Report):
            try:
                if isinstance(out, ExistsCall):
                    fault = self.backing.fault_for("exists", self.rank)
                    answers = self.backing.exists(self.rank, out.keys, fault)
                    out = ex.exists_answered(job, [a == 1 for a in answers])
                else:
                    assert isinstance(out, PutCall)
                    fault = self.backing.fault_for("put", self.rank)
                    if fault is not None and fault.blocks:
                        self.blocked = (job, out)
                        return
                    out = ex.put_answered(job, self.backing.put(self.rank, out.keys,
                                                                out.block_ids, fault))
            except StoreRaised as exc:
                out = ex.raised(job, str(exc))
        if out is not None:
            self.reports.append(out)

    def release(self) -> None:
        if self.blocked is None:
            raise ValueError(f"rank {self.rank} has no blocked put")
        job, call = self.blocked
        self.blocked = None
        codes = self.backing.put(self.rank, call.keys, call.block_ids, None)
        self._drive(job, self.executor.put_answered(job, codes))
        # A released thread goes on with its queue only when the window says so.

    def take_reports(self) -> list[Report]:
        out, self.reports = self.reports, []
        return out


# --------------------------------------------------------------------------
# kvstate's side with one rule changed: F4's proposed fix, and the group-rule
# mutants (specs/conformance.md, "Two KV-cache groups").


def _freed_positions(before: Tables, after: Tables) -> tuple[tuple[int, ...], ...]:
    """Per group, the positions that held a block before an allocation and
    the null block after it (empty when none did)."""
    freed = tuple(tuple(i for i, (b, a) in enumerate(zip(old, new))
                        if b != NULL_BLOCK_ID and a == NULL_BLOCK_ID)
                  for old, new in zip(before, after))
    return freed if any(freed) else ()


class AppendOnlyTablesPlanner(Planner):
    """F4 as found: the planner before it was told what vLLM freed
    (``CachedRequest.freed_positions`` ignored), so its tables still list
    the sliding-window blocks vLLM freed and a retry's job reads them. Kept
    as the negative control of the fix."""

    def _forget_freed(self, tracker: Any, freed: Sequence[Sequence[int]]) -> None:
        pass


class WindowLookupAsFull(Planner):
    """Mutant: the sliding-window group is looked up with full attention's
    rule (a hit needs every chunk from 0 held in every group) instead of
    ``SlidingWindowManager.find_longest_cache_hit``'s (the ``need`` chunks
    before an aligned boundary). The rule lives in ``Planner._longest_hit``'s
    spec groups."""

    def __init__(self, config: ConnectorConfig, variant: Variant) -> None:
        super().__init__(config, variant)
        self._spec_groups = [(tuple(range(len(config.groups))), None)]
        self._simple_hybrid = False


def _without_group(prefix: str) -> str:
    return prefix.rsplit("@group:", 1)[0]


class KeyWithoutGroupPlanner(Planner):
    """Mutant (lookups): keys without their ``@group:g`` segment."""

    def __init__(self, config: ConnectorConfig, variant: Variant) -> None:
        super().__init__(config, variant)
        self._lookup_prefixes = [[_without_group(p) for p in ps] for ps in self._lookup_prefixes]


class KeyWithoutGroupExecutor(Executor):
    """Mutant (puts): keys without their ``@group:g`` segment, so every group
    of a chunk shares one key. The rule lives in ``kvstate.keys.key_prefix``."""

    def __init__(self, config: ConnectorConfig, rank: int, variant: Variant) -> None:
        super().__init__(config, rank, variant)
        self.prefixes = [_without_group(p) for p in self.prefixes]


class WindowEventsAsGroupZero(Executor):
    """Mutant: every ``BlockStored`` names group 0 (a consumer indexing the
    store by group would file the window's chunks under full attention). The
    rule lives in ``Executor._events``."""

    def _events(self, job: RankJob, status: Sequence[int]) -> tuple[Any, ...]:
        return tuple(attrs.evolve(e, group_idx=0) for e in super()._events(job, status))


class FullGroupOnlyPins(PerJobPins):
    """Mutant: a job pins only the full-attention group's blocks, so the
    window blocks it reads may be freed and reused under it."""

    name = "per-job-full-group-only"

    def on_job(self, tracker: Any, book: Any, token_len: int, block_size: int,
               pins: list[int]) -> None:
        book.pinned = [b for b in tracker.block_ids[0] if b != NULL_BLOCK_ID]
        pins.extend(book.pinned)


class WindowBlocksKeptOnRanks(FullMetadata):
    """Mutant: each rank keeps its own copy of a request's tables and a null
    block in a job's table does not overwrite the block it knew, so a rank
    reads (and stores) a window block vLLM freed when it left the window.
    The rule lives in the metadata policy's ``resolve`` and the executor's
    null-block skip; it shows only where job tables carry the null block
    (as they do since F4's fix). One instance per run (it holds the copies)."""

    name = "full-keeping-freed-window-blocks"

    def __init__(self) -> None:
        self.known: dict[tuple[str, int, int], list[list[int]]] = {}

    def resolve(self, entry: Any, meta: Any) -> tuple[Sequence[Sequence[int]], Sequence[bytes]]:  # type: ignore[override]
        key = (meta.req_id, meta.generation, id(entry))
        old = self.known.get(key)
        tables = [list(t) for t in meta.block_ids]
        if old is not None:
            for table, before in zip(tables, old):
                for i, b in enumerate(table):
                    if b == NULL_BLOCK_ID and i < len(before):
                        table[i] = before[i]
        self.known[key] = tables
        return tables, meta.block_hashes


@attrs.frozen
class RuleMutant:
    """A kvstate side with one group rule broken, and the harness field where
    it must be told apart from upstream (its first divergence)."""

    name: str
    rule: str  # where the rule lives in kvstate
    field: str
    changes: Callable[[], dict[str, Any]] = dict  # Variant fields changed from e2 (fresh per run)
    planner_cls: type[Planner] = Planner
    executor_cls: type[Executor] = Executor

    def variant(self) -> Variant:
        return attrs.evolve(get_variant("e2"), name=self.name,
                            summary=f"e2 with {self.rule} broken", **self.changes())

    def run(self, setup: Setup, faults: Sequence[Fault] = (), **kwargs: Any) -> Conformance:
        return Conformance(setup, self.variant(), faults, planner_cls=self.planner_cls,
                           executor_cls=self.executor_cls, **kwargs)


RULE_MUTANTS: dict[str, RuleMutant] = {m.name: m for m in (
    RuleMutant("window-lookup-as-full", "the window group's lookup rule (Planner._longest_hit)",
               "lookup hit", planner_cls=WindowLookupAsFull),
    RuleMutant("key-without-group", "the @group:g key segment (kvstate.keys.key_prefix)",
               "store calls", planner_cls=KeyWithoutGroupPlanner,
               executor_cls=KeyWithoutGroupExecutor),
    RuleMutant("window-stores-freed-blocks",
               "the skip of a window block vLLM freed (metadata resolve, Executor.start)",
               "store calls", lambda: {"metadata": WindowBlocksKeptOnRanks()}),
    RuleMutant("window-events-as-group-0", "each event's group (Executor._events)",
               "emitted KV events", executor_cls=WindowEventsAsGroupZero),
    RuleMutant("window-blocks-unpinned", "every group's blocks pinned (the pin policy)",
               "pins", lambda: {"pins": FullGroupOnlyPins()}),
)}


# --------------------------------------------------------------------------
# Normalised views (what is compared).


def _hash(h: bytes | None) -> Any:
    return None if h is None else maybe_convert_block_hash(BlockHash(h))


def upstream_event(e: Any) -> tuple[Any, ...]:
    return (tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size,
            e.group_idx, e.medium)


def kvstate_event(e: Any) -> tuple[Any, ...]:
    return (tuple(_hash(h) for h in e.block_hashes), _hash(e.parent_block_hash),
            tuple(e.token_ids), e.block_size, e.group_idx, e.medium)


def upstream_job(m: ReqMeta, hash_block: int) -> tuple[Any, ...]:
    return (m.store_job_id, m.req_id, m.token_ids_start, m.token_len_chunk,
            tuple(tuple(g) for g in m.block_ids),
            tuple(h.hex() for h in m.block_hashes[:m.token_len_chunk // hash_block]),
            None if m.token_ids is None else tuple(m.token_ids), m.prefill_end_tokens)


def kvstate_job(m: Any, hash_block: int) -> tuple[Any, ...]:
    hashes = m.block_hashes[:m.token_len // hash_block]
    return (m.job_id - JOB_ID_SHIFT, m.req_id, m.token_ids_start, m.token_len,
            tuple(tuple(g) for g in m.block_ids), tuple(h.hex() for h in hashes),
            None if m.token_ids is None else tuple(m.token_ids), m.num_prompt_tokens)


JOB_FIELDS = ("job", "request", "token_ids_start", "token_len", "block_ids", "hashes",
              "token snapshot", "prefill_end")


def upstream_rank_state(t: Any) -> dict[str, Any]:
    return {
        "ledger": {r: tuple(sorted(jobs)) for r, jobs in sorted(t.stored_requests.items())},
        "saved offset": {r: o for r, o in sorted(t._saved_offset.items()) if o},
        "skip set": tuple(sorted(t._skip_store_requests)),
        "pressure": t._store_pressure_active,
        "retry suffix": {r: (s, tuple(ids)) for r, (s, ids) in sorted(t._retry_token_ids.items())},
    }


def kvstate_rank_state(ex: Executor) -> dict[str, Any]:
    entries = ex.ledger.entries  # type: ignore[attr-defined]
    retry = {r: (e.retry[0], tuple(e.retry[1])) for r, e in entries.items() if e.retry is not None}
    # A variant may keep retry state outside the ledger (keyed by request id).
    retry.update((r, (v[0], tuple(v[1]))) for r, v in ex.retry_by_request.items())
    return {
        "ledger": {r: tuple(sorted(j - JOB_ID_SHIFT for j in e.live))
                   for r, e in sorted(entries.items())},
        "saved offset": {r: e.saved_offset for r, e in sorted(entries.items()) if e.saved_offset},
        "skip set": tuple(sorted(e.req_id for e in ex.skipped)),
        "pressure": ex.pressure is PressureState.PRESSURED,
        "retry suffix": dict(sorted(retry.items())),
    }


# --------------------------------------------------------------------------
# The run.


@attrs.frozen(slots=True)
class Setup:
    world_size: int = 1
    put_step: int = 1
    block_size: int = 16
    save_decode_cache: bool = False
    kv_events: bool = False
    chunk: int = 1 << 20  # prefill tokens per request per step
    num_blocks: int = 128
    # A hybrid model: group 0 full attention, group 1 a sliding window of this
    # many tokens, one block size (None: one full-attention group).
    sliding_window: int | None = None
    # vLLM's ``KVCacheConfig.prefix_cache_retention_interval``: None (vLLM's
    # default) keeps a window tail at every aligned boundary, 0 only the
    # prompt's replay tail. kvstate models None only (specs/conformance.md, D7).
    retention_interval: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 2:
            # vLLM needs no block for a window of 1 (upstream then stores none of
            # the group); kvstate's ``blocks_needed_for_hit`` keeps one.
            raise ValueError(f"Setup.sliding_window={self.sliding_window}: at least 2")

    @property
    def num_groups(self) -> int:
        return 1 if self.sliding_window is None else 2

    @property
    def window_groups(self) -> tuple[int, ...]:
        return () if self.sliding_window is None else (1,)


def vllm_config(setup: Setup) -> VllmConfig:
    """A VllmConfig without a model: the store connector's scheduler role reads
    only the transfer, events, parallel and cache configs."""
    extra = {"save_decode_cache": setup.save_decode_cache, "enable_lookup": False}
    return VllmConfig(
        cache_config=CacheConfig(block_size=setup.block_size),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=64,
                                         max_model_len=4096, is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeStoreConnector",
                                            kv_role="kv_both", kv_connector_extra_config=extra),
        parallel_config=ParallelConfig(tensor_parallel_size=setup.world_size),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=setup.kv_events),
    )


def kv_cache_config(setup: Setup) -> KVCacheConfig:
    """One full-attention group; with ``sliding_window``, a second group with
    that window and the same block size (what vLLM's hybrid KV-cache manager
    makes of a Gemma-like model)."""
    spec = FullAttentionSpec(block_size=setup.block_size, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer.0"], spec)]
    if setup.sliding_window is not None:
        window: KVCacheSpec = SlidingWindowSpec(
            block_size=setup.block_size, num_kv_heads=1, head_size=8, dtype=torch.float32,
            sliding_window=setup.sliding_window)
        groups.append(KVCacheGroupSpec(["layer.1"], window))
    return KVCacheConfig(num_blocks=setup.num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=groups,
                         prefix_cache_retention_interval=setup.retention_interval)


def connector_config(setup: Setup) -> ConnectorConfig:
    """kvstate's configuration of the same model."""
    groups = [GroupSpec()]
    if setup.sliding_window is not None:
        groups.append(GroupSpec(GroupKind.SLIDING_WINDOW, setup.sliding_window))
    return ConnectorConfig(
        block_size=setup.block_size, world_size=setup.world_size, put_step=setup.put_step,
        save_decode_cache=setup.save_decode_cache, enable_kv_events=setup.kv_events,
        model_name=MODEL, groups=tuple(groups))


class DivergenceError(AssertionError):
    pass


class Conformance:
    """See the module docstring. ``variant`` is the kvstate protocol to compare
    (``e2`` by default; a mutant for negative controls); ``planner_cls`` and
    ``executor_cls`` replace kvstate's planner or executor by a patched one (the
    group-rule mutants, `RULE_MUTANTS`, and F4 as found,
    `AppendOnlyTablesPlanner`). ``strict_event_order`` also compares the order of
    the events one step publishes, ``strict_window_tables`` the window group's
    blocks vLLM freed in job tables, pins and reference counts (two known,
    deliberate differences: specs/conformance.md, D1 and D8)."""

    def __init__(self, setup: Setup = Setup(), variant: str | Variant = "e2",
                 faults: Sequence[Fault] = (), *, strict_event_order: bool = False,
                 strict_window_tables: bool = False,
                 planner_cls: type[Planner] = Planner,
                 executor_cls: type[Executor] = Executor) -> None:
        self.setup = setup
        self.strict_event_order = strict_event_order
        self.strict_window_tables = strict_window_tables
        self.variant = get_variant(variant) if isinstance(variant, str) else variant
        kv_config = kv_cache_config(setup)
        self.engine = Engine(kv_config, setup.block_size, setup.chunk)
        self.step_no = 0
        self.divergences: list[Divergence] = []
        self.upstream_dead = False
        self.published_upstream: list[tuple[Any, ...]] = []
        self.published_kvstate: list[tuple[Any, ...]] = []
        self.pins_released: dict[int, int] = {}  # upstream job id -> step released
        self.thread_exceptions: list[tuple[int, int, str]] = []
        # kvstate's save jobs per step, normalised (see ``kvstate_job``), for asserts.
        self.save_jobs: dict[int, list[tuple[Any, ...]]] = {}
        # How often each named normalisation changed what was compared.
        self.normalised: dict[str, int] = {}
        # Lookups compared so far: (after step, upstream hit, kvstate hit).
        self.lookups: list[tuple[int, int, int]] = []

        vc = vllm_config(setup)
        self.connector = MooncakeStoreConnector(vc, KVConnectorRole.SCHEDULER, kv_config)
        scheduler = self.connector.connector_scheduler
        assert scheduler is not None
        self.scheduler: MooncakeStoreScheduler = scheduler
        self.scheduler.bind_gpu_block_pool(self.engine.pool)
        self.aggregator = KVOutputAggregator(setup.world_size)
        self.store_up = StoreBacking(faults)
        self.store_ks = StoreBacking(faults)
        coord = self.scheduler._store_coord
        self.up_ranks = [UpstreamRank(r, coord, setup, self.store_up)
                         for r in range(setup.world_size)]

        self.config = connector_config(setup)
        self.planner_cls = planner_cls
        self.planner = planner_cls(self.config, self.variant)
        self.ks_ranks = [KvstateRank(executor_cls(self.config, r, self.variant), self.store_ks)
                         for r in range(setup.world_size)]
        self.ks_refs: dict[int, int] = {}  # kvstate's pins per block
        # D8: per kvstate job, the window-group blocks its table lists where
        # vLLM's current table holds the null block (freed: left the window).
        self.freed_in_job: dict[int, tuple[int, set[int]]] = {}

    def close(self) -> None:
        for rank in self.up_ranks:
            if rank.blocked is not None:
                rank.release()
        self.scheduler.client.close()

    # ------------------------------------------------------------------

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 1) -> None:
        """A client submits a request (an id may be reused once it finished)."""
        self.engine.add(req_id, prompt, max_tokens)

    def step(
        self,
        *,
        jobs: int | Mapping[int, int] = ALL,
        release: Sequence[int] = (),
        preempt: Sequence[str] = (),
        resume: Sequence[str] = (),
        finish: Sequence[str] = (),
    ) -> list[Divergence]:
        """One engine step. ``jobs``: how many queued jobs each rank's send thread
        runs in this step's window (``ALL``, or per rank; a rank not named runs
        none — it lags). ``release``: ranks whose blocked put returns first.
        ``preempt``/``resume`` take effect at scheduling, ``finish`` (an abort)
        after the forward pass."""
        self.step_no += 1
        step = self.step_no
        found: list[Divergence] = []
        sched = self.engine.schedule(
            preempt, resume, lambda req, n: self._admit_upstream(req))

        # Scheduler metadata.
        meta = self._guard(found, "build_connector_meta",
                           lambda: self.connector.build_connector_meta(sched.upstream))
        plan = self.planner.step(sched.kvstate)
        for b in plan.pins:
            self.ks_refs[b] = self.ks_refs.get(b, 0) + 1
        hb = self.setup.block_size
        up_jobs = [upstream_job(m, hb) for m in meta.requests if m.can_save] if meta else []
        ks_jobs = [kvstate_job(m, hb) for m in plan.saves]
        self.save_jobs[step] = ks_jobs
        if self.setup.window_groups and not self.strict_window_tables:
            ks_jobs = [self._window_tables(m, job, sched.tables)
                       for m, job in zip(plan.saves, ks_jobs)]
        self._compare_jobs(found, step, up_jobs, ks_jobs)

        # Every rank takes the step's metadata.
        finished_ids = set(sched.upstream.finished_req_ids)
        for up, ks in zip(self.up_ranks, self.ks_ranks):
            if meta is not None:
                rank_meta = copy.deepcopy(meta)  # each worker gets its own copy over IPC
                up.connector._connector_metadata = rank_meta
                with host_events():
                    self._guard(found, f"rank {up.rank} wait_for_save", up.connector.wait_for_save)
                self._guard(found, f"rank {up.rank} get_finished",
                            functools.partial(up.connector.get_finished, finished_ids))
            ks.executor.receive(plan)

        # The send-thread window.
        for up, ks in zip(self.up_ranks, self.ks_ranks):
            if up.rank in release:
                up.release()
                ks.release()
            budget = jobs if isinstance(jobs, int) else jobs.get(up.rank, 0)
            ran = 0
            while budget == ALL or ran < budget:
                a, b = up.run_job(), ks.run_job()
                if not a and not b:
                    break
                ran += 1

        # Worker metadata back to the scheduler.
        outputs = []
        ks_reports: list[Report] = []
        for up, ks in zip(self.up_ranks, self.ks_ranks):
            rank = up.rank
            self._compare(found, step, rank, "store calls",
                          self.store_up.calls.pop(rank, []), self.store_ks.calls.pop(rank, []))
            # An exception out of upstream's exists check escapes ``_handle_request``
            # to the thread's run loop, which logs it (the job still reports from its
            # ``finally``); kvstate turns it into a RAISED outcome. Kept for asserts.
            self.thread_exceptions += [(step, rank, msg) for msg in up.raised]
            up.raised = []
            worker_meta = up.connector.build_connector_worker_meta()
            events = up.connector.get_kv_connector_kv_cache_events()
            reports = ks.take_reports()
            ks_reports.extend(reports)
            assert worker_meta is None or isinstance(worker_meta, MooncakeStoreWorkerMetadata)
            up_done = dict(sorted((worker_meta.completed_saves if worker_meta else {}).items()))
            ks_done: dict[int, int] = {}
            for r in reports:
                ks_done[r.job_id - JOB_ID_SHIFT] = ks_done.get(r.job_id - JOB_ID_SHIFT, 0) + 1
            self._compare(found, step, rank, "completions", up_done, dict(sorted(ks_done.items())))
            up_events = [upstream_event(e) for e in events.get_all_events()] if events else []
            ks_events = [kvstate_event(e) for r in reports for e in r.events]
            self._compare(found, step, rank, "emitted KV events", sorted(up_events, key=repr),
                          sorted(ks_events, key=repr))
            up_state = upstream_rank_state(up.thread)
            ks_state = kvstate_rank_state(ks.executor)
            for name in up_state:
                self._compare(found, step, rank, name, up_state[name], ks_state[name])
            outputs.append(SimpleNamespace(kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=worker_meta, kv_cache_events=events)))
        merged = self.aggregator.aggregate(outputs)  # type: ignore[arg-type]
        before = set(self.scheduler._pinned_saves)
        merged_output = merged.kv_connector_output if merged is not None else None
        if merged_output is not None and meta is not None:
            self._guard(found, "update_connector_output",
                        functools.partial(self.connector.update_connector_output, merged_output))
        for job in before - set(self.scheduler._pinned_saves):
            self.pins_released[job] = step
        up_published = [upstream_event(e) for e in self.connector.take_events()]
        settlement = self.planner.on_reports(ks_reports)
        for b in settlement.releases:
            self.ks_refs[b] -= 1
        for job_id in settlement.released_jobs:
            self.freed_in_job.pop(job_id, None)
        ks_published = [kvstate_event(e) for e in settlement.published]
        self.published_upstream += up_published
        self.published_kvstate += ks_published

        self._compare(found, step, None, "pins", self._upstream_pins(), self._kvstate_pins())
        if not self.strict_event_order:
            # Within one step's batch upstream publishes in order of each event's
            # first report, e2 in order of quorum completion (specs/conformance.md).
            up_published, ks_published = sorted(up_published, key=repr), sorted(
                ks_published, key=repr)
        self._compare(found, step, None, "published KV events", up_published, ks_published)

        self.engine.after_step(sched.scheduled, finish)
        self._compare(found, step, None, "block reference counts", self._upstream_refs(),
                      self._kvstate_refs())
        self.divergences.extend(found)
        return found

    def steps(self, n: int, **kwargs: Any) -> None:
        for _ in range(n):
            self.step(**kwargs)

    # ------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int]:
        """Both sides look a prompt up in their store as it is now (between
        steps), as vLLM's scheduler would on admitting it: upstream's
        ``MooncakeStoreWorker.lookup`` on rank 0 (what its lookup server
        runs), kvstate's ``Planner.lookup`` and ``lookup_answered`` on a
        planner of its own (the run's planner keeps no state of it). Compared:
        the keys asked with their answers, as a set (D9: the order of keys in
        one ``batch_is_exist`` is not compared), and the hit length. Returns
        (upstream hit, kvstate hit)."""
        step = self.step_no
        probe = "lookup-probe"
        req = Request(probe, list(tokens), SamplingParams(max_tokens=1), None,
                      block_hasher=self.engine.hasher)
        hashes = list(req.block_hashes)
        for rank in (0,):
            self.store_up.calls.pop(rank, None)
            self.store_ks.calls.pop(rank, None)
        up_hit = self.up_ranks[0].worker.lookup(req.num_tokens, hashes).hit_length
        planner = self.planner_cls(self.config, self.variant)
        query = planner.lookup(probe, req.num_tokens, tuple(hashes))
        present: list[bool] = []
        if query.keys:
            try:
                answers = self.store_ks.exists(0, query.keys, self.store_ks.fault_for("exists", 0))
                present = [a == 1 for a in answers]
            except StoreRaised:  # KvstateConnector: a failed lookup is a miss
                present = [False] * len(query.keys)
        ks_hit = planner.lookup_answered(query, present)
        found: list[Divergence] = []

        def asked(calls: list[StoreCall]) -> list[tuple[str, Any]]:
            return sorted((k, a) for c in calls for k, a in zip(c.keys, c.answers))

        up_calls, ks_calls = self.store_up.calls.pop(0, []), self.store_ks.calls.pop(0, [])
        if [c.keys for c in up_calls] != [c.keys for c in ks_calls]:
            self.normalised["lookup key order"] = self.normalised.get("lookup key order", 0) + 1
        self._compare(found, step, 0, "lookup keys", asked(up_calls), asked(ks_calls))
        self._compare(found, step, 0, "lookup hit", up_hit, ks_hit)
        self.divergences.extend(found)
        self.lookups.append((step, up_hit, ks_hit))
        return up_hit, ks_hit

    def evict(self, tokens: Sequence[int], chunk: int, group: int) -> list[str]:
        """Remove one chunk of one group (every rank's namespace) from both
        stores, as Mooncake evicting it would; returns the keys removed."""
        req = Request("evict-probe", list(tokens), SamplingParams(max_tokens=1), None,
                      block_hasher=self.engine.hasher)
        digest = req.block_hashes[chunk].hex()
        keys = [key_for(key_prefix(self.config, ns * self.config.put_step, group), digest)
                for ns in range(self.config.num_namespaces)]
        self.evict_keys(keys)
        return keys

    def evict_keys(self, keys: Sequence[str]) -> None:
        """Remove keys from both stores (each must be in both)."""
        for key in keys:
            if key not in self.store_up.objects or key not in self.store_ks.objects:
                raise ValueError(f"evict: {key} is not in both stores")
            del self.store_up.objects[key]
            del self.store_ks.objects[key]

    def _window_tables(self, meta: Any, job: tuple[Any, ...],
                       current: Mapping[str, Tables]) -> tuple[Any, ...]:
        """D8: kvstate's job table with the window-group blocks vLLM freed
        (the current table holds the null block there) nulled, as upstream's
        ``_apply_current_save_block_ids`` sees them; remembers where they sit
        among the job's non-null blocks, for its pins and the reference
        counts. Anything else in the table is compared as it is."""
        now = current.get(meta.req_id)
        if now is None:
            return job
        tables = [list(t) for t in job[4]]
        freed: set[int] = set()  # indexes among the table's non-null blocks, group-major
        flat = 0
        for g, table in enumerate(tables):
            for i, b in enumerate(table):
                if b == NULL_BLOCK_ID:
                    continue
                pos = meta.block_ids_start + i
                if g in self.setup.window_groups and pos < len(now[g]) and \
                        now[g][pos] == NULL_BLOCK_ID:
                    table[i] = NULL_BLOCK_ID
                    freed.add(flat)
                flat += 1
        if not freed:
            return job
        self.freed_in_job[meta.job_id] = (flat, freed)
        self.normalised["window tables"] = self.normalised.get("window tables", 0) + len(freed)
        return (*job[:4], tuple(tuple(t) for t in tables), *job[5:])

    def _pinned(self, job_id: int, pinned: Sequence[int]) -> list[int]:
        """A kvstate job's pins less its D8 blocks. ``e2`` pins every
        non-null block of the job's table, group-major, so pin ``i`` is the
        table's ``i``-th non-null block; pins of any other shape are left as
        they are (and compared so)."""
        entry = self.freed_in_job.get(job_id)
        if entry is None or len(pinned) != entry[0]:
            return list(pinned)
        return [b for i, b in enumerate(pinned) if i not in entry[1]]

    def _admit_upstream(self, req: Request) -> None:
        # vLLM calls these for every request it admits from the waiting queue
        # (new or resumed); lookups are off, so nothing is external.
        self.connector.get_num_new_matched_tokens(req, 0)
        self.connector.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]

    def _guard(self, found: list[Divergence], what: str, call: Callable[[], Any]) -> Any:
        if self.upstream_dead:
            return None
        try:
            return call()
        except Exception as exc:  # an upstream crash is a divergence, not a harness error
            self.upstream_dead = True
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}"
            found.append(Divergence(
                self.step_no, None, f"upstream {what} raised",
                f"{type(exc).__name__}: {exc} at {where}: {frame.line}", "no exception"))
            return None

    def _compare(self, found: list[Divergence], step: int, rank: int | None, field: str,
                 upstream: Any, kvstate: Any) -> None:
        if upstream != kvstate and not self.upstream_dead:
            found.append(Divergence(step, rank, field, upstream, kvstate))

    def _compare_jobs(self, found: list[Divergence], step: int, up: list[tuple[Any, ...]],
                      ks: list[tuple[Any, ...]]) -> None:
        if self.upstream_dead:
            return
        if len(up) != len(ks):
            found.append(Divergence(step, None, "save jobs", up, ks))
            return
        for u, k in zip(up, ks):
            for name, a, b in zip(JOB_FIELDS, u, k):
                if a != b:
                    found.append(Divergence(step, None, f"save job {u[0]} ({u[1]}) {name}", a, b))

    def _upstream_pins(self) -> dict[int, tuple[tuple[int, ...], int]]:
        return {j: (tuple(b), n) for j, (b, n) in sorted(self.scheduler._pinned_saves.items())}

    def _kvstate_pins(self) -> dict[int, tuple[tuple[int, ...], int]]:
        world = self.setup.world_size
        out = {}
        for j, book in sorted(self.planner.jobs.items()):
            pinned = self._pinned(j, book.pinned)
            if pinned:
                out[j - JOB_ID_SHIFT] = (tuple(pinned), world - len(book.ranks))
        return out

    def _upstream_refs(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.engine.pool.blocks[1:] if b.ref_cnt}

    def _kvstate_refs(self) -> dict[int, int]:
        refs = self.engine.holdings()
        for b, n in self.ks_refs.items():
            refs[b] = refs.get(b, 0) + n
        for j in self.freed_in_job:  # D8: pins of blocks vLLM freed
            book = self.planner.jobs.get(j)
            if book is not None:
                for b in book.pinned:
                    refs[b] -= 1
                for b in self._pinned(j, book.pinned):
                    refs[b] += 1
        return {b: n for b, n in sorted(refs.items()) if n}

    # ------------------------------------------------------------------

    def f4_explains(self, d: Divergence) -> bool:
        """Whether ``d`` is F4's divergence: store calls that differ only by
        window-group chunks kvstate's rank asked for or put (their keys,
        answers and blocks) where upstream's job skipped them as the null
        block (specs/conformance.md, F4). Nothing else is explained by it."""
        if d.field != "store calls" or len(d.upstream) != len(d.kvstate):
            return False
        marks = tuple(f"@group:{g}@" for g in self.setup.window_groups)
        extra = False
        for up, ks in zip(d.upstream, d.kvstate):
            if up.op != ks.op:
                return False
            keep = [i for i, k in enumerate(ks.keys)
                    if k in up.keys or not any(m in k for m in marks)]
            extra |= len(keep) < len(ks.keys)
            raised = ks.answers == ("raised",)
            trimmed = StoreCall(
                ks.op, tuple(ks.keys[i] for i in keep),
                ks.answers if raised else tuple(ks.answers[i] for i in keep),
                tuple(ks.blocks[i] for i in keep) if ks.blocks else ())
            if trimmed != up:
                return False
        return extra

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def assert_conforms(self) -> None:
        if self.divergences:
            raise DivergenceError(
                f"{self.variant.name} diverges from vLLM 0.33.0 ({len(self.divergences)} "
                f"difference(s)); first at {self.divergences[0]}")

    def rank_state(self, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(upstream, kvstate) normalised state of one rank, for scenario asserts."""
        return upstream_rank_state(self.up_ranks[rank].thread), kvstate_rank_state(
            self.ks_ranks[rank].executor)


# --------------------------------------------------------------------------
# Random schedules: the same differential check over seeded swarms.


def random_run(seed: int, steps: int = 30, variant: str | Variant = "e2", *,
               strict_event_order: bool = False, hybrid: bool = False,
               retries: bool = True, planner_cls: type[Planner] = Planner,
               executor_cls: type[Executor] = Executor) -> Conformance:
    """Run one seeded random schedule (admissions with shared prefixes, id reuse,
    chunked prefill, preemption and resumption, aborts, lagging ranks, store
    faults including blocked puts) and return the finished run. Request ids are
    never reused in the step right after they finished: upstream crashes there
    (specs/conformance.md), which would end every such run.

    ``hybrid``: the model has a sliding-window group too (a window of 4, 20 or
    40 tokens), and between steps both sides may look a prompt up or lose a
    stored chunk (an eviction from both stores). ``retries=False`` draws every
    fault that would fail a store call as a blocked put instead, so no job is
    retried (a retry over blocks that left the window was F4, where
    `AppendOnlyTablesPlanner` still diverges); ``planner_cls`` replaces the
    planner (that one, say); ``executor_cls`` a patched
    executor, as `RuleMutant` has). A one-group seed draws the same schedule
    whatever these say."""
    import random

    rnd = random.Random(seed)
    world = rnd.choice([1, 2])
    window = random.Random(f"{seed}-window").choice([4, 20, 40]) if hybrid else None
    setup = Setup(world_size=world, put_step=rnd.choice([1, world]),
                  kv_events=rnd.random() < 0.7, save_decode_cache=rnd.random() < 0.7,
                  chunk=rnd.choice([16, 32, 1 << 20]), sliding_window=window)
    faults = []
    for _ in range(rnd.randint(0, 4)):
        rank, nth = rnd.randrange(world), rnd.randint(1, 8)
        kind = rnd.choice(["no space", "raise", "partial", "transfer", "block", "exists raise"])
        if not retries:
            kind = "block"
        faults.append({
            "no space": Fault("put", rank, nth, code=-200),
            "raise": Fault("put", rank, nth, raises=True),
            "partial": Fault("put", rank, nth, code=-800, index=0),
            "transfer": Fault("put", rank, nth, code=-800),
            "block": Fault("put", rank, nth, blocks=True),
            "exists raise": Fault("exists", rank, nth, raises=True),
        }[kind])
    run = Conformance(setup, variant, faults, strict_event_order=strict_event_order,
                      planner_cls=planner_cls, executor_cls=executor_cls)
    ids = ("a", "b", "c")
    between = random.Random(f"{seed}-between")  # hybrid runs' lookups and evictions

    def both_blocked() -> list[int]:
        return [r for r in range(world)
                if run.up_ranks[r].blocked is not None and run.ks_ranks[r].blocked is not None]

    try:
        for _ in range(steps):
            reqs = run.engine.requests
            free = [r for r in ids if (r not in reqs or reqs[r].status == "finished")
                    and r not in run.engine.finished_ids]
            if free and rnd.random() < 0.3:
                base = rnd.choice([1, 1, 500])
                run.add(rnd.choice(free), range(base, base + rnd.randint(10, 60)),
                        max_tokens=rnd.randint(1, 30))
            running = [r for r in ids if r in reqs and reqs[r].status == "running"]
            parked = [r for r in ids if r in reqs and reqs[r].status == "preempted"]
            kwargs: dict[str, Any] = {}
            if running and rnd.random() < 0.1:
                kwargs["preempt"] = [rnd.choice(running)]
            elif parked and rnd.random() < 0.4:
                kwargs["resume"] = [rnd.choice(parked)]
            if running and "preempt" not in kwargs and rnd.random() < 0.05:
                kwargs["finish"] = [rnd.choice(running)]
            if (blocked := both_blocked()) and rnd.random() < 0.3:
                kwargs["release"] = blocked
            if rnd.random() < 0.4:
                kwargs["jobs"] = {r: rnd.choice([0, 1, ALL]) for r in range(world)}
            run.step(**kwargs)
            if hybrid and not run.divergences:
                # Evictions with any quorum: a re-put reporting an event again
                # in the step its quorum completes was F5 (fixed).
                if between.random() < 0.2 and run.store_up.objects and \
                        run.store_up.objects == run.store_ks.objects:
                    run.evict_keys([between.choice(sorted(run.store_up.objects))])
                if between.random() < 0.3:
                    base = between.choice([1, 1, 500])
                    run.lookup(range(base, base + between.randint(10, 90)))
            if run.divergences:
                return run
        run.step(release=both_blocked())
        run.steps(5)
        if hybrid and not run.divergences:
            run.lookup(range(1, 91))
            run.lookup(range(500, 590))
        return run
    finally:
        run.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m adapters.vllm.conformance [--strict-event-order] [--hybrid
    [--no-retries] [--append-only]] [FIRST [LAST]]``: random schedules
    ``FIRST..LAST-1`` (``--hybrid``: with a sliding-window group, lookups and
    evictions; ``--no-retries``: no store call fails; ``--append-only``:
    kvstate's planner as it was before F4's fix); prints the first divergence
    of each failing seed. Exit 1 if any diverged."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    flags = {"--strict-event-order", "--hybrid", "--no-retries", "--append-only"}
    given = {a for a in args if a in flags}
    args = [a for a in args if a not in flags]
    first = int(args[0]) if args else 0
    last = int(args[1]) if len(args) > 1 else first + 20
    bad = 0
    for seed in range(first, last):
        run = random_run(
            seed, strict_event_order="--strict-event-order" in given,
            hybrid="--hybrid" in given, retries="--no-retries" not in given,
            planner_cls=AppendOnlyTablesPlanner if "--append-only" in given else Planner)
        if run.first_divergence is not None:
            bad += 1
            print(f"seed {seed} ({run.setup}): {run.first_divergence}")
    print(f"{last - first} seeds, {bad} diverged")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
