"""Deriving what the observed layer leaves out: generation numbers.

An engine's recorder knows request ids, job ids and ranks, not kvstate's
generations. The monitors key everything by generation (a request id's
lifetime from being scheduled as new or resumed until it is preempted or
finishes), so a trace that leaves the numbers out gets them here, before any
monitor or the replayer sees a record, by the rules kvstate's own planner
numbers lifetimes with (`kvstate.planner.Planner._new_tracker` and its
callers), per engine, one counter from 1:

* a lookup or an allocation of a request id with no open lifetime, or whose
  lifetime was preempted, opens one (the lookup feeds the lifetime that will
  be scheduled or resumed);
* scheduling a request id as new opens one unless a lookup or allocation
  already did (a request id still running gets a new one: K2's hazard, the
  old one is finished);
* a resumption opens one unless a lookup or allocation since the
  preemption already did;
* a finish closes the request id's lifetime; a preemption marks it;
* a save job belongs to the lifetime its plan was built in; a job start,
  put, verdict or report to its job; a load to the request's open lifetime,
  a load answer to the request's latest load.

Because the rules are the planner's, a kvstate trace stripped of its numbers
derives exactly the numbers it had (the tests check this on every protocol
variant). The plan's ``preempted``/``finished`` generation keys, when left
out, come from the step's scheduler output the same way.

Numbers are written everywhere or nowhere: a trace that writes some and
leaves out others cannot be matched up, and is refused (exit 2) at the first
record that breaks the pattern.

Works on the reader's records as they come, attrs records (evolved) or the
fast path's msgspec structs (set in place).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvstate.contract import UNKNOWN
from kvstate.trace import TraceError

_PENDING, _RUNNING, _PREEMPTED = "pending", "running", "preempted"


_IS_ATTRS: dict[type, bool] = {}


def _with(record: Any, **changes: Any) -> Any:
    kind = type(record)
    frozen = _IS_ATTRS.get(kind)
    if frozen is None:
        frozen = _IS_ATTRS[kind] = attrs.has(kind)
    if frozen:
        return attrs.evolve(record, **changes)
    for name, value in changes.items():  # a fast-path struct: mutable, not shared
        setattr(record, name, value)
    return record


# Jobs every rank has reported whose generation is still remembered, newest
# last: a record of one of them after its last report (a rank reporting twice,
# a late put) is a connector's bug for the monitor to judge (S4, S21), not a
# trace whose generations cannot be derived. Job ids only grow (S22), so the
# newest few thousand are the ones a late record can name: a busy engine
# finishes a few hundred jobs a step.
DONE_REMEMBERED = 4096


class _Lifetimes:
    """One engine's request-id lifetimes, numbered as its planner would."""

    __slots__ = ("next_generation", "open", "jobs", "done", "reported", "loads", "ended",
                 "world_size", "written")

    def __init__(self, world_size: int) -> None:
        self.next_generation = 1
        self.open: dict[str, list[Any]] = {}  # req_id -> [generation, phase]
        self.jobs: dict[int, int] = {}  # job id -> generation
        self.done: dict[int, int] = {}  # the same, once every rank reported (DONE_REMEMBERED)
        self.reported: dict[int, set[int]] = {}  # job id -> ranks that reported it
        self.loads: dict[str, int] = {}  # req_id -> generation of its latest load
        # The generation keys the latest step ended, for the plan that follows.
        self.ended: tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] | None = None
        self.world_size = world_size
        # A trace that writes its generations: the latest one written per
        # request id (to name the lifetimes a step ended in its numbers).
        self.written: dict[str, int] = {}

    def _start(self, req_id: str, phase: str) -> int:
        generation = self.next_generation
        self.next_generation += 1
        self.open[req_id] = [generation, phase]
        return generation

    def lookup(self, req_id: str) -> int:
        entry = self.open.get(req_id)
        if entry is None or entry[1] == _PREEMPTED:
            return self._start(req_id, _PENDING)
        return int(entry[0])

    def scheduled(self, step: Any) -> None:
        finished: list[tuple[str, int]] = []
        preempted: list[tuple[str, int]] = []
        for req_id in step.finished:
            entry = self.open.pop(req_id, None)
            if entry is not None and entry[1] != _PREEMPTED:
                finished.append((req_id, entry[0]))
        for req_id in step.preempted:
            entry = self.open.get(req_id)
            if entry is not None and entry[1] == _RUNNING:
                preempted.append((req_id, entry[0]))
                entry[1] = _PREEMPTED
        for new in step.new:
            entry = self.open.get(new.req_id)
            if entry is not None and entry[1] == _RUNNING:
                finished.append((new.req_id, entry[0]))
                entry = None
            if entry is None or entry[1] == _PREEMPTED:
                self._start(new.req_id, _RUNNING)
            else:
                entry[1] = _RUNNING
        for res in step.resumed:
            entry = self.open.get(res.req_id)
            if entry is not None and entry[1] == _PENDING:
                entry[1] = _RUNNING  # looked up on re-admission: that lifetime resumes
            else:
                self._start(res.req_id, _RUNNING)
        self.ended = (tuple(preempted), tuple(finished))

    def current(self, req_id: str, where: str, field: str) -> int:
        entry = self.open.get(req_id)
        if entry is None:
            raise TraceError(where, field, f"no lifetime of request {req_id!r} is open (never "
                             "looked up, allocated or scheduled, or finished): its generation "
                             "cannot be derived")
        return int(entry[0])

    def of_job(self, job_id: int, where: str, field: str) -> int:
        generation = self.jobs.get(job_id)
        if generation is None:
            generation = self.done.get(job_id)
        if generation is None:
            raise TraceError(where, field, f"job {job_id} is not in any earlier plan of this "
                             f"engine (or every rank reported it, more than {DONE_REMEMBERED} "
                             "jobs ago): its generation cannot be derived")
        return generation

    def report(self, job_id: int, rank: int) -> None:
        if job_id not in self.jobs:
            return  # a report of a job already done: the monitor's to judge (S4)
        ranks = self.reported.setdefault(job_id, set())
        ranks.add(rank)
        if len(ranks) >= self.world_size:  # only a connector's bug can follow its last report
            del self.reported[job_id]
            generation = self.jobs.pop(job_id, None)
            if generation is not None:
                done = self.done
                done[job_id] = generation
                if len(done) > DONE_REMEMBERED:
                    del done[next(iter(done))]


