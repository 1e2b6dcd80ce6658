"""Coverage of every machine from recorded traces.

A trace holds every input the planner and the executors took, and replay
feeds them to a fresh planner and fresh executors, which fire the same table
entries the recorded run fired. So a trace's coverage is its replay's, recorded
with `kvstate.coverage.recording`: exact, for all machines, whatever produced
the trace (simulator, fuzzer, model checker, or a real-store run).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvstate.coverage import Coverage, recording
from sim.traces.replay import replay_trace


class CoverageError(Exception):
    """A trace could not be replayed, so its coverage would be wrong."""


def trace_coverage(paths: Iterable[str | Path], into: Coverage | None = None) -> Coverage:
    cov = into if into is not None else Coverage()
    for path in paths:
        with recording(cov):
            result = replay_trace(path)
        if result.divergence is not None:
            d = result.divergence
            raise CoverageError(
                f"{path}:{d.line}: replay diverged ({d.kind}{' ' + d.field if d.field else ''}): "
                f"recorded {d.expected}, replayed {d.got}; coverage would be wrong")
    return cov
