"""``kvstate plot TRACE -o run.png``: a run's timeline, drawn from its trace.

One streaming pass over the trace (simulator or recorded, any number of
engines) derives, against the trace's time ``t``:

- **pins held**: the connector's extra block references (``Plan.pins`` taken,
  ``Plan.releases`` and ``Settlement.releases`` given back), per engine, with
  preemptions marked;
- **send queues**: per rank, jobs received and not yet dequeued (the send
  queue's depth: ``Plan.saves`` enqueue on every rank, ``JobStarted``
  dequeues) and jobs in flight (received and not yet finished: ``JobFinished``);
- **store pressure**: puts answered -200 and jobs skipped under pressure per
  time bin, and the dedup hit rate (keys an existence check found present);
- **KV events**: events published (``Settlement.published``) and orphans, i.e.
  events a Dynamo-style router that rejects unknown parents would refuse
  (`sim.simulator.consumer.RadixConsumer`, fed the published events in trace order).

``plot_trace`` returns the same figures as numbers (`PlotSummary`), so the
command prints them and ``--json`` emits them. matplotlib is needed
(``pip install 'kvstate[plot]'``); it draws with the non-interactive Agg
backend, to any format matplotlib knows from the output's suffix (png, svg, pdf).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvstate.config import GroupKind
from kvstate.keys import parse_key
from kvstate.records import NULL_BLOCK_ID
from kvstate.trace import TraceReader
from sim.simulator.consumer import RadixConsumer

MAX_POINTS = 4000  # per series: longer series keep each bucket's extremes
BINS = 120  # time bins for the per-bin counts


@attrs.define
class Level:
    """A quantity that changes at points in time (drawn as a step line)."""

    times: list[float] = attrs.Factory(list)
    values: list[int] = attrs.Factory(list)
    now: int = 0
    peak: int = 0

    def add(self, t: float, delta: int) -> None:
        if not delta:
            return
        self.now += delta
        self.peak = max(self.peak, self.now)
        if self.times and self.times[-1] == t:
            self.values[-1] = self.now
        else:
            self.times.append(t)
            self.values.append(self.now)


@attrs.define
class PlotSummary:
    path: str
    output: str
    observations: int
    engines: int
    ranks: int
    duration: float
    peak_pins: int
    pins_at_end: int
    peak_queue_depth: int
    peak_jobs_in_flight: int
    preemptions: int
    rejections_200: int
    skipped_jobs: int
    exists_keys: int
    dedup_hits: int
    events_published: int
    orphans: int

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class _Timeline:
    pins: dict[int, Level] = attrs.Factory(dict)  # engine -> pins held
    queued: dict[tuple[int, int], Level] = attrs.Factory(dict)  # (engine, rank)
    in_flight: dict[tuple[int, int], Level] = attrs.Factory(dict)
    preemptions: list[float] = attrs.Factory(list)
    rejections: list[float] = attrs.Factory(list)
    skipped: list[float] = attrs.Factory(list)
    exists: list[tuple[float, int, int]] = attrs.Factory(list)  # (t, keys, present)
    published: Level = attrs.Factory(Level)
    orphans: Level = attrs.Factory(Level)
    first: float | None = None
    last: float = 0.0
    observations: int = 0


def read_timeline(path: str | Path) -> tuple[_Timeline, dict[str, Any]]:
    line = _Timeline()
    with TraceReader(path, fast=True) as reader:
        configs = reader.header["configs"]
        consumer = RadixConsumer([i for i, g in enumerate(configs[0].groups)
                                  if g.kind is GroupKind.FULL])
        for e, config in enumerate(configs):
            line.pins[e] = Level()
            for r in range(config.world_size):
                line.queued[(e, r)] = Level()
                line.in_flight[(e, r)] = Level()
        for _, engine, t, obs in reader:
            line.observations += 1
            if line.first is None:
                line.first = t
            line.last = t
            kind = type(obs).__name__
            if kind == "Planned":
                plan = obs.plan
                line.pins[engine].add(t, _real(plan.pins) - _real(plan.releases))
                if plan.saves:
                    for r in range(configs[engine].world_size):
                        line.queued[(engine, r)].add(t, len(plan.saves))
                        line.in_flight[(engine, r)].add(t, len(plan.saves))
                line.preemptions += [t] * len(plan.preempted)
            elif kind == "Settled":
                settlement = obs.settlement
                line.pins[engine].add(t, -_real(settlement.releases))
                orphans = 0
                for event in settlement.published:
                    if not consumer.accept(event):
                        orphans += 1
                line.published.add(t, len(settlement.published))
                line.orphans.add(t, orphans)
            elif kind == "JobStarted":
                line.queued[(engine, obs.rank)].add(t, -1)
            elif kind == "JobFinished":
                line.in_flight[(engine, obs.rank)].add(t, -1)
                if obs.outcome == "skipped":
                    line.skipped.append(t)
            elif kind == "PutDone":
                if obs.code == -200:
                    line.rejections.append(t)
            elif kind == "ExistsAnswered":
                line.exists.append((t, len(obs.keys), sum(obs.present)))
            elif kind == "KeyEvicted":
                # The router forgets an evicted chunk (as the simulator's does).
                fields = parse_key(obs.key)
                if fields is not None and fields.namespace == 0:
                    try:
                        consumer.forget(fields.group, fields.chunk_hash())
                    except ValueError:
                        continue  # a digest that is not hex
        return line, reader.header


def _real(blocks: Sequence[int]) -> int:
    return sum(1 for b in blocks if b != NULL_BLOCK_ID)


def _thin(times: list[float], values: list[int]) -> tuple[list[float], list[int]]:
    """At most ``MAX_POINTS`` points: each bucket keeps its min and max."""
    if len(times) <= MAX_POINTS:
        return times, values
    step = -(-len(times) // (MAX_POINTS // 2))
    out_t: list[float] = []
    out_v: list[int] = []
    for start in range(0, len(times), step):
        chunk = range(start, min(start + step, len(times)))
        lo = min(chunk, key=values.__getitem__)
        hi = max(chunk, key=values.__getitem__)
        for i in sorted({lo, hi}):
            out_t.append(times[i])
            out_v.append(values[i])
    return out_t, out_v


def _step(ax: Any, level: Level, start: float, end: float, **style: Any) -> None:
    times, values = _thin([start, *level.times, end], [0, *level.values, level.now])
    ax.step(times, values, where="post", **style)


def plot_trace(path: str | Path, output: str | Path, *, title: str | None = None) -> PlotSummary:
    """Draw the timeline of the trace at ``path`` into ``output``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    line, header = read_timeline(path)
    start = line.first or 0.0
    end = max(line.last, start + 1e-9)
    engines = len(header["configs"])
    multi = engines > 1

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    ax_pins, ax_jobs, ax_store, ax_events = axes
    name = title or f"{Path(path).name} ({header.get('protocol', 'trace')})"
    fig.suptitle(name)

    for e, level in line.pins.items():
        _step(ax_pins, level, start, end, label=f"engine {e}" if multi else "pins held")
    if line.preemptions:
        ax_pins.plot(line.preemptions, [0] * len(line.preemptions), "|", color="tab:red",
                     markersize=12, label=f"preemption ({len(line.preemptions)})")
    ax_pins.set_ylabel("pinned blocks")
    ax_pins.legend(loc="upper right", fontsize="small")

    for n, ((e, r), level) in enumerate(line.in_flight.items()):
        who = f"e{e} rank {r}" if multi else f"rank {r}"
        colour = f"C{n % 10}"
        _step(ax_jobs, level, start, end, color=colour, linewidth=2.2, alpha=0.35,
              label=f"{who} in flight")
        _step(ax_jobs, line.queued[(e, r)], start, end, color=colour, linewidth=0.9,
              label=f"{who} queued")
    ax_jobs.set_ylabel("save jobs")
    ax_jobs.legend(loc="upper right", fontsize="small", ncol=2)

    edges = [start + (end - start) * i / BINS for i in range(BINS + 1)]
    width = (end - start) / BINS
    ax_store.hist([line.rejections, line.skipped], bins=edges,
                  label=[f"put -200 ({len(line.rejections)})",
                         f"job skipped under pressure ({len(line.skipped)})"],
                  color=["tab:red", "tab:orange"])
    ax_store.set_ylabel(f"per {width:.3g} t")
    rate_ax = ax_store.twinx()
    keys = [0] * BINS
    hits = [0] * BINS
    for t, n, present in line.exists:
        b = min(BINS - 1, int((t - start) / width)) if width else 0
        keys[b] += n
        hits[b] += present
    centres = [(edges[i] + edges[i + 1]) / 2 for i in range(BINS) if keys[i]]
    rates = [hits[i] / keys[i] for i in range(BINS) if keys[i]]
    rate_ax.plot(centres, rates, ".", color="tab:green", label="dedup hit rate")
    rate_ax.set_ylim(-0.02, 1.02)
    rate_ax.set_ylabel("dedup hit rate")
    handles, labels = ax_store.get_legend_handles_labels()
    more, more_labels = rate_ax.get_legend_handles_labels()
    ax_store.legend(handles + more, labels + more_labels, loc="upper right", fontsize="small")

    _step(ax_events, line.published, start, end, label="KV events published")
    _step(ax_events, line.orphans, start, end, color="tab:red", label="orphans")
    ax_events.set_ylabel("events (cumulative)")
    ax_events.set_xlabel("t (trace time: seconds in the simulator, steps in vLLM traces)")
    ax_events.legend(loc="upper left", fontsize="small")

    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)

    exists_keys = sum(n for _, n, _ in line.exists)
    return PlotSummary(
        path=str(path), output=str(output), observations=line.observations, engines=engines,
        ranks=len(line.queued), duration=round(end - start, 6),
        peak_pins=max((lv.peak for lv in line.pins.values()), default=0),
        pins_at_end=sum(lv.now for lv in line.pins.values()),
        peak_queue_depth=max((lv.peak for lv in line.queued.values()), default=0),
        peak_jobs_in_flight=max((lv.peak for lv in line.in_flight.values()), default=0),
        preemptions=len(line.preemptions), rejections_200=len(line.rejections),
        skipped_jobs=len(line.skipped), exists_keys=exists_keys,
        dedup_hits=sum(p for _, _, p in line.exists),
        events_published=line.published.now, orphans=line.orphans.now)
