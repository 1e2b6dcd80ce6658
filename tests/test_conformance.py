"""vLLM 0.33.0's shipped MooncakeStore connector and kvstate's ``e2``, fed one schedule.

Each test is a scenario run through ``adapters.vllm.conformance.Conformance``,
which compares both sides after every step (save jobs, store calls per rank,
completions, KV events, rank state, pins, reference counts) and keeps every
difference. A conforming scenario must end with none; the negative controls run a
mutant of ``e2`` and must be caught where its bug lives. Deliberate differences and
upstream hazards are in ``specs/conformance.md``. The second half runs a hybrid model
(full attention and a sliding window): per-group jobs, keys, masks, events, pins and
lookups, the found divergences F4 and F5, and the group-rule mutants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from kvstate.events import ValueCountQuorum
from kvstate.variants import Variant, get_variant

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm")

from adapters.vllm.conformance import (  # noqa: E402
    ALL,
    RULE_MUTANTS,
    AppendOnlyTablesPlanner,
    Conformance,
    Divergence,
    DivergenceError,
    Fault,
    Setup,
    random_run,
)

NO_AVAILABLE_HANDLE = -200
TRANSFER_FAIL = -800


def prompt(n: int, base: int = 1) -> list[int]:
    return list(range(base, base + n))


@pytest.fixture
def runs() -> Iterator[Callable[..., Conformance]]:
    made: list[Conformance] = []

    def make(setup: Setup | None = None, variant: str | Variant = "e2",
             faults: tuple[Fault, ...] = (), **options: Any) -> Conformance:
        run = Conformance(setup or Setup(), variant, faults, **options)
        made.append(run)
        return run

    yield make
    for run in made:
        run.close()


def settle(run: Conformance, steps: int = 3) -> None:
    """Keep stepping with every rank draining its queue (pins must drain too)."""
    run.steps(steps)


# --------------------------------------------------------------------------
# Scenarios that must conform.


@pytest.mark.parametrize("kv_events", [False, True], ids=["events-off", "events-on"])
def test_prompt_then_decode_saves_each_new_full_block(runs, kv_events):
    run = runs(Setup(save_decode_cache=True, kv_events=kv_events))
    run.add("a", prompt(40), max_tokens=30)
    run.steps(30)
    settle(run)
    run.assert_conforms()
    # The prompt's 2 full blocks, then one job per block decode fills (48, 64).
    assert len(run.store_up.objects) == 4
    assert run.scheduler._pinned_saves == {}
    if kv_events:
        assert len(run.published_upstream) == 4


@pytest.mark.parametrize("kv_events", [False, True], ids=["events-off", "events-on"])
def test_shared_prefix_is_stored_once(runs, kv_events):
    run = runs(Setup(kv_events=kv_events))
    run.add("a", prompt(48), max_tokens=2)
    run.step()
    run.add("b", prompt(32) + prompt(20, base=900), max_tokens=2)
    run.step()
    settle(run)
    run.assert_conforms()
    # b found a's two shared chunks present and put only its own third.
    assert len(run.store_up.objects) == 4


def test_preemption_with_a_queued_job_then_resumption(runs):
    run = runs(Setup(save_decode_cache=True, kv_events=True))
    run.add("a", prompt(40), max_tokens=40)
    run.step(jobs=0)  # the prompt job stays queued
    run.step(jobs=0, preempt=["a"])  # the queued job is now stale
    run.step()  # it runs, makes no store call, still reports (pins released)
    assert run.store_up.objects == {}
    run.step(resume=["a"])
    run.steps(20)
    settle(run)
    run.assert_conforms()
    assert run.scheduler._pinned_saves == {}


@pytest.mark.parametrize("gap", [1, 0], ids=["reuse-later", "reuse-next-step"])
def test_request_id_reused_after_finish_with_a_stale_job(runs, gap):
    run = runs(Setup(save_decode_cache=True, kv_events=True))
    run.add("a", prompt(40), max_tokens=1)
    run.step(jobs=0)  # a finishes with its prompt job queued
    for _ in range(gap):
        run.step(jobs=0)
    run.add("a", prompt(56, base=500), max_tokens=20)
    run.steps(25)
    settle(run)
    if gap == 0:
        # Upstream crashes here (specs/conformance.md, "id reuse in the next step").
        first = run.first_divergence
        assert first is not None and first.field == "upstream build_connector_meta raised"
        assert "AssertionError" in first.upstream
        return
    run.assert_conforms()


def test_reused_id_inherits_the_stale_generations_saved_offset(runs):
    """Upstream hazard (specs/conformance.md, H2): the reused id shares the old
    generation's ledger entry, the old job writes its offset there, and the new
    prompt's first chunks are never stored. e2 reproduces it step for step."""
    run = runs(Setup(kv_events=True))
    run.add("a", prompt(40), max_tokens=1)
    run.step(jobs=0)  # a finishes; its prompt job stays queued
    run.step(jobs=0)  # the finish is deferred: the job is still live
    new_prompt = prompt(56, base=500)
    run.add("a", new_prompt, max_tokens=1)
    run.step()  # the old job stores the old prompt and sets offset 32; the new one starts there
    settle(run)
    run.assert_conforms()
    new_first_chunk = run.engine.requests["a"].req.block_hashes[0].hex()
    assert not any(k.endswith(new_first_chunk) for k in run.store_up.objects)
    assert len(run.store_up.objects) == 3  # old chunks 0-1, new chunk 2 only
    # ...and the new chunk 2's event names a parent no event ever announced (K4).
    announced = {e[0][0] for e in run.published_upstream}
    orphans = [e for e in run.published_upstream if e[1] is not None and e[1] not in announced]
    assert len(orphans) == 1


