"""A connector engineer's own variant, kept in their own module and named by
KVSTATE_VARIANTS: every command finds it, in every process it starts, and
the commands it prints to reproduce a failure carry the setting. Each run is
a fresh `kvstate` process, as a user's is (a variant registered here would
stay in this test process's table)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = '''
"""Advances the saved offset past a failed put (the bug S10 catches)."""
import attrs
from kvstate.variants import KVSTATE, offset_advanced, register

register(attrs.evolve(KVSTATE, name="mine-advance", summary="advances past a failed put",
                      offset_after_failure=offset_advanced))
'''


def _kvstate(tmp_path: Path, *argv: str, modules: str | None = "myvariants"
             ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_VARIANTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    if modules is not None:
        env["KVSTATE_VARIANTS"] = modules
    return subprocess.run([sys.executable, "-m", "sim.cli", *argv], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)


@pytest.fixture
def own(tmp_path: Path) -> Path:
    (tmp_path / "myvariants.py").write_text(MODULE)
    return tmp_path


def test_every_command_finds_a_variant_from_the_users_module(own: Path) -> None:
    run = _kvstate(own, "sim", "--protocol", "mine-advance", "--trace", "t.jsonl")
    assert run.returncode == 1, run.stderr
    assert "VIOLATION S10" in run.stdout
    assert "reproduce: KVSTATE_VARIANTS=myvariants kvstate sim --protocol=mine-advance" in (
        run.stdout)
    replay = _kvstate(own, "replay", "t.jsonl")  # the header names the variant
    assert replay.returncode == 0 and "result: identical" in replay.stdout, replay.stdout
    # Worker processes look it up by name too.
    campaign = _kvstate(own, "campaign", "--protocol", "mine-advance", "--seeds", "4",
                        "--workers", "2", "--json")
    assert campaign.returncode == 1 and '"S10"' in campaign.stdout, campaign.stderr
    check = _kvstate(own, "modelcheck", "--protocol", "mine-advance", "--scope", "tiny",
                     "--workers", "2", "--out-dir", str(own))
    assert check.returncode == 1 and "S10" in check.stdout, check.stdout + check.stderr


def test_without_the_setting_or_with_a_broken_module_the_name_is_refused(own: Path) -> None:
    plain = _kvstate(own, "sim", "--protocol", "mine-advance", modules=None)
    assert plain.returncode == 2
    assert "unknown protocol 'mine-advance'" in plain.stderr
    assert "KVSTATE_VARIANTS=your.module" in plain.stderr
    broken = _kvstate(own, "sim", "--protocol", "mine-advance", modules="nosuchmodule")
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "KVSTATE_VARIANTS: cannot import 'nosuchmodule' (ModuleNotFoundError" in (
        broken.stderr)


def test_a_name_taken_is_refused() -> None:
    import attrs

    from kvstate.variants import E2, KVSTATE, register

    assert register(KVSTATE) is KVSTATE  # registering a variant again changes nothing
    with pytest.raises(ValueError, match="named 'e2' exists already"):
        register(attrs.evolve(E2, summary="another e2"))
