"""``kvstate modelcheck``: exhaustive breadth-first exploration of a small scope.

Theory of operation
-------------------
A *state* is the whole synchronous harness (`kvstate.harness.Harness`: engine
model, planner, every rank executor, block pool, store, invariant monitor) plus
the model checker's own budget counters (which scope requests are still to be
admitted, faults, evictions and preemptions left). A *transition* is one
action the environment may take next:

* ``admit i``      a client submits scope request ``i`` (an id is reused only
                   after its earlier request finished);
* ``step``         one engine step (scheduling, planning, loads, the forward
                   pass; finished requests retire); ``step get-fails`` the same
                   with every store read in it failing;
* ``preempt r``    a step that preempts running request ``r``;
* ``abort r``      a step in which the client aborts ``r``;
* ``rank k A``     rank ``k`` performs its next store call (or dequeues a job)
                   and the store answers ``A``: ``ok``, ``-200`` (every key of
                   the batch), ``-800`` (the first key fails, the rest are
                   stored: a partial failure), ``raise`` (the call raises);
                   an existence check answers ``ok`` or ``raise``;
* ``evict K``      the store drops stored key ``K``.

Failures, evictions, preemptions and aborts are bounded per path by the scope
(the usual bounded-fault model); everything else is exhaustive. The
catalogue's monitor sees every observation, so a transition that breaks a
safety invariant is a violation; a state with nothing left to do (or nothing
but no-op steps) gets the quiescence check, which is where leaked pins, ledger
entries and unsettled jobs show.

States are stored, copied and identified as *values*
(`sim.explore.modelcheck.values`): one walk over a state's fields writes
nested tuples that ``marshal`` stores and a hash of which is the state's key;
a state is rebuilt from its value for every transition. The key is a function
of the state's value (equal strings that are one object or two give one key)
and applies these reductions:

* **Block-id symmetry.** Block ids are handed out as `BlockId` (an ``int``
  subclass), so the key can number them in order of first appearance; the
  pool is written last, per numbered id, its free queue in order. Two states
  that differ only by which physical blocks hold what get one key.
* **Request-id symmetry.** Scope requests with the same program (prompt, decode
  length, lookup) and no id reuse are interchangeable; their ids are handed out
  as `RequestName` and numbered the same way, and decode tokens are derived
  from the program, not the id (``token_seed``), so the renaming is a symmetry.
* **Counter abstraction.** Job ids, generations, planner step numbers and the
  monitor's observation index only ever grow and are only compared or tested
  for equality (data independence), so each is an `Ordinal` subclass and is
  written as its rank among the values present. Paths of different lengths
  that reach the same situation merge.
* **Left-out fields.** Pure statistics and caches (counters, the monitor's
  handler cache, the harness's records) are left out; they never influence a
  decision. Time is the harness's step count (`Tick`) with a backoff of one
  step, renamed by order like the counters.
* **What only the end of a trace reads.** The monitor's step bookkeeping
  (``Monitor.step``, ``last_report``, ``pinned_since``, each job's ``step``)
  feeds `Monitor.end`, the age-bounded liveness check of a finished trace,
  and nothing else; the model checker never calls ``end`` (a quiet state is
  judged by the `Quiescent` check, which reads no step), so these fields are
  left out. The monitor's observation number (``index``) is left out too: it
  only stamps findings, and no verdict reads it (the monitor keeps *when*
  comparisons as facts, see `kvstate.invariants`). `tests/test_modelcheck.py`
  scrambles these fields on random walks of every scope and protocol and
  finds no verdict that changes.
* **Dicts whose order nothing reads** (`UNORDERED_FIELDS`) are written sorted
  by key; a test parses the sources for any code that iterates one.

The renaming is *sound* (equal keys imply states equal up to a renaming
the code cannot observe) as long as the core never does arithmetic on these
values beyond ``+ 1``; it is not complete (a dict filled in another order gives
another key), which only costs reduction. `tests/test_modelcheck.py`
checks that the reduced and unreduced explorations find the same verdicts.
A rebuilt state keeps its own block ids, names and counter values (the stored
value carries them beside the key's numbers), so what a search expands is a
state some path reached, never a renamed one.

Breadth-first order makes the first violation found a shortest one; it is
replayed on a recording harness and written as a kvstate trace that
``kvstate replay`` and ``kvstate check`` accept.

The engine (`sim.explore.modelcheck.compact`) expands the frontier a
level at a time, optionally in worker processes or Ray actors.
"""

