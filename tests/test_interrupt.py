"""Ctrl-C on a long command stops it cleanly: exit 130, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def _campaign(*extra: str, new_session: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sim.cli", "campaign", "--protocol", "e2", "--budget", "120",
         *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_with_ctrl_c_delivered, start_new_session=new_session)


@pytest.mark.slow
def test_ctrl_c_during_a_campaign_ends_it_without_a_traceback() -> None:
    proc = _campaign()
    try:
        time.sleep(12)  # imports done, some seeds folded (the budget is 120 s)
        assert proc.poll() is None, "the campaign ended before it was interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
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
    try:
        time.sleep(8)  # imports done, seeds running in both workers
        assert proc.poll() is None, "the campaign ended before it was interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
