"""One simulation run: build the world from options, run the two phases, judge.

Phases. *Safety*: arrivals come in, the fault swarm is on, and every
invariant is checked after every observation; the first violation stops the
run. *Liveness*: faults off, no new arrivals, and at most ``settle_time``
virtual seconds for everything to drain; then a ``Quiescent`` observation
asks the liveness invariants (S4, S6, S18, K3) whether anything is left.
A liveness failure names who stalled (``liveness_stall``): ``environment``
when the engine model itself still holds requests it could not finish (the
protocol's leftovers then belong to those requests), ``protocol`` when every
request finished and the protocol still did not settle.

Admission (``sim.simulator.engine``): requests vLLM would refuse (prompt plus max
tokens over ``max_model_len``, or more than the KV cache holds) are counted in
``rejected`` and never enter an engine.

Event figures: ``events_per_stored_chunk`` is published ``BlockStored``
events over distinct (group, chunk hash) pairs some rank stored;
``event_duplicate_ratio`` the share of published events announcing a
(group, hash) an earlier event of the run already announced;
``events_republished`` those a later generation of the same request
published again (re-announcements at resumption).

Setups. ``both``: one ``kv_both`` engine saving prefill and decode KV.
``pd``: a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer`` with ``save_decode_cache``) sharing one store; when the
prefill engine finishes a prompt its KV goes to the decode engine directly
(not through the store, which may therefore lack it until the decode engine
backfills it with its first decode save).
"""

from __future__ import annotations

import hashlib
import math
import shlex
import time as wallclock
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec, Role
from kvstate.harness import EngineRequest, Harness
from kvstate.invariants import INVARIANTS, Finding, Monitor
from kvstate.keys import HashChain, chunk_hash, key_digest, parse_key
from kvstate.observations import KeyEvicted, Observation, Planned, PutDone, Settled
from kvstate.records import NULL_BLOCK_ID
from kvstate.trace import encode_header, encode_observation
from kvstate.variants import get_variant, with_plugins
from kvstate.workloads import DEFAULT_FAST25, Arrival, fast25, synthetic
from sim.simulator.consumer import RadixConsumer
from sim.simulator.engine import SimEngine
from sim.simulator.faults import SITES, Faults
from sim.simulator.kernel import Kernel
from sim.simulator.store import SimStore

WINDOW = 4000  # observations kept for a violation's causal window


# The range of every numeric option (`SimOptions`). `kvstate sim` refuses a
# value outside it (`sim.commands.options.validate_options`) and `kvstate
# minimize` refuses it in a trace's header (`sim.traces.minimize.options_from_trace`),
# so every run's reproduce command is one both take. The upper bounds keep a
# run's work bounded (minimize re-runs a header's options up to --max-runs
# times: a hostile header must not buy unbounded work) and its configs inside
# the trace format's `kvstate.trace.LIMITS`.
OPTION_LIMITS: dict[str, float] = {
    "seed": (1 << 63) - 1, "requests": 100_000, "rate": 1e9, "scale": 1 << 20, "world_size": 64,
    "put_step": 64, "block_size": 4096, "num_blocks": 1 << 20, "store_capacity": 1 << 24,
    "token_budget": 1 << 20, "settle_time": 1e6, "max_model_len": 1 << 30,
    "alignment": 1 << 20,
}
OPTION_ZERO = {"seed", "max_model_len", "alignment"}  # integer options where 0 is meaningful
# Where a simulator bound is tighter than the trace format's, the message says so.
OPTION_WHY = {"world_size": " (the simulator's bound: every simulated rank costs time; a "
              "trace from an engine may name up to 1024 ranks)"}


