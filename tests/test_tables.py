"""The tables are the single source: dict dispatch, the `transitions`
reference interpreter and the committed diagrams must all agree with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.diagrams import reference_fire, reference_machine, to_mermaid
from kvstate.specs import rendered_specs
from kvstate.tables import (
    JOB,
    MACHINES,
    REQUEST,
    IllegalTransition,
    JobEvent,
    JobState,
    RequestEvent,
    RequestState,
)

SPECS = Path(__file__).resolve().parent.parent / "specs"


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_dict_dispatch_equals_transitions_reference_on_every_pair(machine) -> None:
    model, engine = reference_machine(machine)
    for state, event in machine.pairs():
        expected = reference_fire(model, engine, state, event)
        try:
            got = machine.fire(("key",), state, event).name
        except IllegalTransition:
            got = None
        assert got == expected, (machine.name, state, event)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_enabled_events_are_exactly_the_legal_ones(machine) -> None:
    for state in machine.states:
        legal = {e for e in machine.events if machine.table[state].get(e) is not None}
        assert machine.enabled(state) == legal


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_every_state_is_reachable_from_the_initial_state(machine) -> None:
    seen = {machine.initial}
    frontier = [machine.initial]
    while frontier:
        state = frontier.pop()
        for nxt in machine.table[state].values():
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(machine.states)


def test_illegal_transition_names_machine_key_state_and_event() -> None:
    with pytest.raises(IllegalTransition) as err:
        JOB.fire((7, 1), JobState.REPORTED, JobEvent.PUT_OK)
    text = str(err.value)
    assert "job machine" in text and "(7, 1)" in text
    assert "PUT_OK" in text and "REPORTED" in text
    assert err.value.state is JobState.REPORTED and err.value.event is JobEvent.PUT_OK


def test_a_finished_generation_accepts_nothing_so_reuse_needs_a_new_one() -> None:
    assert REQUEST.enabled(RequestState.FINISHED) == frozenset()
    assert RequestState.FINISHED in REQUEST.terminal
    # A resumption starts the next generation from ABSENT, never from PREEMPTED.
    assert RequestEvent.RESUME not in REQUEST.enabled(RequestState.PREEMPTED)
    assert REQUEST.fire("g2", RequestState.ABSENT, RequestEvent.RESUME) is RequestState.RESUMED


def test_every_job_outcome_must_report_before_release() -> None:
    for outcome in (JobState.STALE, JobState.SKIPPED, JobState.STORED,
                    JobState.PARTIALLY_STORED, JobState.FAILED):
        assert JOB.enabled(outcome) == {JobEvent.REPORT}
    assert JOB.enabled(JobState.REPORTED) == {JobEvent.RELEASE}


def test_committed_diagrams_and_catalogue_are_fresh() -> None:
    for rel, text in rendered_specs().items():
        path = SPECS / rel
        assert path.exists(), f"missing {path}: run `kvstate specs --write`"
        assert path.read_text() == text, f"{path} is stale: run `kvstate specs --write`"


def test_coverage_colouring_marks_unvisited_states() -> None:
    text = to_mermaid(JOB, coverage={(JobState.EMITTED, JobEvent.ENQUEUE)})
    assert "class EMITTED covered" in text
    assert "class QUEUED partial" in text
    assert "class RELEASED unvisited" in text
