"""Every invariant checker fires on the variant or fault that breaks it, and
stays silent for the default protocol on the same scenario."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec
from kvstate.executor import Executor
from kvstate.harness import Harness
from kvstate.invariants import CATALOGUE, INVARIANTS, Monitor
from kvstate.keys import key_prefix
from kvstate.memory_store import MemoryStore
from kvstate.observations import JobStarted, LookupDone, Planned, StepScheduled
from kvstate.planner import Planner
from kvstate.records import (
    CachedRequest,
    GenerationStart,
    NewRequest,
    Plan,
    SaveMeta,
    SchedulerStep,
)
from kvstate.scenarios import SCENARIOS, run
from kvstate.specs import render_invariants
from kvstate.store_codes import StoreCode

SPECS = Path(__file__).resolve().parent.parent / "specs"
SCENARIO_BROKEN = [inv for inv in CATALOGUE if inv.scenario in SCENARIOS]


def test_specs_invariants_md_is_generated_from_the_catalogue() -> None:
    assert (SPECS / "invariants.md").read_text() == render_invariants(), (
        "specs/invariants.md is stale: run `kvstate specs --write`"
    )


def test_every_reference_invariant_that_applies_is_catalogued() -> None:
    ids = set(INVARIANTS)
    expected = {f"S{i}" for i in range(1, 24)} - {"S5"}  # S5: structural, see module doc
    assert expected <= ids
    assert {"K1", "K2", "K3", "K4"} <= ids  # integrity, isolation, settlement, consumability


def test_every_invariant_names_a_breaker() -> None:
    for inv in CATALOGUE:
        assert inv.scenario in SCENARIOS or inv.scenario == "synthetic", inv
        assert inv.kind in ("safety", "liveness", "safety+liveness"), inv


@pytest.mark.parametrize("inv", SCENARIO_BROKEN, ids=lambda inv: f"{inv.id}-{inv.broken_by}")
def test_checker_fires_on_its_breaker(inv) -> None:
    harness = run(inv.scenario, inv.broken_by)
    assert inv.id in harness.monitor.fired(), (
        f"{inv.id} did not fire for {inv.broken_by} in {inv.scenario}: "
        f"{harness.monitor.findings}"
    )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_default_protocol_survives_every_scenario(name: str) -> None:
    harness = run(name, "kvstate")
    assert harness.monitor.findings == []


# Faults no variant produces: a broken engine or a corrupted plan, fed to the monitor.

def _monitor(config: ConnectorConfig) -> Monitor:
    return Monitor(config)


def test_s23_scheduling_a_request_in_the_step_that_preempts_it_is_reported() -> None:
    config = ConnectorConfig(block_size=4)
    planner = Planner(config)
    monitor = _monitor(config)
    first = SchedulerStep(new=(NewRequest("a", tuple(range(8)), 0, 8, ((1, 2),), ()),))
    monitor.observe(StepScheduled(first))
    monitor.observe(Planned(planner.step(first)))
    broken = SchedulerStep(cached=(CachedRequest("a", 8, (9,), ((),)),), preempted=("a",))
    plan = planner.step(broken)
    assert plan.violations and {v.invariant for v in plan.violations} == {"S23"}
    assert "step 2, the step that preempts it" in plan.violations[0].message
    monitor.observe(Planned(plan))
    assert monitor.fired() == {"S23"}


def _meta(job_id: int, start: int, end: int) -> SaveMeta:
    return SaveMeta("a", 1, job_id, start, end, 8, False, 0, ((1, 2, 3),), 0, (), None)


def _started() -> GenerationStart:
    return GenerationStart("a", 1, "new", 12)


def test_s22_a_plan_repeating_a_job_id_fires() -> None:
    config = ConnectorConfig(block_size=4)
    monitor = _monitor(config)
    monitor.observe(StepScheduled(SchedulerStep(
        new=(NewRequest("a", tuple(range(12)), 0, 12, ((1, 2, 3),), ()),))))
    monitor.observe(Planned(Plan(step=1, saves=(_meta(5, 0, 8),), started=(_started(),))))
    assert monitor.fired() == set()
    monitor.observe(Planned(Plan(step=2, saves=(_meta(5, 8, 12),))))
    assert monitor.fired() == {"S22"}


def test_s7_a_meta_beyond_the_computed_tokens_fires() -> None:
    config = ConnectorConfig(block_size=4)
    monitor = _monitor(config)
    monitor.observe(StepScheduled(SchedulerStep(
        new=(NewRequest("a", tuple(range(12)), 0, 6, ((1, 2),), ()),))))
    monitor.observe(Planned(Plan(step=1, saves=(_meta(1, 0, 8),), started=(_started(),))))
    assert monitor.fired() == {"S7"}


def test_s7_a_rank_aligning_a_hybrid_job_to_the_block_size_fires() -> None:
    # Two 4-token blocks per lcm chunk (a hybrid model's full-attention
    # boundary): a rank must round the job's 12 tokens down to 8, not keep 12.
    config = ConnectorConfig(block_size=4, alignment=8)
    monitor = _monitor(config)
    monitor.observe(StepScheduled(SchedulerStep(
        new=(NewRequest("a", tuple(range(12)), 0, 12, ((1, 2, 3),), ()),))))
    monitor.observe(Planned(Plan(step=1, saves=(_meta(1, 0, 12),), started=(_started(),))))
    monitor.observe(JobStarted(0, 1, "a", 1, True, 0, 8, 1, None))
    assert monitor.fired() == set()
    monitor.observe(JobStarted(1, 1, "a", 1, True, 0, 12, 1, None))
    assert monitor.fired() == {"S7"}
    assert "rank 1 job 1 aligned its length to 12, not a multiple of the lcm 8" in (
        monitor.findings[0].message)


def test_s20_a_hybrid_lookup_claiming_a_hit_past_its_hash_chain_is_one_finding() -> None:
    # A trace's hit_tokens is whatever the file says: a hit of a million
    # chunks on a two-chunk chain is one S20 finding, not a million (which
    # is what the checker did, looping over the claimed hit).
    config = ConnectorConfig(block_size=4, groups=(
        GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 8)))
    monitor = _monitor(config)
    chain = (b"\x01" * 32, b"\x02" * 32)
    monitor.observe(LookupDone("a", 1, 8, chain, (), (), 4 * 1_000_000))
    # The claim, then the two chunks the chain does cover, which the store
    # was never asked about (no keys): three S20 findings in all, after K9's
    # (a hit beyond the 8-token prompt leaves nothing to compute).
    assert [f.invariant for f in monitor.findings] == ["K9"] + ["S20"] * 3, \
        monitor.findings[:5]
    assert "counted 1000000 chunks as a hit but its hash chain of 2 hashes covers 2" in (
        monitor.findings[1].message)


class _CountsFailedPutsAsStored(Executor):
    """A send thread that ignores batch_put's return codes (a connector bug
    an outside reviewer wrote: its KV events announce chunks the store never
    took, and nothing else in the catalogue saw it)."""

    def put_answered(self, job, codes):
        return super().put_answered(job, [StoreCode.OK] * len(codes))


def _second_put_of_rank_1_refused() -> MemoryStore:
    puts = {"rank 1": 0}

    def answer(op: str, rank: int, key: str) -> int:
        if op == "put" and rank == 1:
            puts["rank 1"] += 1
            if puts["rank 1"] == 2:
                return StoreCode.NO_AVAILABLE_HANDLE
        return 0
    return MemoryStore(answer)


@pytest.mark.parametrize("executor", [Executor, _CountsFailedPutsAsStored])
def test_k7_a_rank_reporting_a_refused_put_as_stored_fires(executor) -> None:
    harness = Harness(ConnectorConfig(block_size=4, world_size=2, enable_kv_events=True),
                      "kvstate", store=_second_put_of_rank_1_refused(),
                      executor_factory=executor)
    harness.add("a", list(range(12)), max_new_tokens=0)
    harness.settle()
    k7 = [f.message for f in harness.monitor.findings if f.invariant == "K7"]
    if executor is Executor:
        assert k7 == []  # the -200 is reported as failed, and retried
    else:
        assert len(k7) == 1 and k7[0].startswith(
            "rank 1 job 1 reports chunk 1 of group 0 stored, but no put of"), k7


def test_findings_name_invariant_event_and_message() -> None:
    harness = run("preempt-running-job", "e1")
    finding = next(f for f in harness.monitor.findings if f.invariant == "S1")
    assert finding.event_index >= 0
    assert re.search(r"job \d+ read block \d+", finding.message)


def _lookup(keys: tuple[str, ...], present: tuple[bool, ...], hit: int):
    from kvstate.observations import LookupDone

    return LookupDone("b", 1, 40, (b"\x01" * 16, b"\x02" * 16), keys, present, hit)


def test_s20_a_hit_the_stores_answers_do_not_support_fires_in_any_store() -> None:
    config = ConnectorConfig(block_size=16)
    keys = (f"{key_prefix(config, 0, 0)}@{'01' * 16}", f"{key_prefix(config, 0, 0)}@{'02' * 16}")
    for shared in (False, True):
        monitor = Monitor(config, shared_store=shared)
        monitor.observe(_lookup(keys, (True, False), 32))  # two chunks counted, one present
        assert monitor.fired() == {"S20"}, shared


def test_s20_a_key_another_engine_stored_is_a_note_in_a_shared_store() -> None:
    """A production engine's trace sees only its own puts: a hit on a key the
    store answered present but no engine of the trace stored is not judged
    (header "store": "shared"); in an exclusive store it is a violation."""
    config = ConnectorConfig(block_size=16)
    keys = (f"{key_prefix(config, 0, 0)}@{'01' * 16}",)
    exclusive = Monitor(config)
    exclusive.observe(_lookup(keys, (True,), 16))
    assert exclusive.fired() == {"S20"}
    shared = Monitor(config, shared_store=True)
    shared.observe(_lookup(keys, (True,), 16))
    assert shared.fired() == set()
    assert any("S20" in note for note in shared.notes())


def test_an_unknown_invariant_id_is_an_error_not_silence() -> None:
    """A monitor asked for an id the catalogue lacks, or a checker reporting
    one, used to drop it without a word (a typo would switch a check off)."""
    config = ConnectorConfig(block_size=4, world_size=2)
    with pytest.raises(ValueError, match="unknown invariant id.*S99"):
        Monitor(config, only=["S1", "S99"])
    monitor = Monitor(config, only=["S1"])
    monitor.fail("S2", "not enabled: ignored")  # known, just not asked for
    with pytest.raises(ValueError, match="unknown invariant 'S2x'"):
        monitor.fail("S2x", "a typo")
    with pytest.raises(ValueError, match="unknown invariant 'Z9'"):
        monitor.skip("Z9", "a typo")
    assert monitor.findings == []


def test_k9_a_lookup_offering_the_whole_prompt_fires() -> None:
    """No protocol here can produce it (the planner shortens a full hit by a
    block); a broken lookup answer, fed to the monitor, must be named."""
    from kvstate.observations import LookupDone

    monitor = _monitor(ConnectorConfig(block_size=4))
    keys = ("k0", "k1")
    monitor.observe(LookupDone("a", 1, 7, (b"h0", b"h1"), keys, (True, True), 4))
    assert "K9" not in monitor.fired()  # 4 of 7: three tokens left to compute
    monitor.observe(LookupDone("b", 1, 8, (b"h0", b"h1"), keys, (True, True), 8))
    assert [f.message for f in monitor.findings if f.invariant == "K9"] == [
        "lookup of 'b' offers 8 tokens of a 8-token prompt: nothing left to compute"]
