"""The ``kvstate`` command line.

Exit codes: 0 ok, 1 an invariant was violated, 2 a usage or
input error. Every command takes ``--json`` and then prints exactly one JSON
object with at least ``ok`` and ``violations``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

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
    if not root.is_dir():
        raise UsageError(f"--root={root}: no specs directory there (run from a kvstate "
                         "checkout, point --root at its specs/, or --write to create one)")
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
    if args.svg:
        from sim.diagram_svg import command

        return command(args)
    missing: list[str] = []
    machine = MACHINES_BY_NAME[args.machine]
    if args.coverage:
        from kvstate.coverage import summarize
        from sim.coverage import trace_coverage

        cov = trace_coverage(args.coverage)
        text = to_mermaid(machine, coverage=cov.pairs(machine))
        (row,) = summarize(cov, [machine])
        missing = [f"{s} --{e.lower()}-->" for s, e in row.unseen]
    else:
        text = to_mermaid(machine)
    if args.json:
        print(json.dumps({"ok": True, "violations": [], "mermaid": text, "unvisited": missing}))
    else:
        print(text, end="")
        for line in missing:
            print(f"%% never seen: {line}")
    return 0


def cmd_coverage(args: argparse.Namespace) -> int:
    from kvstate.coverage import format_table, summarize
    from sim.coverage import trace_coverage

    rows = summarize(trace_coverage(args.traces))
    if args.json:
        print(json.dumps({"ok": True, "violations": [],
                          "machines": [attrs.asdict(r) for r in rows]}, sort_keys=True))
        return 0
    print(f"coverage of {len(args.traces)} trace(s), replayed through the tables")
    print(format_table(rows))
    return 0


def cmd_modelcheck(args: argparse.Namespace) -> int:
    from kvstate.coverage import Coverage, format_table, never_fired, recording, summarize
    from sim.modelcheck import SCOPES, check, format_action

    names = list(SCOPES) if args.scope == "all" else [args.scope]
    if any(n not in SCOPES for n in names):
        raise UsageError(f"unknown scope {args.scope!r}; known: all, {', '.join(SCOPES)}")
    protocols = args.protocol or ["kvstate"]
    runs = []
    cov = Coverage()
    for protocol in protocols:
        for name in names:
            scope = SCOPES[name]
            if not args.json:
                print(scope.describe(), flush=True)
            with recording(cov):
                r = check(scope, protocol, budget=args.budget, max_states=args.max_states,
                          reduce=not args.no_reduction, out_dir=args.out_dir,
                          engine=args.engine, workers=args.workers)
            runs.append(r)
            if not args.json:
                verdict = "exhaustive" if r.exhaustive else (
                    "violation" if r.violation else "NOT exhaustive (budget)")
                print(f"  {protocol}: {r.states} states, {r.transitions} transitions, depth "
                      f"{r.depth}, {r.seconds:.1f} s, {r.states_per_second:.0f} states/s; "
                      f"{verdict}")
                if r.violation:
                    v = r.violation
                    print(f"  VIOLATION {v.invariant}: {v.message}")
                    print(f"  shortest counterexample, {len(v.actions)} actions: "
                          + "; ".join(map(format_action, v.actions)))
                    if v.trace:
                        print(f"  trace: {v.trace} (kvstate replay {v.trace})")
    ok = all(r.ok for r in runs)
    complete = all(r.exhaustive for r in runs)
    rows = summarize(cov)
    if args.json:
        print(json.dumps({"ok": ok, "exhaustive": complete, "violations": [
            {"invariant": r.violation.invariant, "event_index": -1,
             "message": f"{r.protocol}/{r.scope}: {r.violation.message}",
             "actions": [format_action(a) for a in r.violation.actions],
             "trace": r.violation.trace} for r in runs if r.violation],
            "runs": [{"protocol": r.protocol, "scope": r.scope, "states": r.states,
                      "transitions": r.transitions, "depth": r.depth,
                      "seconds": round(r.seconds, 3), "exhaustive": r.exhaustive,
                      "states_per_second": round(r.states_per_second)} for r in runs],
            "never_fired": never_fired(rows)}, sort_keys=True))
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
    if not ok:
        return 1
    return 0 if complete or not args.require_exhaustive else 1


def _bench_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM connector bench runs in its own process (`adapters.vllm.bench`):
    it needs the vllm extra, and upstream's connector keeps a ZMQ context that
    would block this process's exit."""
    import subprocess

    command = [sys.executable, "-m", "adapters.vllm.bench", "--json"]
    if args.quick:
        command += ["--context", "1024", "--context", "4096", "--requests", "16",
                    "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise UsageError("bench vllm needs vLLM 0.33.0 (adapters/vllm/requirements-cpu.txt, "
                         f"then pip install --no-deps vllm==0.33.0): {done.stderr[-500:]}")
    report: dict[str, Any] = json.loads(lines[-1])
    if not args.json:
        from adapters.vllm.bench import format_vllm

        print(format_vllm(report))
    return report


def cmd_bench(args: argparse.Namespace) -> int:
    from sim.bench import bench_core, bench_memory, bench_sim, format_report, ratio_lines

    parts = set(args.part or ["core", "sim"])
    report: dict[str, Any] = {}
    if "core" in parts:
        if args.quick:
            core = bench_core(contexts=(1024, 16384), requests=64, cycles=1, repeats=1)
        else:
            core = bench_core(contexts=tuple(args.context), requests=args.requests,
                              world=args.world_size, cycles=args.cycles, repeats=args.repeats)
        report["core"] = {"results": core, "ratios": ratio_lines(core)}
        if not args.json:
            print(f"core bookkeeping per request-step, {next(iter(core.values()))['requests']} "
                  "decoding requests, block size 16, no store I/O (medians, microseconds)")
            print(format_report(core) + "\n")
    if "sim" in parts:
        sim = bench_sim(requests=80 if args.quick else 400)
        report["sim"] = sim
        if not args.json:
            print("simulator, every invariant checked after every observation:")
            print(_table([[k, str(v)] for k, v in sim.items()]) + "\n")
    if "memory" in parts:
        counts = (1000, 4000) if args.quick else tuple(args.memory_requests)
        memory = bench_memory(counts)
        report["memory"] = memory
        if not args.json:
            print("peak memory of FAST'25 runs (fresh process each, scale 512):")
            print(_table([[k, str(v)] for k, v in memory.items()]))
    if "variants" in parts:
        from sim.bench import bench_variants

        variants = bench_variants(trials=2 if args.quick else 5, budget=10 if args.quick else 60)
        report["variants"] = variants
        if not args.json:
            print("campaigns per variant (first violation; median wall seconds to find):")
            rows = [["variant", "invariants found", "median s"]]
            for name, row in variants.items():
                rows.append([name, " ".join(row["found"]) or "-",
                             str(row.get("median_seconds_to_find", "-"))])
            print(_table(rows))
    if "tools" in parts:
        from sim.bench import bench_tools, format_tools

        def show(name: str, row: dict[str, Any]) -> None:
            if not args.json:
                print(format_tools({name: row}).splitlines()[1], flush=True)

        if not args.json:
            print("bug-finding power: each variant against the simulator campaign, the "
                  "Hypothesis CI profile and the model checker, checking the variant's own "
                  "invariants (first violation each)")
        tools = bench_tools(args.tool_protocol, sim_budget=5 if args.quick else 30,
                            mc_budget=10 if args.quick else 60, out_dir=args.out_dir,
                            progress=show)
        report["tools"] = tools
        if not args.json:
            print("\n" + format_tools(tools))
    if "modelcheck" in parts:
        from sim.bench import bench_modelcheck

        report["modelcheck"] = bench_modelcheck(
            "tiny" if args.quick else "default", max_states=None if args.quick else 15_000)
        if not args.json:
            print("model checker, kvstate: legacy vs compact engine (same states, same run):")
            print(_table([[k, str(v)] for k, v in report["modelcheck"].items()]))
    if "campaign" in parts:
        from sim.bench import bench_campaign

        report["campaign"] = bench_campaign(seeds=4 if args.quick else 16)
        if not args.json:
            print("campaign seeds per second with 1, 2 and all workers (same seeds):")
            print(_table([[k, str(v)] for k, v in report["campaign"].items()]))
    if "check" in parts:
        from sim.bench import bench_check

        report["check"] = bench_check(requests=80 if args.quick else 400)
        if not args.json:
            print("trace check against bare parsing (same lines, same process, best of 3):")
            print(_table([[k, str(v)] for k, v in report["check"].items()]))
    if "vllm" in parts:
        report["vllm"] = _bench_vllm(args)
    if "hypothesis" in parts:
        from sim.bench import bench_hypothesis

        report["hypothesis"] = bench_hypothesis(examples=20 if args.quick else 100)
        if not args.json:
            print("Hypothesis rule steps per second (same run, same settings):")
            print(_table([[k, str(v)] for k, v in report["hypothesis"].items()]))
    if args.json:
        print(json.dumps({"ok": True, "violations": [], **report}, sort_keys=True))
    return 0


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


# --------------------------------------------------------------------------
# Simulator commands.


def _faults_arg(text: str) -> tuple[str, ...]:
    from sim.faults import SITES

    if text in ("all", ""):
        return tuple(SITES)
    if text == "none":
        return ()
    sites = tuple(t.strip() for t in text.split(",") if t.strip())
    for site in sites:
        if site not in SITES:
            raise argparse.ArgumentTypeError(
                f"unknown fault site {site!r}; known: {', '.join(SITES)}, all, none")
    return sites


def _groups_arg(text: str) -> tuple[str, ...]:
    from sim.runner import parse_groups

    groups = tuple(t.strip() for t in text.split(","))
    try:
        parse_groups(groups)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return groups


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def add_sim_options(parser: argparse.ArgumentParser) -> None:
    from sim.runner import SimOptions

    d = SimOptions()
    group = parser.add_argument_group("simulation")
    group.add_argument("--seed", type=_nonneg_int, default=d.seed)
    group.add_argument("--protocol", type=_protocol, default=d.protocol)
    group.add_argument("--setup", choices=("both", "pd"), default=d.setup,
                       help="one kv_both engine, or prefill + decode engines sharing a store")
    group.add_argument("--workload", choices=("synthetic", "fast25"), default=d.workload)
    group.add_argument("--fast25-path", default=d.fast25_path,
                       help="a trace in the FAST'25 format, plain or .gz (default: the packaged "
                            "FAST'25 conversation trace)")
    group.add_argument("--scale", type=_positive_int, default=d.scale,
                       help="divide FAST'25 token counts by this (any positive integer)")
    group.add_argument("--requests", type=_positive_int, default=d.requests)
    group.add_argument("--rate", type=_positive_float, default=d.rate,
                       help="synthetic arrivals per second")
    group.add_argument("--world-size", type=_positive_int, default=d.world_size)
    group.add_argument("--put-step", type=_positive_int, default=d.put_step,
                       help="TP striding: ranks per stored copy (must divide --world-size)")
    group.add_argument("--block-size", type=_positive_int, default=d.block_size)
    group.add_argument("--num-blocks", type=_positive_int, default=d.num_blocks)
    group.add_argument("--store-capacity", type=_positive_int, default=d.store_capacity)
    group.add_argument("--token-budget", type=_positive_int, default=d.token_budget)
    group.add_argument("--max-model-len", type=_nonneg_int, default=d.max_model_len,
                       help="refuse requests whose prompt plus max tokens exceed this "
                       "(vLLM's admission; 0: what the KV cache holds)")
    group.add_argument("--events", dest="events", action="store_true", default=d.events)
    group.add_argument("--no-events", dest="events", action="store_false")
    group.add_argument("--faults", type=_faults_arg, default=d.faults,
                       help="comma-separated fault sites, 'all' or 'none'")
    group.add_argument("--settle-time", type=_positive_float, default=d.settle_time)
    group.add_argument("--groups", type=_groups_arg, default=d.groups,
                       help="KV-cache groups, comma-separated: 'full' or 'swa:W' (sliding "
                       "window of W tokens), e.g. full,swa:8 (a hybrid model)")
    group.add_argument("--alignment", type=_nonneg_int, default=d.alignment,
                       help="tokens a stored prefix ends on (the lcm block size; a multiple "
                       "of --block-size; 0: the block size). A sliding-window group stores "
                       "only the window before each boundary")


def options_from(args: argparse.Namespace) -> Any:
    import attrs

    from sim.runner import SimOptions

    values = {f.name: getattr(args, f.name) for f in attrs.fields(SimOptions)
              if hasattr(args, f.name)}
    return SimOptions(**values)


def _validate(options: Any) -> None:
    from sim.runner import build_configs

    try:
        build_configs(options)
    except ValueError as exc:
        raise UsageError(str(exc).replace("ConnectorConfig.", "--").replace("_", "-")) from None
    from sim.engine import kv_capacity_tokens

    capacity = kv_capacity_tokens(options.num_blocks, options.block_size, len(options.groups))
    if options.max_model_len > capacity:
        # vLLM refuses to start when the KV cache cannot hold one max-length request.
        raise UsageError(f"--max-model-len={options.max_model_len}: the KV cache holds "
                         f"{capacity} tokens (--num-blocks x --block-size)")


def _violation_dicts(result: Any) -> list[dict[str, Any]]:
    return [{"invariant": f.invariant, "event_index": f.event_index, "engine": engine,
             "message": f.message} for engine, f in result.findings]


def _print_violation(result: Any) -> None:
    from kvstate.invariants import INVARIANTS

    engine, finding = result.findings[0]
    print(f"\nVIOLATION {finding.invariant}: {INVARIANTS[finding.invariant].statement}")
    print(f"  engine {engine}, observation {finding.event_index}: {finding.message}")
    if result.windows and result.windows[0]:
        print("  causal window (same request generation and job, oldest first):")
        for line in result.windows[0]:
            print("    " + (line if len(line) <= 220 else line[:217] + "..."))
    more = len(result.findings) - 1
    if more:
        print(f"  ({more} more finding{'s' if more > 1 else ''}; --json lists them all)")
    print(f"  reproduce: {result.options.command()}")


def cmd_sim(args: argparse.Namespace) -> int:
    from sim.runner import simulate

    options = options_from(args)
    _validate(options)
    out = open(args.trace, "w") if args.trace else None  # noqa: SIM115 - closed below
    try:
        interactive = sys.stderr.isatty() and not args.json

        def bar(done: int, total: int) -> None:
            filled = 30 * done // max(total, 1)
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} requests",
                  end="", file=sys.stderr, flush=True)

        result = simulate(options, trace=out, hash_trace=args.check_determinism,
                          progress=bar if interactive else None,
                          stop_at_first=not args.keep_going)
        if interactive:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    finally:
        if out is not None:
            out.close()
    determinism: dict[str, Any] | None = None
    if args.check_determinism:
        again = simulate(options, hash_trace=True, stop_at_first=not args.keep_going)
        determinism = {"first": result.trace_sha256, "second": again.trace_sha256,
                       "identical": result.trace_sha256 == again.trace_sha256}
    ok = result.ok and (determinism is None or determinism["identical"])
    if args.json:
        print(json.dumps({"ok": ok, "violations": _violation_dicts(result),
                          "figures": result.figures, "faults": {
                              "rates": result.fault_rates, "fired": result.fault_fired},
                          "trace_sha256": result.trace_sha256, "determinism": determinism,
                          "command": options.command()}, sort_keys=True))
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
    for site in options.faults:
        rate = result.fault_rates.get(site)
        fired = result.fault_fired.get(site, 0)
        state = f"on  {rate:.3f}  fired {fired}" if rate is not None else "off"
        print(f"  {site:13s} {state}")
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
    print(_table(rows))
    if determinism is not None:
        print(f"determinism: trace sha256 {determinism['first'][:16]}... twice: "
              f"{'identical' if determinism['identical'] else 'DIFFERENT'}")
    if args.trace:
        print(f"trace: {args.trace}")
    if f.get("liveness_detail"):
        print(f"liveness: {f['liveness_detail']}")
    if not result.ok:
        _print_violation(result)
    print(f"\nresult: {'ok' if ok else 'VIOLATION'}")
    return 0 if ok else 1


