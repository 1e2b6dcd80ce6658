"""Load-path conformance: one schedule, vLLM 0.33.0's real ``Scheduler``, and
either upstream's shipped ``MooncakeStoreConnector`` or ``KvstateConnector``
(any protocol, ``e2`` to compare with upstream) loading from a real Mooncake
store.

Theory of operation
-------------------
The save-path harness (`adapters.vllm.conformance`) feeds upstream's classes a
schedule it writes itself; the load path cannot be compared that way, because
its recovery lives in vLLM's ``Scheduler`` (``_update_requests_with_invalid_blocks``,
``WAITING_FOR_REMOTE_KVS``, ``kv_load_failure_policy``). So each side here is an
engine of its own (`adapters.vllm.rig.Rig`: the real scheduler, the worker
connectors, a fake forward pass) on a real ``mooncake_master``:

1. a writer engine (kvstate's default protocol) serves the scenario's
   ``stored`` prompts, so the store holds their blocks (same keys, same bytes
   for both connectors: `adapters.vllm.interop` shows they interoperate);
2. the reader engine, with the side's connector and lookup on, serves the
   scenario's requests (arrivals and aborts at fixed steps) while the store
   fails the gets the scenario names (``GetFault``: a Mooncake error code, a
   short read, the key evicted between lookup and get, a raising call),
   injected in the Mooncake binding itself, so both connectors meet the same
   store;
3. every step is recorded: what was scheduled from which computed position,
   the requests waiting for remote KV, every get (key, rank, answer) and put,
   the blocks reported as load errors, loads finished, requests finished, each
   request's computed tokens, and any computed block whose bytes are not its
   prefix's KV (an integrity check over every rank and layer). An exception
   that escapes a connector callback ends the record (the engine would die).

Asynchronous loads and saves run on the connectors' own threads; each step
waits until they finished what the step queued before the step collects
``get_finished`` (``Rig.settle``), which is what makes two runs comparable
step by step (a GPU's loads usually land within the forward pass that
follows; a slower store only shifts steps).

Each side keys the store with its own ``cache_prefix``, so one master serves
both sides and every scenario without one seeing another's blocks.
`compare` names the first step and field where two records differ.

``python -m adapters.vllm.load_conformance --master HOST:PORT --side upstream
[--scenario NAME ...]`` prints one JSON object per scenario and leaves with
``os._exit`` (upstream's worker leaves non-daemon threads behind); the tests
run it in a subprocess.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from kvstate.variants import VARIANTS

BLOCK = 16


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


@attrs.frozen
class GetFault:
    """The store's answer to gets of one block: the block ``block`` of the
    prompt that ``request`` (a stored or a served request's name) carries.
    ``answer``: a negative Mooncake code returned for the key instead of
    reading it, ``"short"`` (the read stops halfway: half the bytes land and
    the count says so), ``"evict"`` (the key is removed just before the get,
    so the store itself answers), ``"raise"`` (the whole batch call raises),
    ``"slow"`` (the batch call takes `SLOW_GET` seconds, then reads).
    ``times``: how many gets it spoils before the key serves again (``None``:
    all of them)."""

    request: str
    block: int
    answer: int | str = -704
    times: int | None = 1


@attrs.frozen
class Arrival:
    step: int
    req_id: str
    tokens: tuple[int, ...]
    max_tokens: int = 3


@attrs.frozen
class Scenario:
    name: str
    stored: tuple[tuple[str, tuple[int, ...]], ...]
    arrivals: tuple[Arrival, ...]
    faults: tuple[GetFault, ...] = ()
    aborts: tuple[tuple[int, str], ...] = ()
    policy: str = "recompute"
    load_async: bool = True
    num_blocks: int = 64
    max_steps: int = 60
    # How long a step waits for the connectors' threads (L2).
    settle_timeout: float = 30.0


def _scenarios() -> dict[str, Scenario]:
    shared = tuple(prompt(7 * BLOCK, salt=11))  # seven full blocks in the store
    tail = tuple(prompt(5, salt=12))
    other_tail = tuple(prompt(9, salt=13))
    stored = (("w", shared),)
    one = (Arrival(0, "r", shared + tail),)
    out = [
        Scenario("hit-and-load", stored, one),
        Scenario("full-prompt-hit", stored, (Arrival(0, "r", shared),)),
        Scenario("partial-hit", stored, (Arrival(0, "r", shared[:4 * BLOCK] + other_tail),)),
        Scenario("prompt-shorter-than-a-block", stored, (Arrival(0, "r", shared[:BLOCK - 3]),)),
        Scenario("two-requests-one-prefix", stored,
                 (Arrival(0, "r", shared + tail), Arrival(0, "s", shared + other_tail))),
        Scenario("later-request-one-prefix", stored,
                 (Arrival(0, "r", shared + tail), Arrival(3, "s", shared + other_tail))),
    ]
    for where, block in (("first", 0), ("middle", 3), ("last", 6)):
        for policy in ("recompute", "fail"):
            out.append(Scenario(f"fail-{where}-{policy}", stored, one,
                                (GetFault("w", block),), policy=policy))
    out += [
        Scenario("fail-shared-block", stored,
                 (Arrival(0, "r", shared + tail), Arrival(0, "s", shared + other_tail)),
                 (GetFault("w", 2, times=None),)),
        Scenario("fail-every-get", stored, one, (GetFault("w", 0, times=None),), max_steps=30),
        Scenario("evicted-before-get", stored, one, (GetFault("w", 4, "evict"),)),
        Scenario("short-read", stored, one, (GetFault("w", 2, "short"),)),
        Scenario("get-raises", stored, one, (GetFault("w", 1, "raise"),)),
        # A get slower than the step waits for: L2 fires on every side (the
        # check's own negative control; a real engine just waits longer).
        Scenario("slow-get", stored, one, (GetFault("w", 1, "slow"),), settle_timeout=1.0),
        Scenario("abort-while-loading", stored, one, aborts=((1, "r"),)),
        Scenario("sync-load", stored, one, load_async=False),
        # A running request is preempted when the pool runs dry and resumes
        # later: vLLM asks the connector again for the resumed request.
        Scenario("preempted-resumes", stored,
                 (Arrival(0, "r", shared + tail, max_tokens=40),
                  Arrival(1, "s", tuple(prompt(4 * BLOCK, salt=20)), max_tokens=40)),
                 num_blocks=14, max_steps=120),
        # The id comes back (a client's retry) right after its request finished.
        Scenario("reused-id", stored,
                 (Arrival(0, "r", shared + tail), Arrival(5, "r", shared[:5 * BLOCK] + other_tail))),
    ]
    for code in (-707, -800, -801, -900, -901):
        out.append(Scenario(f"code{code}", stored, one, (GetFault("w", 3, code),)))
    return {s.name: s for s in out}


SCENARIOS = _scenarios()
SLOW_GET = 3.0  # seconds; above slow-get's settle_timeout, below kvstate_store_timeout (5 s)


# ----------------------------------------------------------------------
# The store as both connectors meet it: the Mooncake binding, patched.

_KEY = re.compile(r"@tp_rank:(\d+)@.*@([0-9a-f]+)$")


class StoreScript:
    """Records every get and put the binding serves and applies the faults.
    Key hashes are named ``REQUEST#BLOCK`` after the first prompt that has
    them, so two sides' records compare without their prefixes."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.faults: dict[str, list[Any]] = {}  # hash hex -> [answer, times left]
        self.gets: list[tuple[int, str, int | str]] = []
        self.puts: list[tuple[int, str]] = []

    def name_prompt(self, name: str, block_hashes: Any) -> None:
        for i, h in enumerate(block_hashes):
            self.names.setdefault(bytes(h).hex(), f"{name}#{i}")

    def fault(self, block_hash: Any, answer: int | str, times: int | None) -> None:
        self.faults[bytes(block_hash).hex()] = [answer, times]

    def label(self, key: str) -> tuple[int, str]:
        m = _KEY.search(key)
        if m is None:
            return -1, key
        return int(m.group(1)), self.names.get(m.group(2), m.group(2)[:12])

    def _spoil(self, key: str) -> int | str | None:
        m = _KEY.search(key)
        entry = self.faults.get(m.group(2)) if m is not None else None
        if entry is None or entry[1] == 0:
            return None
        if entry[1] is not None:
            entry[1] -= 1
        return entry[0]

    def take(self) -> tuple[list[Any], list[Any]]:
        gets, self.gets = sorted(self.gets), []
        puts, self.puts = sorted(self.puts), []
        return gets, puts

    @contextmanager
    def installed(self) -> Iterator[None]:
        from mooncake.store import MooncakeDistributedStore as Binding

        real_get = Binding.batch_get_into_multi_buffers
        real_put = Binding.batch_put_from_multi_buffers
        script = self

        def get(store: Any, keys: list[str], ptrs: Any, sizes: Any, *args: Any) -> list[int]:
            spoiled = [script._spoil(k) for k in keys]
            if "raise" in spoiled:
                for key in keys:
                    script.gets.append((*script.label(key), "raised"))
                raise RuntimeError("scripted store: batch_get_into_multi_buffers raised")
            if "slow" in spoiled:
                time.sleep(SLOW_GET)
            for key, answer in zip(keys, spoiled):
                if answer == "evict":
                    store.remove(key, True)
            real = [i for i, a in enumerate(spoiled) if a is None or isinstance(a, str)]
            got: dict[int, int] = {}
            if real:
                answers = real_get(store, [keys[i] for i in real], [ptrs[i] for i in real],
                                   [sizes[i] for i in real], *args)
                got = dict(zip(real, answers))
            out = []
            for i, (key, answer) in enumerate(zip(keys, spoiled)):
                if isinstance(answer, int):
                    value = answer
                elif answer == "short" and got[i] > 0:
                    # Half the bytes landed: the rest of the key's last buffer is zeroed.
                    size = sizes[i][-1]
                    ctypes.memset(ptrs[i][-1] + size // 2, 0, size - size // 2)
                    value = got[i] - (size - size // 2)
                else:
                    value = got[i]
                out.append(value)
                script.gets.append((*script.label(key), value))
            return out

        def put(store: Any, keys: list[str], ptrs: Any, sizes: Any, *args: Any) -> Any:
            answers = real_put(store, keys, ptrs, sizes, *args)
            for key, answer in zip(keys, answers):
                if answer == 0:
                    script.puts.append(script.label(key))
            return answers

        Binding.batch_get_into_multi_buffers = get
        Binding.batch_put_from_multi_buffers = put
        try:
            yield
        finally:
            Binding.batch_get_into_multi_buffers = real_get
            Binding.batch_put_from_multi_buffers = real_put


# ----------------------------------------------------------------------
# Settling a step: the connectors' threads finish what the step queued.


def _settle_worker(worker: Any, timeout: float = 30.0) -> bool:
    """Wait until ``worker``'s loads and saves queued so far are done;
    False when they are not within ``timeout`` (a stuck thread)."""
    side = getattr(worker, "worker", None)
    if side is not None:  # KvstateConnector's WorkerSide
        def done() -> bool:
            return bool(side.loads_settled() and not side.executor.queue
                        and side.in_flight is None)
    else:
        upstream = worker.connector_worker
        queues = [upstream.recv_request_queue]
        if getattr(upstream, "kv_send_thread", None) is not None:
            queues.append(upstream.kv_send_thread.request_queue)

        def done() -> bool:
            return all(q.unfinished_tasks == 0 for q in queues)
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


# ----------------------------------------------------------------------
# One side, one scenario.


# Upstream's lookup server binds an IPC path named after ``lookup_rpc_port``
# in a directory every process shares (``VLLM_RPC_BASE_PATH``): a second
# process with the same number unlinks the first's socket. Numbers start
# from this process's id, so concurrent runs never meet.
_LOOKUP_PORT = os.getpid() * 64


def _extra(side: str, prefix: str, scenario: Scenario) -> dict[str, Any]:
    extra: dict[str, Any] = {"cache_prefix": prefix, "save_decode_cache": True,
                             "enable_lookup": True, "load_async": scenario.load_async}
    if side == "upstream":
        # The lookup server's IPC path: one per engine this process builds.
        global _LOOKUP_PORT
        _LOOKUP_PORT += 1
        extra["lookup_rpc_port"] = _LOOKUP_PORT
    else:
        extra["kvstate_protocol"] = side
        # The default protocol checks its invariant catalogue online and
        # raises on a violation (recorded like any exception that escapes).
        extra["kvstate_monitor"] = "raise" if side == "kvstate" else "off"
        extra["kvstate_load_async"] = scenario.load_async
    return extra


def _escaped(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                  for f in reversed(frames) if "kv_connector" in f.filename
                  or "adapters" in f.filename), "?")
    return f"{type(exc).__name__} at {where}: {str(exc)[:200]}"


def run_scenario(scenario: Scenario, side: str, model_dir: str) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    from .rig import Rig, make_vllm_config

    script = StoreScript()
    tag = uuid.uuid4().hex[:8]
    writer = Rig(make_vllm_config(model_dir, extra={"cache_prefix": f"{side}-{tag}",
                                                    "save_decode_cache": True}), 64)
    reader = None
    record: dict[str, Any] = {"scenario": scenario.name, "side": side, "steps": [],
                              "error": None, "stuck": None}
    try:
        for name, tokens in scenario.stored:
            request = writer.add(name, list(tokens), max_tokens=1)
            script.name_prompt(name, request.block_hashes)
        writer.run()
        writer.drain()
        vc = make_vllm_config(
            model_dir, connector="MooncakeStoreConnector" if side == "upstream" else "KvstateConnector",
            module=None if side == "upstream" else "adapters.vllm",
            extra=_extra(side, f"{side}-{tag}", scenario), num_blocks=scenario.num_blocks,
            kv_load_failure_policy=scenario.policy)
        reader = Rig(vc, scenario.num_blocks)
        stuck: list[str] = []

        def settle(worker: Any) -> None:
            if not _settle_worker(worker, scenario.settle_timeout):
                stuck.append(f"a load or save did not finish within {scenario.settle_timeout} s")

        reader.settle = settle
        with script.installed():
            for fault in scenario.faults:
                owner = writer.requests.get(fault.request) or reader.requests[fault.request]
                script.fault(owner.block_hashes[fault.block], fault.answer, fault.times)
            script.take()
            for step in range(scenario.max_steps):
                for arrival in scenario.arrivals:
                    if arrival.step == step:
                        request = reader.add(arrival.req_id, list(arrival.tokens),
                                             arrival.max_tokens)
                        script.name_prompt(arrival.req_id, request.block_hashes)
                for when, req_id in scenario.aborts:
                    if when == step:
                        reader.abort(req_id)
                if step > max(a.step for a in scenario.arrivals) and not reader.busy():
                    break
                finished_before = len(reader.finished)
                invalid_before = set(reader.invalid_block_ids)
                try:
                    so = reader.step()
                except Exception as exc:  # noqa: BLE001 - recorded: the engine would die
                    record["error"] = f"step {step}: {_escaped(exc)}"
                    break
                gets, puts = script.take()
                scheduled = sorted(
                    [(d.req_id, d.num_computed_tokens, so.num_scheduled_tokens[d.req_id])
                     for d in so.scheduled_new_reqs]
                    + [(r, so.scheduled_cached_reqs.num_computed_tokens[i],
                        so.num_scheduled_tokens[r])
                       for i, r in enumerate(so.scheduled_cached_reqs.req_ids)])
                waiting = sorted(r for r, q in reader.scheduler.requests.items()
                                 if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
                record["steps"].append({
                    "step": step,
                    "scheduled": scheduled,
                    "waiting_for_remote_kv": waiting,
                    "gets": gets,
                    "puts": puts,
                    "load_errors": sorted(reader.invalid_block_ids - invalid_before),
                    "finished": reader.finished[finished_before:],
                    "computed": {r: q.num_computed_tokens
                                 for r, q in sorted(reader.scheduler.requests.items())},
                    "corrupt": reader.corrupt_blocks(),
                })
                if stuck:
                    record["stuck"] = f"step {step}: {stuck[0]}"
                    break
        record["unfinished"] = sorted(r for r in reader.requests if r not in reader.finished)
    finally:
        for rig in (reader, writer):
            if rig is not None:
                try:
                    rig.close()
                except Exception:  # noqa: BLE001 - a side that died may not close cleanly
                    pass
                # Upstream's lookup client and server keep ZMQ sockets open
                # (its scheduler role closes nothing): a context collected
                # with a socket open blocks the collecting thread for ever.
                # The engines stay referenced until the process exits.
                _KEPT.append(rig)
    return record


_KEPT: list[Any] = []


# ----------------------------------------------------------------------
# What every load path owes the engine, whatever the store does.

PROPERTIES = {
    "L1": "nothing escapes a connector callback into the engine",
    "L2": "every load ends (the connector's threads finish what a step queued)",
    "L3": "every computed block holds its prefix's KV (no block taken as loaded that was not)",
    "L4": "every request not aborted finishes (no request loops on a failing load)",
    "L5": "with kv_load_failure_policy=fail, a request whose load failed ends in that step "
          "and leaves the scheduler with its blocks",
}


def broken_properties(record: dict[str, Any], scenario: Scenario) -> dict[str, str]:
    """The `PROPERTIES` a side's record breaks, each with the first place it
    does. Shown firing by upstream itself (H4: L4, H5: L1, H6: L3) and by
    `swallow-load-errors` (L3), in tests/test_load_conformance.py."""
    out: dict[str, str] = {}
    if record["error"]:
        out["L1"] = record["error"]
    if record["stuck"]:
        out["L2"] = record["stuck"]
    for step in record["steps"]:
        if step["corrupt"]:
            out["L3"] = f"step {step['step']}: blocks {step['corrupt']}"
            break
    aborted = {req_id for _, req_id in scenario.aborts}
    unfinished = sorted(set(record.get("unfinished", ())) - aborted)
    if unfinished and not record["error"] and not record["stuck"]:
        out["L4"] = f"{unfinished} unfinished after {len(record['steps'])} steps"
    if scenario.policy == "fail":
        for step in record["steps"]:
            if step["load_errors"] and (not step["finished"] or any(
                    r in step["computed"] for r in step["finished"])):
                out["L5"] = (f"step {step['step']}: load errors {step['load_errors']}, "
                             f"finished {step['finished']}, still held {step['computed']}")
                break
    return out


# ----------------------------------------------------------------------
# Comparing two records.


@attrs.frozen
class Difference:
    step: int
    field: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"step {self.step}, {self.field}: {self.a!r} != {self.b!r}"


FIELDS = ("scheduled", "waiting_for_remote_kv", "gets", "load_errors", "finished", "computed",
          "puts", "corrupt")


def compare(a: dict[str, Any], b: dict[str, Any],
            fields: tuple[str, ...] = FIELDS) -> Difference | None:
    """The first step and field where the records differ, or None."""
    for sa, sb in zip(a["steps"], b["steps"]):
        for field in fields:
            if sa[field] != sb[field]:
                return Difference(sa["step"], field, sa[field], sb[field])
    for field in ("error", "stuck"):
        if a[field] != b[field]:
            return Difference(-1, field, a[field], b[field])
    if len(a["steps"]) != len(b["steps"]):
        return Difference(min(len(a["steps"]), len(b["steps"])), "steps",
                          len(a["steps"]), len(b["steps"]))
    return None


# ----------------------------------------------------------------------
# The command (run in a subprocess by the tests).


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.load_conformance")
    parser.add_argument("--master", required=True, help="HOST:PORT of a running mooncake_master")
    parser.add_argument("--side", choices=("upstream", *sorted(VARIANTS)), required=True,
                        help="upstream's MooncakeStoreConnector, or KvstateConnector "
                        "running this protocol (e2: upstream's semantics)")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                        help="a scenario to run (repeatable; default: all)")
    args = parser.parse_args(argv)
    code = 0
    try:
        from .interop import prepare_process
        from .rig import tiny_model_dir

        with tempfile.TemporaryDirectory() as workdir:
            model_dir = tiny_model_dir(os.path.join(workdir, "model"))
            prepare_process(args.master, workdir, model_dir)
            for name in args.scenario or sorted(SCENARIOS):
                print(json.dumps(run_scenario(SCENARIOS[name], args.side, model_dir)),
                      flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as JSON, then a hard exit
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-3000:]}), flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
