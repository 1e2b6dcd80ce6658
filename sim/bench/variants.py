"""Time to catch each seeded variant with a campaign."""

from __future__ import annotations

import statistics
from typing import Any


def bench_variants(trials: int = 5, budget: float = 60.0) -> dict[str, Any]:
    """For every variant but the default: ``trials`` campaigns from different
    start seeds, each stopping at its first violation (at most ``budget``
    seconds); the invariants found and the median wall time to find one. The
    default protocol gets one campaign of ``budget`` seconds and must find
    nothing."""
    from kvstate.variants import VARIANTS
    from sim.explore.campaign import campaign

    out: dict[str, Any] = {}
    for name in VARIANTS:
        if name == "kvstate":
            result = campaign(name, budget=budget)
            out[name] = {"runs": result.runs, "seconds": result.seconds,
                         "found": sorted(result.counts), "fired": result.fired,
                         "never_fired": result.never_fired}
            continue
        times: list[float] = []
        found: set[str] = set()
        for trial in range(trials):
            result = campaign(name, budget=budget, start_seed=1000 * trial,
                              stop_when_found=True)
            if result.first_found:
                times.append(min(result.first_found.values()))
                found |= set(result.counts)
        out[name] = {"found": sorted(found), "trials": trials, "found_in": len(times),
                     "median_seconds_to_find": round(statistics.median(times), 3)
                     if times else None}
    return out
