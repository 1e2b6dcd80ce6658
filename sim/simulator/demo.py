"""The README's main job until the simulator lands: a scripted workload that
exercises the core's hazards (shared prefixes, decode saving, KV events,
preemption with a queued job, request-id reuse, -200 pressure, a failed and a
raising put) on the in-process harness, with every invariant checked after
every observation."""

from __future__ import annotations

from typing import Any

from kvstate.config import ConnectorConfig
from kvstate.harness import Harness
from kvstate.memory_store import MemoryStore, StoreRaised
from kvstate.observations import ExistsAnswered, JobFinished, PutDone
from kvstate.scenarios import ScriptedAnswers, prompt


def demo_config() -> ConnectorConfig:
    return ConnectorConfig(block_size=4, world_size=2, save_decode_cache=True,
                           enable_kv_events=True, pressure_backoff=3.0)


def run_demo(variant: str) -> dict[str, Any]:
    answers = (
        ScriptedAnswers()
        .when("put", 0, lambda n, k: n == 3, -200)
        .when("put", 1, lambda n, k: n == 5, -800)
        .when("put", 1, lambda n, k: n == 9, StoreRaised("connection reset"))
    )
    store = MemoryStore(answers)
    h = Harness(demo_config(), variant, num_blocks=40, store=store)
    shared = prompt(8, salt=1)
    h.add("chat-1", shared + prompt(6, salt=2), max_new_tokens=10)
    h.add("chat-2", shared + prompt(3, salt=3), max_new_tokens=8)
    h.add("chat-3", prompt(9, salt=4), max_new_tokens=6)
    h.step()
    h.run_rank(1)          # rank 1 runs ahead, rank 0 lags a step
    h.step()
    h.run_ranks()
    h.step(preempt=["chat-3"], hold=["chat-3"])  # chat-3's queued job goes stale
    for _ in range(4):
        h.step()
        h.run_rank(0)
        h.run_rank(1)
    h.settle()
    h.add("chat-1", shared + prompt(5, salt=6), max_new_tokens=4)  # a client reuses the id
    h.add("chat-4", shared + prompt(6, salt=2), max_new_tokens=3, lookup=True)
    quiet = h.settle()
    jobs = sum(len(p.saves) for p in h.plans)
    outcomes: dict[str, int] = {}
    for obs in h.log:
        if isinstance(obs, JobFinished):
            outcomes[obs.outcome] = outcomes.get(obs.outcome, 0) + 1
    exists = sum(len(o.keys) for o in h.log if isinstance(o, ExistsAnswered))
    present = sum(sum(o.present) for o in h.log if isinstance(o, ExistsAnswered))
    puts = [o for o in h.log if isinstance(o, PutDone)]
    return {
        "protocol": variant,
        "ok": not h.monitor.findings,
        "violations": [
            {"invariant": f.invariant, "event_index": f.event_index, "message": f.message}
            for f in h.monitor.findings
        ],
        "steps": len(h.plans),
        "observations": len(h.log),
        "generations": sum(len(p.started) for p in h.plans),
        "save_jobs": jobs,
        "rank_outcomes": outcomes,
        "exists_keys": exists,
        "dedup_hits": present,
        "puts": len(puts),
        "puts_failed": sum(1 for p in puts if p.code != 0),
        "keys_stored": len(store.objects),
        "events_published": len(h.published),
        "pins": sum(len(p.pins) for p in h.plans),
        "metadata_block_ids": sum(len(t) for p in h.plans for m in p.saves for t in m.block_ids),
        "leftovers": dict(quiet.leftovers),
        "invariants_checked": len(h.monitor.enabled),
    }