def test_no_space_then_recovery_while_other_jobs_find_their_keys(runs):
    run = runs(Setup(kv_events=True, save_decode_cache=True),
               faults=(Fault("put", 0, nth=2, code=NO_AVAILABLE_HANDLE),))
    run.add("a", prompt(32), max_tokens=1)
    run.step()  # a's prompt is stored
    run.add("b", prompt(40, base=300), max_tokens=30)
    run.step()  # b's put answers -200: pressure on, b skipped
    upstream, _ = run.rank_state(0)
    assert upstream["pressure"] and upstream["skip set"] == ("b",)
    run.add("c", prompt(32), max_tokens=1)
    run.step()  # c finds a's keys present: that clears nothing upstream
    upstream, _ = run.rank_state(0)
    assert upstream["pressure"] and upstream["skip set"] == ("b",)
    run.steps(10)  # b's decode jobs are skipped, keeping their tokens as retry state
    assert run.rank_state(0)[0]["retry suffix"]["b"][0] == 0
    run.add("d", prompt(33, base=700), max_tokens=1)
    run.step()  # d's put succeeds: pressure and skip set cleared
    upstream, _ = run.rank_state(0)
    assert not upstream["pressure"] and upstream["skip set"] == ()
    run.steps(20)
    settle(run)
    run.assert_conforms()


def test_put_that_raises_is_reported_and_retried(runs):
    run = runs(Setup(kv_events=True, save_decode_cache=True),
               faults=(Fault("put", 0, nth=1, raises=True),))
    run.add("a", prompt(40), max_tokens=30)
    run.steps(30)
    settle(run)
    run.assert_conforms()
    assert len(run.store_up.objects) == 4


def test_exists_check_that_raises(runs):
    run = runs(Setup(kv_events=True, save_decode_cache=True),
               faults=(Fault("exists", 0, nth=1, raises=True),))
    run.add("a", prompt(40), max_tokens=30)
    run.steps(30)
    settle(run)
    run.assert_conforms()


def test_partial_failure_keeps_the_offset_and_retries(runs):
    run = runs(Setup(kv_events=True, save_decode_cache=True),
               faults=(Fault("put", 0, nth=1, code=TRANSFER_FAIL, index=1),))
    run.add("a", prompt(48), max_tokens=30)
    run.steps(30)
    settle(run)
    run.assert_conforms()


@pytest.mark.parametrize("put_step", [1, 2])
@pytest.mark.parametrize("kv_events", [False, True], ids=["events-off", "events-on"])
def test_two_ranks(runs, put_step, kv_events):
    run = runs(Setup(world_size=2, put_step=put_step, kv_events=kv_events,
                     save_decode_cache=True))
    run.add("a", prompt(72), max_tokens=30)
    run.step()
    run.add("b", prompt(48), max_tokens=20)
    run.steps(30)
    settle(run)
    run.assert_conforms()
    if kv_events:
        assert run.published_upstream


