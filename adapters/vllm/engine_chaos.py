"""The store misbehaving under a real engine that computes.

`adapters.vllm.chaos` does this on the rig (vLLM's real Scheduler, forward
passes stood in for); here the engine is ``vllm.LLM`` running a tiny Llama
(`adapters.vllm.engine`, in a process of its own) against a `Deployment`: a
real ``mooncake_master`` and a standalone store on 127.0.0.1. The master is
killed and started again on its ports (every object lost; the store process
and the engine's clients mount again) during three waves, then stopped with
SIGSTOP for a few seconds and continued. The faults happen at exact engine
steps: the engine asks for each one through files (`StoreFault`), and a
`FaultController` thread here does it and answers.

The waves: every wave's requests share one prefix of four blocks, each with
a suffix of its own; before every wave but the first the engine drops vLLM's
own prefix cache, so the shared prefix can only come from the store. A
restart in the middle of wave 1 loses what wave 0 stored: wave 2 finds
nothing (the hits lost), stores the prefix again, and wave 3 finds it (the
hits back); and so on for waves 3-4-5 and 5-6-7. (Within a wave one request
loads the prefix from the store; the others wait for it and read it from
vLLM's cache: a wave that finds the prefix is offered its four blocks once.) The engine sleeps
``STEP_PAUSE_S`` after each step, as long as a real model's forward pass, so
that a fault's seconds span tens of steps as they would in production.

Figures (`run`'s answer, ``python -m adapters.vllm.engine_chaos`` prints them
as JSON): outputs equal to an engine without a connector (what a wrong byte
loaded would change: `tests/test_engine.py` shows it does), pins and jobs
left after the drain, for each fault the steps and seconds until a key was
next put successfully, the store tokens each wave was offered, and the
store's recovery episodes.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from adapters.master import Master

from .deployment import Deployment
from .engine import BLOCK_SIZE, EngineRequest, StoreFault, Wave

# Seconds after each engine step (see the module's docstring): about a real
# 7-8B model's decode step on one GPU.
STEP_PAUSE_S = 0.02
RESTARTS = 3
STALL_S = 3.0
# Which step of a wave a fault comes at: after the wave's requests were
# admitted (their lookups and loads done), while they decode and save.
FAULT_STEP = 6
REQUESTS = 4
# Tokens each request generates: its decode spans the fault and enough steps
# after it for the store to come back (decode blocks are saved as they fill).
MAX_TOKENS = 72
# Request ids kept as given: the figures name requests by the ids given.
FIXED_IDS = {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}
# A store call's bound: a stall longer than this starts a recovery episode.
STORE_TIMEOUT_S = 1.0


def prompt(n: int, salt: int) -> list[int]:
    return [10 + (salt * 7919 + i * 31) % 4000 for i in range(n)]


SHARED = prompt(4 * BLOCK_SIZE, 1)


def waves(*, faults: bool) -> list[Wave]:
    """Waves 0-8 as the module's docstring says; without ``faults`` the same
    requests with no faults (the reference engine)."""
    plan: dict[int, StoreFault] = {}
    if faults:
        for restart in range(RESTARTS):
            plan[1 + 2 * restart] = StoreFault(FAULT_STEP, "restart")
        plan[1 + 2 * RESTARTS] = StoreFault(FAULT_STEP, "stall", STALL_S)
    out = []
    for w in range(2 * RESTARTS + 3):
        requests = [EngineRequest(f"w{w}-{i}", SHARED + prompt(20 + 9 * i, 100 * w + i),
                                  MAX_TOKENS) for i in range(REQUESTS)]
        out.append(Wave(requests, store_faults=[plan[w]] if w in plan else [],
                        reset_prefix_cache=w > 0))
    return out


class FaultController:
    """Answers an engine's `StoreFault` requests in ``control_dir`` on a thread:
    ``fault-N.json`` asks, ``fault-N.done`` answers once the action is done."""

    def __init__(self, master: Master, control_dir: str | Path) -> None:
        self.master = master
        self.control = Path(control_dir)
        self.control.mkdir(parents=True, exist_ok=True)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._thread = threading.Thread(target=self._serve, name="fault-controller",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        n = 0
        while not self._stop.is_set():
            request = self.control / f"fault-{n}.json"
            if not request.exists():
                time.sleep(0.005)
                continue
            fault = StoreFault(**json.loads(request.read_text()))
            try:
                answer = self._do(fault)
            except Exception as error:  # noqa: BLE001 - the engine must hear of it
                answer = f"failed: {error!r}"
                self.errors.append(f"fault {n} ({fault.action}): {error!r}")
            # Whole or not at all: the engine reads the answer once the file exists.
            done = self.control / f"fault-{n}.done"
            partial = done.with_name(done.name + ".partial")
            partial.write_text(answer)
            partial.replace(done)
            n += 1

    def _do(self, fault: StoreFault) -> str:
        if fault.action == "restart":
            old = self.master.process.pid
            self.master.restart()
            return f"master {old} killed, {self.master.process.pid} listening"
        pid = self.master.process.pid
        self.master.pause()
        timer = threading.Timer(fault.seconds, self.master.resume)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return f"master {pid} stopped for {fault.seconds:g} s"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for timer in self._timers:
            timer.cancel()
        if self.master.process.poll() is None:
            self.master.resume()  # never leave it stopped


def run(deployment: Deployment, workdir: str | Path,
        connector: str = "kvstate") -> dict[str, Any]:
    """The reference engine, then the engine under faults with ``connector``
    (``kvstate``, or upstream's ``mooncake`` for comparison: it has no
    store timeout and no recovery of its own); the figures."""
    control = Path(workdir) / f"control-{connector}"
    reference = deployment.run("reference", waves(faults=False), connector=None,
                               step_pause_s=STEP_PAUSE_S, env=FIXED_IDS)
    extra: dict[str, Any] = {"save_decode_cache": True}
    if connector == "kvstate":
        extra["kvstate_store_timeout"] = STORE_TIMEOUT_S
    controller = FaultController(deployment.master, control)
    try:
        chaos = deployment.run(
            f"chaos-{connector}", waves(faults=True), connector=connector,
            control_dir=str(control), step_pause_s=STEP_PAUSE_S, env=FIXED_IDS, extra=extra)
    finally:
        controller.close()
    mismatched = sorted(
        rid for ref, got in zip(reference["waves"], chaos["waves"])
        for rid in ref["outputs"] if ref["outputs"][rid] != got["outputs"].get(rid))
    external = chaos.get("external_tokens", {})
    totals = chaos.get("worker_totals", {})
    return {
        "connector": connector,
        "outputs_mismatched": mismatched,
        "requests": sum(len(w["outputs"]) for w in reference["waves"]),
        "controller_errors": controller.errors,
        "faults": chaos.get("store_faults", []),
        "store_tokens_by_wave": [sum(external.get(r.req_id, 0) for r in wave.requests)
                                 for wave in waves(faults=False)],
        "pins_left": chaos.get("pins_held"),
        "jobs_left": chaos.get("jobs_in_flight"),
        "pending_save_work": chaos.get("pending_save_work"),
        "violations": chaos.get("violations"),
        "store_episodes": totals.get("store_episodes", 0),
        "store_recoveries": totals.get("store_recoveries", 0),
        "store_errors": totals.get("store_errors", 0),
        "keys_put": totals.get("keys_put", 0),
        "trace": chaos.get("trace"),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .engine import engine_python, make_model_with

    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.engine_chaos",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", default=None,
                        help="the CPU engine's interpreter (default: .venv-engine's)")
    parser.add_argument("--connector", choices=("kvstate", "mooncake"), default="kvstate",
                        help="kvstate's connector, or upstream's MooncakeStoreConnector for "
                        "comparison (default: kvstate)")
    args = parser.parse_args(argv)
    python = args.engine_python or engine_python()
    with tempfile.TemporaryDirectory() as workdir:
        model = make_model_with(python, Path(workdir) / "model")
        with Deployment(workdir, model, python=python) as deployment:
            figures = run(deployment, workdir, args.connector)
        from sim.traces.check import check_trace

        trace = figures.pop("trace")
        if trace is not None:
            figures["trace_ok"] = check_trace(trace).ok
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
