"""Ctrl-C on a long command stops it cleanly: exit 130, no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _with_ctrl_c_delivered() -> None:
    # A command started in the background by a non-interactive shell
    # (`nohup bash .ci/run &`) inherits SIGINT as *ignored*, and Python then
    # installs no KeyboardInterrupt handler: the command would rightly ignore
    # the test's Ctrl-C and the test would time out. Give the child the
    # disposition a terminal gives it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kvstate(*argv: str, new_session: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sim.cli", *argv],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_with_ctrl_c_delivered, start_new_session=new_session)


def _campaign(*extra: str, new_session: bool = False) -> subprocess.Popen[str]:
    return _kvstate("campaign", "--protocol", "e2", "--budget", "120", *extra,
                    new_session=new_session)


def _ctrl_c(proc: subprocess.Popen[str], ready: Callable[[], object], group: bool = False
            ) -> tuple[str, str]:
    """Once ``ready()`` says so, Ctrl-C to the command (its whole process
    group with ``group``, as a terminal does); what it printed after."""
    try:
        ready()
        assert proc.poll() is None, "the command ended before it was interrupted"
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_ctrl_c_during_a_campaign_ends_it_without_a_traceback() -> None:
    proc = _campaign()
    # imports done, some seeds folded (the budget is 120 s)
    out, err = _ctrl_c(proc, lambda: time.sleep(12))
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in err
    assert "Traceback" not in err
    # What it found before the interrupt is reported, as at the end of a budget.
    assert "protocol" in out and "runs" in out, out
    runs = int(next(line.split()[1] for line in out.splitlines() if line.startswith("e2 ")))
    assert f"interrupted after {runs} runs" in err


@pytest.mark.slow
def test_ctrl_c_to_the_whole_process_group_ends_a_parallel_campaign_quietly() -> None:
    """A terminal's Ctrl-C reaches every worker too: they leave it to the
    parent (exit 130, no traceback from any process)."""
    proc = _campaign("--workers", "2", new_session=True)
    # imports done, seeds running in both workers
    out, err = _ctrl_c(proc, lambda: time.sleep(8), group=True)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_stops_a_model_check_keeps_what_it_found_and_it_goes_on(
        tmp_path, capsys) -> None:
    """The first Ctrl-C (to the whole group: the workers too) ends the search
    at the next state: its figures are printed, the checkpoint written, exit
    130; ``--resume`` finishes it with the figures of a search never
    interrupted."""
    from sim.cli import main
    from sim.explore.modelcheck.checkpoint import load
    from sim.explore.modelcheck.model import SCOPES
    from sim.explore.modelcheck.search import check

    path = str(tmp_path / "c.ckpt")
    proc = _kvstate("modelcheck", "--scope", "decode2", "--workers", "2", "--checkpoint", path,
                    "--no-progress", new_session=True)

    def searching() -> None:
        assert proc.stdout is not None
        proc.stdout.readline()  # the scope's line: imports done, the search begins
        time.sleep(1.5)

    out, err = _ctrl_c(proc, searching, group=True)
    assert proc.returncode == 130, (out, err)
    assert "stopping at the next state" in err and "Traceback" not in err
    assert "NOT exhaustive (interrupted)" in out and f"--resume {path}" in out
    saved = load(path)
    whole = check(SCOPES["decode2"], "kvstate", out_dir=None, workers=2)
    assert 0 < len(saved.parents) < whole.states
    assert main(["modelcheck", "--resume", path, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert (run["states"], run["transitions"], run["depth"], run["exhaustive"]) == (
        whole.states, whole.transitions, whole.depth, True)


def test_sigterm_leaves_no_partial_file_and_the_previous_trace_intact(tmp_path: Path) -> None:
    """Issue 32, class 8: SIGTERM (a service manager, `timeout`) used to kill
    `sim` on the spot, leaving its half-written `.partial` file beside the
    destination. Now it unwinds like Ctrl-C: exit 143, nothing left behind,
    the previous trace as it was."""
    trace = tmp_path / "run.jsonl"
    trace.write_text("previous\n")
    partial = tmp_path / "run.jsonl.partial"
    proc = _kvstate("sim", "--requests", "100000", "--trace", str(trace))
    try:
        deadline = time.monotonic() + 120
        while not (partial.exists() and partial.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "terminated" in err
    assert not partial.exists()
    assert trace.read_text() == "previous\n"
