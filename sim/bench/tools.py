"""Bug-finding power: every variant against the three tools (simulator campaign,
Hypothesis, model checker), a row a variant."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

# Model-checker scopes in the order they are tried (small and cheap first).
TOOL_SCOPES = ("tiny", "load", "pd", "mla", "twins", "decode", "default", "churn")


def bench_tools(protocols: Sequence[str] | None = None, sim_budget: float = 30.0,
                mc_budget: float = 60.0, out_dir: str = ".",
                progress: Any = None, workers: int = 1, cluster: Any = None
                ) -> dict[str, Any]:
    """Per variant and tool: whether the tool finds the variant's *own* bug
    (one of its characteristic invariants, `kvstate.invariants.broken_by`: every E2-based mutant
    also has e2's bugs, which would otherwise be found first), seconds to find,
    and the counterexample's length — the simulator's in observations (not
    shrunk), Hypothesis's CI profile in rules after shrinking, the model
    checker's in actions (shortest, breadth-first). ``kvstate`` itself is run
    with every invariant on and must survive all three.

    ``workers`` > 1 computes the rows in that many processes (a row per
    variant, independent of the others); the table comes back in variant
    order, with the same findings and lengths as one process gives. The
    seconds are then measured beside the other workers: on a machine with
    fewer free cores than workers they grow, which is why one worker is the
    default for a benchmark.

    ``cluster`` (a `sim.explore.cluster.Cluster`): each row is a Ray task there
    instead, folded in variant order as well; its counterexample traces are
    written where the task ran and sent back, so they land in ``out_dir``
    here all the same (`_traced_tool_row`)."""
    from kvstate.variants import VARIANTS

    names = list(protocols or VARIANTS)
    job = functools.partial(_tool_row, sim_budget=sim_budget, mc_budget=mc_budget,
                            out_dir=out_dir)
    out: dict[str, Any] = {}
    rows: Any
    if cluster is not None:
        submit = cluster.task(_traced_tool_row)
        handles = [submit(name, sim_budget, mc_budget) for name in names]
        rows = (_land_traces(cluster.get(h), out_dir) for h in handles)
        pool = None
    elif workers <= 1 or len(names) < 2:
        rows = map(job, names)
        pool = None
    else:
        import multiprocessing

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        from sim.explore.workers import take_signals

        pool = ctx.Pool(min(workers, len(names)), initializer=take_signals)
        rows = pool.imap(job, names)  # in order, as each is ready
    try:
        for name, row in zip(names, rows):
            out[name] = row
            if progress is not None:
                progress(name, row)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return out


def _traced_tool_row(name: str, sim_budget: float, mc_budget: float
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """`_tool_row` on a cluster node: its traces go to a scratch directory
    there and come back as text (file name -> trace)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvstate-tools-") as scratch:
        row = _tool_row(name, sim_budget, mc_budget, scratch)
        traces = {}
        for file in sorted(os.listdir(scratch)):
            with open(os.path.join(scratch, file)) as f:
                traces[file] = f.read()
    return row, traces


def _land_traces(result: tuple[dict[str, Any], dict[str, str]], out_dir: str
                 ) -> dict[str, Any]:
    """Write a remote row's traces into ``out_dir`` and point the row at them."""
    import os

    row, traces = result
    os.makedirs(out_dir, exist_ok=True)
    for file, text in traces.items():
        with open(os.path.join(out_dir, file), "w") as f:
            f.write(text)
    found = row["modelcheck"]
    if found.get("trace"):
        found["trace"] = os.path.join(out_dir, os.path.basename(found["trace"]))
    return row


def _tool_row(name: str, sim_budget: float, mc_budget: float, out_dir: str) -> dict[str, Any]:
    """One variant's row of `bench_tools` (a module-level function: a worker
    process runs it)."""
    from kvstate.invariants import broken_by
    from sim.explore.campaign import campaign
    from sim.explore.fuzz import fuzz_ci
    from sim.explore.modelcheck.model import SCOPES
    from sim.explore.modelcheck.search import check

    row: dict[str, Any] = {"targets": list(broken_by(name))}
    only = broken_by(name) or None
    c = campaign(name, budget=sim_budget, stop_when=only or ())
    hits = [i for i in (only or c.first_found) if i in c.first_found]
    if hits:
        # Invariants one seed broke share its fold time (the campaign reads the
        # clock once a seed): the tie goes to the earlier observation, then the
        # name, never to chance.
        inv = min(hits, key=lambda k: (c.first_found[k], c.first_index.get(k, 0), k))
        row["sim"] = {"found": inv, "seconds": c.first_found[inv],
                      "length": c.first_index[inv], "unit": "observations"}
    else:
        row["sim"] = {"found": None, "seconds": c.seconds, "runs": c.runs}
    f = fuzz_ci(name, out_dir=out_dir, only=only)
    row["hypothesis"] = ({"found": f.invariant, "seconds": f.seconds, "length": f.rules,
                          "unit": "rules", "profile": f.profile} if not f.ok
                         else {"found": None, "seconds": f.seconds})
    spent = 0.0
    row["modelcheck"] = {"found": None, "seconds": 0.0, "scopes": []}
    for scope in TOOL_SCOPES:
        r = check(SCOPES[scope], name, budget=mc_budget, out_dir=out_dir, only=only)
        spent += r.seconds
        row["modelcheck"]["scopes"].append(
            {"scope": scope, "states": r.states, "exhaustive": r.exhaustive})
        if r.violation is not None:
            row["modelcheck"].update(found=r.violation.invariant, scope=scope,
                                     length=len(r.violation.actions), unit="actions",
                                     states=r.states, trace=r.violation.trace)
            break
    row["modelcheck"]["seconds"] = round(spent, 3)
    return row


def format_tools(report: dict[str, Any]) -> str:
    rows = [["variant", "its invariants", "simulator", "hypothesis (CI profile)",
             "model checker"]]
    for name, row in report.items():
        cells = [name, " ".join(row["targets"]) or "(all)"]
        for tool in ("sim", "hypothesis", "modelcheck"):
            r = row[tool]
            if r["found"] is None:
                cells.append(f"not found ({r['seconds']:.1f} s)")
            else:
                where = f" [{r['scope']}]" if tool == "modelcheck" else (
                    f" [{r['profile']}]" if tool == "hypothesis" and r["profile"] != "both"
                    else "")
                cells.append(f"{r['found']} {r['seconds']:.1f} s, {r['length']} "
                             f"{r['unit']}{where}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
