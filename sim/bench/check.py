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


def bench_check(requests: int = 400, path: str | None = None, repeats: int = 3) -> dict[str, Any]:
    """``kvstate check`` against bare parsing, on the same lines in the same
    process: ``json.loads``, orjson and msgspec (untyped) where installed,
    msgspec typed into the trace's structs (the fast path's own decode, where
    msgspec is installed), and the full check: ``repeats`` rounds, each timing
    every contender once (so a load spike on a shared machine hits all of
    them alike), best round of each. The trace is the default simulation's
    (``requests``) unless ``path`` names one."""
    import json
    import os
    import tempfile

    from kvstate.trace import fast_codec
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
        if codec is not None:
            parsers["msgspec typed (check's decode)"] = codec.decoder.decode
        figures: dict[str, Any] = {"lines": len(lines), "trace_bytes": os.path.getsize(path)}
        best = dict.fromkeys(parsers, float("inf"))
        best_check = float("inf")
        gc.collect()
        for _ in range(repeats):
            for name, parse in parsers.items():
                best[name] = min(best[name], _parse_seconds(lines, parse))
            started = time.perf_counter()
            result = check_trace(path)
            best_check = min(best_check, time.perf_counter() - started)
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
        return figures
    finally:
        if own:
            os.unlink(path)
