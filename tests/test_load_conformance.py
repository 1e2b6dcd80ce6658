"""The load path against vLLM 0.33.0's shipped MooncakeStoreConnector, on
vLLM's real Scheduler and a real Mooncake master (`adapters.vllm.load_conformance`).

Each side runs every scenario once, in a subprocess of its own (upstream's
worker threads would keep this process alive): upstream, kvstate's `e2`
(upstream's semantics) and the default protocol (its online monitor raising).
The tests then read the records like a reviewer would: `e2` step for step
equal to upstream wherever upstream is right; upstream's own failures (H4–H6
in specs/conformance.md) reproduced; the default protocol keeping every load
property in every scenario.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

from adapters.master import Master  # noqa: E402
from adapters.vllm.load_conformance import (  # noqa: E402
    SCENARIOS,
    broken_properties,
    compare,
)

# Where upstream itself is wrong (specs/conformance.md): e2 is not asked to
# copy a crash, a livelock or a silent corruption.
HAZARDS = {"sync-load": "H5", "short-read": "H6"}
# L2's negative control: a get slower than a step waits for, on every side.
SLOW = {"slow-get"}


def run_side(master: Master, side: str, scenarios: list[str] | None = None) -> dict:
    command = [sys.executable, "-m", "adapters.vllm.load_conformance",
               "--master", master.address, "--side", side]
    for name in scenarios or ():
        command += ["--scenario", name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    records = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            assert "scenario" in record, record
            records[record["scenario"]] = record
    assert done.returncode == 0 and records, done.stdout[-3000:] + done.stderr[-3000:]
    return records


@pytest.fixture(scope="module")
def records():
    master = Master()
    try:
        return {side: run_side(master, side) for side in ("upstream", "e2", "kvstate")} | {
            "swallow-load-errors": run_side(master, "swallow-load-errors",
                                            ["fail-middle-recompute"])}
    finally:
        master.stop()


def loads_of(record: dict) -> Counter:
    """How often each key (rank, block name) was read over the scenario."""
    return Counter((rank, name) for step in record["steps"] for rank, name, _ in step["gets"])


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - set(HAZARDS) - SLOW))
def test_e2_loads_and_recovers_step_for_step_as_upstream(records, name) -> None:
    upstream, e2 = records["upstream"][name], records["e2"][name]
    assert compare(upstream, e2) is None, compare(upstream, e2)
    assert upstream["error"] is None and upstream["stuck"] is None


# The properties each side breaks, by scenario: upstream's hazards, and e2
# copying upstream's loop (H4). Everything else keeps all of them.
BROKEN = {
    "upstream": {"sync-load": {"L1"}, "short-read": {"L3"}, "fail-every-get": {"L4"},
                 "slow-get": {"L2"}},
    "e2": {"fail-every-get": {"L4"}, "slow-get": {"L2"}},
    "kvstate": {"slow-get": {"L2"}},
}


@pytest.mark.parametrize("side", sorted(BROKEN))
def test_each_side_breaks_exactly_the_load_properties_its_hazards_say(records, side) -> None:
    """L1-L5 (`load_conformance.PROPERTIES`) over every scenario: the default
    protocol (its online monitor raising, so an invariant violation counts
    as an escaped exception) keeps them all; upstream breaks L1 (H5), L3 (H6)
    and L4 (H4), each where its hazard lives, and nowhere else. Every side
    breaks L2 where a get outlasts the step's wait (the check firing)."""
    broken = {name: set(broken_properties(record, SCENARIOS[name]))
              for name, record in records[side].items()}
    broken = {name: props for name, props in broken.items() if props}
    assert broken == BROKEN[side], {
        name: broken_properties(records[side][name], SCENARIOS[name]) for name in broken}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_default_protocol_reads_no_key_twice(records, name) -> None:
    """One load per request, and requests sharing a prefix share its load
    (D5): no key is read twice in any scenario, every get failing included."""
    twice = {key: n for key, n in loads_of(records["kvstate"][name]).items() if n > 1}
    assert not twice, twice


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_with_policy_fail_a_failed_load_ends_the_request_and_frees_its_blocks(records, where
                                                                              ) -> None:
    """vLLM's `kv_load_failure_policy=fail`: the request ends in the step its
    load failed and leaves the scheduler (its blocks with it); all sides."""
    for side in ("upstream", "e2", "kvstate"):
        (step,) = records[side][f"fail-{where}-fail"]["steps"]
        assert step["load_errors"], (side, step)
        assert step["finished"] == ["r"] and step["computed"] == {}, (side, step)


