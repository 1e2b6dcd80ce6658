"""Progress bars for the long commands (`sim.commands.progress`): drawn on
stderr only for a terminal, never with --json or --no-progress, stdout the same
either way, and a plain status line where rich is not installed."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import sim.commands.progress as progress
import sim.explore.campaign
from sim.cli import main
from sim.commands.progress import NullBar, PlainBar, print_table, progress_for
from sim.simulator.runner import SimOptions

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"json": False, "no_progress": False, **kw})


def tty_console(width: int = 120) -> Any:
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=width)


def text(console: Any) -> str:
    return ANSI.sub("", console.file.getvalue())


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def no_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import rich...`` fails, as where the progress extra is not installed."""
    for name in ("rich", "rich.console", "rich.progress", "rich.table", "rich.text",
                 "rich.box"):
        monkeypatch.setitem(sys.modules, name, None)


def watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured stderr claims to be a terminal (stdout stays a pipe); called
    in the test itself, where capsys's stderr is the one in place."""
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(progress, "MIN_REFRESH", 0.0)  # redraw on every update


@pytest.fixture
def small_campaign(monkeypatch: pytest.MonkeyPatch) -> None:
    """The campaign command's seeds on a 24-request workload (fast)."""
    monkeypatch.setattr(sim.explore.campaign, "SimOptions", lambda: SimOptions(requests=24))


def steady(out: str) -> str:
    """Command output less what differs from run to run (wall seconds)."""
    out = re.sub(r"\d+ states/s", "# states/s", re.sub(r"\d+\.\d+", "#", out))
    return re.sub(r" +", " ", out)


VOLATILE = {"seconds", "wall_seconds", "first_found", "states_per_second"}


def steady_json(out: str) -> Any:
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in VOLATILE}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip(json.loads(out))


# The module, driven directly.

def test_a_rich_bar_shows_the_advancing_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "MIN_REFRESH", 0.0)
    console = tty_console()
    with progress_for(args(), total=5, label="e1", unit="seeds", console=console) as bar:
        assert bar.active
        bar.advance(2, found="S16")
        bar.advance(1)
        bar.update(completed=5, found="S16,K4")
    out = text(console)
    assert "e1" in out
    for count in ("0/5 seeds", "2/5 seeds", "3/5 seeds", "5/5 seeds"):
        assert count in out, out
    assert "found S16" in out and "found S16,K4" in out
    assert "━" in out  # the bar itself


def test_a_bar_without_a_total_pulses_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "MIN_REFRESH", 0.0)
    console = tty_console()
    with progress_for(args(), label="kvstate/tiny", unit="states", console=console) as bar:
        bar.update(completed=1234, depth=7)
    assert "1,234 states" in text(console) and "depth 7" in text(console)


@pytest.mark.parametrize("given", [{"json": True}, {"no_progress": True}])
def test_json_and_no_progress_draw_nothing(given: dict[str, bool]) -> None:
    console = tty_console()
    with progress_for(args(**given), total=3, label="x", console=console) as bar:
        assert isinstance(bar, NullBar) and not bar.active
        bar.advance(3, found="S16")
    assert console.file.getvalue() == ""


def test_a_stream_that_is_not_a_terminal_gets_nothing() -> None:
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=False)
    with progress_for(args(), total=3, console=console) as bar:
        bar.advance(3)
    assert console.file.getvalue() == ""
    pipe = io.StringIO()
    with progress_for(args(), total=3, stream=pipe) as bar:
        assert not bar.active
        bar.advance(3)
    assert pipe.getvalue() == ""


def test_ctrl_c_stops_and_erases_the_bar() -> None:
    console = tty_console()
    with pytest.raises(KeyboardInterrupt):  # noqa: PT012 - the bar is live inside
        with progress_for(args(), total=9, label="e2", unit="seeds", console=console) as bar:
            bar.advance(1)
            raise KeyboardInterrupt
    assert isinstance(bar, progress.RichBar)
    assert not bar.progress.live.is_started
    # The cursor shown again and the bar's line erased.
    assert console.file.getvalue().endswith("\x1b[?25h\r\x1b[1A\x1b[2K")