def test_lagging_rank(runs):
    run = runs(Setup(world_size=2, kv_events=True, save_decode_cache=True))
    run.add("a", prompt(40), max_tokens=40)
    for _ in range(20):
        run.step(jobs={0: ALL})  # rank 1 runs nothing: pins wait for it
    assert run.scheduler._pinned_saves
    run.step(jobs={0: ALL, 1: 2})
    run.steps(25)
    settle(run)
    run.assert_conforms()


@pytest.mark.parametrize("ending", ["finish", "preempt"])
def test_request_ends_while_a_put_blocks(runs, ending):
    run = runs(Setup(kv_events=True, save_decode_cache=True),
               faults=(Fault("put", 0, nth=1, blocks=True),))
    run.add("a", prompt(40), max_tokens=40)
    run.step()  # the prompt job blocks inside its put
    if ending == "finish":
        run.step(finish=["a"])
    else:
        run.step(preempt=["a"])
    run.step()
    run.step(release=[0])
    if ending == "preempt":
        run.step(resume=["a"])
        run.steps(20)
    settle(run)
    run.assert_conforms()
    assert run.scheduler._pinned_saves == {}


def test_running_and_resumed_jobs_in_one_step_are_numbered_like_vllm(runs):
    """vLLM lists running requests before resumed ones; upstream numbers their
    jobs in that order (specs/conformance.md, F3)."""
    run = runs(Setup(chunk=16, kv_events=True))
    run.add("a", prompt(64), max_tokens=2)
    run.add("b", prompt(20, base=300), max_tokens=10)
    run.step()
    run.step(preempt=["b"])
    run.step(resume=["b"])  # a's third chunk (running) and b's recompute (resumed) both save
    settle(run)
    run.assert_conforms()
    assert [job[1] for job in run.save_jobs[3]] == ["a", "b"]


@pytest.mark.parametrize("strict", [False, True], ids=["per-step-multiset", "strict-order"])
def test_publication_order_within_a_step(runs, strict):
    """Known difference D1: upstream publishes a step's events in order of first
    report, e2 in order of quorum completion."""
    run = Conformance(Setup(world_size=2, chunk=32, kv_events=True),
                      faults=(Fault("exists", 1, nth=1, raises=True),),
                      strict_event_order=strict)
    try:
        run.add("a", prompt(48), max_tokens=1)
        run.step()  # rank 0 reports a's chunks 0-1; rank 1's existence check raises
        run.add("c", prompt(20, base=300), max_tokens=1)
        run.step()  # rank 1 retries a's chunks after c's job: a0 completes after c0
        settle(run)
    finally:
        run.close()
    if not strict:
        run.assert_conforms()
        return
    first = run.first_divergence
    assert first is not None and first.field == "published KV events"
    assert sorted(first.upstream, key=repr) == sorted(first.kvstate, key=repr)
    assert first.upstream != first.kvstate


@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_conform(seed):
    run = random_run(seed)
    run.assert_conforms()


# --------------------------------------------------------------------------
# Negative controls: a mutant must be caught where its bug lives.


def _events_run(run: Conformance) -> None:
    run.add("a", prompt(40), max_tokens=30)
    run.steps(30)


def _failure_run(run: Conformance) -> None:
    run.add("a", prompt(48), max_tokens=30)
    run.steps(30)


def _raising_put_run(run: Conformance) -> None:
    run.add("a", prompt(40), max_tokens=3)
    run.steps(4)


def _preemption_run(run: Conformance) -> None:
    run.add("a", prompt(40), max_tokens=30)
    run.step(jobs=0)
    run.step(jobs=0, preempt=["a"])
    run.steps(2)


def _lagging_run(run: Conformance) -> None:
    run.add("a", prompt(40), max_tokens=30)
    run.step(jobs=0)
    run.steps(2)


def _failed_then_preempted_run(run: Conformance) -> None:
    run.add("a", prompt(40), max_tokens=30)
    run.step()  # the put raises: the job's tokens stay as retry state
    run.step(preempt=["a"])


def _shared_prefix_run(run: Conformance) -> None:
    run.add("a", prompt(48), max_tokens=2)
    run.step()
    run.add("b", prompt(32) + prompt(20, base=900), max_tokens=2)
    run.steps(3)