from __future__ import annotations

import hashlib
import sys
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec, Role
from kvstate.harness import Harness
from kvstate.invariants import Monitor, _Job
from kvstate.memory_store import MemoryStore, StoreRaised
from kvstate.planner import Planner
from kvstate.records import PutCall

# ---------------------------------------------------------------------------
# Tagged values the canonical pickler renames.


class BlockId(int):
    """A block id handed out by the model checker's pool (symmetric)."""

    __slots__ = ()


class RequestName(str):
    """A request id of an interchangeable scope request (symmetric)."""

    __slots__ = ()


class Ordinal(int):
    """A monotone counter value: only its order among live values matters."""

    __slots__ = ()

    def __add__(self, other: object) -> Ordinal:
        return type(self)(int(self) + int(other))  # type: ignore[call-overload]

    __radd__ = __add__


class JobNo(Ordinal):
    __slots__ = ()


class GenerationNo(Ordinal):
    __slots__ = ()


class StepNo(Ordinal):
    __slots__ = ()


class ObservationNo(Ordinal):
    __slots__ = ()


class Tick(Ordinal):
    """The harness clock (one tick per engine step). Pressure backoff is one
    tick, and ``now - since >= 1`` is ``now > since`` on integers: an order
    comparison, so ticks are renamed by rank like the counters."""

    __slots__ = ()


ORDINALS: tuple[type[Ordinal], ...] = (JobNo, GenerationNo, StepNo, ObservationNo, Tick)

# Fields that `Monitor.end` alone reads (see "What only the end of a trace
# reads" above; a test holds the monitor to it).
END_ONLY_FIELDS: dict[type, frozenset[str]] = {
    Monitor: frozenset({"step", "last_report", "pinned_since"}),
    _Job: frozenset({"step"}),
}

# Dicts no code the model checker runs iterates (see "Dicts whose order
# nothing reads" above; a test parses the sources for any other use). The
# state's key writes them as items sorted by key.
UNORDERED_FIELDS: dict[type, frozenset[str]] = {
    MemoryStore: frozenset({"objects"}),
    Monitor: frozenset({"frontier"}),
    Harness: frozenset({"current"}),
}


# ---------------------------------------------------------------------------
# Scopes.


@attrs.frozen
class ScopeRequest:
    name: str
    prompt: tuple[int, ...]
    decode: int = 0
    lookup: bool = True
    transferred: bool = False
    load_async: bool = False


@attrs.frozen
class Scope:
    name: str
    description: str
    requests: tuple[ScopeRequest, ...]
    world_size: int = 2
    num_blocks: int = 6
    block_size: int = 2
    token_budget: int = 4
    put_step: int = 1
    role: Role = Role.BOTH
    faults: int = 1  # failed/raising store answers per path
    evictions: int = 1
    preemptions: int = 1
    aborts: int = 0
    put_answers: tuple[str, ...] = ("ok", "-200", "-800", "raise")
    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    alignment: int | None = None

    def config(self) -> ConnectorConfig:
        return ConnectorConfig(
            role=self.role, block_size=self.block_size, world_size=self.world_size,
            put_step=self.put_step, save_decode_cache=True, enable_kv_events=True,
            pressure_backoff=1.0, groups=self.groups, alignment=self.alignment)

    def describe(self) -> str:
        reqs = ", ".join(
            f"{r.name}: {len(r.prompt)}-token prompt + {r.decode} decode"
            f"{' (lookup)' if r.lookup else ''}{' (async load)' if r.load_async else ''}"
            f"{' (P/D transfer)' if r.transferred else ''}"
            for r in self.requests)
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        return (f"{self.name}: {self.description}; {ranks}, put_step "
                f"{self.put_step}, {self.num_blocks} blocks of {self.block_size} tokens, "
                f"budget {self.token_budget} tokens/step; requests [{reqs}]; at most "
                f"{self.faults} store fault(s), {self.evictions} eviction(s), "
                f"{self.preemptions} preemption(s), {self.aborts} abort(s) per path")