def test_without_rich_the_bar_is_one_plain_line(no_rich: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.0)
    stream = FakeTTY()
    with progress_for(args(), total=3, label="e1", unit="seeds", stream=stream) as bar:
        assert isinstance(bar, PlainBar)
        bar.advance(1)
        bar.advance(2, found="S16")
    out = stream.getvalue()
    assert "\re1  0/3 seeds" in out  # drawn at once
    assert "\re1  1/3 seeds" in out and "\re1  3/3 seeds" in out and "found S16" in out
    assert "\n" not in out and "\x1b" not in out
    assert out.endswith("\r" + " " * bar.width + "\r")  # cleared at the end
    assert all(len(line) <= bar.width for line in out.split("\r"))


def test_tables_are_plain_unless_stdout_is_a_terminal(no_rich: None) -> None:
    from sim.commands.output import table

    rows = [["protocol", "runs"], ["e1", "3"]]
    pipe = io.StringIO()
    print_table(args(), rows, stream=pipe)
    assert pipe.getvalue() == table(rows) + "\n"
    tty = FakeTTY()
    print_table(args(), rows, stream=tty)  # a terminal, but no rich: plain as well
    assert tty.getvalue() == table(rows) + "\n"


def test_a_rich_table_on_a_terminal_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    from sim.commands.output import table

    monkeypatch.setenv("TERM", "xterm")
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    rows = [["protocol", "found"], ["e1", "[bold]S16[/bold]"]]
    tty = FakeTTY()
    print_table(args(), rows, stream=tty)
    out = ANSI.sub("", tty.getvalue())
    assert "protocol" in out and "[bold]S16[/bold]" in out  # cells are text, not markup
    assert "─" in out
    plain = FakeTTY()
    print_table(args(no_progress=True), rows, stream=plain)
    assert plain.getvalue() == table(rows) + "\n"


def test_the_command_line_does_not_import_rich() -> None:
    code = "import sys, sim.cli; sim.cli.build_parser(); print('rich' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.split() == ["False"]


@pytest.mark.parametrize("command", ["campaign", "fuzz", "modelcheck", "real", "sim"])
def test_every_long_command_takes_no_progress(command: str) -> None:
    from sim.cli import build_parser

    assert build_parser().parse_args([command, "--no-progress"]).no_progress


# The hooks in sim.explore.campaign and sim.explore.fuzz.

def test_campaign_reports_each_seed_and_stops_cleanly_on_ctrl_c() -> None:
    seen: list[Any] = []
    result = sim.explore.campaign.campaign("kvstate", seeds=2, base=SimOptions(requests=24),
                                   on_seed=seen.append)
    assert [p.runs for p in seen] == [1, 2] and result.runs == 2
    assert seen[-1].protocol == "kvstate" and seen[-1].found == ()

    def interrupt(p: Any) -> None:
        raise KeyboardInterrupt

    result = sim.explore.campaign.campaign("kvstate", seeds=3, base=SimOptions(requests=24),
                                   on_seed=interrupt)
    assert result.interrupted and result.runs == 1


def test_fuzz_reports_each_program_and_still_finds(tmp_path: Path) -> None:
    pytest.importorskip("hypothesis")
    from sim.explore.fuzz import fuzz

    seen: list[Any] = []
    clean = fuzz("kvstate", budget=float("inf"), examples=10, steps=10, derandomize=True,
                 out_dir=str(tmp_path), on_example=seen.append)
    assert clean.ok and len(seen) >= 10
    assert [e.examples for e in seen] == list(range(1, len(seen) + 1))
    assert all(e.rounds == 1 and e.protocol == "kvstate" for e in seen)
    found = fuzz("e1", budget=float("inf"), examples=10, steps=10, derandomize=True,
                 out_dir=str(tmp_path), on_example=lambda e: None)
    assert not found.ok and found.trace  # shrunk and written as before


# The commands: stdout the same with and without a terminal, stderr quiet
# unless a person is watching.

