"""Campaign throughput (issue 11: verification at scale) and the sizing of the
campaign the README names (10,000 seeds of 10^5 steps each)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sim.bench.clock import cpu_seconds


def bench_campaign(seeds: int = 16, protocol: str = "kvstate",
                   workers: Sequence[int] | None = None,
                   connect: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Seeds per second of a campaign with 1, 2 and all workers (the same
    seeds each time; the aggregated results must be equal); given
    ``connect`` (a context manager of a `sim.explore.cluster.Cluster`), the same
    seeds as Ray tasks on that cluster too (its speed-up over one local
    worker is what a campaign gains per seed from it, scheduling and
    transfers included). The cluster is connected after the local runs, so
    their worker processes are never forked beside Ray's threads."""
    import os

    from sim.explore.campaign import campaign, comparable

    counts = workers or sorted({1, 2, os.cpu_count() or 1})
    figures: dict[str, Any] = {"seeds": seeds, "protocol": protocol}
    outcomes = []
    base = None
    for n in counts:
        cpu = cpu_seconds()
        r = campaign(protocol, seeds=seeds, workers=n)
        cpu = cpu_seconds() - cpu
        figures[f"cpu_s_per_seed_w{n}"] = round(cpu / max(r.runs, 1), 3)
        outcomes.append(comparable(r))
        rate = r.runs / r.seconds if r.seconds else 0.0
        figures[f"seeds_per_s_w{n}"] = round(rate, 2)
        if base is None:
            base = rate or 1.0
        else:
            figures[f"speedup_w{n}"] = round(rate / base, 2)
    if connect is not None:
        with connect() as cluster:
            # The connection is this process's already: campaign() uses it as
            # it is, so its start is not counted (a one-time cost).
            r = campaign(protocol, seeds=seeds, ray_address=cluster.address)
            figures["ray_cpus"] = cluster.cpus
        outcomes.append(comparable(r))
        rate = r.runs / r.seconds if r.seconds else 0.0
        figures["seeds_per_s_ray"] = round(rate, 2)
        figures["speedup_ray"] = round(rate / (base or 1.0), 2)
    figures["same_results"] = all(o == outcomes[0] for o in outcomes)
    # Sizing from the first run (one worker unless ``workers`` says otherwise;
    # the CPU seconds count every worker): a campaign's cost is its observations
    # (each seed's run length varies with its workload and faults).
    per_seed = outcomes[0]["observations"] / max(outcomes[0]["runs"], 1)
    per_cpu_s = per_seed / max(figures[f"cpu_s_per_seed_w{counts[0]}"], 1e-9)
    figures["observations_per_seed"] = round(per_seed)
    figures["observations_per_cpu_s"] = round(per_cpu_s)
    figures["cpu_hours_for_10k_seeds_of_1e5_observations"] = round(
        SIZING_SEEDS * SIZING_OBSERVATIONS / per_cpu_s / 3600, 2)
    return figures


# The campaign the README sizes (issue 11: 10,000 seeds of 10^5 steps each).
SIZING_SEEDS = 10_000
SIZING_OBSERVATIONS = 100_000
