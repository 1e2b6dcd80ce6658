"""``kvstate fuzz``: Hypothesis stateful fuzzing with a time budget."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.options import add_protocols, positive_int
from sim.commands.output import envelope
from sim.commands.paths import output_dir
from sim.commands.progress import Bar, add_progress_option, print_table, progress_for

# Hypothesis's default is 50 rules a program; the budget is checked between
# rounds of --examples programs, so a round must end in bounded time (issue
# 32, class 2: --steps 100000000 ran far past --budget 2).
MAX_STEPS = 1_000
MAX_EXAMPLES = 10_000


def _at_most(limit: int) -> Any:
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected an integer in [1, {limit}], got {value}")
        return value
    return parse


steps_arg = _at_most(MAX_STEPS)
examples_arg = _at_most(MAX_EXAMPLES)


def _on_example(args: argparse.Namespace, bar: Bar) -> Any:
    def show(e: Any) -> None:  # a sim.explore.fuzz.FuzzProgress, after every program
        bar.update(completed=min(e.seconds, args.budget), round=e.rounds, programs=e.examples)
    return show


def run(args: argparse.Namespace) -> int:
    from sim.extras import require

    require("hypothesis", "kvstate fuzz")
    output_dir(args.out_dir, "--out-dir")
    from kvstate.coverage import Coverage, format_table, never_fired, recording, summarize
    from sim.explore.fuzz import fuzz

    cov = Coverage()
    results = []
    with recording(cov):
        for p in args.protocol or ["kvstate"]:
            with progress_for(args, label=p, total=args.budget, unit="s") as bar:
                results.append(fuzz(
                    p, budget=args.budget, examples=args.examples, steps=args.steps,
                    out_dir=args.out_dir, profile=args.profile,
                    on_example=_on_example(args, bar) if bar.active else None))
    ok = all(r.ok for r in results)
    rows_cov = summarize(cov)
    if args.json:
        print(envelope({"ok": ok, "violations": [
            {"invariant": r.invariant, "event_index": -1, "message": f"{r.protocol}: "
             f"{r.message} (shrunk to {r.rules} rules; trace {r.trace})"}
            for r in results if not r.ok],
            "runs": [{"protocol": r.protocol, "rounds": r.rounds, "seconds": r.seconds,
                      "invariant": r.invariant, "rules": r.rules, "trace": r.trace}
                     for r in results],
            "never_fired": never_fired(rows_cov)}))
        return 0 if ok else 1
    rows = [["protocol", "rounds", "seconds", "found", "shrunk rules", "trace"]]
    for r in results:
        rows.append([r.protocol, str(r.rounds), f"{r.seconds:.1f}", r.invariant or "-",
                     str(r.rules or "-"), r.trace or "-"])
    print_table(args, rows)
    print("\ntable entries the fuzzer's programs fired (shrinking included):")
    print(format_table(rows_cov, unseen=args.show_unseen))
    return 0 if ok else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("fuzz", help="Hypothesis stateful fuzzing with a time budget")
    add_protocols(parser)
    parser.add_argument("--examples", type=examples_arg, default=200,
                        help=f"programs per round (at most {MAX_EXAMPLES:,})")
    parser.add_argument("--steps", type=steps_arg, default=50,
                        help=f"rules per program (at most {MAX_STEPS:,}: the budget is "
                        "checked between rounds of programs, so one round must stay short)")
    parser.add_argument("--out-dir", default=".", help="where counterexample traces go")
    parser.add_argument("--profile", default="both",
                    choices=("both", "striding", "consumer", "shared", "hybrid", "hybrid-pd"),
                    help="engine shape: per-rank heads, MLA striding, a P/D decode node, "
                    "one prompt family (lookups hit, loads fail), or a hybrid model (full "
                    "attention + sliding window) with striding or on a P/D decode node")
    parser.add_argument("--show-unseen", action="store_true",
                    help="list the table entries and guard outcomes never fired")
    parser.add_argument("--json", action="store_true")
    add_progress_option(parser)
    parser.set_defaults(func=run)