def test_campaign_stdout_is_the_same_on_a_terminal(small_campaign: None,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["campaign", "--seeds", "2", "--workers", "1"]
    assert main(argv) == 0
    piped = capsys.readouterr()
    assert piped.err == ""
    assert main([*argv, "--json"]) == 0
    piped_json = capsys.readouterr()
    assert piped_json.err == ""

    watch(monkeypatch)
    assert main([*argv, "--json"]) == 0
    watched_json = capsys.readouterr()
    assert watched_json.err == ""
    assert steady_json(watched_json.out) == steady_json(piped_json.out)
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert main(argv) == 0
    watched = capsys.readouterr()
    assert steady(watched.out) == steady(piped.out)
    bar = ANSI.sub("", watched.err)
    assert "kvstate" in bar and "1/2 seeds" in bar and "2/2 seeds" in bar
    assert "found nothing" in bar


def test_ctrl_c_in_a_watched_campaign_reports_and_exits_130(
        small_campaign: None, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    watch(monkeypatch)

    def interrupt(self: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(progress.RichBar, "update", interrupt)
    assert main(["campaign", "--seeds", "3", "--workers", "1"]) == 130
    out, err = capsys.readouterr()
    assert "interrupted after 1 runs" in err and "Traceback" not in err
    assert re.search(r"^kvstate +1 ", out, re.M), out


@pytest.mark.slow
def test_modelcheck_shows_the_checkers_reports(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.explore.modelcheck.search

    watch(monkeypatch)
    real_check = sim.explore.modelcheck.search.check
    hooks: list[Any] = []

    def check(*a: Any, progress: Any = None, **kw: Any) -> Any:
        hooks.append(progress)
        if progress is not None:  # what the checker reports every ~5 s
            progress(SimpleNamespace(states=1234, transitions=2000, depth=5, seconds=2.0))
        return real_check(*a, **kw)

    monkeypatch.setattr(sim.explore.modelcheck.search, "check", check)
    argv = ["modelcheck", "--scope", "tiny", "--max-states", "5000"]
    assert main([*argv, "--json"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and hooks == [None]  # no bar: the checker gets no hook either
    assert main(argv) == 0
    watched = capsys.readouterr()
    bar = ANSI.sub("", watched.err)
    assert "kvstate/tiny" in bar and "1,234/5,000 states" in bar and "617 states/s" in bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(argv) == 0
    piped = capsys.readouterr()
    assert piped.err == "" and steady(piped.out) == steady(watched.out)


@pytest.mark.slow
def test_sim_soak_bar_counts_arrivals(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    watch(monkeypatch)
    argv = ["sim", "--requests", "200"]
    assert main(argv) == 0
    watched = capsys.readouterr()
    bar = ANSI.sub("", watched.err)
    assert "0/200 arrived" in bar and "200/200 arrived" in bar
    assert main([*argv, "--json"]) == 0
    watched_json = capsys.readouterr()
    assert watched_json.err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main([*argv, "--json"]) == 0
    piped_json = capsys.readouterr()
    assert steady_json(piped_json.out) == steady_json(watched_json.out)
    assert main(argv) == 0
    assert steady(capsys.readouterr().out) == steady(watched.out)


def test_fuzz_bar_counts_programs(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("hypothesis")
    watch(monkeypatch)
    argv = ["fuzz", "--budget", "0.5", "--examples", "5", "--steps", "5",
            "--out-dir", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["ok"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    bar = ANSI.sub("", err)
    assert "round 1, programs 1" in bar and "/0.5 s" in bar
    assert out.startswith("protocol  rounds  seconds  found  shrunk rules  trace\n")


def test_real_shows_its_phases(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The phases of `kvstate real` (the store itself faked: tests/test_mooncake.py
    runs the real one)."""
    import sim.commands.real as real

    watch(monkeypatch)
    result = SimpleNamespace(ok=True, violations=[], figures={"requests": 3, "puts": 9})

    def measure(args: Any, bar: Any, arrivals: Any = None) -> Any:
        bar.update(phase="starting mooncake_master")
        return "127.0.0.1:1", ([("a", [1], 1)] * 3, result)

    monkeypatch.setattr(real, "_measure", measure)
    assert main(["real", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["figures"] == result.figures
    assert main(["real"]) == 0
    out, err = capsys.readouterr()
    assert "phase starting mooncake_master" in ANSI.sub("", err)
    assert out.splitlines()[1:] == ["requests  3", "puts      9", "result: ok"]
