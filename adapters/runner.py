"""The core against a real Mooncake store and real KV bytes.

``RealStore`` gives the engine model (`kvstate.harness.Harness`) the store
interface it drives — existence checks, batched puts, loads into blocks —
performed as real ``MooncakeDistributedStore`` calls on the registered torch
KV caches. ``run_real`` pushes a workload through it and then verifies, with
bytes: every key the run stored is read back into fresh blocks and must equal
the pattern its key names (prefix hash, rank namespace, group), and every load
the engine did is checked the same way when it happens.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from adapters.mooncake import MooncakeStore, code_name
from adapters.torch_kv import PagedKV
from kvstate.blockhash import VLLM_SHA256
from kvstate.config import ConnectorConfig
from kvstate.harness import Harness
from kvstate.keys import StoreKey, parse_key
from kvstate.memory_store import StoreRaised
from kvstate.observations import ExistsAnswered, JobStarted, Planned


@contextmanager
def registered(store: MooncakeStore, tensors: Iterable[Any]) -> Iterator[None]:
    """Register tensors' memory with the store for the block's duration."""
    done: list[int] = []
    try:
        for tensor in tensors:
            ptr = tensor.data_ptr()
            store.register(ptr, tensor.numel() * tensor.element_size())
            done.append(ptr)
        yield
    finally:
        for ptr in done:
            try:
                store.unregister(ptr)
            except TimeoutError:
                break  # the store is broken; nothing more to release


def key_fields(key: str) -> StoreKey:
    """(digest hex, namespace, group) of a key kvstate wrote."""
    fields = parse_key(key)
    if fields is None:
        raise ValueError(f"not a kvstate store key: {key!r}")
    return fields


class RealStore:
    """The harness's store interface over Mooncake and the torch caches."""

    def __init__(self, store: MooncakeStore, kv: PagedKV) -> None:
        self.store = store
        self.kv = kv
        self.written: set[str] = set()
        self.puts = 0
        self.put_bytes = 0
        self.exists_calls = 0
        self.exists_keys = 0
        self.dedup_hits = 0
        self.loads = 0
        self.load_bytes = 0
        self.load_mismatches = 0
        self.errors: dict[str, int] = {}

    def _error(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1

    def exists(self, rank: int, keys: Sequence[str]) -> list[bool]:
        self.exists_calls += 1
        self.exists_keys += len(keys)
        try:
            present = self.store.exists(keys)
        except (ConnectionError, TimeoutError) as exc:
            self._error(type(exc).__name__)
            raise StoreRaised(str(exc)) from None
        self.dedup_hits += sum(present)
        return present

    def put_many(self, rank: int, keys: Sequence[str], groups: Sequence[int],
                 blocks: Sequence[int], contents: Sequence[str]) -> list[tuple[int, bool]]:
        ptrs, sizes = [], []
        for group, block in zip(groups, blocks):
            p, s = self.kv.buffers(rank, group, block)
            ptrs.append(p)
            sizes.append(s)
        try:
            codes = self.store.put(list(keys), ptrs, sizes)
        except TimeoutError as exc:
            self._error("TimeoutError")
            raise StoreRaised(str(exc)) from None
        out = []
        for key, code, size in zip(keys, codes, sizes):
            if code == 0:
                self.puts += 1
                self.put_bytes += sum(size)
                self.written.add(key)
            else:
                self._error(code_name(code))
            out.append((code, code == 0))
        return out

    def load(self, rank: int, key: str, group: int, block: int) -> str | None:
        ptrs, sizes = self.kv.buffers(rank, group, block)
        try:
            (got,) = self.store.get([key], [ptrs], [sizes])
        except TimeoutError:
            self._error("TimeoutError")
            return None
        if got < 0:
            self._error(code_name(got))
            return None
        self.loads += 1
        self.load_bytes += got
        digest, ns, g = key_fields(key)
        if not self.kv.matches(rank, group, block, digest, ns):
            self.load_mismatches += 1
            return None
        return digest

    def evict(self, key: str) -> bool:
        return False  # the real master evicts on its own, silently

    def totals(self) -> dict[str, Any]:
        return {"puts": self.puts, "put_bytes": self.put_bytes,
                "exists_calls": self.exists_calls, "exists_keys": self.exists_keys,
                "dedup_hits": self.dedup_hits, "loads": self.loads,
                "load_bytes": self.load_bytes, "load_mismatches": self.load_mismatches,
                "keys_written": len(self.written), "errors": dict(self.errors)}


class SaveCounter:
    """Existence checks split by the kind of save that made them, from the
    harness's observations: a job is a decode save when its plan said so."""

    def __init__(self) -> None:
        self.decode_jobs: set[int] = set()
        self.rank_jobs = {"decode": 0, "prompt": 0}  # (job, rank) pairs started
        self.exists_calls = {"decode": 0, "prompt": 0}
        self.exists_keys = {"decode": 0, "prompt": 0}

    def __call__(self, obs: Any) -> None:
        kind = type(obs)
        if kind is Planned:
            for meta in obs.plan.saves:
                if meta.is_decode:
                    self.decode_jobs.add(meta.job_id)
        elif kind is JobStarted:
            self.rank_jobs["decode" if obs.job_id in self.decode_jobs else "prompt"] += 1
        elif kind is ExistsAnswered:
            which = "decode" if obs.job_id in self.decode_jobs else "prompt"
            self.exists_calls[which] += 1
            self.exists_keys[which] += len(obs.keys)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for which in ("decode", "prompt"):
            saves = self.rank_jobs[which]
            out[f"{which}_saves_per_rank"] = saves
            out[f"exists_calls_per_{which}_save"] = round(
                self.exists_calls[which] / saves, 3) if saves else None
            out[f"exists_keys_per_{which}_save"] = round(
                self.exists_keys[which] / saves, 3) if saves else None
        return out


@attrs.define
class RealResult:
    ok: bool
    violations: list[dict[str, Any]]
    figures: dict[str, Any]


def verify(store: MooncakeStore, kv: PagedKV, keys: Iterable[str], scratch_rank: int = 0
           ) -> tuple[int, int, list[str]]:
    """Read every key into a fresh block of ``kv`` (block 0 of the scratch rank,
    reused) and compare with the bytes its key names: (checked, missing, wrong)."""
    checked = missing = 0
    wrong: list[str] = []
    for key in sorted(keys):
        digest, ns, group = key_fields(key)
        ptrs, sizes = kv.buffers(scratch_rank, group, 0)
        for layer in range(kv.layers):
            kv.block_view(scratch_rank, group, 0, layer).zero_()
        (got,) = store.get([key], [ptrs], [sizes])
        if got < 0:
            missing += 1  # evicted since: not wrong, just gone
            continue
        checked += 1
        if not kv.matches(scratch_rank, group, 0, digest, ns):
            wrong.append(key)
    return checked, missing, wrong


def _drive(harness: Harness, arrivals: Sequence[tuple[str, Sequence[int], int]],
           steps_per_arrival: int) -> float:
    """Admit each arrival (waiting while its id is still running), step the
    engine and let every rank work; settle. Returns the wall seconds."""
    started = time.perf_counter()
    pending = list(arrivals)
    while pending:
        req_id, prompt, max_new = pending.pop(0)
        if req_id in harness.requests:
            pending.append((req_id, prompt, max_new))
        else:
            harness.add(req_id, prompt, max_new, lookup=True)
        for _ in range(steps_per_arrival):
            harness.step()
            harness.run_ranks()
    harness.settle(max_steps=2000)
    return time.perf_counter() - started


def _result(harness: Harness, arrivals: Sequence[Any], totals: dict[str, Any],
            verified: tuple[int, int, list[str]], seconds: float,
            extra: dict[str, Any] | None = None) -> RealResult:
    checked, missing, wrong = verified
    violations = [{"invariant": f.invariant, "event_index": f.event_index, "message": f.message}
                  for f in harness.monitor.findings]
    violations += [{"invariant": "K1", "event_index": -1,
                    "message": f"{key} holds bytes of another prefix"} for key in wrong]
    if totals["load_mismatches"]:
        violations.append({"invariant": "K1", "event_index": -1, "message":
                           f"{totals['load_mismatches']} loads read bytes of another prefix"})
    moved = totals["put_bytes"] + totals["load_bytes"]
    figures = {
        "requests": len(arrivals),
        **{k: totals[k] for k in ("puts", "put_bytes", "exists_calls", "exists_keys",
                                  "dedup_hits", "loads", "load_bytes", "keys_written")},
        "verified_keys": checked,
        "missing_at_verify": missing,
        "wrong_keys": len(wrong),
        "store_errors": totals["errors"],
        "seconds": round(seconds, 3),
        "bytes_per_second": round(moved / seconds) if seconds else 0,
        **(extra or {}),
    }
    return RealResult(not violations, violations, figures)


def _harness(config: ConnectorConfig, variant: str, num_blocks: int, store: Any,
             fill: Any, block_hash: str) -> tuple[Harness, SaveCounter]:
    """The engine model over a real store; ``fill`` writes a block's bytes;
    ``block_hash`` names the blocks (vLLM's sha256 by default: a store filled
    here serves a vLLM engine with the same model and prefix)."""
    saves = SaveCounter()
    harness = Harness(config, variant, num_blocks=num_blocks, store=store, token_budget=64,
                      record=False, keep_finished=False, auto_preempt=True, sink=saves,
                      block_hash=block_hash)
    harness.pool.on_write = fill
    return harness, saves


def run_real(
    store: MooncakeStore,
    arrivals: Sequence[tuple[str, Sequence[int], int]],
    config: ConnectorConfig,
    variant: str = "kvstate",
    num_blocks: int = 128,
    steps_per_arrival: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    device: str = "cpu",
    block_hash: str = VLLM_SHA256,
) -> RealResult:
    """Drive ``arrivals`` (req id, prompt, max new tokens) through the core with
    the real store, all ranks in this process, then verify every stored key
    byte for byte."""
    kv = PagedKV(config.world_size, len(config.groups), num_blocks, config.block_size,
                 heads=heads, head_dim=head_dim, device=device, put_step=config.put_step)
    with registered(store, kv.tensors()):
        real = RealStore(store, kv)
        harness, saves = _harness(config, variant, num_blocks, real, kv.fill, block_hash)
        seconds = _drive(harness, arrivals, steps_per_arrival)
        verified = verify(store, kv, real.written)
    return _result(harness, arrivals, real.totals(), verified, seconds,
                   {**saves.figures(), "block_hash": block_hash})


def run_real_processes(
    mooncake: Any,
    arrivals: Sequence[tuple[str, Sequence[int], int]],
    config: ConnectorConfig,
    variant: str = "kvstate",
    num_blocks: int = 128,
    steps_per_arrival: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    timeout: float = 5.0,
    block_hash: str = VLLM_SHA256,
) -> RealResult:
    """``run_real`` with every rank in its own process, with its own Mooncake
    client (``mooncake``: the `MooncakeConfig` each rank connects with) and its
    own KV caches (`adapters.rank_process`)."""
    from adapters.rank_process import RankProcesses

    ranks = RankProcesses(mooncake, config.world_size, config.put_step, len(config.groups),
                          num_blocks, config.block_size, heads=heads, head_dim=head_dim,
                          timeout=timeout)
    try:
        harness, saves = _harness(config, variant, num_blocks, ranks, ranks.fill, block_hash)
        seconds = _drive(harness, arrivals, steps_per_arrival)
        verified = ranks.verify()
        per_rank = ranks.stats()
    finally:
        ranks.close()
    totals: dict[str, Any] = {"errors": {}}
    for stats in per_rank:
        for key, value in stats.items():
            if key == "errors":
                for name, n in value.items():
                    totals["errors"][name] = totals["errors"].get(name, 0) + n
            elif key != "pid":
                totals[key] = totals.get(key, 0) + value
    extra = {**saves.figures(), "block_hash": block_hash,
             "rank_pids": [s["pid"] for s in per_rank],
             "puts_per_rank": [s["puts"] for s in per_rank]}
    return _result(harness, arrivals, totals, verified, seconds, extra)


def workload_arrivals(kind: str, requests: int, seed: int, scale: int = 64,
                      fast25_path: str = "") -> list[tuple[str, Sequence[int], int]]:
    """Arrivals for the real runner from the workloads the simulator runs too
    (`kvstate.workloads`: below both, so the adapters need nothing of `sim`)."""
    import random
    from pathlib import Path

    from kvstate.workloads import DEFAULT_FAST25, fast25, synthetic

    if kind == "synthetic":
        feed = synthetic(random.Random(seed), requests=requests, prompt_tokens=(16, 96),
                         output_tokens=(2, 12))
    else:
        feed = fast25(Path(fast25_path) if fast25_path else DEFAULT_FAST25, scale=scale,
                      limit=requests)
    return [(a.req_id, a.prompt, min(a.max_new_tokens, 16)) for a in feed]


def bench_adapter(store: MooncakeStore, sizes: Sequence[int] = (16 << 10, 256 << 10, 4 << 20),
                  bytes_per_batch: int = 8 << 20, repeats: int = 11) -> dict[str, Any]:
    """Put and get bytes/second through ``MooncakeStore`` (the adapter, with its
    bounded calls) against the raw ``MooncakeDistributedStore`` calls on the same
    registered buffers, in the same run. Every round stores fresh keys (a put
    of a present key moves nothing): ``(repeats + 1) * 2 * bytes_per_batch``
    per size must fit the segment (576 MiB with the defaults)."""
    import torch

    raw = store._store  # the wrapped client: the baseline
    out: dict[str, Any] = {}
    for size in sizes:
        keys_per_size = max(2, bytes_per_batch // size)
        buf = torch.randint(0, 256, (keys_per_size * size,), dtype=torch.uint8)
        out[f"{size // 1024}KiB"] = _bench_size(store, raw, buf, size, keys_per_size, repeats)
    return out


def _bench_size(store: MooncakeStore, raw: Any, buf: Any, size: int, keys_per_size: int,
                repeats: int) -> dict[str, Any]:
    import statistics
    import uuid

    with registered(store, [buf]):
        ptrs = [[buf.data_ptr() + i * size] for i in range(keys_per_size)]
        lens = [[size]] * keys_per_size
        rates: dict[str, list[float]] = {"adapter_put": [], "raw_put": [], "adapter_get": [],
                                         "raw_get": []}
        calls = {"adapter": (store.put, store.get),
                 "raw": (raw.batch_put_from_multi_buffers, raw.batch_get_into_multi_buffers)}
        for repeat in range(-1, repeats):  # round -1 warms both paths up, unmeasured
            # Alternate who goes first, so neither gains from the other's warm-up.
            for who in (("adapter", "raw") if repeat % 2 == 0 else ("raw", "adapter")):
                put, get = calls[who]
                keys = [f"bench-{uuid.uuid4().hex}-{i}" for i in range(keys_per_size)]
                started = time.perf_counter()
                codes = put(keys, ptrs, lens)
                put_s = time.perf_counter() - started
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"bench put failed: {set(codes)}")
                started = time.perf_counter()
                got = get(keys, ptrs, lens)
                get_s = time.perf_counter() - started
                if any(g < 0 for g in got):
                    raise RuntimeError(f"bench get failed: {set(got)}")
                total = size * keys_per_size
                if repeat < 0:
                    continue
                rates[f"{who}_put"].append(total / put_s)
                rates[f"{who}_get"].append(total / get_s)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        **{k: round(v) for k, v in med.items()},
        "put_ratio": round(med["adapter_put"] / med["raw_put"], 3),
        "get_ratio": round(med["adapter_get"] / med["raw_get"], 3),
    }