# The first request is reused by id once it finished; the two prompts share
# their first block, so the reuse hits the store on lookup and its stale jobs
# (if any survive) would write into the new generation's namespace. (A request
# with ``decode=1`` finishes with the token its prefill sampled: no decode step.)
_A1 = ScopeRequest("a", (1, 2, 3), decode=1)
_A2 = ScopeRequest("a", (1, 2), decode=0)
_B = ScopeRequest("b", (1, 2, 4), decode=2)

# State counts are measured (`kvstate modelcheck --scope NAME`); every save job
# multiplies the space by the interleavings of its 2 x 3 rank calls with the
# engine, so the 2-rank scopes are kept to a few jobs. The default must stay
# exhaustive within 60 s on the 2-core development machine (~700 states/s).
SCOPES: dict[str, Scope] = {s.name: s for s in (
    Scope("tiny", "one request on one rank (a smoke test)",
          (ScopeRequest("a", (1, 2, 3), decode=2),), world_size=1, num_blocks=4),
    Scope("default", "one id used twice (reuse after finish, shared first block) on 2 ranks, "
          "every store answer with one fault per path",
          (_A1, _A2), faults=1, evictions=0, preemptions=0),
    Scope("churn", "the default requests with one eviction and one preemption per path and "
          "no store faults",
          (_A1, _A2), faults=0, evictions=1, preemptions=1),
    Scope("decode", "decode-phase saves across a preemption and an id reuse on one rank, a "
          "fault, an eviction",
          (ScopeRequest("a", (1, 2, 3), decode=3), ScopeRequest("a", (1, 2), decode=0)),
          world_size=1, num_blocks=5, faults=1, evictions=1, preemptions=1),
    Scope("twins", "two interchangeable requests (request-id symmetry) on 2 ranks",
          (ScopeRequest("a", (1, 2, 3), decode=1), ScopeRequest("b", (1, 2, 3), decode=1)),
          faults=0, evictions=0, preemptions=0),
    Scope("mla", "put_step 2: each chunk stored by one rank (striding), a job per block "
          "(2-token budget), one fault",
          (ScopeRequest("a", (1, 2, 3, 4, 5), decode=1),), put_step=2, num_blocks=5,
          token_budget=2, evictions=0, preemptions=0),
    Scope("load", "a second request loads (asynchronously) the prefix the first stored; "
          "one fault, a failed read included; one rank",
          (ScopeRequest("a", (1, 2, 3), decode=1),
           ScopeRequest("b", (1, 2, 3), decode=1, load_async=True)),
          world_size=1, faults=1, evictions=1, preemptions=0),
    Scope("pd", "a decode node (kv_consumer) whose prompt KV was transferred, one fault",
          (ScopeRequest("a", (1, 2, 3, 4, 5), decode=2, lookup=False, transferred=True),),
          role=Role.CONSUMER, faults=1, evictions=0, preemptions=0),
    Scope("hybrid", "two KV-cache groups sharing hashes (full attention and a 2-token sliding "
          "window that keeps the block before each 4-token boundary) with MLA-style striding: "
          "a chunk's groups are owned by different ranks; one fault",
          (ScopeRequest("a", (1, 2, 3, 4, 5, 6, 7, 8, 9), decode=1),), put_step=2,
          num_blocks=12, token_budget=8, faults=1, evictions=0, preemptions=0, alignment=4,
          groups=(GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 2))),
    Scope("hybrid-pd", "a decode node (kv_consumer) of the hybrid model (full attention and "
          "a 2-token sliding window) with MLA-style striding, saving decode-phase KV across a "
          "preemption; one fault per path",
          (ScopeRequest("a", (1, 2, 3, 4, 5, 6, 7, 8, 9), decode=4, lookup=False,
                        transferred=True),),
          role=Role.CONSUMER, put_step=2, num_blocks=12, token_budget=8, faults=1,
          evictions=0, preemptions=1, alignment=4,
          groups=(GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 2))),
    # The shapes that broke upstream, on two ranks, with decode-phase saves
    # and a -200 (the store out of space) as the one fault of a path. Each is
    # exhaustive within about a minute on two cores (`--workers 2`); all four
    # ingredients in one scope (`upstream`) take about two (2026-12-03).
    Scope("decode2", "decode-phase saves on 2 ranks across a preemption (the request "
          "resumes and saves again), one -200 per path",
          (ScopeRequest("a", (1, 2, 3), decode=2),), faults=1, evictions=0, preemptions=1,
          put_answers=("ok", "-200")),
    Scope("reuse2", "decode-phase saves on 2 ranks, then the id reused (the second "
          "request hits the first's prefix), one -200 per path",
          (ScopeRequest("a", (1, 2, 3), decode=3), _A2), faults=1, evictions=0,
          preemptions=0, put_answers=("ok", "-200")),
    Scope("pd-decode", "a decode node (kv_consumer) saving decode-phase KV on 2 ranks "
          "across a preemption, one -200 per path",
          (ScopeRequest("a", (1, 2, 3, 4, 5), decode=3, lookup=False, transferred=True),),
          role=Role.CONSUMER, faults=1, evictions=0, preemptions=1, put_answers=("ok", "-200")),
    Scope("upstream", "decode-phase saves on 2 ranks, a preemption, an id reuse and a -200 "
          "in one scope (113,281 states, exhaustive in ~2 minutes with 2 workers)",
          (ScopeRequest("a", (1, 2, 3), decode=2), _A2), faults=1, evictions=0,
          preemptions=1, put_answers=("ok", "-200")),
    # The load path among the upstream shapes (issue 30): on two ranks, a
    # second request loads (asynchronously) the prefix the first stores with
    # decode-phase saves; one fault per path, a -200 or a failed read.
    # 88,698 states, exhaustive in ~2.5 minutes on one core (measured:
    # `kvstate modelcheck --scope load2 --workers 1`).
    Scope("load2", "a second request loads (asynchronously) the prefix the first stores "
          "with decode-phase saves, on 2 ranks; one -200 or failed read per path",
          (ScopeRequest("a", (1, 2, 3), decode=2),
           ScopeRequest("b", (1, 2, 3), decode=1, load_async=True)),
          faults=1, evictions=0, preemptions=0, put_answers=("ok", "-200")),
    # Three ranks (issue 30): every chunk's keys stored by one rank of
    # three (put_step 3, MLA-style striding), decode-phase saves, a -200 per
    # path. 44,114 states, exhaustive in ~50 s with 2 workers (measured:
    # `kvstate modelcheck --scope three-ranks --workers 2`).
    Scope("three-ranks", "3 ranks with striding (put_step 3: each chunk stored by one "
          "rank), decode-phase saves, one -200 per path",
          (ScopeRequest("a", (1, 2, 3, 4, 5, 6, 7), decode=2),), world_size=3, put_step=3,
          num_blocks=6, token_budget=8, faults=1, evictions=0, preemptions=0,
          put_answers=("ok", "-200")),
    Scope("large", "two ids, one reused, a decode step, a fault, an eviction, a preemption "
          "and an abort per path (millions of states: bug hunting with --budget)",
          (_A1, _B, _A2), faults=1, evictions=1, preemptions=1, aborts=1),
)}