def cmd_check(args: argparse.Namespace) -> int:
    import time

    from kvstate.invariants import INVARIANTS
    from sim.check import check_trace

    started = time.perf_counter()
    result = check_trace(args.trace, liveness_steps=args.liveness_steps, at_end=args.at_end)
    seconds = time.perf_counter() - started
    rate = result.lines / seconds if seconds > 0 else 0.0
    violations = [{"invariant": f.invariant, "event_index": f.event_index, "line": line,
                   "engine": engine, "message": f.message} for line, engine, f in result.findings]
    if args.json:
        print(json.dumps({"ok": result.ok, "violations": violations, "lines": result.lines,
                          "observations": result.observations, "seconds": round(seconds, 3),
                          "lines_per_second": round(rate), "notes": result.notes},
                         sort_keys=True))
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


def cmd_replay(args: argparse.Namespace) -> int:
    from sim.replay import replay_trace

    result = replay_trace(args.trace, protocol=args.protocol)
    d = result.divergence
    if args.json:
        print(json.dumps({"ok": result.ok, "violations": [] if d is None else [
            {"invariant": "divergence", "event_index": d.line, "message":
             f"{d.kind}{d.field}: expected {d.expected}, got {d.got}"}],
            "protocol": result.protocol, "lines": result.lines,
            "outputs_compared": result.compared}, sort_keys=True))
    else:
        print(f"{args.trace}: replayed with protocol {result.protocol}; "
              f"{result.compared} outputs compared over {result.lines} lines")
        if d is not None:
            print(f"DIVERGENCE at line {d.line} (engine {d.engine}), {d.kind}{d.field}:")
            print(f"  recorded: {d.expected}")
            print(f"  model:    {d.got}")
        print(f"result: {'identical' if result.ok else 'DIVERGED'}")
    return 0 if result.ok else 1