@pytest.mark.parametrize(
    ("variant", "scenario", "faults", "field"),
    [
        ("parent-previous-emitted", _events_run, (), "emitted KV events"),
        ("skip-exists-check", _shared_prefix_run, (), "store calls"),
        ("advance-offset-on-failure", _failure_run,
         (Fault("put", 0, nth=1, code=TRANSFER_FAIL, index=1),), "saved offset"),
        ("snapshot-from-zero", _events_run, (), "token snapshot"),
        ("boundary-without-plus-one", _events_run, (), "save jobs"),
        ("key-without-rank", _shared_prefix_run, (), "store calls"),
        ("missing-finally", _raising_put_run, (Fault("put", 0, nth=1, raises=True),),
         "completions"),
        ("no-pins-on-preemption", _preemption_run, (), "pins"),
        ("delayed-free-at-finish", _lagging_run, (), "pins"),
        ("retry-keyed-by-request", _failed_then_preempted_run,
         (Fault("put", 0, nth=1, raises=True),), "retry suffix"),
    ],
)
def test_mutant_diverges_where_its_bug_lives(runs, variant, scenario, faults, field):
    setup = Setup(kv_events=True, save_decode_cache=True)
    if variant == "key-without-rank":
        setup = Setup(world_size=2, kv_events=True)
    run = runs(setup, variant, faults)
    scenario(run)
    first = run.first_divergence
    assert first is not None, f"{variant} was not told apart from upstream"
    assert field in first.field, str(first)
    with pytest.raises(DivergenceError, match=variant):
        run.assert_conforms()


def test_divergence_message_names_step_rank_and_field():
    text = str(Divergence(7, 1, "saved offset", {"a": 32}, {"a": 48}))
    assert text.startswith("step 7, rank 1, saved offset:")
    assert "upstream: {'a': 32}" in text and "kvstate:  {'a': 48}" in text


# The save-path mutants of e2 (the load path, the consumer role and the loading
# step are outside this harness: specs/conformance.md, "What is not compared").
SAVE_PATH_MUTANTS = (
    "req-id-counter-ledger", "no-pins-on-preemption", "delayed-free-at-finish",
    "parent-previous-emitted", "retry-keyed-by-request", "missing-finally",
    "boundary-without-plus-one", "consumer-without-backfill", "advance-offset-on-failure",
    "stride-by-relative-chunk", "skip-exists-check", "snapshot-from-zero", "key-without-rank",
    "e1", "e0",
)


@pytest.mark.parametrize("variant", SAVE_PATH_MUTANTS)
def test_random_schedules_tell_the_mutant_apart(variant):
    for seed in range(40):
        if random_run(seed, variant=variant).first_divergence is not None:
            return
    pytest.fail(f"{variant}: no divergence in 40 random schedules")



# --------------------------------------------------------------------------
# Two KV-cache groups: full attention (group 0) and a sliding window (group 1),
# one block size, blocks from vLLM's own KVCacheManager (the window's blocks
# are freed and nulled as they leave it). specs/conformance.md, "Two KV-cache
# groups": what is compared, D7-D9, F4, F5.

WINDOW = 20  # tokens: a hit at a block boundary needs the 2 blocks before it


def hybrid(**kwargs) -> Setup:
    return Setup(sliding_window=kwargs.pop("sliding_window", WINDOW), **kwargs)


def keys_of(objects, group: int) -> list[str]:
    return sorted(k for k in objects if f"@group:{group}@" in k)


@pytest.mark.parametrize("kv_events", [False, True], ids=["events-off", "events-on"])
def test_hybrid_prompt_then_decode_saves(runs, kv_events):
    """A 72-token prompt in one step, then decode saves: both groups store
    every chunk (each job is planned before its window blocks are freed), the
    window's events name group 1, and later jobs' tables show the blocks
    vLLM freed as the null block, in kvstate's as in upstream's (so D8's
    normalisation never applies: F4's fix)."""
    run = runs(hybrid(save_decode_cache=True, kv_events=kv_events))
    run.add("a", prompt(72), max_tokens=30)
    run.steps(30)
    settle(run)
    run.assert_conforms()
    assert len(keys_of(run.store_up.objects, 0)) == len(keys_of(run.store_up.objects, 1)) == 6
    assert "window tables" not in run.normalised
    assert run.scheduler._pinned_saves == {}
    if kv_events:
        assert sorted(e[4] for e in run.published_upstream) == [0] * 6 + [1] * 6


def test_hybrid_chunked_prefill_frees_window_blocks_between_jobs(runs):
    run = runs(hybrid(chunk=16, kv_events=True))
    run.add("a", prompt(72), max_tokens=2)
    run.steps(7)
    settle(run)
    run.assert_conforms()
    # Later prefill jobs' window tables hold the blocks that left the window
    # as the null block, kvstate's (told what vLLM freed) as upstream's: no
    # D8 normalisation was needed.
    assert "window tables" not in run.normalised
    assert len(keys_of(run.store_up.objects, 1)) == 4


