"""Memory of a FAST'25 replay: peak resident bytes at growing request counts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def bench_memory(counts: Sequence[int] = (10_000, 100_000), scale: int = 512) -> dict[str, Any]:
    """Peak resident memory of FAST'25 runs of increasing size, each in a
    fresh process (faults and events off: the size of the run, not of the
    consumer index, is what is measured)."""
    import json
    import subprocess
    import sys

    out: dict[str, Any] = {}
    for count in counts:
        # VmHWM (peak RSS of this address space): unlike ru_maxrss it is not
        # inherited across exec from the forking parent.
        code = (
            "import json\n"
            "from sim.simulator.runner import SimOptions, simulate\n"
            f"r = simulate(SimOptions(workload='fast25', requests={count}, scale={scale}, "
            "faults=(), events=False))\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print(json.dumps({'ok': r.ok, 'observations': r.figures['observations'], "
            "'peak_rss_kib': int(hwm.split()[1])}))\n"
        )
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["seconds"] = round(time.perf_counter() - started, 1)
        out[str(count)] = row
    keys = [str(c) for c in counts]
    if len(keys) >= 2:
        out["peak_ratio_largest_to_smallest"] = round(
            out[keys[-1]]["peak_rss_kib"] / out[keys[0]]["peak_rss_kib"], 3)
    return out
