"""The ``kvstate`` command line.

Exit codes (DESIGN.md §7): 0 ok, 1 an invariant was violated, 2 a usage or
input error. Every command takes ``--json`` and then prints exactly one JSON
object with at least ``ok`` and ``violations``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstate.invariants import INVARIANTS
from kvstate.variants import VARIANTS


class UsageError(Exception):
    pass


def _protocol(name: str) -> str:
    if name not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"unknown protocol {name!r}; known: {', '.join(VARIANTS)}")
    return name


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_demo(args: argparse.Namespace) -> int:
    from sim.demo import run_demo

    results = [run_demo(p) for p in [args.protocol, *args.compare]]
    ok = results[0]["ok"]
    if args.json:
        print(json.dumps({"ok": ok, "violations": results[0]["violations"],
                          "runs": results}, sort_keys=True))
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
    print(_table(rows))
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


def cmd_scenarios(args: argparse.Namespace) -> int:
    from kvstate.scenarios import SCENARIOS, run

    names = args.scenario or list(SCENARIOS)
    for name in names:
        if name not in SCENARIOS:
            raise UsageError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    protocols = args.protocol or ["kvstate"]
    results: list[dict[str, Any]] = []
    for name in names:
        for protocol in protocols:
            h = run(name, protocol)
            results.append({
                "scenario": name,
                "protocol": protocol,
                "fired": sorted(h.monitor.fired()),
                "violations": [{"invariant": f.invariant, "event_index": f.event_index,
                                "message": f.message} for f in h.monitor.findings],
            })
    ok = not any(r["violations"] for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "violations": [dict(v, scenario=r["scenario"],
                                                        protocol=r["protocol"])
                                                   for r in results for v in r["violations"]],
                          "runs": results}, sort_keys=True))
    else:
        rows = [["scenario", "protocol", "invariants violated"]]
        rows += [[r["scenario"], r["protocol"], " ".join(r["fired"]) or "-"] for r in results]
        print(_table(rows))
    return 0 if ok else 1


def cmd_specs(args: argparse.Namespace) -> int:
    from kvstate.specs import rendered_specs, write_specs

    root = Path(args.root)
    if args.write:
        written = write_specs(root)
        if not args.json:
            for path in written:
                print(f"wrote {path}")
        else:
            print(json.dumps({"ok": True, "violations": [], "written": [str(p) for p in written]}))
        return 0
    stale = [rel for rel, text in rendered_specs().items()
             if not (root / rel).exists() or (root / rel).read_text() != text]
    if args.json:
        print(json.dumps({"ok": not stale, "violations": [], "stale": stale}))
    else:
        print("\n".join(f"stale: {root / rel}" for rel in stale) or "specs are up to date")
    return 1 if stale else 0


def cmd_diagram(args: argparse.Namespace) -> int:
    from kvstate.diagrams import to_mermaid
    from kvstate.tables import MACHINES_BY_NAME

    if args.machine not in MACHINES_BY_NAME:
        raise UsageError(f"unknown machine {args.machine!r}; known: {', '.join(MACHINES_BY_NAME)}")
    text = to_mermaid(MACHINES_BY_NAME[args.machine])
    if args.json:
        print(json.dumps({"ok": True, "violations": [], "mermaid": text}))
    else:
        print(text, end="")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from sim.bench import bench_core, format_report, ratio_lines

    if args.quick:
        results = bench_core(contexts=(1024, 16384), requests=64, cycles=1, repeats=1)
    else:
        results = bench_core(contexts=tuple(args.context), requests=args.requests,
                             world=args.world_size, cycles=args.cycles, repeats=args.repeats)
    if args.json:
        print(json.dumps({"ok": True, "violations": [], "results": results,
                          "ratios": ratio_lines(results)}, sort_keys=True))
    else:
        print(f"core bookkeeping per request-step, {next(iter(results.values()))['requests']} "
              "decoding requests, block size 16, no store I/O (medians, microseconds)")
        print(format_report(results))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the core on a scripted workload, checking invariants")
    demo.add_argument("--protocol", type=_protocol, default="kvstate",
                      help="protocol variant whose result sets the exit code")
    demo.add_argument("--compare", type=_protocol, nargs="*", default=["e2"],
                      help="further variants to run side by side (default: e2)")
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=cmd_demo)

    scen = sub.add_parser("scenarios", help="run the named hazard scenarios")
    scen.add_argument("scenario", nargs="*", help="scenario names (default: all)")
    scen.add_argument("--protocol", type=_protocol, action="append",
                      help="variant to run (repeatable; default: kvstate)")
    scen.add_argument("--json", action="store_true")
    scen.set_defaults(func=cmd_scenarios)

    specs = sub.add_parser("specs", help="check (or --write) the generated files in specs/")
    specs.add_argument("--root", default="specs")
    specs.add_argument("--write", action="store_true")
    specs.add_argument("--json", action="store_true")
    specs.set_defaults(func=cmd_specs)

    bench = sub.add_parser("bench", help="benchmark the core's bookkeeping against e2")
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    bench.add_argument("--context", type=_positive_int, nargs="+", default=[1024, 131072])
    bench.add_argument("--requests", type=_positive_int, default=256)
    bench.add_argument("--world-size", type=_positive_int, default=8)
    bench.add_argument("--cycles", type=_positive_int, default=2)
    bench.add_argument("--repeats", type=_positive_int, default=3)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)

    diagram = sub.add_parser("diagram", help="print one machine's table as mermaid")
    diagram.add_argument("machine", help="request, job, pressure, skip, retry, pin, saved_mark")
    diagram.add_argument("--json", action="store_true")
    diagram.set_defaults(func=cmd_diagram)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"kvstate {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
