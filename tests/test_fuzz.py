"""The Hypothesis stateful machine (CI profile: derandomized, bounded)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import Flaky

from kvstate.testing import ConnectorMachine
from kvstate.variants import VARIANTS
from sim.explore.fuzz import CI_EXAMPLES, CI_STEPS, machine_for
from sim.traces.replay import replay_trace

CI = settings(max_examples=CI_EXAMPLES, stateful_step_count=CI_STEPS, derandomize=True,
              deadline=None, suppress_health_check=list(HealthCheck), print_blob=False)


class DefaultProtocol(ConnectorMachine):
    pass


TestDefaultProtocol = DefaultProtocol.TestCase
TestDefaultProtocol.settings = CI


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    "e2", "e1", "req-id-counter-ledger", "missing-finally", "parent-previous-emitted",
    "no-pins-on-preemption", "retry-keyed-by-request", "boundary-without-plus-one",
])
def test_fuzzer_finds_the_variant_and_writes_a_replayable_trace(variant, tmp_path,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("KVSTATE_FUZZ_DIR", str(tmp_path))
    case = machine_for(variant).TestCase
    case.settings = CI
    with pytest.raises((AssertionError, Flaky)) as err:
        case("runTest").runTest()
    assert "kvstate replay" in str(err.value)
    traces = sorted(tmp_path.glob(f"fuzz-{variant}-*.jsonl"))
    assert traces
    assert replay_trace(traces[-1]).ok  # the written counterexample replays exactly


def test_a_fuzz_run_leaves_one_trace_the_shrunk_one(tmp_path, monkeypatch) -> None:
    """Shrinking runs many failing programs, and the machine writes a trace
    for each (dozens); `sim.explore.fuzz.fuzz` keeps only the one it reports, and
    leaves ``KVSTATE_FUZZ_DIR`` as it found it."""
    import os

    from sim.explore.fuzz import fuzz

    monkeypatch.delenv("KVSTATE_FUZZ_DIR", raising=False)
    r = fuzz("e1", budget=float("inf"), examples=CI_EXAMPLES, steps=CI_STEPS,
             out_dir=str(tmp_path), derandomize=True)
    assert not r.ok and r.trace is not None
    assert sorted(tmp_path.iterdir()) == [tmp_path / os.path.basename(r.trace)]
    assert replay_trace(r.trace).ok
    assert "KVSTATE_FUZZ_DIR" not in os.environ


@pytest.mark.slow
def test_fuzz_command_reports_runs_and_coverage(tmp_path, capsys) -> None:
    import json

    from sim.cli import main

    assert main(["fuzz", "--budget", "1", "--examples", "10", "--json",
                 "--out-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["runs"][0]["protocol"] == "kvstate"
    assert set(doc["never_fired"]) >= {"request", "job", "pin"}
    assert main(["fuzz", "--budget", "1", "--examples", "10", "--profile", "striding"]) == 0
    assert "table entries the fuzzer's programs fired" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"kvstate"}))
def test_ci_profile_finds_the_variants_own_bug(variant: str, tmp_path) -> None:
    """Every variant, in one of the four engine shapes (tried in order; a shape
    that finds nothing costs well under a second). Only the variant's own
    invariants are checked, so an E2-based mutant is not credited with e2's
    bugs."""
    from kvstate.invariants import broken_by
    from sim.explore.fuzz import fuzz_ci

    own = broken_by(variant)
    r = fuzz_ci(variant, out_dir=str(tmp_path), only=own)
    assert r.invariant in own, f"{variant}: CI profile found {r.invariant}, wanted one of {own}"
    assert r.trace is not None and replay_trace(r.trace).ok
