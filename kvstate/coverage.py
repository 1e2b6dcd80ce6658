"""Which table entries and guard outcomes a run exercised.

Every transition of every machine goes through `Machine.fire`, so coverage is
recorded there: `recording()` swaps in a recording ``fire`` for the duration of
a ``with`` block (nothing is paid when no one records) and collects the
(machine, state, event) triples that fired. The simulator, the fuzzer and the
model checker record live; a recorded trace is covered by replaying it, since
replay re-drives the same planner and executors through the same tables.

Guard outcomes. A guarded event (``Machine.guards``) is chosen by a predicate
in a state that lists it. Its *true* outcome is seen when the event fired
from such a state; its *false* outcome when, from that state, some *other*
event fired (the predicate was not the one that held). Both outcomes of every
guard in every state that lists it are what a thorough run shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from kvstate.tables import MACHINES, Machine


@attrs.define
class Coverage:
    """Fired (machine name, state, event) triples."""

    fired: set[tuple[str, Any, Any]] = attrs.Factory(set)

    def update(self, other: Coverage) -> None:
        self.fired |= other.fired

    def pairs(self, machine: Machine[Any, Any]) -> set[tuple[Any, Any]]:
        return {(s, e) for name, s, e in self.fired if name == machine.name}


_active: list[Coverage] = []
_PLAIN_FIRE = Machine.fire


def _recording_fire(self: Machine[Any, Any], key: Any, state: Any, event: Any) -> Any:
    nxt = _PLAIN_FIRE(self, key, state, event)
    for target in _active:
        target.fired.add((self.name, state, event))
    return nxt


@contextmanager
def recording(into: Coverage | None = None) -> Iterator[Coverage]:
    """Record every transition fired inside the block (nests; not thread-safe
    across concurrent recorders, which no driver uses)."""
    cov = into if into is not None else Coverage()
    if not _active:
        Machine.fire = _recording_fire  # type: ignore[method-assign]
    _active.append(cov)
    try:
        yield cov
    finally:
        _active.remove(cov)
        if not _active:
            Machine.fire = _PLAIN_FIRE  # type: ignore[method-assign]


def recording_now() -> bool:
    """Whether a `recording` block is open in this process (a model-checker
    worker in another process records its own only when the driver does)."""
    return bool(_active)


def add_fired(fired: Iterable[tuple[str, Any, Any]]) -> None:
    """Transitions that fired in another process (a model-checker worker or
    Ray actor, recording its own share) into every recording open here:
    without them a parallel search's table, and its "never fired" list,
    would be only the share this process expanded itself."""
    triples = set(fired)
    for target in _active:
        target.fired |= triples


@attrs.frozen
class MachineCoverage:
    machine: str
    entries: int
    seen: int
    unseen: tuple[tuple[str, str], ...]
    guard_outcomes: int
    guard_outcomes_seen: int
    unseen_guards: tuple[str, ...]


def entries(machine: Machine[Any, Any]) -> list[tuple[Any, Any]]:
    """Every legal (state, event) entry of the table, in declaration order."""
    return [(s, e) for s in machine.states for e in machine.table[s]]


def summarize(cov: Coverage, machines: Iterable[Machine[Any, Any]] = MACHINES) -> list[MachineCoverage]:
    out = []
    for machine in machines:
        seen = cov.pairs(machine)
        table = entries(machine)
        unseen = tuple((s.name, e.name) for s, e in table if (s, e) not in seen)
        outcomes = 0
        outcomes_seen = 0
        missing: list[str] = []
        for state in machine.states:
            for event in machine.table[state]:
                if event not in machine.guards:
                    continue
                left = {e for s, e in seen if s is state}
                for outcome, hit in (("true", event in left), ("false", bool(left - {event}))):
                    outcomes += 1
                    outcomes_seen += hit
                    if not hit:
                        missing.append(f"{state.name}: {event.name} guard {outcome}")
        out.append(MachineCoverage(machine.name, len(table), len(table) - len(unseen), unseen,
                                   outcomes, outcomes_seen, tuple(missing)))
    return out


def never_fired(rows: list[MachineCoverage]) -> dict[str, list[list[str]]]:
    """Per machine, the (state, event) entries no run fired (for JSON)."""
    return {r.machine: [list(pair) for pair in r.unseen] for r in rows}


def format_table(rows: list[MachineCoverage], *, unseen: bool = True) -> str:
    lines = [f"{'machine':<12} {'entries':>7} {'seen':>5} {'guard outcomes':>15} {'seen':>5}"]
    for r in rows:
        lines.append(f"{r.machine:<12} {r.entries:>7} {r.seen:>5} {r.guard_outcomes:>15} "
                     f"{r.guard_outcomes_seen:>5}")
    total = sum(r.entries for r in rows)
    seen = sum(r.seen for r in rows)
    g = sum(r.guard_outcomes for r in rows)
    gs = sum(r.guard_outcomes_seen for r in rows)
    lines.append(f"{'all':<12} {total:>7} {seen:>5} {g:>15} {gs:>5}")
    if unseen:
        for r in rows:
            for state, event in r.unseen:
                lines.append(f"  never seen: {r.machine} {state} --{event}-->")
            for text in r.unseen_guards:
                lines.append(f"  guard outcome never seen: {r.machine} {text}")
    return "\n".join(lines)