@attrs.frozen(slots=True)
class SimOptions:
    seed: int = 0
    protocol: str = "kvstate"
    setup: str = "both"
    workload: str = "synthetic"
    requests: int = 400
    rate: float = 60.0
    fast25_path: str = ""
    scale: int = 32
    world_size: int = 2
    put_step: int = 1
    block_size: int = 4
    num_blocks: int = 160
    store_capacity: int = 600
    token_budget: int = 256
    max_model_len: int = 0  # 0: what the KV cache holds (num_blocks x block_size)
    # KV-cache groups: "full" (full attention) or "swa:W" (a sliding window of
    # W tokens); a hybrid model is e.g. ("full", "swa:8").
    groups: tuple[str, ...] = ("full",)
    alignment: int = 0  # the lcm boundary stored prefixes end on; 0: the block size
    events: bool = True
    faults: tuple[str, ...] = tuple(SITES)
    settle_time: float = 30.0

    def command(self) -> str:
        """The exact command line that reproduces this run."""
        default = SimOptions()
        parts = ["kvstate", "sim"]
        for field in attrs.fields(SimOptions):
            value = getattr(self, field.name)
            if value == getattr(default, field.name):
                continue
            flag = "--" + field.name.replace("_", "-")
            if isinstance(value, bool):
                parts.append(flag if value else "--no-" + field.name.replace("_", "-"))
            elif isinstance(value, tuple):
                parts.append(f"{flag}={','.join(value) or 'none'}")
            else:
                parts.append(f"{flag}={value}")
        return with_plugins(" ".join(shlex.quote(p) for p in parts), self.protocol)


_DEFAULTS = SimOptions()


def out_of_range(name: str, value: float) -> str | None:
    """Why ``value`` is no value of the numeric option ``name`` (None when it is one)."""
    limit = OPTION_LIMITS[name]
    if isinstance(getattr(_DEFAULTS, name), float):
        if not (math.isfinite(value) and 0 < value <= limit):
            return f"expected a number in (0, {limit:g}]"
        return None
    low = 0 if name in OPTION_ZERO else 1
    if not low <= value <= limit:
        return f"expected an integer in [{low}, {int(limit)}]" + OPTION_WHY.get(name, "")
    return None


@attrs.define
class SimResult:
    options: SimOptions
    ok: bool
    findings: list[tuple[int, Finding]]
    windows: list[list[str]]
    figures: dict[str, Any]
    fault_rates: dict[str, float]
    fault_fired: dict[str, int]
    trace_sha256: str


class _Recorder:
    """Streams observations to the trace (if any) and into the determinism
    hash (if asked: encoding every line costs more than checking it), and
    keeps a ring buffer of recent observations for causal windows, encoded
    only when a violation needs them."""

    def __init__(self, kernel: Kernel, out: IO[str] | None, digest: bool) -> None:
        self.kernel = kernel
        self.out = out
        self.index = 0
        self.digest = hashlib.sha256() if digest or out is not None else None
        self.local: list[int] = []
        # (trace index, engine, engine-local index, time, observation)
        self.recent: deque[tuple[int, int, int, float, Observation]] = deque(maxlen=WINDOW)
        self.announced: set[tuple[int, bytes]] = set()  # (group, hash) ever published
        self.duplicates = 0  # published events whose (group, hash) was announced before
        self.stored: set[tuple[int, str]] = set()  # (group, hash hex) some rank stored
        # Per request id: (group, hash) its generations published since the id's
        # last finished generation (``floor``; later reports of that one are not
        # the new request's); ``republished`` counts events a later generation
        # of the same request published again.
        self.by_request: dict[tuple[int, str], tuple[int, set[tuple[int, bytes]]]] = {}
        self.republished = 0
        self.pins_held = 0  # connector pins (extra block references) outstanding
        self.peak_pins = 0

    def sink(self, engine: int, consumer: RadixConsumer | None = None) -> Any:
        self.local.append(0)

        def record(obs: Observation) -> None:
            kind = type(obs)
            if kind is Settled:
                announced = self.announced
                settlement = obs.settlement  # type: ignore[union-attr]
                self.pins_held -= sum(1 for b in settlement.releases if b != NULL_BLOCK_ID)
                by = settlement.published_by
                for i, event in enumerate(settlement.published):
                    key = (event.group_idx, event.block_hashes[-1])
                    if key in announced:
                        self.duplicates += 1
                    else:
                        announced.add(key)
                    if i < len(by):
                        req_id, gen = by[i]
                        floor, mine = self.by_request.setdefault((engine, req_id), (-1, set()))
                        if gen > floor:
                            if key in mine:
                                self.republished += 1
                            mine.add(key)
            elif kind is Planned:
                plan = obs.plan  # type: ignore[union-attr]
                self.pins_held += sum(1 for b in plan.pins if b != NULL_BLOCK_ID) - sum(
                    1 for b in plan.releases if b != NULL_BLOCK_ID)
                self.peak_pins = max(self.peak_pins, self.pins_held)
                for req_id, gen in plan.finished:
                    self.by_request[(engine, req_id)] = (gen, set())
            elif kind is PutDone and obs.accepted:  # type: ignore[union-attr]
                self.stored.add((obs.group, key_digest(obs.key)))  # type: ignore[union-attr]
            if consumer is not None:
                if type(obs) is Settled:
                    for event in obs.settlement.published:
                        consumer.accept(event)
                elif type(obs) is KeyEvicted:
                    fields = parse_key(obs.key)
                    if fields is not None and fields.namespace == 0:
                        consumer.forget(fields.group, fields.chunk_hash())
            now = self.kernel.now
            if self.digest is not None:
                line = encode_observation(obs, self.index, engine, now)
                self.digest.update(line.encode())
                if self.out is not None:
                    self.out.write(line + "\n")
            self.recent.append((self.index, engine, self.local[engine], now, obs))
            self.local[engine] += 1
            self.index += 1
        return record

    def locate(self, engine: int, local: int) -> tuple[int, Observation] | None:
        """Trace index and observation of an engine's ``local``-th observation."""
        for index, e, loc, _, obs in reversed(self.recent):
            if e == engine and loc == local:
                return index, obs
        return None


