"""Each rank in its own process, with its own Mooncake client and KV caches.

In vLLM every tensor-parallel rank is a separate worker process with its own
store client (its own transfer engine and its own segment mounted at the
master) and its own paged KV caches. ``RankProcesses`` starts one such process
per rank (``spawn``: no Mooncake state is inherited) and gives the engine model
the store interface by sending each store call to the rank's process over a
pipe. The forward pass is broadcast: every write of an engine block is sent to
every rank process, which fills its own shard of the block from the content
tag. Pipes keep order, so a block's fill always precedes a put that reads it.

What stays in the driver process is the bookkeeping — the planner and the
rank executors of `kvstate.harness` — which decides each call; the bytes, the
clients and the transfers are the ranks'. At the end each rank process reads
back every key it stored into a fresh block of its own cache and compares.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

import attrs

from adapters.mooncake import MooncakeConfig
from kvstate.memory_store import StoreRaised


class RankProcessError(RuntimeError):
    """A rank process died or did not answer in time."""


@attrs.frozen
class RankSpec:
    rank: int
    put_step: int
    groups: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    timeout: float
    mooncake: dict[str, Any]


def _serve(conn: Any, spec: RankSpec) -> None:
    """The rank process: one client, one cache, calls answered in order."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from adapters.mooncake import MooncakeStore
    from adapters.runner import RealStore, registered, verify
    from adapters.torch_kv import PagedKV

    store = MooncakeStore(MooncakeConfig(**spec.mooncake), timeout=spec.timeout,
                          setup_timeout=max(10.0, 3 * spec.timeout))
    kv = PagedKV(1, spec.groups, spec.num_blocks, spec.block_size, heads=spec.heads,
                 head_dim=spec.head_dim, put_step=spec.put_step, first_rank=spec.rank)
    try:
        with registered(store, kv.tensors()):
            real = RealStore(store, kv)
            conn.send(("ready", os.getpid()))
            while True:
                op, *args = conn.recv()
                if op == "fill":  # no answer: the pipe's order is enough
                    kv.fill(*args)
                    continue
                if op == "close":
                    conn.send(("ok", None))
                    return
                try:
                    if op == "exists":
                        out: Any = real.exists(0, args[0])
                    elif op == "put":
                        out = real.put_many(0, *args)
                    elif op == "load":
                        out = real.load(0, *args)
                    elif op == "verify":
                        out = verify(store, kv, real.written)
                    elif op == "stats":
                        out = {**real.totals(), "pid": os.getpid()}
                    else:
                        raise ValueError(f"unknown rank-process operation {op!r}")
                    conn.send(("ok", out))
                except StoreRaised as exc:
                    conn.send(("raised", str(exc)))
    finally:
        store.close()


class RankProcesses:
    """The harness's store interface, served by one process per rank."""

    def __init__(self, mooncake: MooncakeConfig, world_size: int, put_step: int, groups: int,
                 num_blocks: int, block_size: int, heads: int = 2, head_dim: int = 16,
                 timeout: float = 5.0, start_timeout: float = 60.0) -> None:
        self.timeout = timeout
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        fields = attrs.asdict(mooncake)
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                spec = RankSpec(rank, put_step, groups, num_blocks, block_size, heads,
                                head_dim, timeout, fields)
                proc = ctx.Process(target=_serve, args=(child, spec), daemon=True,
                                   name=f"kvstate-rank{rank}")
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            for rank in range(world_size):
                self._answer(rank, start_timeout)  # "ready" and the pid
        except BaseException:
            self.close()
            raise

    def _answer(self, rank: int, timeout: float | None = None) -> Any:
        conn = self.conns[rank]
        # A store call is bounded by the rank's own timeout; allow for the pipe.
        if not conn.poll(timeout if timeout is not None else 3 * self.timeout + 5):
            raise RankProcessError(f"rank {rank} process (pid {self.procs[rank].pid}) did not "
                                   "answer in time")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RankProcessError(f"rank {rank} process exited (code "
                                   f"{self.procs[rank].exitcode})") from None
        if kind == "raised":
            raise StoreRaised(value)
        return value

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        try:
            self.conns[rank].send(message)
        except OSError:  # a broken pipe: the process is gone
            self.procs[rank].join(1)
            raise RankProcessError(f"rank {rank} process exited (code "
                                   f"{self.procs[rank].exitcode})") from None

    def _call(self, rank: int, *message: Any) -> Any:
        self._send(rank, message)
        return self._answer(rank)

    # The harness's store interface ------------------------------------

    def exists(self, rank: int, keys: Sequence[str]) -> list[bool]:
        return list(self._call(rank, "exists", list(keys)))

    def put_many(self, rank: int, keys: Sequence[str], groups: Sequence[int],
                 blocks: Sequence[int], contents: Sequence[str]) -> list[tuple[int, bool]]:
        return list(self._call(rank, "put", list(keys), list(groups), list(blocks),
                               list(contents)))

    def load(self, rank: int, key: str, group: int, block: int) -> str | None:
        got: str | None = self._call(rank, "load", key, group, block)
        return got

    def evict(self, key: str) -> bool:
        return False  # the real master evicts on its own, silently

    def fill(self, block: int, digest_hex: str) -> None:
        """The forward pass: every rank's shard of ``block`` gets its bytes."""
        for rank in range(len(self.conns)):
            self._send(rank, ("fill", block, digest_hex))

    # ------------------------------------------------------------------

    def verify(self) -> tuple[int, int, list[str]]:
        checked = missing = 0
        wrong: list[str] = []
        for rank in range(len(self.conns)):
            c, m, w = self._call(rank, "verify")
            checked, missing = checked + c, missing + m
            wrong += w
        return checked, missing, wrong

    def stats(self) -> list[dict[str, Any]]:
        return [self._call(rank, "stats") for rank in range(len(self.conns))]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("close",))
                conn.poll(10) and conn.recv()
            except (OSError, EOFError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.conns, self.procs = [], []
