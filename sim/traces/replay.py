"""``kvstate replay``: re-drive the model from a trace's inputs, compare its decisions.

A trace records every input at the connector boundary — scheduler steps,
lookups and their store answers, allocations, which rank dequeued when, every
store answer (existence, put codes, exceptions, load results), report
deliveries — and every output: plans, settlements, job starts, state writes,
job verdicts, reports. Replay feeds the inputs to a fresh planner and fresh
executors (the protocol the trace's header names, or ``--protocol``) and
compares each output with the recorded one; the first mismatch is the
divergence, told as the decision that differs. Engine-side observations
(block pool, evictions, quiescence) are not outputs of the model and are
skipped.

What is compared is what the protocol decides, not how its producer wrote it
down: the recorded output and the model's both pass through
``NORMALISATIONS`` first, one small function per freedom of encoding, each
saying why it decides nothing (specs/replay.md lists them and what replay
cannot judge). So a trace from vLLM's own connector, which numbers its jobs
from 0 and ships every job the whole block table, replays against kvstate's
protocol, which numbers from 1 and ships slices.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
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
from kvstate.records import (
    ExistsCall,
    GenerationEnd,
    GenKey,
    GetCall,
    LoadMeta,
    LoadReport,
    Plan,
    PutCall,
    Report,
    SaveMeta,
    SchedulerStep,
    Settlement,
)
from kvstate.tables import IllegalTransition
from kvstate.trace import NO_ABSENT, TraceError, TraceReader
from kvstate.variants import VARIANTS, get_variant, is_variant
from sim.traces.minimize import check_header_options

_PRODUCED = (JobStarted, StateWritten, JobFinished)


@attrs.define
class Divergence:
    """The first output that differs: the trace's ``line`` and ``engine``,
    the ``kind`` of record, the ``field`` path in the line, the recorded
    (``expected``) and the model's (``got``) value there after normalisation,
    and ``decision``: the difference in the protocol's words."""

    line: int
    engine: int
    kind: str
    expected: str
    got: str
    field: str = ""
    decision: str = ""


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


# Block tables and hash chains as a side has shipped them so far, per
# generation. A position no job shipped reads as a block id and a hash no
# trace can hold (ids are >= 0, hashes not empty).
_Tables = dict[GenKey, tuple[list[list[int]], list[bytes]]]
_UNSHIPPED_BLOCK = -1
_UNSHIPPED_HASH = b""
# The trace's number for a model job the trace never emitted (ids are >= 0).
_NOT_EMITTED = -1


class _JobNumbers:
    """The trace's store job ids against the model's, paired by order of
    emission: the trace's first job is the model's first, its second the
    model's second. A pair is forgotten once the model released the job."""

    def __init__(self) -> None:
        self.to_model: dict[int, int] = {}
        self.to_trace: dict[int, int] = {}
        self.last: int | None = None

    def pair(self, recorded: Plan, model: Plan, listed: Sequence[int]) -> None:
        """Pair a plan's jobs, the trace's in id order; ``listed``: the trace's
        ids as its line lists them (to name the field of a repeated id)."""
        for i, save in enumerate(recorded.saves):
            job = save.job_id
            if self.last is not None and job <= self.last:
                # S22 for `kvstate check`; here a job the model never emits,
                # since its ids follow the order of emission.
                raise _Mismatch(
                    "Planned", job, f"a job id after {self.last}",
                    f".plan.saves[{listed.index(job)}].job_id",
                    f"step {recorded.step}: the trace emits {_job_words(job, save.req_id)} "
                    f"after job {self.last}; job ids strictly increase in the order jobs are "
                    "emitted (S22), and the model's do")
            self.last = job
            if i < len(model.saves):
                self.to_model[job] = model.saves[i].job_id
                self.to_trace[model.saves[i].job_id] = job

    def model_id(self, recorded: int) -> int | None:
        return self.to_model.get(recorded)

    def trace_id(self, model: int) -> int:
        """The trace's id for a model job (`_NOT_EMITTED` when it has none)."""
        return self.to_trace.get(model, _NOT_EMITTED)

    def forget(self, model_jobs: Iterable[int]) -> None:
        for model in model_jobs:
            recorded = self.to_trace.pop(model, None)
            if recorded is not None:
                self.to_model.pop(recorded, None)


