"""``kvstate minimize``: shrink a failing run to a small one that fails the same way.

The inputs of a simulator run are its options (seed, workload size, fault
sites, ranks...), so shrinking works on them, in named passes run to a fixed
point, each keeping a change only if the *same invariant* still fires:

``fewer-requests``   bisect the workload size down;
``fewer-faults``     switch fault sites off one at a time;
``fewer-ranks``      halve the tensor-parallel world.

The result is written as a trace that ``kvstate replay`` and ``kvstate
check`` take, with the command that reproduces it.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvstate.trace import TraceError, TraceReader
from kvstate.variants import VARIANTS, is_variant
from sim.simulator.faults import SITES
from sim.simulator.runner import (
    SimOptions,
    SimResult,
    build_configs,
    out_of_range,
    parse_groups,
    simulate,
)

OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "setup": ("both", "pd"), "workload": ("synthetic", "fast25"),
}


def _known_protocol(name: str, where: str, field: str) -> bool:
    try:
        return is_variant(name)
    except ValueError as exc:  # a module KVSTATE_VARIANTS names does not import
        raise TraceError(where, field, str(exc)) from None


def check_header_options(path: str | Path, header: dict[str, Any]) -> None:
    """A header that records simulator ``options`` gets them checked as
    `options_from_trace` does (a ``TraceError`` naming the field), so
    ``check`` and ``replay`` do not read garbage there as a valid trace."""
    if "options" in header:
        options_from_trace(path)


def options_from_trace(path: str | Path) -> SimOptions:
    """The simulator options a trace's header records, each checked for type,
    range and known names (fault sites, protocols) before anything runs; a bad
    one is a ``TraceError`` naming ``file:1``, the field and the value."""
    with TraceReader(path) as reader:
        header = reader.header
    where = f"{reader.name}:1"
    raw = header.get("options")
    if not isinstance(raw, dict):
        raise TraceError(where, "options", "missing: no simulator options in the header; "
                         "minimize works on simulator traces")
    defaults = SimOptions()
    fields = {f.name for f in attrs.fields(SimOptions)}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        field = f"options.{name}"
        if name not in fields:
            raise TraceError(where, field, "not a simulator option")
        default = getattr(defaults, name)
        if isinstance(default, bool):
            if type(value) is not bool:
                raise TraceError(where, field, f"expected true/false, got {value!r}")
        elif isinstance(default, (int, float)):
            kinds = (int,) if isinstance(default, int) else (int, float)
            why = out_of_range(name, value) if type(value) in kinds else (
                "expected an integer" if kinds == (int,) else "expected a number")
            if why:
                raise TraceError(where, field, f"{why}, got {value!r}")
            value = type(default)(value)
        elif name == "groups":
            if type(value) is not list or not all(type(v) is str for v in value) \
                    or len(value) > 64:
                raise TraceError(where, field, f"expected a list of groups, got {value!r}")
            try:
                parse_groups(tuple(value))
            except ValueError as exc:
                raise TraceError(where, field, str(exc)) from None
            value = tuple(value)
        elif isinstance(default, tuple):  # faults
            if type(value) is not list or not all(type(v) is str for v in value):
                raise TraceError(where, field, f"expected a list of fault sites, got {value!r}")
            unknown = [v for v in value if v not in SITES]
            if unknown:
                raise TraceError(where, field, f"unknown fault site {unknown[0]!r} (known: "
                                 f"{', '.join(SITES)})")
            value = tuple(value)
        elif type(value) is not str:
            raise TraceError(where, field, f"expected a string, got {value!r}")
        elif name == "protocol" and not _known_protocol(value, where, field):
            raise TraceError(where, field, f"{value!r} is not one of {', '.join(VARIANTS)}")
        elif name in OPTION_CHOICES and value not in OPTION_CHOICES[name]:
            raise TraceError(where, field, f"{value!r} is not one of "
                             f"{', '.join(OPTION_CHOICES[name])}")
        elif name == "fast25_path" and value:
            try:
                regular = stat.S_ISREG(os.stat(value).st_mode)
            except OSError as exc:
                raise TraceError(where, field, f"{value!r}: {exc.strerror}") from None
            if not regular:
                raise TraceError(where, field, f"{value!r} is not a regular file")
        values[name] = value
    options = SimOptions(**values)
    try:
        build_configs(options)
    except ValueError as exc:
        raise TraceError(where, "options", str(exc)) from None
    return options


@attrs.define
class Minimized:
    invariant: str
    original: SimOptions
    options: SimOptions
    result: SimResult
    runs: int
    passes: list[str]


class NothingToMinimize(ValueError):
    pass


def minimize(options: SimOptions, invariant: str | None = None, max_runs: int = 200,
             progress: Callable[[str], None] | None = None) -> Minimized:
    first = simulate(options)
    if first.ok:
        raise NothingToMinimize(f"the run violates nothing: {options.command()}")
    target = invariant or first.findings[0][1].invariant
    if invariant is not None and all(f.invariant != invariant for _, f in first.findings):
        raise NothingToMinimize(f"the run does not violate {invariant}")
    runs = 1
    best, best_result = options, first
    applied: list[str] = []

    def fails(candidate: SimOptions) -> SimResult | None:
        nonlocal runs
        if runs >= max_runs:
            return None
        try:  # a pass may propose a shape no engine can have: not a smaller failing run
            build_configs(candidate)
        except ValueError:
            return None
        runs += 1
        result = simulate(candidate)
        return result if any(f.invariant == target for _, f in result.findings) else None

    changed = True
    while changed and runs < max_runs:
        changed = False
        # fewer-requests: bisect between 1 and the current size.
        low, high = 1, best.requests
        while low < high and runs < max_runs:
            mid = (low + high) // 2
            result = fails(attrs.evolve(best, requests=mid))
            if result is not None:
                high = mid
                best, best_result = attrs.evolve(best, requests=mid), result
                changed = True
                applied.append(f"fewer-requests -> {mid}")
            else:
                low = mid + 1
        # fewer-faults: drop fault sites that are not needed.
        for site in list(best.faults):
            candidate = attrs.evolve(best, faults=tuple(s for s in best.faults if s != site))
            result = fails(candidate)
            if result is not None:
                best, best_result = candidate, result
                changed = True
                applied.append(f"fewer-faults -{site}")
        # fewer-ranks.
        if best.world_size > 1:
            ranks = best.world_size // 2  # put_step must divide the world size
            candidate = attrs.evolve(best, world_size=ranks, put_step=math.gcd(best.put_step, ranks))
            result = fails(candidate)
            if result is not None:
                best, best_result = candidate, result
                changed = True
                applied.append(f"fewer-ranks -> {candidate.world_size}")
        if progress is not None:
            progress(f"minimize: {runs} runs, {best.requests} requests, "
                     f"{len(best.faults)} fault sites, world size {best.world_size}")
    return Minimized(target, options, best, best_result, runs, applied)
