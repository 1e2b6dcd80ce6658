"""The connector's worker role: one ``kvstate.executor.Executor`` per TP rank.

Theory of operation
-------------------
vLLM calls a worker connector on the model runner's thread, once per engine
step, in this order (vLLM 0.33.0): ``bind_connector_metadata``,
``start_load_kv`` (before the forward pass when the step has synchronous
loads, after its launch otherwise), ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``.

- ``start_load_kv`` hands the step's loads (the plan's ``LoadMeta``s) to
  the receive thread (asynchronous loads, the default): it reads each into
  the blocks vLLM allocated while the engine runs other requests; the
  request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``, its blocks uncached,
  until ``get_finished`` names it. A load is announced once all its reads
  returned, and its failed blocks (a key that read short or failed) go out
  through ``get_block_ids_with_load_errors`` in that same pass, so the engine
  recomputes them (S19) before anything reads them. With
  ``kvstate_load_async=false`` the loads are blocking reads instead, done
  before the forward pass that reads them.
- ``wait_for_save`` hands the plan to the executor *after* the forward pass
  wrote this step's KV: generations end, ledger entries are registered, jobs
  are queued (S5: ledger first). Only then can the send thread read the
  blocks, which is what makes the stored bytes the bytes of the key's prefix.
- The send thread takes queued jobs in FIFO order and performs each store call
  the executor asks for *outside* the lock, feeding the answer back *inside*
  it. The executor is the single source of behaviour; this class only moves
  bytes and answers. Every path ends in a ``Report`` (a call that raises or
  times out included), because the scheduler releases a job's pins only when
  every rank reported it.
- ``build_connector_worker_meta`` ships reports, load reports and (when a
  trace or the online monitor is on) this rank's observations to the
  scheduler; vLLM aggregates the ranks' metadata with ``aggregate``.

The executor's clock is the number of the last plan this rank received: a
pressure backoff is counted in engine steps, and a recorded trace replays to
the same verdicts (the trace's time is that step number).

Byte layout. Each layer's KV tensor is blocks-first; a block's value in the
store is, per distinct tensor of its KV-cache group's layers in
``kv_caches`` order, that tensor's bytes of the block — the layout
upstream's rank-local store layout writes, so either connector reads what
the other stored (`KVLayout`). Every store call names each key's group
(``PutCall.groups``, ``GetCall.groups``): the block is addressed in that
group's tensors. Null blocks (a sliding-window group's blocks that left its
window) are never in a call: the executor skips them, as upstream does.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import attrs

from kvstate.config import ConnectorConfig
from kvstate.executor import Executor, RankJob
from kvstate.observations import (
    ExistsAnswered,
    LoadDone,
    Observation,
    PutDone,
    StoreCallRaised,
)
from kvstate.records import ExistsCall, LoadReport, Plan, PutCall, Report
from kvstate.variants import Variant

logger = logging.getLogger("kvstate.vllm")


@attrs.frozen(slots=True)
class RankObservation:
    """One observation of a rank, with where it belongs in the engine's order:
    ``plan`` is the step of the last plan the rank had taken when it happened,
    ``shipped`` the step whose worker metadata carried it."""

    plan: int
    shipped: int
    rank: int
    seq: int
    observation: Observation


@attrs.define(slots=True)
class RankCounters:
    """What a rank did since its counters were last read (vLLM's stats are
    per interval: the aggregator sums the ranks' values)."""

    jobs_reported: int = 0
    exists_calls: int = 0
    exists_keys: int = 0
    dedup_hits: int = 0
    keys_put: int = 0
    bytes_put: int = 0
    put_failures: int = 0
    pressure_rejections: int = 0
    store_errors: int = 0
    keys_loaded: int = 0
    bytes_loaded: int = 0
    load_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class KVLayout:
    """Where a block's bytes live, per KV-cache group: for each of the
    group's KV tensors, a base address and a block length.

    A block id names a block of vLLM's one block pool, which every group
    draws from; the block's bytes are those of the group it was allocated
    to. vLLM lays a hybrid model's KV cache out as one tensor per layer
    slot, shared by one layer of each group, so two groups' layers may be
    views of one tensor: a group's value is its layers' distinct tensors
    (by address), in ``kv_caches`` order — upstream's rank-local layout
    whenever each group spans every tensor, as vLLM's layout makes it.
    Every distinct tensor is registered with the store once."""

    def __init__(self, kv_caches: dict[str, Any], num_blocks: int,
                 groups: list[list[str]]) -> None:
        self.bases: list[list[int]] = []
        self.lengths: list[list[int]] = []
        self._regions: dict[int, int] = {}  # distinct tensor address -> bytes
        self.tensors: list[Any] = []  # the distinct tensors, every group's
        for g, layers in enumerate(groups):
            missing = [name for name in layers if name not in kv_caches]
            if missing:
                raise ValueError(f"register_kv_caches: no KV tensor for layers {missing} of "
                                 f"KV-cache group {g}")
            mine = set(layers)
            bases: list[int] = []
            lengths: list[int] = []
            for name, tensor in kv_caches.items():
                if name not in mine:
                    continue
                base, length = self._region(name, tensor, num_blocks)
                if base not in bases:
                    bases.append(base)
                    lengths.append(length)
            self.bases.append(bases)
            self.lengths.append(lengths)

    def _region(self, name: str, tensor: Any, num_blocks: int) -> tuple[int, int]:
        if not hasattr(tensor, "data_ptr"):
            raise ValueError(f"register_kv_caches: layer {name!r} is not a tensor "
                             f"({type(tensor).__name__}); Mamba state is not supported")
        if tensor.shape[0] != num_blocks:
            raise ValueError(
                f"register_kv_caches: layer {name!r} has shape {tuple(tensor.shape)}; "
                f"expected blocks first ({num_blocks} blocks on dimension 0)")
        if not tensor.is_contiguous():
            raise ValueError(f"register_kv_caches: layer {name!r} is not contiguous")
        base = tensor.data_ptr()
        length = tensor.stride(0) * tensor.element_size()
        size = tensor.numel() * tensor.element_size()
        if base not in self._regions:
            self._regions[base] = size
            self.tensors.append(tensor)
        elif self._regions[base] != size:
            raise ValueError(f"register_kv_caches: layer {name!r} views the KV tensor at "
                             f"{base:#x} with another size than a layer before it")
        return base, length

    def regions(self) -> list[tuple[int, int]]:
        return list(self._regions.items())

    def block_bytes(self, group: int) -> int:
        return sum(self.lengths[group])

    def buffers(self, group: int, block: int) -> tuple[list[int], list[int]]:
        lengths = self.lengths[group]
        return [base + block * length for base, length in zip(self.bases[group], lengths)], \
            list(lengths)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, rank: int, variant: Variant, store: Any,
                 *, record: bool, load_async: bool = False) -> None:
        self.config = config
        self.load_async = load_async
        self.rank = rank
        self.store = store
        self.lock = threading.Lock()
        self.plan_step = 0  # the last plan this rank took (its clock)
        self.shipped = 0  # worker metadata built so far
        self._seq = 0
        self._said: set[tuple[str, ...]] = set()  # kinds of store failure logged (`_say`)
        self.record = record
        self.executor = Executor(config, rank, variant, clock=self._clock,
                                 observer=self._observe if record else None)
        self.observations: list[RankObservation] = []
        # (plan, rank, seq) orders reports as the trace orders their jobs' lines.
        self.reports: list[tuple[tuple[int, int, int], Report]] = []
        self.load_reports: list[LoadReport] = []
        self.load_errors: set[int] = set()
        # With several KV-cache groups vLLM takes a failed load per request
        # (block ids are only unique within a group): `take_failed_loads`.
        self.per_request_failures = len(config.groups) > 1
        self.failed_loads: set[str] = set()
        self.counters = RankCounters()
        self.totals: dict[str, int] = {}  # counters summed over every take_counters()
        self._store_seen: dict[str, int] = {}  # the store's counters at the last read
        self.layout: KVLayout | None = None
        self.in_flight: RankJob | None = None
        self._work = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._registered: list[int] = []
        # Asynchronous loads: queued for the receive thread, the loads each
        # request still waits for, and loads that landed and were not
        # announced yet (`take_landed_loads`), with their `_read` outcome.
        self._to_receive: deque[Any] = deque()
        self._receiving: dict[str, int] = {}
        self._landed: list[tuple[Any, tuple[int, ...], LoadReport, int, int]] = []
        self._receive = threading.Event()
        self._receiver: threading.Thread | None = None

    def _clock(self) -> float:
        return float(self.plan_step)

    def _observe(self, obs: Observation, plan: int | None = None) -> None:
        """Called with ``self.lock`` held: the rank's observations are totally ordered."""
        self._seq += 1
        self.observations.append(RankObservation(
            self.plan_step if plan is None else plan, self.shipped + 1, self.rank, self._seq, obs))

    # ------------------------------------------------------------------
    # Set-up and teardown.

    def register(self, kv_caches: dict[str, Any], num_blocks: int,
                 groups: list[list[str]] | None = None) -> None:
        """``groups``: each KV-cache group's layer names (default: one group
        of every layer)."""
        self.layout = KVLayout(kv_caches, num_blocks, groups or [list(kv_caches)])
        for ptr, size in self.layout.regions():
            self.store.register(ptr, size)
            self._registered.append(ptr)
        self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"kvstate-send-rank{self.rank}")
        self._thread.start()
        if self.load_async:
            self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                              name=f"kvstate-receive-rank{self.rank}")
            self._receiver.start()

    def close(self) -> None:
        with self.lock:
            self._stopping = True
            self._work.set()
            self._receive.set()
        for thread in (self._thread, self._receiver):
            if thread is not None:
                thread.join(timeout=self.store.timeout + 1)
        for ptr in self._registered:
            try:
                self.store.unregister(ptr)
            except Exception:  # noqa: BLE001 - a broken store cannot unregister
                break
        self._registered = []

    # ------------------------------------------------------------------
    # The model runner's thread.

    def load(self, plan: Plan) -> None:
        """Perform the plan's loads now (before the forward pass reads them)."""
        for load in plan.loads:
            with self.lock:
                call = self.executor.load_call(load)
            failed, report, loaded, loaded_bytes = self._read(call)
            with self.lock:
                self._landed_load(plan.step, call, failed, report, loaded, loaded_bytes)

    def _read(self, call: Any) -> tuple[tuple[int, ...], LoadReport, int, int]:
        """One load's store reads into its blocks (outside the lock)."""
        ptrs, sizes = self._buffers(call)
        try:
            got = self.store.get(list(call.keys), ptrs, sizes) if call.keys else []
        except Exception as exc:  # noqa: BLE001 - a failed read is a load error
            logger.warning("kvstate rank %d: load of %s failed: %s", self.rank,
                           call.req_id, exc)
            got = [-1] * len(call.keys)
            # A call refused while the store recovers ran nothing: only one
            # that was running when its bound passed may still write.
            wait = getattr(self.store, "wait_for_straggler", None)
            if isinstance(exc, TimeoutError) and self.load_async and not (
                    wait is not None and wait(0)):
                self._outwait(call)
        ok = [g == sum(s) for g, s in zip(got, sizes)]
        report = self.executor.load_answered(call, ok)
        failed = tuple(b for b, good in zip(call.block_ids, ok) if not good)
        loaded_bytes = sum(sum(s) for s, good in zip(sizes, ok) if good)
        return failed, report, sum(ok), loaded_bytes

    def _outwait(self, call: Any) -> None:
        """A get that timed out may still write into the load's blocks when
        it returns. Landing the load now would let vLLM recompute into them,
        or free them for another request, and the late bytes would land on
        top. So the receive thread waits for the call to return: the request
        stays parked and its blocks held (vLLM frees nothing of a parked or
        loading request), possibly for good if the call never returns — a
        lost request, never corrupt KV. The engine serves on; calls fail at
        once until the store has set up a fresh client, which it does once
        the stuck call returned (`adapters.mooncake.MooncakeStore`)."""
        wait = getattr(self.store, "wait_for_straggler", None)
        if wait is None:
            return
        logger.warning("kvstate rank %d: the get of %s outlived kvstate_store_timeout; its "
                       "blocks stay held until it returns", self.rank, call.req_id)
        while not wait(1.0):
            with self.lock:
                if self._stopping:
                    return

    def _landed_load(self, step: int, call: Any, failed: tuple[int, ...], report: LoadReport,
                     loaded: int, loaded_bytes: int) -> None:
        """A load's outcome, told to the scheduler (with ``self.lock`` held)."""
        self.counters.keys_loaded += loaded
        self.counters.bytes_loaded += loaded_bytes
        self.counters.load_failures += len(failed)
        if self.record:
            self._observe(LoadDone(self.rank, call.req_id, call.generation, failed,
                                   report.failed_block_ids), step)
        self.load_reports.append(report)
        if self.per_request_failures:
            if report.failed_block_ids:
                self.failed_loads.add(call.req_id)
        else:
            self.load_errors.update(report.failed_block_ids)

    # Asynchronous loads.

    def queue_loads(self, plan: Plan) -> None:
        """``start_load_kv``: the plan's loads go to the receive thread."""
        if not plan.loads:
            return
        with self.lock:
            for load in plan.loads:
                call = self.executor.load_call(load)
                self._receiving[call.req_id] = self._receiving.get(call.req_id, 0) + 1
                self._to_receive.append(call)
            self._receive.set()

    def loads_settled(self) -> bool:
        """Has every load queued so far landed (announced or not)?"""
        with self.lock:
            return sum(self._receiving.values()) == len(self._landed)

    def take_landed_loads(self) -> set[str]:
        """``get_finished``: the requests whose every queued load landed
        since the last call. Their reports, observations and failed blocks
        are released now, so the pass that names a request also carries its
        load errors (and the scheduler's metadata its report)."""
        with self.lock:
            landed, self._landed = self._landed, []
            done: set[str] = set()
            for call, failed, report, loaded, loaded_bytes in landed:
                # Observed now (this step's plan), when the scheduler learns it.
                self._landed_load(self.plan_step, call, failed, report, loaded, loaded_bytes)
                left = self._receiving[call.req_id] - 1
                if left:
                    self._receiving[call.req_id] = left
                else:
                    del self._receiving[call.req_id]
                    done.add(call.req_id)
        return done

    def _receive_loop(self) -> None:
        while True:
            self._receive.wait()
            with self.lock:
                if self._stopping:
                    return
                if not self._to_receive:
                    self._receive.clear()
                    continue
                call = self._to_receive.popleft()
            # Every load lands, a failed one included: vLLM frees a request's
            # blocks (finished meanwhile) or schedules it only when it does.
            try:
                outcome = self._read(call)
            except Exception:  # noqa: BLE001 - see above
                logger.exception("kvstate rank %d: load of %s could not be read",
                                 self.rank, call.req_id)
                outcome = (call.block_ids, self.executor.load_answered(
                    call, [False] * len(call.keys)), 0, 0)
            with self.lock:
                self._landed.append((call, *outcome))

    def take_plan(self, plan: Plan) -> None:
        """After the forward pass: end generations, register and queue jobs."""
        with self.lock:
            self.plan_step = plan.step
            self.executor.receive(plan, loads=False)
            if self.executor.queue:
                self._work.set()

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self.load_errors = self.load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose load failed, told once: with several groups, after
        `take_landed_loads` named them in the same pass (vLLM then drops
        what they loaded and computes them afresh)."""
        with self.lock:
            failed, self.failed_loads = self.failed_loads, set()
        return failed

    def take_output(self) -> tuple[list[tuple[tuple[int, int, int], Report]], list[LoadReport],
                                   list[RankObservation]]:
        with self.lock:
            self.shipped += 1
            out = (self.reports, self.load_reports, self.observations)
            self.reports, self.load_reports, self.observations = [], [], []
        return out

    def take_counters(self) -> dict[str, Any]:
        with self.lock:
            data = self.counters.as_dict()
            for name, value in data.items():
                self.totals[name] = self.totals.get(name, 0) + value
            self.counters = RankCounters()
            data["send_queue_depth"] = len(self.executor.queue) + (self.in_flight is not None)
            data["ledger_entries"] = len(self.executor.ledger)
        # The store's recovery: episodes (a call outlived its bound), attempts
        # and recoveries since the last read (vLLM's stats are per
        # interval; the store counts from its start), and whether it is
        # recovering now (a gauge: summed over ranks, the ranks recovering).
        stats = getattr(self.store, "stats", None)
        if stats is not None:
            now = stats()
            for name in ("store_episodes", "store_recovery_attempts", "store_recoveries"):
                data[name] = now[name] - self._store_seen.get(name, 0)
                self.totals[name] = self.totals.get(name, 0) + data[name]
            data["store_recovering"] = now["store_recovering"]
            self._store_seen = now
        return data

    # ------------------------------------------------------------------
    # The send thread.

    def _send_loop(self) -> None:
        while True:
            self._work.wait()
            with self.lock:
                if self._stopping:
                    return
                job = self.executor.dequeue()
                if job is None:
                    self._work.clear()
                    continue
                self.in_flight = job
                try:
                    out = self.executor.start(job)
                except Exception:  # noqa: BLE001 - see below
                    self._lost(job)
                    continue
            try:
                self._run_job(job, out)
            except Exception:  # noqa: BLE001 - the thread outlives one job's failure
                with self.lock:
                    self._lost(job)

    def _lost(self, job: RankJob) -> None:
        """A job the executor itself failed on (a bug, not a store error): said,
        and the thread goes on with the next one. Called holding the lock."""
        logger.exception("kvstate rank %d: job %d could not finish; its blocks stay pinned "
                         "until the engine restarts", self.rank, job.meta.job_id)
        self.in_flight = None

    def _run_job(self, job: RankJob, out: ExistsCall | PutCall | Report | None) -> None:
        while out is not None and not isinstance(out, Report):
            call = out
            try:
                answer = self._perform(call)
                with self.lock:
                    out = self._answered(job, call, answer)
            except Exception as exc:  # noqa: BLE001 - every failure must still report
                # A store call that raised or timed out, or an answer the
                # executor refused (one answer too few): the job reports as
                # failed either way, so its pins are released; a send thread
                # that died here left them pinned for good, without a word.
                error = f"{type(exc).__name__}: {exc}"
                self._say(job, error)
                with self.lock:
                    self.counters.store_errors += 1
                    if self.record:
                        self._observe(StoreCallRaised(self.rank, job.meta.job_id, error))
                    out = self.executor.raised(job, error)
        with self.lock:
            self.in_flight = None
            if out is not None:
                self._seq += 1
                self.reports.append(((self.plan_step, self.rank, self._seq), out))
                self.counters.jobs_reported += 1

    def _say(self, job: RankJob, error: str) -> None:
        """Log a store failure, once per kind of error (the first words), so a
        store that is down is said once a rank, not once a call."""
        kind = error.split(":", 2)[:2]
        said = self._said
        if tuple(kind) in said or len(said) >= 64:
            return
        said.add(tuple(kind))
        logger.warning("kvstate rank %d: a store call of job %d failed: %s (the job reports "
                       "it as failed; the same kind of failure is not logged again)",
                       self.rank, job.meta.job_id, error)

    def _perform(self, call: ExistsCall | PutCall) -> list[Any]:
        """The store's answers, one per key: a call answered otherwise failed
        (recorded as raised, so the trace holds no answer that cannot be)."""
        if isinstance(call, ExistsCall):
            answers = list(self.store.exists(call.keys))
        else:
            if self.layout is None:
                raise RuntimeError("put before register_kv_caches")
            ptrs, sizes = self._buffers(call)
            answers = list(self.store.put(list(call.keys), ptrs, sizes))
        if len(answers) != len(call.keys):
            raise RuntimeError(f"the store gave {len(answers)} answers for {len(call.keys)} keys")
        return answers

    def _buffers(self, call: Any) -> tuple[list[list[int]], list[list[int]]]:
        """Each key's buffers: its block in its group's tensors."""
        layout = self.layout
        ptrs, sizes = [], []
        for group, block in zip(call.groups, call.block_ids):
            p, s = layout.buffers(group, block) if layout is not None else ([], [])
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    def _answered(self, job: RankJob, call: ExistsCall | PutCall, answer: list[Any]
                  ) -> ExistsCall | PutCall | Report | None:
        counters = self.counters
        meta = job.meta
        if isinstance(call, ExistsCall):
            counters.exists_calls += 1
            counters.exists_keys += len(call.keys)
            counters.dedup_hits += sum(answer)
            if self.record:
                self._observe(ExistsAnswered(self.rank, meta.job_id, call.keys, tuple(answer)))
            return self.executor.exists_answered(job, answer)
        layout = self.layout
        for key, group, cid, block, code in zip(call.keys, call.groups, call.chunk_ids,
                                               call.block_ids, answer):
            if code == 0:
                counters.keys_put += 1
                counters.bytes_put += layout.block_bytes(group) if layout is not None else 0
            else:
                counters.put_failures += 1
                counters.pressure_rejections += code == -200
            if self.record:
                # The bytes' content tag is not observable here: "" says so (K1 skips it).
                self._observe(PutDone(self.rank, meta.job_id, meta.req_id, meta.generation,
                                      key, group, cid, block, "", code, code == 0))
        return self.executor.put_answered(job, answer)

