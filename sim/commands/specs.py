"""``kvstate specs``: check or write the generated files in specs/."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.commands.errors import UsageError
from sim.commands.output import envelope
from sim.commands.paths import output_dir


def run(args: argparse.Namespace) -> int:
    from kvstate.specs import rendered_specs, write_specs

    root = Path(args.root)
    if args.write:
        for rel in rendered_specs():  # all writable, or none is written
            target = root / rel
            if target.is_dir():
                raise UsageError(f"--root {root}: {target} is a directory")
            output_dir(str(target.parent), "--root")
        written = write_specs(root)
        if not args.json:
            for path in written:
                print(f"wrote {path}")
        else:
            print(envelope({"ok": True, "violations": [], "written": [str(p) for p in written]}))
        return 0
    if not root.is_dir():
        raise UsageError(f"--root={root}: no specs directory there (run from a kvstate "
                         "checkout, point --root at its specs/, or --write to create one)")
    stale = [rel for rel, text in rendered_specs().items()
             if not (root / rel).exists() or (root / rel).read_text() != text]
    if args.json:
        print(envelope({"ok": not stale, "violations": [], "stale": stale}))
    else:
        print("\n".join(f"stale: {root / rel}" for rel in stale) or "specs are up to date")
    return 1 if stale else 0


def register(sub: Any) -> None:
    parser = sub.add_parser("specs", help="check (or --write) the generated files in specs/")
    parser.add_argument("--root", default="specs")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)
