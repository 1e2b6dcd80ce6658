"""A synchronous harness: one planner, N rank executors, a block pool, a store.

Scenario tests (and the demo) need the whole connector moving without threads
or time: this harness plays a small engine — waiting and running requests,
chunked prefill under a token budget, one decode token per step, explicit
preemption, finish and id reuse — and lets the test decide exactly when each
rank performs each store call (``advance``). Every observation goes to the
invariant monitor, so a scenario that breaks the protocol fails loudly.

The simulator (`sim`) replaces the "when" with a seeded event loop; what is
modelled here (content tags, pins as references, first-write-wins store) is
the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstate.block_pool import BlockPool
from kvstate.blockhash import KVSTATE as KVSTATE_HASH
from kvstate.blockhash import chain_hash_fn
from kvstate.config import ConnectorConfig
from kvstate.executor import Executor
from kvstate.invariants import Monitor
from kvstate.keys import HashChain, cdiv, chunk_hash, key_digest
from kvstate.memory_store import MemoryStore, StoreRaised
from kvstate.observations import (
    Allocated,
    ExistsAnswered,
    KeyEvicted,
    LoadDone,
    LookupDone,
    Observation,
    Planned,
    PutDone,
    Quiescent,
    ReportDelivered,
    Settled,
    StepScheduled,
    StoreCallRaised,
)
from kvstate.planner import Planner
from kvstate.protocols import (
    ExecutorFactory,
    ExecutorProtocol,
    PlannerFactory,
    PlannerProtocol,
    StoreProtocol,
)
from kvstate.records import (
    NULL_BLOCK_ID,
    CachedRequest,
    ExistsCall,
    GetCall,
    LoadReport,
    NewRequest,
    Plan,
    PutCall,
    Report,
    ResumedRequest,
    SchedulerStep,
)
from kvstate.variants import Variant, get_variant


def token_for(req_id: str, position: int, salt: int = 0) -> int:
    """Deterministic "sampled" token ids (no global randomness)."""
    return (sum(map(ord, req_id)) * 7919 + position * 104729 + salt * 15485863) % 50000


def rank_content(block_content: str, rank: int, put_step: int, group: int) -> str:
    """What rank ``rank`` holds for a block: its shard of the block's KV."""
    if not block_content:
        return "empty"
    return f"{block_content}|ns{rank // put_step}|g{group}"


class EngineRequest:
    __slots__ = (
        "req_id", "prompt", "tokens", "max_new_tokens", "computed", "blocks", "chain",
        "sent_hashes", "status", "resume", "pending_load", "load_async", "lookup",
        "hit", "transferred", "token_seed", "load_failed", "resume_hit", "rewind", "freed",
        "hashed",
    )

    def __init__(self, req_id: str, prompt: Sequence[int], max_new_tokens: int,
                 num_groups: int, hash_block: int,
                 hash_fn: Callable[[bytes | None, Sequence[int]], bytes] | None = None) -> None:
        self.req_id = req_id
        self.prompt = tuple(prompt)
        self.tokens: list[int] = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.computed = 0
        self.blocks: list[list[int]] = [[] for _ in range(num_groups)]
        self.chain = HashChain(hash_block, hash_fn=hash_fn)
        self.sent_hashes = 0
        self.status = "waiting"
        self.resume = False
        self.pending_load: int = 0
        self.load_async = False
        self.lookup = False
        self.hit: int | None = None  # lookup answer, once asked
        self.resume_hit: int | None = None  # the same, once per resumption
        # A synchronous load of this step failed: (first failed position,
        # tokens before the step's forward), applied after the forward.
        self.rewind: tuple[int, int] | None = None
        self.transferred = False  # prompt KV arrived from a prefill engine (P/D)
        self.token_seed = req_id  # what decode tokens are derived from
        # Its asynchronous load failed: no second lookup or allocation (the
        # connector's rule: `adapters.vllm.scheduler_side`).
        self.load_failed = False
        # Per group: table positions whose block left the sliding window and
        # was freed since the request was last scheduled (told to the
        # connector with its next ``CachedRequest``).
        self.freed: list[list[int]] = [[] for _ in range(num_groups)]
        # A cache (`Harness._hashes`): the tokens hashed so far and their
        # block hashes; never read without checking it against ``tokens``.
        self.hashed: tuple[tuple[int, ...], tuple[bytes, ...]] = ((), ())


