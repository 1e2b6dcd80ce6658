"""Seeded campaigns: many simulator runs of one protocol, each a different
swarm of faults and a different workload, across both setups.

For a buggy variant a campaign measures how long each invariant takes to
fire (wall seconds from the campaign's start); for the default protocol it
runs out its budget and reports which fault sites fired how often — a site
that never fired means the campaign proved nothing about it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs

from sim.faults import SITES
from sim.runner import SimOptions, simulate


@attrs.define
class CampaignResult:
    protocol: str
    runs: int
    seconds: float
    first_found: dict[str, float]
    first_command: dict[str, str]
    counts: dict[str, int]
    fired: dict[str, int]
    never_fired: list[str]
    # Observation index at which each invariant first broke, in the run that
    # found it: the length of the simulator's (unshrunk) counterexample.
    first_index: dict[str, int] = attrs.Factory(dict)

    @property
    def ok(self) -> bool:
        return not self.counts


def campaign(
    protocol: str,
    budget: float = 60.0,
    seeds: int | None = None,
    start_seed: int = 0,
    setups: Sequence[str] = ("both", "pd"),
    base: SimOptions | None = None,
    stop_when_found: bool = False,
    progress: Callable[[str], None] | None = None,
    stop_when: Collection[str] = (),
) -> CampaignResult:
    """Seeds until the budget (or ``seeds``) is spent; ``stop_when_found``
    stops at the first run with any violation, ``stop_when`` at the first
    run that violates one of the named invariants."""
    base = base or SimOptions()
    started = time.perf_counter()
    first_found: dict[str, float] = {}
    first_command: dict[str, str] = {}
    first_index: dict[str, int] = {}
    counts: Counter[str] = Counter()
    fired: Counter[str] = Counter()
    runs = 0
    seed = start_seed
    while True:
        elapsed = time.perf_counter() - started
        if (seeds is not None and runs >= seeds) or (seeds is None and elapsed >= budget):
            break
        # Vary the shape too: both setups, and every other pair of seeds with
        # MLA-style striding (each chunk stored by one rank).
        options = attrs.evolve(base, seed=seed, protocol=protocol,
                               setup=setups[seed % len(setups)],
                               put_step=base.world_size if seed % 4 >= 2 else base.put_step)
        result = simulate(options, stop_at_first=False)
        runs += 1
        seed += 1
        fired.update(result.fault_fired)
        for invariant in {f.invariant for _, f in result.findings}:
            counts[invariant] += 1
            if invariant not in first_found:
                first_found[invariant] = round(time.perf_counter() - started, 3)
                first_command[invariant] = options.command()
                first_index[invariant] = min(
                    f.event_index for _, f in result.findings if f.invariant == invariant)
        if progress is not None:
            progress(f"{protocol}: {runs} runs, {time.perf_counter() - started:.1f}s, "
                     f"found {sorted(first_found) or 'nothing'}")
        if (stop_when_found and counts) or any(i in counts for i in stop_when):
            break
    configured = base.faults
    return CampaignResult(protocol, runs, round(time.perf_counter() - started, 3), first_found,
                          first_command, dict(counts), dict(fired),
                          [s for s in configured if s in SITES and not fired.get(s)], first_index)


def summary(result: CampaignResult) -> dict[str, Any]:
    return attrs.asdict(result)
