"""``kvstate replay``: re-drive the model from a trace's inputs, compare outputs.

A trace records every input at the connector boundary — scheduler steps,
lookups and their store answers, allocations, which rank dequeued when, every
store answer (existence, put codes, exceptions, load results), report
deliveries — and every output: plans, settlements, job starts, state writes,
job verdicts, reports. Replay feeds the inputs to a fresh planner and fresh
executors (the trace's protocol, or another one with ``--protocol``) and
compares each output with the recorded one; the first mismatch is the
divergence. Engine-side observations (block pool, evictions, quiescence) are
not outputs of the model and are skipped.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import attrs

from kvstate.contract import OMITTABLE
from kvstate.executor import Executor, RankJob
from kvstate.observations import (
    Allocated,
    ExistsAnswered,
    JobFinished,
    JobStarted,
    LoadDone,
    LookupDone,
    Planned,
    PutDone,
    ReportDelivered,
    Settled,
    StateWritten,
    StepScheduled,
    StoreCallRaised,
)
from kvstate.planner import Planner
from kvstate.records import ExistsCall, GetCall, LoadReport, PutCall, Report, SchedulerStep
from kvstate.tables import IllegalTransition
from kvstate.trace import TraceError, TraceReader
from kvstate.variants import VARIANTS, get_variant, is_variant
from sim.minimize import check_header_options

_PRODUCED = (JobStarted, StateWritten, JobFinished)


@attrs.define
class Divergence:
    line: int
    engine: int
    kind: str
    expected: str
    got: str
    field: str = ""


@attrs.define
class ReplayResult:
    path: str
    protocol: str
    lines: int
    compared: int
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def first_difference(expected: Any, got: Any, path: str = "") -> tuple[str, Any, Any]:
    """The path of the first differing field and the two values there."""
    if type(expected) is type(got) and attrs.has(type(expected)):
        for field in attrs.fields(type(expected)):
            a, b = getattr(expected, field.name), getattr(got, field.name)
            if a != b:
                return first_difference(a, b, f"{path}.{field.name}")
    if isinstance(expected, tuple) and isinstance(got, tuple):
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                return first_difference(a, b, f"{path}[{i}]")
        if len(expected) != len(got):
            return f"{path} (length)", len(expected), len(got)
    return path or "(value)", expected, got


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _EngineReplay:
    def __init__(self, config: Any, protocol: str) -> None:
        variant = get_variant(protocol)
        self.planner = Planner(config, variant)
        self.produced: deque[Any] = deque()
        self.now = 0.0  # the recorded time of the line being applied: the executors' clock
        self.executors = [
            Executor(config, r, variant, clock=lambda: self.now, observer=self.produced.append)
            for r in range(config.world_size)
        ]
        self.step: SchedulerStep | None = None
        self.current: dict[int, tuple[RankJob, ExistsCall | PutCall]] = {}
        self.codes: dict[int, list[int]] = {}
        self.outbox: deque[Report] = deque()
        self.delivered: list[Report] = []
        self.loads: dict[int, list[GetCall]] = {}
        self.load_reports: list[LoadReport] = []
        # The trace is of the observed layer only (`kvstate.derive`): it has
        # no rank-state writes and leaves the omittable fields out.
        self.observed_only = False

    def handle(self, rank: int, job: RankJob, out: Any) -> None:
        if out is None:
            return
        if isinstance(out, Report):
            self.outbox.append(out)
        else:
            self.current[rank] = (job, out)
            self.codes[rank] = []


class _Mismatch(Exception):
    def __init__(self, kind: str, expected: Any, got: Any) -> None:
        self.kind = kind
        self.expected = expected
        self.got = got


def _same(kind: str, expected: Any, got: Any) -> None:
    if expected != got:
        raise _Mismatch(kind, expected, got)


def _unrecorded(recorded: Any, model: Any, absent: frozenset[str]) -> Any:
    """The model's output with the annotations the trace left out taken from
    the recorded line (their defaults): a left-out field is not recorded, so
    it is not compared (`kvstate.trace.ANNOTATIONS`)."""
    if not absent or type(model) is not type(recorded):
        return model
    return attrs.evolve(model, **{name: getattr(recorded, name) for name in absent})


def _observed_only(recorded: Any, model: Any) -> Any:
    """The model's output with the fields the observed layer leaves out
    (`kvstate.contract.OMITTABLE`) taken from the recorded line: a trace that
    derives its generations wrote none of them, so none is compared."""
    omit = OMITTABLE.get(type(model).__name__)
    if omit is None or type(model) is not type(recorded):
        return model
    return attrs.evolve(model, **{name: getattr(recorded, name) for name in omit
                                  if name != "generation"})


def replay_trace(path: str | Path, protocol: str | None = None) -> ReplayResult:
    with TraceReader(path) as reader:
        name = reader.name
        check_header_options(path, reader.header)
        chosen = protocol or reader.header.get("protocol") or "kvstate"
        try:
            known = is_variant(chosen)
        except ValueError as exc:  # a module KVSTATE_VARIANTS names does not import
            raise TraceError(f"{name}:1", "protocol", str(exc)) from None
        if not known:
            raise TraceError(f"{name}:1", "protocol", f"{chosen!r} is not a kvstate protocol "
                             f"variant (known: {', '.join(VARIANTS)}); replay needs one: "
                             "pass --protocol")
        engines = [_EngineReplay(config, chosen) for config in reader.header["configs"]]
        compared = 0
        for number, index, when, obs in reader:
            engine = engines[index]
            engine.now = when
            engine.observed_only = reader.derivation.mode == "derived"
            try:
                compared += _apply(engine, obs, reader.absent)
            except _Mismatch as mm:
                where, a, b = first_difference(mm.expected, mm.got)
                return ReplayResult(name, chosen, number, compared, Divergence(
                    number, index, mm.kind, _short(a), _short(b), where))
            except (ValueError, KeyError, IndexError, IllegalTransition) as exc:
                return ReplayResult(name, chosen, number, compared, Divergence(
                    number, index, type(obs).__name__, _short(obs),
                    f"the model could not take this input: {exc}"))
            except Exception as exc:  # never a traceback for a line the reader took
                raise TraceError(f"{name}:{number}", "",
                                 f"the model could not take this {type(obs).__name__} "
                                 f"({type(exc).__name__}: {exc})") from None
        for index, engine in enumerate(engines):
            if engine.observed_only:
                while engine.produced and isinstance(engine.produced[0], StateWritten):
                    engine.produced.popleft()
            if engine.produced:
                return ReplayResult(name, chosen, reader.last_line, compared, Divergence(
                    reader.last_line, index, "end of trace", "nothing more",
                    _short(engine.produced[0])))
        return ReplayResult(name, chosen, reader.last_line, compared, None)


def _apply(engine: _EngineReplay, obs: Any, absent: frozenset[str] = frozenset()) -> int:
    """Feed one recorded observation; return how many outputs were compared.
    ``absent``: the annotations its line left out (not compared)."""
    if engine.observed_only:
        produced = engine.produced
        while produced and isinstance(produced[0], StateWritten):
            produced.popleft()  # kvstate's own rank-state writes: no engine logs them
    if isinstance(obs, _PRODUCED):
        if isinstance(obs, JobStarted) and not engine.produced:
            executor = engine.executors[obs.rank]
            job = executor.dequeue()
            if job is None:
                raise _Mismatch("JobStarted", obs, "rank has no queued job")
            engine.handle(obs.rank, job, executor.start(job))
        if not engine.produced:
            raise _Mismatch(type(obs).__name__, obs, "the model produced nothing here")
        model = _unrecorded(obs, engine.produced.popleft(), absent)
        if engine.observed_only:
            model = _observed_only(obs, model)
        _same(type(obs).__name__, obs, model)
        if engine.observed_only and isinstance(obs, JobStarted):
            while engine.produced and isinstance(engine.produced[0], StateWritten):
                engine.produced.popleft()
        return 1
    if engine.produced:
        raise _Mismatch("extra output", "nothing before " + type(obs).__name__,
                        engine.produced[0])
    if engine.load_reports and not isinstance(obs, LoadDone):
        engine.planner.on_load_reports(engine.load_reports)
        engine.load_reports = []
    if isinstance(obs, StepScheduled):
        engine.step = obs.step
    elif isinstance(obs, Planned):
        if engine.step is None:
            raise _Mismatch("Planned", obs.plan, "no StepScheduled before it")
        plan = engine.planner.step(engine.step)
        engine.step = None
        _same("Planned", obs.plan, _unrecorded(obs.plan, plan, absent))
        for executor in engine.executors:
            # An asynchronous load lands steps later: loads wait for their
            # LoadDone across plans (a synchronous one lands in this step).
            engine.loads.setdefault(executor.rank, []).extend(executor.receive(plan))
        return 1
    elif isinstance(obs, ReportDelivered):
        if not engine.outbox:
            raise _Mismatch("ReportDelivered", obs.report, "no report pending")
        report = engine.outbox.popleft()
        _same("ReportDelivered", obs.report,
              _observed_only(obs.report, report) if engine.observed_only else report)
        engine.delivered.append(report)
        return 1
    elif isinstance(obs, Settled):
        settlement = engine.planner.on_reports(engine.delivered)
        engine.delivered = []
        _same("Settled", obs.settlement, _unrecorded(obs.settlement, settlement, absent))
        return 1
    elif isinstance(obs, LookupDone):
        query = engine.planner.lookup(obs.req_id, obs.num_prompt_tokens, obs.block_hashes)
        _same("LookupDone.keys", obs.keys, query.keys)
        hit = engine.planner.lookup_answered(query, obs.present)
        _same("LookupDone.hit_tokens", obs.hit_tokens, hit)
        return 1
    elif isinstance(obs, Allocated):
        engine.planner.allocate(obs.req_id, obs.block_ids, obs.num_computed_tokens,
                                obs.num_external_tokens, obs.load_async)
    elif isinstance(obs, LoadDone):
        calls = engine.loads.get(obs.rank, [])
        call = next((c for c in calls if (c.req_id, c.generation) == (obs.req_id, obs.generation)),
                    None)
        if call is None:
            raise _Mismatch("LoadDone", obs, "no load planned for it")
        calls.remove(call)
        failed = set(obs.failed_block_ids)
        load_report = engine.executors[obs.rank].load_answered(
            call, [b not in failed for b in call.block_ids])
        _same("LoadDone.reported_block_ids", obs.reported_block_ids,
              load_report.failed_block_ids)
        engine.load_reports.append(load_report)
        return 1
    elif isinstance(obs, ExistsAnswered):
        job, call = _current(engine, obs.rank, obs.job_id, ExistsCall)
        _same("ExistsAnswered.keys", obs.keys, call.keys)
        del engine.current[obs.rank]
        engine.handle(obs.rank, job, engine.executors[obs.rank].exists_answered(job, obs.present))
        return 1
    elif isinstance(obs, PutDone):
        job, call = _current(engine, obs.rank, obs.job_id, PutCall)
        codes = engine.codes[obs.rank]
        _same("PutDone.key", obs.key, call.keys[len(codes)])
        codes.append(obs.code)
        if len(codes) == len(call.keys):
            del engine.current[obs.rank]
            engine.handle(obs.rank, job, engine.executors[obs.rank].put_answered(job, codes))
        return 1
    elif isinstance(obs, StoreCallRaised):
        pending = engine.current.pop(obs.rank, None)
        if pending is None or pending[0].meta.job_id != obs.job_id:
            raise _Mismatch("StoreCallRaised", obs, "no such store call in flight")
        engine.handle(obs.rank, pending[0], engine.executors[obs.rank].raised(pending[0], obs.error))
    return 0


def _current(engine: _EngineReplay, rank: int, job_id: int, kind: type) -> tuple[RankJob, Any]:
    pending = engine.current.get(rank)
    if pending is None or pending[0].meta.job_id != job_id or not isinstance(pending[1], kind):
        raise _Mismatch(kind.__name__, f"job {job_id} in a {kind.__name__} on rank {rank}",
                        pending[1] if pending else "nothing in flight")
    return pending
