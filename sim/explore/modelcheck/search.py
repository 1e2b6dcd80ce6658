"""``kvstate modelcheck``'s entry point: `check` explores a scope with the
engine, `sim.explore.modelcheck.compact` (level-synchronous, worker processes
or Ray actors, checkpoints, states stored as values by
`sim.explore.modelcheck.values`). The model itself (states, actions, scopes)
is `sim.explore.modelcheck.model`; this module sits above it and above the
engine, so the model imports neither (the circle the five modules once made:
issue 31)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sim.explore.modelcheck.compact import check_compact
from sim.explore.modelcheck.model import Result, Scope


def check(scope: Scope, protocol: str = "kvstate", *, budget: float | None = None,
          max_states: int | None = None, reduce: bool = True, out_dir: str | None = ".",
          progress: Callable[[Result], None] | None = None,
          only: Sequence[str] | None = None, workers: int = 1, cluster: Any = None,
          stop: Callable[[], bool] | None = None, checkpoint: str | None = None,
          checkpoint_every: float = 300.0, resume: Any = None) -> Result:
    """Explore ``scope`` under ``protocol`` breadth-first; stop at the first
    violation (which is then a shortest one), when every reachable state was
    visited, or when ``budget`` seconds / ``max_states`` run out.

    ``workers``: processes expanding the frontier (the same states, counts
    and counterexamples for any number). ``cluster``: a
    `sim.explore.cluster.Cluster`: the ``workers`` are Ray actors there, the
    same answer again. ``stop``, ``checkpoint``, ``checkpoint_every`` and
    ``resume`` (a `sim.explore.modelcheck.checkpoint.Checkpoint`): a search
    that stops and goes on (`check_compact`)."""
    return check_compact(scope, protocol, budget=budget, max_states=max_states,
                         reduce=reduce, out_dir=out_dir, progress=progress, only=only,
                         workers=workers, cluster=cluster, stop=stop, checkpoint=checkpoint,
                         checkpoint_every=checkpoint_every, resume=resume)


__all__ = ["check"]