def cmd_trace(args: argparse.Namespace) -> int:
    from sim.observed import write_observed, write_observed_file

    if args.output in (None, "-"):
        cut = write_observed(args.trace, sys.stdout)
    else:
        cut = write_observed_file(args.trace, args.output)
    if args.output not in (None, "-"):
        print(f"{args.trace}: {cut.lines_in} lines -> {cut.lines_out} observed lines in "
              f"{args.output} ({cut.records_dropped} annotation records dropped)")
    return 0


def cmd_minimize(args: argparse.Namespace) -> int:
    from sim.minimize import NothingToMinimize, minimize, options_from_trace
    from sim.runner import simulate

    if args.from_trace:
        options = options_from_trace(args.from_trace)
    else:
        options = options_from(args)
    progress = None if args.json else (lambda m: print(m, file=sys.stderr))
    try:
        shrunk = minimize(options, invariant=args.invariant, max_runs=args.max_runs,
                          progress=progress)
    except NothingToMinimize as exc:
        raise UsageError(str(exc)) from None
    with open(args.out, "w") as out:
        simulate(shrunk.options, trace=out)
    if args.json:
        print(json.dumps({"ok": False, "violations": _violation_dicts(shrunk.result),
                          "invariant": shrunk.invariant, "runs": shrunk.runs,
                          "passes": shrunk.passes, "command": shrunk.options.command(),
                          "trace": args.out}, sort_keys=True))
    else:
        print(f"minimized {shrunk.invariant} in {shrunk.runs} runs: "
              f"{shrunk.original.requests} -> {shrunk.options.requests} requests, "
              f"{len(shrunk.original.faults)} -> {len(shrunk.options.faults)} fault sites, "
              f"world size {shrunk.original.world_size} -> {shrunk.options.world_size}")
        print(f"trace: {args.out}  (kvstate replay {args.out}; kvstate check {args.out})")
        print(f"reproduce: {shrunk.options.command()}")
    return 1