def test_hybrid_preemption_with_a_queued_job_then_resumption(runs):
    run = runs(hybrid(save_decode_cache=True, kv_events=True, chunk=32))
    run.add("a", prompt(72), max_tokens=20)
    run.step()
    run.step(jobs=0)  # the second chunk's job stays queued
    run.step(jobs=0, preempt=["a"])  # ... and is stale now
    run.step()
    run.step(resume=["a"])
    run.steps(25)
    settle(run)
    run.assert_conforms()
    assert run.scheduler._pinned_saves == {}


@pytest.mark.parametrize(("world", "put_step"), [(2, 1), (2, 2)])
def test_hybrid_two_ranks_with_a_lagging_rank(runs, world, put_step):
    run = runs(hybrid(world_size=world, put_step=put_step, kv_events=True,
                      save_decode_cache=True, chunk=32))
    run.add("a", prompt(72), max_tokens=20)
    for _ in range(6):
        run.step(jobs={0: ALL})  # rank 1 runs nothing: pins wait for it
    assert run.scheduler._pinned_saves
    run.step(jobs={0: ALL, 1: 2})
    run.add("b", prompt(48) + prompt(20, base=900), max_tokens=5)
    run.steps(20)
    settle(run)
    run.assert_conforms()
    assert run.lookup(prompt(72) + prompt(8, base=700)) == (64, 64)


def test_hybrid_shared_prefix_is_stored_once_and_hits(runs):
    run = runs(hybrid(kv_events=True))
    run.add("a", prompt(48), max_tokens=2)
    run.step()
    run.add("b", prompt(32) + prompt(20, base=900), max_tokens=2)
    run.step()
    settle(run)
    # a's three chunks and b's own third, in both groups.
    assert len(keys_of(run.store_up.objects, 0)) == len(keys_of(run.store_up.objects, 1)) == 4
    assert run.lookup(prompt(32) + prompt(20, base=900)) == (48, 48)
    assert run.lookup(prompt(48) + prompt(5, base=300)) == (48, 48)
    assert run.lookup(prompt(40)) == (32, 32)  # a prompt the store fully holds: its last token recomputed
    assert run.lookup(prompt(15)) == (0, 0)
    run.assert_conforms()
    assert run.normalised["lookup key order"] > 0


def test_hybrid_lookup_with_window_chunks_missing(runs):
    """Upstream's window rule: a hit needs every full-attention chunk up to
    it but only the 2 window chunks before its boundary."""
    run = runs(hybrid())
    run.add("a", prompt(72), max_tokens=1)
    run.steps(3)
    longer = prompt(72) + prompt(8, base=700)
    assert run.lookup(longer) == (64, 64)
    run.evict(prompt(72), chunk=0, group=1)
    assert run.lookup(longer) == (64, 64)  # chunk 0 is out of every window
    run.evict(prompt(72), chunk=3, group=1)
    assert run.lookup(longer) == (48, 48)  # the window before 48 is held
    run.evict(prompt(72), chunk=2, group=1)
    assert run.lookup(longer) == (0, 0)  # no 2 window chunks in a row
    run.assert_conforms()


def test_hybrid_lookup_with_a_full_attention_chunk_missing(runs):
    run = runs(hybrid())
    run.add("a", prompt(72), max_tokens=1)
    run.steps(3)
    run.evict(prompt(72), chunk=2, group=0)
    assert run.lookup(prompt(72) + prompt(8, base=700)) == (32, 32)
    run.assert_conforms()


@pytest.mark.parametrize("seed", range(6))
def test_random_hybrid_schedules_conform_without_retries(seed):
    run = random_run(seed, hybrid=True, retries=False)
    run.assert_conforms()


# F4: a retry over chunks that left the window. Found by this harness, fixed
# in kvstate's planner (CachedRequest.freed_positions); the planner as it was,
# AppendOnlyTablesPlanner, is the negative control (specs/conformance.md, F4).

F4_SETUP = Setup(sliding_window=4, kv_events=True, chunk=32)
F4_FAULTS = (Fault("put", 0, nth=1, code=TRANSFER_FAIL),)


def _f4_run(run: Conformance) -> None:
    run.add("a", prompt(72), max_tokens=2)
    run.steps(6)


