"""``kvstate demo``: run the core on a scripted workload, checking invariants."""

from __future__ import annotations

import argparse
from typing import Any

from kvstate.invariants import INVARIANTS
from sim.commands.options import protocol_name
from sim.commands.output import envelope, table


def run(args: argparse.Namespace) -> int:
    from sim.simulator.demo import run_demo

    results = [run_demo(p) for p in [args.protocol, *args.compare]]
    ok = results[0]["ok"]
    if args.json:
        print(envelope({"ok": ok, "violations": results[0]["violations"],
                          "runs": results}))
        return 0 if ok else 1
    print("kvstate demo: 3 chat requests (two share a prefix) on 2 TP ranks, decode saving and")
    print("KV events on; a rank lagging a step, a preemption with a queued job, -200 pressure,")
    print("a failed and a raising put, a reused request id and a lookup that loads.")
    print(f"Every one of {results[0]['invariants_checked']} invariants is checked after "
          "every observation.\n")
    keys = ["steps", "observations", "generations", "save_jobs", "exists_keys", "dedup_hits",
            "puts", "puts_failed", "keys_stored", "events_published", "pins",
            "metadata_block_ids"]
    rows = [["", *[r["protocol"] for r in results]]]
    rows += [[k, *[str(r[k]) for r in results]] for k in keys]
    rows.append(["rank outcomes", *[", ".join(f"{k}={v}" for k, v in sorted(
        r["rank_outcomes"].items())) for r in results]])
    rows.append(["violations", *[str(len(r["violations"])) for r in results]])
    print(table(rows))
    for r in results:
        fired: dict[str, int] = {}
        for v in r["violations"]:
            fired[v["invariant"]] = fired.get(v["invariant"], 0) + 1
        if fired:
            print(f"\n{r['protocol']} violates:")
            for inv, count in sorted(fired.items()):
                print(f"  {inv} x{count}: {INVARIANTS[inv].statement}")
            first = r["violations"][0]
            print(f"  first: {first['invariant']} at observation {first['event_index']}: "
                  f"{first['message']}")
    print(f"\nresult: {'ok' if ok else 'VIOLATION'} for protocol {args.protocol}")
    return 0 if ok else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("demo", help="run the core on a scripted workload, checking invariants")
    parser.add_argument("--protocol", type=protocol_name, default="kvstate",
                      help="protocol variant whose result sets the exit code")
    parser.add_argument("--compare", type=protocol_name, nargs="*", default=["e2"],
                      help="further variants to run side by side (default: e2)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
