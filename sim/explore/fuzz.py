"""``kvstate fuzz``: the Hypothesis stateful machine with a time budget.

Runs ``kvstate.testing.ConnectorMachine`` for a protocol in rounds of
``examples`` random programs (a fresh seed each round) until the budget is
spent or an invariant breaks; Hypothesis then shrinks the failing program and
interleaving, and the machine writes it as a replayable trace.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvstate.config import GroupKind, GroupSpec


@attrs.define
class FuzzResult:
    protocol: str
    rounds: int
    seconds: float
    invariant: str | None
    rules: int | None
    trace: str | None
    message: str | None
    profile: str = "both"

    @property
    def ok(self) -> bool:
        return self.invariant is None


@attrs.frozen
class FuzzProgress:
    """Where a fuzz run stands after each program Hypothesis ran (``on_example``;
    shrinking a failure runs programs too)."""

    protocol: str
    rounds: int  # the round under way, from 1
    examples: int  # programs run so far, every round together
    seconds: float  # wall seconds since the run started


# Engine shapes the machine runs in: every rank stores its own heads; MLA-style
# striding, each chunk stored by one rank (as the campaign varies it); a decode
# node of a P/D pair whose prompts arrive from a prefill node; and one prompt
# family, so lookups hit.
PROFILES: dict[str, dict[str, Any]] = {
    "both": {},
    "striding": {"put_step": 2},
    "consumer": {"role": "kv_consumer"},
    # One prompt family: every lookup can hit, so loads and load failures abound.
    "shared": {"prompt_families": 1},
    # A hybrid model: full attention plus a 4-token sliding window that keeps
    # the block before each 8-token boundary, its groups sharing hashes, with
    # MLA-style striding (a chunk's two groups are owned by different ranks).
    "hybrid": {"put_step": 2, "alignment": 8,
               "groups": (GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 4))},
    # The same model on a P/D decode node: only decode-phase chunks are saved.
    "hybrid-pd": {"role": "kv_consumer", "alignment": 8,
                  "groups": (GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 4))},
}
_MACHINE_KNOBS = ("prompt_families",)

# The CI profile: derandomized, so a test run is a fixed program set.
CI_EXAMPLES, CI_STEPS = 60, 40


def machine_for(protocol: str, profile: str = "both",
                only: tuple[str, ...] | None = None) -> Any:
    from kvstate.testing import ConnectorMachine

    if profile not in PROFILES:
        raise ValueError(f"unknown fuzz profile {profile!r} (known: {', '.join(PROFILES)})")
    knobs = {k: v for k, v in PROFILES[profile].items() if k in _MACHINE_KNOBS}
    fields = {k: v for k, v in PROFILES[profile].items() if k not in _MACHINE_KNOBS}
    config = attrs.evolve(ConnectorMachine.config, **fields)
    return type(f"Fuzz_{protocol}_{profile}", (ConnectorMachine,),
                {"variant": protocol, "config": config, "only": only, **knobs})


def fuzz(protocol: str, budget: float = 60.0, examples: int = 200, steps: int = 50,
         out_dir: str = ".", profile: str = "both", derandomize: bool = False,
         only: tuple[str, ...] | None = None,
         on_example: Callable[[FuzzProgress], None] | None = None) -> FuzzResult:
    """Rounds of ``examples`` programs until ``budget`` seconds are spent or an
    invariant breaks. ``derandomize`` runs one fixed round (the CI profile).
    ``on_example`` is called after every program (at its teardown)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.errors import Flaky

    machine = machine_for(protocol, profile, only)
    started = time.perf_counter()
    rounds = 0
    if on_example is not None:
        machine = _reporting(machine, protocol, on_example, started, lambda: rounds)
    from hypothesis.stateful import run_state_machine_as_test

    # The machine writes a trace for every failing program, and shrinking
    # runs dozens (~90 for one variant's CI profile): they go to a scratch
    # directory, and only the shrunk one Hypothesis reports is kept.
    with _scratch_traces() as scratch:
        while time.perf_counter() - started < budget and not (derandomize and rounds):
            rounds += 1
            try:
                # Hypothesis draws its own randomness here (a fuzzer, not a
                # replay); what it finds is reproducible through its trace.
                run_state_machine_as_test(machine, settings=settings(
                    max_examples=examples, stateful_step_count=steps, deadline=None,
                    derandomize=derandomize, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck)))
            except (AssertionError, Flaky) as exc:
                text = str(exc)
                found = re.search(r"(\b[SK]\d+) after (\d+) rules", text)
                trace = re.search(r"trace: (\S+)", text)
                return FuzzResult(protocol, rounds, round(time.perf_counter() - started, 3),
                                  found.group(1) if found else "unknown",
                                  int(found.group(2)) if found else None,
                                  _keep(trace.group(1), scratch, out_dir) if trace else None,
                                  text.splitlines()[0], profile)
    return FuzzResult(protocol, rounds, round(time.perf_counter() - started, 3), None, None,
                      None, None, profile)


@contextlib.contextmanager
def _scratch_traces() -> Iterator[str]:
    """A scratch directory the machine writes its traces to
    (``KVSTATE_FUZZ_DIR``, as it was before afterwards), removed at the end."""
    import os
    import tempfile

    before = os.environ.get("KVSTATE_FUZZ_DIR")
    with tempfile.TemporaryDirectory(prefix="kvstate-fuzz-") as scratch:
        os.environ["KVSTATE_FUZZ_DIR"] = scratch
        try:
            yield scratch
        finally:
            if before is None:
                os.environ.pop("KVSTATE_FUZZ_DIR", None)
            else:
                os.environ["KVSTATE_FUZZ_DIR"] = before


def _keep(path: str, scratch: str, out_dir: str) -> str:
    """Move the reported trace from the scratch directory into ``out_dir``."""
    import os
    import shutil

    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(scratch):
        return path  # not one of ours (a machine subclass writing elsewhere)
    os.makedirs(out_dir, exist_ok=True)
    kept = os.path.join(out_dir, os.path.basename(path))
    shutil.move(path, kept)
    return kept


def _reporting(machine: Any, protocol: str, on_example: Callable[[FuzzProgress], None],
               started: float, rounds: Callable[[], int]) -> Any:
    """``machine`` calling ``on_example`` after each program's own teardown (same
    name, so nothing Hypothesis reports changes)."""
    examples = 0

    def teardown(self: Any) -> None:
        nonlocal examples
        try:
            machine.teardown(self)
        finally:
            examples += 1
            on_example(FuzzProgress(protocol, rounds(), examples,
                                    time.perf_counter() - started))

    return type(machine.__name__, (machine,), {"teardown": teardown})


def fuzz_ci(protocol: str, profiles: tuple[str, ...] = tuple(PROFILES),
            out_dir: str = ".", only: tuple[str, ...] | None = None) -> FuzzResult:
    """The CI profile in each engine shape until one finds a violation."""
    started = time.perf_counter()
    result = None
    for profile in profiles:
        result = fuzz(protocol, budget=float("inf"), examples=CI_EXAMPLES, steps=CI_STEPS,
                      out_dir=out_dir, profile=profile, derandomize=True, only=only)
        if not result.ok:
            break
    assert result is not None
    result.seconds = round(time.perf_counter() - started, 3)
    return result
