"""A reusable Hypothesis stateful machine for connector bookkeeping.

``ConnectorMachine`` drives the engine model (`kvstate.harness`) with rules —
admit a request (sometimes reusing a finished id), run a scheduler step,
preempt, finish, let one rank perform its next store call, script the store's
next answer (ok, -200, another failure, an exception), evict — and checks the
whole invariant catalogue after every rule. Which rank moves next and what the
store answers are Hypothesis draws, so a failing example shrinks to a short
program *and* a short interleaving.

When an invariant breaks, the run is written as a kvstate trace (to
``KVSTATE_FUZZ_DIR``, default the working directory) and the assertion names
the file: ``kvstate replay FILE`` reproduces it and ``kvstate check FILE``
re-judges it.

To test your own bookkeeping, subclass and give the machine factories that
build your planner and executors (`kvstate.protocols.PlannerProtocol` and
`kvstate.protocols.ExecutorProtocol` list the methods and attributes the
harness uses)::

    class MyConnector(ConnectorMachine):
        planner_factory = MyPlanner
        executor_factory = MyExecutor

    TestMyConnector = MyConnector.TestCase

``hypothesis`` is needed (``pip install 'kvstate[test]'``); the core never
imports this module.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from pathlib import Path
from typing import Any, ClassVar

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, multiple, rule
except ImportError as exc:  # pragma: no cover
    raise ImportError("kvstate.testing needs Hypothesis: pip install 'kvstate[test]'") from exc

from kvstate.config import ConnectorConfig
from kvstate.harness import Harness
from kvstate.invariants import Monitor
from kvstate.memory_store import MemoryStore, StoreRaised
from kvstate.protocols import ExecutorFactory, PlannerFactory
from kvstate.store_codes import StoreCode

ANSWERS = (StoreCode.OK, StoreCode.NO_AVAILABLE_HANDLE, StoreCode.TRANSFER_FAIL, "raise")


class ConnectorMachine(RuleBasedStateMachine):
    """Override these class attributes to change what is tested."""

    config: ClassVar[ConnectorConfig] = ConnectorConfig(
        block_size=4, world_size=2, save_decode_cache=True, enable_kv_events=True,
        pressure_backoff=2.0)
    variant: ClassVar[str] = "kvstate"
    num_blocks: ClassVar[int] = 24
    only: ClassVar[tuple[str, ...] | None] = None  # check just these invariants
    # Distinct prompt families: 1 makes every prompt a prefix of one sequence,
    # so lookups hit and loads (and their failures) happen often.
    prompt_families: ClassVar[int] = 4
    planner_factory: ClassVar[PlannerFactory | None] = None
    executor_factory: ClassVar[ExecutorFactory | None] = None

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.rules_run = 0  # reported with a failure: the shrunk program's length
        self.answers: deque[int | str] = deque()
        self.get_answers: deque[int] = deque()
        self.store = store = MemoryStore(self._answer)
        self.h = Harness(self.config, self.variant, num_blocks=self.num_blocks, store=store,
                         token_budget=16, auto_preempt=True,
                         monitor=Monitor(self.config, only=self.only),
                         planner_factory=type(self).planner_factory,
                         executor_factory=type(self).executor_factory)

    # The store answers puts from a script the rules fill.
    def _answer(self, op: str, rank: int, key: str) -> int | BaseException:
        if op == "get" and self.get_answers:
            return self.get_answers.popleft()
        if op != "put" or not self.answers:
            return 0
        answer = self.answers.popleft()
        return StoreRaised("scripted") if answer == "raise" else int(answer)

    @rule(target=requests, req_id=st.sampled_from(("a", "b", "c")),
          length=st.integers(1, 14), salt=st.integers(0, 3), decode=st.integers(0, 6),
          load_async=st.booleans())
    def admit(self, req_id: str, length: int, salt: int, decode: int,
              load_async: bool) -> Any:
        """Salts 0-2 look the store up (and may load asynchronously); on a decode
        node (kv_consumer) salt 1 is a request whose prompt KV was transferred
        from a prefill node."""
        self.rules_run += 1
        if req_id in self.h.requests:
            return multiple()
        family = salt % self.prompt_families
        prompt = [(family * 7 + i) % 11 for i in range(length)]  # small vocabulary: shared prefixes
        self.h.add(req_id, prompt, decode, lookup=salt != 3, load_async=load_async,
                   transferred=salt == 1 and self.config.is_consumer)
        return req_id

    @rule()
    def step(self) -> None:
        self.rules_run += 1
        self.h.step()

    @rule(req_id=requests)
    def preempt(self, req_id: str) -> None:
        self.rules_run += 1
        self.h.step(preempt=[req_id])

    @rule(req_id=requests)
    def finish(self, req_id: str) -> None:
        self.rules_run += 1
        self.h.step(finish=[req_id])

    @rule(rank=st.integers(0, 1))
    def rank_moves(self, rank: int) -> None:
        self.rules_run += 1
        self.h.advance(rank % self.config.world_size)

    @rule(rank=st.integers(0, 1))
    def rank_catches_up(self, rank: int) -> None:
        """The rank performs every call it has (a rank that ran ahead): keeps
        programs short that need a prefix fully stored before a lookup."""
        self.rules_run += 1
        self.h.run_rank(rank % self.config.world_size, max_calls=64)

    @rule(answer=st.sampled_from(ANSWERS))
    def store_answers_next_put(self, answer: int | str) -> None:
        self.rules_run += 1
        self.answers.append(answer)

    @rule(code=st.sampled_from((StoreCode.TRANSFER_FAIL, -1)))
    def store_fails_next_get(self, code: int) -> None:
        self.rules_run += 1
        self.get_answers.append(code)

    @rule()
    def evict(self) -> None:
        self.rules_run += 1
        if self.store.objects:
            self.h.evict(next(iter(self.store.objects)))

    @invariant()
    def catalogue_holds(self) -> None:
        self._judge()

    def teardown(self) -> None:
        if not self.h.monitor.findings:
            self.answers.clear()
            self.get_answers.clear()
            self.h.settle(max_steps=400)
            self._judge()

    def _judge(self) -> None:
        findings = self.h.monitor.findings
        if findings:
            text = self.h.trace_text(source="kvstate.testing")
            name = hashlib.sha256(text.encode()).hexdigest()[:12]
            folder = Path(os.environ.get("KVSTATE_FUZZ_DIR", "."))
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"fuzz-{self.variant}-{name}.jsonl"
            path.write_text(text)
            first = findings[0]
            raise AssertionError(
                f"{first.invariant} after {self.rules_run} rules, at observation "
                f"{first.event_index}: {first.message}\ntrace: {path} (kvstate replay {path})")
