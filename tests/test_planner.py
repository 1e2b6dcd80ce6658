"""Scheduler-side behaviour, as scenarios (upstream's build_connector_meta; decode saving)."""

from __future__ import annotations

from kvstate.config import ConnectorConfig, Role
from kvstate.harness import Harness
from kvstate.keys import chain_hashes
from kvstate.planner import Planner
from kvstate.records import CachedRequest, NewRequest, Report, ResumedRequest, SchedulerStep
from kvstate.scenarios import prompt, run
from kvstate.tables import JobState, RequestState


def saves(h: Harness):
    return [m for plan in h.plans for m in plan.saves]


def test_decode_saving_is_off_by_default_and_decode_steps_skip_the_tracker() -> None:
    h = Harness(ConnectorConfig(block_size=4), num_blocks=32)
    h.add("a", prompt(8), max_new_tokens=12)
    h.step()
    tracker = h.planner.trackers["a"]
    assert [(m.token_ids_start, m.token_len) for m in saves(h)] == [(0, 8)]
    token_len = tracker.token_len
    for _ in range(10):
        h.step()
        h.run_ranks()
    assert [(m.token_ids_start, m.token_len) for m in saves(h)] == [(0, 8)]
    assert tracker.token_len == token_len  # fast path: no tracker work at all
    h.settle()
    assert h.monitor.findings == []


def test_consumer_first_decode_save_backfills_the_block_aligned_prompt() -> None:
    h = run("consumer-backfill", "kvstate")
    metas = saves(h)
    assert metas[0].is_decode and metas[0].token_ids_start == 0
    assert metas[0].token_len == 8  # the 10-token prompt, block aligned
    assert all(m.is_decode for m in metas)  # a consumer never saves prefill
    # Without save_decode_cache a consumer saves nothing at all.
    quiet = Harness(ConnectorConfig(role=Role.CONSUMER, block_size=4), num_blocks=32)
    quiet.add("a", prompt(10), max_new_tokens=10)
    quiet.settle()
    assert saves(quiet) == [] and quiet.store.objects == {}


def test_only_full_blocks_are_saved_with_the_plus_one_boundary() -> None:
    h = run("decode-save", "kvstate")
    spans = [(m.token_ids_start, m.token_len) for m in saves(h)]
    assert spans == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert all(end % 4 == 0 and end > start for start, end in spans)
    # The pre-#653 boundary emits a job with nothing new right after each block.
    bad = run("decode-save", "boundary-without-plus-one")
    assert any(m.token_len == m.token_ids_start for m in saves(bad))


def test_token_snapshot_only_with_kv_events_and_only_the_new_suffix() -> None:
    h = run("snapshot-events", "kvstate")
    tokens = list(h["a"].tokens)
    for meta in saves(h):
        assert meta.token_ids == tuple(tokens[meta.token_ids_start:meta.token_len])
    off = run("decode-save", "kvstate")  # same shape, events on
    assert all(m.token_ids is not None for m in saves(off))
    plain = Harness(ConnectorConfig(block_size=4, save_decode_cache=True), num_blocks=32)
    plain.add("a", prompt(8), max_new_tokens=6)
    plain.settle()
    assert all(m.token_ids is None for m in saves(plain))
    assert plain.planner.trackers == {}


def test_delta_metadata_carries_only_new_blocks_and_hashes() -> None:
    h = run("decode-save", "kvstate")
    for meta in saves(h)[1:]:
        assert len(meta.block_ids[0]) <= 1 and len(meta.block_hashes) <= 1
    full = run("decode-save", "e2")
    last = saves(full)[-1]
    assert last.block_ids_start == 0 and len(last.block_ids[0]) == 4


def test_async_completion_releases_pins_only_after_every_rank_reported() -> None:
    config = ConnectorConfig(block_size=4, world_size=2)
    for variant in ("kvstate", "e2"):
        h = Harness(config, variant, num_blocks=16)
        h.add("a", prompt(8))
        plan = h.step()
        pinned = sorted(plan.pins)
        assert pinned == sorted(h["a"].blocks[0])
        h.run_rank(0)
        h.deliver_reports()
        assert all(h.pool.refs[b] == 2 for b in pinned), variant  # engine + pin
        h.run_rank(1)
        h.deliver_reports()
        assert all(h.pool.refs[b] == 1 for b in pinned), variant
        assert not h.planner.has_pending_push_work()


