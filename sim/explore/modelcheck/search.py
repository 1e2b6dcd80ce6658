"""``kvstate modelcheck``'s entry point: `check` explores a scope with one of
the two engines, `sim.explore.modelcheck.compact` (level-synchronous, worker
processes or Ray actors, checkpoints) or the legacy loop here (one process,
kept for the differential test). The model itself (states, actions, scopes,
digests) is `sim.explore.modelcheck.model`; this module sits above it and
above the compact engine, so the model imports neither (the circle the five
modules once made: issue 31)."""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvstate.variants import get_variant
from sim.explore.modelcheck.compact import check_compact
from sim.explore.modelcheck.model import (
    Action,
    Result,
    Scope,
    System,
    _key,
    _symmetric,
    _violation,
    apply,
    enabled,
    initial,
)


def _dumps(s: System) -> bytes:
    return pickle.dumps(s, protocol=5)


ENGINES = ("compact", "legacy")


def check(scope: Scope, protocol: str = "kvstate", *, budget: float | None = None,
          max_states: int | None = None, reduce: bool = True, out_dir: str | None = ".",
          progress: Callable[[Result], None] | None = None,
          only: Sequence[str] | None = None, engine: str = "compact",
          workers: int = 1, cluster: Any = None, stop: Callable[[], bool] | None = None,
          checkpoint: str | None = None, checkpoint_every: float = 300.0,
          resume: Any = None) -> Result:
    """Explore ``scope`` under ``protocol`` breadth-first; stop at the first
    violation (which is then a shortest one), when every reachable state was
    visited, or when ``budget`` seconds / ``max_states`` run out.

    ``engine``: ``compact`` (`sim.explore.modelcheck.compact`: level-synchronous, no cyclic
    garbage, ``workers`` processes expanding the frontier) or ``legacy`` (the
    original loop, kept for the differential test: both must agree on
    verdicts, state counts and counterexample lengths). ``cluster``: a
    `sim.explore.cluster.Cluster` (compact engine): the ``workers`` are Ray actors
    there, the same answer again. ``stop``, ``checkpoint``,
    ``checkpoint_every`` and ``resume`` (a `sim.explore.modelcheck.checkpoint.Checkpoint`):
    a search that stops and goes on, compact engine only (`check_compact`)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown model-checker engine {engine!r}; known: {', '.join(ENGINES)}")
    if engine == "legacy" and (workers != 1 or cluster is not None):
        what = f"workers={workers}" if workers != 1 else "a Ray cluster"
        raise ValueError(f"{what} needs the compact engine (the legacy loop runs in one "
                         "process)")
    if engine == "legacy" and (stop or checkpoint or resume):
        raise ValueError("stopping, checkpoints and resuming need the compact engine")
    if engine == "compact":
        return check_compact(scope, protocol, budget=budget, max_states=max_states,
                             reduce=reduce, out_dir=out_dir, progress=progress, only=only,
                             workers=workers, cluster=cluster, stop=stop,
                             checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                             resume=resume)
    return _check_legacy(scope, protocol, budget=budget, max_states=max_states, reduce=reduce,
                         out_dir=out_dir, progress=progress, only=only)


def _check_legacy(scope: Scope, protocol: str = "kvstate", *, budget: float | None = None,
                  max_states: int | None = None, reduce: bool = True,
                  out_dir: str | None = ".", progress: Callable[[Result], None] | None = None,
                  only: Sequence[str] | None = None) -> Result:
    get_variant(protocol)  # a clear error for an unknown name, before any work
    symmetric = _symmetric(scope) if reduce else set()
    result = Result(scope.name, protocol)
    start = initial(scope, protocol, reduce=reduce, only=only)
    key = _key(start, reduce)
    parents: dict[bytes, tuple[bytes, Action] | None] = {key: None}
    frontier: deque[tuple[bytes, bytes, int]] = deque([(key, _dumps(start), 0)])
    started = time.perf_counter()
    last_report = started
    while frontier:
        if budget is not None and time.perf_counter() - started > budget:
            break
        if max_states is not None and len(parents) >= max_states:
            break
        key, blob, depth = frontier.popleft()
        result.depth = max(result.depth, depth)
        s = pickle.loads(blob)
        actions = enabled(scope, s)
        moved = False
        for n, action in enumerate(actions):
            if n:
                s = pickle.loads(blob)
            s.h.monitor.findings.clear()
            apply(scope, s, action, symmetric)
            result.transitions += 1
            if s.h.monitor.findings:
                result.violation = _violation(scope, protocol, parents, key, action, s,
                                              out_dir)
                break
            child = _key(s, reduce)
            if child != key:
                moved = True
            if child not in parents:
                parents[child] = (key, action)
                frontier.append((child, _dumps(s), depth + 1))
        if result.violation is not None:
            break
        if not moved:
            # Nothing left but no-op steps: the liveness check at quiescence.
            result.quiet_states += 1
            s = pickle.loads(blob)
            s.h.monitor.findings.clear()
            s.h.quiesce()
            if s.h.monitor.findings:
                result.violation = _violation(scope, protocol, parents, key, ("quiesce",), s,
                                              out_dir)
                break
        if progress is not None and time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            result.states, result.seconds = len(parents), last_report - started
            progress(result)
    result.states = len(parents)
    result.seconds = time.perf_counter() - started
    result.exhaustive = not frontier and result.violation is None
    return result


__all__ = ["ENGINES", "check"]
