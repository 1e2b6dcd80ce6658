"""What a plain install gets: packaged data (the FAST'25 trace), optional
dependencies checked by the commands that need them, ``kvstate plot``, and a
wheel that runs outside the repository."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import sim.extras
from kvstate.workloads import DEFAULT_FAST25, WorkloadError, fast25, read_mooncake
from sim.cli import main
from sim.simulator.runner import SimOptions, simulate

ROOT = Path(__file__).resolve().parent.parent
SHARED_FAST25 = ROOT.parent / "shared" / "data" / "mooncake-fast25" / "conversation_trace.jsonl"


def test_fast25_trace_is_package_data_with_its_licence() -> None:
    assert DEFAULT_FAST25.is_relative_to(ROOT / "kvstate")
    assert DEFAULT_FAST25.suffix == ".gz"
    data = DEFAULT_FAST25.parent
    notice = (data / "README.md").read_text()
    assert "Apache License, Version 2.0" in notice and "kvcache-ai/Mooncake" in notice
    assert "Apache License" in (data / "LICENSE-Apache-2.0.txt").read_text()
    rows = list(read_mooncake(DEFAULT_FAST25))
    assert len(rows) == 12031
    if SHARED_FAST25.is_file():  # the development copy: byte for byte the same
        assert gzip.decompress(DEFAULT_FAST25.read_bytes()) == SHARED_FAST25.read_bytes()


def test_fast25_workload_runs_from_the_packaged_trace() -> None:
    result = simulate(SimOptions(workload="fast25", requests=20, scale=64))
    assert result.ok and result.figures["arrivals"] == 20


def test_plain_and_gzip_traces_read_alike(tmp_path: Path) -> None:
    lines = gzip.decompress(DEFAULT_FAST25.read_bytes()).splitlines(keepends=True)[:5]
    plain = tmp_path / "five.jsonl"
    plain.write_bytes(b"".join(lines))
    packed = tmp_path / "five.jsonl.gz"
    packed.write_bytes(gzip.compress(b"".join(lines)))
    assert list(read_mooncake(plain)) == list(read_mooncake(packed))
    assert len(list(fast25(packed, scale=64))) == 5


def test_corrupt_gzip_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all\n")
    with pytest.raises(WorkloadError, match=r"bad\.jsonl\.gz:1: cannot read"):
        list(read_mooncake(bad))
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(DEFAULT_FAST25.read_bytes()[:5000])
    # A run reads the workload only as far as it takes (issue 32, class 2):
    # one that asks for more requests than the cut file holds reaches the cut.
    assert main(["sim", "--workload", "fast25", "--fast25-path", str(truncated),
                 "--requests", "100000"]) == 2
    assert "cut.jsonl.gz" in capsys.readouterr().err


def test_core_dependencies_are_only_attrs() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dependencies = ["attrs>=23.1"]' in text
    # Diagrams and the specs render without transitions (the reference
    # interpreter, a test cross-check, imports it when called).
    code = ("import sys, kvstate.diagrams, kvstate.specs, sim.cli; "
            "print('transitions' in sys.modules, 'hypothesis' in sys.modules, "
            "'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.split() == ["False", "False", "False"]


def test_commands_name_the_extra_they_miss(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    real = importlib.util.find_spec

    def without(name: str, *args: object) -> object:
        return None if name in ("hypothesis", "matplotlib") else real(name)

    monkeypatch.setattr(sim.extras.importlib.util, "find_spec", without)
    assert main(["fuzz", "--budget", "1"]) == 2
    err = capsys.readouterr().err
    assert "kvstate fuzz needs the package 'hypothesis'" in err and "kvstate[fuzz]" in err
    assert main(["plot", str(tmp_path / "run.jsonl"), "-o", str(tmp_path / "run.png")]) == 2
    assert "kvstate[plot]" in capsys.readouterr().err


def _sim_trace(tmp_path: Path, requests: int = 40) -> tuple[Path, dict]:
    trace = tmp_path / "run.jsonl"
    with trace.open("w") as out:
        result = simulate(SimOptions(requests=requests), trace=out)
    return trace, result.figures


def test_plot_writes_a_png_of_a_simulator_run(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace, figures = _sim_trace(tmp_path)
    out = tmp_path / "run.png"
    assert main(["plot", str(trace), "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert summary["ok"] and summary["output"] == str(out)
    assert summary["ranks"] == 2 and summary["peak_pins"] > 0
    # The same pins as the simulator counted while it ran; a settled run
    # gives every one back.
    assert summary["peak_pins"] == figures["peak_pins"]
    assert summary["pins_at_end"] == figures["pins_at_end"] == 0
    assert summary["events_published"] > 0 and summary["exists_keys"] > 0


def test_plot_refuses_bad_input_before_work(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"kvstate_trace": 1}\n')
    assert main(["plot", str(trace), "-o", str(tmp_path / "x.png")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    good, _ = _sim_trace(tmp_path, requests=5)
    assert main(["plot", str(good), "-o", str(tmp_path / "x.nope")]) == 2
    assert "unknown image format 'nope'" in capsys.readouterr().err
    assert main(["plot", str(good), "-o", str(tmp_path / "missing" / "x.png")]) == 2
    assert "no directory" in capsys.readouterr().err


@pytest.mark.slow
def test_wheel_runs_documented_commands_outside_the_repository(tmp_path: Path) -> None:
    """Build the wheel from the sources, unpack it away from the checkout and
    run commands that need no extra with it (the installed dependencies of
    this environment stand in for pip's)."""
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("kvstate", "sim", "adapters"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp_path / "wheel")],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("kvstate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("kvstate/py.typed", "kvstate/data/mooncake_fast25_conversation.jsonl.gz",
                   "kvstate/data/README.md", "kvstate/data/LICENSE-Apache-2.0.txt"):
        assert needed in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    away = tmp_path / "elsewhere"
    away.mkdir()
    code = ("import sys, kvstate, sim.cli; assert kvstate.__file__.startswith(sys.argv[1]), "
            "kvstate.__file__; kvstate.__all__; "
            "sys.exit(sim.cli.main(sys.argv[2:]))")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    for argv in (["sim", "--requests", "30", "--json"],
                 ["sim", "--workload", "fast25", "--requests", "30", "--scale", "64", "--json"],
                 ["scenarios"], ["diagram", "job"]):
        run = subprocess.run([sys.executable, "-c", code, str(site), *argv], cwd=away,
                             env=env, capture_output=True, text=True)
        assert run.returncode == 0, (argv, run.stderr[-2000:])