def test_h4_every_get_failing_loops_upstream_and_e2_not_the_default(records) -> None:
    """The master says present, every get of the prefix's first block fails:
    upstream (and e2, its model) look the request up and load again every
    step and never finish it; the default protocol loads once and computes."""
    for side in ("upstream", "e2"):
        record = records[side]["fail-every-get"]
        assert record["unfinished"] == ["r"], side
        loading = [s for s in record["steps"] if s["gets"]]
        assert len(loading) >= len(record["steps"]) // 2, (side, len(loading))
    record = records["kvstate"]["fail-every-get"]
    assert record["unfinished"] == [] and record["error"] is None
    assert max(loads_of(record).values()) == 1


def test_h5_upstream_asserts_in_start_load_kv_when_loads_are_synchronous(records) -> None:
    """`load_async: false` is accepted at start and kills the engine at the
    first load; kvstate serves synchronous loads (both protocols)."""
    error = records["upstream"]["sync-load"]["error"]
    assert error is not None and "AssertionError" in error and "start_load_kv" in error
    for side in ("e2", "kvstate"):
        record = records[side]["sync-load"]
        assert record["error"] is None and record["unfinished"] == [], side
        assert loads_of(record), side


def test_h6_upstream_takes_a_short_read_for_a_loaded_block(records) -> None:
    """A get that returns fewer bytes than the block holds: upstream checks
    only for a negative answer, so the request computes on a half-zeroed
    block (the integrity check names it); kvstate reports it as a failed
    block and recomputes it (both protocols)."""
    upstream = records["upstream"]["short-read"]
    assert any(s["corrupt"] for s in upstream["steps"])
    assert not any(s["load_errors"] for s in upstream["steps"])
    for side in ("e2", "kvstate"):
        record = records[side]["short-read"]
        assert not any(s["corrupt"] for s in record["steps"]), side
        assert any(s["load_errors"] for s in record["steps"]), side


def test_the_comparison_catches_a_variant_that_drops_load_errors(records) -> None:
    """Negative control: e2 with its load errors swallowed diverges at the
    step and field its bug lives in, and computes on blocks that were never
    loaded (L3 fires)."""
    upstream = records["upstream"]["fail-middle-recompute"]
    mutant = records["swallow-load-errors"]["fail-middle-recompute"]
    difference = compare(upstream, mutant)
    assert difference is not None and difference.field == "load_errors", difference
    assert set(broken_properties(mutant, SCENARIOS["fail-middle-recompute"])) == {"L3"}


def test_the_comparison_sees_the_default_protocols_deliberate_differences(records) -> None:
    """Negative control for the comparison itself: where the default protocol
    differs from upstream on purpose (no second lookup after a failed load,
    one load for requests sharing a prefix), `compare` names the step."""
    first = compare(records["upstream"]["fail-first-recompute"],
                    records["kvstate"]["fail-first-recompute"])
    assert first is not None and first.step == 1 and first.field == "scheduled", first
    shared = compare(records["upstream"]["two-requests-one-prefix"],
                     records["kvstate"]["two-requests-one-prefix"])
    assert shared is not None and shared.field == "waiting_for_remote_kv", shared


def test_a_preempted_request_is_looked_up_again_and_loads_what_it_saved(records) -> None:
    """`s` is preempted when the pool runs dry, its prompt blocks already
    saved; when vLLM re-admits it, every side looks it up again and loads
    the block vLLM's own cache lost meanwhile instead of recomputing it."""
    for side in ("upstream", "e2", "kvstate"):
        steps = records[side]["preempted-resumes"]["steps"]
        computed_before = [s["computed"].get("s") for s in steps]
        preempted = next(i for i in range(1, len(steps))
                         if computed_before[i - 1] and computed_before[i] == 0)
        later = [g for s in steps[preempted:] for g in s["gets"] if g[1].startswith("s#")]
        assert later and all(answer > 0 for _, _, answer in later), (side, later)