def test_f4_the_append_only_planner_reads_a_freed_window_block_on_a_retry():
    """The first job's put fails; by the next job vLLM freed window chunk 0
    (it left the 4-token window) and gave its block to full attention's
    chunk 2. Upstream's retry skips the chunk (null in the current table);
    the planner as it was still lists the freed block and its rank stores
    that block's bytes (full attention's chunk 2) under window chunk 0's key."""
    run = Conformance(F4_SETUP, faults=F4_FAULTS, planner_cls=AppendOnlyTablesPlanner)
    try:
        _f4_run(run)
    finally:
        run.close()
    first = run.first_divergence
    assert first is not None and first.step == 2 and first.field == "store calls"
    assert run.f4_explains(first)
    up_put = next(c for c in first.upstream if c.op == "put")
    ks_put = next(c for c in first.kvstate if c.op == "put")
    hashes = run.engine.requests["a"].req.block_hashes

    def block_put(call, group: int, chunk: int) -> int | None:
        ends = f"@group:{group}@{hashes[chunk].hex()}"
        return next((b for k, b in zip(call.keys, call.blocks) if k.endswith(ends)), None)

    assert block_put(up_put, 1, 0) is None
    assert block_put(ks_put, 1, 0) == block_put(ks_put, 0, 2) == block_put(up_put, 0, 2)


@pytest.mark.parametrize("strict", [False, True], ids=["normalised", "strict-window-tables"])
def test_f4_e2_told_what_vllm_freed_conforms(runs, strict):
    run = Conformance(F4_SETUP, faults=F4_FAULTS, strict_window_tables=strict)
    try:
        _f4_run(run)
        settle(run)
    finally:
        run.close()
    run.assert_conforms()
    assert "window tables" not in run.normalised


@pytest.mark.parametrize("seed", range(40))
def test_random_hybrid_schedules_conform_with_every_fault(seed):
    """With every fault and with lookups and evictions: e2 conforms; the
    planner as it was either conforms or diverges first by F4."""
    random_run(seed, hybrid=True).assert_conforms()
    run = random_run(seed, hybrid=True, planner_cls=AppendOnlyTablesPlanner)
    if run.first_divergence is not None:
        assert run.f4_explains(run.first_divergence), str(run.first_divergence)


# Named differences.


def test_d8_strict_window_tables_show_the_append_only_mirror_and_none_since_f4s_fix(runs):
    """D8 was the planner's append-only mirror listing blocks vLLM freed;
    told what vLLM freed, kvstate's tables equal upstream's strictly."""
    fixed = runs(hybrid(chunk=16, kv_events=True), strict_window_tables=True)
    fixed.add("a", prompt(72), max_tokens=2)
    fixed.steps(7)
    settle(fixed)
    fixed.assert_conforms()
    run = Conformance(hybrid(chunk=16, kv_events=True), strict_window_tables=True,
                      planner_cls=AppendOnlyTablesPlanner)
    try:
        run.add("a", prompt(72), max_tokens=2)
        run.steps(7)
    finally:
        run.close()
    first = run.first_divergence
    assert first is not None and first.field.endswith("block_ids")
    up_window, ks_window = first.upstream[1], first.kvstate[1]
    assert 0 in up_window and 0 not in ks_window
    assert [b for b in up_window if b] == [b for b, u in zip(ks_window, up_window) if u]


def test_d7_retention_interval_zero_stores_only_the_replay_tail_upstream(runs):
    """vLLM with ``prefix_cache_retention_interval=0``: upstream keeps only
    the window chunks a hit at the prompt's replay boundary needs (chunks 2-3
    of a 72-token prompt); kvstate models vLLM's default (None) and stores the
    window densely. A named difference, not a bug of either."""
    run = runs(hybrid(retention_interval=0))
    run.add("a", prompt(72), max_tokens=1)
    run.steps(3)
    first = run.first_divergence
    assert first is not None and first.step == 1 and first.field == "store calls"
    up_keys = {k for c in first.upstream for k in c.keys}
    ks_keys = {k for c in first.kvstate for k in c.keys}
    assert up_keys < ks_keys and all("@group:1@" in k for k in ks_keys - up_keys)
    assert len(keys_of(run.store_up.objects, 1)) == 2
    assert len(keys_of(run.store_ks.objects, 1)) == 4
    assert len(keys_of(run.store_up.objects, 0)) == len(keys_of(run.store_ks.objects, 0)) == 4