class Derivation:
    """Fills in left-out generation numbers, one record at a time
    (``apply``); ``mode`` is ``"written"``, ``"derived"`` or ``None`` until a
    record decides it."""

    def __init__(self, configs: list[Any]) -> None:
        self.engines = [_Lifetimes(c.world_size) for c in configs]
        self.mode: str | None = None
        self._handlers: dict[type, Any] = {}

    # -- the all-or-nothing rule ------------------------------------------

    def _mode(self, derived: bool, where: str, field: str) -> bool:
        mode = "derived" if derived else "written"
        if self.mode is None:
            self.mode = mode
        elif self.mode != mode:
            raise TraceError(where, field, (
                "generation left out, but earlier records write generation numbers"
                if derived else
                "generation written, but earlier records leave generation numbers out")
                + ": a trace writes them on every record or on none")
        return derived

    def _needs(self, value: Any, where: str, field: str) -> bool:
        """Whether ``value`` (a generation) must be derived."""
        return self._mode(value == UNKNOWN, where, field)

    # -- per record ---------------------------------------------------------

    def apply(self, where: str, engine: int, obs: Any,
              absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        handler = self.handler_of(type(obs))
        if handler is None:
            return obs, absent
        return handler(where, self.engines[engine], obs, absent)

    def handler_of(self, kind: type) -> Any:
        """What `apply` does with a record of type ``kind``, called with
        ``(where, self.engines[engine], obs, absent)``; ``None``: nothing."""
        try:
            return self._handlers[kind]
        except KeyError:  # by name: the fast path's structs share the records' names
            handler = self._handlers[kind] = getattr(self, "_on_" + kind.__name__, None)
            return handler

    def _on_StepScheduled(self, where: str, life: _Lifetimes, obs: Any,
                          absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        life.scheduled(obs.step)
        return obs, absent

    def _on_LookupDone(self, where: str, life: _Lifetimes, obs: Any,
                       absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        derived = life.lookup(obs.req_id)
        if self._needs(obs.generation, where, "generation"):
            obs = _with(obs, generation=derived)
        else:
            life.written[obs.req_id] = obs.generation
        return obs, absent

    def _on_Allocated(self, where: str, life: _Lifetimes, obs: Any,
                      absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        life.lookup(obs.req_id)
        return obs, absent

    def _on_Planned(self, where: str, life: _Lifetimes, obs: Any,
                    absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        plan = obs.plan
        changes: dict[str, Any] = {}
        for field in ("started", "ended"):
            records = getattr(plan, field)
            if records and field not in absent:
                self._mode(False, where, f"plan.{field}")
        for field in ("preempted", "finished"):
            if field not in absent and getattr(plan, field):
                self._mode(False, where, f"plan.{field}")
        if "started" not in absent:
            for start in plan.started:
                life.written[start.req_id] = start.generation
        saves = list(plan.saves)
        for i, meta in enumerate(saves):
            field = f"plan.saves[{i}].generation"
            if self._needs(meta.generation, where, field):
                generation = life.current(meta.req_id, where, field)
                saves[i] = _with(meta, generation=generation)
            else:
                generation = life.written[meta.req_id] = meta.generation
            life.jobs[meta.job_id] = generation
        loads = list(plan.loads)
        for i, load in enumerate(loads):
            field = f"plan.loads[{i}].generation"
            if self._needs(load.generation, where, field):
                generation = life.current(load.req_id, where, field)
                loads[i] = _with(load, generation=generation)
                life.loads[load.req_id] = generation
        ended, life.ended = life.ended or ((), ()), None
        if self.mode == "derived":
            if saves:
                changes["saves"] = tuple(saves)
            if loads:
                changes["loads"] = tuple(loads)
        elif self.mode == "written":  # the producer's own numbers, where it wrote them
            written = life.written
            ended = (tuple((r, written[r]) for r, _ in ended[0] if r in written),
                     tuple((r, written[r]) for r, _ in ended[1] if r in written))
            for req_id, _ in ended[1]:  # finished: a reuse writes its own number again
                del written[req_id]
        # Left out: the step's scheduler output says which lifetimes ended.
        for i, field in enumerate(("preempted", "finished")):
            if field in absent:
                changes[field] = ended[i]
        if changes:
            absent = absent - {"preempted", "finished"}
            obs = _with(obs, plan=_with(plan, **changes))
        return obs, absent

    def _job_record(self, where: str, life: _Lifetimes, obs: Any,
                    absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        # The most frequent lines (every put): the common cases inline.
        if obs.generation == UNKNOWN:
            if self.mode != "derived":
                self._mode(True, where, "generation")
            generation = life.jobs.get(obs.job_id)
            if generation is None:
                generation = life.of_job(obs.job_id, where, "job_id")  # raises
            obs = _with(obs, generation=generation)
        elif self.mode != "written":
            self._mode(False, where, "generation")
        return obs, absent

    def _on_JobStarted(self, where: str, life: _Lifetimes, obs: Any,
                       absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        for field in ("state_generation", "retry_generation"):
            if getattr(obs, field) is not None:
                self._mode(False, where, field)
        return self._job_record(where, life, obs, absent)

    _on_JobFinished = _job_record
    _on_PutDone = _job_record

    def _on_StateWritten(self, where: str, life: _Lifetimes, obs: Any,
                         absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        self._mode(False, where, "generation")
        return obs, absent

    def _on_ReportDelivered(self, where: str, life: _Lifetimes, obs: Any,
                            absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        report = obs.report
        if self._needs(report.generation, where, "report.generation"):
            generation = life.of_job(report.job_id, where, "report.job_id")
            obs = _with(obs, report=_with(report, generation=generation))
            life.report(report.job_id, report.rank)
        return obs, absent

    def _on_LoadDone(self, where: str, life: _Lifetimes, obs: Any,
                     absent: frozenset[str]) -> tuple[Any, frozenset[str]]:
        if self._needs(obs.generation, where, "generation"):
            generation = life.loads.get(obs.req_id)
            if generation is None:
                raise TraceError(where, "req_id", f"no earlier plan loads request "
                                 f"{obs.req_id!r}: its generation cannot be derived")
            obs = _with(obs, generation=generation)
        return obs, absent
