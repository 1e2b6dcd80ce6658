"""``kvstate plot``: a run's timeline from its trace."""

from __future__ import annotations

import argparse
from typing import Any


def run(args: argparse.Namespace) -> int:
    from sim.plot import command

    return command(args)


def register(sub: Any) -> None:
    parser = sub.add_parser("plot", help="draw a run's timeline from its trace (needs "
                          "kvstate[plot]: matplotlib)")
    parser.add_argument("trace")
    parser.add_argument("-o", "--output", required=True,
                      help="the image to write; its suffix picks the format (.png, .svg, .pdf)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
