"""Upstream's connector under the observer, on vLLM 0.33.0's real Scheduler.

Each scenario runs one engine (`adapters.vllm.rig.Rig`: the real scheduler,
the worker connectors, a fake forward pass) with
``ObservedMooncakeStoreConnector`` against a real ``mooncake_master``, writes
the observer's trace and returns what the online monitor found. The tests
(`tests/test_observer.py`) then judge each trace with ``kvstate check``: a
clean run must check clean, and each upstream hazard of
`specs/conformance.md` must be found from upstream's own trace, as the
invariant it breaks.

- ``clean``: requests with a shared prefix, chunked prefill, decode saves,
  KV events, preemption (few blocks), an id reused after its request ended;
  then a second engine on the same store serves the same prompts (lookups,
  asynchronous loads).
- ``no-space`` (H3): the store answers one put of one request -200
  (``NO_AVAILABLE_HANDLE``); the other requests' jobs only find their keys
  present, so upstream's pressure flag never clears and the request's
  later jobs are skipped: K6.
- ``reused-id`` (H2): a request finishes while its first save job is parked
  in the store (a put that blocks until released), its id is reused, then
  the put returns: the old job writes the reused id's saved offset and the
  new generation's job starts there: S10 (and S12).
- ``short-read`` (H6): a second engine's get of one block reads half the
  bytes; upstream takes the block for loaded: S19.

``python -m adapters.vllm.observer_runs --master HOST:PORT --out DIR
[--scenario NAME ...]`` prints one JSON object per scenario and leaves with
``os._exit`` (upstream's worker leaves non-daemon threads behind).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

BLOCK = 16


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


def block_hash(tokens: list[int], block: int) -> str:
    """The engine's hash of block ``block`` of a prompt, as store keys end."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    probe = Request("probe", tokens, SamplingParams(max_tokens=1), None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256))
    return bytes(probe.block_hashes[block]).hex()


