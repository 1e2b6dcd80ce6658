"""The model checker's engine: a level-synchronous breadth-first search.

What a transition costs (per-phase timers, ``kvstate bench modelcheck``):
rebuilding the parent from its stored value (``copy``), the core's own work
(``step``: `sim.explore.modelcheck.model.apply`, engine step, planner,
executors, monitor), and writing the child's value (``key``: one walk gives
the key and the stored bytes, `sim.explore.modelcheck.values`). The value
walks are Python; the core's step is the floor (see "Speed" below).

* **No cyclic garbage.** Every rebuilt harness is a reference cycle (each
  executor's and the pool's ``observer`` is a bound method of the harness),
  so a used copy's cycles are cut by hand (`discard`: the harness's and the
  monitor's attribute dicts are cleared) and it dies by reference counting;
  the cyclic collector is off during the search (on again afterwards, and run
  every `COLLECT_EVERY` transitions in case some path leaves a cycle uncut,
  so memory stays bounded).
* **Level-synchronous breadth-first search.** The frontier is expanded one
  depth at a time; a level's states can be expanded by ``workers`` processes
  (`multiprocessing`, fork where available) or Ray actors on a cluster
  (`_RayPool`), each a contiguous slice. A worker computes the keys the
  parent would: nothing in a state's value may depend on the process that
  made it (a key is a function of the value; a test loads a state in a
  process with another string-hash seed). The parent merges their results
  *in frontier order*, so the visited table fills in the same order as one
  process's FIFO: same state counts, same first violation, same shortest
  counterexample, whatever the number of workers. A worker stores a child only if its
  key was unknown to it (the keys of earlier levels, sent with each level,
  and its own slice so far); a child it skips is one the parent has already
  merged, because everything a worker knows precedes that child in frontier
  order.

The behaviour stays single-sourced: successors are
`sim.explore.modelcheck.model.apply` on a real `kvstate.harness.Harness`,
identity is the value key (the symmetry and counter reductions, whose
soundness argument lives in `sim.explore.modelcheck.model`'s docstring),
violations are the core monitor's findings.

Speed: the value form only names the core's fields (no second copy of the
protocol), so a state is still a graph of core objects, rebuilt and walked
once or twice a transition by Python code. That walk costs about what the
core's own step does; what would make it cheap is a core whose state is
immutable values (a transition then copies nothing it does not change).
Until then, states/s scale with ``workers``.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs

from kvstate.coverage import add_fired, recording, recording_now
from kvstate.variants import get_variant
from sim.explore.cluster import ClusterError, code_fingerprint, node_code
from sim.explore.modelcheck.checkpoint import Checkpoint, probe, require_same, save
from sim.explore.modelcheck.frontier import Frontier
from sim.explore.modelcheck.model import (
    Action,
    Result,
    Scope,
    System,
    _symmetric,
    apply,
    enabled,
    violation_at,
)
from sim.explore.modelcheck.values import form_for
from sim.explore.modelcheck.visited import KeySet, Visited

# With the collector off, a cycle nobody cut would only be freed here.
COLLECT_EVERY = 20_000
# New children an expander keeps live for their own expansion (`Expander.expand`):
# a state is ~300 objects, ~30-60 KB live, so this bounds the memory at a few
# tens of MB; the first states of each level are the ones kept, in frontier
# order, the ones expanded first.
LIVE = 512
# Frontier states per worker and batch (a batch is ~0.1-0.3 s of work).
BATCH = 64
# Times a Ray actor is started again after its process or node died (then
# `ActorLost`). A few: a node lost now and then is routine on a cluster; an
# actor that dies every time is a broken install, said after a few tries.
ACTOR_RESTARTS = 3


def discard(s: System) -> None:
    """Cut a used copy's reference cycles so reference counting frees it."""
    h = s.h
    monitor = getattr(h, "monitor", None)
    if monitor is not None:
        monitor.__dict__.clear()
    h.__dict__.clear()


