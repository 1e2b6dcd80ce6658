"""Ctrl-C on a long command stops it cleanly: exit 130, no traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ctrl_c_during_a_campaign_ends_it_without_a_traceback() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.cli", "campaign", "--protocol", "e2", "--budget", "120"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
