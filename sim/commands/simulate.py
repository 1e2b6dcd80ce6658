"""``kvstate sim``: the deterministic simulator (the main job)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from sim.commands.options import add_sim_options, options_from, validate_options
from sim.commands.output import envelope, print_violation, table, violation_dicts
from sim.commands.paths import output_file, written_whole
from sim.commands.progress import add_progress_option, progress_for


def run(args: argparse.Namespace) -> int:
    from sim.simulator.runner import simulate

    options = options_from(args)
    validate_options(options)
    if args.trace is not None:
        output_file(args.trace, "--trace")
    with (written_whole(args.trace) if args.trace is not None else contextlib.nullcontext()) \
            as out, progress_for(args, label=options.protocol, total=options.requests,
                                 unit="arrived") as bar:
        # arrivals so far (every 200) of --requests; then it settles
        result = simulate(options, trace=out, hash_trace=args.check_determinism,
                          progress=(lambda done, total: bar.update(completed=done))
                          if bar.active else None,
                          stop_at_first=not args.keep_going)
    determinism: dict[str, Any] | None = None
    if args.check_determinism:
        with progress_for(args, label=f"{options.protocol} rerun", total=options.requests,
                          unit="arrived") as bar:
            again = simulate(options, hash_trace=True, stop_at_first=not args.keep_going,
                             progress=(lambda done, total: bar.update(completed=done))
                             if bar.active else None)
        determinism = {"first": result.trace_sha256, "second": again.trace_sha256,
                       "identical": result.trace_sha256 == again.trace_sha256}
    ok = result.ok and (determinism is None or determinism["identical"])
    if args.json:
        print(envelope({"ok": ok, "violations": violation_dicts(result),
                          "figures": result.figures, "faults": {
                              "rates": result.fault_rates, "fired": result.fault_fired},
                          "trace_sha256": result.trace_sha256, "determinism": determinism,
                          "command": options.command()}))
        return 0 if ok else 1
    setup = "kv_both engine" if options.setup == "both" else \
        "prefill engine (kv_producer) + decode engine (kv_consumer, save_decode_cache)"
    print(f"kvstate sim: protocol {options.protocol}, seed {options.seed}, {setup}, "
          f"{options.world_size} TP ranks, block size {options.block_size}")
    workload = (f"synthetic, {options.requests} requests at {options.rate}/s with shared prefixes"
                if options.workload == "synthetic" else
                f"FAST'25 trace, {options.requests} requests, lengths / {options.scale}")
    print(f"workload: {workload}")
    print("fault swarm (site, per-visit rate when on):")
    width = max((len(site) for site in options.faults), default=0)
    for site in options.faults:
        rate = result.fault_rates.get(site)
        fired = result.fault_fired.get(site, 0)
        state = f"on  {rate:.3f}  fired {fired}" if rate is not None else "off"
        print(f"  {site:{width}s} {state}")
    f = result.figures
    rows = [["simulated", f"{f['simulated_seconds']:.2f} s virtual, {f['wall_seconds']:.2f} s wall"],
            ["kernel events", str(f["kernel_events"])],
            ["observations checked", f"{f['observations']} x {f['invariants_checked']} invariants"],
            ["engine steps", str(f["steps"])],
            ["preemptions / id reuses", f"{f['preemptions']} / {f['id_reuses']}"],
            ["requests rejected at admission", str(f["rejected"])],
            ["store puts / exists keys", f"{f['store_puts']} / {f['store_exists_keys']}"],
            ["dedup hits at save (rate) / peak pins",
             f"{f['dedup_hits']} ({f['dedup_hit_rate']}) / {f['peak_pins']}"],
            ["store keys / evictions", f"{f['store_keys']} / {f['store_evictions']}"],
            ["events published", str(f["events_published"])],
            ["events per stored chunk / duplicate ratio",
             f"{f['events_per_stored_chunk']} / {f['event_duplicate_ratio']} "
             f"({f['events_duplicate']} duplicates, {f['events_republished']} at "
             f"resumptions, {f['chunks_stored']} chunks stored)"],
            ["router: blocks / orphans rejected", f"{f['consumer_blocks']} / "
             f"{f['consumer_orphans_rejected']}"],
            ["router: mean prefix hit at arrival", f"{f['mean_prefix_hit_chunks']} chunks"],
            ["liveness (settled)", "yes" if f["liveness_ok"] else
             f"NO: {f['liveness_stall']} stalled"]]
    print(table(rows))
    if determinism is not None:
        print(f"determinism: trace sha256 {determinism['first'][:16]}... twice: "
              f"{'identical' if determinism['identical'] else 'DIFFERENT'}")
    if args.trace:
        print(f"trace: {args.trace}")
    if f.get("liveness_detail"):
        print(f"liveness: {f['liveness_detail']}")
    if not result.ok:
        print_violation(result)
    print(f"\nresult: {'ok' if ok else 'VIOLATION'}")
    return 0 if ok else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("sim", help="run the deterministic simulator (the main job)")
    add_sim_options(parser)
    parser.add_argument("--trace", help="write the run's trace (JSON Lines) here")
    parser.add_argument("--keep-going", action="store_true",
                     help="run to the end past violations (to measure a buggy protocol's "
                     "figures); the figures count violations by invariant")
    parser.add_argument("--check-determinism", action="store_true",
                     help="run twice and compare the traces' hashes")
    parser.add_argument("--json", action="store_true")
    add_progress_option(parser)
    parser.set_defaults(func=run)
