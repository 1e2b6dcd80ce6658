"""Model-checker throughput (issues 11 and 30): states a second and a CPU
second, where a transition's time goes, and, given a git revision, the same
search by that revision's model checker in the same run."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from sim.bench.baseline import revision_tree, run_in
from sim.bench.clock import cpu_seconds
from sim.bench.visited import bench_visited

# What the other revision runs: its own `check` on the scope, one process.
_BASELINE = """
import json, sys, time
from sim.explore.modelcheck.model import SCOPES
from sim.explore.modelcheck.search import check
scope, cap = sys.argv[1], json.loads(sys.argv[2])
r = check(SCOPES[scope], "kvstate", max_states=cap, out_dir=None)
print(json.dumps({"states": r.states, "transitions": r.transitions,
                  "seconds": r.seconds, "exhaustive": r.exhaustive}))
"""


def bench_modelcheck(scope: str = "default", max_states: int | None = None,
                     workers: Sequence[int] | None = None,
                     against: str | None = None) -> dict[str, Any]:
    """States per second of the model checker on one scope: one process,
    then ``workers`` processes (default: 2 and every core); the phases of a
    transition (rebuilding the parent, the core's step, writing the child's
    value); and with ``against`` (a git revision of this checkout) that
    revision's model checker on the same scope, in a worktree of its own,
    alternating with this one (best of two each), so both see the same
    machine. Two engines may count the same scope in different numbers of
    states (a coarser key merges more), so they are compared by the time
    each takes to exhaust it (``max_states`` None) and by transitions a
    second."""
    from sim.explore.modelcheck.compact import TimedExpander, check_compact
    from sim.explore.modelcheck.model import SCOPES
    from sim.explore.modelcheck.search import check

    sc = SCOPES[scope]
    figures: dict[str, Any] = {"scope": scope, "max_states": max_states}
    counts = set()
    plan = [1, *[n for n in (workers or sorted({2, os.cpu_count() or 1})) if n > 1]]
    for n in plan:
        cpu = cpu_seconds()
        r = check(sc, "kvstate", workers=n, max_states=max_states, out_dir=None)
        cpu = cpu_seconds() - cpu
        counts.add((r.states, r.transitions, r.quiet_states, r.exhaustive))
        figures[f"w{n}_states_per_s"] = round(r.states_per_second)
        figures[f"w{n}_states_per_cpu_s"] = round(r.states / cpu) if cpu else 0
        if n == 1:
            figures.update(states=r.states, transitions=r.transitions,
                           exhaustive=r.exhaustive, w1_seconds=round(r.seconds, 2),
                           w1_transitions_per_s=round(r.transitions / r.seconds)
                           if r.seconds else 0)
    # Where a transition's time goes: one more one-process run, its phases
    # timed (the timers cost a few per cent, so it is not one of the rates).
    timed = TimedExpander(sc, "kvstate", True, None)
    r = check_compact(sc, "kvstate", max_states=max_states, out_dir=None, expander=timed)
    counts.add((r.states, r.transitions, r.quiet_states, r.exhaustive))
    figures["same_counts"] = len(counts) == 1
    for phase, seconds in timed.seconds.items():
        figures[f"phase_{phase}_share"] = round(seconds / r.seconds, 3) if r.seconds else 0.0
        figures[f"phase_{phase}_us_per_transition"] = round(
            seconds / max(timed.transitions, 1) * 1e6)
    if against is not None:
        figures.update(_against(against, scope, max_states))
    figures.update(bench_visited())
    return figures


def _against(revision: str, scope: str, max_states: int | None) -> dict[str, Any]:
    """``revision``'s model checker against this one, alternating, best of two."""
    from sim.explore.modelcheck.model import SCOPES
    from sim.explore.modelcheck.search import check

    ours, theirs = [], []
    with revision_tree(revision) as tree:
        for _ in range(2):
            r = check(SCOPES[scope], "kvstate", max_states=max_states, out_dir=None)
            ours.append({"states": r.states, "transitions": r.transitions,
                         "seconds": r.seconds, "exhaustive": r.exhaustive})
            theirs.append(run_in(tree, revision, "model checker", _BASELINE, scope,
                                 json.dumps(max_states)))
    mine = min(ours, key=lambda x: x["seconds"])
    base = min(theirs, key=lambda x: x["seconds"])
    out = {"against": revision, "against_states": base["states"],
           "against_transitions": base["transitions"],
           "against_seconds": round(base["seconds"], 2), "ours_seconds": round(mine["seconds"], 2),
           "against_transitions_per_s": round(base["transitions"] / base["seconds"]),
           "ours_transitions_per_s": round(mine["transitions"] / mine["seconds"])}
    out["ratio_transitions_per_s"] = round(out["ours_transitions_per_s"]
                                           / max(out["against_transitions_per_s"], 1), 2)
    if mine["exhaustive"] and base["exhaustive"]:
        out["ratio_time_to_exhaust"] = round(base["seconds"] / mine["seconds"], 2)
    return out
