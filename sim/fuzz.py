"""``kvstate fuzz``: the Hypothesis stateful machine with a time budget.

Runs ``kvstate.testing.ConnectorMachine`` for a protocol in rounds of
``examples`` random programs (a fresh seed each round) until the budget is
spent or an invariant breaks; Hypothesis then shrinks the failing program and
interleaving, and the machine writes it as a replayable trace.
"""

from __future__ import annotations

import re
import time
from typing import Any

import attrs


@attrs.define
class FuzzResult:
    protocol: str
    rounds: int
    seconds: float
    invariant: str | None
    rules: int | None
    trace: str | None
    message: str | None

    @property
    def ok(self) -> bool:
        return self.invariant is None


def fuzz(protocol: str, budget: float = 60.0, examples: int = 200, steps: int = 50,
         out_dir: str = ".") -> FuzzResult:
    import os

    from hypothesis import HealthCheck, settings
    from hypothesis.errors import Flaky

    from kvstate.testing import ConnectorMachine

    os.environ["KVSTATE_FUZZ_DIR"] = out_dir
    machine: Any = type(f"Fuzz_{protocol}", (ConnectorMachine,), {"variant": protocol})
    started = time.perf_counter()
    rounds = 0
    from hypothesis.stateful import run_state_machine_as_test

    while time.perf_counter() - started < budget:
        rounds += 1
        try:
            # Hypothesis draws its own randomness here (a fuzzer, not a replay);
            # what it finds is reproducible through the trace it writes.
            run_state_machine_as_test(machine, settings=settings(
                max_examples=examples, stateful_step_count=steps, deadline=None,
                derandomize=False, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck)))
        except (AssertionError, Flaky) as exc:
            text = str(exc)
            found = re.search(r"(\b[SK]\d+) after (\d+) rules", text)
            trace = re.search(r"trace: (\S+)", text)
            return FuzzResult(protocol, rounds, round(time.perf_counter() - started, 3),
                              found.group(1) if found else "unknown",
                              int(found.group(2)) if found else None,
                              trace.group(1) if trace else None, text.splitlines()[0])
    return FuzzResult(protocol, rounds, round(time.perf_counter() - started, 3), None, None,
                      None, None)