def _ids_of(obs: Observation) -> set[Any]:
    ids: set[Any] = set()
    for name in ("req_id", "job_id"):
        value = getattr(obs, name, None)
        if value is not None:
            ids.add((name, value))
    report = getattr(obs, "report", None)
    if report is not None:
        ids.update({("req_id", report.req_id), ("job_id", report.job_id)})
    return ids


def _arrivals(options: SimOptions, kernel: Kernel) -> Iterator[Arrival]:
    if options.workload == "synthetic":
        return synthetic(kernel.rng, requests=options.requests, rate=options.rate)
    path = Path(options.fast25_path) if options.fast25_path else DEFAULT_FAST25
    return fast25(path, scale=options.scale, limit=options.requests,
                  repeat=max(1, -(-options.requests // 12031)))


def parse_groups(specs: tuple[str, ...]) -> tuple[GroupSpec, ...]:
    """``("full", "swa:8")`` -> the groups' specs; ValueError naming the bad item."""
    out = []
    for spec in specs:
        kind, sep, window = spec.partition(":")
        if kind == "full" and not sep:
            out.append(GroupSpec())
        elif kind == "swa" and sep and window.isascii() and window.isdigit() \
                and len(window) < 10 and int(window) >= 1:
            out.append(GroupSpec(GroupKind.SLIDING_WINDOW, int(window)))
        else:
            raise ValueError(f"group {spec!r}: expected 'full' or 'swa:W' (W: a window of 1 "
                             "to 999,999,999 tokens)")
    if not out:
        raise ValueError("at least one group is needed")
    return tuple(out)


def build_configs(options: SimOptions) -> list[ConnectorConfig]:
    common: dict[str, Any] = dict(block_size=options.block_size, world_size=options.world_size,
                  put_step=options.put_step, enable_kv_events=options.events,
                  pressure_backoff=0.2, groups=parse_groups(options.groups),
                  alignment=options.alignment or None)
    if options.setup == "both":
        return [ConnectorConfig(role=Role.BOTH, save_decode_cache=True, **common)]
    return [ConnectorConfig(role=Role.PRODUCER, **common),
            ConnectorConfig(role=Role.CONSUMER, save_decode_cache=True, **common)]


def simulate(options: SimOptions, trace: IO[str] | None = None,
             stop_at_first: bool = True, hash_trace: bool = False,
             progress: Callable[[int, int], None] | None = None,
             monitor: type[Monitor] = Monitor) -> SimResult:
    """Run once. ``trace`` receives the JSON Lines trace; ``hash_trace``
    computes its sha256 without writing it (for the determinism check);
    ``progress(arrived, total)`` is called as arrivals come in. ``monitor``:
    the class each engine's invariant monitor is made of (`kvstate bench
    sim` passes one that checks nothing, to weigh the checks)."""
    started = wallclock.perf_counter()
    kernel = Kernel(options.seed)
    faults = Faults(kernel.rng, options.faults)
    variant = get_variant(options.protocol)
    configs = build_configs(options)
    recorder = _Recorder(kernel, trace, hash_trace)
    if trace is not None:
        trace.write(encode_header(configs, protocol=options.protocol, seed=options.seed,
                                  options=attrs.asdict(options),
                                  engines=[c.role.value for c in configs]) + "\n")
    shared_store_view: set[str] = set()
    engines: list[SimEngine] = []
    monitors: list[Monitor] = []

    def on_evict(key: str) -> None:
        for engine in engines:
            engine.harness.observe(KeyEvicted(key))

    store = SimStore(kernel, faults, options.store_capacity, on_evict)
    # One router, fed by every engine's published events.
    consumer = RadixConsumer([i for i, g in enumerate(configs[0].groups)
                              if g.kind is GroupKind.FULL])
    for index, config in enumerate(configs):
        checks = monitor(config, store_view=shared_store_view)
        monitors.append(checks)
        harness = Harness(config, variant, num_blocks=options.num_blocks, store=store,
                          token_budget=options.token_budget, monitor=checks, record=False,
                          keep_finished=False, auto_preempt=True,
                          sink=recorder.sink(index, consumer if options.events else None),
                          clock=lambda: kernel.now)
        engines.append(SimEngine(config.role.value, index, kernel, harness, store, faults,
                                 lookup=config.role is not Role.CONSUMER,
                                 max_model_len=options.max_model_len))
    pending_max_new: dict[str, int] = {}
    if options.setup == "pd":
        def hand_off(req: EngineRequest) -> None:
            # The prompt's KV goes to the decode engine directly, not via the store.
            max_new = pending_max_new.pop(req.req_id, 8)
            arrival = Arrival(kernel.now, req.req_id, req.prompt, max(1, max_new))
            kernel.schedule(0.005, lambda: engines[1].arrive(arrival, transferred=True))
        engines[0].on_prefilled = hand_off

    block, per_block = configs[0].block_size, configs[0].hashes_per_block

    def arrive(arrival: Arrival) -> None:
        # Admission: the engine that will hold the whole request decides.
        holder = engines[-1]
        if holder.refusal(len(arrival.prompt), arrival.max_new_tokens) is not None:
            holder.rejected += 1
            return
        if options.events:
            hashes = HashChain(configs[0].hash_block, arrival.prompt).hashes
            consumer.prefix_hit([chunk_hash(hashes, c, per_block)
                                 for c in range(len(arrival.prompt) // block)])
        if options.setup == "pd":
            # The prefill engine stops after the prompt; the decode engine generates.
            pending_max_new[arrival.req_id] = arrival.max_new_tokens
            engines[0].arrive(attrs.evolve(arrival, max_new_tokens=0))
        else:
            engines[0].arrive(arrival)

    # Arrivals are fed lazily, one scheduled at a time, so a 100k-request
    # workload never sits in memory (the heap holds only the next arrival).
    feed = _arrivals(options, kernel)
    counts: dict[str, Any] = {"arrivals": 0, "last": 0.0, "done": False}

    def next_arrival() -> None:
        arrival = next(feed, None)
        if arrival is None:
            counts["done"] = True
            return
        counts["arrivals"] += 1
        counts["last"] = arrival.time
        if progress is not None and counts["arrivals"] % 200 == 0:
            progress(counts["arrivals"], options.requests)

        def fire() -> None:
            arrive(arrival)
            next_arrival()
        kernel.schedule(max(0.0, arrival.time - kernel.now), fire)

    next_arrival()

    def violated() -> bool:
        return stop_at_first and any(m.findings for m in monitors)

    # Safety phase: every arrival, then a horizon for the last one's work.
    kernel.run(stop=lambda: violated() or bool(counts["done"]))
    if not violated():
        kernel.run(until=kernel.now + options.settle_time, stop=violated)
    arrivals, last_arrival = counts["arrivals"], counts["last"]
    safety_events = kernel.processed
    liveness_ok = True
    stall, stall_detail = "none", ""
    if not violated():
        # Liveness phase: faults off, and a bound generous enough for the work
        # still queued (a fault swarm can leave a long backlog behind a slow
        # store): settle_time plus 2 virtual seconds per request still in an engine.
        faults.enabled = False
        # Findings of the safety phase (kept going past a violation) are not
        # the liveness phase's: only new ones say the run did not settle.
        found_before = sum(len(m.findings) for m in monitors)
        backlog = sum(len(e.harness.requests) + len(e.backlog) for e in engines)
        deadline = kernel.now + options.settle_time + 2.0 * backlog
        preempted_before = sum(e.harness.preemptions for e in engines)
        kernel.run(until=deadline,
                   stop=lambda: violated() or all(e.idle() for e in engines))
        left = {e.name: len(e.harness.requests) + len(e.backlog) for e in engines}
        for engine in engines:
            engine.harness.quiesce()
        liveness_ok = sum(len(m.findings) for m in monitors) == found_before
        if not liveness_ok:
            if any(left.values()):
                stall = "environment"
                thrash = sum(e.harness.preemptions for e in engines) - preempted_before
                pinned = sum(1 for e in engines for b, r in enumerate(e.harness.pool.refs)
                             if b and r > 0)
                stall_detail = (
                    "the engine model stalled: requests never finished "
                    + ", ".join(f"{n} in {name}" for name, n in left.items() if n)
                    + f" after the settle deadline ({thrash} preemptions while settling, "
                    f"{pinned} blocks referenced); the protocol's leftovers belong to them")
            else:
                stall = "protocol"
                stall_detail = ("every request finished, yet the protocol did not settle "
                                "(its own state was left behind)")

    findings = [(i, f) for i, m in enumerate(monitors) for f in m.findings]
    published = sum(e.harness.published_count for e in engines)
    windows = [_window(recorder, engine, finding) for engine, finding in findings[:3]]
    figures = {
        "simulated_seconds": round(kernel.now, 6),
        "kernel_events": kernel.processed,
        "safety_events": safety_events,
        "observations": recorder.index,
        "arrivals": arrivals,
        "last_arrival": round(last_arrival, 6),
        "steps": sum(e.steps for e in engines),
        "preemptions": sum(e.harness.preemptions for e in engines),
        "id_reuses": sum(e.reuses for e in engines),
        "store_evictions": store.evictions,
        "store_restarts": store.restarts,
        "store_lost_to_restarts": store.lost_to_restarts,
        "store_puts_preempted": store.preempted_puts,
        "store_keys": len(store.objects),
        "store_puts": store.puts,
        "store_exists_keys": store.exists_keys,
        "dedup_hits": store.dedup_hits,
        "dedup_hit_rate": round(store.dedup_hits / store.dedup_checked, 4)
        if store.dedup_checked else 0.0,
        "peak_pins": recorder.peak_pins,
        "pins_at_end": recorder.pins_held,
        "events_published": published,
        "events_duplicate": recorder.duplicates,
        "events_republished": recorder.republished,
        "event_duplicate_ratio": round(recorder.duplicates / published, 4) if published else 0.0,
        "chunks_stored": len(recorder.stored),
        "events_per_stored_chunk": round(published / len(recorder.stored), 4)
        if recorder.stored else 0.0,
        "rejected": sum(e.rejected for e in engines),
        "hung_calls": sum(e.hung_calls for e in engines),
        "consumer_blocks": consumer.accepted,
        "consumer_orphans_rejected": consumer.orphans,
        "consumer_duplicates": consumer.duplicates,
        "mean_prefix_hit_chunks": round(consumer.hit_chunks / consumer.lookups, 3)
        if consumer.lookups else 0.0,
        "invariants_checked": len(INVARIANTS),
        "violations_by_invariant": dict(sorted(Counter(f.invariant for _, f in findings).items())),
        "liveness_ok": liveness_ok,
        "liveness_stall": stall,
        "liveness_detail": stall_detail,
        "wall_seconds": round(wallclock.perf_counter() - started, 3),
    }
    return SimResult(
        options=options,
        ok=not findings,
        findings=findings,
        windows=windows,
        figures=figures,
        fault_rates=dict(faults.rates),
        fault_fired=dict(faults.fired),
        trace_sha256=recorder.digest.hexdigest() if recorder.digest is not None else "",
    )


def _window(recorder: _Recorder, engine: int, finding: Finding, size: int = 12) -> list[str]:
    """The observations of the same request generation and job that led to a
    finding — its causal window — as trace lines, oldest first."""
    found = recorder.locate(engine, finding.event_index)
    if found is None:
        return []
    index, trigger = found
    keys = _ids_of(trigger)
    picked = [(i, when, obs) for i, e, _, when, obs in recorder.recent
              if e == engine and i <= index and (i == index or keys & _ids_of(obs))]
    return [encode_observation(obs, i, engine, when) for i, when, obs in picked[-size:]]
