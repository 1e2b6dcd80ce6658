"""The store misbehaving under a running engine: master restarts and a stall.

One engine (`adapters.vllm.rig.Rig`: vLLM 0.33.0's real Scheduler,
``KvstateConnector`` with the online monitor raising and a trace) serves
rounds of requests against a real ``mooncake_master`` on 127.0.0.1 while the
master is killed and started again on its ports (every object lost, clients
must mount their segments again) ``restarts`` times, then stopped with
SIGSTOP for ``stall_s`` seconds and continued. Every step checks that every
computed block of every running request holds its prefix's KV (wrong bytes
loaded would show there). After the rounds the engine drains; then a second
engine serves the last round's prompts from what the store holds now and
checks its loaded blocks the same way.

Figures (`run`'s answer): wrong blocks seen (must be 0), pins and jobs left
after the drain (0), steps and seconds from each restart to the first key
put successfully afterwards, lookup hits (tokens) in the round before each
restart, in the rounds until the first put (what the restart cost: the
store lost the prefix) and in the round after, the store's recovery
episodes and recoveries, and the traces (they must check clean).

``python -m adapters.vllm.chaos`` starts a master itself and prints the
figures as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any

from .rig import Rig, make_vllm_config, tiny_model_dir

BS = 16  # the rig's block size (`make_vllm_config`'s default)

# A round: requests sharing a prefix with the previous round's (so lookups
# can hit what the store kept) plus prompts of their own.
REQUESTS_PER_ROUND = 4
# Bounds: a round must finish within this many engine steps, the first put
# after a restart within this many seconds (the store's recovery waits for a
# stuck call, then backs off from 1 s).
MAX_STEPS = 20000
RECOVERY_BOUND_S = 120.0


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


def _keys_put(rig: Rig) -> int:
    return rig.totals().get("keys_put", 0)


def _serve(rig: Rig, round_no: int, bad: list[str], *, during: Any = None) -> dict[str, Any]:
    """One round; ``during(step)`` runs before each step (faults)."""
    shared = prompt(3 * BS, 1)
    for i in range(REQUESTS_PER_ROUND):
        rig.add(f"r{round_no}-{i}", shared + prompt(BS + 7 * i, 100 * round_no + i),
                max_tokens=6)
    hits_before = rig.totals().get("lookup_hit_tokens", 0)
    steps = 0
    while rig.busy():
        if during is not None:
            during(steps)
        so = rig.step()
        steps += 1
        bad.extend(rig.corrupt_blocks())
        if not so.num_scheduled_tokens:
            time.sleep(0.001)
        if steps > MAX_STEPS:
            raise RuntimeError(f"round {round_no} did not finish in {MAX_STEPS} steps")
    return {"steps": steps, "hit_tokens": rig.totals().get("lookup_hit_tokens", 0) - hits_before}


def _until_a_put(rig: Rig, round_no: int, bad: list[str]) -> tuple[int, float, int, int]:
    """Serve rounds until a key is put: (steps, seconds, rounds, hit tokens)."""
    started, steps, rounds, hits = time.monotonic(), 0, 0, 0
    before = _keys_put(rig)
    while _keys_put(rig) == before:
        if time.monotonic() - started > RECOVERY_BOUND_S:
            raise RuntimeError(f"no key put within {RECOVERY_BOUND_S} s of the fault")
        served = _serve(rig, round_no + rounds, bad)
        steps += served["steps"]
        hits += served["hit_tokens"]
        rounds += 1
    return steps, time.monotonic() - started, rounds, hits


def run(master: Any, model_dir: str, workdir: str, *, restarts: int = 3,
        stall_s: float = 3.0) -> dict[str, Any]:
    os.environ["MOONCAKE_CONFIG_PATH"] = _store_config(master.address, workdir)
    extra = {"cache_prefix": f"chaos{uuid.uuid4().hex[:8]}", "save_decode_cache": True,
             "kvstate_monitor": "raise", "kvstate_store_timeout": 1.0}
    traces = [os.path.join(workdir, "chaos-0.jsonl"), os.path.join(workdir, "chaos-1.jsonl")]
    rig = Rig(make_vllm_config(model_dir, extra=dict(extra, kvstate_trace=traces[0]),
                               num_blocks=96), 96)
    bad: list[str] = []
    out: dict[str, Any] = {"restarts": [], "stall": None}
    round_no = 0
    try:
        _serve(rig, round_no, bad)
        round_no += 1
        for _ in range(restarts):
            before = _serve(rig, round_no, bad)
            round_no += 1
            master.restart()
            steps, seconds, rounds, hits = _until_a_put(rig, round_no, bad)
            round_no += rounds
            after = _serve(rig, round_no, bad)
            round_no += 1
            out["restarts"].append({"steps_to_first_put": steps,
                                    "seconds_to_first_put": round(seconds, 2),
                                    "hit_tokens_before": before["hit_tokens"],
                                    "hit_tokens_until_first_put": hits,
                                    "hit_tokens_after": after["hit_tokens"]})
        stalled_at = time.monotonic()

        def stall(step: int) -> None:
            if step == 2:
                master.pause()
            if step > 2 and time.monotonic() - stalled_at > stall_s:
                master.resume()

        try:
            _serve(rig, round_no, bad, during=stall)
        finally:
            master.resume()
        round_no += 1
        steps, seconds, rounds, _ = _until_a_put(rig, round_no, bad)
        round_no += rounds
        out["stall"] = {"stall_s": stall_s, "steps_to_first_put": steps,
                        "seconds_to_first_put": round(seconds, 2)}
        rig.drain()
        rig.step()
        side = rig.connector.scheduler  # type: ignore[union-attr]
        out["pins_left"] = side.pins_held
        out["jobs_left"] = len(side.planner.jobs)
        totals = rig.totals()
        out["store_episodes"] = totals.get("store_episodes", 0)
        out["store_recoveries"] = totals.get("store_recoveries", 0)
        out["store_errors"] = totals.get("store_errors", 0)
        # A second engine serves the last prompts from what the store holds.
        second = Rig(make_vllm_config(model_dir, extra=dict(extra, kvstate_trace=traces[1]),
                                      num_blocks=96), 96)
        try:
            shared = prompt(3 * BS, 1)
            for i in range(REQUESTS_PER_ROUND):
                second.add(f"again-{i}", shared + prompt(BS + 7 * i, 100 * (round_no - 1) + i),
                           max_tokens=4)
            while second.busy():
                second.step()
                bad.extend(second.corrupt_blocks())
                time.sleep(0.001)
            out["second_engine_hit_tokens"] = second.totals().get("lookup_hit_tokens", 0)
        finally:
            second.close()
    finally:
        rig.close()
    out["wrong_blocks"] = sorted(set(bad))
    out["traces"] = traces
    return out


def _store_config(address: str, workdir: str) -> str:
    path = os.path.join(workdir, "mooncake.json")
    with open(path, "w") as handle:
        json.dump({"master_server_address": address, "metadata_server": "P2PHANDSHAKE",
                   "protocol": "tcp", "global_segment_size": "64mb",
                   "local_buffer_size": "32mb"}, handle)
    return path


def main() -> None:
    from adapters.master import Master

    master = Master()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            model_dir = tiny_model_dir(os.path.join(workdir, "model"))
            figures = run(master, model_dir, workdir)
            from sim.traces.check import check_trace

            figures["traces_ok"] = [check_trace(t).ok for t in figures.pop("traces")]
            print(json.dumps(figures), flush=True)
    finally:
        master.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
