"""``kvstate modelcheck``: exhaustive breadth-first model checking of a small scope."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.options import (
    MAX_SEED,
    add_protocols,
    int_in,
    positive_float,
    ray_cluster,
    workers_int,
)
from sim.commands.output import envelope
from sim.commands.paths import output_dir, output_file
from sim.commands.progress import Bar, add_progress_option, progress_for


def _bar_total(args: argparse.Namespace) -> tuple[float | None, str]:
    """The bar's scale: --max-states when given, else the --budget seconds, else
    none (a pulsing bar counting states: a scope's size is not known ahead)."""
    if args.max_states is not None:
        return args.max_states, "states"
    if args.budget is not None:
        return args.budget, "s"
    return None, "states"


def _on_report(args: argparse.Namespace, bar: Bar) -> Any:
    unit = _bar_total(args)[1]

    def show(r: Any) -> None:  # a sim.explore.modelcheck.model.Result, every ~5 s
        rate = f"{r.states / r.seconds:,.0f} states/s" if r.seconds else None
        if unit == "s":
            bar.update(completed=min(r.seconds, args.budget), states=f"{r.states:,}",
                       depth=r.depth, at=rate)
        else:
            bar.update(completed=r.states, depth=r.depth, at=rate)
    return show


@contextlib.contextmanager
def _first_ctrl_c_stops() -> Iterator[Callable[[], bool]]:
    """A ``stop`` for the search: the first Ctrl-C asks it to stop at the
    next frontier state (what it found is reported, and written to the
    checkpoint if there is one); a second one interrupts at once, as Ctrl-C
    does everywhere else."""
    asked: list[bool] = []

    def on_ctrl_c(signum: int, frame: Any) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(True)
        print("kvstate modelcheck: stopping at the next state (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False  # signals reach the main thread only
        return
    before = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, before)


def _resumed(args: argparse.Namespace) -> Any:
    """The checkpoint ``--resume`` names, checked against the other options."""
    from sim.explore.modelcheck.checkpoint import CheckpointError, load

    try:
        found = load(args.resume)
    except CheckpointError as e:
        raise UsageError(str(e)) from e
    if args.scope is not None and args.scope != found.scope.name:
        raise UsageError(f"{args.resume}: a checkpoint of scope {found.scope.name!r}, not "
                         f"{args.scope!r} (leave --scope out to go on with its own)")
    if args.protocol and args.protocol != [found.protocol]:
        raise UsageError(f"{args.resume}: a checkpoint of protocol {found.protocol!r}, not "
                         f"{', '.join(args.protocol)} (leave --protocol out)")
    if args.no_reduction and found.reduce:
        raise UsageError(f"{args.resume}: a checkpoint of the reduced search; --no-reduction "
                         "would be another one")
    return found


def _goes_on(r: Any, checkpoint: str | None) -> bool:
    """Whether ``checkpoint`` holds a search that stopped before its end
    (``--resume`` would go on with it)."""
    return checkpoint is not None and not r.exhaustive and r.violation is None


def run(args: argparse.Namespace) -> int:
    from sim.explore.modelcheck.model import SCOPES

    output_dir(args.out_dir, "--out-dir")
    resume = _resumed(args) if args.resume is not None else None
    scope_name = args.scope if args.scope is not None else (
        resume.scope.name if resume is not None else "default")
    names = list(SCOPES) if scope_name == "all" else [scope_name]
    if resume is None and any(n not in SCOPES for n in names):
        raise UsageError(f"unknown scope {scope_name!r}; known: all, {', '.join(SCOPES)}")
    protocols = [resume.protocol] if resume is not None else args.protocol or ["kvstate"]
    if args.checkpoint is not None:
        if len(names) * len(protocols) != 1:
            raise UsageError("--checkpoint holds one search: give one --scope (not all) and "
                             "one --protocol")
        output_file(args.checkpoint, "--checkpoint")
    with ray_cluster(args.ray) as cluster:
        if args.workers is not None:
            workers = args.workers
        elif cluster is not None:
            workers = cluster.cpus  # an actor per CPU of the cluster
        else:
            from sim.explore.modelcheck.compact import default_workers

            workers = default_workers()
        with _first_ctrl_c_stops() as stop:
            return _check_all(args, names, protocols, workers, cluster, resume, stop)


def _check_all(args: argparse.Namespace, names: list[str], protocols: list[str], workers: int,
               cluster: Any, resume: Any, stop: Callable[[], bool] | None) -> int:
    from kvstate.coverage import Coverage, format_table, never_fired, recording, summarize
    from sim.explore.modelcheck.model import SCOPES, format_action
    from sim.explore.modelcheck.search import check

    runs = []
    cov = Coverage()
    checkpoint = args.checkpoint or args.resume
    for protocol in protocols:
        for name in names:
            scope = resume.scope if resume is not None else SCOPES[name]
            if not args.json:
                print(scope.describe(), flush=True)
                if resume is not None:
                    print(f"  going on from {args.resume}: {resume.describe()}", flush=True)
            total, unit = _bar_total(args)
            with recording(cov), progress_for(args, label=f"{protocol}/{name}",
                                              total=total, unit=unit) as bar:
                r = check(scope, protocol, budget=args.budget, max_states=args.max_states,
                          reduce=resume.reduce if resume is not None else not args.no_reduction,
                          only=resume.only if resume is not None else None,
                          out_dir=args.out_dir, workers=workers,
                          cluster=cluster, stop=stop, checkpoint=checkpoint,
                          checkpoint_every=args.checkpoint_every, resume=resume,
                          progress=_on_report(args, bar) if bar.active else None)
            runs.append(r)
            if not args.json:
                verdict = "exhaustive" if r.exhaustive else (
                    "violation" if r.violation else "NOT exhaustive (interrupted)"
                    if r.interrupted else "NOT exhaustive (budget)")
                print(f"  {protocol}: {r.states} states, {r.transitions} transitions, depth "
                      f"{r.depth}, {r.seconds:.1f} s, {r.states_per_second:.0f} states/s "
                      f"({r.workers} worker{'s' if r.workers > 1 else ''}); {verdict}")
                if _goes_on(r, checkpoint):
                    print(f"  checkpoint: {checkpoint} (go on: kvstate modelcheck --resume "
                          f"{shlex.quote(checkpoint)})")
                elif checkpoint is not None:
                    print(f"  checkpoint: none written to {checkpoint} (the search ended: "
                          "nothing to go on from)")
                if r.violation:
                    v = r.violation
                    print(f"  VIOLATION {v.invariant}: {v.message}")
                    print(f"  shortest counterexample, {len(v.actions)} actions: "
                          + "; ".join(map(format_action, v.actions)))
                    if v.trace:
                        print(f"  trace: {v.trace} (kvstate replay {v.trace})")
            if r.interrupted:
                break
        if runs and runs[-1].interrupted:
            break  # the runs not started are not reported
    ok = all(r.ok for r in runs)
    interrupted = any(r.interrupted for r in runs)
    complete = all(r.exhaustive for r in runs)
    rows = summarize(cov)
    if args.json:
        print(envelope({"ok": ok, "exhaustive": complete, "interrupted": interrupted, "violations": [
            {"invariant": r.violation.invariant, "event_index": -1,
             "message": f"{r.protocol}/{r.scope}: {r.violation.message}",
             "actions": [format_action(a) for a in r.violation.actions],
             "trace": r.violation.trace} for r in runs if r.violation],
            "runs": [{"protocol": r.protocol, "scope": r.scope, "states": r.states,
                      "transitions": r.transitions, "depth": r.depth,
                      "seconds": round(r.seconds, 3), "exhaustive": r.exhaustive,
                      "workers": r.workers, "interrupted": r.interrupted,
                      "checkpoint": checkpoint if _goes_on(r, checkpoint) else None,
                      "states_per_second": round(r.states_per_second)} for r in runs],
            "never_fired": never_fired(rows)}))
    else:
        print("\ntable entries fired during the exploration:")
        print(format_table(rows, unseen=False))
        exhausted = [f"{r.protocol}/{r.scope}" for r in runs if r.exhaustive]
        if ok and exhausted:
            print("\nspec smell: table entries that no run fired, though "
                  f"{', '.join(exhausted)} visited every reachable state (reachable only "
                  "in a wider scope, or an entry nothing can take):")
            for row in rows:
                for state, event in row.unseen:
                    print(f"  {row.machine}: {state} --{event}-->")
    if interrupted:
        print("kvstate modelcheck: interrupted", file=sys.stderr)
        return 130
    if not ok:
        return 1
    return 0 if complete or not args.require_exhaustive else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("modelcheck", help="exhaustive breadth-first model checking of a "
                        "small scope; shortest counterexample as a trace")
    from sim.explore.modelcheck.model import SCOPES  # the help lists the scopes that exist

    parser.add_argument("--scope", default=None,
                        help=f"{', '.join(SCOPES)}, or all (default: default, or the "
                        "checkpoint's with --resume)")
    add_protocols(parser, budget=False)
    parser.add_argument("--budget", type=positive_float, default=None,
                    help="stop after this many seconds (then not exhaustive)")
    parser.add_argument("--max-states", type=int_in(1, MAX_SEED), default=None)
    parser.add_argument("--no-reduction", action="store_true",
                    help="no symmetry or counter reduction (for comparison)")
    parser.add_argument("--require-exhaustive", action="store_true",
                    help="exit 1 if a budget stopped the search")
    parser.add_argument("--out-dir", default=".", help="where counterexample traces go")
    parser.add_argument("--workers", type=workers_int, default=None,
                    help="processes expanding each breadth-first level (default: every "
                    "core; same states, counts and counterexamples for any number)")
    parser.add_argument("--ray", metavar="ADDRESS", default=None,
                    help="expand each level on a Ray cluster instead, an actor per CPU "
                    "(or --workers N actors): 'local' starts one here, else a cluster's "
                    "address; same answer as one process (needs pip install "
                    "'kvstate[ray]', and kvstate on the cluster's nodes)")
    parser.add_argument("--checkpoint", metavar="FILE", default=None,
                    help="write the search to FILE as it goes (every --checkpoint-every "
                    "seconds, at the end of a level) and when it stops early (Ctrl-C, "
                    "--budget, --max-states), to go on later with --resume FILE")
    parser.add_argument("--checkpoint-every", metavar="SECONDS", type=positive_float,
                    default=300.0, help="seconds between checkpoints (default: 300)")
    parser.add_argument("--resume", metavar="FILE", default=None,
                    help="go on with the search a --checkpoint FILE holds (its scope, "
                    "protocol and reduction; checkpoints keep being written there): the "
                    "same result as a search that never stopped")
    parser.add_argument("--json", action="store_true")
    add_progress_option(parser)
    parser.set_defaults(func=run)