@attrs.frozen
class Expanded:
    """One frontier state's successors, in `enabled` order.

    ``children``: (action, child key, stored child or None when the expander
    already knew the key). ``violation``: (action, invariant, message) of the
    first transition that broke an invariant (its successors after it were not
    taken, as one process's FIFO would). ``quiet``: nothing but no-op steps were
    enabled, so the quiescence check ran; ``quiet_violation`` its finding."""

    children: tuple[tuple[Action, bytes, bytes | None], ...]
    violation: tuple[Action, str, str] | None = None
    quiet: bool = False
    quiet_violation: tuple[str, str] | None = None


class Expander:
    """Computes `Expanded` for stored states of one scope and protocol.

    A transition's three phases are methods of their own (`copy`, `step`,
    `key`) so that `TimedExpander` can time them
    (``kvstate bench modelcheck`` prints the shares)."""

    def __init__(self, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None) -> None:
        self.scope = scope
        self.reduce = reduce
        self.symmetric = _symmetric(scope) if reduce else set()
        self.transitions = 0
        self.form = form_for(scope, protocol, reduce, only)
        self.live: dict[bytes, System] = {}

    def copy(self, blob: bytes) -> System:
        return self.form.loads(blob)

    def step(self, s: System, action: Action) -> None:
        apply(self.scope, s, action, self.symmetric)

    def key(self, s: System) -> tuple[bytes, bytes]:
        """The state's key and its stored bytes: one walk makes both."""
        return self.form.dumps(s)

    def expand(self, key: bytes, blob: bytes, seen: Collection[bytes]) -> Expanded:
        # A new child is kept live (up to `LIVE` of them) and stepped on for
        # its own first action when it is expanded in turn, which saves
        # rebuilding it once: its value is the stored one (a key is a
        # function of the value, so nothing it holds by identity matters),
        # only its scratch fields and the order of dicts nothing iterates may
        # differ, which decide nothing (sim.explore.modelcheck.model).
        s = self.live.pop(key, None)
        if s is None:
            s = self.copy(blob)
        actions = enabled(self.scope, s)
        children: list[tuple[Action, bytes, bytes | None]] = []
        fresh: set[bytes] = set()
        moved = False
        kept = False
        for n, action in enumerate(actions):
            if n:
                if not kept:
                    discard(s)
                kept = False
                s = self.copy(blob)
            findings = s.h.monitor.findings
            findings.clear()
            self.step(s, action)
            self._count()
            if findings:
                first = findings[0]
                discard(s)
                return Expanded(tuple(children), (action, first.invariant, first.message))
            child, child_blob = self.key(s)
            if child != key:
                moved = True
            if child in seen or child in fresh:
                children.append((action, child, None))
            else:
                fresh.add(child)
                children.append((action, child, child_blob))
                if len(self.live) < LIVE:
                    self.live[child] = s
                    kept = True
        if not kept:
            discard(s)
        if moved:
            return Expanded(tuple(children))
        # Nothing left but no-op steps: the liveness check at quiescence.
        s = self.copy(blob)
        s.h.monitor.findings.clear()
        s.h.quiesce()
        findings = s.h.monitor.findings
        quiet = (findings[0].invariant, findings[0].message) if findings else None
        discard(s)
        return Expanded(tuple(children), quiet=True, quiet_violation=quiet)

    def _count(self) -> None:
        self.transitions += 1
        if self.transitions % COLLECT_EVERY == 0:
            gc.collect()


class TimedExpander(Expander):
    """An `Expander` that adds up the seconds of each phase of a transition:
    rebuilding the parent, the core's step, writing the child's value (its
    key and stored bytes): ``kvstate bench modelcheck`` prints them."""

    def __init__(self, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None) -> None:
        super().__init__(scope, protocol, reduce, only)
        self.seconds = {"copy": 0.0, "step": 0.0, "key": 0.0}

    def copy(self, blob: bytes) -> System:
        started = time.perf_counter()
        s = super().copy(blob)
        self.seconds["copy"] += time.perf_counter() - started
        return s

    def step(self, s: System, action: Action) -> None:
        started = time.perf_counter()
        super().step(s, action)
        self.seconds["step"] += time.perf_counter() - started

    def key(self, s: System) -> tuple[bytes, bytes]:
        started = time.perf_counter()
        out = super().key(s)
        self.seconds["key"] += time.perf_counter() - started
        return out