class ReportByReportQuorum(ValueCountQuorum):
    """F5 as found: an event is popped when it reaches the quorum and a
    surplus report of the same step starts counting it again."""

    def batch_ended(self) -> None:
        pass

    def add(self, gen, rank, events):
        published = super().add(gen, rank, events)
        self._published.clear()  # forget at once: the next report counts anew
        return published


def _f5_run(run: Conformance) -> None:
    """Found with evictions (any number of groups): TP 2, rank 0 puts an
    evicted chunk again in the step rank 1 first reports it (3 reports of
    one event in one step), then rank 1 puts it again after an eviction."""
    run.add("a", prompt(32), max_tokens=1)
    run.step(jobs={0: ALL})  # rank 0 reports a's two chunks; rank 1 lags
    chunk0 = run.engine.requests["a"].req.block_hashes[0].hex()

    def key(rank: int) -> list[str]:
        return [k for k in run.store_up.objects if k.endswith(chunk0) and f"@tp_rank:{rank}@" in k]

    run.evict_keys(key(0))
    run.add("b", prompt(32) + prompt(16, base=900), max_tokens=1)
    run.step()  # rank 1 runs a's job, rank 0 puts chunk 0 again: 3 reports in one step
    assert run.divergences == []
    run.evict_keys(key(1))
    run.add("c", prompt(32) + prompt(16, base=950), max_tokens=1)
    run.step()  # rank 1 puts it again: one more report


def test_f5_a_report_beyond_the_quorum_in_its_step_is_dropped_as_upstream_drops_it(runs):
    """Upstream pops an event that reached its quorum with every count of
    the step's batch; e2's quorum swallows the step's surplus reports the
    same way and conforms. Counting report by report (F5 as found), the
    surplus starts a new count and a later report of the same chunk
    publishes it again."""
    run = runs(Setup(world_size=2, kv_events=True))
    _f5_run(run)
    run.assert_conforms()
    found = runs(Setup(world_size=2, kv_events=True),
                 attrs.evolve(get_variant("e2"), quorum=ReportByReportQuorum))
    _f5_run(found)
    first = found.first_divergence
    assert first is not None and first.field == "published KV events"
    extra = list(first.kvstate)
    for event in first.upstream:
        extra.remove(event)
    assert len(extra) == 1 and extra[0][1] is None  # chunk 0 (no parent), published again


# --------------------------------------------------------------------------
# Group-rule mutants: each is caught at the field where its rule lives.


def _evicted_window_lookup_run(run: Conformance) -> None:
    run.add("a", prompt(72), max_tokens=1)
    run.steps(3)
    run.evict(prompt(72), chunk=0, group=1)
    run.lookup(prompt(72) + prompt(8, base=700))


def _plain_hybrid_run(run: Conformance) -> None:
    run.add("a", prompt(72), max_tokens=3)
    run.steps(4)


def _lagging_hybrid_run(run: Conformance) -> None:
    run.add("a", prompt(72), max_tokens=3)
    run.step(jobs=0)
    run.steps(3)


@pytest.mark.parametrize(
    ("name", "setup", "faults", "scenario"),
    [
        ("window-lookup-as-full", hybrid(), (), _evicted_window_lookup_run),
        ("key-without-group", hybrid(), (), _plain_hybrid_run),
        ("window-stores-freed-blocks", F4_SETUP, F4_FAULTS, _f4_run),
        ("window-events-as-group-0", hybrid(kv_events=True), (), _plain_hybrid_run),
        ("window-blocks-unpinned", hybrid(), (), _lagging_hybrid_run),
    ],
)
def test_group_rule_mutant_diverges_where_its_rule_lives(name, setup, faults, scenario):
    mutant = RULE_MUTANTS[name]
    run = mutant.run(setup, faults)
    try:
        scenario(run)
    finally:
        run.close()
    first = run.first_divergence
    assert first is not None, f"{name} was not told apart from upstream"
    assert first.field == mutant.field, str(first)
    # Only the mutant of the freed-block skip has F4's shape (it is F4 on the ranks).
    assert run.f4_explains(first) == (name == "window-stores-freed-blocks")
    with pytest.raises(DivergenceError, match=name):
        run.assert_conforms()
    # ...and the same scenario conforms without the mutation.
    control = Conformance(setup, "e2", faults)
    try:
        scenario(control)
    finally:
        control.close()
    control.assert_conforms()
