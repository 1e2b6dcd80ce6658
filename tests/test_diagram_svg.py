"""``kvstate diagram MACHINE --svg OUT.svg [--coverage TRACE...]`` (`sim.pictures.diagram_svg`):
an SVG state diagram drawn from the table, coloured by the transitions traces fired."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

import sim.extras
from kvstate.tables import MACHINES, MACHINES_BY_NAME
from sim.cli import main
from sim.simulator.runner import SimOptions, simulate
from sim.traces.coverage import trace_coverage

pytest.importorskip("matplotlib")

from sim.pictures.diagram_svg import COVERED, NEVER, NOT_APPLICABLE  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def _svg(path: Path) -> ET.Element:
    return ET.parse(path).getroot()


def _texts(root: ET.Element) -> set[str]:
    return {"".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")}


def _by_id(root: ET.Element, gid: str) -> ET.Element:
    (found,) = [el for el in root.iter() if el.get("id") == gid]
    return found


def _stroke(root: ET.Element, gid: str) -> str:
    """The stroke colour of the arrow (its first path) with this id."""
    path = next(_by_id(root, gid).iter(f"{SVG}path"))
    style = dict(part.split(": ", 1) for part in path.get("style", "").split("; "))
    return style["stroke"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two simulator traces: seed 0's fault swarm, and no faults at all."""
    root = tmp_path_factory.mktemp("traces")
    out: dict[str, Path] = {}
    for name, options in (("swarm", SimOptions(requests=20)),
                          ("calm", SimOptions(requests=20, faults=()))):
        out[name] = root / f"{name}.jsonl"
        with open(out[name], "w") as trace:
            simulate(options, trace=trace)
    return out


@pytest.mark.parametrize("machine", [m.name for m in MACHINES])
def test_an_svg_is_written_for_every_machine_naming_every_state(
        machine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"{machine}.svg"
    assert main(["diagram", machine, "--svg", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    root = _svg(out)
    assert root.tag == f"{SVG}svg"
    table = MACHINES_BY_NAME[machine].table
    texts = _texts(root)
    for state, row in table.items():
        assert state.name in texts
        _by_id(root, f"state-{state.name}")
        for event in row:
            # every transition is an arrow, grey without coverage, and labelled
            assert _stroke(root, f"transition-{state.name}-{event.name}") == NOT_APPLICABLE
            label = "".join(_by_id(root, f"transition-label-{state.name}-{event.name}")
                            .itertext())
            assert event.name.lower() in label
    # guards the table names are tagged on their arrows and listed in full
    for guard in MACHINES_BY_NAME[machine].guards.values():
        assert any(guard in text for text in texts)


def test_coverage_colours_a_transition_one_trace_fired_and_the_other_did_not(
        traces: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swarm = trace_coverage([traces["swarm"]]).fired
    calm = trace_coverage([traces["calm"]]).fired
    differ = sorted((m, s.name, e.name) for m, s, e in swarm ^ calm)
    assert differ, "the two traces fire the same table entries; pick other runs"
    machine, state, event = differ[0]
    gid = f"transition-{state}-{event}"
    colours = {}
    for name in ("swarm", "calm"):
        out = tmp_path / f"{name}.svg"
        assert main(["diagram", machine, "--svg", str(out), "--coverage",
                     str(traces[name])]) == 0
        printed = capsys.readouterr().out
        assert "transitions fired" in printed and "guard outcomes" in printed
        colours[name] = _stroke(_svg(out), gid)
        fired = swarm if name == "swarm" else calm
        row = MACHINES_BY_NAME[machine].table
        for s, events in row.items():  # every arrow green or red, as the trace says
            for e in events:
                want = COVERED if (machine, s, e) in fired else NEVER
                assert _stroke(_svg(out), f"transition-{s.name}-{e.name}") == want
        never = [f"{s.name} --{e.name.lower()}-->" for s, events in row.items()
                 for e in events if (machine, s, e) not in fired]
        for line in never:
            assert f"never seen: {line}" in printed
    assert colours["swarm"] != colours["calm"]
    assert {colours["swarm"], colours["calm"]} == {COVERED, NEVER}


def test_json_names_the_svg_and_the_figures(traces: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.svg"
    assert main(["diagram", "job", "--svg", str(out), "--coverage", str(traces["swarm"]),
                 "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["svg"] == str(out) and out.exists()
    entries = sum(len(row) for row in MACHINES_BY_NAME["job"].table.values())
    assert doc["transitions"] == entries
    assert doc["covered"] + len(doc["unvisited"]) == entries
    assert doc["mermaid"].startswith("stateDiagram-v2")


@pytest.mark.slow
def test_the_same_input_gives_the_same_bytes(traces: dict[str, Path], tmp_path: Path) -> None:
    for machine in ("request", "job"):
        runs = []
        for n in range(2):
            out = tmp_path / f"{machine}{n}.svg"
            assert main(["diagram", machine, "--svg", str(out), "--coverage",
                         str(traces["swarm"])]) == 0
            runs.append(out.read_bytes())
        assert runs[0] == runs[1]
        assert b"<dc:date>" not in runs[0]


def test_bad_input_exits_2_before_any_work(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # a trace that does not exist: reading it would fail too, but the output is
    # checked first, so the message names the output
    missing_trace = str(tmp_path / "no-such-trace.jsonl")
    a_file = tmp_path / "file.txt"
    a_file.write_text("")
    (tmp_path / "dir.svg").mkdir()
    cases = [
        (["diagram", "nosuch", "--svg", str(tmp_path / "x.svg")], "unknown machine 'nosuch'"),
        (["diagram", "job", "--svg", str(tmp_path / "x.png"), "--coverage", missing_trace],
         "unknown suffix '.png'"),
        (["diagram", "job", "--svg", str(tmp_path / "x"), "--coverage", missing_trace],
         "unknown suffix '(none)'"),
        (["diagram", "job", "--svg", str(tmp_path / "missing" / "x.svg"), "--coverage",
          missing_trace], "no directory"),
        (["diagram", "job", "--svg", str(a_file / "x.svg")], "no directory"),
        (["diagram", "job", "--svg", str(tmp_path / "dir.svg")], "is a directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "kvstate diagram: error:" in err, (argv, err)
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "x").exists()
    # a good output and a missing trace: the trace is named
    assert main(["diagram", "job", "--svg", str(tmp_path / "ok.svg"),
                 "--coverage", missing_trace]) == 2
    assert "no-such-trace.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "ok.svg").exists()


def test_without_matplotlib_the_extra_is_named(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec

    def without(name: str, *args: object) -> object:
        return None if name == "matplotlib" else real(name)

    monkeypatch.setattr(sim.extras.importlib.util, "find_spec", without)
    assert main(["diagram", "job", "--svg", str(tmp_path / "job.svg")]) == 2
    assert "kvstate[plot]" in capsys.readouterr().err
    assert not (tmp_path / "job.svg").exists()