# ---------------------------------------------------------------------------
# The explored system.


class NextAnswers:
    """The store's answers for the next call (set by the action being taken).
    A class, not a closure, so the harness stays picklable."""

    __slots__ = ("put", "get", "exists", "used")

    def __init__(self) -> None:
        self.put = "ok"
        self.get = "ok"
        self.exists = "ok"
        self.used = False

    def reset(self) -> None:
        self.put = self.get = self.exists = "ok"
        self.used = False

    def __call__(self, op: str, rank: int, key: str) -> int | BaseException:
        answer = self.put if op == "put" else self.get if op == "get" else self.exists
        if answer == "ok":
            return 0
        self.used = True
        if answer == "raise":
            return StoreRaised("scripted by the model checker")
        if answer == "-800":  # partial failure: only the first key of the call fails
            if op == "put":
                self.put = "ok"
            return -800
        return int(answer)


@attrs.define
class System:
    """One state: the harness plus the model checker's budgets."""

    h: Harness
    answers: NextAnswers
    admitted: tuple[bool, ...]
    faults: int
    evictions: int
    preemptions: int
    aborts: int


def initial(scope: Scope, variant: str, *, reduce: bool = True,
            only: Sequence[str] | None = None) -> System:
    """``only``: check just these invariants (all by default)."""
    config = scope.config()
    answers = NextAnswers()
    h = Harness(config, variant, num_blocks=scope.num_blocks, store=MemoryStore(answers),
                token_budget=scope.token_budget, record=False, keep_finished=False,
                auto_preempt=True, monitor=Monitor(config, only=only))
    if reduce:
        h.now = Tick(0)
        h.pool.free = deque(BlockId(b) for b in h.pool.free)
        planner = cast(Planner, h.planner)
        planner._next_job_id = JobNo(planner._next_job_id)
        planner._next_generation = GenerationNo(planner._next_generation)
        planner._step = StepNo(planner._step)
        h.monitor.index = ObservationNo(h.monitor.index)
        h.monitor.last_job_id = JobNo(h.monitor.last_job_id)
    return System(h, answers, (False,) * len(scope.requests), scope.faults, scope.evictions,
                  scope.preemptions, scope.aborts)


