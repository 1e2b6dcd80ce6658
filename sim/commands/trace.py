"""``kvstate trace``: trace tools ('observed': the trace cut to its observed layer)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet): not the same file
        return False


def run(args: argparse.Namespace) -> int:
    from sim.commands.errors import UsageError
    from sim.commands.paths import output_file, written_whole
    from sim.traces.observed import write_observed

    if args.output in (None, "-"):
        cut = write_observed(args.trace, sys.stdout)
    else:
        output_file(args.output, "-o")
        if _same_file(args.trace, args.output):
            # The cut is written whole and then renamed over the output: it
            # would replace the annotated trace it was cut from.
            raise UsageError(f"-o {args.output}: that is the trace being read ({args.trace}); "
                             "the annotations would be lost: write the cut elsewhere")
        with written_whole(args.output) as out:
            cut = write_observed(args.trace, out)
        print(f"{args.trace}: {cut.lines_in} lines -> {cut.lines_out} observed lines in "
              f"{args.output} ({cut.records_dropped} annotation records dropped)")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("trace", help="trace tools: 'observed' cuts a trace to what an "
                           "engine would write (specs/trace.md)")
    trace_sub = parser.add_subparsers(dest="trace_command", required=True)
    observed = trace_sub.add_parser("observed", help="drop kvstate's annotations: generations, "
                                    "rank-state writes, verdicts, content tags")
    observed.add_argument("trace")
    observed.add_argument("-o", "--output", default=None,
                          help="write here (default: standard output)")
    observed.set_defaults(func=run)
