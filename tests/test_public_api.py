"""The public API: ``kvstate.__all__``, its lazy loading, and the extension
point's Protocols (kvstate's own classes fit them; a planner and executor of
one's own run under the harness)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kvstate
from kvstate import (
    ConnectorConfig,
    Executor,
    ExecutorProtocol,
    Harness,
    JobProtocol,
    MemoryStore,
    Planner,
    PlannerProtocol,
    StoreProtocol,
)
from kvstate.protocols import MetadataPolicy, RetryPolicy
from kvstate.variants import VARIANTS


def test_every_public_name_resolves() -> None:
    assert len(kvstate.__all__) == len(set(kvstate.__all__))
    for name in kvstate.__all__:
        assert getattr(kvstate, name) is not None, name
    assert set(kvstate.__all__) <= set(dir(kvstate))


def test_star_import_and_unknown_name() -> None:
    namespace: dict[str, Any] = {}
    exec("from kvstate import *", namespace)
    assert {"Planner", "Executor", "Monitor", "TraceReader", "Harness"} <= set(namespace)
    try:
        kvstate.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("unknown attribute resolved")


def test_import_is_lazy() -> None:
    """``import kvstate`` loads none of the submodules until a name is used."""
    code = ("import sys, kvstate; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvstate.', 'sim'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_py_typed_ships() -> None:
    assert (Path(kvstate.__file__).parent / "py.typed").is_file()


def test_own_classes_fit_the_protocols() -> None:
    config = ConnectorConfig(block_size=4, world_size=2)
    h = Harness(config)
    assert isinstance(h.planner, PlannerProtocol)
    assert isinstance(Planner(config), PlannerProtocol)
    assert all(isinstance(e, ExecutorProtocol) for e in h.ranks)
    assert isinstance(MemoryStore(), StoreProtocol)
    import random

    from sim.simulator.faults import Faults
    from sim.simulator.kernel import Kernel
    from sim.simulator.store import SimStore
    sim_store = SimStore(Kernel(0), Faults(random.Random(0)), 8, lambda key: None)
    assert isinstance(sim_store, StoreProtocol)
    for variant in VARIANTS.values():
        metadata: MetadataPolicy = variant.metadata
        retry: RetryPolicy = variant.retry
        assert callable(metadata.slice) and callable(metadata.resolve)
        assert callable(retry.get) and callable(retry.put)


class CountingPlanner(Planner):
    """A planner of one's own (here: kvstate's, counting steps)."""

    def __init__(self, config: ConnectorConfig, variant: Any) -> None:
        super().__init__(config, variant)
        self.steps = 0

    def step(self, sched: Any) -> Any:
        self.steps += 1
        return super().step(sched)


class WrappedExecutor:
    """An executor of one's own that wraps kvstate's: it offers exactly what
    `ExecutorProtocol` lists and nothing else."""

    def __init__(self, config: ConnectorConfig, rank: int, variant: Any, *, clock: Any,
                 observer: Any) -> None:
        self._inner = Executor(config, rank, variant, clock=clock, observer=observer)
        self.rank = rank
        self.jobs_started = 0

    @property
    def queue(self) -> Any:
        return self._inner.queue

    def receive(self, plan: Any, *, loads: bool = True) -> Any:
        return self._inner.receive(plan, loads=loads)

    def dequeue(self) -> Any:
        job = self._inner.dequeue()
        assert job is None or isinstance(job, JobProtocol)
        return job

    def start(self, job: Any) -> Any:
        self.jobs_started += 1
        return self._inner.start(job)

    def exists_answered(self, job: Any, present: Any) -> Any:
        return self._inner.exists_answered(job, present)

    def put_answered(self, job: Any, codes: Any) -> Any:
        return self._inner.put_answered(job, codes)

    def raised(self, job: Any, error: str) -> Any:
        return self._inner.raised(job, error)

    def load_answered(self, call: Any, ok: Any) -> Any:
        return self._inner.load_answered(call, ok)

    def live_state_size(self) -> dict[str, int]:
        return self._inner.live_state_size()


def test_own_planner_and_executor_run_under_the_harness() -> None:
    config = ConnectorConfig(block_size=4, world_size=2, save_decode_cache=True)
    h = Harness(config, planner_factory=CountingPlanner, executor_factory=WrappedExecutor)
    assert all(isinstance(e, ExecutorProtocol) for e in h.ranks)
    h.add("a", list(range(13)), max_new_tokens=5)
    quiet = h.settle()
    assert not h.monitor.findings and not quiet.leftovers
    assert isinstance(h.planner, CountingPlanner) and h.planner.steps > 0
    assert all(isinstance(e, WrappedExecutor) and e.jobs_started for e in h.ranks)