def test_incremental_pins_pin_each_block_once_per_generation() -> None:
    h = run("decode-save", "kvstate")
    pins = [b for plan in h.plans for b in plan.pins]
    assert len(pins) == len(set(pins)) == 4
    per_job = run("decode-save", "e2")
    counts = [len(plan.pins) for plan in per_job.plans if plan.saves]
    # Upstream pins every allocated block again for every job.
    assert counts == sorted(counts) and counts[-1] >= 4 and sum(counts) > 4 * len(counts) // 2


def test_resumed_request_is_a_new_generation_with_a_replaced_block_table() -> None:
    h = run("preempt-with-queued-job", "kvstate")
    started = [s for plan in h.plans for s in plan.started]
    assert [s.reason for s in started] == ["new", "resumed"]
    assert started[0].generation != started[1].generation
    first, second = saves(h)[0], saves(h)[1]
    assert second.generation == started[1].generation
    assert second.block_ids_start == 0 and set(second.block_ids[0]).isdisjoint(first.block_ids[0])


def test_load_path_parks_then_loads_and_never_saves_on_a_loading_step() -> None:
    h = run("load-async", "kvstate")
    loads = [load for plan in h.plans for load in plan.loads]
    assert [(load.req_id, load.start_token, load.end_token) for load in loads] == [("b", 0, 8)]
    load_step = next(plan for plan in h.plans if plan.loads)
    assert not load_step.saves
    b_saves = [m for m in saves(h) if m.req_id == "b"]
    assert b_saves and b_saves[0].token_len == 12  # after the load, b saves what it computed
    sync = run("load-hit", "kvstate")
    sync_step = next(plan for plan in sync.plans if plan.loads)
    assert all(m.req_id != "b" for m in sync_step.saves)


def test_failed_loads_are_reported_for_recompute() -> None:
    h = run("load-evicted", "kvstate")
    assert h.monitor.findings == []
    assert len(h.store.objects) == 3


def test_job_ids_strictly_increase() -> None:
    h = run("shared-prefix", "kvstate")
    ids = [m.job_id for m in saves(h)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def _one_job(world: int = 2):
    config = ConnectorConfig(block_size=4, world_size=world)
    planner = Planner(config)
    hashes = tuple(chain_hashes(list(range(8)), 4))
    plan = planner.step(SchedulerStep(new=(NewRequest("a", tuple(range(8)), 0, 8, ((1, 2),),
                                                      hashes),)))
    return planner, plan.saves[0]


def test_more_reports_than_ranks_and_unknown_jobs_are_violations() -> None:
    planner, meta = _one_job()
    ok = [Report(meta.job_id, r, "a", meta.generation, JobState.STORED, 8) for r in (0, 1)]
    settled = planner.on_reports(ok)
    assert settled.released_jobs == (meta.job_id,) and sorted(settled.releases) == [1, 2]
    extra = planner.on_reports([ok[0]])
    assert [v.invariant for v in extra.violations] == ["S4"]
    assert "unknown or already released job" in extra.violations[0].message
    planner2, meta2 = _one_job()
    twice = planner2.on_reports([ok[0].__class__(meta2.job_id, 0, "a", meta2.generation,
                                                 JobState.STORED, 8)] * 2)
    assert [v.invariant for v in twice.violations] == ["S4"]


def test_request_states_follow_the_table() -> None:
    planner, meta = _one_job(world=1)
    tracker = planner.trackers["a"]
    assert tracker.state is RequestState.PREFILLING
    planner.step(SchedulerStep(cached=(CachedRequest("a", 8, (8,), ((),)),)))
    assert tracker.state is RequestState.PREFILLING  # decode saving off: fast path
    planner.step(SchedulerStep(preempted=("a",)))
    assert tracker.state is RequestState.PREEMPTED
    planner.step(SchedulerStep(resumed=(ResumedRequest("a", tuple(range(9)), 0, 9, ((3, 4, 5),),
                                                       ()),)))
    resumed = planner.trackers["a"]
    assert resumed is not tracker and resumed.state is RequestState.PREFILLING
    planner.step(SchedulerStep(finished=("a",)))
    assert resumed.state is RequestState.FINISHED and "a" not in planner.trackers
