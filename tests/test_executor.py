"""Worker-side behaviour, as scenarios (decode-phase and incremental saving)."""

from __future__ import annotations

from kvstate.config import ConnectorConfig
from kvstate.events import BlockStored, OrderedQuorum, ValueCountQuorum
from kvstate.harness import Harness
from kvstate.keys import chain_hashes, parent_hash
from kvstate.memory_store import MemoryStore
from kvstate.observations import ExistsAnswered, JobFinished, StateWritten
from kvstate.records import Plan
from kvstate.scenarios import ScriptedAnswers, prompt, run
from kvstate.tables import JobState


def exists_calls(h: Harness, rank: int = 0) -> list[int]:
    return [len(o.keys) for o in h.log if isinstance(o, ExistsAnswered) and o.rank == rank]


def test_incremental_store_checks_only_new_chunks() -> None:
    h = run("decode-save", "kvstate")
    assert exists_calls(h) == [1, 1, 1, 1]  # one new chunk per decode save
    e0 = run("decode-save", "e0")  # every job re-checks from chunk 0
    assert exists_calls(e0) == [1, 2, 3, 4]


def test_first_job_after_a_failed_put_checks_only_unconfirmed_chunks() -> None:
    h = run("partial-put-failure", "kvstate")
    # Job 1 checks chunks 0-2 and fails chunk 1; job 2 resumes at chunk 1.
    assert exists_calls(h) == [3, 3]  # job 2: chunks 1, 2 and the new chunk 3
    upstream = run("partial-put-failure", "e2")  # keeps the offset: rescans from 0
    assert exists_calls(upstream) == [3, 4]
    assert len(h.store.objects) == len(upstream.store.objects) == 4


def published_parents_follow_the_chain(h: Harness) -> None:
    chains = {}
    for req in [*h.requests.values(), *h.finished.values()]:
        chains.update({d: i for i, d in enumerate(chain_hashes(req.tokens, h.config.hash_block))})
        hashes = chain_hashes(req.tokens, h.config.hash_block)
        for event in h.published:
            digest = event.block_hashes[0]
            if digest in hashes:
                start = (hashes.index(digest) + 1) * h.config.hash_block - h.config.block_size
                assert event.parent_block_hash == parent_hash(hashes, start, h.config.hash_block)


def test_kv_event_parents_follow_the_hash_chain_after_dedup_miss_and_striding() -> None:
    for name in ("shared-prefix", "partial-put-failure", "strided-events"):
        for variant in ("kvstate", "e2"):
            h = run(name, variant)
            assert h.published, (name, variant)
            published_parents_follow_the_chain(h)
    # The new chunk of a deduplicated request names the shared chunk, not the root.
    h = run("shared-prefix", "kvstate")
    b = chain_hashes(h["b"].tokens, 4)
    event = next(e for e in h.published if e.block_hashes[0] == b[2])
    assert event.parent_block_hash == b[1]
    wrong = run("shared-prefix", "parent-previous-emitted")
    event = next(e for e in wrong.published if e.block_hashes[0] == b[2])
    assert event.parent_block_hash is None


def test_retry_without_covered_tokens_announces_empty_token_ids() -> None:
    # Job 1 hits -200 and keeps its suffix (0, 8 tokens); job 2 is skipped; after
    # the backoff job 3 starts at token 12, which the kept suffix does not reach.
    answers = ScriptedAnswers().when("put", 0, lambda n, k: n == 0, -200)
    config = ConnectorConfig(block_size=4, save_decode_cache=True, enable_kv_events=True,
                             pressure_backoff=5.0)
    h = Harness(config, num_blocks=32, store=MemoryStore(answers))
    h.add("a", prompt(8), max_new_tokens=12)
    h.settle()
    assert h.monitor.findings == []
    tokens = h["a"].tokens
    by_chunk = {chain_hashes(tokens, 4).index(e.block_hashes[0]): e for e in h.published}
    assert by_chunk[0].token_ids == () and by_chunk[1].token_ids == ()
    assert any(e.token_ids == tuple(tokens[i * 4:i * 4 + 4]) for i, e in by_chunk.items())
    outcomes = [o.outcome for o in h.log if isinstance(o, JobFinished)]
    assert outcomes[0] in ("failed", "partially_stored") and outcomes[1] == "skipped"


def test_retry_suffix_is_spliced_when_it_covers_the_gap() -> None:
    answers = ScriptedAnswers().when("put", 0, lambda n, k: n == 0, -800)
    config = ConnectorConfig(block_size=4, save_decode_cache=True, enable_kv_events=True)
    h = Harness(config, num_blocks=32, store=MemoryStore(answers))
    h.add("a", prompt(8), max_new_tokens=6)
    h.settle()
    tokens = h["a"].tokens
    assert {e.token_ids for e in h.published} >= {tuple(tokens[0:4]), tuple(tokens[4:8])}
    assert h.monitor.findings == []


