"""``kvstate diagram``: one machine's table as mermaid or SVG."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.output import envelope


def run(args: argparse.Namespace) -> int:
    from kvstate.diagrams import to_mermaid
    from kvstate.tables import MACHINES_BY_NAME

    if args.machine not in MACHINES_BY_NAME:
        raise UsageError(f"unknown machine {args.machine!r}; known: {', '.join(MACHINES_BY_NAME)}")
    if args.svg is not None:
        from sim.diagram_svg import command

        return command(args)
    missing: list[str] = []
    machine = MACHINES_BY_NAME[args.machine]
    if args.coverage:
        from kvstate.coverage import summarize
        from sim.coverage import trace_coverage

        cov = trace_coverage(args.coverage)
        text = to_mermaid(machine, coverage=cov.pairs(machine))
        (row,) = summarize(cov, [machine])
        missing = [f"{s} --{e.lower()}-->" for s, e in row.unseen]
    else:
        text = to_mermaid(machine)
    if args.json:
        print(envelope({"ok": True, "violations": [], "mermaid": text, "unvisited": missing}))
    else:
        print(text, end="")
        for line in missing:
            print(f"%% never seen: {line}")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("diagram", help="print one machine's table as mermaid")
    parser.add_argument("machine", help="request, job, pressure, skip, retry, pin, saved_mark")
    parser.add_argument("--coverage", nargs="+", metavar="TRACE",
                         help="colour the machine by the transitions these traces fired")
    parser.add_argument("--svg", metavar="OUT.svg",
                         help="draw the machine as an SVG state diagram (needs the 'plot' "
                         "extra); with --coverage, transitions green if fired, red if never")

    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