class StoreFaults:
    """Faults in the Mooncake binding itself (so upstream's own code meets
    them): puts of chosen block hashes answered a code, a put that parks
    until ``release``, gets of chosen hashes that read half the bytes."""

    def __init__(self) -> None:
        self.put_codes: dict[str, list[int]] = {}  # hash hex -> [code, times left]
        self.park: set[str] = set()
        self.parked = threading.Event()
        self.go = threading.Event()
        self.short: set[str] = set()

    @staticmethod
    def _hash(key: str) -> str:
        return key.rsplit("@", 1)[-1]

    @contextmanager
    def installed(self) -> Iterator[None]:
        from mooncake.store import MooncakeDistributedStore as Binding

        real_put = Binding.batch_put_from_multi_buffers
        real_get = Binding.batch_get_into_multi_buffers
        faults = self

        def put(store: Any, keys: list[str], ptrs: Any, sizes: Any, *args: Any) -> Any:
            if any(self._hash(k) in faults.park for k in keys):
                faults.park.clear()
                faults.parked.set()
                faults.go.wait(30)
            codes = real_put(store, keys, ptrs, sizes, *args)
            out = []
            for key, code in zip(keys, codes):
                entry = faults.put_codes.get(self._hash(key))
                if entry is not None and entry[1] > 0:
                    entry[1] -= 1
                    store.remove(key, True)  # the store kept nothing
                    code = entry[0]
                out.append(code)
            return out

        def get(store: Any, keys: list[str], ptrs: Any, sizes: Any, *args: Any) -> Any:
            answers = real_get(store, keys, ptrs, sizes, *args)
            out = []
            for i, (key, value) in enumerate(zip(keys, answers)):
                if self._hash(key) in faults.short and value > 0:
                    size = sizes[i][-1]
                    ctypes.memset(ptrs[i][-1] + size // 2, 0, size - size // 2)
                    value -= size - size // 2
                out.append(value)
            return out

        Binding.batch_put_from_multi_buffers = put
        Binding.batch_get_into_multi_buffers = get
        try:
            yield
        finally:
            Binding.batch_put_from_multi_buffers = real_put
            Binding.batch_get_into_multi_buffers = real_get


# Upstream's lookup server binds an IPC path named after ``lookup_rpc_port``
# in a directory every process shares (``VLLM_RPC_BASE_PATH``): a second
# process with the same number unlinks the first's socket. Numbers start
# from this process's id, so concurrent runs never meet.
_LOOKUP_PORT = os.getpid() * 64
_KEPT: list[Any] = []


def observed_engine(model_dir: str, trace: str, prefix: str, *, num_blocks: int = 64,
                    max_num_batched_tokens: int = 256, monitor: str = "log",
                    lookup_async: bool = False) -> Any:
    from .rig import Rig, make_vllm_config

    global _LOOKUP_PORT
    _LOOKUP_PORT += 1
    extra = {"cache_prefix": prefix, "save_decode_cache": True, "enable_lookup": True,
             "lookup_rpc_port": _LOOKUP_PORT, "kvstate_trace": trace,
             "kvstate_monitor": monitor, "lookup_async": lookup_async}
    vc = make_vllm_config(model_dir, connector="ObservedMooncakeStoreConnector",
                          module="adapters.vllm", extra=extra, num_blocks=num_blocks,
                          kv_events=True, max_num_batched_tokens=max_num_batched_tokens)
    rig = Rig(vc, num_blocks)
    # Upstream's lookup client and server keep ZMQ sockets open: a context
    # collected with one open blocks the collecting thread (see
    # `adapters.vllm.load_conformance`), so engines live until the exit.
    _KEPT.append(rig)
    return rig


def settle(rig: Any, timeout: float = 30.0) -> None:
    """Wait until every rank's send and receive queues are empty."""
    deadline = time.monotonic() + timeout
    for worker in rig.workers:
        upstream = worker.connector_worker
        queues = [upstream.recv_request_queue]
        if upstream.kv_send_thread is not None:
            queues.append(upstream.kv_send_thread.request_queue)
        while any(q.unfinished_tasks for q in queues):
            if time.monotonic() > deadline:
                raise TimeoutError("a store job or load did not finish")
            time.sleep(0.001)


def run_steps(rig: Any, arrivals: dict[int, list[tuple[str, list[int], int]]],
              max_steps: int = 4000, before_step: Callable[[int], None] | None = None) -> None:
    rig.settle = lambda worker: settle(rig)
    last = max(arrivals) if arrivals else 0
    for step in range(max_steps):
        for req_id, tokens, max_tokens in arrivals.get(step, ()):
            rig.add(req_id, tokens, max_tokens)
        if before_step is not None:
            before_step(step)
        if step > last and not rig.busy():
            return
        rig.step()
    raise RuntimeError(f"the engine still had work after {max_steps} steps")


def _result(name: str, rigs: list[Any], traces: list[str]) -> dict[str, Any]:
    violations = []
    for rig in rigs:
        connector = rig.connector
        connector.shutdown()  # writes and judges the last lines, closes the trace
        violations += [f"{v.invariant}: {v.message}" for v in connector.violations]
    return {"scenario": name, "traces": traces, "monitor": violations,
            "finished": sorted(r for rig in rigs for r in rig.finished)}


def clean(model_dir: str, out: str) -> dict[str, Any]:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    shared = prompt(3 * BLOCK, 1)
    arrivals = {
        0: [("a", shared + prompt(2 * BLOCK + 5, 2), 6), ("b", shared + prompt(BLOCK, 3), 40)],
        2: [("c", prompt(5 * BLOCK, 4), 8), ("d", prompt(4 * BLOCK + 3, 5), 8)],
        4: [("e", prompt(6 * BLOCK, 6), 4)],
    }
    first = os.path.join(out, "clean-writer.trace")
    # 14 blocks for requests of up to 7 blocks each: vLLM preempts.
    writer = observed_engine(model_dir, first, prefix, num_blocks=14,
                             max_num_batched_tokens=64)
    run_steps(writer, arrivals)
    # The id "a" again, once "a" ended: a new request with another prompt.
    run_steps(writer, {0: [("a", prompt(3 * BLOCK + 1, 7), 3)]})
    second = os.path.join(out, "clean-reader.trace")
    reader = observed_engine(model_dir, second, prefix)
    run_steps(reader, {0: [("a2", shared + prompt(2 * BLOCK + 5, 2), 2),
                           ("c2", prompt(5 * BLOCK, 4), 2)]})
    # Asynchronous lookups: vLLM collects the hit a step after asking, and
    # rank 0's answers may reach the observer before the hit does.
    third = os.path.join(out, "clean-async-lookup.trace")
    late = observed_engine(model_dir, third, prefix, lookup_async=True)
    run_steps(late, {0: [("b3", shared + prompt(BLOCK, 3), 2)],
                     1: [("d3", prompt(4 * BLOCK + 3, 5), 2)]})
    return _result("clean", [writer, reader, late], [first, second, third])


def no_space(model_dir: str, out: str, faults: StoreFaults) -> dict[str, Any]:
    prefix = f"n{uuid.uuid4().hex[:8]}"
    trace = os.path.join(out, "no-space.trace")
    rig = observed_engine(model_dir, trace, prefix)
    shared = prompt(2 * BLOCK, 11)
    # "x" is stored first; "p" shares its prefix, and its own third block's
    # put is answered -200: "p" is skipped, and every later job of the
    # engine only finds its keys present (the same prompt again).
    run_steps(rig, {0: [("x", shared + prompt(2 * BLOCK, 12), 1)]})
    p = shared + prompt(2 * BLOCK, 13)
    faults.put_codes[block_hash(p, 2)] = [-200, 1]
    run_steps(rig, {0: [("p", p, 40)],
                    **{3 + 2 * i: [(f"y{i}", shared + prompt(2 * BLOCK, 12), 1)]
                       for i in range(4)}})
    return _result("no-space", [rig], [trace])


def reused_id(model_dir: str, out: str, faults: StoreFaults) -> dict[str, Any]:
    prefix = f"r{uuid.uuid4().hex[:8]}"
    trace = os.path.join(out, "reused-id.trace")
    rig = observed_engine(model_dir, trace, prefix)
    old = prompt(2 * BLOCK + 1, 21)
    faults.park.add(block_hash(old, 0))
    new = prompt(4 * BLOCK + 1, 22)
    rig.settle = None  # the parked put is the point: no waiting for the queue
    rig.add("r", old, 1)
    steps = 0
    while "r" not in rig.finished:
        rig.step()
        steps += 1
        if steps > 20:
            raise RuntimeError("r never finished")
    if not faults.parked.wait(10):
        raise RuntimeError("the put never parked")
    rig.step()  # the finish reaches the connector (not the same step: H1)
    rig.add("r", new, 1)
    rig.step()  # the new generation's first job is queued behind the parked one
    faults.go.set()
    run_steps(rig, {})
    return _result("reused-id", [rig], [trace])


def short_read(model_dir: str, out: str, faults: StoreFaults) -> dict[str, Any]:
    prefix = f"s{uuid.uuid4().hex[:8]}"
    first = os.path.join(out, "short-read-writer.trace")
    writer = observed_engine(model_dir, first, prefix)
    tokens = prompt(4 * BLOCK + 3, 31)
    run_steps(writer, {0: [("w", tokens, 1)]})
    request = writer.requests["w"]
    faults.short.add(bytes(request.block_hashes[1]).hex())
    second = os.path.join(out, "short-read-reader.trace")
    reader = observed_engine(model_dir, second, prefix)
    run_steps(reader, {0: [("s", tokens, 2)]})
    return _result("short-read", [writer, reader], [first, second])


SCENARIOS = ("clean", "no-space", "reused-id", "short-read")


def run_scenario(name: str, model_dir: str, out: str) -> dict[str, Any]:
    faults = StoreFaults()
    with faults.installed():
        if name == "clean":
            return clean(model_dir, out)
        if name == "no-space":
            return no_space(model_dir, out, faults)
        if name == "reused-id":
            return reused_id(model_dir, out, faults)
        return short_read(model_dir, out, faults)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.observer_runs")
    parser.add_argument("--master", required=True, help="HOST:PORT of a running mooncake_master")
    parser.add_argument("--out", required=True, help="a directory for the traces")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS,
                        help="a scenario to run (repeatable; default: all)")
    args = parser.parse_args(argv)
    code = 0
    try:
        from .interop import prepare_process
        from .rig import tiny_model_dir

        with tempfile.TemporaryDirectory() as workdir:
            model_dir = tiny_model_dir(os.path.join(workdir, "model"))
            prepare_process(args.master, workdir, model_dir)
            for name in args.scenario or SCENARIOS:
                try:
                    result = run_scenario(name, model_dir, args.out)
                except Exception as exc:  # noqa: BLE001 - reported per scenario
                    result = {"scenario": name, "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-3000:]}
                print(json.dumps(result), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as JSON, then a hard exit
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-3000:]}), flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