def cmd_campaign(args: argparse.Namespace) -> int:
    import os

    from sim.campaign import campaign, summary

    interactive = sys.stderr.isatty() and not args.json

    def progress(message: str) -> None:
        if interactive:
            print("\r" + message[:100].ljust(100), end="", file=sys.stderr, flush=True)

    results = []
    for protocol in args.protocol or ["kvstate"]:
        try:
            results.append(campaign(protocol, budget=args.budget, seeds=args.seeds,
                                    start_seed=args.seed, progress=progress,
                                    stop_when_found=args.stop_when_found,
                                    workers=args.workers or os.cpu_count() or 1,
                                    ray_address=args.ray))
        except RuntimeError as e:  # --ray without Ray installed, or no cluster there
            raise UsageError(str(e)) from e
    if interactive:
        print(file=sys.stderr)
    failed_sites = [s for r in results if r.ok for s in r.never_fired] if args.require_fired \
        else []
    ok = all(r.ok for r in results) and not failed_sites
    if args.json:
        print(json.dumps({"ok": ok, "violations": [
            {"invariant": inv, "event_index": -1, "message":
             f"{r.protocol}: first after {t}s; reproduce: {r.first_command[inv]}"}
            for r in results for inv, t in r.first_found.items()],
            "never_fired": failed_sites, "campaigns": [summary(r) for r in results]},
            sort_keys=True))
        return 0 if ok else 1
    rows = [["protocol", "runs", "seconds", "invariants violated (first found after s)"]]
    for r in results:
        found = ", ".join(f"{inv} {t:.2f}" for inv, t in sorted(r.first_found.items(),
                                                                key=lambda kv: kv[1]))
        rows.append([r.protocol, str(r.runs), f"{r.seconds:.1f}", found or "-"])
    print(_table(rows))
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
    return 0 if ok else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from sim.plot import command

    return command(args)


