"""The connector's scheduler role: vLLM's scheduler output in, kvstate's ``Plan`` out.

Theory of operation
-------------------
vLLM 0.33.0 calls the scheduler connector inside ``Scheduler.schedule()``
(``get_num_new_matched_tokens`` and ``update_state_after_alloc`` for each
request it admits, then ``build_connector_meta`` once) and inside
``update_from_output()`` (``request_finished``, ``update_connector_output``
with the ranks' aggregated worker metadata, ``get_kv_connector_stats``,
``take_events``). This class translates those calls into the sans-IO
planner's inputs and applies its outputs to the engine:

- ``SchedulerOutput`` -> ``kvstate.records.SchedulerStep``. vLLM ships no
  token ids for running requests without pipeline parallelism, so tokens and
  block hashes are read from the ``Request`` objects the scheduler handed us:
  a running request's new tokens are ``all_token_ids[num_computed :
  num_computed + scheduled - drafts]`` (speculative drafts never count), its
  new hashes whatever ``Request.block_hashes`` grew by since the last step. A
  request listed in ``resumed_req_ids`` (or scheduled as new while its last
  generation was preempted) is a resumption with a replaced block table.
- The plan's pins and releases are references on vLLM's own ``BlockPool``
  (``touch`` / ``free_blocks``): a pinned block outlives its request's
  preemption or finish until every rank confirmed saving past it, so a send
  thread never reads a block vLLM gave to someone else (S1, vLLM#52360).
- Reports and load reports arrive in the workers' metadata; the planner
  settles them (releases, KV events at quorum).
- Lookups run here, against the store, with the scheduler's own small
  Mooncake client: every rank namespace must hold every chunk (S20). A
  preempted request is looked up again when vLLM re-admits it (as upstream
  does): its next generation starts at that lookup (`resuming`) and the
  step that resumes it takes the generation over, load and all.
- Loads are asynchronous by default (``kvstate_load_async``): vLLM parks the
  request in ``WAITING_FOR_REMOTE_KVS`` until every rank reported the load
  through ``get_finished``, and caches its blocks only then, so no other
  request reads a block a load is still filling. A load that failed is
  never tried again for the same request: vLLM keeps the valid prefix (or,
  when the first block failed, frees the blocks and schedules the request
  afresh) and the request computes the rest. The retry asks the store
  nothing, which loses no hit (whatever lay before the failed block is in
  the blocks vLLM kept), and bounds a request whose every get fails — the
  master still saying "present" — to one load (`failed_loads`).
- A request whose next block another request's asynchronous load is
  filling is not looked up yet: ``get_num_new_matched_tokens`` answers
  ``None`` ("ask again"), vLLM keeps it waiting, and once the load landed
  vLLM's own prefix cache holds the block. Without this, requests admitted
  together that share a prefix each loaded it from the store (vLLM caches
  a loading block only once the load landed). Every load lands, a failed
  one included, and an owner scheduled (vLLM cached the blocks it loaded
  when it promoted it) or finished holds nobody back any more, so the wait
  ends (`loading_blocks`).

Several KV-cache groups (a hybrid model; the connector declares vLLM's
``SupportsHMA``): block tables are one tuple per group, a block id names a
block of vLLM's one block pool whichever group holds it, so pins and
releases stay block ids; keys, lookups (the planner's window rule) and puts
are per group. vLLM's sliding-window manager frees the blocks that left
the window and nulls them in the request's table (and may hand them to
another request in the same step); a save job must neither read nor pin
them. Each step the positions vLLM nulled since the last step are read
from vLLM's current tables (``SchedulerOutput.kv_connector_block_state``,
what upstream saves from) and told to the planner with the request
(``CachedRequest.freed_positions``), which nulls them in its copy of the
table; `_window_fence` then checks every job against the current tables
and says so if one still reads a freed block.

Store keys use the engine's own block hashes (``Request.block_hashes``,
vLLM's sha256 chain) in upstream's key format, so a store either connector
filled serves the other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvstate.config import ConnectorConfig, GroupKind
from kvstate.observations import (
    Allocated,
    LookupDone,
    Planned,
    ReportDelivered,
    Settled,
    StepScheduled,
)
from kvstate.planner import Planner
from kvstate.records import (
    NULL_BLOCK_ID,
    BlockTable,
    CachedRequest,
    NewRequest,
    Plan,
    Report,
    ResumedRequest,
    SchedulerStep,
)
from kvstate.tables import RequestState
from kvstate.variants import Variant

from .recorder import EngineLog

logger = logging.getLogger("kvstate.vllm")


def _table(block_ids: Any, groups: int) -> BlockTable:
    if not block_ids:
        return tuple(() for _ in range(groups))
    return tuple(tuple(ids) for ids in block_ids)


def scheduler_step(so: Any, requests: dict[str, Any], sent_hashes: dict[str, int],
                   groups: int, resumes: Callable[[str], bool]) -> SchedulerStep:
    """vLLM's ``SchedulerOutput`` as kvstate's ``SchedulerStep`` (the module
    docstring says where each field comes from). ``requests`` holds the
    ``Request`` objects by id, ``sent_hashes`` how many of each request's
    block hashes earlier steps carried (updated here); ``resumes(req_id)``
    says whether a request scheduled as new is a preempted one coming back
    (vLLM's v2 runner lists a resumption that way)."""
    new: list[NewRequest] = []
    resumed: list[ResumedRequest] = []
    cached: list[CachedRequest] = []
    scheduled = so.num_scheduled_tokens
    for data in so.scheduled_new_reqs:
        req_id = data.req_id
        request = requests[req_id]
        hashes = tuple(request.block_hashes)
        sent_hashes[req_id] = len(hashes)
        table = _table(data.block_ids, groups)
        if resumes(req_id):
            resumed.append(ResumedRequest(req_id, tuple(request.all_token_ids),
                                          data.num_computed_tokens, scheduled[req_id],
                                          table, hashes))
        else:
            new.append(NewRequest(req_id, tuple(data.prompt_token_ids or ()),
                                  data.num_computed_tokens, scheduled[req_id], table, hashes))
    cd = so.scheduled_cached_reqs
    drafts = so.scheduled_spec_decode_tokens
    for i, req_id in enumerate(cd.req_ids):
        request = requests[req_id]
        computed = cd.num_computed_tokens[i]
        hashes_all = request.block_hashes
        if req_id in cd.resumed_req_ids:
            sent_hashes[req_id] = len(hashes_all)
            resumed.append(ResumedRequest(req_id, tuple(request.all_token_ids), computed,
                                          scheduled[req_id], _table(cd.new_block_ids[i], groups),
                                          tuple(hashes_all)))
            continue
        real = scheduled[req_id] - len(drafts.get(req_id, ()))
        tokens = tuple(request.all_token_ids[computed:computed + real])
        sent = sent_hashes.get(req_id, 0)
        sent_hashes[req_id] = len(hashes_all)
        cached.append(CachedRequest(req_id, computed, tokens,
                                    _table(cd.new_block_ids[i], groups),
                                    tuple(hashes_all[sent:])))
    return SchedulerStep(tuple(new), tuple(cached), tuple(resumed),
                         tuple(sorted(so.preempted_req_ids or ())),
                         tuple(sorted(so.finished_req_ids)))


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, variant: Variant, *, lookup_store: Any,
                 log: EngineLog, load_async: bool = False) -> None:
        self.config = config
        self.load_async = load_async
        self.planner = Planner(config, variant)
        self.groups = len(config.groups)
        # Groups whose blocks vLLM frees while the request runs (`_window_fence`).
        self.window_groups = tuple(g for g, spec in enumerate(config.groups)
                                   if spec.kind is GroupKind.SLIDING_WINDOW)
        self.fence_said = False
        # Per request, per group: table positions below this were nulled by
        # vLLM and told to the planner (vLLM nulls a window's blocks from the
        # left, so the nulls are a prefix: each step scans only what is new).
        self.nulled_upto: dict[str, list[int]] = {}
        self.store = lookup_store
        self.log = log
        self.pool: Any = None
        self.requests: dict[str, Any] = {}
        self.sent_hashes: dict[str, int] = {}
        self.finishing: set[str] = set()  # finished, not yet told to the planner
        self.hits: dict[str, int] = {}  # a lookup's answer until the request is allocated
        self.local_hits: dict[str, int] = {}  # tokens vLLM's own prefix cache provided
        # Requests (by id, with the Request object: an id reused later is
        # another request) whose load failed: they get no lookup again.
        self.failed_loads: dict[str, Any] = {}
        # Preempted requests looked up on re-admission, until the step that
        # resumes them (vLLM's v2 runner lists a resumption as a new request).
        self.resuming: set[str] = set()
        # Asynchronous loads in flight: the block hash (a block's last hash)
        # of each block one fills -> the request loading it, and the reverse.
        self.loading_blocks: dict[bytes, str] = {}
        self.loads_of: dict[str, list[bytes]] = {}
        self.events: list[Any] = []
        self.pins_held = 0
        self.totals: dict[str, int] = {}  # counters summed over every stats() call
        self.counters = {"lookups": 0, "lookup_hit_tokens": 0, "lookup_errors": 0,
                         "loads_failed": 0, "lookups_skipped_after_failed_load": 0,
                         "lookups_deferred": 0,
                         "jobs_emitted": 0, "jobs_released": 0, "events_published": 0,
                         "events_dropped": 0, "window_blocks_freed_before_save": 0}

    @property
    def step(self) -> int:
        return self.planner._step

    # ------------------------------------------------------------------
    # Inside schedule(): lookups and allocations.

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        self.requests[req_id] = request
        self.local_hits[req_id] = num_computed_tokens
        if self.store is None:
            return 0, False
        if req_id in self.finishing:
            return 0, False  # the id's previous request is not closed yet (see finished())
        variant = self.planner.variant
        if self.failed_loads.get(req_id) is request and not variant.lookup_after_failed_load:
            # Rescheduled after its load failed: computes (the module docstring).
            self.counters["lookups_skipped_after_failed_load"] += 1
            return 0, False
        hit = self.hits.get(req_id)
        if hit is None:
            if (variant.defer_lookup_behind_loads
                    and self._next_block_loading(request, num_computed_tokens)):
                self.counters["lookups_deferred"] += 1
                return None, False  # vLLM asks again next step (the module docstring)
            hit = self._lookup(request)
        need = hit - num_computed_tokens
        if need <= 0:
            return 0, False
        # Asynchronous: vLLM parks the request until get_finished reports the
        # load. Synchronous: vLLM loads before the forward pass that reads them.
        return need, self.load_async

    def _block_hash(self, request: Any, block: int) -> bytes | None:
        per_block = self.config.hashes_per_block
        index = (block + 1) * per_block - 1
        hashes = request.block_hashes
        return hashes[index] if index < len(hashes) else None

    def _next_block_loading(self, request: Any, num_computed_tokens: int) -> bool:
        """Is another request's asynchronous load filling the block this
        request would take from the store first?"""
        if not self.loading_blocks:
            return False
        block_hash = self._block_hash(request, num_computed_tokens // self.config.block_size)
        owner = self.loading_blocks.get(block_hash) if block_hash is not None else None
        return owner is not None and owner != request.request_id

    def _loading(self, request: Any, start: int, end: int) -> None:
        """An asynchronous load of tokens ``[start, end)`` was allocated."""
        bs = self.config.block_size
        owned = self.loads_of.setdefault(request.request_id, [])
        for block in range(start // bs, end // bs):
            block_hash = self._block_hash(request, block)
            if block_hash is not None and block_hash not in self.loading_blocks:
                self.loading_blocks[block_hash] = request.request_id
                owned.append(block_hash)

    def _stop_loading(self, req_id: str) -> None:
        """``req_id`` is scheduled (vLLM cached what its load filled when it
        promoted it) or finished: it holds no other request back."""
        for block_hash in self.loads_of.pop(req_id, ()):
            if self.loading_blocks.get(block_hash) == req_id:
                del self.loading_blocks[block_hash]

    def _lookup(self, request: Any) -> int:
        req_id = request.request_id
        tracker = self.planner.trackers.get(req_id)
        if tracker is not None and tracker.state is RequestState.PREEMPTED:
            self.resuming.add(req_id)
        hashes = tuple(request.block_hashes)
        prompt_len = request.num_tokens
        query = self.planner.lookup(req_id, prompt_len, hashes)
        present: tuple[bool, ...] = ()
        if query.keys:
            try:
                present = tuple(self.store.exists(query.keys))
            except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss
                self.counters["lookup_errors"] += 1
                logger.warning("kvstate lookup of %s failed: %s", req_id, exc)
                present = (False,) * len(query.keys)
        hit = self.planner.lookup_answered(query, present)
        self.hits[req_id] = hit
        self.counters["lookups"] += 1
        self.counters["lookup_hit_tokens"] += hit
        if self.log.active:
            self.log.scheduling(self.step + 1, LookupDone(
                req_id, query.generation, prompt_len, hashes, query.keys, present, hit))
        return hit

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        self.requests[req_id] = request
        self.hits.pop(req_id, None)
        if req_id in self.finishing:
            return  # the step's new-request record starts the new generation
        tracker = self.planner.trackers.get(req_id)
        if tracker is not None and tracker.state is RequestState.PREEMPTED:
            return  # the step's resumption record starts the new generation
        local = self.local_hits.pop(req_id, 0)
        if (tracker is not None and tracker.state is RequestState.ALLOCATED
                and num_external_tokens == 0):
            # After an asynchronous load vLLM allocates once more before it
            # schedules the request (no external tokens: the loaded blocks
            # are its computed ones), or, when the load's first block failed,
            # allocates afresh after freeing the blocks. Either way the same
            # generation, not admitted yet: the step's new-request record
            # brings the block table.
            return
        table = _table(blocks.get_block_ids(), self.groups)
        load_async = self.load_async and num_external_tokens > 0
        self.planner.allocate(req_id, table, local, num_external_tokens, load_async)
        if load_async:
            self._loading(request, local, local + num_external_tokens)
        if self.log.active:
            self.log.scheduling(self.step + 1, Allocated(
                req_id, table, local, num_external_tokens, load_async))

    def finished(self, req_id: str) -> None:
        """``request_finished``: vLLM tells the planner at its next
        ``build_connector_meta`` (``finished_req_ids``), but a client may
        reuse the id inside that very ``schedule()``, before the old
        generation is closed. Such a request gets no lookup (a lost hit,
        never a mixed-up generation) and its new generation starts from the
        step's new-request record, after the old one ended."""
        self.finishing.add(req_id)
        self.resuming.discard(req_id)

    # ------------------------------------------------------------------
    # build_connector_meta.

    def build(self, so: Any) -> Plan:
        sched = self._scheduler_step(so)
        plan = self.planner.step(sched)
        if self.window_groups and plan.saves:
            self._window_fence(so, plan)
        pool = self.pool
        if pool is not None:
            if plan.pins:
                pool.touch([pool.blocks[b] for b in plan.pins])
            if plan.releases:
                pool.free_blocks(pool.blocks[b] for b in plan.releases)
        self.pins_held += len(plan.pins) - len(plan.releases)
        self.counters["jobs_emitted"] += len(plan.saves)
        if self.log.active:
            self.log.scheduling(plan.step, StepScheduled(sched))
            self.log.scheduling(plan.step, Planned(plan))
        reused = {r.req_id for r in sched.new}
        if self.loads_of:
            for req_id in reused:
                self._stop_loading(req_id)
        for req_id in sched.finished:
            self.finishing.discard(req_id)
            if req_id in reused:
                continue  # the id's new request, admitted in this very step
            self.requests.pop(req_id, None)
            self.sent_hashes.pop(req_id, None)
            self.nulled_upto.pop(req_id, None)
            self.hits.pop(req_id, None)
            self.local_hits.pop(req_id, None)
            self.failed_loads.pop(req_id, None)
            self._stop_loading(req_id)
        return plan

    def _window_fence(self, so: Any, plan: Plan) -> None:
        """Count (and say, once) each sliding-window block a save job of this
        plan is to read that vLLM no longer holds for the request: it left
        the window and was freed before the job was planned, so another
        request may have taken it and written it before the job reads it.
        The planner nulls what it is told vLLM freed (`_freed_positions`),
        so this counts only what that missed. A job reads its chunks
        ``[token_ids_start, token_len)``; a block it re-reads after a failed
        put was pinned by its first job. vLLM
        (0.32, 0.33) offers the connector the current tables of the
        requests scheduled this step; an engine that offers none is not
        checked."""
        state = getattr(so, "kv_connector_block_state", None)
        if state is None:
            return
        bs = self.config.block_size
        trackers = self.planner.trackers
        freed = 0
        for save in plan.saves:
            current = state.get_block_ids(save.req_id)
            tracker = trackers.get(save.req_id)
            if current is None or tracker is None or tracker.generation != save.generation:
                continue
            for g in self.window_groups:
                mirror, now = tracker.block_ids[g], current[g]
                for i in range(save.token_ids_start // bs, min(save.token_len // bs, len(mirror))):
                    block = mirror[i]
                    # The job's own chunks: no earlier job pinned them, so
                    # this plan's pin came after vLLM freed the block.
                    if block != NULL_BLOCK_ID and (i >= len(now) or now[i] != block):
                        freed += 1
        if freed:
            if not self.fence_said:
                self.fence_said = True
                logger.warning(
                    "kvstate: save jobs read %d sliding-window block(s) vLLM freed before "
                    "the jobs were planned (they left the window): the bytes stored for them "
                    "may be another request's (counted in window_blocks_freed_before_save)", freed)
            self.counters["window_blocks_freed_before_save"] += freed

    def _scheduler_step(self, so: Any) -> SchedulerStep:
        trackers = self.planner.trackers

        def resumes(req_id: str) -> bool:
            tracker = trackers.get(req_id)
            return (tracker is not None and tracker.state is RequestState.PREEMPTED
                    or req_id in self.resuming)

        sched = scheduler_step(so, self.requests, self.sent_hashes, self.groups, resumes)
        self.resuming.difference_update(r.req_id for r in sched.resumed)
        if self.window_groups:
            sched = self._freed_positions(so, sched)
        return sched

    def _freed_positions(self, so: Any, sched: SchedulerStep) -> SchedulerStep:
        """Each running request's ``freed_positions``: the window-group table
        positions vLLM nulled (and freed) since it was last scheduled, read
        from vLLM's current tables. A request new or resumed this step brings
        a whole table (its nulls included): scanned from 0 next time."""
        for req_id in [r.req_id for r in sched.new] + [r.req_id for r in sched.resumed]:
            self.nulled_upto.pop(req_id, None)
        state = getattr(so, "kv_connector_block_state", None)
        if state is None or not sched.cached:
            return sched
        trackers = self.planner.trackers
        cached: list[CachedRequest] = []
        told = False
        for record in sched.cached:
            current = state.get_block_ids(record.req_id)
            tracker = trackers.get(record.req_id)
            if current is None or tracker is None:
                cached.append(record)
                continue
            upto = self.nulled_upto.setdefault(record.req_id, [0] * self.groups)
            freed: list[tuple[int, ...]] = [() for _ in range(self.groups)]
            for g in self.window_groups:
                mirror, now = tracker.block_ids[g], current[g]
                pos = upto[g]
                found = []
                while pos < len(now) and now[pos] == NULL_BLOCK_ID:
                    if pos < len(mirror) and mirror[pos] != NULL_BLOCK_ID:
                        found.append(pos)
                    pos += 1
                upto[g] = pos
                freed[g] = tuple(found)
            if any(freed):
                record = attrs.evolve(record, freed_positions=tuple(freed))
                told = True
            cached.append(record)
        # Most steps free nothing: the step is rebuilt only when one did.
        return attrs.evolve(sched, cached=tuple(cached)) if told else sched

    # ------------------------------------------------------------------
    # update_connector_output.

    def settle(self, reports: list[Report], load_reports: list[Any],
               observations: list[Any]) -> None:
        step = self.step
        log = self.log
        if log.active:
            log.ranks(observations)
        if load_reports:
            for result in self.planner.on_load_reports(load_reports):
                if result.failed_block_ids:
                    self.counters["loads_failed"] += 1
                    request = self.requests.get(result.req_id)
                    if request is not None:
                        self.failed_loads[result.req_id] = request
        if reports:
            settlement = self.planner.on_reports(reports)
            pool = self.pool
            if pool is not None and settlement.releases:
                pool.free_blocks(pool.blocks[b] for b in settlement.releases)
            self.pins_held -= len(settlement.releases)
            self.counters["jobs_released"] += len(settlement.released_jobs)
            self.counters["events_published"] += len(settlement.published)
            self.counters["events_dropped"] += settlement.dropped_events
            if settlement.published:
                self.events.extend(settlement.published)
            if log.active:
                for report in reports:
                    log.settlement(step, ReportDelivered(report))
                log.settlement(step, Settled(settlement))
        if log.active:
            log.flush(step)

    def take_events(self) -> Iterator[Any]:
        """Published ``BlockStored`` events as vLLM's own records."""
        if not self.events:
            return
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        events, self.events = self.events, []
        for event in events:
            parent = event.parent_block_hash
            yield BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=None,
                medium=event.medium,
                lora_name=None,
                group_idx=event.group_idx,
            )

    def stats(self) -> dict[str, Any]:
        """Counters since the last call, plus gauges: pin references held on
        engine blocks and save jobs awaiting their ranks' reports."""
        data: dict[str, Any] = dict(self.counters)
        for name, value in self.counters.items():
            self.totals[name] = self.totals.get(name, 0) + value
            self.counters[name] = 0
        data["pins_held"] = self.pins_held
        data["jobs_in_flight"] = len(self.planner.jobs)
        return data