class Harness:
    """See the module docstring. ``record`` keeps every observation in ``log``
    and every plan in ``plans`` (scenario tests read them; the simulator streams
    observations to a trace instead); ``keep_finished`` keeps finished requests
    in ``finished`` for inspection; ``auto_preempt`` preempts the newest running
    request when blocks run out, as vLLM's scheduler does (recompute)."""

    def __init__(
        self,
        config: ConnectorConfig,
        variant: str | Variant = "kvstate",
        num_blocks: int = 256,
        store: StoreProtocol | None = None,
        token_budget: int = 1 << 30,
        monitor: Monitor | None = None,
        *,
        record: bool = True,
        keep_finished: bool = True,
        auto_preempt: bool = False,
        sink: Callable[[Observation], None] | None = None,
        clock: Callable[[], float] | None = None,
        planner_factory: PlannerFactory | None = None,
        executor_factory: ExecutorFactory | None = None,
        block_hash: str = KVSTATE_HASH,
    ) -> None:
        """``block_hash``: how the engine hashes blocks (`kvstate.blockhash`):
        kvstate's own, or vLLM's ``vllm-sha256`` so the keys stored are the
        keys a vLLM engine looks up."""
        self.config = config
        self.variant = get_variant(variant) if isinstance(variant, str) else variant
        self.monitor = monitor if monitor is not None else Monitor(config, block_hash=block_hash)
        self.hash_fn = chain_hash_fn(block_hash)
        self.record = record
        self.keep_finished = keep_finished
        self.auto_preempt = auto_preempt
        self.sink = sink
        self.log: list[Observation] = []
        self.times: list[float] = []  # the clock at each logged observation
        self.now = 0.0
        self.clock = clock if clock is not None else self.virtual_now
        self.pool = BlockPool(num_blocks, self.observe)
        self.store: StoreProtocol = store if store is not None else MemoryStore()
        # Factories let another implementation of the same interfaces (your own
        # connector bookkeeping) run under this engine, these monitors and the
        # kvstate.testing machine (kvstate.protocols says what they must offer).
        make_planner: PlannerFactory = planner_factory or Planner
        make_executor: ExecutorFactory = executor_factory or Executor
        self.planner: PlannerProtocol = make_planner(config, self.variant)
        self.ranks: list[ExecutorProtocol[Any]] = [
            make_executor(config, r, self.variant, clock=self.clock, observer=self.observe)
            for r in range(config.world_size)
        ]
        self.token_budget = token_budget
        self.requests: dict[str, EngineRequest] = {}
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.finished: dict[str, EngineRequest] = {}
        self.outbox: list[Report] = []
        # rank -> (the job, as its executor's dequeue returned it; its pending call)
        self.current: dict[int, tuple[Any, ExistsCall | PutCall]] = {}
        self.published: list = []
        self.published_count = 0
        self.plans: list[Plan] = []
        self.preemptions = 0
        self.last_finished: list[EngineRequest] = []
        self._load_reports: list[LoadReport] = []

    def virtual_now(self) -> float:
        """The default clock: one unit per engine step (a bound method rather
        than a lambda so a harness can be pickled — the model checker copies
        states that way)."""
        return self.now

    # ------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        if self.record:
            self.log.append(obs)
            self.times.append(self.clock())
        if self.sink is not None:
            self.sink(obs)
        self.monitor.observe(obs)

    def add(self, req_id: str, prompt: Sequence[int], max_new_tokens: int = 0, *,
            lookup: bool = False, load_async: bool = False, transferred: bool = False,
            token_seed: str | None = None) -> None:
        """A client submits a request (reusing ``req_id`` only once it finished).
        ``transferred``: its prompt KV arrives directly from a prefill engine.
        ``token_seed`` (default: the id) determines the decode tokens; two
        requests with one seed generate the same text (the model checker's
        interchangeable requests)."""
        old = self.requests.get(req_id)
        if old is not None:
            raise ValueError(f"request {req_id!r} is still {old.status}")
        self.finished.pop(req_id, None)
        req = EngineRequest(req_id, prompt, max_new_tokens, len(self.config.groups),
                            self.config.hash_block, self.hash_fn)
        req.lookup = lookup and not transferred
        req.load_async = load_async
        req.transferred = transferred
        if token_seed is not None:
            req.token_seed = token_seed
        self.requests[req_id] = req
        self.waiting.append(req)

    def trace_text(self, **header: object) -> str:
        """The logged run as a kvstate trace (needs ``record``)."""
        from kvstate.trace import encode_header, encode_observation

        lines = [encode_header([self.config], protocol=self.variant.name, **header)]
        lines += [encode_observation(obs, i, 0, t)
                  for i, (obs, t) in enumerate(zip(self.log, self.times))]
        return "\n".join(lines) + "\n"

    def __getitem__(self, req_id: str) -> EngineRequest:
        req = self.requests.get(req_id) or self.finished.get(req_id)
        if req is None:
            raise KeyError(req_id)
        return req

    # ------------------------------------------------------------------
    # One engine step.

    def step(self, *, preempt: Iterable[str] = (), finish: Iterable[str] = (),
             hold: Iterable[str] = ()) -> Plan:
        self.deliver_reports()
        config = self.config
        budget = self.token_budget
        hold = set(hold)
        finished = [r for r in finish if r in self.requests]
        for req in self.running:
            if (req.computed >= len(req.prompt)
                    and len(req.tokens) - len(req.prompt) >= req.max_new_tokens
                    and req.computed >= len(req.tokens) - 1 and req.req_id not in finished):
                finished.append(req.req_id)
        engine_frees: list[int] = []
        self.last_finished = []
        for req_id in finished:
            req = self.requests.pop(req_id)
            self.last_finished.append(req)
            for table in req.blocks:
                engine_frees.extend(reversed(table))
            req.blocks = [[] for _ in config.groups]
            req.status = "finished"
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            if self.keep_finished:
                self.finished[req_id] = req
        preempted: list[str] = []
        for req_id in preempt:
            victim = self.requests.get(req_id)
            if victim is not None and victim.status == "running":
                self._preempt(victim, preempted)

        new: list[NewRequest] = []
        resumed: list[ResumedRequest] = []
        cached: list[CachedRequest] = []
        forward: list[tuple[EngineRequest, int]] = []
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            if req.req_id in hold:
                index += 1
                continue
            n = min(len(req.prompt) - req.computed, budget) if req.computed < len(req.prompt) else 1
            if req.computed + n > len(req.tokens):
                index += 1
                continue
            self._leave_window(req)
            new_blocks = self._grow(req, req.computed + n)
            while new_blocks is None and self.auto_preempt:
                # vLLM: preempt the lowest-priority running request (the newest),
                # possibly this one, and try again.
                victim = self.running[-1]
                self._preempt(victim, preempted)
                if victim is req:
                    break
                new_blocks = self._grow(req, req.computed + n)
            if new_blocks is None:
                index += 1
                continue
            ids = tuple(req.tokens[req.computed:req.computed + n])
            # After a rewind the chain already holds the recomputed tokens.
            hashed = req.chain.num_tokens
            fresh = tuple(req.chain.extend(req.tokens[hashed:req.computed + n])
                          if req.computed + n > hashed else ())
            freed: tuple[tuple[int, ...], ...] = ()
            if any(req.freed):
                freed = tuple(tuple(f) for f in req.freed)
                req.freed = [[] for _ in req.freed]
            cached.append(CachedRequest(req.req_id, req.computed, ids, new_blocks, fresh, freed))
            budget -= n
            forward.append((req, n))
            index += 1
        if not preempted:  # vLLM admits nothing new in a step that had to preempt
            for req in list(self.waiting):
                if budget <= 0:
                    break
                if req.req_id in hold or req.status != "waiting":
                    continue
                admitted = self._admit(req, budget)
                if admitted is None:
                    if req.status == "parked":
                        continue
                    break  # FCFS: the head of the queue waits for blocks
                record, n = admitted
                self.waiting.remove(req)
                self.running.append(req)
                if isinstance(record, ResumedRequest):
                    resumed.append(record)
                else:
                    new.append(record)
                budget -= n
                forward.append((req, n))

        sched = SchedulerStep(tuple(new), tuple(cached), tuple(resumed), tuple(preempted),
                              tuple(finished))
        self.observe(StepScheduled(sched))
        plan = self.planner.step(sched)
        if self.record:
            self.plans.append(plan)
        self.observe(Planned(plan))
        # A finished request's blocks are freed after request_finished, so a
        # delayed-free pin taken at finish (E1) still lands first.
        self.pool.ref(plan.pins)
        self.pool.unref(engine_frees)
        self.pool.unref(plan.releases)
        for executor in self.ranks:
            for call in executor.receive(plan):
                self._load(executor, call)
        self._finish_loads()
        for req, n in forward:
            self._forward(req, n)
            if req.rewind is not None:
                self._rewind(req)
        self.now += 1.0
        return plan

    def _preempt(self, req: EngineRequest, preempted: list[str]) -> None:
        """vLLM frees a preempted request's blocks inside schedule(), before
        anything else is scheduled: only the connector's pins hold them."""
        for table in req.blocks:
            self.pool.unref(reversed(table))
        req.blocks = [[] for _ in self.config.groups]
        req.freed = [[] for _ in self.config.groups]
        req.computed = 0
        req.chain = HashChain(self.config.hash_block, hash_fn=self.hash_fn)
        req.sent_hashes = 0
        req.status = "waiting"
        req.resume = True
        req.resume_hit = None
        if req in self.running:
            self.running.remove(req)
        self.waiting.appendleft(req)
        preempted.append(req.req_id)
        self.preemptions += 1

    def _leave_window(self, req: EngineRequest) -> None:
        """vLLM's ``SlidingWindowManager.remove_skipped_blocks`` when a running
        request is allocated again (before the allocation, whether or not it
        then gets its blocks): a window group's blocks wholly before the
        window of the first token to compute (``get_num_skipped_tokens``, as
        `_skip_window`) become the null block and are freed, from the
        right until a null block. The pool may hand them to another request
        at once; only the connector's pins keep them."""
        bs = self.config.block_size
        for g, (spec, table) in enumerate(zip(self.config.groups, req.blocks)):
            if spec.sliding_window is None:
                continue
            skipped = min(_blocks_before_window(spec.sliding_window, req.computed, bs), len(table))
            removed: list[int] = []
            for pos in range(skipped - 1, -1, -1):
                if table[pos] == NULL_BLOCK_ID:
                    break
                removed.append(table[pos])
                table[pos] = NULL_BLOCK_ID
                req.freed[g].append(pos)
            self.pool.unref(removed)

    def _grow(self, req: EngineRequest, tokens: int) -> tuple[tuple[int, ...], ...] | None:
        # Per group: a sliding-window table may start with null blocks (`_skip_window`).
        target = cdiv(tokens, self.config.block_size)
        needs = [max(0, target - len(table)) for table in req.blocks]
        if not any(needs):
            return tuple(() for _ in req.blocks)
        out: list[tuple[int, ...]] = []
        if sum(needs) > self.pool.num_free:
            return None
        for table, need in zip(req.blocks, needs):
            got = self.pool.allocate(need, req.req_id)
            assert got is not None
            table.extend(got)
            out.append(tuple(got))
        return tuple(out)

    def _admit(self, req: EngineRequest, budget: int) -> tuple[NewRequest | ResumedRequest, int] | None:
        """Schedule a waiting request: a resumption (looked up again, as vLLM
        asks the connector again; loaded synchronously) recomputes what the
        store does not hold; a new request may first look the store up and
        load a hit."""
        if req.resume:
            hit = self._resume_lookup(req)
            if hit:
                self._skip_window(req, hit)  # the tables are empty since the preemption
            n = min(len(req.tokens) - hit, budget)
            if self._grow(req, hit + n) is None:
                return None
            if req.resume_hit is not None:
                self._allocate(req, hit, False)
            req.resume = False
            req.resume_hit = None
            req.status = "running"
            req.computed = hit
            hashes = self._start_chain(req, hit + n)
            return ResumedRequest(req.req_id, tuple(req.tokens), hit, n,
                                  tuple(tuple(t) for t in req.blocks), hashes), n
        if req.transferred:
            return self._admit_transferred(req)
        if req.status == "waiting" and req.pending_load:
            # Loaded asynchronously while parked: scheduled now from the hit on.
            hit = req.computed
        else:
            if req.hit is None:
                req.hit = 0
                if req.lookup:
                    req.hit = self._look_up(req, req.prompt)
            hit = req.hit
            if hit:
                self._skip_window(req, hit)
            if self._grow(req, max(hit, min(len(req.prompt), hit + budget))) is None:
                return None
            if not req.load_failed:
                # After a failed asynchronous load whose first block failed,
                # vLLM frees the blocks and allocates afresh; the connector
                # neither asks the store again nor tells the planner (the
                # same generation, never admitted yet).
                self._allocate(req, hit, req.load_async and hit > 0)
            req.computed = hit
            if hit and req.load_async:
                req.pending_load = hit
                req.status = "parked"
                return None
        req.pending_load = 0
        n = min(len(req.prompt) - hit, budget)
        if self._grow(req, hit + n) is None:
            return None
        req.status = "running"
        hashes = self._start_chain(req, hit + n)
        return NewRequest(req.req_id, req.prompt, hit, n,
                          tuple(tuple(t) for t in req.blocks), hashes), n

    def _resume_lookup(self, req: EngineRequest) -> int:
        """A preempted request's lookup when it is re-admitted, once per
        resumption (the answer kept while it waits for blocks); none after
        a failed load (the connector's rule, as for a new request)."""
        if not req.lookup or req.load_failed:
            return 0
        if req.resume_hit is None:
            req.resume_hit = self._look_up(req, req.tokens)
        return req.resume_hit

    def _look_up(self, req: EngineRequest, tokens: Sequence[int]) -> int:
        """``get_num_new_matched_tokens``: the planner's lookup of ``tokens``
        against the store, observed; the hit in tokens."""
        hashes_all = list(self._hashes(req, tokens))
        query = self.planner.lookup(req.req_id, len(tokens), hashes_all)
        present = tuple(self.store.exists(-1, query.keys))
        hit = self.planner.lookup_answered(query, present)
        self.observe(LookupDone(req.req_id, query.generation, len(tokens),
                                tuple(hashes_all), query.keys, present, hit))
        return hit

    def _hashes(self, req: EngineRequest, tokens: Sequence[int]) -> tuple[bytes, ...]:
        """The block hashes of ``tokens`` (a prefix of the request's tokens:
        its prompt or all of them), as vLLM's ``Request.block_hashes`` holds
        them, hashed once per request. A lookup, the admission after it, a
        resumption and a failed load's recovery all hash the same prefix
        again (a tenth of a FAST'25 soak's time went to that). ``req.hashed``
        is only a cache, used where it agrees with ``tokens`` on the tokens
        both hold: a shorter prefix is a slice of it, a longer one goes on
        hashing from its last hash; anything else (tokens a rewind cut and
        the engine regrew differently, another request's cache) hashes from
        the start."""
        size = self.config.hash_block
        done, hashes = req.hashed
        whole = len(tokens) // size * size
        common = min(len(done), whole)
        if tokens[:common] != (done[:common] if type(tokens) is tuple
                               else list(done[:common])):
            done, hashes = (), ()
        if len(done) < whole:
            fn = self.hash_fn
            more = []
            parent = hashes[-1] if hashes else None
            for start in range(len(done), whole, size):
                parent = fn(parent, tokens[start:start + size])
                more.append(parent)
            done, hashes = tuple(tokens[:whole]), hashes + tuple(more)
            req.hashed = (done, hashes)
        return hashes[:whole // size]

    def _start_chain(self, req: EngineRequest, upto: int) -> tuple[bytes, ...]:
        """Admission: the request's chain over its first ``upto`` tokens (the
        step goes on extending it); the hashes of its whole blocks."""
        size = self.config.hash_block
        hashes = self._hashes(req, req.tokens[:upto])
        req.chain = HashChain.continued(size, hashes, req.tokens[len(hashes) * size:upto],
                                        self.hash_fn)
        return hashes

    def _skip_window(self, req: EngineRequest, hit: int) -> None:
        """vLLM's ``SlidingWindowManager`` on an external hit: the blocks
        wholly before the window of the first token to compute
        (``get_num_skipped_tokens(hit) // block_size``) are the null block,
        neither allocated nor loaded; the store holds a window group only
        where some aligned hit needs it. Once per admission (empty tables)."""
        bs = self.config.block_size
        for spec, table in zip(self.config.groups, req.blocks):
            if spec.sliding_window is not None and not table:
                table.extend([NULL_BLOCK_ID] * _blocks_before_window(spec.sliding_window, hit, bs))

    def _allocate(self, req: EngineRequest, external: int, load_async: bool) -> None:
        blocks = tuple(tuple(t) for t in req.blocks)
        self.observe(Allocated(req.req_id, blocks, 0, external, load_async))
        self.planner.allocate(req.req_id, blocks, 0, external, load_async)

    def _admit_transferred(self, req: EngineRequest) -> tuple[NewRequest, int] | None:
        """P/D: the prompt's KV arrived from the prefill engine straight into
        freshly allocated blocks (not through the store). As in vLLM, the
        decode engine recomputes the last prompt token to sample from."""
        config = self.config
        n_prompt = len(req.prompt)
        if self._grow(req, n_prompt) is None:
            return None
        self._allocate(req, 0, False)
        hashes = self._start_chain(req, n_prompt)
        for idx in range((n_prompt - 1) // config.block_size):
            digest = chunk_hash(req.chain.hashes, idx, config.hashes_per_block).hex()
            for table in req.blocks:
                self.pool.write(table[idx], digest)
        req.computed = n_prompt - 1
        req.status = "running"
        return NewRequest(req.req_id, req.prompt, req.computed, 1,
                          tuple(tuple(t) for t in req.blocks), hashes), 1

    def _forward(self, req: EngineRequest, n: int) -> None:
        """The model ran: blocks filled by this step get their content."""
        config = self.config
        bs = config.block_size
        before = req.computed
        req.computed += n
        for idx in range(before // bs, req.computed // bs):
            digest = chunk_hash(req.chain.hashes, idx, config.hashes_per_block).hex()
            for table in req.blocks:
                self.pool.write(table[idx], digest)
        if req.computed >= len(req.prompt) and req.computed >= len(req.tokens):
            if len(req.tokens) - len(req.prompt) < req.max_new_tokens:
                req.tokens.append(token_for(req.token_seed, len(req.tokens)))

    # ------------------------------------------------------------------
    # Loads.

    def _load(self, executor: ExecutorProtocol[Any], call: GetCall) -> None:
        ok: list[bool] = []
        for key, group, block in zip(call.keys, call.groups, call.block_ids):
            got = self.store.load(executor.rank, key, group, block)
            good = got is not None and got.split("|", 1)[0] == key_digest(key)
            ok.append(good)
            self.pool.write(block, got.split("|", 1)[0] if good and got else "")
        report = executor.load_answered(call, ok)
        failed = tuple(b for b, good in zip(call.block_ids, ok) if not good)
        self.observe(LoadDone(executor.rank, call.req_id, call.generation, failed,
                              report.failed_block_ids))
        self._load_reports.append(report)

    def _finish_loads(self) -> None:
        if not self._load_reports:
            return
        results = self.planner.on_load_reports(self._load_reports)
        self._load_reports = []
        bs = self.config.block_size
        for result in results:
            req = self.requests.get(result.req_id)
            if req is None:
                continue
            if result.failed_block_ids and len(self.config.groups) == 1:
                if req.status == "parked":
                    self._recover_async_load(req, set(result.failed_block_ids))
                    continue
                if req.status == "running":
                    first = _first_failed(req, set(result.failed_block_ids))
                    req.rewind = (first * bs, len(req.tokens))
                    continue
            # The engine recomputes exactly the blocks reported as failed.
            hashes = self._hashes(req, req.tokens)
            for table in req.blocks:
                for idx, block in enumerate(table):
                    if block in result.failed_block_ids and (idx + 1) * bs <= len(req.tokens):
                        self.pool.write(
                            block, chunk_hash(hashes, idx, self.config.hashes_per_block).hex())
            if req.status == "parked":
                req.status = "waiting"  # pending_load stays set: admitted from the hit

    def _rewind(self, req: EngineRequest) -> None:
        """vLLM 0.33's recovery of a failed synchronous load (policy
        ``recompute``): the forward pass ran over the failed blocks, so what
        it computed from the first failed block on is wrong (the blocks hold
        no valid KV: written empty, as a poisoned block) and its sampled
        token is dropped; ``num_computed_tokens`` is cut to the first failed
        block and the next step recomputes from there (a running request
        whose computed count went backwards: the planner's rewind)."""
        assert req.rewind is not None
        position, tokens = req.rewind
        req.rewind = None
        bs = self.config.block_size
        for idx in range(position // bs, cdiv(req.computed, bs)):
            for table in req.blocks:
                if idx < len(table):
                    self.pool.write(table[idx], "")
        del req.tokens[tokens:]
        req.computed = min(req.computed, position)

    def _recover_async_load(self, req: EngineRequest, failed: set[int]) -> None:
        """vLLM 0.33's recovery of a failed asynchronous load (policy
        ``recompute``: ``Scheduler._update_requests_with_invalid_blocks`` and
        ``_update_waiting_for_remote_kv``): the request's computed tokens
        are cut at its first failed block and it waits again; the valid
        prefix is kept (scheduled from there), or, when the first block
        failed, its blocks are freed and it is admitted afresh: without a
        second lookup (kvstate), or looked up again (upstream: H4, which K8
        reports). One KV-cache group only: vLLM refuses block-level load
        errors for several."""
        bs = self.config.block_size
        first = _first_failed(req, failed)
        req.computed = first * bs
        req.pending_load = req.computed
        req.status = "waiting"
        if req.computed == 0:
            for table in req.blocks:
                self.pool.unref(reversed(table))
            req.blocks = [[] for _ in self.config.groups]
            req.freed = [[] for _ in self.config.groups]
            if self.variant.lookup_after_failed_load:
                req.hit = None  # upstream asks the store again (H4)
                return
            req.hit = 0
        req.load_failed = True

    # ------------------------------------------------------------------
    # Ranks.

    def advance(self, rank: int, fail: BaseException | None = None) -> str:
        """Perform the next store call of ``rank``'s current job (dequeueing
        one if idle). Returns what happened: idle, exists, put, reported, lost.
        ``fail`` makes the pending call raise instead (a timeout, say)."""
        executor = self.ranks[rank]
        current = self.current.get(rank)
        if current is None:
            job = executor.dequeue()
            if job is None:
                return "idle"
            return self._handle(rank, job, executor.start(job))
        job, call = current
        del self.current[rank]
        try:
            if fail is not None:
                raise fail
            if isinstance(call, ExistsCall):
                present = tuple(self.store.exists(rank, call.keys))
                self.observe(ExistsAnswered(rank, job.meta.job_id, call.keys, present))
                return self._handle(rank, job, executor.exists_answered(job, present))
            contents = [rank_content(self.pool.content[block], rank, self.config.put_step, group)
                        for group, block in zip(call.groups, call.block_ids)]
            answers = self.store.put_many(rank, call.keys, call.groups, call.block_ids, contents)
            codes = []
            for key, group, block, cid, content, (code, accepted) in zip(
                    call.keys, call.groups, call.block_ids, call.chunk_ids, contents, answers):
                codes.append(code)
                self.observe(PutDone(rank, job.meta.job_id, job.meta.req_id,
                                     job.meta.generation, key, group, cid, block, content,
                                     code, accepted))
            return self._handle(rank, job, executor.put_answered(job, codes))
        except (StoreRaised, TimeoutError) as exc:
            self.observe(StoreCallRaised(rank, job.meta.job_id, str(exc)))
            return self._handle(rank, job, executor.raised(job, str(exc)))

    def _handle(self, rank: int, job: Any, out: ExistsCall | PutCall | Report | None) -> str:
        if out is None:
            return "lost"
        if isinstance(out, Report):
            self.outbox.append(out)
            return "reported"
        self.current[rank] = (job, out)
        return "exists" if isinstance(out, ExistsCall) else "put"

    def evict(self, key: str) -> None:
        """The store dropped a key (Mooncake evicts silently under pressure)."""
        if self.store.evict(key):
            self.observe(KeyEvicted(key))

    def run_rank(self, rank: int, max_calls: int = 1 << 30) -> None:
        for _ in range(max_calls):
            if self.advance(rank) == "idle":
                return

    def run_ranks(self) -> None:
        for rank in range(len(self.ranks)):
            self.run_rank(rank)

    def deliver_reports(self) -> None:
        if not self.outbox:
            return
        reports, self.outbox = self.outbox, []
        for report in reports:
            self.observe(ReportDelivered(report))
        settlement = self.planner.on_reports(reports)
        self.pool.unref(settlement.releases)
        if self.record:
            self.published.extend(settlement.published)
        self.published_count += len(settlement.published)
        self.observe(Settled(settlement))

    def run(self, steps: int, *, ranks: bool = True) -> None:
        for _ in range(steps):
            self.step()
            if ranks:
                self.run_ranks()

    def settle(self, max_steps: int = 10_000) -> Quiescent:
        """Run until nothing is left to do, then hand monitors the liveness check."""
        for _ in range(max_steps):
            self.run_ranks()
            busy = bool(self.requests)
            if not busy and not self.outbox and not any(e.queue for e in self.ranks) \
                    and not self.current:
                break
            self.step()
        return self.quiesce()

    def quiesce(self) -> Quiescent:
        """Deliver what is left and hand monitors the liveness check: every
        piece of state that should be gone at quiescence, by name."""
        self.deliver_reports()
        leftovers: list[tuple[str, int]] = []
        for name, value in self.planner.live_state_size().items():
            if value:
                leftovers.append((f"planner.{name}", value))
        for executor in self.ranks:
            for name, value in executor.live_state_size().items():
                if value:
                    leftovers.append((f"rank{executor.rank}.{name}", value))
        if self.requests:
            leftovers.append(("engine.requests", len(self.requests)))
        held = sum(1 for b, r in enumerate(self.pool.refs) if b and r > 0)
        quiet = Quiescent(held, tuple(leftovers))
        self.observe(quiet)
        return quiet


def _blocks_before_window(window: int, computed: int, block_size: int) -> int:
    """vLLM's ``SlidingWindowManager.get_num_skipped_tokens(computed) //
    block_size``: the blocks wholly before the window of the first token to
    compute, which the sliding-window group needs no more."""
    return max(0, computed - window + 1) // block_size


def _first_failed(req: EngineRequest, failed: set[int]) -> int:
    """The index of the request's first block whose load failed (vLLM cuts a
    request back to it; one KV-cache group)."""
    return min(idx for idx, block in enumerate(req.blocks[0]) if block in failed)
