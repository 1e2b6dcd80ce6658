"""``kvstate bench vllm``: the connectors' scheduler-side cost inside vLLM's real Scheduler.

What is timed: ``build_connector_meta`` and ``update_connector_output`` of the
scheduler connector, per scheduled request per decode step, with N requests
decoding at a given context (``save_decode_cache`` on, so a job is emitted
whenever a request fills a block, and released when all ranks reported).
``KvstateConnector`` (protocol ``kvstate``, with the online monitor off and on),
upstream's ``MooncakeStoreConnector``, and upstream's connector under
kvstate's observer (``ObservedMooncakeStoreConnector`` writing its trace to a
file, monitor on: every line it writes is also judged) run in the same
process, on the same schedule, so the ratios are like for like on a noisy
machine. The observer encodes, writes and judges its lines on a thread of
its own: the per-call figure is what the engine's scheduler waits for, and
``run_cpu_s`` (process CPU of the whole run, prefill, decode and the trace's
last lines included, every thread) is what it costs the machine. The
observer's rank-side work (the store tap, a few list appends per store call)
runs on the send threads and is not part of this bench.

What is not timed, and why: store I/O (none: the ranks' reports are written
by the bench, all jobs stored, delivered one step later as vLLM would), the
worker side (upstream's needs a Mooncake client; kvstate's per-rank cost is
``kvstate bench core``) and vLLM's own scheduling (the same for both).
Metadata size is the pickled ``KVConnectorMetadata`` of the measured steps,
what a multi-process executor ships to every worker.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import tempfile
import time
from typing import Any

VARIANTS = ("upstream", "upstream+observer", "kvstate", "kvstate+monitor")


def _engine(kind: str, model_dir: str, context: int, requests: int, world: int,
            block: int, trace: str) -> Any:
    from .rig import make_kv_cache_config, make_vllm_config

    blocks = requests * (context // block + 8) + 16
    extra: dict[str, Any] = {"save_decode_cache": True, "enable_lookup": False}
    if kind == "upstream":
        connector, module = "MooncakeStoreConnector", None
    elif kind == "upstream+observer":
        connector, module = "ObservedMooncakeStoreConnector", "adapters.vllm"
        extra["kvstate_trace"] = trace
        extra["kvstate_monitor"] = "log"
    else:
        connector, module = "KvstateConnector", "adapters.vllm"
        extra["kvstate_monitor"] = "log" if kind == "kvstate+monitor" else "off"
    vc = make_vllm_config(model_dir, connector=connector, module=module, extra=extra,
                          block_size=block, num_blocks=blocks, tp=world,
                          max_num_batched_tokens=max(4096, min(context * requests, 1 << 20)),
                          max_model_len=context + 256, max_num_seqs=requests)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(vllm_config=vc, kv_cache_config=make_kv_cache_config(blocks, block),
                     log_stats=False, structured_output_manager=StructuredOutputManager(vc),
                     block_size=block)


def _reports(kind: str, meta: Any, world: int) -> Any:
    """Every rank stored every job of the step's metadata."""
    from kvstate.records import Report
    from kvstate.tables import JobState

    if kind.startswith("upstream"):
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeStoreWorkerMetadata,
        )

        jobs = [r for r in meta.requests if r.store_job_id is not None]
        if not jobs:
            return None
        inner = MooncakeStoreWorkerMetadata(completed_saves={r.store_job_id: world for r in jobs})
        if kind == "upstream":
            return inner
        from kvstate.contract import UNKNOWN

        from .observer import ObservedWorkerMetadata

        step = meta.kvstate_step
        return ObservedWorkerMetadata(inner, [], [
            ((step, rank, i), Report(r.store_job_id, rank, r.req_id, UNKNOWN, JobState.STORED,
                                     UNKNOWN))
            for rank in range(world) for i, r in enumerate(jobs)], [])

    from .connector import KvstateWorkerMetadata

    saves = meta.plan.saves
    if not saves:
        return None
    reports = [((meta.plan.step, rank, i), Report(s.job_id, rank, s.req_id, s.generation,
                                                   JobState.STORED, s.token_len))
               for rank in range(world) for i, s in enumerate(saves)]
    return KvstateWorkerMetadata(reports, [], [])


