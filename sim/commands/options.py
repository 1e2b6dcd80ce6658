"""Argument types and the simulator's options, shared by the commands that take them.

Each type refuses a bad value with argparse's own error (exit 2, the option and the
value named); ``validate_options`` checks a whole configuration before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from typing import Any

from kvstate.trace.codec import LIVENESS_STEPS_MAX
from kvstate.variants import PLUGINS_ENV, VARIANTS, is_variant
from sim.commands.errors import UsageError


def protocol_name(name: str) -> str:
    try:
        known = is_variant(name)
    except ValueError as exc:  # a module KVSTATE_VARIANTS names does not import
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not known:
        raise argparse.ArgumentTypeError(
            f"unknown protocol {name!r}; known: {', '.join(VARIANTS)} (your own: "
            f"{PLUGINS_ENV}=your.module, see docs/testing-your-connector.md)")
    return name


def int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)

# Upper bounds of the options that have no domain bound of their own (issue
# 32, class 2: a count of 10^30 was taken and the work never ended, or ran
# out of memory): a seed is a 64-bit integer, as `sim --seed` (and a trace
# header's) is; a pool of processes or Ray actors is at most this many.
MAX_SEED = (1 << 63) - 1
MAX_WORKERS = 1024


def int_in(low: int, high: int) -> Any:
    """An integer type in ``[low, high]``; the message says both bounds."""
    def parse(text: str) -> int:
        value = int_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got "
                                             f"{value}")
        return value
    return parse


seed_int = int_in(0, MAX_SEED)
workers_int = int_in(1, MAX_WORKERS)


def liveness_steps(text: str) -> int:
    """``--liveness-steps``: the bound a trace header's ``liveness_steps``
    has (`kvstate.trace.codec`), so the option and the header agree."""
    value = positive_int(text)
    if value > LIVENESS_STEPS_MAX:
        raise argparse.ArgumentTypeError(
            f"expected an integer in [1, {LIVENESS_STEPS_MAX}], got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        # inf (or 1e999) is no budget, timeout or rate: the work would never end
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def faults_arg(text: str) -> tuple[str, ...]:
    from sim.simulator.faults import SITES

    if text in ("all", ""):
        return tuple(SITES)
    if text == "none":
        return ()
    sites = tuple(t.strip() for t in text.split(",") if t.strip())
    for word in ("all", "none"):
        if word in sites:
            raise argparse.ArgumentTypeError(
                f"{word!r} stands alone (--faults {word}), not in a list of sites: {text!r}")
    for site in sites:
        if site not in SITES:
            raise argparse.ArgumentTypeError(
                f"unknown fault site {site!r}; known: {', '.join(SITES)}, all, none")
    return sites


def groups_arg(text: str) -> tuple[str, ...]:
    from sim.simulator.runner import parse_groups

    groups = tuple(t.strip() for t in text.split(","))
    try:
        parse_groups(groups)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return groups


def add_sim_options(parser: argparse.ArgumentParser) -> None:
    from sim.simulator.runner import SimOptions

    d = SimOptions()
    group = parser.add_argument_group("simulation")
    group.add_argument("--seed", type=nonneg_int, default=d.seed)
    group.add_argument("--protocol", type=protocol_name, default=d.protocol)
    group.add_argument("--setup", choices=("both", "pd"), default=d.setup,
                       help="one kv_both engine, or prefill + decode engines sharing a store")
    group.add_argument("--workload", choices=("synthetic", "fast25"), default=d.workload)
    group.add_argument("--fast25-path", default=d.fast25_path,
                       help="a trace in the FAST'25 format, plain or .gz (default: the packaged "
                            "FAST'25 conversation trace)")
    group.add_argument("--scale", type=positive_int, default=d.scale,
                       help="divide FAST'25 token counts by this (any positive integer)")
    group.add_argument("--requests", type=positive_int, default=d.requests)
    group.add_argument("--rate", type=positive_float, default=d.rate,
                       help="synthetic arrivals per second")
    group.add_argument("--world-size", type=positive_int, default=d.world_size)
    group.add_argument("--put-step", type=positive_int, default=d.put_step,
                       help="TP striding: ranks per stored copy (must divide --world-size)")
    group.add_argument("--block-size", type=positive_int, default=d.block_size)
    group.add_argument("--num-blocks", type=positive_int, default=d.num_blocks)
    group.add_argument("--store-capacity", type=positive_int, default=d.store_capacity)
    group.add_argument("--token-budget", type=positive_int, default=d.token_budget)
    group.add_argument("--max-model-len", type=nonneg_int, default=d.max_model_len,
                       help="refuse requests whose prompt plus max tokens exceed this "
                       "(vLLM's admission; 0: what the KV cache holds)")
    group.add_argument("--events", dest="events", action="store_true", default=d.events)
    group.add_argument("--no-events", dest="events", action="store_false")
    group.add_argument("--faults", type=faults_arg, default=d.faults,
                       help="comma-separated fault sites, 'all' or 'none'")
    group.add_argument("--settle-time", type=positive_float, default=d.settle_time)
    group.add_argument("--groups", type=groups_arg, default=d.groups,
                       help="KV-cache groups, comma-separated: 'full' or 'swa:W' (sliding "
                       "window of W tokens), e.g. full,swa:8 (a hybrid model)")
    group.add_argument("--alignment", type=nonneg_int, default=d.alignment,
                       help="tokens a stored prefix ends on (the lcm block size; a multiple "
                       "of --block-size; 0: the block size). A sliding-window group stores "
                       "only the window before each boundary")


def options_from(args: argparse.Namespace) -> Any:
    import attrs

    from sim.simulator.runner import SimOptions

    values = {f.name: getattr(args, f.name) for f in attrs.fields(SimOptions)
              if hasattr(args, f.name)}
    return SimOptions(**values)


def validate_options(options: Any) -> None:
    """Refuse options `kvstate minimize` would refuse in the run's trace, or
    configs the trace reader would refuse: what ``sim`` runs, the rest of the
    tools take (`sim.simulator.runner.OPTION_LIMITS`, `kvstate.trace.LIMITS`)."""
    from kvstate.trace.codec import TraceError, check_limits
    from sim.simulator.runner import OPTION_LIMITS, build_configs, out_of_range

    for name in OPTION_LIMITS:
        value = getattr(options, name)
        why = out_of_range(name, value)
        if why:
            raise UsageError(f"--{name.replace('_', '-')}={value}: {why}")
    try:
        configs = build_configs(options)
    except ValueError as exc:
        raise UsageError(str(exc).replace("ConnectorConfig.", "--").replace("_", "-")) from None
    for config in configs:
        try:
            check_limits(config, "", "config")
        except TraceError as exc:
            raise UsageError(f"the run's config, {exc.field.removeprefix('config.')}: "
                             f"{exc.message} (a trace's limit, kvstate.trace.LIMITS)") from None
    if options.fast25_path and options.workload != "fast25":
        raise UsageError(f"--fast25-path {options.fast25_path}: only read with --workload "
                         "fast25 (the workload is synthetic)")
    from sim.simulator.engine import kv_capacity_tokens

    capacity = kv_capacity_tokens(options.num_blocks, options.block_size, len(options.groups))
    if options.max_model_len > capacity:
        # vLLM refuses to start when the KV cache cannot hold one max-length request.
        raise UsageError(f"--max-model-len={options.max_model_len}: the KV cache holds "
                         f"{capacity} tokens (--num-blocks x --block-size)")


DEFAULT_BUDGET = 60.0  # seconds per protocol of a search (campaign, fuzz)


def add_protocols(parser: argparse.ArgumentParser, *, budget: bool = True) -> None:
    """``--protocol`` (repeatable) and, for the searches, ``--budget`` per protocol."""
    parser.add_argument("--protocol", type=protocol_name, action="append",
                        help="variant (repeatable; default: kvstate)")
    if budget:
        parser.add_argument("--budget", type=positive_float, default=DEFAULT_BUDGET,
                            help="seconds per protocol")


@contextlib.contextmanager
def ray_cluster(address: str | None) -> Iterator[Any]:
    """The ``--ray ADDRESS`` connection (`sim.explore.cluster.Cluster`, one for the
    whole command), or ``None`` without the option. The cluster's own
    failures (`sim.explore.cluster.ClusterError`: Ray missing, no cluster at the
    address, a node with other code, an actor lost), when connecting or
    while the command runs, are usage errors (exit 2) that say which;
    anything else the command raises is its own, with its traceback."""
    if address is None:
        yield None
        return
    from sim.explore.cluster import Cluster, ClusterError

    try:
        cluster = Cluster(address)
    except ClusterError as e:
        raise UsageError(str(e)) from e
    with cluster:
        try:
            yield cluster
        except ClusterError as e:
            raise UsageError(str(e)) from e