class _Collector:
    """The cyclic collector off for a block (on again only if it was on)."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


# ---------------------------------------------------------------------------
# Workers: each holds an Expander and the keys it has been told about.


class SliceWorker:
    """What a worker keeps from one level to the next: its `Expander` and
    every key it has been told (the keys merged before each call). A local
    worker process (`_worker`) and a Ray actor (`_RayPool`) are this object
    behind a pipe or an actor handle. A crash in the core comes back as a
    `WorkerError` with the worker's traceback, for the parent to raise (a
    crash is a finding too)."""

    def __init__(self, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None) -> None:
        self.expander = Expander(scope, protocol, reduce, only)
        self.seen = KeySet()

    def expand(self, known: bytes, chunk: list[tuple[bytes, bytes]],
               record: bool = False) -> SliceResult | WorkerError:
        """``known``: the keys merged since the last call, packed
        (`sim.explore.modelcheck.visited.KeySet.packed_from`). ``record``: the driver records
        table coverage, so record this slice's and send it back
        (`kvstate.coverage.add_fired`)."""
        self.seen.add_packed(known)
        try:
            with recording() if record else contextlib.nullcontext() as coverage:
                out = expand_slice(self.expander, chunk, self.seen)
            self.expander.form.check_unchanged()
            return SliceResult(out, frozenset(coverage.fired) if coverage is not None
                               else frozenset())
        except Exception:
            import traceback

            return WorkerError(traceback.format_exc())


@attrs.frozen
class SliceResult:
    """What a worker sends back for a slice: its states' `Expanded`, and
    the table entries that fired while expanding them (only when asked)."""

    expanded: list[Expanded]
    fired: frozenset[tuple[str, Any, Any]] = frozenset()


def _worker(conn: Any, scope: Scope, protocol: str, reduce: bool,
            only: Sequence[str] | None) -> None:
    from sim.explore.workers import take_signals

    take_signals()
    gc.disable()
    worker = SliceWorker(scope, protocol, reduce, only)
    while True:
        message = conn.recv()
        if message is None:
            break
        conn.send(worker.expand(*message))
    conn.close()


class _ActorWorker(SliceWorker):
    """A `SliceWorker` as a Ray actor: a process of its own, so the cyclic
    collector is off there as in a local worker (`discard` cuts the cycles;
    `Expander` still collects every `COLLECT_EVERY` transitions). It first
    checks that its node runs the driver's ``code`` (an actor started again
    after its node died may land on a node that joined since)."""

    def __init__(self, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None, code: tuple[str, ...]) -> None:
        from sim.explore.cluster import require_code

        require_code(code)
        gc.disable()
        super().__init__(scope, protocol, reduce, only)


class WorkerError(RuntimeError):
    """An exception inside a model-checker worker, with its traceback."""


class ActorLost(ClusterError):
    """A Ray actor of the model checker died for good (`ACTOR_RESTARTS` spent):
    the cluster failed, not the protocol (the command line says so, exit 2)."""


def expand_slice(expander: Expander, chunk: list[tuple[bytes, bytes]], seen: Any
                 ) -> list[Expanded]:
    """A contiguous slice of a level; ``seen`` (``in`` and ``update``) learns
    the keys the slice stores, so none is stored twice within it."""
    out = []
    for key, blob in chunk:
        e = expander.expand(key, blob, seen)
        out.append(e)
        seen.update(k for _, k, b in e.children if b is not None)
        if e.violation is not None or e.quiet_violation is not None:
            break  # the parent stops here; the rest of the slice is moot
    return out


class _Overlay:
    """The parent's own view for its slice: the merged keys plus its own."""

    def __init__(self, base: Collection[bytes]) -> None:
        self.base = base
        self.extra: set[bytes] = set()

    def __contains__(self, key: object) -> bool:
        return key in self.extra or key in self.base

    def update(self, keys: Any) -> None:
        self.extra.update(keys)


