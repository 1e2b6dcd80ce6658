"""Model-checker throughput (issue 11: verification at scale): states a second
and a CPU second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.bench.clock import cpu_seconds
from sim.bench.visited import bench_visited


def bench_modelcheck(scope: str = "default", max_states: int | None = 15_000,
                     workers: Sequence[int] | None = None) -> dict[str, Any]:
    """States per second of the legacy and the compact model-checker engine
    on one scope, in the same run and on the same states (breadth-first order
    is the same, so ``max_states`` cuts both at the same point); the compact
    engine also with every core. Both must report the same counts."""
    import os

    from sim.explore.modelcheck.model import SCOPES
    from sim.explore.modelcheck.search import check

    sc = SCOPES[scope]
    runs: dict[str, Any] = {}
    counts = set()
    plan = [("legacy", 1), ("compact", 1)]
    for n in workers or sorted({2, os.cpu_count() or 1}):
        if n > 1:
            plan.append(("compact", n))
    for engine, n in plan:
        cpu = cpu_seconds()
        r = check(sc, "kvstate", engine=engine, workers=n, max_states=max_states, out_dir=None)
        cpu = cpu_seconds() - cpu
        counts.add((r.states, r.transitions, r.quiet_states, r.exhaustive))
        runs[f"{engine}_w{n}"] = {"states": r.states, "transitions": r.transitions,
                                  "seconds": round(r.seconds, 2),
                                  "states_per_s": round(r.states_per_second),
                                  "states_per_cpu_s": round(r.states / cpu) if cpu else 0}
    # Where a compact transition's time goes: one more one-worker run, its
    # phases timed (the timers cost a few per cent, so it is not one of the
    # rates above).
    from sim.explore.modelcheck.compact import TimedExpander, check_compact

    timed = TimedExpander(sc, "kvstate", True, None)
    r = check_compact(sc, "kvstate", max_states=max_states, out_dir=None, expander=timed)
    counts.add((r.states, r.transitions, r.quiet_states, r.exhaustive))
    legacy = runs["legacy_w1"]["states_per_s"] or 1
    figures: dict[str, Any] = {"scope": scope, "max_states": max_states,
                               "same_counts": len(counts) == 1}
    for phase, seconds in timed.seconds.items():
        figures[f"phase_{phase}_share"] = round(seconds / r.seconds, 3) if r.seconds else 0.0
        figures[f"phase_{phase}_us_per_transition"] = round(
            seconds / max(timed.transitions, 1) * 1e6)
    for name, row in runs.items():
        figures[f"{name}_states_per_s"] = row["states_per_s"]
        figures[f"{name}_states_per_cpu_s"] = row["states_per_cpu_s"]
        if name != "legacy_w1":
            figures[f"ratio_{name}_to_legacy"] = round(row["states_per_s"] / legacy, 2)
    figures["states"] = runs["legacy_w1"]["states"]
    figures["transitions"] = runs["legacy_w1"]["transitions"]
    figures.update(bench_visited())
    return figures
