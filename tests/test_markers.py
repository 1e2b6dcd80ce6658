"""The default selection: what `pytest` alone runs, and what it leaves out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import WHOLLY_SLOW_MODULES, pytest_ignore_collect

TESTS = Path(__file__).parent


def _module_marks(path: Path) -> set[str]:
    """The marker names of a module's own ``pytestmark`` assignment."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                    and n.value.attr == "mark"}
    return set()


def test_the_modules_left_uncollected_are_exactly_the_wholly_slow_ones() -> None:
    wholly_slow = {p.name for p in TESTS.glob("test_*.py") if "slow" in _module_marks(p)}
    assert wholly_slow == WHOLLY_SLOW_MODULES


class _Config:
    def __init__(self, markexpr: str) -> None:
        self.markexpr = markexpr

    def getoption(self, name: str, default: str = "") -> str:
        assert name == "markexpr"
        return self.markexpr


@pytest.mark.parametrize("markexpr,ignored", [
    ("not slow", True),  # the default selection (pyproject addopts)
    ("", False),  # CI: pytest -m '' runs everything
    ("slow", False),
    ("vllm", False),
    ("not slow and not mooncake", False),  # any other expression decides per test
])
def test_only_the_default_selection_skips_collecting_them(markexpr: str,
                                                          ignored: bool) -> None:
    for name in WHOLLY_SLOW_MODULES:
        assert bool(pytest_ignore_collect(TESTS / name, _Config(markexpr))) is ignored
    assert pytest_ignore_collect(TESTS / "test_sim.py", _Config(markexpr)) is None
