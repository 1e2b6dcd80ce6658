"""The scheduler side (sans-IO): from engine steps to store jobs, pins and releases.

Design notes
------------
One ``Planner`` per engine. It never performs I/O and never reads a clock: the
engine (or the simulator, or a test) hands it a ``SchedulerStep`` and gets a
``Plan`` back; it hands it the ranks' ``Report``s and gets a ``Settlement``.

Order within a step follows upstream's ``build_connector_meta``
(vLLM 0.33.0): finished, preempted, new, cached (running, then resumed),
then loads.
Finished and preempted come first so a generation is over before anything of
the step could touch it. A request listed as both scheduled and preempted in
one step is a broken engine assumption (S23) and is reported, not ignored.

Saves. A generation may save only full blocks, only once at least one *new*
full block exists (``chunk_boundary``), never in a step that loads it, and a
consumer only in decode with ``save_decode_cache``. Emitting a job advances the
optimistic mark ``num_saved_tokens`` at once; the ranks' confirmed offsets come
back with their reports.

Hot path. For each running request a step costs a dict lookup, a few integer
updates and one comparison, and the fast path (decode saving off) returns
before touching the tracker. A job's cost — token snapshot, metadata slice,
pins — is proportional to the blocks that are new since the generation's last
job in the default protocol; upstream's policies (``e2``) are proportional to
the context, which is what the benchmark measures.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvstate.config import ConnectorConfig, GroupKind
from kvstate.events import BlockStored
from kvstate.keys import blocks_needed_for_hit, cdiv, chunk_hash, key_for, key_prefix, store_mask
from kvstate.records import (
    NULL_BLOCK_ID,
    CachedRequest,
    GenerationEnd,
    GenerationStart,
    GenKey,
    LoadMeta,
    LoadReport,
    NewRequest,
    Plan,
    Report,
    ResumedRequest,
    SaveMeta,
    SchedulerStep,
    Settlement,
    Violation,
)
from kvstate.tables import JOB, JobEvent, JobState, RequestEvent, RequestState
from kvstate.tracker import JobBook, Tracker
from kvstate.variants import KVSTATE, Variant

_RE = RequestEvent


@attrs.frozen(slots=True)
class LookupQuery:
    """Keys to test with ``batch_is_exist``: chunk-major, then namespace, then group."""

    req_id: str
    generation: int
    keys: tuple[str, ...]
    keys_per_chunk: int
    num_prompt_tokens: int
    # With a sliding-window group: per chunk, the groups looked up (those whose
    # lookup mask covers it); each chunk then has namespaces x len(groups) keys.
    # None: every group of every chunk, ``keys_per_chunk`` keys each.
    chunk_groups: tuple[tuple[int, ...], ...] | None = None


@attrs.frozen(slots=True)
class LoadResult:
    """Every rank finished a load; the engine recomputes ``failed_block_ids``."""

    req_id: str
    generation: int
    failed_block_ids: tuple[int, ...]


def _window_hit(held: set[tuple[int, int]], groups: tuple[int, ...], need: int,
                max_length: int, bs: int, lcm: int) -> int:
    """``SlidingWindowManager.find_longest_cache_hit`` (vLLM 0.33.0, no
    EAGLE): from the right, the first ``need`` contiguous held blocks whose
    run starts (on the right) at an aligned boundary end the hit; with none,
    the run from chunk 0 cut to the alignment. Only the window before the hit
    boundary is needed: blocks further left are the null block."""
    run = 0
    for i in range(max_length // bs - 1, -1, -1):
        if all((g, i) in held for g in groups):
            if run == 0 and bs != lcm and (i + 1) * bs % lcm:
                continue  # a run must end on an aligned boundary
            run += 1
            if run >= need:
                return (i + run) * bs
        else:
            run = 0
    while bs != lcm and run * bs % lcm:
        run -= 1
    return run * bs


# Request states in which a generation is running (scheduled and computing),
# and in which a preemption names a request that is not running (S23).
_RUNNING = frozenset({RequestState.PREFILLING, RequestState.DECODING, RequestState.RESUMED})
_NOT_RUNNING = frozenset({
    RequestState.PREEMPTED, RequestState.FINISHED, RequestState.ABSENT,
    RequestState.LOOKUP_PENDING, RequestState.ALLOCATED, RequestState.LOAD_PARKED,
})


@attrs.define(slots=True)
class _StepOutput:
    """What one step's phases add up to; ``plan`` freezes it."""

    pins: list[int] = attrs.Factory(list)
    releases: list[int] = attrs.Factory(list)
    saves: list[SaveMeta] = attrs.Factory(list)
    loads: list[LoadMeta] = attrs.Factory(list)
    started: list[GenerationStart] = attrs.Factory(list)
    ended: list[GenerationEnd] = attrs.Factory(list)
    violations: list[Violation] = attrs.Factory(list)
    preempted: list[GenKey] = attrs.Factory(list)
    finished: list[GenKey] = attrs.Factory(list)

    def plan(self, step: int) -> Plan:
        return Plan(
            step=step, saves=tuple(self.saves), loads=tuple(self.loads),
            preempted=tuple(self.preempted), finished=tuple(self.finished),
            pins=tuple(self.pins), releases=tuple(self.releases),
            started=tuple(self.started), ended=tuple(self.ended),
            violations=tuple(self.violations))


