"""vLLM 0.33.0's shipped MooncakeStore connector and kvstate's ``e2``, fed one schedule.

Each test is a scenario run through ``adapters.vllm.conformance.Conformance``,
which compares both sides after every step (save jobs, store calls per rank,
completions, KV events, rank state, pins, reference counts) and keeps every
difference. A conforming scenario must end with none; the negative controls run a
mutant of ``e2`` and must be caught where its bug lives. Deliberate differences and
upstream hazards are in ``specs/conformance.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm")

from adapters.vllm.conformance import (  # noqa: E402
    ALL,
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

    def make(setup: Setup | None = None, variant: str = "e2",
             faults: tuple[Fault, ...] = ()) -> Conformance:
        run = Conformance(setup or Setup(), variant, faults)
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

