"""Upstream's own MooncakeStoreConnector, watched by kvstate's observer.

`ObservedMooncakeStoreConnector` runs vLLM 0.33.0's shipped connector on
vLLM's real Scheduler against a real ``mooncake_master`` on 127.0.0.1 and
writes the observed layer of kvstate's trace (`adapters.vllm.observer_runs`
drives the scenarios in a subprocess; upstream's worker leaves threads that
only ``os._exit`` ends). The traces are then judged by ``kvstate check``, no
model involved: a clean run checks clean, and each upstream hazard of
specs/conformance.md is found from upstream's own trace as the invariant it
breaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

from adapters.master import Master  # noqa: E402
from sim.traces.check import check_trace  # noqa: E402
from sim.traces.replay import replay_trace  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("observer")
    master = Master()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "adapters.vllm.observer_runs", "--master", master.address,
             "--out", str(out)], capture_output=True, text=True, timeout=900)
    finally:
        master.stop()
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert results, done.stderr[-3000:]
    by_name = {r.get("scenario", "?"): r for r in results}
    for result in results:
        assert "error" not in result, result.get("traceback", result)
    return by_name


def findings(trace: str) -> list[tuple[int, str, str]]:
    result = check_trace(trace)
    return [(line, f.invariant, f.message) for line, _, f in result.findings]


def records(trace: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(trace).read_text().splitlines()[1:]]


def test_a_clean_run_of_upstreams_connector_checks_clean(runs: dict[str, Any]) -> None:
    """Shared prefixes, chunked prefill, decode saves, KV events, a
    preemption and its resumption, an id reused after its request ended, and
    a second engine that looks the prompts up and loads them: upstream's
    trace breaks no invariant, online or offline."""
    run = runs["clean"]
    assert run["monitor"] == []
    writer, reader, late = run["traces"]
    assert findings(writer) == [] and findings(reader) == [] and findings(late) == []
    lines = records(writer)
    kinds = {r["type"] for r in lines}
    assert {"StepScheduled", "Planned", "LookupDone", "Allocated", "JobStarted",
            "ExistsAnswered", "PutDone", "JobFinished", "ReportDelivered", "Settled"} <= kinds
    steps = [r["step"] for r in lines if r["type"] == "StepScheduled"]
    assert any(s["preempted"] for s in steps) and any(s["resumed"] for s in steps)
    plans = [r["plan"] for r in lines if r["type"] == "Planned"]
    job_ids = [save["job_id"] for plan in plans for save in plan["saves"]]
    assert job_ids[0] == 0 and job_ids == sorted(set(job_ids))  # vLLM numbers jobs from 0
    # Published events carry whole hashes (vLLM's own carry 64 bits of them).
    settled = [r["settlement"] for r in lines if r["type"] == "Settled"]
    assert any(s["published"] for s in settled)
    loaded = [r for r in records(reader) if r["type"] == "LoadDone"]
    hits = [r for r in records(reader) if r["type"] == "LookupDone" and r["hit_tokens"]]
    assert loaded and hits and all(not r["failed_block_ids"] for r in loaded)
    # Asynchronous lookups (upstream's lookup_async): every hit is recorded
    # with the store's answers that support it.
    late_hits = [r for r in records(late) if r["type"] == "LookupDone" and r["hit_tokens"]]
    assert {r["req_id"] for r in late_hits} == {"b3", "d3"}
    assert all(r["present"] and any(r["present"]) for r in late_hits)


def test_upstreams_own_traces_replay_identically_under_e2(runs: dict[str, Any]) -> None:
    """`e2` is kvstate's model of upstream's bookkeeping: fed the inputs of
    upstream's own trace (vLLM's job numbering from 0, whole block tables,
    lookups repeated while a request waits), it takes every decision
    upstream took, the hazards H2 and H3 included."""
    for name in ("clean", "reused-id", "no-space"):
        for trace in runs[name]["traces"]:
            result = replay_trace(trace, protocol="e2")
            assert result.ok and result.compared > 10, (trace, result.divergence)


def test_replay_names_h6_as_the_decision_where_e2_parts_from_upstream(
        runs: dict[str, Any]) -> None:
    """`e2` copies upstream except H5 and H6 (specs/conformance.md): on the
    short read, replay parts ways at the load report, naming the block."""
    _, reader = runs["short-read"]["traces"]
    divergence = replay_trace(reader, protocol="e2").divergence
    assert divergence is not None and divergence.field.endswith("reported_block_ids")
    assert "the model reports blocks" in divergence.decision and "the trace []" in \
        divergence.decision


def test_h2_a_reused_id_inheriting_a_stale_saved_offset_is_s10(runs: dict[str, Any]) -> None:
    """H2 (specs/conformance.md): the old generation's parked job stores and
    writes the reused id's saved offset; the new generation's job starts at
    32 having saved nothing: S10, and the new chunk's KV event names a
    parent no event announced: K4."""
    run = runs["reused-id"]
    (trace,) = run["traces"]
    found = findings(trace)
    assert {inv for _, inv, _ in found} == {"S10", "K4"}, found
    s10 = next(msg for _, inv, msg in found if inv == "S10")
    assert "starts at 32 but has really saved only up to 0" in s10
    assert sorted(m.split(":")[0] for m in run["monitor"]) == sorted(inv for _, inv, _ in found)


def test_h3_pressure_that_outlives_its_cause_is_k6(runs: dict[str, Any]) -> None:
    """H3: after one -200 the request's later jobs are skipped while the
    other requests' jobs only find their keys present: K6 (the observer
    writes when the rank saw the -200 and when it skipped); the chunk after
    the rejected one is announced with the rejected one as its parent: K4."""
    run = runs["no-space"]
    (trace,) = run["traces"]
    found = findings(trace)
    assert {inv for _, inv, _ in found} == {"K6", "K4"}, found
    assert all("('p'," in msg for _, inv, msg in found if inv == "K6")
    skipped = [r for r in records(trace) if r["type"] == "JobFinished"
               and r["outcome"] == "skipped"]
    assert skipped and all(r["skipped_since"] < r["now"] for r in skipped)


def test_h6_a_short_read_taken_for_a_load_is_s19(runs: dict[str, Any]) -> None:
    """H6: a get reads half a block's bytes; upstream checks only for a
    negative answer and reports nothing. The observer judges the store's
    answer (fewer bytes than asked), so the check names the block: S19."""
    run = runs["short-read"]
    writer, reader = run["traces"]
    assert findings(writer) == []
    found = findings(reader)
    assert [inv for _, inv, _ in found] == ["S19"], found
    assert "did not report them" in found[0][2]
    assert run["monitor"] == [f"S19: {found[0][2]}"]


def test_the_observer_refuses_kvstates_protocol_fields_by_name() -> None:
    from adapters.vllm.observer import observer_options

    for field, value in (("kvstate_protocol", "e2"), ("kvstate_load_async", False),
                         ("kvstate_store_timeout", 2.0), ("kvstate_put_step", 1)):
        with pytest.raises(ValueError, match=f"{field}.*upstream's MooncakeStoreConnector"):
            observer_options({field: value})
    with pytest.raises(ValueError, match="observed layer only"):
        observer_options({"kvstate_trace_layer": "annotated"})
    with pytest.raises(ValueError, match="kvstate_monitor"):
        observer_options({"kvstate_monitor": "loud"})
    assert observer_options({"kvstate_monitor": "log", "enable_lookup": True,
                             "lookup_rpc_port": 7}).monitor == "log"