class _Pool:
    def __init__(self, workers: int, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None) -> None:
        methods = multiprocessing.get_all_start_methods()
        ctx: Any = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.conns = []
        self.procs = []
        for _ in range(workers - 1):  # the parent expands the first slice itself
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(theirs, scope, protocol, reduce,
                                                  list(only) if only else None), daemon=True)
            p.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(p)
        self.told = 0  # how many keys of the visited table every worker has been sent

    def expand(self, level: list[tuple[bytes, bytes]], visited: Visited,
               expander: Expander) -> list[Expanded]:
        known = visited.packed_from(self.told)
        self.told = len(visited)
        slices = _slices(level, len(self.conns) + 1)
        record = recording_now()
        for conn, part in zip(self.conns, slices[1:]):
            conn.send((known, part, record))
        # This process's own slice is recorded here directly, if at all.
        mine = SliceResult(expand_slice(expander, slices[0], _Overlay(visited)))
        return _fold(slices, [mine, *(conn.recv() for conn in self.conns)])

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
                conn.close()
            except OSError:  # pragma: no cover - a worker already gone
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():  # pragma: no cover
                p.terminate()


def _slices(level: list[tuple[bytes, bytes]], n: int) -> list[list[tuple[bytes, bytes]]]:
    """``level`` cut into ``n`` contiguous slices (the last ones may be short or empty)."""
    size = -(-len(level) // n)
    return [level[i * size:(i + 1) * size] for i in range(n)]


def _fold(slices: list[list[tuple[bytes, bytes]]],
          results: list[SliceResult | WorkerError]) -> list[Expanded]:
    """The slices' results in frontier order. A slice that came back short
    stopped at a violation: what follows it is moot. A worker's crash is
    raised here (every result was received first, so the pipes stay in step).
    The table entries the workers fired join this process's recordings."""
    out: list[Expanded] = []
    stopped = False
    for part, rest in zip(slices, results):
        if isinstance(rest, WorkerError):
            raise rest
        add_fired(rest.fired)
        if not stopped:
            out.extend(rest.expanded)
            stopped = len(rest.expanded) < len(part)
    return out


class _RayPool:
    """A level's slices as calls on Ray actors, one `_ActorWorker` per
    worker, folded in frontier order like `_Pool`'s (so the same states,
    counts and counterexamples as one process). Unlike `_Pool`, this process
    expands no slice itself: on a cluster the driver's machine may be the
    smallest, and it has the merge to do. The keys merged since the last
    call go into the object store once, for every actor to read."""

    def __init__(self, cluster: Any, workers: int, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None) -> None:
        self.cluster = cluster
        # A CPU an actor, or a share of one when asked for more actors than
        # the cluster has CPUs (whole CPUs would leave the rest unscheduled,
        # and a level would wait for them forever).
        share = min(1.0, cluster.cpus / workers)
        # An actor whose process or node dies is started again and its call
        # sent again. That is safe because what it loses is only what it was
        # told: a worker that knows fewer keys stores more children, never
        # fewer (the fold keeps a child's blob only if its key is new), so
        # the result is the same (a test kills actors between levels).
        remote = cluster.ray.remote(num_cpus=share, max_restarts=ACTOR_RESTARTS,
                                    max_task_retries=ACTOR_RESTARTS)(_ActorWorker)
        code = node_code()
        self.actors = [remote.remote(scope, protocol, reduce, list(only) if only else None, code)
                       for _ in range(workers)]
        self.told = 0

    def expand(self, level: list[tuple[bytes, bytes]], visited: Visited,
               expander: Expander) -> list[Expanded]:
        known = self.cluster.ray.put(visited.packed_from(self.told))
        self.told = len(visited)
        slices = _slices(level, len(self.actors))
        # Every actor is called, an empty slice too: each must learn the keys.
        record = recording_now()
        handles = [a.expand.remote(known, part, record) for a, part in zip(self.actors, slices)]
        try:
            results = [self.cluster.get(h) for h in handles]
        except self.cluster.ray.exceptions.RayActorError as e:
            raise ActorLost(
                f"--ray {self.cluster.address}: a model-checker actor died more than "
                f"{ACTOR_RESTARTS} times (its node lost, or its process killed): {e}") from e
        return _fold(slices, results)

    def close(self) -> None:
        for actor in self.actors:
            self.cluster.ray.kill(actor)


def default_workers() -> int:
    return os.cpu_count() or 1


def check_compact(scope: Scope, protocol: str = "kvstate", *, budget: float | None = None,
                  max_states: int | None = None, reduce: bool = True,
                  out_dir: str | None = ".", progress: Callable[[Result], None] | None = None,
                  only: Sequence[str] | None = None, workers: int = 1,
                  expander: Expander | None = None, cluster: Any = None,
                  stop: Callable[[], bool] | None = None, checkpoint: str | None = None,
                  checkpoint_every: float = 300.0, resume: Checkpoint | None = None) -> Result:
    """`sim.explore.modelcheck.search.check` with the compact engine (see the module docstring).
    ``expander``: this process's (a `TimedExpander` to time the phases).
    ``cluster``: a `sim.explore.cluster.Cluster`; the ``workers`` are then Ray actors
    on it instead of local processes.

    ``stop``: asked before each frontier state is merged; true ends the
    search there (``Result.interrupted``; the command line's first Ctrl-C).
    ``checkpoint``: a file the search is written to (`sim.explore.modelcheck.checkpoint`;
    one that cannot be written fails before any work) when a level ends and ``checkpoint_every`` seconds passed since the last
    write, and whenever the search stops before its end (stop, budget,
    max_states). ``resume``: a checkpoint (`sim.explore.modelcheck.checkpoint.load`) to go
    on from instead of the initial state, of this scope, protocol, reduction
    and ``only`` (else `CheckpointError`): the result is the one an
    uninterrupted search gives, its ``seconds`` counting every run. A loaded
    checkpoint goes on once (its states are let go of as they are expanded)."""
    get_variant(protocol)  # a clear error for an unknown name, before any work
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    result = Result(scope.name, protocol)
    if expander is None:
        expander = Expander(scope, protocol, reduce, only)
    elif expander.form is not form_for(scope, protocol, reduce, only):
        raise ValueError("the expander was made for another scope, protocol, reduction or "
                         "invariant set")
    with _Collector():
        parents: Visited
        if resume is None:
            # The form's template is the initial state (stored, never stepped).
            key, blob = expander.form.dumps(expander.form.template)
            parents = Visited()
            parents.reach(key)
            level, following = Frontier([(key, blob)]), Frontier()
            depth = 0
            before = 0.0
        else:
            require_same(resume, "resume", scope, protocol, reduce, only)
            if resume.rest.closed or resume.following.closed:
                raise ValueError("this checkpoint was gone on from already (its states were "
                                 "let go of): load it again")
            parents = resume.parents.copy()
            level, following, depth = resume.rest, resume.following, resume.depth
            result.transitions, result.quiet_states = resume.transitions, resume.quiet_states
            result.depth, before = resume.max_depth, resume.seconds
        # Started at the first level wide enough to share (`_expanded`): a
        # scope that never gets one forks nothing, whatever the core count.
        pool = _LazyPool(workers, scope, protocol, reduce, only, cluster)
        started = last_report = last_saved = time.perf_counter()

        def write(rest: Frontier, after: Frontier) -> None:
            assert checkpoint is not None
            save(checkpoint, Checkpoint(
                scope, protocol, reduce, tuple(only) if only else None, code_fingerprint(),
                parents, depth, result.transitions, result.quiet_states, result.depth,
                before + time.perf_counter() - started, rest, after))

        if checkpoint is not None:
            probe(checkpoint)
        stopped = False
        try:
            while (level or following) and not stopped:
                if not level:  # resumed at a level's end
                    level, following, depth = following, Frontier(), depth + 1
                batches = level.batches(BATCH * workers)
                for batch in batches:
                    for index, e in enumerate(_expanded(pool, expander, level, batch,
                                                        parents)):
                        if stop is not None and stop():
                            result.interrupted = stopped = True
                        elif budget is not None and time.perf_counter() - started > budget:
                            stopped = True
                        elif max_states is not None and len(parents) >= max_states:
                            stopped = True
                        if stopped:
                            # Not expanded: not exhaustive, and where a
                            # resumed search goes on.
                            rest = Frontier(batch[index:])
                            for more in batches:
                                rest.extend(more)
                            level.close()
                            level = rest
                            if checkpoint is not None:
                                write(level, following)
                            break
                        parent = batch[index][0]
                        result.depth = max(result.depth, depth)
                        for action, child, child_blob in e.children:
                            result.transitions += 1
                            if parents.reach(child, parent, action):
                                assert child_blob is not None, \
                                    "a worker skipped an unknown state"
                                following.append(child, child_blob)
                        if e.violation is not None:
                            result.transitions += 1
                            action, invariant, message = e.violation
                            result.violation = violation_at(scope, protocol, parents, parent,
                                                            action, invariant, message, out_dir)
                            stopped = True
                            break
                        if e.quiet:
                            result.quiet_states += 1
                            if e.quiet_violation is not None:
                                invariant, message = e.quiet_violation
                                result.violation = violation_at(
                                    scope, protocol, parents, parent, ("quiesce",), invariant,
                                    message, out_dir)
                                stopped = True
                                break
                        if progress is not None and time.perf_counter() - last_report > 5:
                            last_report = time.perf_counter()
                            result.states = len(parents)
                            result.seconds = before + last_report - started
                            progress(result)
                    if stopped:
                        break
                else:  # the level is done
                    expander.form.check_unchanged()
                    level.close()
                    level, following, depth = following, Frontier(), depth + 1
                    if checkpoint is not None and (
                            time.perf_counter() - last_saved >= checkpoint_every):
                        write(level, following)
                        last_saved = time.perf_counter()
        except BaseException:
            expander.form.changed()  # a spoiled template is not used again
            raise
        finally:
            pool.close()
            result.workers = pool.started()
    expander.form.check_unchanged()
    result.states = len(parents)
    result.seconds = before + time.perf_counter() - started
    result.exhaustive = not level and not following and result.violation is None
    level.close()
    following.close()
    return result


class _LazyPool:
    """A `_Pool` (or, given a cluster, a `_RayPool`) started when first
    needed, closed only if it was."""

    def __init__(self, workers: int, scope: Scope, protocol: str, reduce: bool,
                 only: Sequence[str] | None, cluster: Any = None) -> None:
        self.workers = workers
        self.args = (scope, protocol, reduce, only)
        self.cluster = cluster
        self.pool: _Pool | _RayPool | None = None

    def get(self) -> _Pool | _RayPool:
        if self.pool is None:
            if self.cluster is not None:
                self.pool = _RayPool(self.cluster, self.workers, *self.args)
            else:
                self.pool = _Pool(self.workers, *self.args)
        return self.pool

    def started(self) -> int:
        """Processes that expanded states: this one, plus the workers if
        started (on a cluster, the actors: this one only merges)."""
        return self.workers if self.pool is not None else 1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _expanded(pool: _LazyPool, expander: Expander, level: Frontier,
              batch: list[tuple[bytes, bytes]], parents: Visited) -> Any:
    """A batch's results in frontier order: in this process when the level
    is too narrow to share (then each state sees every key merged before it,
    one process's FIFO view), else on the pool, whose workers know the keys
    merged from the batches before. A batch is `BATCH` states a worker, so a
    budget or a stop is checked every few tenths of a second, not once a
    level."""
    workers = pool.workers
    if workers < 2 or len(level) < 2 * workers:
        return _inline(expander, batch, parents)
    return pool.get().expand(batch, parents, expander)


def _inline(expander: Expander, level: list[tuple[bytes, bytes]], parents: Visited) -> Any:
    """Expand lazily in this process: each state sees every key merged
    before it (one process's FIFO view), so no child is stored twice.

    Every successor is computed on a fresh copy of its stored parent."""
    for key, blob in level:
        yield expander.expand(key, blob, parents)


__all__ = ["Expanded", "Expander", "TimedExpander", "check_compact", "default_workers",
           "discard"]
