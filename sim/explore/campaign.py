"""Seeded campaigns: many simulator runs of one protocol, each a different
swarm of faults and a different workload, across both setups.

For a buggy variant a campaign measures how long each invariant takes to
fire (wall seconds from the campaign's start); for the default protocol it
runs out its budget and reports which fault sites fired how often — a site
that never fired means the campaign proved nothing about it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs

from sim.explore.workers import take_signals
from sim.simulator.faults import SITES
from sim.simulator.runner import SimOptions, simulate


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
    # Ctrl-C stopped it: ``runs`` and everything found are the seeds folded so far.
    interrupted: bool = False
    # Observations the folded seeds' runs made, all together (what a
    # campaign's cost scales with: `kvstate bench campaign` sizes from it).
    observations: int = 0

    @property
    def ok(self) -> bool:
        return not self.counts


@attrs.frozen
class SeedOutcome:
    """What one seed's run contributes to a campaign (small: it crosses
    process and cluster boundaries)."""

    seed: int
    command: str
    fired: tuple[tuple[str, int], ...]
    # invariant -> first observation index at which it broke in this run
    found: tuple[tuple[str, int], ...]
    observations: int  # the run's length


@attrs.frozen
class CampaignProgress:
    """Where a campaign stands after each seed it folds (``on_seed``)."""

    protocol: str
    runs: int  # seeds folded so far
    seconds: float  # wall seconds since the campaign started
    found: tuple[str, ...]  # invariants violated so far, sorted


def seed_options(base: SimOptions, protocol: str, seed: int,
                 setups: Sequence[str]) -> SimOptions:
    # Vary the shape too: both setups, and every other pair of seeds with
    # MLA-style striding (each chunk stored by one rank).
    return attrs.evolve(base, seed=seed, protocol=protocol, setup=setups[seed % len(setups)],
                        put_step=base.world_size if seed % 4 >= 2 else base.put_step)


def run_seed(base: SimOptions, protocol: str, seed: int, setups: Sequence[str]) -> SeedOutcome:
    """One campaign seed (a module-level function: workers and Ray tasks
    import it by name)."""
    options = seed_options(base, protocol, seed, setups)
    result = simulate(options, stop_at_first=False)
    found: dict[str, int] = {}
    for _, f in result.findings:
        found[f.invariant] = min(found.get(f.invariant, f.event_index), f.event_index)
    return SeedOutcome(seed, options.command(), tuple(sorted(result.fault_fired.items())),
                       tuple(sorted(found.items())), result.figures["observations"])


class _Inline:
    def submit(self, *args: Any) -> Any:
        return args

    def result(self, handle: Any) -> SeedOutcome:
        return run_seed(*handle)

    def close(self) -> None:
        pass


class _Processes:
    """A local process pool (fork where available: no re-import per worker)."""

    def __init__(self, workers: int) -> None:
        import multiprocessing

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.pool = ctx.Pool(workers, initializer=take_signals)

    def submit(self, *args: Any) -> Any:
        return self.pool.apply_async(run_seed, args)

    def result(self, handle: Any) -> SeedOutcome:
        outcome: SeedOutcome = handle.get()
        return outcome

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


class _Ray:
    """Seeds as Ray tasks on the cluster at ``address`` (`sim.explore.cluster`)."""

    def __init__(self, address: str) -> None:
        from sim.explore.cluster import Cluster

        self.cluster = Cluster(address)
        self.submit = self.cluster.task(run_seed)

    def result(self, handle: Any) -> SeedOutcome:
        outcome: SeedOutcome = self.cluster.get(handle)
        return outcome

    def close(self) -> None:
        self.cluster.close()

    @property
    def workers(self) -> int:
        return self.cluster.cpus


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
    workers: int = 1,
    ray_address: str | None = None,
    on_seed: Callable[[CampaignProgress], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CampaignResult:
    """Seeds until the budget (or ``seeds``) is spent; ``stop_when_found``
    stops at the first run with any violation, ``stop_when`` at the first
    run that violates one of the named invariants.

    ``workers`` processes (or Ray tasks on ``ray_address``) run seeds ahead
    of the aggregation, a bounded window of them; results are folded in seed
    order, never in arrival order, so with ``seeds`` the result (runs,
    counts, fired sites, each invariant's first command and index) is the
    same for any number of workers, and a stop condition stops at the same
    seed as a sequential campaign (seeds run ahead of it are dropped). Only
    the wall-clock figures (``seconds``, ``first_found``) differ. With a time
    budget, the seeds folded are the in-order prefix finished in time.

    ``on_seed`` is called after each seed is folded (a `CampaignProgress`);
    ``progress`` gets the same as one line of text. ``clock``: wall seconds
    (the budget and every time reported; a test passes its own)."""
    base = base or SimOptions()
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    runner: Any
    if ray_address is not None:
        runner = _Ray(ray_address)
        window = 2 * runner.workers
    elif workers > 1:
        runner = _Processes(workers)
        window = 2 * workers
    else:
        runner = _Inline()
        window = 1
    started = clock()
    first_found: dict[str, float] = {}
    first_command: dict[str, str] = {}
    first_index: dict[str, int] = {}
    counts: Counter[str] = Counter()
    fired: Counter[str] = Counter()
    runs = 0
    observations = 0
    submitted: deque[Any] = deque()
    next_seed = start_seed
    interrupted = False
    try:
        while True:
            elapsed = clock() - started
            out_of_budget = seeds is None and elapsed >= budget
            while not out_of_budget and len(submitted) < window and (
                    seeds is None or next_seed < start_seed + seeds):
                submitted.append(runner.submit(base, protocol, next_seed, tuple(setups)))
                next_seed += 1
            if not submitted or out_of_budget:
                break
            outcome: SeedOutcome = runner.result(submitted.popleft())
            runs += 1
            observations += outcome.observations
            fired.update(dict(outcome.fired))
            # One time for the whole seed: read per invariant, the clock could
            # tick between two of them, and whoever ranks a seed's findings by
            # time (`kvstate bench tools`) would then see a different order
            # run to run (S1 before S2 of the same seed, once in a while).
            folded = round(clock() - started, 3)
            for invariant, index in outcome.found:
                counts[invariant] += 1
                if invariant not in first_found:
                    first_found[invariant] = folded
                    first_command[invariant] = outcome.command
                    first_index[invariant] = index
            if on_seed is not None:
                on_seed(CampaignProgress(protocol, runs, clock() - started,
                                         tuple(sorted(first_found))))
            if progress is not None:
                progress(f"{protocol}: {runs} runs, {clock() - started:.1f}s, "
                         f"found {sorted(first_found) or 'nothing'}")
            if (stop_when_found and counts) or any(i in counts for i in stop_when):
                break
    except KeyboardInterrupt:  # Ctrl-C: what was folded so far is the answer
        interrupted = True
    finally:
        runner.close()
    configured = base.faults
    return CampaignResult(protocol, runs, round(clock() - started, 3), first_found,
                          first_command, dict(counts), dict(fired),
                          [s for s in configured if s in SITES and not fired.get(s)], first_index,
                          interrupted, observations)


def summary(result: CampaignResult) -> dict[str, Any]:
    return attrs.asdict(result)


def comparable(result: CampaignResult) -> dict[str, Any]:
    """`summary` without the wall-clock fields: equal for the same seeds
    whatever ran them (one process, N workers, a Ray cluster)."""
    return {k: v for k, v in summary(result).items() if k not in ("seconds", "first_found")}
