"""``kvstate real``: a workload through the core against a real Mooncake store, verified byte for byte."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.options import int_in, positive_float, positive_int, protocol_name, seed_int
from sim.commands.output import envelope, table
from sim.commands.progress import Bar, add_progress_option, print_table, progress_for

# What `kvstate real` may allocate, checked before a master starts or a tensor
# is built: its KV caches are ranks x layers x (128 + 1) blocks of block_size x
# 2 heads x 16 dims in float16 (`adapters.runner.run_real`), and one block must
# fit the Mooncake client's 64 MiB transfer buffer.
REAL_KV_BYTES = 1 << 30
REAL_BLOCK_BYTES_PER_TOKEN = 2 * 16 * 2  # heads x head_dim x float16
REAL_LAYERS, REAL_BLOCKS = 2, 128 + 1
REAL_MAX_SEGMENT_MIB = 1 << 16
REAL_MAX_REQUESTS = 100_000  # the simulator's bound (sim.simulator.runner.OPTION_LIMITS)
REAL_MAX_TIMEOUT = 3600.0  # seconds; beyond it a socket timeout overflows
# A store call shorter than a millisecond cannot succeed (a loopback round
# trip is ~0.1 ms before any bytes move): the connector's bound too
# (`adapters.vllm.options.MIN_STORE_TIMEOUT`).
REAL_MIN_TIMEOUT = 0.001


class StoreFailed(UsageError):
    """The store stopped answering mid-run; a call of it is still stuck in
    the Mooncake client's own thread."""


def _check_real_bounds(args: argparse.Namespace) -> None:
    kv_bytes = (args.world_size * REAL_LAYERS * REAL_BLOCKS * args.block_size
                * REAL_BLOCK_BYTES_PER_TOKEN)
    if kv_bytes > REAL_KV_BYTES:
        most = REAL_KV_BYTES // (args.world_size * REAL_LAYERS * REAL_BLOCKS
                                 * REAL_BLOCK_BYTES_PER_TOKEN)
        raise UsageError(f"--block-size={args.block_size}: the KV caches would need "
                         f"{kv_bytes / (1 << 30):.1f} GiB; at most {REAL_KV_BYTES >> 30} GiB "
                         f"(--block-size <= {most} with --world-size {args.world_size})")
    if args.requests > REAL_MAX_REQUESTS:
        raise UsageError(f"--requests={args.requests}: at most {REAL_MAX_REQUESTS:,}")
    if args.timeout > REAL_MAX_TIMEOUT:
        raise UsageError(f"--timeout={args.timeout:g}: at most {REAL_MAX_TIMEOUT:g} seconds")
    if args.timeout < REAL_MIN_TIMEOUT:
        raise UsageError(f"--timeout={args.timeout:g}: at least {REAL_MIN_TIMEOUT:g} seconds "
                         "(no store call is shorter)")
    if not 16 <= args.segment_mib <= REAL_MAX_SEGMENT_MIB:
        raise UsageError(f"--segment-mib={args.segment_mib}: Mooncake needs 16 MiB to "
                         f"{REAL_MAX_SEGMENT_MIB} MiB per client segment here")