# Schedulers measured so far stay referenced: a collected upstream scheduler's
# ZMQ context would block in ``term()`` inside the garbage collector.
_MEASURED: list[Any] = []


def _release_lookup_socket(connector: Any) -> None:
    """Upstream's scheduler holds a ZMQ REQ socket to its lookup server (none
    runs here); close it without lingering so its context can be torn down."""
    client = getattr(getattr(connector, "connector_scheduler", None), "client", None)
    socket = getattr(client, "socket", None)
    if socket is not None:
        socket.close(linger=0)


def measure(kind: str, model_dir: str, context: int, requests: int, world: int = 8,
            block: int = 16, cycles: int = 2) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    cpu_start = time.process_time()  # every thread: the observer's writer too
    trace = os.path.join(model_dir, f"{kind}-{context}-{len(_MEASURED)}.trace")
    scheduler = _engine(kind, model_dir, context, requests, world, block, trace)
    connector = scheduler.connector
    _MEASURED.append(scheduler)
    clock = {"s": 0.0}
    build, update = connector.build_connector_meta, connector.update_connector_output

    def timed_build(so: Any) -> Any:
        t = time.perf_counter()
        try:
            return build(so)
        finally:
            clock["s"] += time.perf_counter() - t

    def timed_update(out: Any) -> None:
        t = time.perf_counter()
        try:
            update(out)
        finally:
            clock["s"] += time.perf_counter() - t

    connector.build_connector_meta = timed_build
    connector.update_connector_output = timed_update
    hasher = get_request_block_hasher(block, sha256)
    for n in range(requests):
        params = SamplingParams(max_tokens=block * (cycles + 2) + 64, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        prompt = [(n * 7 + i) % 251 for i in range(context)]
        scheduler.add_request(Request(request_id=f"r{n}", prompt_token_ids=prompt,
                                      sampling_params=params, pooling_params=None,
                                      block_hasher=hasher))
    pending: Any = None
    measured = {"request_steps": 0, "seconds": 0.0, "meta_bytes": 0, "jobs": 0, "steps": 0}
    decoding_steps = 0
    target = block * cycles
    for _ in range(100 * target + 10 * requests):  # bounded: prefill, then decode steps
        if decoding_steps >= target:
            break
        before = clock["s"]
        so = scheduler.schedule()
        meta = so.kv_connector_metadata
        ids = list(so.num_scheduled_tokens)
        decode = bool(ids) and all(n == 1 for n in so.num_scheduled_tokens.values()) and \
            len(ids) == requests
        out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if scheduler.requests[r].num_computed_tokens
                               + so.num_scheduled_tokens[r] >= scheduler.requests[r].num_tokens
                               else [] for r in ids],
            kv_connector_output=None if pending is None else KVConnectorOutput(
                kv_connector_worker_meta=pending))
        pending = _reports(kind, meta, world)
        scheduler.update_from_output(so, out)
        if decode and not decoding_steps:
            # vLLM's engine core freezes the objects alive after start-up so the
            # collector does not rescan them; the prefilled requests here are
            # millions of objects at 128k, and a full collection inside a timed
            # call would be the collector's cost, not a connector's.
            gc.collect()
            gc.freeze()
        if decode:
            decoding_steps += 1
            measured["request_steps"] += len(ids)
            measured["steps"] += 1
            measured["meta_bytes"] += len(pickle.dumps(meta))
            measured["jobs"] += (len(meta.plan.saves) if kind.startswith("kvstate")
                                 else sum(r.store_job_id is not None for r in meta.requests))
        else:
            clock["s"] = before  # prefill steps are not measured
    gc.unfreeze()
    _release_lookup_socket(connector)
    connector.shutdown()  # the observer's trace: written whole (in the run's CPU, not timed)
    run_cpu = time.process_time() - cpu_start
    if decoding_steps < target:
        raise RuntimeError(f"{kind}: only {decoding_steps} of {target} decode steps with all "
                           f"{requests} requests running")
    measured["seconds"] = clock["s"]  # decode steps only (prefill steps were taken back)
    per = measured["seconds"] / max(1, measured["request_steps"])
    return {"kind": kind, "context": context, "requests": requests, "world": world,
            "us_per_request_step": per * 1e6,
            "run_cpu_s": run_cpu,
            "meta_bytes_per_job": measured["meta_bytes"] / max(1, measured["jobs"]),
            "jobs": measured["jobs"], "decode_steps": measured["steps"]}


