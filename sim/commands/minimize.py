"""``kvstate minimize``: shrink a failing run, write its trace."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.options import add_sim_options, int_in, options_from, validate_options
from sim.commands.output import envelope, violation_dicts
from sim.commands.paths import output_file, written_whole


def run(args: argparse.Namespace) -> int:
    import attrs

    from kvstate.invariants import INVARIANTS
    from sim.simulator.runner import SimOptions, simulate
    from sim.traces.minimize import NothingToMinimize, minimize, options_from_trace

    output_file(args.out, "--out")
    if args.invariant is not None and args.invariant not in INVARIANTS:
        raise UsageError(f"--invariant {args.invariant}: no such invariant (known: "
                         f"{', '.join(INVARIANTS)})")
    given = options_from(args)
    if args.from_trace:
        default = SimOptions()
        ignored = [f"--{f.name.replace('_', '-')}" for f in attrs.fields(SimOptions)
                   if getattr(given, f.name) != getattr(default, f.name)]
        if ignored:
            raise UsageError(f"{args.from_trace}: a trace brings its run's options; give a "
                             f"trace or options, not both ({', '.join(ignored)})")
        options = options_from_trace(args.from_trace)
    else:
        validate_options(given)
        options = given
    progress = None if args.json else (lambda m: print(m, file=sys.stderr))
    try:
        shrunk = minimize(options, invariant=args.invariant, max_runs=args.max_runs,
                          progress=progress)
    except NothingToMinimize as exc:
        raise UsageError(str(exc)) from None
    with written_whole(args.out) as out:
        simulate(shrunk.options, trace=out)
    if args.json:
        print(envelope({"ok": False, "violations": violation_dicts(shrunk.result),
                          "invariant": shrunk.invariant, "runs": shrunk.runs,
                          "passes": shrunk.passes, "command": shrunk.options.command(),
                          "trace": args.out}))
    else:
        print(f"minimized {shrunk.invariant} in {shrunk.runs} runs: "
              f"{shrunk.original.requests} -> {shrunk.options.requests} requests, "
              f"{len(shrunk.original.faults)} -> {len(shrunk.options.faults)} fault sites, "
              f"world size {shrunk.original.world_size} -> {shrunk.options.world_size}")
        print(f"trace: {args.out}  (kvstate replay {args.out}; kvstate check {args.out})")
        print(f"reproduce: {shrunk.options.command()}")
    return 1


def register(sub: Any) -> None:
    parser = sub.add_parser("minimize", help="shrink a failing run, write its trace")
    parser.add_argument("from_trace", nargs="?", help="a failing simulator trace (or give options)")
    add_sim_options(parser)
    parser.add_argument("--invariant", help="keep this invariant failing (default: the first)")
    parser.add_argument("--max-runs", type=int_in(1, 100_000), default=200)
    parser.add_argument("--out", default="minimized.jsonl")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
