"""One module per ``kvstate`` command: each has ``register(sub)`` (its parser) and
``run(args) -> exit code``. ``COMMANDS`` is the order ``kvstate --help`` lists them."""

from __future__ import annotations

COMMANDS = (
    "demo",
    "scenarios",
    "specs",
    "simulate",
    "check",
    "plot",
    "replay",
    "trace",
    "minimize",
    "fuzz",
    "campaign",
    "real",
    "bench",
    "diagram",
    "coverage",
    "modelcheck",
)
