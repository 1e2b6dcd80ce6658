"""Benchmarks of the core's bookkeeping (issue: protocol core, item 9).

What is timed: for R running decode requests (default 256) on W ranks
(default 8) with block size 16, the planner's ``step`` and ``on_reports`` plus
every rank's ``receive``/``start``/``exists_answered``/``put_answered`` — all
the connector bookkeeping of a decode step, with no store I/O (the store's
answers are canned: every new chunk missing, every put ok). Engine inputs
(``SchedulerStep`` records) are built before the clock starts. Requests are
staggered so their block boundaries spread over the 16-step cycle, and the
window is a whole number of cycles, so save steps and completions are averaged
in exactly as often as they happen.

Reported per request-step: the planner alone, the planner plus one rank (the
critical path: ranks run in their own processes in production) and the
planner plus all ranks (total CPU). Every figure is measured for ``kvstate``
and for ``e2`` (upstream as shipped) in the same run, at 1k and at 128k tokens
of context, and printed as ratios — never compared against a fixed time.

Also measured: pickled metadata bytes per save job, and existence-check keys
per decode save, including the first job after a failed put (a failed decode
chunk, and a failed chunk in the middle of the prompt's first save).
"""

from __future__ import annotations

import gc
import pickle
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvstate.config import ConnectorConfig
from kvstate.executor import Executor
from kvstate.planner import Planner
from kvstate.records import CachedRequest, ExistsCall, NewRequest, PutCall, Report, SchedulerStep
from kvstate.variants import get_variant


def _digest(i: int) -> bytes:
    return i.to_bytes(16, "little")