def test_stale_job_after_id_reuse_cannot_touch_the_new_generation() -> None:
    h = run("reuse-with-stale-job", "kvstate")
    writes = [o for o in h.log if isinstance(o, StateWritten)]
    second = max(s.generation for p in h.plans for s in p.started)
    assert all(w.scope_generation == w.generation for w in writes)
    assert {w.generation for w in writes if w.scope_generation == second} == {second}
    assert len(h.store.objects) == 3  # both generations' prompts are stored
    upstream = run("reuse-with-stale-job", "e2")
    assert "S3" in upstream.monitor.fired()
    assert len(upstream.store.objects) == 2  # the reused id's prompt never made it


def test_writes_are_guarded_by_liveness_at_the_moment_of_the_write() -> None:
    config = ConnectorConfig(block_size=4)
    h = Harness(config, num_blocks=16)
    h.add("a", prompt(8), max_new_tokens=4)
    plan = h.step()
    assert h.advance(0) == "exists" and h.advance(0) == "put"
    gen = plan.saves[0].gen_key
    h.ranks[0].receive(Plan(step=99, preempted=(gen,)))  # preemption lands mid-job
    assert h.advance(0) == "reported"
    report = h.outbox[-1]
    assert report.confirmed_offset == 0 and report.outcome is JobState.STORED
    assert not [o for o in h.log if isinstance(o, StateWritten)]


def test_exceptions_still_report_and_leave_the_offset() -> None:
    h = run("store-raises", "kvstate")
    failed = [o for o in h.log if isinstance(o, JobFinished) and o.outcome == "failed"]
    assert [f.rank for f in failed] == [1]
    assert h.planner.jobs == {} and not any(h.pool.refs[1:])
    lost = run("store-raises", "missing-finally")
    assert lost.planner.jobs  # the job that raised never reported


def test_pressure_only_on_minus_200_and_backoff_brings_saves_back() -> None:
    h = run("pressure-idle", "kvstate")
    upstream = run("pressure-idle", "e2")
    # 23 computed tokens: 5 full chunks. Upstream stays skipped once nothing else
    # puts: only the chunk accepted in the same call as the -200 answer is there.
    assert len(h.store.objects) == 5 and len(upstream.store.objects) == 1
    other = run("partial-put-failure", "kvstate")  # -800 is a failure, not pressure
    assert not any(o.outcome == "skipped" for o in other.log if isinstance(o, JobFinished))


def _event(n: int, parent: int | None) -> BlockStored:
    return BlockStored((bytes([n]),), bytes([parent]) if parent is not None else None, (), 4)


def test_event_quorum_counts_distinct_ranks_orders_parents_and_forgets() -> None:
    config = ConnectorConfig(world_size=2)
    gen = ("a", 1)
    ordered = OrderedQuorum(config)
    assert ordered.add(gen, 0, (_event(1, None),)) == []
    assert ordered.add(gen, 0, (_event(1, None),)) == []  # same rank twice: still one
    assert ordered.add(gen, 1, (_event(2, 1),)) == []
    assert ordered.add(gen, 0, (_event(2, 1),)) == []     # child at quorum, parent not yet
    assert ordered.add(gen, 1, (_event(1, None),)) == [_event(1, None), _event(2, 1)]
    ordered.add(gen, 0, (_event(3, 2),))
    assert ordered.pending() == 1 and ordered.generation_settled(gen) == 1
    assert ordered.pending() == 0
    upstream = ValueCountQuorum(config)
    upstream.add(gen, 0, (_event(1, None),))
    assert upstream.add(gen, 0, (_event(1, None),)) == [_event(1, None)]  # early: S16
    upstream.add(gen, 0, (_event(3, 2),))
    assert upstream.generation_settled(gen) == 0 and upstream.pending() == 1  # leaks


def test_upstreams_quorum_drops_an_events_surplus_reports_of_the_step_it_published() -> None:
    """Upstream adds a step's reports to its counter and pops what reached
    the quorum with every count (F5): an eviction made rank 0 put chunk 1
    again, so the step holds three reports of it; the surplus goes with the
    pop, and rank 1's report in a later step starts a count of one."""
    upstream = ValueCountQuorum(ConnectorConfig(world_size=2))
    gen, event = ("a", 1), _event(1, None)
    step = [upstream.add(gen, rank, (event,)) for rank in (0, 1, 0)]
    assert step == [[], [event], []]
    upstream.batch_ended()
    assert upstream.pending() == 0
    assert upstream.add(gen, 1, (event,)) == []  # counted as one: not published again
    upstream.batch_ended()
    assert upstream.pending() == 1
