"""The CPU clock the verification-at-scale benchmarks (issue 11) read."""

from __future__ import annotations


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children: with the
    wall-clock rate it tells parallel overhead from a machine shared with
    other work (a loaded machine lowers the rate, not the CPU per unit)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