def cmd_fuzz(args: argparse.Namespace) -> int:
    from sim.extras import require

    require("hypothesis", "kvstate fuzz")
    from kvstate.coverage import Coverage, format_table, never_fired, recording, summarize
    from sim.fuzz import fuzz

    cov = Coverage()
    with recording(cov):
        results = [fuzz(p, budget=args.budget, examples=args.examples, steps=args.steps,
                        out_dir=args.out_dir, profile=args.profile)
                   for p in (args.protocol or ["kvstate"])]
    ok = all(r.ok for r in results)
    rows_cov = summarize(cov)
    if args.json:
        print(json.dumps({"ok": ok, "violations": [
            {"invariant": r.invariant, "event_index": -1, "message": f"{r.protocol}: "
             f"{r.message} (shrunk to {r.rules} rules; trace {r.trace})"}
            for r in results if not r.ok],
            "runs": [{"protocol": r.protocol, "rounds": r.rounds, "seconds": r.seconds,
                      "invariant": r.invariant, "rules": r.rules, "trace": r.trace}
                     for r in results],
            "never_fired": never_fired(rows_cov)}, sort_keys=True))
        return 0 if ok else 1
    rows = [["protocol", "rounds", "seconds", "found", "shrunk rules", "trace"]]
    for r in results:
        rows.append([r.protocol, str(r.rounds), f"{r.seconds:.1f}", r.invariant or "-",
                     str(r.rules or "-"), r.trace or "-"])
    print(_table(rows))
    print("\ntable entries the fuzzer's programs fired (shrinking included):")
    print(format_table(rows_cov, unseen=args.show_unseen))
    return 0 if ok else 1


# What `kvstate real` may allocate, checked before a master starts or a tensor
# is built: its KV caches are ranks x layers x (128 + 1) blocks of block_size x
# 2 heads x 16 dims in float16 (`adapters.runner.run_real`), and one block must
# fit the Mooncake client's 64 MiB transfer buffer.
REAL_KV_BYTES = 1 << 30
REAL_BLOCK_BYTES_PER_TOKEN = 2 * 16 * 2  # heads x head_dim x float16
REAL_LAYERS, REAL_BLOCKS = 2, 128 + 1
REAL_MAX_SEGMENT_MIB = 1 << 16


