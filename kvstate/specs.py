"""The generated parts of ``specs/``: the invariant catalogue and the diagrams.

``specs/`` is documentation, never read at run time; tests compare it with
what this module renders, so it cannot drift from the code.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.contract import render_markdown
from kvstate.diagrams import all_diagrams
from kvstate.invariants import CATALOGUE
from kvstate.trace import trace_schema


def render_invariants() -> str:
    lines = [
        "# Invariant catalogue",
        "",
        "Generated from `kvstate.invariants.CATALOGUE` by `kvstate specs --write`; do not edit.",
        "`S*` are the invariants found upstream, `K*` are kvstate's own",
        "(docs/invariants.md tells their history). *Broken by* names the protocol variant (or fault) and the scenario",
        "(`kvstate.scenarios`) under which the checker is shown to fire; the default protocol",
        "runs the same scenario silently.",
        "",
        "S5 (no job dequeued without a ledger entry) has no checker: the executor registers a",
        "job in the same call that enqueues it, so there is nothing to observe.",
        "",
        "| id | invariant | kind | checked at | broken by | scenario | upstream |",
        "|---|---|---|---|---|---|---|",
    ]
    for inv in CATALOGUE:
        lines.append(
            f"| {inv.id} | {inv.statement} | {inv.kind} | {inv.checked_at} | "
            f"`{inv.broken_by}` | {inv.scenario} | {inv.upstream} |"
        )
    return "\n".join(lines) + "\n"


# Named scenarios whose traces are committed under specs/scenarios/ and replayed
# by the tests: each shows one hazard the default protocol handles.
SCENARIO_TRACES = (
    "preempt-with-queued-job",
    "reuse-with-stale-job",
    "consumer-backfill",
    "shared-prefix",
)


def render_scenario_trace(name: str) -> str:
    from kvstate.scenarios import run

    return run(name, "kvstate").trace_text(scenario=name)


def rendered_specs() -> dict[str, str]:
    files = {
        "invariants.md": render_invariants(),
        "trace.schema.json": json.dumps(trace_schema(), indent=2, sort_keys=True) + "\n",
        "trace.md": render_markdown(),
    }
    files.update({f"diagrams/{name}": text for name, text in all_diagrams().items()})
    files.update({f"scenarios/{name}.jsonl": render_scenario_trace(name)
                  for name in SCENARIO_TRACES})
    return files


def write_specs(root: Path) -> list[Path]:
    written = []
    for rel, text in rendered_specs().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written
