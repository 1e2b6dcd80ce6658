"""Each variant is a small policy object, and each changes something observable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvstate.harness import Harness
from kvstate.invariants import CATALOGUE
from kvstate.scenarios import SCENARIOS, run
from kvstate.variants import MUTANTS, VARIANTS

ROOT = Path(__file__).resolve().parent.parent


def signature(h: Harness) -> tuple:
    """What an outside observer can see of a run."""
    return (
        tuple(sorted(h.monitor.fired())),
        tuple(sorted(h.store.objects.items())),
        tuple(h.published),
        tuple((p.saves, p.pins, p.releases, p.loads) for p in h.plans),
    )


def test_command_line_names() -> None:
    assert list(VARIANTS)[:4] == ["kvstate", "e2", "e1", "e0"]
    assert len(MUTANTS) >= 9
    for name in VARIANTS:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), name
    required = {
        "req-id-counter-ledger", "no-pins-on-preemption", "delayed-free-at-finish",
        "parent-previous-emitted", "retry-keyed-by-request", "missing-finally",
        "boundary-without-plus-one", "save-on-loading-step", "consumer-without-backfill",
    }
    assert required <= set(VARIANTS)


_BASELINE = {name: signature(run(name, "kvstate")) for name in SCENARIOS}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "kvstate"])
def test_each_variant_changes_observable_behaviour_in_some_scenario(variant: str) -> None:
    differing = [name for name in SCENARIOS if signature(run(name, variant)) != _BASELINE[name]]
    assert differing, f"{variant} behaves exactly like kvstate in every scenario"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "kvstate"])
def test_each_variant_breaks_some_invariant(variant: str) -> None:
    """e2 and the mutants are known-buggy: the catalogue must catch each."""
    fired = set()
    for name in SCENARIOS:
        fired |= run(name, variant).monitor.fired()
    assert fired, f"no invariant catches {variant}"


def test_runs_are_deterministic() -> None:
    for name in SCENARIOS:
        assert signature(run(name, "e2")) == signature(run(name, "e2"))


def test_core_has_no_variant_branches_and_imports_neither_sim_nor_adapters() -> None:
    for path in (ROOT / "kvstate").rglob("*.py"):
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""]
                assert not any(n.split(".")[0] in ("sim", "adapters") for n in names), path
            if isinstance(node, ast.Compare) and path.name != "variants.py":
                text = ast.unparse(node)
                assert "variant.name" not in text and ".name ==" not in text, (path, text)


def test_catalogue_breakers_are_known_variants_or_faults() -> None:
    for inv in CATALOGUE:
        assert inv.broken_by in VARIANTS or inv.broken_by.startswith("fault:"), inv
