"""What commands print: tables, violations, the one JSON result envelope."""

from __future__ import annotations

import json
from typing import Any


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def violation_dicts(result: Any) -> list[dict[str, Any]]:
    return [{"invariant": f.invariant, "event_index": f.event_index, "engine": engine,
             "message": f.message} for engine, f in result.findings]


def print_violation(result: Any) -> None:
    from kvstate.invariants import INVARIANTS

    engine, finding = result.findings[0]
    print(f"\nVIOLATION {finding.invariant}: {INVARIANTS[finding.invariant].statement}")
    print(f"  engine {engine}, observation {finding.event_index}: {finding.message}")
    if result.windows and result.windows[0]:
        print("  causal window (same request generation and job, oldest first):")
        for line in result.windows[0]:
            print("    " + (line if len(line) <= 220 else line[:217] + "..."))
    more = len(result.findings) - 1
    if more:
        print(f"  ({more} more finding{'s' if more > 1 else ''}; --json lists them all)")
    print(f"  reproduce: {result.options.command()}")


def envelope(result: dict[str, Any]) -> str:
    """The one JSON object every command prints with ``--json``: ``ok`` (bool),
    ``violations`` (a list of objects naming at least the ``invariant`` and a
    ``message``), then the command's own figures; keys sorted. A command that
    builds anything else is a bug, refused here rather than printed."""
    ok, violations = result.get("ok"), result.get("violations")
    if not isinstance(ok, bool) or not isinstance(violations, list) or not all(
            isinstance(v, dict) and "invariant" in v and "message" in v for v in violations):
        raise TypeError(f"not a result envelope: ok={ok!r}, violations={violations!r}")
    return json.dumps(result, sort_keys=True)
