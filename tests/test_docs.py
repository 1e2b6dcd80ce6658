"""The docs hold: their example trace checks clean, their paths exist, their
commands parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sim.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_there_are_docs() -> None:
    assert {p.name for p in DOCS} >= {"background.md", "invariants.md",
                                      "testing-your-connector.md"}


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


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    for path in re.findall(r"`((?:kvstate|sim|adapters|specs|docs|tests)/[\w./-]+)`",
                           doc.read_text()):
        assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"


def test_every_kvstate_command_the_docs_show_parses() -> None:
    parser = build_parser()
    commands = [line for doc in DOCS
                for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
                for line in re.findall(r"^kvstate ([^#\n]+)", block, re.M)]
    assert len(commands) >= 5
    for line in commands:
        # "mine" stands for the reader's own variant.
        argv = ["kvstate" if arg == "mine" else arg for arg in shlex.split(line)]
        parser.parse_args(argv)  # exits 2 on an unknown command or option