class _EngineReplay:
    def __init__(self, config: Any, protocol: str) -> None:
        variant = get_variant(protocol)
        self.config = config
        self.planner = Planner(config, variant)
        self.produced: deque[Any] = deque()
        self.now = 0.0  # the recorded time of the line being applied: the executors' clock
        self.executors = [
            Executor(config, r, variant, clock=lambda: self.now, observer=self.produced.append)
            for r in range(config.world_size)
        ]
        self.step: SchedulerStep | None = None
        self.step_no = 0  # the trace's number of the latest plan, for the words
        self.current: dict[int, tuple[RankJob, ExistsCall | PutCall]] = {}
        self.codes: dict[int, dict[int, int]] = {}  # per rank: put key index -> code
        self.outbox: deque[Report] = deque()
        self.delivered: list[Report] = []
        self.loads: dict[int, list[GetCall]] = {}
        self.load_reports: list[LoadReport] = []
        self.jobs = _JobNumbers()
        self.trace_tables: _Tables = {}
        self.model_tables: _Tables = {}
        # The line being applied: the record as read and the annotations it
        # left out (not compared).
        self.line: Any = None
        self.absent: frozenset[str] = NO_ABSENT
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
            self.codes[rank] = {}

    def in_trace_numbers(self, record: Any) -> Any:
        """A model output with its job ids as the trace numbers them."""
        trace_id = self.jobs.trace_id
        if isinstance(record, Settlement):
            return _with(record, released_jobs=tuple(trace_id(j) for j in record.released_jobs))
        if isinstance(record, (Report, JobStarted, StateWritten, JobFinished, ExistsAnswered)):
            return _with(record, job_id=trace_id(record.job_id))
        return record

    def forget(self, ended: Iterable[GenerationEnd]) -> None:
        """Ended generations save no more: their shipped tables go."""
        for end in ended:
            key = (end.req_id, end.generation)
            self.trace_tables.pop(key, None)
            self.model_tables.pop(key, None)


def _with(record: Any, **changes: Any) -> Any:
    """``record`` with ``changes``; the record itself when they change
    nothing: kvstate's own traces mostly need no normalising, and evolving
    every compared record would slow replay down by a quarter."""
    for name, value in changes.items():
        if getattr(record, name) != value:
            return attrs.evolve(record, **changes)
    return record


# --------------------------------------------------------------------------
# Normalisations: how a producer may write an output down without deciding
# anything differently. Each takes the recorded output and the model's (same
# type, or the comparison fails anyway) and returns both normalised; they run
# in the order of ``NORMALISATIONS``. specs/replay.md lists them.

Normalisation = Callable[[Any, Any, _EngineReplay], tuple[Any, Any]]