def run(args: argparse.Namespace) -> int:
    import os

    if args.fast25_path and args.workload != "fast25":
        raise UsageError(f"--fast25-path {args.fast25_path}: only read with --workload fast25 "
                         "(the workload is synthetic)")  # as sim says
    if args.master is not None and not args.master.strip():
        raise UsageError("--master '': an empty address (leave the option out to start a "
                         "master on a free loopback port)")

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from kvstate.blockhash import chain_hash_fn

    try:
        chain_hash_fn(args.block_hash)  # before a master starts: cbor2 may be missing
    except ValueError as exc:
        raise UsageError(f"--block-hash={args.block_hash}: {exc}") from None
    _check_real_bounds(args)
    arrivals = None
    if not args.bench:
        # The workload is read (and a bad one refused) before a master starts
        # or a client connects (issue 32: input checked late).
        from adapters.runner import workload_arrivals

        arrivals = workload_arrivals(args.workload, args.requests, args.seed, args.scale,
                                     args.fast25_path)
    # A spinner with the phase under way: adapters.runner has no per-request
    # hook, so there is no count to show. SIGTERM unwinds like Ctrl-C, so the
    # master this command started is stopped too (143: 128 + SIGTERM).
    import signal

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with progress_for(args, label="real") as bar:
            address, outcome = _measure(args, bar, arrivals)
    except StoreFailed as exc:
        # Said, then no interpreter shutdown: the client's thread still blocked
        # on the dead master crashes the process while Python tears down
        # (SIGSEGV or abort, measured), which would turn exit 2 into 139.
        import sys

        print(f"kvstate real: error: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.bench:
        figures = outcome
        if args.json:
            print(envelope({"ok": True, "violations": [], "adapter": figures}))
        else:
            rows = [["block", "adapter put B/s", "raw put B/s", "put ratio",
                     "adapter get B/s", "raw get B/s", "get ratio"]]
            for size, f in figures.items():
                rows.append([size, f"{f['adapter_put']:,}", f"{f['raw_put']:,}",
                             str(f["put_ratio"]), f"{f['adapter_get']:,}",
                             f"{f['raw_get']:,}", str(f["get_ratio"])])
            print_table(args, rows)
        return 0
    arrivals, result = outcome
    if args.json:
        print(envelope({"ok": result.ok, "violations": result.violations,
                          "figures": result.figures}))
    else:
        print(f"kvstate real: {len(arrivals)} requests through protocol {args.protocol} on "
              f"{args.world_size} ranks against mooncake_master {address}")
        print(table([[k, str(v)] for k, v in result.figures.items()]))
        for v in result.violations[:10]:
            print(f"  {v['invariant']}: {v['message']}")
        print(f"result: {'ok' if result.ok else 'MISMATCH'}")
    return 0 if result.ok else 1


def _measure(args: argparse.Namespace, bar: Bar, arrivals: Any) -> tuple[str, Any]:
    """Start (or reach) the master, connect, then either the adapter bench (its
    figures) or the workload run (the arrivals and the run's result)."""
    from adapters.master import MasterError
    from adapters.mooncake import MooncakeConfig, MooncakeStore, MooncakeUnavailable
    from adapters.runner import bench_adapter, run_real
    from kvstate.config import ConnectorConfig
    from kvstate.memory_store import StoreRaised

    master = None
    try:
        if args.master:
            address = args.master
        else:
            from adapters.master import Master

            bar.update(phase="starting mooncake_master")
            try:
                master = Master()
            except MasterError as exc:
                raise UsageError(str(exc)) from None
            address = master.address
        bar.update(phase=f"connecting to {address}")
        try:
            store = MooncakeStore(MooncakeConfig(
                master_server_address=address, global_segment_size=args.segment_mib << 20,
                local_buffer_size=64 << 20), timeout=args.timeout,
                setup_timeout=max(10.0, 3 * args.timeout))
        except (MooncakeUnavailable, ValueError, ConnectionError, TimeoutError) as exc:
            raise UsageError(str(exc)) from None
        try:
            if args.bench:
                bar.update(phase=f"bench: adapter vs raw client, {args.repeats} rounds a size")
                return address, bench_adapter(store, repeats=args.repeats)
            config = ConnectorConfig(block_size=args.block_size, world_size=args.world_size,
                                     save_decode_cache=True, enable_kv_events=True,
                                     cache_prefix=f"run{args.seed}")
            bar.update(phase=f"{len(arrivals)} requests on {args.world_size} ranks, then "
                       "verifying every key")
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
                try:
                    result = run_real(store, arrivals, config, variant=args.protocol,
                                      block_hash=args.block_hash)
                except StoreRaised as exc:  # the master died or stalled mid-run
                    raise StoreFailed(f"the store at {address} failed during the run: "
                                      f"{exc}") from None
        finally:
            store.close()
    finally:
        if master is not None:
            bar.update(phase="stopping mooncake_master")
            master.stop()
    return address, (arrivals, result)


def register(sub: Any) -> None:
    parser = sub.add_parser("real", help="a workload through the core against a real Mooncake "
                          "store and torch KV caches, verified byte for byte")
    parser.add_argument("--master", help="host:port of a running mooncake_master "
                      "(default: start one on a free loopback port)")
    parser.add_argument("--protocol", type=protocol_name, default="kvstate")
    parser.add_argument("--workload", choices=("synthetic", "fast25"), default="synthetic")
    parser.add_argument("--fast25-path", default="")
    parser.add_argument("--scale", type=int_in(1, 1 << 20), default=64)  # as sim's
    parser.add_argument("--requests", type=positive_int, default=40)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--world-size", type=positive_int, default=2, choices=(1, 2, 3, 4))
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--block-hash", choices=("vllm-sha256", "vllm-sha256_cbor", "kvstate"),
                      default="vllm-sha256",
                      help="how blocks are hashed into keys: vLLM 0.33.0's sha256 (the "
                      "default: the keys a vLLM engine looks up, with PYTHONHASHSEED unset), "
                      "its sha256_cbor, or kvstate's own 16-byte hash")
    parser.add_argument("--segment-mib", type=positive_int, default=256)
    parser.add_argument("--timeout", type=positive_float, default=5.0,
                      help="seconds a store call may take")
    parser.add_argument("--processes", action="store_true",
                      help="every rank in its own process with its own Mooncake client "
                      "and KV caches (default: all ranks in this process)")
    parser.add_argument("--bench", action="store_true",
                      help="instead: adapter vs raw client bytes/s for 16 KiB-4 MiB blocks "
                      "(needs --segment-mib 1024 with the default --repeats)")
    parser.add_argument("--repeats", type=int_in(1, 1000), default=11,
                      help="--bench rounds per block size (median of these)")
    parser.add_argument("--json", action="store_true")
    add_progress_option(parser)
    parser.set_defaults(func=run)