def _check_real_bounds(args: argparse.Namespace) -> None:
    kv_bytes = (args.world_size * REAL_LAYERS * REAL_BLOCKS * args.block_size
                * REAL_BLOCK_BYTES_PER_TOKEN)
    if kv_bytes > REAL_KV_BYTES:
        most = REAL_KV_BYTES // (args.world_size * REAL_LAYERS * REAL_BLOCKS
                                 * REAL_BLOCK_BYTES_PER_TOKEN)
        raise UsageError(f"--block-size={args.block_size}: the KV caches would need "
                         f"{kv_bytes / (1 << 30):.1f} GiB; at most {REAL_KV_BYTES >> 30} GiB "
                         f"(--block-size <= {most} with --world-size {args.world_size})")
    if not 16 <= args.segment_mib <= REAL_MAX_SEGMENT_MIB:
        raise UsageError(f"--segment-mib={args.segment_mib}: Mooncake needs 16 MiB to "
                         f"{REAL_MAX_SEGMENT_MIB} MiB per client segment here")


def cmd_real(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from adapters.mooncake import MooncakeConfig, MooncakeStore, MooncakeUnavailable
    from adapters.runner import bench_adapter, run_real, workload_arrivals
    from kvstate.blockhash import chain_hash_fn
    from kvstate.config import ConnectorConfig

    try:
        chain_hash_fn(args.block_hash)  # before a master starts: cbor2 may be missing
    except ValueError as exc:
        raise UsageError(f"--block-hash={args.block_hash}: {exc}") from None
    _check_real_bounds(args)
    master = None
    try:
        if args.master:
            address = args.master
        else:
            from adapters.master import Master

            master = Master()
            address = master.address
        try:
            store = MooncakeStore(MooncakeConfig(
                master_server_address=address, global_segment_size=args.segment_mib << 20,
                local_buffer_size=64 << 20), timeout=args.timeout,
                setup_timeout=max(10.0, 3 * args.timeout))
        except (MooncakeUnavailable, ValueError, ConnectionError, TimeoutError) as exc:
            raise UsageError(str(exc)) from None
        try:
            if args.bench:
                figures = bench_adapter(store, repeats=args.repeats)
                if args.json:
                    print(json.dumps({"ok": True, "violations": [], "adapter": figures},
                                     sort_keys=True))
                else:
                    rows = [["block", "adapter put B/s", "raw put B/s", "put ratio",
                             "adapter get B/s", "raw get B/s", "get ratio"]]
                    for size, f in figures.items():
                        rows.append([size, f"{f['adapter_put']:,}", f"{f['raw_put']:,}",
                                     str(f["put_ratio"]), f"{f['adapter_get']:,}",
                                     f"{f['raw_get']:,}", str(f["get_ratio"])])
                    print(_table(rows))
                return 0
            arrivals = workload_arrivals(args.workload, args.requests, args.seed, args.scale,
                                         args.fast25_path)
            config = ConnectorConfig(block_size=args.block_size, world_size=args.world_size,
                                     save_decode_cache=True, enable_kv_events=True,
                                     cache_prefix=f"run{args.seed}")
            if args.processes:
                from adapters.rank_process import RankProcessError
                from adapters.runner import run_real_processes

                store.close()  # the ranks bring their own clients
                try:
                    result = run_real_processes(store.config, arrivals, config,
                                                variant=args.protocol, timeout=args.timeout,
                                                block_hash=args.block_hash)
                except RankProcessError as exc:
                    raise UsageError(str(exc)) from None
            else:
                result = run_real(store, arrivals, config, variant=args.protocol,
                                  block_hash=args.block_hash)
        finally:
            store.close()
    finally:
        if master is not None:
            master.stop()
    if args.json:
        print(json.dumps({"ok": result.ok, "violations": result.violations,
                          "figures": result.figures}, sort_keys=True))
    else:
        print(f"kvstate real: {len(arrivals)} requests through protocol {args.protocol} on "
              f"{args.world_size} ranks against mooncake_master {address}")
        print(_table([[k, str(v)] for k, v in result.figures.items()]))
        for v in result.violations[:10]:
            print(f"  {v['invariant']}: {v['message']}")
        print(f"result: {'ok' if result.ok else 'MISMATCH'}")
    return 0 if result.ok else 1


def _add_protocols(parser: argparse.ArgumentParser, *, budget: bool = True) -> None:
    """``--protocol`` (repeatable) and, for the searches, ``--budget`` per protocol."""
    parser.add_argument("--protocol", type=_protocol, action="append",
                        help="variant (repeatable; default: kvstate)")
    if budget:
        parser.add_argument("--budget", type=_positive_float, default=60.0,
                            help="seconds per protocol")


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

    sim = sub.add_parser("sim", help="run the deterministic simulator (the main job)")
    add_sim_options(sim)
    sim.add_argument("--trace", help="write the run's trace (JSON Lines) here")
    sim.add_argument("--keep-going", action="store_true",
                     help="run to the end past violations (to measure a buggy protocol's "
                     "figures); the figures count violations by invariant")
    sim.add_argument("--check-determinism", action="store_true",
                     help="run twice and compare the traces' hashes")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=cmd_sim)

    check = sub.add_parser("check", help="run the invariant monitors over a trace")
    check.add_argument("trace")
    check.add_argument("--liveness-steps", type=_positive_int, default=None,
                       help="where the trace ends, jobs and pins older than this many "
                       "steps are stuck (default: the header's liveness_steps, else 64)")
    check.add_argument("--at-end", choices=("closed", "open"), default="closed",
                       help="closed: the run ended with the trace (judge liveness); open: "
                       "the trace was cut mid-run (list what was left, judge nothing)")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_check)

    plot = sub.add_parser("plot", help="draw a run's timeline from its trace (needs "
                          "kvstate[plot]: matplotlib)")
    plot.add_argument("trace")
    plot.add_argument("-o", "--output", required=True,
                      help="the image to write; its suffix picks the format (.png, .svg, .pdf)")
    plot.add_argument("--title", default=None)
    plot.add_argument("--json", action="store_true")
    plot.set_defaults(func=cmd_plot)

    replay = sub.add_parser("replay", help="re-drive the model from a trace; first divergence")
    replay.add_argument("trace")
    replay.add_argument("--protocol", type=_protocol, default=None,
                        help="replay with another variant (default: the trace's)")
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(func=cmd_replay)

    trace = sub.add_parser("trace", help="trace tools: 'observed' cuts a trace to what an "
                           "engine would write (specs/trace.md)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    observed = trace_sub.add_parser("observed", help="drop kvstate's annotations: generations, "
                                    "rank-state writes, verdicts, content tags")
    observed.add_argument("trace")
    observed.add_argument("-o", "--output", default=None,
                          help="write here (default: standard output)")
    observed.set_defaults(func=cmd_trace)

    mini = sub.add_parser("minimize", help="shrink a failing run, write its trace")
    mini.add_argument("from_trace", nargs="?", help="a failing simulator trace (or give options)")
    add_sim_options(mini)
    mini.add_argument("--invariant", help="keep this invariant failing (default: the first)")
    mini.add_argument("--max-runs", type=_positive_int, default=200)
    mini.add_argument("--out", default="minimized.jsonl")
    mini.add_argument("--json", action="store_true")
    mini.set_defaults(func=cmd_minimize)

    fz = sub.add_parser("fuzz", help="Hypothesis stateful fuzzing with a time budget")
    _add_protocols(fz)
    fz.add_argument("--examples", type=_positive_int, default=200, help="programs per round")
    fz.add_argument("--steps", type=_positive_int, default=50, help="rules per program")
    fz.add_argument("--out-dir", default=".", help="where counterexample traces go")
    fz.add_argument("--profile", default="both",
                    choices=("both", "striding", "consumer", "shared", "hybrid", "hybrid-pd"),
                    help="engine shape: per-rank heads, MLA striding, a P/D decode node, "
                    "one prompt family (lookups hit, loads fail), or a hybrid model (full "
                    "attention + sliding window) with striding or on a P/D decode node")
    fz.add_argument("--show-unseen", action="store_true",
                    help="list the table entries and guard outcomes never fired")
    fz.add_argument("--json", action="store_true")
    fz.set_defaults(func=cmd_fuzz)

    camp = sub.add_parser("campaign", help="many seeds per protocol; what each violates")
    _add_protocols(camp)
    camp.add_argument("--seeds", type=_positive_int, default=None,
                      help="run exactly this many seeds instead of a time budget")
    camp.add_argument("--seed", type=_nonneg_int, default=0, help="first seed")
    camp.add_argument("--stop-when-found", action="store_true")
    camp.add_argument("--require-fired", action="store_true",
                      help="fail if a configured fault site never fired")
    camp.add_argument("--workers", type=_positive_int, default=None,
                      help="local worker processes (default: every core)")
    camp.add_argument("--ray", metavar="ADDRESS", default=None,
                      help="run seeds as tasks on this Ray cluster ('local': start one here; "
                      "needs the ray extra)")
    camp.add_argument("--json", action="store_true")
    camp.set_defaults(func=cmd_campaign)

    real = sub.add_parser("real", help="a workload through the core against a real Mooncake "
                          "store and torch KV caches, verified byte for byte")
    real.add_argument("--master", help="host:port of a running mooncake_master "
                      "(default: start one on a free loopback port)")
    real.add_argument("--protocol", type=_protocol, default="kvstate")
    real.add_argument("--workload", choices=("synthetic", "fast25"), default="synthetic")
    real.add_argument("--fast25-path", default="")
    real.add_argument("--scale", type=_positive_int, default=64)
    real.add_argument("--requests", type=_positive_int, default=40)
    real.add_argument("--seed", type=_nonneg_int, default=0)
    real.add_argument("--world-size", type=_positive_int, default=2, choices=(1, 2, 3, 4))
    real.add_argument("--block-size", type=_positive_int, default=16)
    real.add_argument("--block-hash", choices=("vllm-sha256", "vllm-sha256_cbor", "kvstate"),
                      default="vllm-sha256",
                      help="how blocks are hashed into keys: vLLM 0.33.0's sha256 (the "
                      "default: the keys a vLLM engine looks up, with PYTHONHASHSEED unset), "
                      "its sha256_cbor, or kvstate's own 16-byte hash")
    real.add_argument("--segment-mib", type=_positive_int, default=256)
    real.add_argument("--timeout", type=_positive_float, default=5.0,
                      help="seconds a store call may take")
    real.add_argument("--processes", action="store_true",
                      help="every rank in its own process with its own Mooncake client "
                      "and KV caches (default: all ranks in this process)")
    real.add_argument("--bench", action="store_true",
                      help="instead: adapter vs raw client bytes/s for 16 KiB-4 MiB blocks "
                      "(needs --segment-mib 1024 with the default --repeats)")
    real.add_argument("--repeats", type=_positive_int, default=11,
                      help="--bench rounds per block size (median of these)")
    real.add_argument("--json", action="store_true")
    real.set_defaults(func=cmd_real)

    bench = sub.add_parser("bench", help="benchmarks: core vs e2, simulator, memory")
    bench.add_argument("part", nargs="*", choices=("core", "sim", "memory", "variants",
                                                   "tools", "modelcheck", "hypothesis", "check",
                                                   "vllm", "campaign"),
                       help="what to measure (default: core sim)")
    bench.add_argument("--tool-protocol", type=_protocol, action="append",
                       help="for 'tools': only these variants (repeatable; default: all)")
    bench.add_argument("--out-dir", default=".",
                       help="for 'tools': where counterexample traces go")
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    bench.add_argument("--memory-requests", type=_positive_int, nargs="+",
                       default=[10_000, 100_000])
    bench.add_argument("--context", type=_positive_int, nargs="+", default=[1024, 131072])
    bench.add_argument("--requests", type=_positive_int, default=256)
    bench.add_argument("--world-size", type=_positive_int, default=8)
    bench.add_argument("--cycles", type=_positive_int, default=2)
    bench.add_argument("--repeats", type=_positive_int, default=3)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)

    diagram = sub.add_parser("diagram", help="print one machine's table as mermaid")
    diagram.add_argument("machine", help="request, job, pressure, skip, retry, pin, saved_mark")
    diagram.add_argument("--coverage", nargs="+", metavar="TRACE",
                         help="colour the machine by the transitions these traces fired")
    diagram.add_argument("--svg", metavar="OUT.svg",
                         help="draw the machine as an SVG state diagram (needs the 'plot' "
                         "extra); with --coverage, transitions green if fired, red if never")

    cover = sub.add_parser("coverage", help="which table entries and guard outcomes traces "
                           "exercised (all machines), and which they never did")
    cover.add_argument("traces", nargs="+", metavar="TRACE")
    cover.add_argument("--json", action="store_true")
    cover.set_defaults(func=cmd_coverage)

    mc = sub.add_parser("modelcheck", help="exhaustive breadth-first model checking of a "
                        "small scope; shortest counterexample as a trace")
    mc.add_argument("--scope", default="default",
                    help="tiny, default, twins, mla, pd, large, or all (default: default)")
    _add_protocols(mc, budget=False)
    mc.add_argument("--budget", type=_positive_float, default=None,
                    help="stop after this many seconds (then not exhaustive)")
    mc.add_argument("--max-states", type=_positive_int, default=None)
    mc.add_argument("--no-reduction", action="store_true",
                    help="no symmetry or counter reduction (for comparison)")
    mc.add_argument("--require-exhaustive", action="store_true",
                    help="exit 1 if a budget stopped the search")
    mc.add_argument("--out-dir", default=".", help="where counterexample traces go")
    mc.add_argument("--engine", choices=("compact", "legacy"), default="compact",
                    help="compact (default) or legacy (the original loop, for comparison)")
    mc.add_argument("--workers", type=_positive_int, default=1,
                    help="processes expanding each breadth-first level (compact engine)")
    mc.add_argument("--json", action="store_true")
    mc.set_defaults(func=cmd_modelcheck)
    diagram.add_argument("--json", action="store_true")
    diagram.set_defaults(func=cmd_diagram)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from kvstate.trace import TraceError
    from sim.coverage import CoverageError
    from sim.extras import MissingExtra
    from sim.workloads import WorkloadError

    try:
        return int(args.func(args))
    except (UsageError, TraceError, WorkloadError, CoverageError, MissingExtra) as exc:
        print(f"kvstate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvstate {args.command}: error: {exc.filename or ''}: {exc.strerror}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: no traceback; what the command printed so far stands. 130 is
        # the shell's code for a process ended by SIGINT (128 + 2).
        print(f"kvstate {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