def _saves_in_job_order(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """A plan's saves in job id order. The list order is how the producer
    serialised the step's metadata; which job was emitted first is its id
    (ids strictly increase, specs/trace.md), and the order a rank runs its
    jobs in is still judged, by the rank's JobStarted lines."""
    if isinstance(recorded, Plan):
        recorded = _with(recorded, saves=tuple(sorted(recorded.saves, key=lambda s: s.job_id)))
    return recorded, model


def _jobs_numbered_by_emission(recorded: Any, model: Any,
                               engine: _EngineReplay) -> tuple[Any, Any]:
    """The model's job ids written as the trace's: the trace's n-th job is
    the model's n-th (`_JobNumbers`). vLLM's connector numbers store jobs
    from 0, kvstate from 1, any producer from where it likes; a job is its
    place in the order of emission, and that order is compared (a job the
    trace emits for another request or token range than the model's n-th is
    a divergence). Divergences name jobs in the trace's numbering."""
    if isinstance(recorded, Plan) and isinstance(model, Plan):
        engine.jobs.pair(recorded, model, [s.job_id for s in engine.line.plan.saves])
        trace_id = engine.jobs.trace_id
        return recorded, _with(model, saves=tuple(
            _with(s, job_id=trace_id(s.job_id)) for s in model.saves))
    return recorded, engine.in_trace_numbers(model)


def _steps_numbered_by_order(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """A plan's step number is the trace's: the producer's own step counter
    (kvstate's planner counts its plans from 1, an engine may count every
    scheduler step from 0). Plans are compared in order, the trace's n-th
    with the model's n-th, and the number labels the step, nothing more: the
    model's clock is the trace's time ``t``."""
    if isinstance(recorded, Plan) and isinstance(model, Plan):
        model = _with(model, step=recorded.step)
    return recorded, model


def _unrecorded(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """The model's output with the annotations the trace left out taken from
    the recorded line (their defaults): a left-out field is not recorded, so
    it is not compared (`kvstate.trace.ANNOTATIONS`)."""
    absent = engine.absent
    if not absent or type(model) is not type(recorded):
        return recorded, model
    return recorded, _with(model, **{name: getattr(recorded, name) for name in absent})


def _observed_only(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """The model's output with the fields the observed layer leaves out
    (`kvstate.contract.OMITTABLE`) taken from the recorded line: a trace that
    derives its generations wrote none of them, so none is compared."""
    omit = OMITTABLE.get(type(model).__name__)
    if not engine.observed_only or omit is None or type(model) is not type(recorded):
        return recorded, model
    return recorded, _with(model, **{name: getattr(recorded, name) for name in omit
                                     if name != "generation"})


def _whole_block_table(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """Each save as the whole block table and hash chain it covers: its slice
    (``block_ids_start``, ``hashes_start``) applied to what the generation's
    earlier jobs shipped. kvstate's default protocol ships only what is new
    since the generation's previous job, upstream's connector (and ``e2``)
    the whole current table from 0 every time; a rank resolves both to the
    same table (`kvstate.variants.DeltaMetadata.resolve`), and that table is
    what the job reads."""
    if isinstance(recorded, Plan) and isinstance(model, Plan):
        recorded = _with(recorded, saves=tuple(
            _resolved(s, engine.trace_tables) for s in recorded.saves))
        model = _with(model, saves=tuple(
            _resolved(s, engine.model_tables) for s in model.saves))
    return recorded, model


def _resolved(meta: SaveMeta, tables: _Tables) -> SaveMeta:
    blocks, hashes = tables.setdefault(meta.gen_key, ([], []))
    for g, ids in enumerate(meta.block_ids):
        if g == len(blocks):
            blocks.append([])
        _ship(blocks[g], meta.block_ids_start, ids, _UNSHIPPED_BLOCK)
    _ship(hashes, meta.hashes_start, meta.block_hashes, _UNSHIPPED_HASH)
    return _with(meta, block_ids_start=0, block_ids=tuple(tuple(t) for t in blocks),
                 hashes_start=0, block_hashes=tuple(hashes))


def _ship(known: list[Any], start: int, new: Sequence[Any], unshipped: Any) -> None:
    """``known[start:] = new``, as a rank's mirror takes a slice."""
    if start > len(known):
        known.extend([unshipped] * (start - len(known)))
    known[start:] = new


def _snapshot_only_with_events(recorded: Any, model: Any,
                               engine: _EngineReplay) -> tuple[Any, Any]:
    """No token snapshot with KV events off: a rank reads a job's
    ``token_ids`` only to fill the ``BlockStored`` events it announces, so
    with ``enable_kv_events`` false kvstate ships none and whatever another
    producer writes there is read by nobody. With events on it is compared:
    the events' tokens come from it."""
    if isinstance(recorded, Plan) and isinstance(model, Plan) \
            and not engine.config.enable_kv_events:
        recorded = _with(recorded, saves=tuple(
            _with(s, token_ids=None) for s in recorded.saves))
        model = _with(model, saves=tuple(
            _with(s, token_ids=None) for s in model.saves))
    return recorded, model


def _blocks_as_multisets(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """Pins and releases as multisets: each is one +1 or -1 reference on an
    engine block, applied by the block pool; how often each block is pinned
    or released in a step or settlement is the decision, the list order is
    not. (The order blocks are freed in can change which free block the
    engine hands out next, but replay takes every allocation from the trace,
    so no later decision of the model rests on it.) The blocks a load
    reports as failed likewise: the planner takes them as a set."""
    names = {Plan: ("pins", "releases"), Settlement: ("releases",),
             LoadDone: ("reported_block_ids",)}.get(type(recorded))
    if names is None or type(model) is not type(recorded):
        return recorded, model
    return (_with(recorded, **{n: tuple(sorted(getattr(recorded, n))) for n in names}),
            _with(model, **{n: tuple(sorted(getattr(model, n))) for n in names}))


def _released_jobs_as_a_set(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """A settlement's released jobs as a set: which jobs the batch of reports
    completed is the decision; the list follows the order of the reports,
    which the ReportDelivered lines before it give already."""
    if isinstance(recorded, Settlement) and isinstance(model, Settlement):
        recorded = _with(recorded, released_jobs=tuple(sorted(recorded.released_jobs)))
        model = _with(model, released_jobs=tuple(sorted(model.released_jobs)))
    return recorded, model


def _verdict_chunks_as_sets(recorded: Any, model: Any, engine: _EngineReplay) -> tuple[Any, Any]:
    """A job's verdict lists the chunks it holds as stored and those whose
    put failed as (group, chunk id) pairs; each names itself, so the order
    they are listed in is the producer's."""
    if isinstance(recorded, JobFinished) and isinstance(model, JobFinished):
        recorded = _with(recorded, stored=tuple(sorted(recorded.stored)),
                         failed=tuple(sorted(recorded.failed)))
        model = _with(model, stored=tuple(sorted(model.stored)),
                      failed=tuple(sorted(model.failed)))
    return recorded, model


def _keys_of_one_call_as_a_set(recorded: Any, model: Any,
                               engine: _EngineReplay) -> tuple[Any, Any]:
    """A lookup's or an existence check's keys, each with its answer, in key
    order: the store answers every key of a batch call on its own and replay
    hands the model each answer by its key (`_answers_by_key`), so the order
    a producer lists them in decides nothing; which keys are asked does. The
    PutDone lines of one put call are matched to its keys the same way, in
    whatever order they come."""
    if isinstance(recorded, (ExistsAnswered, LookupDone)) and type(model) is type(recorded):
        return _in_key_order(recorded), _in_key_order(model)
    return recorded, model


def _in_key_order(record: Any) -> Any:
    pairs = sorted(zip(record.keys, record.present), key=lambda pair: pair[0])
    return _with(record, keys=tuple(k for k, _ in pairs), present=tuple(p for _, p in pairs))


NORMALISATIONS: tuple[Normalisation, ...] = (
    _saves_in_job_order,
    _jobs_numbered_by_emission,
    _steps_numbered_by_order,
    _unrecorded,
    _observed_only,
    _whole_block_table,
    _snapshot_only_with_events,
    _blocks_as_multisets,
    _released_jobs_as_a_set,
    _verdict_chunks_as_sets,
    _keys_of_one_call_as_a_set,
)


def _answers_by_key(keys: Sequence[str], answers: Sequence[bool],
                    wanted: Sequence[str]) -> tuple[bool, ...]:
    """The recorded answers in the order of the model's keys. A key the trace
    did not ask about reads as absent; the comparison of the keys, which
    comes first, names it."""
    by_key = dict(zip(keys, answers))
    return tuple(by_key.get(key, False) for key in wanted)


# --------------------------------------------------------------------------
# Comparing.


class _Mismatch(Exception):
    """A recorded output and the model's differ. ``field`` is the path of the
    compared record in the line (``.plan`` for a plan); ``decision``, when
    the handler already knows the words, says what differs."""

    def __init__(self, kind: str, expected: Any, got: Any, field: str = "",
                 decision: str = "") -> None:
        self.kind = kind
        self.expected = expected
        self.got = got
        self.field = field
        self.decision = decision


def _compare(engine: _EngineReplay, kind: str, recorded: Any, model: Any,
             field: str = "") -> None:
    for normalise in NORMALISATIONS:
        recorded, model = normalise(recorded, model, engine)
    if recorded != model:
        raise _Mismatch(kind, recorded, model, field)


# Fields normalised to multisets or sets (and the answers sorted with their
# keys): a divergence names them whole.
_COMPARED_WHOLE = frozenset({"pins", "releases", "reported_block_ids", "released_jobs",
                             "stored", "failed", "keys", "present"})


def _divergence(mm: _Mismatch, line: int, index: int, engine: _EngineReplay) -> Divergence:
    if mm.decision:
        return Divergence(line, index, mm.kind, _short(mm.expected), _short(mm.got), mm.field,
                          mm.decision)
    path, a, b = first_difference(mm.expected, mm.got)
    decision = _decision(mm.expected, mm.got, path, engine)
    top = _top(path)
    table = re.match(r"\.saves\[(\d+)\]\.(block_ids|block_hashes)\b", path)
    if top in _COMPARED_WHOLE and path != "." + top:
        # A position in a sorted multiset is no place in the line: the
        # field is named whole, with both sides.
        path, a, b = "." + top, getattr(mm.expected, top), getattr(mm.got, top)
    elif table is not None and path != table.group(0):
        # Likewise a position in the whole table, which the line may ship
        # as a slice.
        i, name = int(table.group(1)), table.group(2)
        path = table.group(0)
        a, b = getattr(mm.expected.saves[i], name), getattr(mm.got.saves[i], name)
    if isinstance(mm.expected, Plan):  # a save's place in the line, not in id order
        plan = mm.expected
        path = re.sub(r"^\.saves\[(\d+)\]", lambda m: _save_in_line(engine, plan, m), path)
    return Divergence(line, index, mm.kind, _short(a), _short(b), mm.field + path, decision)


def _save_in_line(engine: _EngineReplay, plan: Plan, match: re.Match[str]) -> str:
    """``.saves[i]`` of the normalised (id-ordered) plan as the line lists it."""
    job_id = plan.saves[int(match.group(1))].job_id
    return f".saves[{[s.job_id for s in engine.line.plan.saves].index(job_id)}]"


# --------------------------------------------------------------------------
# The difference in words: the decision, the trace's job numbering.


def _job_words(job_id: int, req_id: str) -> str:
    if job_id == _NOT_EMITTED:
        return f"a job of {req_id!r} the trace does not emit"
    return f"job {job_id} of {req_id!r}"


def _jobs_words(saves: Sequence[SaveMeta]) -> str:
    if not saves:
        return "no job"
    return ", ".join(f"{_job_words(s.job_id, s.req_id)} for tokens "
                     f"[{s.token_ids_start}, {s.token_len})" for s in saves)


def _who(record: Any) -> str:
    """Whose output ``record`` is, in words."""
    if isinstance(record, Report):
        return f"rank {record.rank}'s report of {_job_words(record.job_id, record.req_id)}"
    if isinstance(record, LookupDone):
        return f"the lookup of {record.req_id!r}"
    if isinstance(record, LoadDone):
        return f"rank {record.rank}'s load of {record.req_id!r}"
    rank, req_id = getattr(record, "rank", None), getattr(record, "req_id", None)
    if rank is not None and req_id is not None:
        return f"rank {rank}, {_job_words(record.job_id, req_id)}"
    if rank is not None:
        return f"rank {rank}, job {getattr(record, 'job_id', '?')}"
    return type(record).__name__


def _differences(verb: str, model: Sequence[Any], trace: Sequence[Any]) -> str:
    """What only one side has, as multisets."""
    m, t = Counter(model), Counter(trace)
    parts = [f"only the {side} {verb} {_short(list(only.elements()), 200)}"
             for side, only in (("model", m - t), ("trace", t - m)) if only]
    return f" ({'; '.join(parts)})" if parts else ""


def _top(path: str) -> str:
    match = re.match(r"\.(\w+)", path)
    return match.group(1) if match else ""


# What a field of a rank's record says, for the words.
_RANK_WORDS = {
    "outcome": "the job's verdict",
    "stored": "the chunks (group, chunk id) it holds as stored",
    "failed": "the chunks (group, chunk id) whose put failed",
    "events": "the events it announces",
    "save_start": "the first token it considers",
    "token_len": "where the job ends",
    "live": "whether the rank holds saved-offset state for the request",
    "state_generation": "the generation whose rank state the job reads",
    "retry_generation": "the generation whose retry suffix it found",
    "scope_generation": "the generation the rank state it writes belongs to",
    "field": "the rank state it writes",
    "value": "the value it writes",
    "confirmed_offset": "the saved offset it confirms",
    "skipped_since": "since when the request is skipped for store pressure",
    "now": "the time of the verdict",
}


def _decision(recorded: Any, model: Any, path: str, engine: _EngineReplay) -> str:
    top = _top(path)
    if isinstance(recorded, Plan) and isinstance(model, Plan):
        return _plan_decision(recorded, model, path, top)
    if isinstance(recorded, Settlement) and isinstance(model, Settlement):
        return _settlement_decision(recorded, model, path, top, engine.step_no)
    if type(recorded) is not type(model):
        return (f"the trace has {type(recorded).__name__} ({_who(recorded)}) where the model "
                f"produces {type(model).__name__} ({_who(model)})")
    if isinstance(recorded, LookupDone):
        if top == "keys":
            return (f"the lookup of {recorded.req_id!r}: the model asks the store about "
                    f"{len(model.keys)} keys, the trace about {len(recorded.keys)}"
                    + _differences("asks about", model.keys, recorded.keys))
        return (f"the lookup of {recorded.req_id!r}: the model concludes a hit of "
                f"{model.hit_tokens} tokens, the trace {recorded.hit_tokens}")
    if isinstance(recorded, ExistsAnswered):
        return (f"{_who(recorded)}: the model checks whether {len(model.keys)} keys exist, "
                f"the trace {len(recorded.keys)}"
                + _differences("checks", model.keys, recorded.keys))
    if isinstance(recorded, LoadDone):
        return (f"{_who(recorded)}: the model reports blocks {list(model.reported_block_ids)} "
                f"as failed, the trace {list(recorded.reported_block_ids)}")
    if isinstance(recorded, JobStarted) and top in ("job_id", "req_id", "generation"):
        return (f"rank {recorded.rank} starts {_job_words(recorded.job_id, recorded.req_id)} "
                f"(generation {recorded.generation}) in the trace, the model's rank "
                f"{model.rank} starts {_job_words(model.job_id, model.req_id)} "
                f"(generation {model.generation})")
    if isinstance(recorded, Report) and top in ("rank", "job_id", "req_id", "generation"):
        return f"the trace delivers {_who(recorded)} next, the model {_who(model)}"
    a, b = getattr(recorded, top, recorded), getattr(model, top, model)
    if top == "events":
        return (f"{_who(recorded)}: the model announces {len(b)} events "
                f"({_events_words(b)}), the trace {len(a)} ({_events_words(a)})"
                + _differences("announces", _event_names(b), _event_names(a)))
    text = (f"{_who(recorded)}: {_RANK_WORDS.get(top, top)}: {_short(b, 200)} in the model, "
            f"{_short(a, 200)} in the trace")
    if top in ("stored", "failed"):
        text += _differences("has", b, a)
    return text


def _plan_decision(recorded: Plan, model: Plan, path: str, top: str) -> str:
    step = f"step {recorded.step}"
    if top == "saves":
        match = re.match(r"\.saves\[(\d+)\]\.(\w+)", path)
        if match is None or match.group(2) in ("req_id", "generation", "job_id"):
            return (f"{step}: the model emits {_jobs_words(model.saves)}, the trace emits "
                    f"{_jobs_words(recorded.saves)}")
        i, field = int(match.group(1)), match.group(2)
        rec, mod = recorded.saves[i], model.saves[i]
        return f"{step}, {_job_words(rec.job_id, rec.req_id)}: {_save_words(field, rec, mod)}"
    if top in ("pins", "releases"):
        a, b = getattr(recorded, top), getattr(model, top)
        why = ""
        if top == "pins" and recorded.saves:
            why = " for " + " and ".join(_job_words(s.job_id, s.req_id) for s in recorded.saves)
        elif top == "releases" and model.ended:
            why = " as " + " and ".join(
                f"{e.req_id!r} (generation {e.generation}) is {e.reason}" for e in model.ended)
        return (f"{step}: the model {top} blocks {_short(list(b), 200)}{why}, the trace {top} "
                f"{_short(list(a), 200)}" + _differences(top, b, a))
    if top == "loads":
        return (f"{step}: the model loads {_loads_words(model.loads)}, the trace loads "
                f"{_loads_words(recorded.loads)}")
    return (f"{step}: the plan's {top}: {_short(getattr(model, top, model), 200)} in the "
            f"model, {_short(getattr(recorded, top, recorded), 200)} in the trace")


def _save_words(field: str, rec: SaveMeta, mod: SaveMeta) -> str:
    if field in ("token_ids_start", "token_len"):
        return (f"the model saves tokens [{mod.token_ids_start}, {mod.token_len}), the trace "
                f"saves [{rec.token_ids_start}, {rec.token_len})")
    if field == "block_ids":
        unknown = any(b == _UNSHIPPED_BLOCK for table in rec.block_ids for b in table)
        return (f"the model's job covers blocks {_short(mod.block_ids, 200)} (its generation's "
                f"table so far), the trace's {_short(rec.block_ids, 200)}"
                + (f" ({_UNSHIPPED_BLOCK}: a position no earlier job of the generation shipped)"
                   if unknown else ""))
    if field == "block_hashes":
        at = next((k for k, (x, y) in enumerate(zip(rec.block_hashes, mod.block_hashes))
                   if x != y), min(len(rec.block_hashes), len(mod.block_hashes)))
        return (f"the job's hash chains differ from hash {at} on (the model's has "
                f"{len(mod.block_hashes)} hashes, the trace's {len(rec.block_hashes)})")
    if field == "token_ids":
        return (f"the job's token snapshots differ: {_short(mod.token_ids, 120)} in the model, "
                f"{_short(rec.token_ids, 120)} in the trace")
    if field == "is_decode":
        kinds = ("a prefill", "a decode")
        return (f"the model saves it as {kinds[mod.is_decode]} job, the trace as "
                f"{kinds[rec.is_decode]} job")
    if field == "num_prompt_tokens":
        return (f"the model counts a prompt of {mod.num_prompt_tokens} tokens, the trace "
                f"{rec.num_prompt_tokens}")
    return f"{field}: {_short(getattr(mod, field))} in the model, {_short(getattr(rec, field))} " \
           "in the trace"


def _loads_words(loads: Sequence[LoadMeta]) -> str:
    if not loads:
        return "nothing"
    return ", ".join(f"tokens [{m.start_token}, {m.end_token}) of {m.req_id!r} into blocks "
                     f"{_short(m.block_ids, 120)}" for m in loads)


def _settlement_decision(recorded: Settlement, model: Settlement, path: str, top: str,
                         step: int) -> str:
    who = f"the settlement after step {step}"
    if top == "releases":
        why = (f" as jobs {list(model.released_jobs)} are done" if model.released_jobs
               else "")
        return (f"{who}: the model releases blocks {_short(list(model.releases), 200)}{why}, "
                f"the trace releases {_short(list(recorded.releases), 200)}"
                + _differences("releases", model.releases, recorded.releases))
    if top == "published":
        match = re.match(r"\.published\[(\d+)\]\.(\w+)", path)
        if match is not None:
            i, field = int(match.group(1)), match.group(2)
            return (f"{who}: published event {i} (chunk "
                    f"{_events_words(recorded.published[i:i + 1])}) differs in {field}: "
                    f"{_short(getattr(model.published[i], field), 200)} in the model, "
                    f"{_short(getattr(recorded.published[i], field), 200)} in the trace")
        return (f"{who}: the model publishes {len(model.published)} events "
                f"({_events_words(model.published)}), the trace {len(recorded.published)} "
                f"({_events_words(recorded.published)})"
                + _differences("publishes", _event_names(model.published),
                               _event_names(recorded.published)))
    if top == "released_jobs":
        return (f"{who}: the model releases jobs {list(model.released_jobs)}, the trace "
                f"{list(recorded.released_jobs)}")
    return (f"{who}: {top}: {_short(getattr(model, top, model), 200)} in the model, "
            f"{_short(getattr(recorded, top, recorded), 200)} in the trace")


def _event_names(events: Sequence[Any]) -> list[str]:
    """An event by the chunk it announces: its hash's first 12 hex digits."""
    return [e.block_hashes[0].hex()[:12] if e.block_hashes else "?" for e in events]


def _events_words(events: Sequence[Any]) -> str:
    names = _event_names(events[:6])
    return ", ".join(names) + (", ..." if len(events) > 6 else "") if names else "none"


# --------------------------------------------------------------------------
# Replaying.


def replay_trace(path: str | Path, protocol: str | None = None) -> ReplayResult:
    with TraceReader(path) as reader:
        name = reader.name
        check_header_options(path, reader.header)
        chosen = _protocol(name, reader.header, protocol)
        engines = [_EngineReplay(config, chosen) for config in reader.header["configs"]]
        compared = 0
        for number, index, when, obs in reader:
            engine = engines[index]
            engine.now = when
            engine.line = obs
            engine.absent = reader.absent
            engine.observed_only = reader.derivation.mode == "derived"
            try:
                compared += _apply(engine, obs)
            except _Mismatch as mm:
                return ReplayResult(name, chosen, number, compared,
                                    _divergence(mm, number, index, engine))
            except TraceError:
                raise
            except (ValueError, KeyError, IndexError, IllegalTransition) as exc:
                return ReplayResult(name, chosen, number, compared, Divergence(
                    number, index, type(obs).__name__, _short(obs),
                    f"the model could not take this input: {exc}", "",
                    f"the model could not take this {type(obs).__name__}: {exc}"))
            except Exception as exc:  # never a traceback for a line the reader took
                raise TraceError(f"{name}:{number}", "",
                                 f"the model could not take this {type(obs).__name__} "
                                 f"({type(exc).__name__}: {exc})") from None
        for index, engine in enumerate(engines):
            if engine.observed_only:
                while engine.produced and isinstance(engine.produced[0], StateWritten):
                    engine.produced.popleft()
            if engine.produced:
                extra = engine.in_trace_numbers(engine.produced[0])
                return ReplayResult(name, chosen, reader.last_line, compared, Divergence(
                    reader.last_line, index, "end of trace", "nothing more", _short(extra), "",
                    f"the trace ends where the model still produces {type(extra).__name__} "
                    f"({_who(extra)})"))
        return ReplayResult(name, chosen, reader.last_line, compared, None)


def _protocol(name: str, header: dict[str, Any], protocol: str | None) -> str:
    """The variant to re-drive: ``protocol`` (``--protocol``), else the
    header's. Without either replay cannot start: a default would judge the
    trace against a protocol nobody said it ran."""
    known = f"known: {', '.join(VARIANTS)}"
    chosen = protocol or header.get("protocol")
    if chosen is None:
        raise TraceError(f"{name}:1", "protocol",
                         "missing: replay re-drives the protocol variant that produced the "
                         "trace, and the header names none; write it in the header's "
                         f"`protocol` field or pass --protocol NAME ({known})")
    where, field = (name, "") if protocol else (f"{name}:1", "protocol")
    try:
        found = is_variant(chosen)
    except ValueError as exc:  # a module KVSTATE_VARIANTS names does not import
        raise TraceError(where, field, str(exc)) from None
    if not found:
        said = f"--protocol {chosen!r}" if protocol else repr(chosen)
        raise TraceError(where, field, f"{said} is not a kvstate protocol variant ({known}); "
                         "replay needs one: pass --protocol")
    return chosen


def _apply(engine: _EngineReplay, obs: Any) -> int:
    """Feed one recorded observation; return how many outputs were compared."""
    if engine.observed_only:
        produced = engine.produced
        while produced and isinstance(produced[0], StateWritten):
            produced.popleft()  # kvstate's own rank-state writes: no engine logs them
    if isinstance(obs, _PRODUCED):
        kind = type(obs).__name__
        if isinstance(obs, JobStarted) and not engine.produced:
            executor = engine.executors[obs.rank]
            job = executor.dequeue()
            if job is None:
                raise _Mismatch(kind, obs, "rank has no queued job", ".job_id",
                                f"rank {obs.rank} starts {_job_words(obs.job_id, obs.req_id)} "
                                f"in the trace; the model's rank {obs.rank} has no job queued")
            engine.handle(obs.rank, job, executor.start(job))
        if not engine.produced:
            raise _Mismatch(kind, obs, "the model produced nothing here", "",
                            f"the trace has {kind} ({_who(obs)}); the model produces nothing "
                            "here")
        _compare(engine, kind, obs, engine.produced.popleft())
        if engine.observed_only and isinstance(obs, JobStarted):
            while engine.produced and isinstance(engine.produced[0], StateWritten):
                engine.produced.popleft()
        return 1
    if engine.produced:
        extra = engine.in_trace_numbers(engine.produced[0])
        raise _Mismatch("extra output", "nothing before " + type(obs).__name__, extra, "",
                        f"the model produces {type(extra).__name__} ({_who(extra)}) before "
                        f"the trace's {type(obs).__name__}")
    if engine.load_reports and not isinstance(obs, LoadDone):
        engine.planner.on_load_reports(engine.load_reports)
        engine.load_reports = []
    if isinstance(obs, StepScheduled):
        engine.step = obs.step
    elif isinstance(obs, Planned):
        if engine.step is None:
            raise _Mismatch("Planned", obs.plan, "no StepScheduled before it", ".plan",
                            f"step {obs.plan.step}: the trace plans with no scheduler step "
                            "before it")
        plan = engine.planner.step(engine.step)
        engine.step = None
        engine.step_no = obs.plan.step
        _compare(engine, "Planned", obs.plan, plan, ".plan")
        engine.forget(plan.ended)
        for executor in engine.executors:
            # An asynchronous load lands steps later: loads wait for their
            # LoadDone across plans (a synchronous one lands in this step).
            engine.loads.setdefault(executor.rank, []).extend(executor.receive(plan))
        return 1
    elif isinstance(obs, ReportDelivered):
        if not engine.outbox:
            raise _Mismatch("ReportDelivered", obs.report, "no report pending", ".report",
                            f"{_who(obs.report)} reaches the scheduler in the trace; the model "
                            "has no report pending")
        report = engine.outbox.popleft()
        _compare(engine, "ReportDelivered", obs.report, report, ".report")
        engine.delivered.append(report)
        return 1
    elif isinstance(obs, Settled):
        settlement = engine.planner.on_reports(engine.delivered)
        engine.delivered = []
        _compare(engine, "Settled", obs.settlement, settlement, ".settlement")
        engine.jobs.forget(settlement.released_jobs)
        return 1
    elif isinstance(obs, LookupDone):
        query = engine.planner.lookup(obs.req_id, obs.num_prompt_tokens, obs.block_hashes)
        present = _answers_by_key(obs.keys, obs.present, query.keys)
        hit = engine.planner.lookup_answered(query, present)
        _compare(engine, "LookupDone", obs,
                 _with(obs, keys=query.keys, present=present, hit_tokens=hit))
        return 1
    elif isinstance(obs, Allocated):
        engine.planner.allocate(obs.req_id, obs.block_ids, obs.num_computed_tokens,
                                obs.num_external_tokens, obs.load_async)
    elif isinstance(obs, LoadDone):
        calls = engine.loads.get(obs.rank, [])
        call = next((c for c in calls if (c.req_id, c.generation) == (obs.req_id, obs.generation)),
                    None)
        if call is None:
            raise _Mismatch("LoadDone", obs, "no load planned for it", "",
                            f"{_who(obs)} finishes in the trace; the model planned no such load")
        calls.remove(call)
        failed = set(obs.failed_block_ids)
        load_report = engine.executors[obs.rank].load_answered(
            call, [b not in failed for b in call.block_ids])
        _compare(engine, "LoadDone", obs,
                 _with(obs, reported_block_ids=load_report.failed_block_ids))
        engine.load_reports.append(load_report)
        return 1
    elif isinstance(obs, ExistsAnswered):
        job, call = _current(engine, obs, ExistsCall)
        present = _answers_by_key(obs.keys, obs.present, call.keys)
        _compare(engine, "ExistsAnswered", obs,
                 _with(obs, job_id=call.job_id, keys=call.keys, present=present))
        del engine.current[obs.rank]
        engine.handle(obs.rank, job, engine.executors[obs.rank].exists_answered(job, present))
        return 1
    elif isinstance(obs, PutDone):
        job, call = _current(engine, obs, PutCall)
        answered = engine.codes[obs.rank]
        at = next((i for i, key in enumerate(call.keys) if key == obs.key and i not in answered),
                  None)
        if at is None:
            left = [key for i, key in enumerate(call.keys) if i not in answered]
            raise _Mismatch("PutDone", obs.key, left, ".key",
                            f"{_who(obs)}: the trace puts {obs.key!r}, not a key the model's "
                            f"put call has left to answer ({len(left)} left: "
                            f"{_short(left, 200)})")
        answered[at] = obs.code
        if len(answered) == len(call.keys):
            del engine.current[obs.rank]
            engine.handle(obs.rank, job, engine.executors[obs.rank].put_answered(
                job, [answered[i] for i in range(len(call.keys))]))
        return 1
    elif isinstance(obs, StoreCallRaised):
        pending = engine.current.get(obs.rank)
        if pending is None or pending[0].meta.job_id != engine.jobs.model_id(obs.job_id):
            raise _Mismatch("StoreCallRaised", obs, "no such store call in flight", ".job_id",
                            f"rank {obs.rank}, job {obs.job_id}: a store call raises in the "
                            f"trace; the model's rank {_in_flight(engine, pending)}")
        del engine.current[obs.rank]
        engine.handle(obs.rank, pending[0], engine.executors[obs.rank].raised(pending[0], obs.error))
    return 0


def _current(engine: _EngineReplay, obs: ExistsAnswered | PutDone,
             kind: type) -> tuple[RankJob, Any]:
    """The store call ``obs`` answers, in flight on its rank (its job in the
    trace's numbering)."""
    rank, job_id = obs.rank, obs.job_id
    pending = engine.current.get(rank)
    if pending is None or pending[0].meta.job_id != engine.jobs.model_id(job_id) \
            or not isinstance(pending[1], kind):
        what = "an existence check" if kind is ExistsCall else "a put"
        raise _Mismatch(type(obs).__name__, f"job {job_id} in a {kind.__name__} on rank {rank}",
                        pending[1] if pending else "nothing in flight", ".job_id",
                        f"rank {rank}, job {job_id}: the trace answers {what}; the model's "
                        f"rank {_in_flight(engine, pending)}")
    return pending


def _in_flight(engine: _EngineReplay, pending: tuple[RankJob, Any] | None) -> str:
    if pending is None:
        return "has no store call in flight"
    job, call = pending
    what = "an existence check" if isinstance(call, ExistsCall) else "a put"
    return (f"waits on {what} of "
            f"{_job_words(engine.jobs.trace_id(job.meta.job_id), job.meta.req_id)}")
