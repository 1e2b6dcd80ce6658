"""``kvstate coverage``: which table entries and guard outcomes traces exercised."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from sim.commands.output import envelope


def run(args: argparse.Namespace) -> int:
    from kvstate.coverage import format_table, summarize
    from sim.traces.coverage import trace_coverage

    rows = summarize(trace_coverage(args.traces))
    if args.json:
        print(envelope({"ok": True, "violations": [],
                          "machines": [attrs.asdict(r) for r in rows]}))
        return 0
    print(f"coverage of {len(args.traces)} trace(s), replayed through the tables")
    print(format_table(rows))
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("coverage", help="which table entries and guard outcomes traces "
                           "exercised (all machines), and which they never did")
    parser.add_argument("traces", nargs="+", metavar="TRACE")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
