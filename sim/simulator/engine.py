"""An engine and its ranks in virtual time.

``SimEngine`` puts the core's `Harness` (an engine model close to vLLM's:
waiting and running queues, a token budget, chunked prefill, a block pool with
reference counts in which the connector's pins are extra references,
preemption by recompute when blocks run out, resumption as a new generation)
on the kernel's clock: one scheduler step every ``step_time`` seconds while
there is work, arrivals at their times, and one ``RankThread`` per
tensor-parallel rank — a FIFO send thread whose store calls take the store's
latency, may hang (until the protocol's timeout, if it has one; a put may hang
after the master took its PutStart, leaving its keys puts in progress) or
stall. The master may restart between steps, losing every object.
Reports reach the planner at the next step, as vLLM's worker metadata does.

Admission is vLLM's: a request whose prompt plus maximum output exceeds
``max_model_len``, or needs more blocks than the KV cache has in all (vLLM
refuses to start with a ``max_model_len`` its cache cannot hold, so no request
it admits can outgrow the cache), is refused at arrival and counted in
``rejected``; it never enters the engine. Without this, one prompt larger than
the pool drives the engine into endless preempt/resume, and the protocol's
bookkeeping for it never settles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvstate.harness import EngineRequest, Harness
from kvstate.workloads import Arrival
from sim.simulator.faults import Faults
from sim.simulator.kernel import Kernel
from sim.simulator.store import SimStore

STALL_TIME = 0.5  # seconds a stalled rank sleeps (a long GC pause or a slow NIC)
REUSE_MEMORY = 64  # finished ids a client may resubmit


def kv_capacity_tokens(num_blocks: int, block_size: int, groups: int = 1) -> int:
    """The most tokens one request can hold: every group needs its own blocks."""
    return (num_blocks // max(1, groups)) * block_size


class RankThread:
    """One rank's send thread: performs its executor's store calls in order."""

    def __init__(self, engine: SimEngine, rank: int) -> None:
        self.engine = engine
        self.rank = rank
        self.busy = False
        self.hung = False
        self.calls = 0

    def kick(self) -> None:
        if not self.busy and not self.hung:
            self.busy = True
            self.engine.kernel.schedule(0.0, self._next)

    def _next(self) -> None:
        engine = self.engine
        harness = engine.harness
        if engine.faults.fire("rank_stall"):
            engine.kernel.schedule(STALL_TIME, self._next)
            return
        pending = harness.current.get(self.rank)
        if pending is None:
            if harness.advance(self.rank) == "idle":
                self.busy = False
                return
            self._after_call()
            return
        _, call = pending
        op = "exists" if type(call).__name__ == "ExistsCall" else "put"
        latency = engine.store.latency(op, len(call.keys))
        if op == "put" and engine.faults.fire("put_preempted"):
            # The master took the call's PutStarts, then its transfer hangs:
            # no PutEnd or PutRevoke follows, so the store keeps the keys as
            # puts in progress until a put preempts them (sim.simulator.store).
            engine.store.start_puts(call.keys)
            self._hang(op)
            return
        if engine.faults.fire("store_hang"):
            self._hang(op)
            return
        engine.kernel.schedule(latency, self._call)

    def _hang(self, op: str) -> None:
        """The pending call never returns: the rank waits for the protocol's
        timeout, if it has one, and the call then raises."""
        engine = self.engine
        timeout = engine.harness.variant.call_timeout
        if timeout is None:
            self.hung = True  # upstream: the call never returns; its pins stay
            engine.hung_calls += 1
            return
        engine.kernel.schedule(timeout, lambda: self._call(TimeoutError(
            f"store {op} timed out after {timeout}s")))

    def _call(self, fail: BaseException | None = None) -> None:
        self.calls += 1
        self.engine.harness.advance(self.rank, fail)
        self._after_call()

    def _after_call(self) -> None:
        self.engine.kernel.schedule(0.0, self._next)


class SimEngine:
    def __init__(
        self,
        name: str,
        index: int,
        kernel: Kernel,
        harness: Harness,
        store: SimStore,
        faults: Faults,
        step_time: float = 0.02,
        lookup: bool = True,
        on_prefilled: Callable[[EngineRequest], None] | None = None,
        max_model_len: int = 0,
    ) -> None:
        self.name = name
        self.index = index
        self.kernel = kernel
        self.harness = harness
        self.store = store
        self.faults = faults
        self.step_time = step_time
        self.lookup = lookup
        self.on_prefilled = on_prefilled
        self.threads = [RankThread(self, r) for r in range(harness.config.world_size)]
        self.stepping = False
        self.steps = 0
        self.reuses = 0
        self.hung_calls = 0
        self.rejected = 0
        # vLLM's max_model_len; 0: what the KV cache can hold (blocks x block size).
        self.capacity_tokens = kv_capacity_tokens(len(harness.pool.refs) - 1,
                                                  harness.config.block_size,
                                                  len(harness.config.groups))
        self.max_model_len = max_model_len or self.capacity_tokens
        self.backlog: deque[Arrival] = deque()
        self._recent: deque[str] = deque(maxlen=REUSE_MEMORY)

    # Clients.

    def refusal(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why vLLM would refuse this request at admission (None: admitted)."""
        total = prompt_tokens + max_new_tokens
        if total > self.max_model_len:
            return (f"prompt ({prompt_tokens}) plus max tokens ({max_new_tokens}) exceeds "
                    f"max_model_len {self.max_model_len}")
        if total > self.capacity_tokens:
            return f"{total} tokens exceed the KV cache ({self.capacity_tokens} tokens)"
        return None

    def arrive(self, arrival: Arrival, transferred: bool = False) -> bool:
        """A client submits a request; False when admission refused it."""
        if self.refusal(len(arrival.prompt), arrival.max_new_tokens) is not None:
            self.rejected += 1
            return False
        req_id = arrival.req_id
        if not transferred and self.faults.fire("id_reuse"):
            for old in self._recent:
                if old not in self.harness.requests:
                    req_id = old
                    self.reuses += 1
                    break
        if req_id in self.harness.requests:
            self.backlog.append(arrival)  # the id is busy: the client waits
        else:
            self.harness.add(req_id, arrival.prompt, arrival.max_new_tokens,
                             lookup=self.lookup, transferred=transferred)
            self._recent.append(req_id)
        self.wake()
        return True

    def wake(self) -> None:
        if not self.stepping:
            self.stepping = True
            self.kernel.schedule(0.0, self._step)

    # Scheduler steps.

    def busy(self) -> bool:
        harness = self.harness
        return bool(harness.requests or harness.outbox or harness.planner.has_pending_push_work()
                    or self.backlog)

    def _step(self) -> None:
        harness = self.harness
        preempt = []
        if harness.running and self.faults.fire("preempt"):
            preempt.append(harness.running[-1].req_id)
        if self.faults.fire("evict"):
            self.store.evict_oldest()
        if self.faults.fire("master_restart"):
            self.store.restart_master()
        harness.step(preempt=preempt)
        self.steps += 1
        for thread in self.threads:
            thread.kick()
        if self.on_prefilled is not None:
            for req in harness.last_finished:
                self.on_prefilled(req)
        while self.backlog and self.backlog[0].req_id not in harness.requests:
            arrival = self.backlog.popleft()
            harness.add(arrival.req_id, arrival.prompt, arrival.max_new_tokens,
                        lookup=self.lookup)
        if self.busy():
            self.kernel.schedule(self.step_time, self._step)
        else:
            self.stepping = False

    def idle(self) -> bool:
        """Nothing runs, queues are empty, no store call is in flight."""
        return (not self.busy() and not any(t.busy for t in self.threads)
                and not self.harness.current)
