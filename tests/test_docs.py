"""The docs hold: their example trace checks clean, their paths exist, their
commands parse, the command reference is the parser's, and the site builds
with ``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cli import build_parser, main
from sim.commands.reference import markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").rglob("*.md"))
README = ROOT / "README.md"
# Every page a reader sees: the site's pages and the README.
PAGES = [README, *DOCS]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_there_are_docs() -> None:
    names = {_name(p) for p in DOCS}
    assert names >= {"docs/background.md", "docs/invariants.md",
                     "docs/testing-your-connector.md", "docs/measurements.md",
                     "docs/index.md", "docs/getting-started.md",
                     "docs/reference/commands.md", "docs/tutorials/find-the-bug.md",
                     "docs/tutorials/record-an-engine.md",
                     "docs/tutorials/observe-upstream.md"}


def test_the_readme_stays_short() -> None:
    """Issue 31: the README says what kvstate is, the two commands, a tour,
    the headline figures and the limits in brief; the rest lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"


def test_the_example_trace_in_the_guide_checks_clean(tmp_path: Path, capsys) -> None:
    text = (ROOT / "docs" / "testing-your-connector.md").read_text()
    (block,) = re.findall(r"```jsonl\n(.*?)```", text, re.S)
    path = tmp_path / "engine.jsonl"
    path.write_text(block)
    assert main(["check", str(path)]) == 0, capsys.readouterr().out
    # Cut it short (the rank never reports) and it must not pass.
    lines = [line for line in block.splitlines() if '"ReportDelivered"' not in line]
    path.write_text("\n".join(lines) + "\n")
    assert main(["check", str(path), "--liveness-steps", "1"]) == 1


@pytest.mark.parametrize("doc", PAGES, ids=_name)
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    for path in re.findall(r"`((?:kvstate|sim|adapters|specs|docs|tests)/[\w./-]+)`",
                           doc.read_text()):
        assert (ROOT / path).exists(), f"{_name(doc)} names {path}, which does not exist"


def test_every_file_the_readme_links_to_exists() -> None:
    """The README is read on its own (not built by MkDocs): its relative
    links must reach files of the repository."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    for link in local:
        assert (ROOT / link).is_file(), f"README.md links to {link}, which does not exist"


def _commands() -> list[tuple[str, str]]:
    return [(_name(doc), line) for doc in PAGES
            for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
            for line in re.findall(r"^kvstate ([^#\n]+)", block, re.M)]


def test_every_kvstate_command_the_docs_show_parses() -> None:
    parser = build_parser()
    commands = _commands()
    assert len(commands) >= 40
    pages = {page for page, _ in commands}
    assert {"README.md", "docs/tutorials/find-the-bug.md",
            "docs/how-to/checkpoints.md"} <= pages  # pages in subfolders are read too
    for page, line in commands:
        # "mine" stands for the reader's own variant.
        argv = ["kvstate" if arg == "mine" else arg for arg in shlex.split(line)]
        try:
            parser.parse_args(argv)  # exits 2 on an unknown command or option
        except SystemExit as exc:
            pytest.fail(f"{page}: `kvstate {line.strip()}` does not parse (exit {exc.code})")


def test_the_command_reference_is_the_parsers() -> None:
    """docs/reference/commands.md is what `sim.commands.reference` writes
    from the parser now: an option added, renamed or documented otherwise
    fails here until the page is written again."""
    committed = (ROOT / "docs" / "reference" / "commands.md").read_text()
    assert committed == markdown(), (
        "docs/reference/commands.md is stale: run "
        "python -m sim.commands.reference > docs/reference/commands.md")


def test_the_command_reference_names_every_command_and_option() -> None:
    page = markdown()
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    for name, child in sub.choices.items():
        assert f"## `kvstate {name}`" in page
        for action in child._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in page or f", {option}" in page, (name, option)


def test_the_reference_entry_point_prints_the_page() -> None:
    done = subprocess.run([sys.executable, "-m", "sim.commands.reference"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == markdown()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]'; CI installs it)")
def test_the_site_builds_strict(tmp_path: Path) -> None:
    """Every page in the nav, every link and anchor resolved, every included
    specs/ file present, every API docstring rendered: any warning fails."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "commands" / "index.html").is_file()


# Lines of a tutorial's shown output that must come out as written: what a
# reader compares with their own run (timings, rates and trimmed lines vary).
_STABLE = re.compile(r"^\s*(VIOLATION|result:|reproduce:|DIVERGENCE|shortest counterexample"
                     r"|minimized|trace:|recorded:|model:|line \d+:)")


def _steps(page: str) -> tuple[str, list[tuple[list[str], list[str]]]]:
    """A tutorial's Python module and its commands, each with the stable
    lines of the output shown after it."""
    text = (ROOT / page).read_text()
    (module,) = re.findall(r"```python\n(.*?)```", text, re.S)
    steps: list[tuple[list[str], list[str]]] = []
    for kind, body in re.findall(r"```(bash|text)\n(.*?)```", text, re.S):
        if kind == "bash":
            lines = [c for c in body.splitlines() if c.startswith("kvstate ")]
            if lines:
                steps.append((lines, []))
        elif steps and not steps[-1][1]:  # the output shown after the commands
            steps[-1][1].extend(s.strip() for s in body.splitlines() if _STABLE.match(s))
    return module, steps


@pytest.mark.slow
def test_the_find_the_bug_tutorial_runs_as_written(tmp_path: Path) -> None:
    """A newcomer following docs/tutorials/find-the-bug.md gets what it shows:
    its variant module written as given, every command run in order in one
    directory (``kvstate`` is ``python -m sim.cli``), and every line that is
    not a timing or trimmed found in the output, word for word."""
    import os

    module, steps = _steps("docs/tutorials/find-the-bug.md")
    (tmp_path / "myvariants.py").write_text(module)
    env = dict(os.environ, KVSTATE_VARIANTS="myvariants", NO_COLOR="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    assert len(steps) >= 6
    for commands, shown in steps:
        out = ""
        for command in commands:
            argv = [sys.executable, "-m", "sim.cli", *shlex.split(command)[1:]]
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert "Traceback" not in done.stderr, done.stderr[-2000:]
            out += done.stdout + done.stderr
        got = {line.strip() for line in out.splitlines()}
        for line in shown:
            assert line in got, f"{commands}: the tutorial shows {line!r}; the run printed:\n{out}"
