"""``kvstate check``: the invariant monitors over a trace."""

from __future__ import annotations

import argparse
from typing import Any

from kvstate.invariants import INVARIANTS
from sim.commands.options import liveness_steps
from sim.commands.output import envelope


def run(args: argparse.Namespace) -> int:
    import time

    from sim.traces.check import check_trace

    started = time.perf_counter()
    result = check_trace(args.trace, liveness_steps=args.liveness_steps, at_end=args.at_end)
    seconds = time.perf_counter() - started
    rate = result.lines / seconds if seconds > 0 else 0.0
    violations = [{"invariant": f.invariant, "event_index": f.event_index, "line": line,
                   "engine": engine, "message": f.message} for line, engine, f in result.findings]
    if args.json:
        print(envelope({"ok": result.ok, "violations": violations, "lines": result.lines,
                          "observations": result.observations, "seconds": round(seconds, 3),
                          "lines_per_second": round(rate), "notes": result.notes}))
    else:
        print(f"{args.trace}: {result.observations} observations from {result.engines} "
              f"engine(s) checked against {len(INVARIANTS)} invariants in {seconds:.2f} s "
              f"({rate:,.0f} lines/s)")
        for v in violations[:20]:
            print(f"  line {v['line']}: {v['invariant']} {v['message']}")
        if len(violations) > 20:
            print(f"  ... {len(violations) - 20} more")
        for note in result.notes:
            print(f"  note: {note}")
        print(f"result: {'ok' if result.ok else 'VIOLATION'}")
    return 0 if result.ok else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("check", help="run the invariant monitors over a trace")
    parser.add_argument("trace")
    parser.add_argument("--liveness-steps", type=liveness_steps, default=None,
                       help="where the trace ends, jobs and pins older than this many "
                       "steps are stuck (default: the header's liveness_steps, else 64)")
    parser.add_argument("--at-end", choices=("closed", "open"), default="closed",
                       help="closed: the run ended with the trace (judge liveness); open: "
                       "the trace was cut mid-run (list what was left, judge nothing)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
