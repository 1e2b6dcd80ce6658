"""``kvstate diagram``: one machine's table as mermaid or SVG."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.output import envelope
from sim.commands.paths import output_file


def run(args: argparse.Namespace) -> int:
    from kvstate.diagrams import to_mermaid
    from kvstate.tables import MACHINES_BY_NAME

    if args.machine not in MACHINES_BY_NAME:
        raise UsageError(f"unknown machine {args.machine!r}; known: {', '.join(MACHINES_BY_NAME)}")
    if args.svg is not None:
        return run_svg(args)
    missing: list[str] = []
    machine = MACHINES_BY_NAME[args.machine]
    if args.coverage:
        from kvstate.coverage import summarize
        from sim.traces.coverage import trace_coverage

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


def check_output(svg: str) -> Path:
    """The output path, or a `UsageError` saying why it cannot be written."""
    out = Path(svg)
    if out.suffix.lower() != ".svg":
        raise UsageError(f"--svg {svg}: unknown suffix {out.suffix or '(none)'!r}; "
                         "the diagram is written as SVG, to a path ending in .svg")
    return output_file(svg, "--svg")


def run_svg(args: argparse.Namespace) -> int:
    """``kvstate diagram MACHINE --svg OUT.svg``: checks before it replays
    traces; the drawing is `sim.pictures.diagram_svg.draw`."""
    import json

    from kvstate.diagrams import to_mermaid
    from kvstate.tables import MACHINES_BY_NAME
    from sim.extras import require
    from sim.pictures.diagram_svg import draw

    machine = MACHINES_BY_NAME[args.machine]  # cmd_diagram checked the name
    require("matplotlib", "kvstate diagram --svg")
    output = check_output(args.svg)
    pairs = None
    guards = ""
    if args.coverage:
        from kvstate.coverage import summarize
        from sim.traces.coverage import trace_coverage

        cov = trace_coverage(args.coverage)
        pairs = cov.pairs(machine)
        (row,) = summarize(cov, [machine])
        guards = f"; guard outcomes {row.guard_outcomes_seen} of {row.guard_outcomes} seen"
    summary = draw(machine, output, pairs)
    missing = [f"{s} --{e.lower()}-->" for s, e in summary.never]
    if args.json:
        print(json.dumps({"ok": True, "violations": [], "svg": summary.output,
                          "mermaid": to_mermaid(machine, coverage=pairs),
                          "states": summary.states, "transitions": summary.transitions,
                          "covered": summary.covered, "unvisited": missing}, sort_keys=True))
        return 0
    print(f"{summary.output}: {summary.machine} machine, {summary.states} states, "
          f"{summary.transitions} transitions")
    if summary.covered is not None:
        print(f"  coverage of {len(args.coverage)} trace(s): {summary.covered} of "
              f"{summary.transitions} transitions fired{guards}")
        for line in missing:
            print(f"  never seen: {line}")
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
