"""``kvstate plot``: a run's timeline from its trace."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.paths import output_file


def run(args: argparse.Namespace) -> int:
    """Checks the extra and the output before reading the trace; the drawing is
    `sim.pictures.plot.plot_trace`."""
    from pathlib import Path

    from sim.extras import require
    from sim.pictures.plot import plot_trace

    require("matplotlib", "kvstate plot")
    from matplotlib.backend_bases import FigureCanvasBase

    output = Path(args.output)
    kind = output.suffix.lstrip(".").lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if kind not in known:
        raise UsageError(f"-o {args.output}: unknown image format {kind or '(no suffix)'!r}; "
                         f"known: {', '.join(sorted(known))}")
    output_file(args.output, "-o")
    summary = plot_trace(args.trace, output, title=args.title)
    if args.json:
        import json

        print(json.dumps({"ok": True, "violations": [], **summary.as_dict()}, sort_keys=True))
    else:
        print(f"{summary.output}: timeline of {summary.path} ({summary.observations} "
              f"observations, {summary.engines} engine(s), {summary.ranks} rank(s), "
              f"t {summary.duration:g})")
        print(f"  pins: peak {summary.peak_pins}, {summary.pins_at_end} at the end; "
              f"{summary.preemptions} preemptions")
        print(f"  send queues: peak depth {summary.peak_queue_depth}, peak in flight "
              f"{summary.peak_jobs_in_flight} (one rank)")
        print(f"  store: {summary.rejections_200} puts answered -200, {summary.skipped_jobs} "
              f"jobs skipped under pressure, dedup {summary.dedup_hits}/{summary.exists_keys} "
              f"keys found present")
        print(f"  KV events: {summary.events_published} published, {summary.orphans} orphans")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("plot", help="draw a run's timeline from its trace (needs "
                          "kvstate[plot]: matplotlib)")
    parser.add_argument("trace")
    parser.add_argument("-o", "--output", required=True,
                      help="the image to write; its suffix picks the format (.png, .svg, .pdf)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
