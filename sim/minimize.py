"""``kvstate minimize``: shrink a failing run to a small one that fails the same way.

The inputs of a simulator run are its options (seed, workload size, fault
sites, ranks...), so shrinking works on them, in named passes run to a fixed
point, each keeping a change only if the *same invariant* still fires:

``fewer-requests``   bisect the workload size down;
``fewer-faults``     switch fault sites off one at a time;
``fewer-ranks``      halve the tensor-parallel world.

The result is written as a trace that ``kvstate replay`` and ``kvstate
check`` take, with the command that reproduces it.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from sim.runner import SimOptions, SimResult, simulate


@attrs.define
class Minimized:
    invariant: str
    original: SimOptions
    options: SimOptions
    result: SimResult
    runs: int
    passes: list[str]


class NothingToMinimize(ValueError):
    pass


def minimize(options: SimOptions, invariant: str | None = None, max_runs: int = 200,
             progress: Callable[[str], None] | None = None) -> Minimized:
    first = simulate(options)
    if first.ok:
        raise NothingToMinimize(f"the run violates nothing: {options.command()}")
    target = invariant or first.findings[0][1].invariant
    if invariant is not None and all(f.invariant != invariant for _, f in first.findings):
        raise NothingToMinimize(f"the run does not violate {invariant}")
    runs = 1
    best, best_result = options, first
    applied: list[str] = []

    def fails(candidate: SimOptions) -> SimResult | None:
        nonlocal runs
        if runs >= max_runs:
            return None
        runs += 1
        result = simulate(candidate)
        return result if any(f.invariant == target for _, f in result.findings) else None

    changed = True
    while changed and runs < max_runs:
        changed = False
        # fewer-requests: bisect between 1 and the current size.
        low, high = 1, best.requests
        while low < high and runs < max_runs:
            mid = (low + high) // 2
            result = fails(attrs.evolve(best, requests=mid))
            if result is not None:
                high = mid
                best, best_result = attrs.evolve(best, requests=mid), result
                changed = True
                applied.append(f"fewer-requests -> {mid}")
            else:
                low = mid + 1
        # fewer-faults: drop fault sites that are not needed.
        for site in list(best.faults):
            candidate = attrs.evolve(best, faults=tuple(s for s in best.faults if s != site))
            result = fails(candidate)
            if result is not None:
                best, best_result = candidate, result
                changed = True
                applied.append(f"fewer-faults -{site}")
        # fewer-ranks.
        if best.world_size > 1:
            candidate = attrs.evolve(best, world_size=best.world_size // 2)
            result = fails(candidate)
            if result is not None:
                best, best_result = candidate, result
                changed = True
                applied.append(f"fewer-ranks -> {candidate.world_size}")
        if progress is not None:
            progress(f"minimize: {runs} runs, {best.requests} requests, "
                     f"{len(best.faults)} fault sites, world size {best.world_size}")
    return Minimized(target, options, best, best_result, runs, applied)
