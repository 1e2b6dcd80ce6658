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
from kvstate.trace import TraceError, decode_line, iter_lines, read_header


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
    name = str(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, streaming
    except OSError as exc:
        raise TraceError(name, "", f"cannot open ({exc.strerror})") from None
    with handle:
        lines = iter_lines(handle, name)
        first = next(lines, None)
        if first is None:
            raise TraceError(f"{name}:1", "", "empty trace (no header)")
        number, text = first
        header = read_header(text, f"{name}:{number}")
        shared: set[str] = set()
        monitors = [Monitor(config, store_view=shared) for config in header["configs"]]
        seen = [0] * len(monitors)
        findings: list[tuple[int, int, Finding]] = []
        observations = 0
        last = number
        for number, text in lines:
            last = number
            _, engine, _, obs = decode_line(text, f"{name}:{number}")
            if not 0 <= engine < len(monitors):
                raise TraceError(f"{name}:{number}", "e",
                                 f"engine {engine} but the header configures {len(monitors)}")
            monitor = monitors[engine]
            monitor.observe(obs)
            observations += 1
            if len(monitor.findings) > seen[engine]:
                for finding in monitor.findings[seen[engine]:]:
                    findings.append((number, engine, finding))
                seen[engine] = len(monitor.findings)
                if stop_at_first:
                    break
    return CheckResult(name, last, observations, len(monitors), findings, header)
