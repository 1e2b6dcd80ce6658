"""Every state machine of the connector's save protocol, as plain tables.

Theory of operation
===================

The Mooncake store connector has two halves that never share memory. The
*scheduler side* (one per engine, `kvstate.planner`) decides each step which
requests save which token range, numbers each save as a *store job*, pins the
engine blocks a job may read, and releases them when every rank has reported.
The *worker side* (one per tensor-parallel rank, `kvstate.executor`) runs each
job on a FIFO send thread: it checks which chunks already exist in the store,
puts the missing ones, advances its own *saved offset*, emits KV events, and
reports the job back. Nearly every serious upstream bug was a race between the
two (docs/invariants.md), so each piece of state that crosses that boundary has a
machine here:

``REQUEST``  keyed by (request id, generation). A generation is one unbroken
    run of a request: admission starts one, resumption after preemption starts
    a new one, and a client that reuses a finished id gets a new one too. All
    worker state is keyed by generation, which is what makes id reuse (ABA)
    harmless: a job of generation g can never see generation g+1's state.

``JOB``      keyed by (store job id, rank). Emitted by the planner with its
    blocks pinned, queued on the rank's FIFO, run (stale, skipped, vacuously or
    really stored, partially stored, failed), reported exactly once per rank on
    every path (the ``finally`` of upstream #43742), and released on the
    scheduler side once every rank has reported.

``PRESSURE`` keyed by rank. Mooncake answers -200 (no space) under pressure;
    the rank then skips further saves of the request that hit it until some put
    succeeds — or, in kvstate's default protocol, until a bounded backoff
    expires (``SKIP``), so an idle engine does not strand a request forever.

``SKIP``, ``RETRY`` keyed by (rank, request generation): whether the
    generation is skipped for pressure, and whether a failed job left a token
    suffix that the next job splices in front of its own (for KV events).

``PIN``      keyed by (request generation, block index) in the default
    protocol, by (job, block) in upstream's: a pin is an extra reference on an
    engine block that keeps it from being freed and reused while a job may read
    it (upstream #52360 was a job reading a block preemption had freed).

``SAVED_MARK`` keyed by (rank, request generation): the rank's confirmed
    saved offset. Only a live job may advance it; once retired it is gone, so
    a stale write is an illegal transition rather than a silent corruption.

Each table is ``{state: {event: next_state}}``. The hot path dispatches with two
dict lookups (``Machine.fire``); an event a state does not list is an error that
names the machine, the key, the state and the event. The same tables build
``transitions`` machines (`kvstate.diagrams`) that render the committed mermaid
diagrams and serve as a reference interpreter in the tests, and they answer the
enabled-events query the simulator, the fuzzer and the model checker use.
Guards (conditions that pick *which* event happens) are computed by the planner
and executor and named in ``GUARDS`` beside each table; the tables themselves
hold no code.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

import attrs

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class TableEnum(enum.Enum):
    """States and events hash by identity: members are singletons, and Enum's
    own ``__hash__`` (``hash(self._name_)``, Python code) is the single largest
    cost of a table dispatch on the hot path."""

    __hash__ = object.__hash__

    def __reduce_ex__(self, protocol: object) -> str:  # type: ignore[override]
        # Pickled as a reference to the member by name, which loads without
        # running Enum's constructor: the model checker copies whole states by
        # pickle, and this halves the cost of a copy.
        return f"{type(self).__qualname__}.{self._name_}"


class IllegalTransition(Exception):
    """An event arrived in a state whose table row does not list it."""

    def __init__(self, machine: str, key: Hashable, state: enum.Enum, event: enum.Enum):
        self.machine = machine
        self.key = key
        self.state = state
        self.event = event
        super().__init__(
            f"{machine} machine, key {key!r}: event {event.name} is not allowed in "
            f"state {state.name}"
        )


@attrs.frozen(slots=True)
class Machine(Generic[S, E]):
    name: str
    states: type[S]
    events: type[E]
    initial: S
    table: Mapping[S, Mapping[E, S]]
    guards: Mapping[E, str] = attrs.field(factory=dict)

    def fire(self, key: Hashable, state: S, event: E) -> S:
        """Next state, or IllegalTransition naming machine, key, state, event."""
        try:
            return self.table[state][event]  # zero-cost try: two dict lookups
        except KeyError:
            raise IllegalTransition(self.name, key, state, event) from None

    def enabled(self, state: S) -> frozenset[E]:
        return frozenset(self.table[state])

    @property
    def terminal(self) -> frozenset[S]:
        return frozenset(s for s in self.states if not self.table[s])

    def pairs(self) -> list[tuple[S, E]]:
        """Every (state, event) pair, legal or not, in declaration order."""
        return [(s, e) for s in self.states for e in self.events]


# --------------------------------------------------------------------------
# REQUEST: scheduler-side lifecycle of one request generation.


class RequestState(TableEnum):
    ABSENT = "absent"
    LOOKUP_PENDING = "lookup_pending"
    ALLOCATED = "allocated"
    LOAD_PARKED = "load_parked"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    FINISHED = "finished"


class RequestEvent(TableEnum):
    LOOKUP_STARTED = "lookup_started"
    ALLOCATE = "allocate"
    PARK_FOR_LOAD = "park_for_load"
    LOAD_FINISHED = "load_finished"
    SCHEDULE_PREFILL = "schedule_prefill"
    SCHEDULE_DECODE = "schedule_decode"
    PREEMPT = "preempt"
    RESUME = "resume"
    FINISH = "finish"


_R, _RE = RequestState, RequestEvent
REQUEST_TABLE: dict[RequestState, dict[RequestEvent, RequestState]] = {
    _R.ABSENT: {
        _RE.LOOKUP_STARTED: _R.LOOKUP_PENDING,
        _RE.ALLOCATE: _R.ALLOCATED,
        _RE.RESUME: _R.RESUMED,
        _RE.FINISH: _R.FINISHED,
    },
    _R.LOOKUP_PENDING: {
        _RE.ALLOCATE: _R.ALLOCATED,
        # vLLM asks again every step it cannot admit a waiting request (no
        # blocks, no token budget): upstream's connector looks the store up
        # again each time (seen in its observed trace); kvstate's answers
        # from the hit it already has.
        _RE.LOOKUP_STARTED: _R.LOOKUP_PENDING,
        _RE.FINISH: _R.FINISHED,
    },
    _R.ALLOCATED: {
        _RE.PARK_FOR_LOAD: _R.LOAD_PARKED,
        _RE.SCHEDULE_PREFILL: _R.PREFILLING,
        # Upstream's only (H4): vLLM freed the blocks of a load whose first
        # block failed and asks again; kvstate computes instead (K8).
        _RE.LOOKUP_STARTED: _R.LOOKUP_PENDING,
        # A preempted request looked up again when vLLM re-admits it: its
        # next generation starts at the lookup and resumes from here.
        _RE.RESUME: _R.RESUMED,
        _RE.FINISH: _R.FINISHED,
    },
    _R.LOAD_PARKED: {_RE.LOAD_FINISHED: _R.ALLOCATED, _RE.FINISH: _R.FINISHED},
    _R.PREFILLING: {
        _RE.SCHEDULE_PREFILL: _R.PREFILLING,
        _RE.SCHEDULE_DECODE: _R.DECODING,
        _RE.PREEMPT: _R.PREEMPTED,
        _RE.FINISH: _R.FINISHED,
    },
    # Another decode step of a decoding request is no transition: the planner's
    # decode fast path does no tracker work (the model checker reported the
    # self-loop this table used to list as never fired).
    _R.DECODING: {
        _RE.PREEMPT: _R.PREEMPTED,
        _RE.FINISH: _R.FINISHED,
    },
    # A preempted generation is over; resumption starts the next one at RESUMED.
    _R.PREEMPTED: {_RE.FINISH: _R.FINISHED},
    _R.RESUMED: {
        _RE.SCHEDULE_PREFILL: _R.PREFILLING,
        _RE.SCHEDULE_DECODE: _R.DECODING,
        _RE.PREEMPT: _R.PREEMPTED,
        _RE.FINISH: _R.FINISHED,
    },
    _R.FINISHED: {},
}

REQUEST = Machine(
    name="request",
    states=RequestState,
    events=RequestEvent,
    initial=RequestState.ABSENT,
    table=REQUEST_TABLE,
    guards={
        RequestEvent.SCHEDULE_DECODE: "num_computed_tokens >= prefill_end_tokens",
        RequestEvent.SCHEDULE_PREFILL: "num_computed_tokens < prefill_end_tokens",
        RequestEvent.PARK_FOR_LOAD: "num_external_tokens > 0 and load_async",
        RequestEvent.RESUME: "request id listed in resumed_req_ids (new generation)",
    },
)


# --------------------------------------------------------------------------
# JOB: one store job on one rank.


class JobState(TableEnum):
    EMITTED = "emitted"
    QUEUED = "queued"
    RUNNING = "running"
    CHECKING = "checking"
    PUTTING = "putting"
    STALE = "stale"
    SKIPPED = "skipped"
    STORED = "stored"
    PARTIALLY_STORED = "partially_stored"
    FAILED = "failed"
    REPORTED = "reported"
    RELEASED = "released"


class JobEvent(TableEnum):
    ENQUEUE = "enqueue"
    DEQUEUE = "dequeue"
    FOUND_STALE = "found_stale"
    SKIP_FOR_PRESSURE = "skip_for_pressure"
    NOTHING_TO_STORE = "nothing_to_store"
    CHECK_EXISTS = "check_exists"
    ALL_PRESENT = "all_present"
    PUT_MISSING = "put_missing"
    PUT_OK = "put_ok"
    PUT_PARTIAL = "put_partial"
    PUT_FAILED = "put_failed"
    RAISED = "raised"
    REPORT = "report"
    RELEASE = "release"


_J, _JE = JobState, JobEvent
_OUTCOMES = (_J.STALE, _J.SKIPPED, _J.STORED, _J.PARTIALLY_STORED, _J.FAILED)
JOB_TABLE: dict[JobState, dict[JobEvent, JobState]] = {
    _J.EMITTED: {_JE.ENQUEUE: _J.QUEUED},
    _J.QUEUED: {_JE.DEQUEUE: _J.RUNNING},
    # No RAISED here: CHECK_EXISTS is taken before the first store call, so a
    # call can only raise in CHECKING or PUTTING (the model checker reported the
    # entry this table used to list as never fired).
    _J.RUNNING: {
        _JE.FOUND_STALE: _J.STALE,
        _JE.SKIP_FOR_PRESSURE: _J.SKIPPED,
        _JE.NOTHING_TO_STORE: _J.STORED,
        _JE.CHECK_EXISTS: _J.CHECKING,
    },
    _J.CHECKING: {
        _JE.ALL_PRESENT: _J.STORED,
        _JE.PUT_MISSING: _J.PUTTING,
        _JE.RAISED: _J.FAILED,
    },
    _J.PUTTING: {
        _JE.PUT_OK: _J.STORED,
        _JE.PUT_PARTIAL: _J.PARTIALLY_STORED,
        _JE.PUT_FAILED: _J.FAILED,
        _JE.RAISED: _J.FAILED,
    },
    **{outcome: {_JE.REPORT: _J.REPORTED} for outcome in _OUTCOMES},
    _J.REPORTED: {_JE.RELEASE: _J.RELEASED},
    _J.RELEASED: {},
}

JOB = Machine(
    name="job",
    states=JobState,
    events=JobEvent,
    initial=JobState.EMITTED,
    table=JOB_TABLE,
    guards={
        JobEvent.FOUND_STALE: "job not in the rank's live set for its generation",
        JobEvent.SKIP_FOR_PRESSURE: "pressure active and generation skipped, backoff not expired",
        JobEvent.NOTHING_TO_STORE: "no chunk of this rank between its saved offset and token_len",
        JobEvent.ALL_PRESENT: "batch_is_exist says every key is present",
        JobEvent.PUT_OK: "every put returned 0",
        JobEvent.PUT_PARTIAL: "some puts returned < 0, some 0",
        JobEvent.PUT_FAILED: "every put returned < 0",
        JobEvent.RELEASE: "all world_size ranks reported the job",
    },
)



# --------------------------------------------------------------------------
# PRESSURE (per rank), SKIP and RETRY (per rank and request generation).


class PressureState(TableEnum):
    CLEAR = "clear"
    PRESSURED = "pressured"


class PressureEvent(TableEnum):
    PUT_REJECTED = "put_rejected"
    PUT_SUCCEEDED = "put_succeeded"


PRESSURE = Machine(
    name="pressure",
    states=PressureState,
    events=PressureEvent,
    initial=PressureState.CLEAR,
    table={
        PressureState.CLEAR: {
            PressureEvent.PUT_REJECTED: PressureState.PRESSURED,
            PressureEvent.PUT_SUCCEEDED: PressureState.CLEAR,
        },
        PressureState.PRESSURED: {
            PressureEvent.PUT_REJECTED: PressureState.PRESSURED,
            PressureEvent.PUT_SUCCEEDED: PressureState.CLEAR,
        },
    },
    guards={PressureEvent.PUT_REJECTED: "a put returned -200 (NO_AVAILABLE_HANDLE)"},
)


class SkipState(TableEnum):
    NOT_SKIPPED = "not_skipped"
    SKIPPED = "skipped"


class SkipEvent(TableEnum):
    MARK = "mark"
    CLEAR = "clear"
    BACKOFF_EXPIRED = "backoff_expired"


SKIP = Machine(
    name="skip",
    states=SkipState,
    events=SkipEvent,
    initial=SkipState.NOT_SKIPPED,
    table={
        SkipState.NOT_SKIPPED: {SkipEvent.MARK: SkipState.SKIPPED, SkipEvent.CLEAR: SkipState.NOT_SKIPPED},
        SkipState.SKIPPED: {
            SkipEvent.MARK: SkipState.SKIPPED,
            SkipEvent.CLEAR: SkipState.NOT_SKIPPED,
            SkipEvent.BACKOFF_EXPIRED: SkipState.NOT_SKIPPED,
        },
    },
    guards={
        SkipEvent.MARK: "a live job of this generation got -200",
        SkipEvent.CLEAR: "some put on this rank succeeded (clears the whole skip set)",
        SkipEvent.BACKOFF_EXPIRED: "now - skipped_since >= pressure_backoff (kvstate only)",
    },
)


class RetryState(TableEnum):
    CLEAN = "clean"
    HELD = "held"


class RetryEvent(TableEnum):
    FAILED_WITH_SUFFIX = "failed_with_suffix"
    SAVE_COMPLETED = "save_completed"


RETRY = Machine(
    name="retry",
    states=RetryState,
    events=RetryEvent,
    initial=RetryState.CLEAN,
    table={
        RetryState.CLEAN: {
            RetryEvent.FAILED_WITH_SUFFIX: RetryState.HELD,
            RetryEvent.SAVE_COMPLETED: RetryState.CLEAN,
        },
        RetryState.HELD: {
            RetryEvent.FAILED_WITH_SUFFIX: RetryState.HELD,
            RetryEvent.SAVE_COMPLETED: RetryState.CLEAN,
        },
    },
    guards={
        RetryEvent.FAILED_WITH_SUFFIX: "live job failed with KV events on: keep (start, token ids)",
        RetryEvent.SAVE_COMPLETED: "live job stored everything it owed",
    },
)


# --------------------------------------------------------------------------
# PIN and SAVED_MARK.


class PinState(TableEnum):
    UNPINNED = "unpinned"
    PINNED = "pinned"
    RELEASED = "released"


class PinEvent(TableEnum):
    PIN = "pin"
    CONFIRMED_BY_ALL_RANKS = "confirmed_by_all_ranks"
    UNREADABLE = "unreadable"


PIN = Machine(
    name="pin",
    states=PinState,
    events=PinEvent,
    initial=PinState.UNPINNED,
    table={
        PinState.UNPINNED: {PinEvent.PIN: PinState.PINNED},
        PinState.PINNED: {
            PinEvent.CONFIRMED_BY_ALL_RANKS: PinState.RELEASED,
            PinEvent.UNREADABLE: PinState.RELEASED,
        },
        PinState.RELEASED: {},
    },
    guards={
        PinEvent.PIN: "first job whose range covers the block (kvstate) / every job (e2)",
        PinEvent.CONFIRMED_BY_ALL_RANKS: "min over ranks of confirmed offset >= block end "
        "(kvstate) / all ranks reported the pinning job (e2)",
        PinEvent.UNREADABLE: "generation ended and its last job was released",
    },
)


class SavedMarkState(TableEnum):
    UNSAVED = "unsaved"
    ADVANCED = "advanced"
    RETIRED = "retired"


class SavedMarkEvent(TableEnum):
    RECORD_SAVED = "record_saved"
    RETIRE = "retire"


SAVED_MARK = Machine(
    name="saved_mark",
    states=SavedMarkState,
    events=SavedMarkEvent,
    initial=SavedMarkState.UNSAVED,
    table={
        SavedMarkState.UNSAVED: {
            SavedMarkEvent.RECORD_SAVED: SavedMarkState.ADVANCED,
            SavedMarkEvent.RETIRE: SavedMarkState.RETIRED,
        },
        SavedMarkState.ADVANCED: {
            SavedMarkEvent.RECORD_SAVED: SavedMarkState.ADVANCED,
            SavedMarkEvent.RETIRE: SavedMarkState.RETIRED,
        },
        SavedMarkState.RETIRED: {},
    },
    guards={
        SavedMarkEvent.RECORD_SAVED: "a live job stored (or found) every chunk it owed",
        SavedMarkEvent.RETIRE: "generation preempted, or finished with no live job left",
    },
)


MACHINES: tuple[Machine, ...] = (REQUEST, JOB, PRESSURE, SKIP, RETRY, PIN, SAVED_MARK)
MACHINES_BY_NAME: dict[str, Machine] = {m.name: m for m in MACHINES}
