"""Transition coverage of the JOB machine, reconstructed from traces.

A trace records what each rank did with each job; from that we recover which
(state, event) pairs of `kvstate.tables.JOB` the run exercised, so
``kvstate diagram job --coverage TRACE...`` can colour the diagram and list
the transitions no trace reached. (Coverage of the other machines needs the
fuzzer's and model checker's instrumentation and is not derived here.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvstate.observations import (
    ExistsAnswered,
    JobFinished,
    JobStarted,
    Planned,
    PutDone,
    Settled,
    StoreCallRaised,
)
from kvstate.tables import JOB, JobEvent, JobState
from kvstate.trace import TraceReader

_J, _E = JobState, JobEvent
_PUT_OUTCOME = {"stored": _E.PUT_OK, "partially_stored": _E.PUT_PARTIAL, "failed": _E.PUT_FAILED}


def job_coverage(paths: Iterable[str | Path]) -> set[tuple[JobState, JobEvent]]:
    seen: set[tuple[JobState, JobEvent]] = set()
    for path in paths:
        with TraceReader(path) as reader:
            stage: dict[tuple[int, int, int], JobState] = {}  # (engine, job, rank) -> state
            for _, engine, _, obs in reader:
                _visit(seen, stage, engine, obs)
    return seen


def _visit(seen: set, stage: dict, engine: int, obs: object) -> None:
    if isinstance(obs, Planned):
        if obs.plan.saves:
            seen.add((_J.EMITTED, _E.ENQUEUE))
    elif isinstance(obs, JobStarted):
        seen.add((_J.QUEUED, _E.DEQUEUE))
        stage[(engine, obs.job_id, obs.rank)] = _J.RUNNING
        if not obs.live:
            seen.add((_J.RUNNING, _E.FOUND_STALE))
    elif isinstance(obs, ExistsAnswered):
        seen.add((_J.RUNNING, _E.CHECK_EXISTS))
        seen.add((_J.CHECKING, _E.ALL_PRESENT if all(obs.present) else _E.PUT_MISSING))
        stage[(engine, obs.job_id, obs.rank)] = _J.PUTTING if not all(obs.present) \
            else _J.STORED
    elif isinstance(obs, PutDone):
        stage[(engine, obs.job_id, obs.rank)] = _J.PUTTING
    elif isinstance(obs, StoreCallRaised):
        where = stage.get((engine, obs.job_id, obs.rank), _J.RUNNING)
        seen.add((_J.CHECKING if where is _J.RUNNING else where, _E.RAISED))
        stage[(engine, obs.job_id, obs.rank)] = _J.FAILED
    elif isinstance(obs, JobFinished):
        key = (engine, obs.job_id, obs.rank)
        where = stage.pop(key, _J.RUNNING)
        outcome = JobState(obs.outcome)
        if outcome is _J.SKIPPED:
            seen.add((_J.RUNNING, _E.SKIP_FOR_PRESSURE))
        elif where is _J.RUNNING and outcome is _J.STORED:
            seen.add((_J.RUNNING, _E.NOTHING_TO_STORE))
        elif where is _J.PUTTING and obs.outcome in _PUT_OUTCOME:
            seen.add((_J.PUTTING, _PUT_OUTCOME[obs.outcome]))
        seen.add((outcome, _E.REPORT))
    elif isinstance(obs, Settled) and obs.settlement.released_jobs:
        seen.add((_J.REPORTED, _E.RELEASE))


def unvisited(seen: set[tuple[JobState, JobEvent]]) -> list[tuple[JobState, JobEvent]]:
    return [(s, e) for s in JOB.states for e in JOB.table[s] if (s, e) not in seen]