_NOTHING_LOADING: frozenset[tuple[int, int]] = frozenset()


class Planner:
    def __init__(self, config: ConnectorConfig, variant: Variant = KVSTATE) -> None:
        self.config = config
        self.variant = variant
        self.trackers: dict[str, Tracker] = {}
        self.jobs: dict[int, JobBook] = {}
        self.closing: dict[GenKey, Tracker] = {}
        self.quorum = variant.quorum(config)
        self._next_job_id = 1
        self._next_generation = 1
        self._step = 0
        self._loads_pending: dict[GenKey, list[LoadReport]] = {}
        self._load_queue: list[Tracker] = []
        self._loading: frozenset[tuple[int, int]] = _NOTHING_LOADING
        self._num_groups = len(config.groups)
        self._lookup_prefixes = [
            [key_prefix(config, ns * config.put_step, g) for g in range(self._num_groups)]
            for ns in variant.lookup_namespaces(config.num_namespaces)
        ]
        # Upstream's spec groups (MooncakeStoreCoordinator
        # ._verify_and_split_kv_cache_groups): groups with one spec are merged
        # (a chunk is held only when all of them hold it), full attention
        # first; ``need`` is None for full attention, else the contiguous
        # blocks a sliding-window hit needs before its boundary.
        specs: dict[int | None, list[int]] = {}
        for g, spec in enumerate(config.groups):
            window = None if spec.kind is GroupKind.FULL else spec.sliding_window
            specs.setdefault(window, []).append(g)
        self._spec_groups = sorted(
            ((tuple(gs), None if w is None else blocks_needed_for_hit(w, config.block_size))
             for w, gs in specs.items()),
            key=lambda spec: spec[1] is not None)
        self._windowed = any(need is not None for _, need in self._spec_groups)
        self._simple_hybrid = len(self._spec_groups) == 2 and self._spec_groups[0][1] is None

    # ------------------------------------------------------------------
    # Load path.

    def _new_tracker(self, req_id: str) -> Tracker:
        tracker = Tracker(req_id, self._next_generation, self._num_groups, self.config.world_size)
        tracker.save_at = self.variant.chunk_boundary(0, self.config.block_size)
        self._next_generation += 1
        return tracker

    def lookup(self, req_id: str, prompt_len: int, block_hashes: Sequence[bytes]) -> LookupQuery:
        """Start a lookup (``get_num_new_matched_tokens`` while it is pending)."""
        tracker = self.trackers.get(req_id)
        if tracker is None or tracker.state in (RequestState.FINISHED, RequestState.PREEMPTED):
            # A preempted request's generation ended at the preemption; its
            # resumption's starts here and `_resume` takes it over.
            tracker = self.trackers[req_id] = self._new_tracker(req_id)
        tracker.fire(_RE.LOOKUP_STARTED)
        tracker.hashes = list(block_hashes)
        tracker.prefill_end = prompt_len
        per_block = self.config.hashes_per_block
        num_chunks = min(prompt_len, len(block_hashes) * self.config.hash_block)
        num_chunks = num_chunks // self.config.lcm_block_size * self.config.lcm_block_size
        num_chunks //= self.config.block_size
        per_chunk = len(self._lookup_prefixes) * self._num_groups
        if self._windowed:
            return self._windowed_lookup(tracker, prompt_len, block_hashes, num_chunks, per_chunk)
        keys: list[str] = []
        for cid in range(num_chunks):
            digest = chunk_hash(block_hashes, cid, per_block)
            for prefixes in self._lookup_prefixes:
                for prefix in prefixes:
                    keys.append(key_for(prefix, digest))
        return LookupQuery(req_id, tracker.generation, tuple(keys), per_chunk, prompt_len)

    def _windowed_lookup(self, tracker: Tracker, prompt_len: int, block_hashes: Sequence[bytes],
                         num_chunks: int, per_chunk: int) -> LookupQuery:
        """Upstream's ``MooncakeStoreWorker.lookup`` for a model with a
        sliding-window group: a group's chunk is looked up only where its
        lookup mask covers it (``coord.lookup_mask``: the store mask over the
        aligned length, here `store_mask` from chunk 0), so the blocks the
        window group never stores are not asked for."""
        config = self.config
        per_block = config.hashes_per_block
        masks = store_mask(config, num_chunks * config.block_size)
        keys: list[str] = []
        chunk_groups: list[tuple[int, ...]] = []
        for cid in range(num_chunks):
            digest = chunk_hash(block_hashes, cid, per_block)
            groups = tuple(g for g, mask in enumerate(masks) if mask is None or mask[cid])
            chunk_groups.append(groups)
            for prefixes in self._lookup_prefixes:
                for g in groups:
                    keys.append(key_for(prefixes[g], digest))
        return LookupQuery(tracker.req_id, tracker.generation, tuple(keys), per_chunk, prompt_len,
                           tuple(chunk_groups))

    def lookup_answered(self, query: LookupQuery, present: Sequence[bool]) -> int:
        """Tokens the store can provide: the longest prefix of chunks whose keys
        exist in every namespace and group; a full hit is shortened so the last
        token is recomputed (the engine needs one token to sample from)."""
        if len(present) != len(query.keys):
            raise ValueError(
                f"lookup_answered: {len(present)} answers for {len(query.keys)} keys"
            )
        if query.chunk_groups is not None:
            return self._windowed_answer(query, present)
        hit = 0
        per = query.keys_per_chunk
        for cid in range(len(query.keys) // per if per else 0):
            if not all(present[cid * per:(cid + 1) * per]):
                break
            hit += 1
        tokens = hit * self.config.block_size
        if tokens >= query.num_prompt_tokens:
            tokens = (query.num_prompt_tokens - 1) // self.config.block_size * self.config.block_size
        return tokens

    def _windowed_answer(self, query: LookupQuery, present: Sequence[bool]) -> int:
        """Upstream's lookup answer with a sliding-window group: a (group,
        chunk) is held when every looked-up namespace holds its key; the hit
        is ``find_longest_cache_hit`` over what is held (`_longest_hit`), and
        a hit covering the whole prompt is searched again below its last
        token (``align_lookup_length(num_tokens - 1)``), so it stays on an
        aligned boundary whose window the store holds."""
        assert query.chunk_groups is not None
        namespaces = len(self._lookup_prefixes)
        held: set[tuple[int, int]] = set()
        pos = 0
        for cid, groups in enumerate(query.chunk_groups):
            width = len(groups)
            for j, g in enumerate(groups):
                if all(present[pos + ns * width + j] for ns in range(namespaces)):
                    held.add((g, cid))
            pos += namespaces * width
        if pos != len(present):
            raise ValueError(f"lookup_answered: {len(present)} answers for a query of {pos} keys")
        bs = self.config.block_size
        hit = self._longest_hit(held, len(query.chunk_groups) * bs)
        if hit >= query.num_prompt_tokens:
            lcm = self.config.lcm_block_size
            hit = self._longest_hit(held, (query.num_prompt_tokens - 1) // lcm * lcm)
        return hit

    def _longest_hit(self, held: set[tuple[int, int]], max_length: int) -> int:
        """``MooncakeStoreCoordinator._find_hit_blocks`` (vLLM 0.33.0): each
        spec group in turn shortens the hit (full attention: the longest run
        of held chunks from chunk 0; a sliding window: `_window_hit`), until
        no group shortens it further; a simple hybrid (full attention and one
        window spec) stops after one pass, as upstream does."""
        bs = self.config.block_size
        lcm = self.config.lcm_block_size
        hit_length = max_length
        full_hit: int | None = None
        while True:
            curr = hit_length
            for groups, need in self._spec_groups:
                if need is None:
                    if full_hit is None:
                        n = 0
                        while n < curr // bs and all((g, n) in held for g in groups):
                            n += 1
                        full_hit = n * bs
                    curr = min(curr, full_hit)
                else:
                    curr = _window_hit(held, groups, need, curr, bs, lcm)
            if curr >= hit_length:
                return hit_length
            hit_length = curr
            if self._simple_hybrid:
                return hit_length

    def allocate(
        self,
        req_id: str,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        num_external_tokens: int,
        load_async: bool,
    ) -> None:
        """``update_state_after_alloc``: the engine allocated blocks; a positive
        external count means a load from the store into them (async parks the
        request until every rank reported the load)."""
        tracker = self.trackers.get(req_id)
        if tracker is None or tracker.state is RequestState.FINISHED:
            tracker = self.trackers[req_id] = self._new_tracker(req_id)
        tracker.fire(_RE.ALLOCATE)
        tracker.block_ids = [list(t) for t in block_ids]
        if num_external_tokens > 0:
            tracker.load = (num_computed_tokens, num_computed_tokens + num_external_tokens)
            tracker.can_load = True
            self._load_queue.append(tracker)
            if load_async:
                tracker.fire(_RE.PARK_FOR_LOAD)

    def on_load_reports(self, reports: Sequence[LoadReport]) -> list[LoadResult]:
        """Collect per-rank load reports; a load is done when every rank reported."""
        done: list[LoadResult] = []
        for report in reports:
            key = (report.req_id, report.generation)
            got = self._loads_pending.setdefault(key, [])
            got.append(report)
            if len(got) < self.config.world_size:
                continue
            del self._loads_pending[key]
            failed = sorted({b for r in got for b in r.failed_block_ids})
            tracker = self.trackers.get(report.req_id)
            if tracker is not None and tracker.generation == report.generation:
                tracker.load = None
                tracker.can_load = False
                if tracker.state is RequestState.LOAD_PARKED:
                    tracker.fire(_RE.LOAD_FINISHED)
            done.append(LoadResult(report.req_id, report.generation, tuple(failed)))
        return done

    # ------------------------------------------------------------------
    # One scheduler step.

    def step(self, sched: SchedulerStep) -> Plan:
        """One step's plan, in upstream's order (the module docstring): each
        phase reads the scheduler output's part it names and adds to ``out``."""
        self._step += 1
        out = _StepOutput()
        if sched.preempted:
            self._refuse_scheduled_preemptions(sched, out)
        self._finish(sched.finished, out)
        self._preempt(sched.preempted, out)
        self._loading = self._blocks_loading() if self._load_queue else _NOTHING_LOADING
        self._admit(sched.new, out)
        if not self.config.is_consumer or self.config.save_decode_cache:
            self._continue(sched.cached, out)
        # Resumed after running: vLLM lists them last in the cached requests
        # (``_make_cached_request_data`` chains running, then resumed), so
        # upstream numbers their jobs after the running requests' jobs.
        self._resume(sched.resumed, out)
        self._plan_loads(out)
        # Scratch of this step only: a planner between steps holds no set of
        # tuples (the model checker's digest needs none, and it is stale).
        self._loading = _NOTHING_LOADING
        return out.plan(self._step)

    def _refuse_scheduled_preemptions(self, sched: SchedulerStep, out: _StepOutput) -> None:
        scheduled = {r.req_id for r in sched.new}
        scheduled.update(r.req_id for r in sched.cached)
        scheduled.update(r.req_id for r in sched.resumed)
        for req_id in sched.preempted:
            if req_id in scheduled:
                out.violations.append(Violation(
                    "S23", f"request {req_id!r} is scheduled in step {self._step}, the "
                    "step that preempts it"))

    def _finish(self, finished: Sequence[str], out: _StepOutput) -> None:
        for req_id in finished:
            tracker = self.trackers.pop(req_id, None)
            if tracker is None:
                continue  # finished before the connector ever saw it (abort in queue)
            self.quorum.request_finished(req_id)
            was_live = tracker.state is not RequestState.PREEMPTED
            tracker.fire(_RE.FINISH)
            self._loads_pending.pop(tracker.gen_key, None)
            if was_live:
                self._end(tracker, "finished", out)

    def _preempt(self, preempted: Sequence[str], out: _StepOutput) -> None:
        for req_id in preempted:
            tracker = self.trackers.get(req_id)
            if tracker is None or tracker.state in _NOT_RUNNING:
                out.violations.append(Violation(
                    "S23", f"preemption of request {req_id!r} that is not running "
                    f"(state {tracker.state.name if tracker else 'unknown'})"))
                continue
            tracker.fire(_RE.PREEMPT)
            tracker.load = None
            self._end(tracker, "preempted", out)

    def _end(self, tracker: Tracker, reason: str, out: _StepOutput) -> None:
        """A generation ends by the step's own output: finished or preempted."""
        (out.finished if reason == "finished" else out.preempted).append(tracker.gen_key)
        out.ended.append(GenerationEnd(tracker.req_id, tracker.generation, reason))
        self._end_generation(tracker, reason, out.pins, out.releases)

    def _admit(self, new_requests: Sequence[NewRequest], out: _StepOutput) -> None:
        variant = self.variant
        is_consumer = self.config.is_consumer
        events_on = self.config.enable_kv_events
        for new in new_requests:
            tracker = self.trackers.get(new.req_id)
            if tracker is not None and tracker.state in _RUNNING:
                out.violations.append(Violation(
                    "K2", f"request {new.req_id!r} scheduled as new while generation "
                    f"{tracker.generation} is still running"))
                self._end(tracker, "finished", out)
                tracker = None
            if tracker is None or tracker.state in (RequestState.PREEMPTED, RequestState.FINISHED):
                tracker = self.trackers[new.req_id] = self._new_tracker(new.req_id)
            if tracker.state in (RequestState.ABSENT, RequestState.LOOKUP_PENDING):
                tracker.fire(_RE.ALLOCATE)
            if tracker.state is RequestState.LOAD_PARKED:
                out.violations.append(Violation(
                    "S13", f"request {new.req_id!r} scheduled while parked for a load"))
                tracker.fire(_RE.LOAD_FINISHED)
            tracker.fire(_RE.SCHEDULE_PREFILL)
            out.started.append(GenerationStart(new.req_id, tracker.generation, "new",
                                               len(new.prompt_token_ids)))
            tracker.token_len = new.num_computed_tokens + new.num_scheduled_tokens
            tracker.block_ids = [list(t) for t in new.block_ids]
            tracker.hashes = list(new.block_hashes)
            tracker.prefill_end = len(new.prompt_token_ids)
            if events_on:
                tracker.token_ids = list(new.prompt_token_ids[:tracker.token_len])
            skip = variant.skip_prefill_save(is_consumer) or variant.skip_on_loading_step(
                tracker.can_load) or (bool(self._loading) and self._reads_loading(tracker))
            tracker.can_load = False
            self._maybe_save(tracker, skip, False, out.saves, out.pins)

    def _continue(self, cached_requests: Sequence[CachedRequest], out: _StepOutput) -> None:
        """Running requests: more prefill chunks or decode tokens. The hot path."""
        variant = self.variant
        config = self.config
        is_consumer = config.is_consumer
        bs = config.block_size
        events_on = config.enable_kv_events
        save_decode = config.save_decode_cache
        trackers = self.trackers
        for cached in cached_requests:
            tracker = trackers.get(cached.req_id)
            if tracker is None or tracker.ended:
                out.violations.append(Violation(
                    "S23", f"request {cached.req_id!r} scheduled as running but has no "
                    "live generation"))
                continue
            if cached.freed_positions:
                self._forget_freed(tracker, cached.freed_positions)
            is_decode = cached.num_computed_tokens >= tracker.prefill_end
            if is_decode and not save_decode:
                continue  # fast path: decode saving off, no tracker work at all
            if is_decode:
                if tracker.state is not RequestState.DECODING:
                    tracker.fire(_RE.SCHEDULE_DECODE)
                    if is_consumer:
                        tracker.num_saved_tokens = variant.consumer_decode_start(
                            tracker.prefill_end, bs)
                        tracker.save_at = variant.chunk_boundary(tracker.num_saved_tokens, bs)
            else:
                tracker.fire(_RE.SCHEDULE_PREFILL)
            computed = cached.num_computed_tokens
            if computed < tracker.token_len and variant.follow_rewinds:
                # vLLM rewound the request: a load failed and
                # kv_load_failure_policy=recompute set num_computed_tokens back
                # to the first failed block, so this step recomputes from
                # there. Counting its tokens on top of the old length planned
                # saves of tokens not computed yet (S7, found in the real
                # engine). Upstream's tracker slices all_token_ids from its
                # own length, which clamps at the sequence's end: the same
                # length after a rewind during prefill.
                tracker.token_len = computed
                if tracker.token_ids is not None:
                    del tracker.token_ids[computed:]
            tracker.token_len += len(cached.new_token_ids)
            if events_on and tracker.token_ids is not None:
                tracker.token_ids.extend(cached.new_token_ids)
            new_blocks = cached.new_block_ids
            if len(new_blocks) == 1:
                if new_blocks[0]:
                    tracker.block_ids[0].extend(new_blocks[0])
            else:
                for g, ids in enumerate(new_blocks):
                    if ids:
                        tracker.block_ids[g].extend(ids)
            if cached.new_block_hashes:
                tracker.hashes.extend(cached.new_block_hashes)
            if is_consumer and not is_decode:
                continue
            # save_at is the chunk boundary (a multiple of the block size), so
            # "a full block past it exists" is a plain comparison.
            if tracker.token_len < tracker.save_at:
                continue
            if self._loading and self._reads_loading(tracker):
                continue  # saved next step, once this step's loads reported
            self._maybe_save(tracker, False, is_decode, out.saves, out.pins)

    def _forget_freed(self, tracker: Tracker, freed: Sequence[Sequence[int]]) -> None:
        """The engine freed these table positions (a sliding-window group's
        blocks that left the window) and may already have handed the blocks
        to another request in this step: from now on the tracker's table
        holds the null block there, so no job reads or pins them (upstream's
        ``_apply_current_save_block_ids`` does the same with vLLM's current
        tables). A block the generation still pins stays (the pin keeps its
        bytes; the policy releases it by its id later). Ranks that were sent
        the block get the null block with the next job's slice, unless every
        rank has confirmed saving past it: a rank reads from its own saved
        offset on, never below (so in steady decode, where the window frees
        blocks long saved, the slices stay as small as without a window)."""
        holds = self.variant.pins.holds
        sent = tracker.sent_blocks
        saved_by_all = min(tracker.rank_confirmed) // self.config.block_size
        for g, positions in enumerate(freed):
            table = tracker.block_ids[g]
            for pos in positions:
                if pos < len(table) and table[pos] != NULL_BLOCK_ID and not holds(tracker, pos):
                    table[pos] = NULL_BLOCK_ID
                    if saved_by_all <= pos < sent[g]:
                        sent[g] = pos

    def _resume(self, resumed: Sequence[ResumedRequest], out: _StepOutput) -> None:
        config = self.config
        for res in resumed:
            old = self.trackers.get(res.req_id)
            if old is not None and old.state is RequestState.LOAD_PARKED:
                out.violations.append(Violation(
                    "S13", f"request {res.req_id!r} resumed while parked for a load"))
                old.fire(_RE.LOAD_FINISHED)
            if old is not None and old.state is RequestState.ALLOCATED:
                # Looked up (and possibly loaded) when vLLM re-admitted it:
                # the generation the lookup started resumes.
                tracker = old
                old = None
            else:
                if old is None or old.state is not RequestState.PREEMPTED:
                    out.violations.append(Violation(
                        "S23", f"resumption of request {res.req_id!r} that was not preempted "
                        f"(state {old.state.name if old else 'unknown'})"))
                    if old is not None and not old.ended:
                        self._end_generation(old, "preempted", out.pins, out.releases)
                tracker = self.trackers[res.req_id] = self._new_tracker(res.req_id)
            tracker.fire(_RE.RESUME)
            out.started.append(GenerationStart(
                res.req_id, tracker.generation, "resumed",
                old.prefill_end if old else len(res.all_token_ids)))
            loading = tracker.can_load
            tracker.can_load = False
            tracker.token_len = res.num_computed_tokens + res.num_scheduled_tokens
            tracker.block_ids = [list(t) for t in res.block_ids]
            tracker.hashes = list(res.block_hashes)
            # Upstream: the resumed tracker's prefill ends at everything known so far.
            tracker.prefill_end = len(res.all_token_ids)
            if config.enable_kv_events:
                tracker.token_ids = list(res.all_token_ids[:tracker.token_len])
            is_decode = res.num_computed_tokens >= tracker.prefill_end
            tracker.fire(_RE.SCHEDULE_DECODE if is_decode else _RE.SCHEDULE_PREFILL)
            if config.is_consumer and not (config.save_decode_cache and is_decode):
                continue
            skip = self.variant.skip_on_loading_step(loading) or (
                bool(self._loading) and self._reads_loading(tracker))
            self._maybe_save(tracker, skip, is_decode, out.saves, out.pins)

    def _blocks_loading(self) -> frozenset[tuple[int, int]]:
        """(group, block) pairs a load of this step fills (the loads
        `_plan_loads` is about to emit), when the variant defers saves over
        them; empty otherwise."""
        if not self.variant.defer_saves_over_loads:
            return _NOTHING_LOADING
        bs = self.config.block_size
        loading = set()
        for tracker in self._load_queue:
            if tracker.load is None or tracker.ended:
                continue
            start, end = tracker.load
            for g, table in enumerate(tracker.block_ids):
                for block in table[start // bs:cdiv(end, bs)]:
                    if block != NULL_BLOCK_ID:
                        loading.add((g, block))
        return frozenset(loading)

    def _reads_loading(self, tracker: Tracker) -> bool:
        """Whether this step's forward reads, for ``tracker``, a block a load
        of this step fills: its KV of this step rests on the load's outcome."""
        loading = self._loading
        upto = cdiv(tracker.token_len, self.config.block_size)
        return any((g, block) in loading
                   for g, table in enumerate(tracker.block_ids) for block in table[:upto])

    def _plan_loads(self, out: _StepOutput) -> None:
        """Load-only metas for requests allocated with an external hit since
        the last step (parked ones and synchronous loads alike)."""
        for tracker in self._load_queue:
            if tracker.load is not None and not tracker.ended:
                start, end = tracker.load
                out.loads.append(LoadMeta(
                    tracker.req_id, tracker.generation, start, end,
                    tuple(tuple(t) for t in tracker.block_ids), tuple(tracker.hashes)))
        self._load_queue.clear()

    def _maybe_save(
        self, tracker: Tracker, skip: bool, is_decode: bool, saves: list[SaveMeta],
        pins: list[int],
    ) -> None:
        """Upstream's ``ReqMeta.from_request_tracker`` plus job id and pins."""
        bs = self.config.block_size
        start = tracker.num_saved_tokens
        to_save = tracker.token_len // bs * bs
        if skip or to_save < tracker.save_at:
            return
        tracker.num_saved_tokens = to_save
        tracker.save_at = self.variant.chunk_boundary(to_save, bs)
        token_ids = None
        if tracker.token_ids is not None:
            token_ids = self.variant.token_snapshot(tracker.token_ids, start, to_save)
        bstart, blocks, hstart, hashes = self.variant.metadata.slice(tracker)
        job_id = self._next_job_id
        self._next_job_id += 1
        saves.append(SaveMeta(
            tracker.req_id, tracker.generation, job_id, start, to_save, tracker.prefill_end,
            is_decode, bstart, blocks, hstart, hashes, token_ids,
        ))
        book = self.jobs[job_id] = JobBook(job_id, tracker)
        tracker.outstanding += 1
        self.variant.pins.on_job(tracker, book, to_save, bs, pins)

    def _end_generation(
        self, tracker: Tracker, reason: str, pins: list[int], releases: list[int]
    ) -> None:
        tracker.ended = True
        books = [b for b in self.jobs.values() if b.tracker is tracker] if tracker.outstanding else []
        self.variant.pins.on_generation_end(tracker, reason, books, pins, releases)
        if tracker.outstanding == 0:
            self._settle_generation(tracker, releases)
        else:
            self.closing[tracker.gen_key] = tracker

    def _settle_generation(self, tracker: Tracker, releases: list[int]) -> int:
        self.closing.pop(tracker.gen_key, None)
        self.variant.pins.on_drained(tracker, releases)
        dropped = self.quorum.generation_settled(tracker.gen_key)
        if tracker.gen_key[0] not in self.trackers:
            self.quorum.request_finished(tracker.gen_key[0])  # late reports may have recorded it
        return dropped

    # ------------------------------------------------------------------
    # Reports.

    def on_reports(self, reports: Sequence[Report]) -> Settlement:
        """``update_connector_output``: count reports, release pins, publish events."""
        releases: list[int] = []
        released: list[int] = []
        published: list[BlockStored] = []
        published_by: list[tuple[str, int]] = []
        violations: list[Violation] = []
        dropped = 0
        world = self.config.world_size
        bs = self.config.block_size
        pins = self.variant.pins
        for report in reports:
            book = self.jobs.get(report.job_id)
            if book is None:
                violations.append(Violation(
                    "S4", f"report for unknown or already released job {report.job_id} "
                    f"from rank {report.rank}"))
                continue
            if report.rank in book.ranks or not 0 <= report.rank < world:
                violations.append(Violation(
                    "S4", f"job {report.job_id}: rank {report.rank} reported twice or is not "
                    f"one of the {world} ranks"))
                continue
            book.ranks.add(report.rank)
            tracker = book.tracker
            if report.confirmed_offset > tracker.rank_confirmed[report.rank]:
                tracker.rank_confirmed[report.rank] = report.confirmed_offset
                pins.on_report(tracker, bs, releases)
            if report.events:
                ready = self.quorum.add(tracker.gen_key, report.rank, report.events)
                if ready:
                    published.extend(ready)
                    published_by.extend([tracker.gen_key] * len(ready))
            if len(book.ranks) == world:
                # The job's last rank reported: the job machine's final step, taken
                # once for the job (the ranks' copies each ended at REPORTED).
                JOB.fire(report.job_id, JobState.REPORTED, JobEvent.RELEASE)
                del self.jobs[report.job_id]
                released.append(report.job_id)
                pins.on_job_released(book, releases)
                tracker.outstanding -= 1
                if tracker.ended and tracker.outstanding == 0:
                    dropped += self._settle_generation(tracker, releases)
        self.quorum.batch_ended()
        return Settlement(tuple(releases), tuple(released), tuple(published), dropped,
                          tuple(violations), tuple(published_by))

    # ------------------------------------------------------------------

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while any job awaits its reports."""
        return bool(self.jobs)

    def live_state_size(self) -> dict[str, int]:
        """What the planner still holds (all zero at settlement)."""
        return {
            "trackers": len(self.trackers),
            "jobs": len(self.jobs),
            "closing_generations": len(self.closing),
            "pending_events": self.quorum.pending(),
            "pending_loads": len(self._loads_pending),
        }
