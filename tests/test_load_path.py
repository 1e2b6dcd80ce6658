"""The load path in the model: vLLM's recovery of a failed load.

The harness plays vLLM 0.33's Scheduler as it recovers a parked request whose
load failed (policy ``recompute``): the computed tokens are cut at the first
failed block, the valid prefix kept and the request scheduled from there; when
the first block failed, its blocks are freed and it is admitted afresh, without
a second lookup or allocation (the connector's rule, which bounds a request to
one load however the store fails). The same recovery runs for real in
``tests/test_vllm_connector.py`` (vLLM's Scheduler) and ``tests/test_engine.py``
(the CPU engine); here the model checker and the scenarios explore it.
"""

from __future__ import annotations

import attrs

from kvstate.observations import Allocated, LookupDone, StepScheduled
from kvstate.scenarios import SCENARIOS
from sim.traces.check import check_trace
from sim.traces.replay import replay_trace


def admissions(harness, req_id: str) -> list[tuple[int, int]]:
    """(num_computed_tokens, num_scheduled_tokens) each time ``req_id`` was
    scheduled as a new request."""
    return [(n.num_computed_tokens, n.num_scheduled_tokens) for obs in harness.log
            if isinstance(obs, StepScheduled) for n in obs.step.new if n.req_id == req_id]


def count(harness, kind: type, req_id: str) -> int:
    return sum(1 for obs in harness.log if isinstance(obs, kind) and obs.req_id == req_id)


def assert_trace_checks_and_replays(harness, tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(harness.trace_text())
    assert check_trace(str(path)).ok
    replayed = replay_trace(str(path))
    assert replayed.ok, replayed.divergence


def test_a_parked_request_whose_first_block_failed_is_admitted_afresh(tmp_path) -> None:
    h = SCENARIOS["load-async-evicted"]("kvstate")
    assert h.monitor.findings == []
    assert admissions(h, "b") == [(0, 12)]  # the whole prompt computed
    assert count(h, LookupDone, "b") == 1 and count(h, Allocated, "b") == 1
    assert sorted(h.finished) == ["a", "b"]
    assert_trace_checks_and_replays(h, tmp_path)


def test_a_parked_request_resumes_at_its_first_failed_block(tmp_path) -> None:
    """Rank 1 failed the second chunk only: both ranks' blocks from there on
    are recomputed (vLLM keeps one computed length per request)."""
    h = SCENARIOS["load-async-partial"]("kvstate")
    assert h.monitor.findings == []
    assert admissions(h, "b") == [(4, 8)]
    assert sorted(h.finished) == ["a", "b"]
    assert_trace_checks_and_replays(h, tmp_path)


def test_upstream_resumes_at_the_failed_block_the_same_way() -> None:
    h = SCENARIOS["load-async-partial"]("e2")
    assert h.monitor.findings == []
    assert admissions(h, "b") == [(4, 8)]


def test_upstream_looks_a_request_whose_load_failed_up_again_for_ever() -> None:
    """H4 in the model: e2 asks the store again after vLLM freed the blocks
    of a failed load; the store says present, the get fails, and again —
    until the scenario's 100-step bound. K8 names the first repeat, K3 the
    request still there at the end; the default protocol computes (above)."""
    h = SCENARIOS["load-async-evicted"]("e2")
    assert count(h, LookupDone, "b") == 100
    assert admissions(h, "b") == []
    assert {"K8", "K3"} <= h.monitor.fired()
    first = next(f for f in h.monitor.findings if f.invariant == "K8")
    assert "'b' (generation 2) is looked up again after a load of it failed" in first.message


def test_a_swallowed_load_error_fires_s19_in_both_recoveries() -> None:
    """The mutant that drops load errors leaves the request scheduled past
    blocks that hold nothing: S19 fires, and the engine model admits the
    request from its whole hit (the recovery never ran)."""
    for name in ("load-async-evicted", "load-async-partial"):
        h = SCENARIOS[name]("swallow-load-errors")
        assert "S19" in h.monitor.fired(), name
        assert admissions(h, "b") == [(8, 4)]


def test_a_failed_synchronous_load_rewinds_the_running_request(tmp_path) -> None:
    """vLLM 0.33 with a synchronous load: the forward pass ran over the
    failed block, so after the step the request is cut back to it and the
    next step recomputes from there, as a running request whose computed
    count went backwards. Both protocols follow it without planning a save
    past what is computed."""
    for variant in ("kvstate", "e2"):
        h = SCENARIOS["load-sync-partial"](variant)
        assert h.monitor.findings == [], variant
        assert admissions(h, "b") == [(8, 4)]
        rewound = [(c.num_computed_tokens, len(c.new_token_ids)) for obs in h.log
                   if isinstance(obs, StepScheduled) for c in obs.step.cached if c.req_id == "b"]
        assert rewound[0] == (4, 8), rewound  # from the failed block to the prompt's end
        assert sorted(h.finished) == ["a", "b"]
    assert_trace_checks_and_replays(SCENARIOS["load-sync-partial"]("kvstate"), tmp_path)


def test_a_planner_that_ignores_the_rewind_saves_what_is_not_computed() -> None:
    """Negative control: a planner that keeps counting from its own length
    (as if vLLM had not cut the request back) plans a save of tokens not
    computed yet; S7 names it."""
    from kvstate.variants import KVSTATE

    h = SCENARIOS["load-sync-partial"](attrs.evolve(KVSTATE, name="ignores-rewinds",
                                                    follow_rewinds=False))
    assert "S7" in h.monitor.fired()
