"""``kvstate check``: run the invariant monitors over a recorded trace.

The trace is an implementation's observations — the simulator's, or one
recorded from a production engine in the same format — read as a stream: one
line decoded, one observation handed to its engine's monitor, nothing kept but
the monitors' own bounded state. Time is linear in the trace's length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from kvstate.invariants import Finding, Monitor
from kvstate.trace import TraceReader


@attrs.define
class CheckResult:
    path: str
    lines: int
    observations: int
    engines: int
    findings: list[tuple[int, int, Finding]]  # (trace line, engine, finding)
    header: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not self.findings


def check_trace(path: str | Path, stop_at_first: bool = False) -> CheckResult:
    with TraceReader(path) as reader:
        shared: set[str] = set()
        monitors = [Monitor(config, store_view=shared) for config in reader.header["configs"]]
        seen = [0] * len(monitors)
        findings: list[tuple[int, int, Finding]] = []
        observations = 0
        for number, engine, _, obs in reader:
            monitor = monitors[engine]
            monitor.observe(obs)
            observations += 1
            if len(monitor.findings) > seen[engine]:
                for finding in monitor.findings[seen[engine]:]:
                    findings.append((number, engine, finding))
                seen[engine] = len(monitor.findings)
                if stop_at_first:
                    break
        return CheckResult(reader.name, reader.last_line, observations, len(monitors),
                           findings, reader.header)
