"""``kvstate campaign``: many seeds per protocol; what each violates."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.options import (
    DEFAULT_BUDGET,
    MAX_SEED,
    add_protocols,
    int_in,
    ray_cluster,
    seed_int,
    workers_int,
)
from sim.commands.output import envelope
from sim.commands.progress import Bar, add_progress_option, print_table, progress_for


def _on_seed(args: argparse.Namespace, bar: Bar) -> Any:
    def show(p: Any) -> None:  # a sim.explore.campaign.CampaignProgress
        found = ",".join(p.found) or "nothing"
        if args.seeds is not None:
            bar.update(completed=p.runs, found=found)
        else:  # a time budget: the bar is the budget's seconds
            bar.update(completed=min(p.seconds, args.budget), runs=p.runs, found=found)
    return show


def run(args: argparse.Namespace) -> int:
    import os

    from sim.explore.campaign import campaign, summary

    if args.seeds is not None and args.budget is not None:
        raise UsageError(f"--seeds {args.seeds} and --budget {args.budget:g}: a campaign runs "
                         "a number of seeds or for a time, not both")
    if args.seeds is not None and args.seed + args.seeds - 1 > MAX_SEED:
        # Each seed's reproduce command is `kvstate sim --seed N`, which takes
        # 64-bit seeds only.
        raise UsageError(f"--seed {args.seed} --seeds {args.seeds}: the last seed would be "
                         f"beyond {MAX_SEED} (2^63-1)")
    if args.budget is None:
        args.budget = DEFAULT_BUDGET

    results = []
    # One connection for every protocol (a campaign uses the one this process
    # holds): `local` starts Ray once, a joined cluster is checked once.
    # The cluster's failures (Ray missing, no cluster there, a node running
    # other code) are usage errors (exit 2) from here; anything else the
    # campaigns raise is theirs, with its traceback.
    with ray_cluster(args.ray) as cluster:
        for protocol in args.protocol or ["kvstate"]:
            with progress_for(args, label=protocol,
                              total=args.seeds if args.seeds is not None else args.budget,
                              unit="seeds" if args.seeds is not None else "s") as bar:
                results.append(campaign(
                    protocol, budget=args.budget, seeds=args.seeds, start_seed=args.seed,
                    on_seed=_on_seed(args, bar) if bar.active else None,
                    stop_when_found=args.stop_when_found,
                    workers=args.workers or os.cpu_count() or 1,
                    ray_address=None if cluster is None else cluster.address))
            if results[-1].interrupted:
                break  # Ctrl-C: report what was found, then exit 130
    failed_sites = [s for r in results if r.ok for s in r.never_fired] if args.require_fired \
        else []
    ok = all(r.ok for r in results) and not failed_sites
    interrupted = any(r.interrupted for r in results)
    code = 130 if interrupted else 0 if ok else 1
    if interrupted:  # the results below are the seeds folded before Ctrl-C
        print(f"kvstate campaign: interrupted after {sum(r.runs for r in results)} runs",
              file=sys.stderr)
    if args.json:
        print(envelope({"ok": ok, "violations": [
            {"invariant": inv, "event_index": -1, "message":
             f"{r.protocol}: first after {t}s; reproduce: {r.first_command[inv]}"}
            for r in results for inv, t in r.first_found.items()],
            "never_fired": failed_sites, "interrupted": interrupted,
            "campaigns": [summary(r) for r in results]}))
        return code
    rows = [["protocol", "runs", "seconds", "invariants violated (first found after s)"]]
    for r in results:
        found = ", ".join(f"{inv} {t:.2f}" for inv, t in sorted(r.first_found.items(),
                                                                key=lambda kv: kv[1]))
        rows.append([r.protocol, str(r.runs), f"{r.seconds:.1f}", found or "-"])
    print_table(args, rows)
    for r in results:
        if r.ok:
            print(f"{r.protocol}: fault sites fired: " + ", ".join(
                f"{k}={v}" for k, v in sorted(r.fired.items())))
            if r.never_fired:
                print(f"  never fired: {', '.join(r.never_fired)}")
    for r in results:
        for inv in sorted(r.first_command):
            print(f"{r.protocol} {inv}: reproduce: {r.first_command[inv]}")
    if failed_sites:
        print(f"FAIL: configured fault sites never fired: {', '.join(failed_sites)}")
    return code


def register(sub: Any) -> None:
    parser = sub.add_parser("campaign", help="many seeds per protocol; what each violates")
    add_protocols(parser)
    parser.set_defaults(budget=None)  # DEFAULT_BUDGET unless --seeds; both is an error
    parser.add_argument("--seeds", type=int_in(1, MAX_SEED), default=None,
                      help="run exactly this many seeds instead of a time budget")
    parser.add_argument("--seed", type=seed_int, default=0, help="first seed")
    parser.add_argument("--stop-when-found", action="store_true")
    parser.add_argument("--require-fired", action="store_true",
                      help="fail if a configured fault site never fired")
    parser.add_argument("--workers", type=workers_int, default=None,
                      help="local worker processes (default: every core)")
    parser.add_argument("--ray", metavar="ADDRESS", default=None,
                      help="run seeds as tasks on this Ray cluster ('local': start one here; "
                      "needs the ray extra)")
    parser.add_argument("--json", action="store_true")
    add_progress_option(parser)
    parser.set_defaults(func=run)
