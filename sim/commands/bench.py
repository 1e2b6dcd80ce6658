"""``kvstate bench``: benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.options import int_in, protocol_name, ray_cluster, workers_int
from sim.commands.output import envelope, table
from sim.commands.paths import output_dir


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


def _bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    """Engines run in processes of the engine's own environment; this one
    only starts the store and reads their results."""
    import os

    from adapters.master import MasterError
    from adapters.vllm.engine import EngineFailed, engine_python
    from adapters.vllm.engine_bench import bench_engine, format_engine

    python = args.engine_python or engine_python()
    if not os.access(python, os.X_OK):
        raise UsageError(f"--engine-python {python}: not an executable")
    try:
        report = bench_engine(python, quick=args.quick, rounds=None if args.quick else args.repeats)
    except (EngineFailed, MasterError) as exc:
        raise UsageError(f"bench engine needs a computing vLLM (the CPU engine's venv: "
                         f"see the README's test command) and the mooncake extra: {exc}"
                         ) from None
    if not args.json:
        print(format_engine(report))
    return report


def run(args: argparse.Namespace) -> int:
    from sim.bench.baseline import BaselineError
    from sim.bench.core import bench_core, format_report, ratio_lines
    from sim.bench.memory import bench_memory
    from sim.bench.simulation import bench_sim

    parts = set(args.part or ["core", "sim"])
    if args.soak_scale is not None and "sim" not in parts:
        raise UsageError("--soak-scale times the simulator's FAST'25 soak: name sim")
    if args.against is not None:
        from sim.bench.baseline import check_revision

        if not parts & {"modelcheck", "sim", "check"}:
            raise UsageError("--against compares the model checker, the simulator or the "
                             "trace check: name modelcheck, sim or check")
        try:
            check_revision(args.against)
        except BaselineError as e:
            raise UsageError(str(e)) from e
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
        try:
            sim = bench_sim(requests=80 if args.quick else 400, against=args.against,
                            soak_scale=args.soak_scale)
        except BaselineError as e:
            raise UsageError(str(e)) from e
        report["sim"] = sim
        if not args.json:
            print("simulator, every invariant checked after every observation"
                  + (f", and revision {args.against}'s simulator (same run)"
                     if args.against else "") + ":")
            print(table([[k, str(v)] for k, v in sim.items()]) + "\n")
    if "memory" in parts:
        counts = (1000, 4000) if args.quick else tuple(args.memory_requests)
        memory = bench_memory(counts)
        report["memory"] = memory
        if not args.json:
            print("peak memory of FAST'25 runs (fresh process each, scale 512):")
            print(table([[k, str(v)] for k, v in memory.items()]))
    if "variants" in parts:
        from sim.bench.variants import bench_variants

        variants = bench_variants(trials=2 if args.quick else 5, budget=10 if args.quick else 60)
        report["variants"] = variants
        if not args.json:
            print("campaigns per variant (first violation; median wall seconds to find):")
            rows = [["variant", "invariants found", "median s"]]
            for name, row in variants.items():
                rows.append([name, " ".join(row["found"]) or "-",
                             str(row.get("median_seconds_to_find", "-"))])
            print(table(rows))
    if "tools" in parts:
        from sim.bench.tools import bench_tools, format_tools

        output_dir(args.out_dir, "--out-dir")

        def show(name: str, row: dict[str, Any]) -> None:
            if not args.json:
                print(format_tools({name: row}).splitlines()[1], flush=True)

        if not args.json:
            print("bug-finding power: each variant against the simulator campaign, the "
                  "Hypothesis CI profile and the model checker, checking the variant's own "
                  "invariants (first violation each)")
        with ray_cluster(args.ray) as cluster:
            tools = bench_tools(args.tool_protocol, sim_budget=5 if args.quick else 30,
                                mc_budget=10 if args.quick else 60, out_dir=args.out_dir,
                                progress=show, workers=args.workers, cluster=cluster)
        report["tools"] = tools
        if not args.json:
            print("\n" + format_tools(tools))
    if "modelcheck" in parts:
        from sim.bench.modelcheck import bench_modelcheck

        try:
            report["modelcheck"] = bench_modelcheck(
                args.scope or ("tiny" if args.quick else "default"), against=args.against)
        except BaselineError as e:
            raise UsageError(str(e)) from e
        if not args.json:
            print("model checker, kvstate: states/s with 1 and more processes, a "
                  "transition's phases"
                  + (f", and revision {args.against}'s model checker (same run)"
                     if args.against else "") + ":")
            print(table([[k, str(v)] for k, v in report["modelcheck"].items()]))
    if "campaign" in parts:
        from sim.bench.campaign import bench_campaign

        report["campaign"] = bench_campaign(
            seeds=4 if args.quick else 16,
            connect=None if args.ray is None else lambda: ray_cluster(args.ray))
        if not args.json:
            print("campaign seeds per second with 1, 2 and all workers"
                  f"{' and on the Ray cluster' if args.ray else ''} (same seeds):")
            print(table([[k, str(v)] for k, v in report["campaign"].items()]))
    if "check" in parts:
        from sim.bench.check import bench_check

        try:
            report["check"] = bench_check(requests=80 if args.quick else 400,
                                          against=args.against)
        except BaselineError as e:
            raise UsageError(str(e)) from e
        if not args.json:
            print("trace check against bare parsing (same lines, same process, best of 3)"
                  + (f", and revision {args.against}'s check of the same file"
                     if args.against else "") + ":")
            print(table([[k, str(v)] for k, v in report["check"].items()]))
    if "vllm" in parts:
        report["vllm"] = _bench_vllm(args)
    if "engine" in parts:
        report["engine"] = _bench_engine(args)
    if "hypothesis" in parts:
        from sim.bench.stateful import bench_hypothesis

        report["hypothesis"] = bench_hypothesis(examples=20 if args.quick else 100)
        if not args.json:
            print("Hypothesis rule steps per second (same run, same settings):")
            print(table([[k, str(v)] for k, v in report["hypothesis"].items()]))
    if args.json:
        print(envelope({"ok": True, "violations": [], **report}))
    return 0


def _scopes() -> list[str]:
    from sim.explore.modelcheck.model import SCOPES

    return list(SCOPES)


def register(sub: Any) -> None:
    parser = sub.add_parser("bench", help="benchmarks: core vs e2, simulator, memory")
    parser.add_argument("part", nargs="*", choices=("core", "sim", "memory", "variants",
                                                   "tools", "modelcheck", "hypothesis", "check",
                                                   "vllm", "engine", "campaign"),
                       help="what to measure (default: core sim)")
    parser.add_argument("--tool-protocol", type=protocol_name, action="append",
                       help="for 'tools': only these variants (repeatable; default: all)")
    parser.add_argument("--workers", type=workers_int, default=1,
                       help="for 'tools': compute the variants' rows in N processes (same "
                       "findings and lengths; the seconds then include the other workers' "
                       "load, so 1 is the default)")
    parser.add_argument("--ray", metavar="ADDRESS", default=None,
                       help="for 'tools': compute the rows as Ray tasks on a cluster instead; "
                       "for 'campaign': run the same seeds on it too and print its speed-up "
                       "('local' starts one here; needs pip install 'kvstate[ray]')")
    parser.add_argument("--out-dir", default=".",
                       help="for 'tools': where counterexample traces go")
    parser.add_argument("--engine-python", metavar="PYTHON", default=None,
                       help="for 'engine': the interpreter of the environment holding a "
                       "computing vLLM (default: $KVSTATE_ENGINE_PYTHON, else .venv-engine "
                       "beside the checkout, else this Python)")
    parser.add_argument("--scope", default=None, choices=sorted(_scopes()),
                       help="for 'modelcheck': the scope to exhaust (default: default; "
                       "tiny with --quick)")
    parser.add_argument("--against", metavar="REVISION", default=None,
                       help="for 'modelcheck', 'sim' and 'check': also run this git "
                       "revision's model checker, simulator or check on the same input, in "
                       "a worktree, in the same run (e.g. HEAD~3)")
    parser.add_argument("--soak-scale", type=int_in(1, 4096), default=None, metavar="S",
                       help="for 'sim': also time the whole FAST'25 trace at scale S with "
                       "the fault swarm on (with --against: that revision's too)")
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    # Bounds (issue 32, class 2): the simulator's request bound, vLLM's
    # longest contexts (~10M tokens), a trace's world size.
    parser.add_argument("--memory-requests", type=int_in(1, 100_000), nargs="+",
                       default=[10_000, 100_000])
    parser.add_argument("--context", type=int_in(1, 10_000_000), nargs="+",
                        default=[1024, 131072])
    parser.add_argument("--requests", type=int_in(1, 100_000), default=256)
    parser.add_argument("--world-size", type=int_in(1, 1024), default=8)
    parser.add_argument("--cycles", type=int_in(1, 1000), default=2)
    parser.add_argument("--repeats", type=int_in(1, 1000), default=3)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
