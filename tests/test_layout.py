"""The layout shows the architecture (issue 31, item 4): imports run one way.

Top down, the layers are: the commands (``sim/cli.py``, ``sim/commands/``); the
benchmarks, the pictures and the adapters (``sim/bench/``, ``sim/pictures/``,
``adapters/``); the exploration engines and the trace tools (``sim/explore/``,
``sim/traces/``); the simulator (``sim/simulator/``); ``sim/extras.py``; the core
(``kvstate/``). Every import in every module (at the top or inside a function,
read with ``ast``, not by importing) names its own package or a layer below;
never a layer above, nor a neighbour in its own layer. docs/reference/layout.md
and the README say the same; this test is what keeps them true.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (package prefix, layer): the longest prefix that matches a module decides.
# A group is a prefix; two groups on one layer are neighbours and do not
# import each other.
GROUPS: dict[str, int] = {
    "kvstate": 0,
    "sim.extras": 1,
    "sim.simulator": 2,
    "sim.explore": 3,
    "sim.traces": 3,
    "sim.bench": 4,
    "sim.pictures": 4,
    "adapters": 4,
    "sim.commands": 5,
    "sim.cli": 5,
}
COMMANDS = ("sim.commands", "sim.cli")
# The model checker's modules bottom up: each imports only those before it.
MODELCHECK = ("model", "values", "visited", "frontier", "checkpoint", "compact", "search")


def group_of(module: str) -> str | None:
    """The group a dotted module name belongs to (None: outside the project,
    or the bare ``sim`` package)."""
    best = None
    for prefix in GROUPS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    return sorted(p for top in ("kvstate", "sim", "adapters") for p in (ROOT / top).rglob("*.py"))


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in ``path``, relative ones resolved;
    ``from a import b`` yields ``a.b`` too (``b`` may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            yield node.lineno, origin
            for alias in node.names:
                yield node.lineno, f"{origin}.{alias.name}"


def upward(path: Path) -> list[str]:
    """Every import in ``path`` that breaks the rule, said as file:line."""
    here = module_name(path)
    mine = group_of(here)
    wrong = []
    for line, name in imports(path):
        theirs = group_of(name)
        if mine is None or theirs is None or theirs == mine:
            continue
        if GROUPS[theirs] > GROUPS[mine]:
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} ({mine}, layer "
                         f"{GROUPS[mine]}) imports {name} ({theirs}, layer {GROUPS[theirs]}: "
                         "above)")
        elif GROUPS[theirs] == GROUPS[mine] and not (theirs in COMMANDS and mine in COMMANDS):
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} ({mine}) imports {name} "
                         f"({theirs}: a neighbour on layer {GROUPS[mine]})")
    return wrong


def test_every_module_belongs_to_a_layer() -> None:
    """A new folder in sim/ gets a place in GROUPS (and in layout.md)."""
    strays = [str(p.relative_to(ROOT)) for p in sources()
              if group_of(module_name(p)) is None and module_name(p) != "sim"]
    assert strays == []


def test_no_module_imports_upward() -> None:
    wrong = [w for p in sources() for w in upward(p)]
    assert wrong == [], "\n".join(wrong)


def test_only_the_commands_and_the_tests_import_the_commands() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line}: {name}"
             for p in sources() if group_of(module_name(p)) not in COMMANDS
             for line, name in imports(p) if group_of(name) in COMMANDS]
    assert wrong == []


def test_kvstate_imports_neither_sim_nor_adapters() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line}: {name}"
             for p in (ROOT / "kvstate").rglob("*.py")
             for line, name in imports(p) if name.split(".")[0] in ("sim", "adapters")]
    assert wrong == []


def test_the_model_checker_makes_no_circle() -> None:
    """Its modules import only those before them in MODELCHECK (the circle
    model, compact, state and checkpoint once made is gone)."""
    folder = ROOT / "sim" / "explore" / "modelcheck"
    assert {p.stem for p in folder.glob("*.py")} == {*MODELCHECK, "__init__"}
    wrong = []
    for n, stem in enumerate(MODELCHECK):
        for line, name in imports(folder / f"{stem}.py"):
            parts = name.split(".")
            if parts[:3] == ["sim", "explore", "modelcheck"] and len(parts) > 3 \
                    and parts[3] in MODELCHECK and MODELCHECK.index(parts[3]) >= n:
                wrong.append(f"{stem}.py:{line}: {name}")
    init = imports(folder / "__init__.py")
    assert wrong == [] and list(init) == []


@pytest.mark.parametrize(("source", "expected"), [
    ("from sim.commands.errors import UsageError\n", "imports sim.commands.errors"),
    ("def f():\n    from sim.cli import main\n", "imports sim.cli"),
    ("from sim.explore.campaign import campaign\n", "above"),
    ("from ..traces import check\n", "a neighbour"),
])
def test_the_check_sees_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         source: str, expected: str) -> None:
    """The rule catches an import from above, inside a function, relative, or
    from a neighbour (a module written into a copy of the layout)."""
    fake = ROOT / "sim" / "explore" / "_layout_probe.py"
    if expected == "above":
        fake = ROOT / "sim" / "simulator" / "_layout_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert any(expected in w for w in upward(fake)), upward(fake)


def test_no_circle_among_sims_modules() -> None:
    """No module of sim/ reaches itself through imports (at the top or inside
    functions): the layers allow none between packages, and within a package
    each is cut by hand (kvstate's own circles are outside this issue)."""
    sims = {module_name(p): p for p in sources() if module_name(p).split(".")[0] == "sim"}
    edges = {m: {n for _, n in imports(p) if n in sims and n != m} for m, p in sims.items()}
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> list[str]:
        if m in path:
            return [*path[path.index(m):], m]
        if m in done:
            return []
        for n in sorted(edges[m]):
            circle = walk(n, [*path, m])
            if circle:
                return circle
        done.add(m)
        return []

    circles = [c for m in sorted(sims) if (c := walk(m, []))]
    assert circles == [], " -> ".join(circles[0])