def _symmetric(scope: Scope) -> set[int]:
    """Indexes of scope requests that are interchangeable (same program, an id
    used by no other scope request)."""
    names = [r.name for r in scope.requests]
    programs: dict[tuple[Any, ...], list[int]] = {}
    for i, r in enumerate(scope.requests):
        if names.count(r.name) == 1:
            programs.setdefault((r.prompt, r.decode, r.lookup, r.transferred, r.load_async),
                                []).append(i)
    return {i for group in programs.values() if len(group) > 1 for i in group}


Action = tuple[Any, ...]


def enabled(scope: Scope, s: System) -> list[Action]:
    h = s.h
    out: list[Action] = []
    for i, req in enumerate(scope.requests):
        if s.admitted[i]:
            continue
        earlier = [j for j in range(i) if scope.requests[j].name == req.name]
        if all(s.admitted[j] for j in earlier) and req.name not in h.requests:
            out.append(("admit", i))
    if h.requests or h.outbox:
        out.append(("step",))
        if s.faults and any(r.lookup and r.status != "running" for r in h.requests.values()):
            out.append(("step", "get-fails"))
        if s.preemptions:
            out += [("preempt", str(r.req_id)) for r in h.running]
        if s.aborts:
            out += [("abort", str(name)) for name in h.requests]
    for rank, executor in enumerate(h.ranks):
        current = h.current.get(rank)
        if current is None:
            if executor.queue:
                out.append(("rank", rank, "ok"))
            continue
        answers = scope.put_answers if isinstance(current[1], PutCall) else ("ok", "raise")
        out += [("rank", rank, a) for a in answers if a == "ok" or s.faults]
    if s.evictions:
        out += [("evict", key) for key in sorted(cast(MemoryStore, h.store).objects)]
    return out


def apply(scope: Scope, s: System, action: Action, symmetric: set[int]) -> None:
    h = s.h
    kind = action[0]
    s.answers.reset()
    if kind == "admit":
        i = action[1]
        req = scope.requests[i]
        # The digest pickles with a memo, so it sees which equal strings are
        # one object. A worker process (spawned, or a Ray actor) gets the
        # scope as a copy, whose names are other objects than this process's
        # literals; entering the state as they come, they made the same
        # scope count other numbers of states there (default: 2,486 against
        # 2,550). Interned, a name is the same object in every process.
        name = RequestName(req.name) if i in symmetric else sys.intern(req.name)
        h.add(name, req.prompt, req.decode, lookup=req.lookup, transferred=req.transferred,
              load_async=req.load_async, token_seed=f"{req.prompt}/{req.decode}")
        s.admitted = s.admitted[:i] + (True,) + s.admitted[i + 1:]
    elif kind == "step":
        if len(action) > 1:
            s.answers.get = "-800"
        h.step()
        if s.answers.used:
            s.faults -= 1
    elif kind == "preempt":
        h.step(preempt=[action[1]])
        s.preemptions -= 1
    elif kind == "abort":
        h.step(finish=[action[1]])
        s.aborts -= 1
    elif kind == "rank":
        _, rank, answer = action
        s.answers.put = s.answers.exists = answer
        h.advance(rank)
        if s.answers.used:
            s.faults -= 1
    elif kind == "evict":
        h.evict(action[1])
        s.evictions -= 1
    else:  # pragma: no cover - actions come from `enabled`
        raise ValueError(f"unknown model-checker action {action!r}")
    s.answers.reset()