class _Workload:
    """R decoding requests of ``context`` tokens each, already saved once."""

    def __init__(self, protocol: str, context: int, requests: int, world: int, block: int):
        self.config = ConnectorConfig(block_size=block, world_size=world, save_decode_cache=True)
        variant = get_variant(protocol)
        self.planner = Planner(self.config, variant)
        self.ranks = [Executor(self.config, r, variant) for r in range(world)]
        self.block = block
        self.requests = requests
        self.next_block = 1
        self.next_hash = 1
        self.computed: list[int] = []
        self.pending: list[Report] = []
        self.fail_next: set[tuple[int, str]] = set()
        self.t_planner = 0.0
        self.t_ranks = [0.0] * world
        self.exists_keys: list[int] = []
        self.meta_bytes: list[int] = []
        if requests == 0:
            self.computed = []
            return
        new = []
        for r in range(requests):
            # Stagger: request r starts r % block tokens past a boundary.
            n = context + (r % block)
            blocks = -(-n // block)
            ids = tuple(range(self.next_block, self.next_block + blocks))
            self.next_block += blocks
            hashes = tuple(_digest(self.next_hash + i) for i in range(n // block))
            self.next_hash += n // block
            new.append(NewRequest(f"req-{r}", tuple(range(n)), 0, n, (ids,), hashes))
            self.computed.append(n)
        self.apply(SchedulerStep(new=tuple(new)), record=False)
        self.drain()

    def decode_steps(self, steps: int) -> list[SchedulerStep]:
        """Engine inputs for ``steps`` decode steps (built before timing)."""
        out = []
        block = self.block
        for _ in range(steps):
            cached = []
            for r in range(self.requests):
                n = self.computed[r]
                new_ids: tuple[int, ...] = ()
                new_hashes: tuple[bytes, ...] = ()
                if n % block == 0:
                    new_ids = (self.next_block,)
                    self.next_block += 1
                if (n + 1) % block == 0:
                    new_hashes = (_digest(self.next_hash),)
                    self.next_hash += 1
                cached.append(CachedRequest(f"req-{r}", n, (n % 50000,), (new_ids,), new_hashes))
                self.computed[r] = n + 1
            out.append(SchedulerStep(cached=tuple(cached)))
        return out

    def apply(self, step: SchedulerStep, record: bool) -> None:
        """One step: reports in, plan out, every rank runs its jobs. The planner's
        and each rank's share are timed separately (``t_planner``, ``t_ranks``)."""
        clock = time.perf_counter
        planner = self.planner
        t0 = clock()
        if self.pending:
            planner.on_reports(self.pending)
            self.pending = []
        plan = planner.step(step)
        self.t_planner += clock() - t0
        if record:
            for meta in plan.saves:
                self.meta_bytes.append(len(pickle.dumps(meta, protocol=5)))
        for index, executor in enumerate(self.ranks):
            t0 = clock()
            reports = self._run_rank(index, executor, plan, record)
            self.t_ranks[index] += clock() - t0
            self.pending.extend(reports)

    def _run_rank(self, index: int, executor: Executor, plan: Any, record: bool) -> list[Report]:
        reports: list[Report] = []
        executor.receive(plan)
        job = executor.dequeue()
        while job is not None:
            out = executor.start(job)
            if isinstance(out, ExistsCall):
                if record:
                    self.exists_keys.append(len(out.keys))
                out = executor.exists_answered(job, (False,) * len(out.keys))
            if isinstance(out, PutCall):
                codes = [0] * len(out.keys)
                if (index, job.meta.req_id) in self.fail_next:
                    self.fail_next.discard((index, job.meta.req_id))
                    codes[len(codes) // 2] = -800
                out = executor.put_answered(job, codes)
            reports.append(out)
            job = executor.dequeue()
        return reports

    def drain(self) -> None:
        if self.pending:
            t0 = time.perf_counter()
            self.planner.on_reports(self.pending)
            self.t_planner += time.perf_counter() - t0
            self.pending = []

    def reset_timers(self) -> None:
        self.t_planner = 0.0
        self.t_ranks = [0.0] * len(self.ranks)


def bench_core(
    protocols: Sequence[str] = ("kvstate", "e2"),
    contexts: Sequence[int] = (1024, 131072),
    requests: int = 256,
    world: int = 8,
    block: int = 16,
    cycles: int = 2,
    repeats: int = 3,
) -> dict[str, Any]:
    """Run the benchmark; return figures per protocol and context."""
    results: dict[str, Any] = {}
    steps_per_run = cycles * block
    for protocol in protocols:
        for context in contexts:
            work = _Workload(protocol, context, requests, world, block)
            # Warm-up cycle, untimed: the setup built every list at its exact size,
            # so the first append copies it once (8 µs at 128k); steady state
            # appends into CPython's over-allocation, amortised O(1).
            for step in work.decode_steps(block):
                work.apply(step, record=False)
            work.drain()
            figures: dict[str, list[float]] = {"planner": [], "one_rank": [], "all_ranks": []}
            for _ in range(repeats):
                steps = work.decode_steps(steps_per_run)
                work.drain()
                work.reset_timers()
                gc.collect()
                gc.disable()
                try:
                    for step in steps:
                        work.apply(step, record=False)
                    work.drain()
                finally:
                    gc.enable()
                scale = 1e6 / (steps_per_run * requests)
                figures["planner"].append(work.t_planner * scale)
                figures["one_rank"].append(
                    (work.t_planner + statistics.mean(work.t_ranks)) * scale)
                figures["all_ranks"].append((work.t_planner + sum(work.t_ranks)) * scale)
            # Metadata and existence-check keys, one more recorded window.
            work.meta_bytes.clear()
            work.exists_keys.clear()
            for step in work.decode_steps(steps_per_run):
                work.apply(step, record=True)
            work.drain()
            results[f"{protocol}@{context}"] = {
                "protocol": protocol,
                "context": context,
                "requests": requests,
                "world_size": world,
                "block_size": block,
                "us_per_request_step": {k: statistics.median(v) for k, v in figures.items()},
                "metadata_bytes_per_job": statistics.mean(work.meta_bytes),
                "exists_keys_per_decode_save": statistics.mean(work.exists_keys),
                "new_chunks_per_decode_save": 1,
                "exists_keys_first_job_after_failed_decode_put": _keys_after_failure(
                    protocol, context, block, fail_prompt=False),
                "exists_keys_first_job_after_failed_prompt_put": _keys_after_failure(
                    protocol, context, block, fail_prompt=True),
                "prompt_chunks": context // block,
            }
            del work
            gc.collect()
    return results


def _keys_after_failure(protocol: str, context: int, block: int, fail_prompt: bool) -> float:
    """One request on one rank. A put fails — one chunk in the middle of the
    prompt's first save, or the single chunk of a decode save — and we count
    the keys the *next* job checks (the rescan upstream pays at 128k)."""
    work = _Workload(protocol, context, 1, 1, block) if not fail_prompt else None
    if work is None:
        work = _Workload.__new__(_Workload)
        _Workload.__init__(work, protocol, 0, 0, 1, block)  # empty, then add the request
        n = context
        ids = tuple(range(1, n // block + 2))
        hashes = tuple(_digest(1 + i) for i in range(n // block))
        work.requests = 1
        work.next_block, work.next_hash, work.computed = len(ids) + 1, len(hashes) + 1, [n]
        work.fail_next.add((0, "req-0"))
        work.apply(SchedulerStep(new=(NewRequest("req-0", tuple(range(n)), 0, n, (ids,),
                                                 hashes),)), record=True)
    else:
        work.fail_next.add((0, "req-0"))
    work.exists_keys.clear() if not fail_prompt else None
    for step in work.decode_steps(3 * block):
        work.apply(step, record=True)
    work.drain()
    # exists_keys[0] is the failing job; [1] the first job after it.
    return float(work.exists_keys[1])


def format_report(results: dict[str, Any]) -> str:
    rows = [["protocol", "context", "planner us", "+1 rank us", "+8 ranks us",
             "meta bytes/job", "keys/decode save", "after failed decode", "after failed prompt"]]
    for r in results.values():
        t = r["us_per_request_step"]
        rows.append([
            r["protocol"], str(r["context"]), f"{t['planner']:.2f}", f"{t['one_rank']:.2f}",
            f"{t['all_ranks']:.2f}", f"{r['metadata_bytes_per_job']:.0f}",
            f"{r['exists_keys_per_decode_save']:.2f}",
            f"{r['exists_keys_first_job_after_failed_decode_put']:.0f}",
            f"{r['exists_keys_first_job_after_failed_prompt_put']:.0f}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    ratios = ratio_lines(results)
    return "\n".join(lines + [""] + ratios)


def ratio_lines(results: dict[str, Any]) -> list[str]:
    out = []
    contexts = sorted({r["context"] for r in results.values()})
    protocols = list(dict.fromkeys(r["protocol"] for r in results.values()))
    if len(contexts) >= 2:
        lo, hi = contexts[0], contexts[-1]
        for p in protocols:
            a, b = results.get(f"{p}@{lo}"), results.get(f"{p}@{hi}")
            if a and b:
                t = b["us_per_request_step"]["one_rank"] / a["us_per_request_step"]["one_rank"]
                m = b["metadata_bytes_per_job"] / a["metadata_bytes_per_job"]
                out.append(f"{p}: {hi}/{lo} ratio  time (planner+1 rank) {t:.2f}x  "
                           f"metadata bytes {m:.2f}x")
    if "kvstate" in protocols and "e2" in protocols:
        for c in contexts:
            a, b = results.get(f"kvstate@{c}"), results.get(f"e2@{c}")
            if a and b:
                t = b["us_per_request_step"]["one_rank"] / a["us_per_request_step"]["one_rank"]
                m = b["metadata_bytes_per_job"] / a["metadata_bytes_per_job"]
                out.append(f"e2/kvstate at {c} tokens: time {t:.1f}x  metadata {m:.1f}x")
    return out