def bench_vllm(contexts: tuple[int, ...] = (1024, 131072), requests: int = 256,
               world: int = 8, repeats: int = 3) -> dict[str, Any]:
    from .rig import tiny_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(os.path.join(tmp, "model"), num_kv_heads=world)
        for context in contexts:
            # Rounds alternate the connectors so machine noise hits all alike;
            # the median round per connector is reported.
            runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in VARIANTS}
            for _ in range(repeats):
                for kind in VARIANTS:
                    runs[kind].append(measure(kind, model_dir, context, requests, world))
            for kind in VARIANTS:
                ordered = sorted(runs[kind], key=lambda r: r["us_per_request_step"])
                rows.append(ordered[len(ordered) // 2])
    return {"rows": rows, "repeats": repeats}


def format_vllm(report: dict[str, Any]) -> str:
    rows = report["rows"]
    out = ["connector cost inside vLLM's Scheduler (build_connector_meta + "
           "update_connector_output), per request-step",
           f"{'connector':<18}{'context':>9}{'reqs':>6}{'us/req-step':>13}{'meta B/job':>12}"]
    cell: dict[tuple[str, int], float] = {}
    for r in rows:
        cell[(r["kind"], r["context"])] = r["us_per_request_step"]
        out.append(f"{r['kind']:<18}{r['context']:>9}{r['requests']:>6}"
                   f"{r['us_per_request_step']:>13.2f}{r['meta_bytes_per_job']:>12.0f}")
    contexts = sorted({r["context"] for r in rows})
    if len(contexts) >= 2:
        lo, hi = contexts[0], contexts[-1]
        for kind in VARIANTS:
            out.append(f"{kind}: {hi}/{lo} context = {cell[(kind, hi)] / cell[(kind, lo)]:.2f}x")
        out.append(f"upstream/kvstate at {hi}: {cell[('upstream', hi)] / cell[('kvstate', hi)]:.1f}x")
    run_cpu = {(r["kind"], r["context"]): r["run_cpu_s"] for r in rows}
    for context in contexts:
        out.append(f"observer on upstream at {context}: "
                   f"{cell[('upstream+observer', context)] / cell[('upstream', context)]:.2f}x "
                   "inside the connector calls, "
                   f"{run_cpu[('upstream+observer', context)] / run_cpu[('upstream', context)]:.2f}x"
                   " process CPU for the whole run (the trace writer's thread included)")
        out.append(f"monitor on/off at {context}: "
                   f"{cell[('kvstate+monitor', context)] / cell[('kvstate', context)]:.2f}x")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.bench")
    parser.add_argument("--context", type=int, action="append")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = bench_vllm(tuple(args.context or (1024, 131072)), args.requests, args.world_size,
                        args.repeats)
    print(json.dumps(report) if args.json else format_vllm(report), flush=True)
    # Upstream's scheduler holds a ZMQ socket whose context blocks interpreter
    # exit (its lookup client): leave without running finalisers.
    os._exit(0)


if __name__ == "__main__":
    main()
