"""Hypothesis's stateful machine (`kvstate fuzz`): examples and steps a second."""

from __future__ import annotations

import time
from typing import Any


def bench_hypothesis(examples: int = 100, steps: int = 40) -> dict[str, Any]:
    """Rule steps per second of the connector machine against a trivial
    stateful machine (one counter, two rules, one invariant) under the same
    settings in the same run: the ratio is the cost of the model per step,
    over what Hypothesis itself costs."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        invariant,
        rule,
        run_state_machine_as_test,
    )

    from sim.explore.fuzz import machine_for

    class Trivial(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0
            self.rules_run = 0
            Trivial.instances.append(self)

        instances: list[Any] = []

        @rule()
        def up(self) -> None:
            self.n += 1
            self.rules_run += 1

        @rule()
        def down(self) -> None:
            self.n -= 1
            self.rules_run += 1

        @invariant()
        def bounded(self) -> None:
            assert abs(self.n) <= 10_000

    base = machine_for("kvstate")

    class Connector(base):  # type: ignore[misc, valid-type]
        instances: list[Any] = []

        def __init__(self) -> None:
            super().__init__()
            Connector.instances.append(self)

    out: dict[str, Any] = {}
    for label, machine in (("trivial", Trivial), ("connector", Connector)):
        started = time.perf_counter()
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
            database=None, suppress_health_check=list(HealthCheck)))
        seconds = time.perf_counter() - started
        done = sum(m.rules_run for m in machine.instances)
        out[f"{label} rule steps"] = done
        out[f"{label} steps/s"] = round(done / seconds)
    out["connector / trivial"] = round(out["connector steps/s"] / out["trivial steps/s"], 3)
    return out