def random_walk(scope: Scope, seed: int, steps: int = 40, *, protocol: str = "kvstate",
                start: System | None = None) -> Iterator[System]:
    """A random path through ``scope`` (``seed`` picks each enabled action):
    yields the state after each action, the same object stepped on, until
    ``steps`` actions or nothing is enabled. ``start``: the state to step on
    (default: a fresh initial state). For tests that need states the search
    can reach without running it."""
    import random

    rng = random.Random(seed)
    symmetric = _symmetric(scope)
    s = start if start is not None else initial(scope, protocol)
    for _ in range(steps):
        actions = enabled(scope, s)
        if not actions:
            return
        apply(scope, s, rng.choice(actions), symmetric)
        yield s


# ---------------------------------------------------------------------------
# The search.


@attrs.frozen
class Violation:
    invariant: str
    message: str
    actions: tuple[Action, ...]
    trace: str | None


@attrs.define
class Result:
    scope: str
    protocol: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    exhaustive: bool = False
    quiet_states: int = 0
    violation: Violation | None = None
    # Processes that expanded states (the compact engine starts its workers
    # only once a level is wide enough to share; the legacy loop is one).
    workers: int = 1
    # Ended by the caller's ``stop`` (the command line's Ctrl-C), not by its
    # end, a violation or a budget.
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return self.violation is None

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0

    @property
    def outcome(self) -> tuple[Any, ...]:
        """What an exploration decided, without its wall clock or process
        count: the same for a scope and protocol whatever the engine, the
        workers or the cluster (the tests compare exactly this)."""
        v = self.violation
        return (self.states, self.transitions, self.quiet_states, self.depth, self.exhaustive,
                None if v is None else (v.invariant, v.actions))


def path_to(parents: Mapping[bytes, tuple[bytes, Action] | None], key: bytes) -> list[Action]:
    path: list[Action] = []
    link = parents[key]
    while link is not None:
        key, action = link
        path.append(action)
        link = parents[key]
    return path[::-1]


def _violation(scope: Scope, protocol: str,
               parents: Mapping[bytes, tuple[bytes, Action] | None],
               key: bytes, action: Action, s: System, out_dir: str | None) -> Violation:
    first = s.h.monitor.findings[0]
    return violation_at(scope, protocol, parents, key, action, first.invariant, first.message,
                        out_dir)


def violation_at(scope: Scope, protocol: str,
                 parents: Mapping[bytes, tuple[bytes, Action] | None], key: bytes, action: Action,
                 invariant: str, message: str, out_dir: str | None) -> Violation:
    """The violation reached by ``action`` from state ``key``: its shortest
    path, replayed into a trace file under ``out_dir``."""
    actions = (*path_to(parents, key), action)
    trace = None
    if out_dir is not None:
        text = replay_actions(scope, protocol, actions)
        name = hashlib.sha256(text.encode()).hexdigest()[:12]
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"modelcheck-{protocol}-{scope.name}-{name}.jsonl"
        path.write_text(text)
        trace = str(path)
    return Violation(invariant, message, actions, trace)


def replay_actions(scope: Scope, protocol: str, actions: tuple[Action, ...]) -> str:
    """Re-run ``actions`` on a recording harness; the kvstate trace text."""
    # Plain ints and names: the renamings change no decision, and a trace
    # holds plain values.
    s = initial(scope, protocol, reduce=False)
    s.h.record = True
    symmetric: set[int] = set()
    for action in actions:
        if action == ("quiesce",):
            s.h.quiesce()
        else:
            apply(scope, s, action, symmetric)
    return s.h.trace_text(source="kvstate modelcheck", scope=scope.name,
                          actions=[format_action(a) for a in actions])


def format_action(action: Action) -> str:
    return " ".join(map(str, action))


__all__ = ["SCOPES", "BlockId", "Result", "Scope", "ScopeRequest"]
