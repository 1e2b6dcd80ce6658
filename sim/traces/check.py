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
from kvstate.trace import TraceError, TraceReader, header_none_hash
from sim.traces.minimize import check_header_options

# Steps after which a job not reported, a job not released or a pin not
# released counts as stuck where a trace ends (a header's "liveness_steps" or
# --liveness-steps overrides it).
DEFAULT_LIVENESS_STEPS = 64


@attrs.define
class CheckResult:
    path: str
    lines: int
    observations: int
    engines: int
    findings: list[tuple[int, int, Finding]]  # (trace line, engine, finding)
    header: dict[str, Any]
    notes: list[str] = attrs.Factory(list)  # what could not be judged, and why

    @property
    def ok(self) -> bool:
        return not self.findings


def check_trace(path: str | Path, stop_at_first: bool = False,
                liveness_steps: int | None = None, at_end: str = "closed") -> CheckResult:
    """Check a trace; at its end, judge liveness (`Monitor.finish`) with
    ``liveness_steps`` (default: the header's ``liveness_steps``, else
    ``DEFAULT_LIVENESS_STEPS``) unless it stopped at a first finding."""
    with TraceReader(path, fast=True) as reader:
        header = reader.header
        check_header_options(path, header)
        bound = liveness_steps or header.get("liveness_steps") or DEFAULT_LIVENESS_STEPS
        shared: set[str] = set()
        none_hash = header_none_hash(header)
        monitors = [Monitor(config, store_view=shared, block_hash=header["block_hash"],
                            none_hash=none_hash, shared_store=header.get("store") == "shared")
                    for config in header["configs"]]
        seen = [0] * len(monitors)
        findings: list[tuple[int, int, Finding]] = []
        observations = 0
        for number, engine, _, obs in reader:
            monitor = monitors[engine]
            try:
                monitor.observe(obs, reader.absent)
            except Exception as exc:  # a monitor must judge any valid line, never crash
                raise TraceError(f"{reader.name}:{number}", "",
                                 f"the checker could not take this {type(obs).__name__} "
                                 f"({type(exc).__name__}: {exc})") from None
            observations += 1
            if len(monitor.findings) > seen[engine]:
                for finding in monitor.findings[seen[engine]:]:
                    findings.append((number, engine, finding))
                seen[engine] = len(monitor.findings)
                if stop_at_first:
                    break
        notes: list[str] = []
        for engine, monitor in enumerate(monitors):
            if stop_at_first and findings:
                break
            before = len(monitor.findings)
            ended = monitor.finish(bound, at_end)
            findings += [(reader.last_line, engine, f) for f in monitor.findings[before:]]
            prefix = f"engine {engine}: " if len(monitors) > 1 else ""
            notes += [prefix + note for note in ended + monitor.notes()]
        return CheckResult(reader.name, reader.last_line, observations, len(monitors),
                           findings, header, notes)
