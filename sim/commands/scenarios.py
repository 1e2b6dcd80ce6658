"""``kvstate scenarios``: the named hazard scenarios."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.options import protocol_name
from sim.commands.output import envelope, table


def run(args: argparse.Namespace) -> int:
    from kvstate.scenarios import SCENARIOS
    from kvstate.scenarios import run as run_scenario

    names = args.scenario or list(SCENARIOS)
    for name in names:
        if name not in SCENARIOS:
            raise UsageError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    protocols = args.protocol or ["kvstate"]
    results: list[dict[str, Any]] = []
    for name in names:
        for protocol in protocols:
            h = run_scenario(name, protocol)
            results.append({
                "scenario": name,
                "protocol": protocol,
                "fired": sorted(h.monitor.fired()),
                "violations": [{"invariant": f.invariant, "event_index": f.event_index,
                                "message": f.message} for f in h.monitor.findings],
            })
    ok = not any(r["violations"] for r in results)
    if args.json:
        print(envelope({"ok": ok, "violations": [dict(v, scenario=r["scenario"],
                                                        protocol=r["protocol"])
                                                   for r in results for v in r["violations"]],
                          "runs": results}))
    else:
        rows = [["scenario", "protocol", "invariants violated"]]
        rows += [[r["scenario"], r["protocol"], " ".join(r["fired"]) or "-"] for r in results]
        print(table(rows))
    return 0 if ok else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("scenarios", help="run the named hazard scenarios")
    parser.add_argument("scenario", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--protocol", type=protocol_name, action="append",
                      help="variant to run (repeatable; default: kvstate)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
