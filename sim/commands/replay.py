"""``kvstate replay``: re-drive the model from a trace; first divergence."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.options import protocol_name
from sim.commands.output import envelope


def run(args: argparse.Namespace) -> int:
    from sim.traces.replay import replay_trace

    result = replay_trace(args.trace, protocol=args.protocol)
    d = result.divergence
    if args.json:
        print(envelope({"ok": result.ok, "violations": [] if d is None else [
            {"invariant": "divergence", "event_index": d.line, "message":
             f"{d.kind}{d.field}: expected {d.expected}, got {d.got}",
             "decision": d.decision}],
            "protocol": result.protocol, "lines": result.lines,
            "outputs_compared": result.compared}))
    else:
        print(f"{args.trace}: replayed with protocol {result.protocol}; "
              f"{result.compared} outputs compared over {result.lines} lines")
        if d is not None:
            print(f"DIVERGENCE at line {d.line} (engine {d.engine}), {d.kind}{d.field}:")
            print(f"  {d.decision}")
            print(f"  recorded: {d.expected}")
            print(f"  model:    {d.got}")
        print(f"result: {'identical' if result.ok else 'DIVERGED'}")
    return 0 if result.ok else 1


def register(sub: Any) -> None:
    parser = sub.add_parser("replay", help="re-drive the model from a trace; first divergence")
    parser.add_argument("trace")
    parser.add_argument("--protocol", type=protocol_name, default=None,
                        help="replay with another variant (default: the trace's)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
