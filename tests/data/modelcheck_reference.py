"""Writes ``modelcheck_reference.json``: what the pickle-digest model checker
(the legacy loop, deleted after this file was written) found on the
differential matrix, for `tests/test_modelcheck.py` to hold the value engine
to. Run from the repository root at the commit that still has the legacy loop:
``python tests/data/modelcheck_reference.py``.

For a run that ended in a violation: the legacy verdict (invariant, shortest
counterexample). For an exhaustive run: the legacy counts, and the same
states grouped by value key (`sim.explore.modelcheck.values`): the number of
groups, the transitions out of one state of each group, and how many groups
are quiet. The value engine must visit exactly those groups: the pickle digest
told apart some states that are equal as values (equal strings that were one
object in one state and two in another), the value key does not."""

from __future__ import annotations

import json
import pickle
import sys
from collections import deque
from pathlib import Path

import attrs

from kvstate.invariants import broken_by
from kvstate.variants import VARIANTS
from sim.explore.modelcheck.model import (
    SCOPES,
    Scope,
    ScopeRequest,
    _key,
    _symmetric,
    apply,
    enabled,
    initial,
)
from sim.explore.modelcheck.search import check
from sim.explore.modelcheck.values import form_for

TINY = SCOPES["tiny"]
TWINS_ONE_RANK = Scope(
    "twins-1", "two identical requests on one rank",
    (ScopeRequest("a", (1, 2, 3), decode=1), ScopeRequest("b", (1, 2, 3), decode=1)),
    world_size=1, num_blocks=6, faults=0, evictions=0, preemptions=0)
TWO_RANKS = attrs.evolve(SCOPES["default"], name="two-ranks", faults=0)
SCOPE_FINDS = {
    "e2": "tiny", "e1": "tiny", "e0": "tiny", "req-id-counter-ledger": "tiny",
    "no-pins-on-preemption": "tiny", "delayed-free-at-finish": "tiny",
    "parent-previous-emitted": "tiny", "retry-keyed-by-request": "tiny",
    "missing-finally": "tiny", "boundary-without-plus-one": "decode",
    "save-on-loading-step": "twins", "consumer-without-backfill": "tiny",
    "consumer-saves-prefill": "pd", "advance-offset-on-failure": "tiny",
    "stride-by-relative-chunk": "mla", "skip-exists-check": "tiny",
    "lookup-first-namespace": "twins", "swallow-load-errors": "load",
    "snapshot-from-zero": "tiny", "key-without-rank": "default",
}
EXHAUSTIVE = ("tiny", "twins-1", "default", "twins", "churn", "two-ranks", "decode", "pd",
              "mla", "load", "hybrid", "hybrid-pd")


def value_groups(scope: Scope, protocol: str, reduce: bool) -> dict[str, int]:
    """The legacy search's states grouped by value key (see the docstring)."""
    form = form_for(scope, protocol, reduce, None)
    symmetric = _symmetric(scope) if reduce else set()
    start = initial(scope, protocol, reduce=reduce)
    seen = {_key(start, reduce): pickle.dumps(start)}
    frontier = deque(seen.values())
    groups: dict[bytes, None] = {}
    transitions = quiet = 0
    while frontier:
        blob = frontier.popleft()
        s = pickle.loads(blob)
        group = form.key(s)
        first = group not in groups
        groups[group] = None
        actions = enabled(scope, s)
        moved = False
        for action in actions:
            child = pickle.loads(blob)
            apply(scope, child, action, symmetric)
            assert not child.h.monitor.findings, (scope.name, protocol)
            if form.key(child) != group:
                moved = True
            key = _key(child, reduce)
            if key not in seen:
                seen[key] = pickle.dumps(child)
                frontier.append(seen[key])
        if first:
            transitions += len(actions)
            quiet += not moved
    return {"states": len(groups), "transitions": transitions, "quiet_states": quiet}


def entry(scope: Scope, protocol: str, only: tuple[str, ...] | None, reduce: bool = True
          ) -> dict[str, object]:
    r = check(scope, protocol, engine="legacy", out_dir=None, only=only, reduce=reduce)
    out: dict[str, object] = {
        "scope": scope.name, "protocol": protocol, "only": list(only) if only else None,
        "reduce": reduce, "legacy": {"states": r.states, "transitions": r.transitions,
                                     "quiet_states": r.quiet_states, "depth": r.depth,
                                     "exhaustive": r.exhaustive}}
    if r.violation is not None:
        out["violation"] = {"invariant": r.violation.invariant,
                            "actions": [list(a) for a in r.violation.actions]}
    else:
        assert r.exhaustive
        out["values"] = value_groups(scope, protocol, reduce)
    print(out["scope"], protocol, out.get("values"), out.get("violation", {}).get("invariant")
          if "violation" in out else "", file=sys.stderr, flush=True)
    return out


def main() -> None:
    scopes = {**SCOPES, "twins-1": TWINS_ONE_RANK, "two-ranks": TWO_RANKS}
    rows = []
    for name in EXHAUSTIVE:
        rows.append(entry(scopes[name], "kvstate", None))
    rows.append(entry(TWINS_ONE_RANK, "kvstate", None, reduce=False))
    for variant in sorted(SCOPE_FINDS):
        own = broken_by(variant)
        rows.append(entry(SCOPES[SCOPE_FINDS[variant]], variant, own))
        rows.append(entry(TINY, variant, None))
    assert set(SCOPE_FINDS) == set(VARIANTS) - {"kvstate"}
    path = Path(__file__).with_name("modelcheck_reference.json")
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
