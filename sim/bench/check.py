"""Trace-check throughput: `kvstate check` on a simulated run's trace, by decoder."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any


def _parse_seconds(lines: Sequence[bytes], parse: Any) -> float:
    started = time.perf_counter()
    for line in lines:
        parse(line)
    return time.perf_counter() - started


# What another revision runs (`sim.bench.baseline`): its own check of the
# same trace file, timed inside its process.
_BASELINE = """
import json, sys, time
from sim.traces.check import check_trace
started = time.perf_counter()
r = check_trace(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - started, "ok": r.ok,
                  "findings": len(r.findings)}))
"""


def bench_check(requests: int = 400, path: str | None = None, repeats: int = 3,
                against: str | None = None) -> dict[str, Any]:
    """``kvstate check`` against bare parsing, on the same lines in the same
    process: ``json.loads``, orjson and msgspec (untyped) where installed,
    msgspec typed into the trace's structs (the fast path's own decode, where
    msgspec is installed), and the full check: ``repeats`` rounds, each timing
    every contender once (so a load spike on a shared machine hits all of
    them alike), best round of each. The trace is the default simulation's
    (``requests``) unless ``path`` names one. ``against`` (a git revision
    of this checkout): that revision's check of the same file joins every
    round, in a process of its own."""
    import contextlib
    import json
    import os
    import tempfile

    from kvstate.trace import fast_codec
    from sim.bench.baseline import revision_tree, run_in
    from sim.simulator.runner import SimOptions, simulate
    from sim.traces.check import check_trace

    own = path is None
    if path is None:
        fd, path = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        with open(path, "w") as out:
            simulate(SimOptions(requests=requests), trace=out)
    try:
        with open(path, "rb") as handle:
            lines = handle.read().splitlines()[1:]
        parsers: dict[str, Any] = {"json.loads": json.loads}
        try:
            import orjson

            parsers["orjson.loads"] = orjson.loads
        except ImportError:
            pass
        try:
            import msgspec

            parsers["msgspec untyped"] = msgspec.json.Decoder().decode
        except ImportError:
            pass
        codec = fast_codec()
        typed = None
        if codec is not None:
            typed = "msgspec typed (check's decode)"
            parsers[typed] = codec.decoder.decode
        figures: dict[str, Any] = {"lines": len(lines), "trace_bytes": os.path.getsize(path)}
        best = dict.fromkeys(parsers, float("inf"))
        best_check = best_theirs = float("inf")
        theirs: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            tree = (stack.enter_context(revision_tree(against))
                    if against is not None else None)
            gc.collect()
            for _ in range(repeats):
                for name, parse in parsers.items():
                    best[name] = min(best[name], _parse_seconds(lines, parse))
                started = time.perf_counter()
                result = check_trace(path)
                best_check = min(best_check, time.perf_counter() - started)
                if tree is not None and against is not None:
                    theirs = run_in(tree, against, "check", _BASELINE, path)
                    best_theirs = min(best_theirs, theirs["seconds"])
        rates = {name: len(lines) / seconds for name, seconds in best.items()}
        figures["check_ok"] = result.ok
        figures["fast_decoder"] = codec is not None
        check_rate = len(lines) / best_check
        bare = {name: rate for name, rate in rates.items() if not name.startswith("msgspec typed")}
        fastest = max(bare, key=lambda n: bare[n])
        for name, rate in rates.items():
            figures[f"{name} lines/s"] = round(rate)
        figures["kvstate check lines/s"] = round(check_rate)
        figures["fastest bare parse"] = fastest
        figures["ratio check / json.loads"] = round(check_rate / rates["json.loads"], 3)
        figures["ratio check / fastest bare parse"] = round(check_rate / bare[fastest], 3)
        if typed is not None:
            figures["ratio check / msgspec typed"] = round(check_rate / rates[typed], 3)
        if against is not None:
            figures["against"] = against
            figures["against_same_verdict"] = (theirs["ok"] == result.ok
                                               and theirs["findings"] == len(result.findings))
            figures["against lines/s"] = round(len(lines) / best_theirs)
            figures["speedup over against"] = round(best_theirs / best_check, 3)
        return figures
    finally:
        if own:
            os.unlink(path)
