"""The command line: exit codes 0/1/2, --json, clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_demo_default_protocol_survives_and_e2_is_caught(capsys) -> None:
    code, out = run_json(capsys, "demo")
    assert code == 0 and out["ok"] is True and out["violations"] == []
    e2 = next(r for r in out["runs"] if r["protocol"] == "e2")
    assert e2["violations"] and e2["save_jobs"] > 0 and e2["puts"] > 0
    code, out = run_json(capsys, "demo", "--protocol", "e2", "--compare")
    assert code == 1 and out["ok"] is False
    assert {"invariant", "event_index", "message"} <= set(out["violations"][0])


def test_demo_human_output_names_what_was_simulated(capsys) -> None:
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert "save_jobs" in text and "result: ok for protocol kvstate" in text


def test_scenarios_command_reports_violations_with_exit_1(capsys) -> None:
    code, out = run_json(capsys, "scenarios", "preempt-running-job", "--protocol", "e1")
    assert code == 1 and "S1" in out["runs"][0]["fired"]
    code, out = run_json(capsys, "scenarios", "preempt-running-job")
    assert code == 0 and out["runs"][0]["fired"] == []


def test_bad_input_exits_2_with_a_clear_message(capsys) -> None:
    assert main(["scenarios", "no-such-scenario"]) == 2
    assert "unknown scenario 'no-such-scenario'" in capsys.readouterr().err
    assert main(["diagram", "nope"]) == 2
    assert "unknown machine 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["demo", "--protocol", "e3"])
    assert err.value.code == 2
    assert "unknown protocol 'e3'" in capsys.readouterr().err


def test_specs_outside_a_checkout_says_so_instead_of_calling_everything_stale(
        tmp_path: Path, capsys) -> None:
    assert main(["specs", "--root", str(tmp_path / "nowhere")]) == 2
    assert "no specs directory there" in capsys.readouterr().err


def test_specs_are_fresh_and_diagram_prints_mermaid(capsys) -> None:
    code, out = run_json(capsys, "specs", "--root", str(ROOT / "specs"))
    assert code == 0 and out["stale"] == []
    code, out = run_json(capsys, "diagram", "job")
    assert code == 0 and out["mermaid"].startswith("stateDiagram-v2")


@pytest.mark.slow
def test_bench_quick_reports_both_protocols_and_ratios(capsys) -> None:
    code, out = run_json(capsys, "bench", "--quick", "core", "sim", "memory")
    assert code == 0
    core = out["core"]
    assert set(core["results"]) == {"kvstate@1024", "kvstate@16384", "e2@1024", "e2@16384"}
    for figures in core["results"].values():
        assert figures["exists_keys_per_decode_save"] == figures["new_chunks_per_decode_save"]
    assert any("e2/kvstate" in line for line in core["ratios"])
    assert out["sim"]["sim_observations"] > 0 and out["sim"]["check_lines"] > 0
    assert 0 < out["sim"]["ratio_observations_to_bare_heapq"] < 1
    assert 0 < out["sim"]["ratio_unchecked_observations_to_bare_heapq"] < 1
    assert out["sim"]["checks_share_of_sim_seconds"] < 1
    assert out["memory"]["1000"]["ok"] and out["memory"]["4000"]["ok"]


@pytest.mark.slow
def test_the_sim_and_check_benches_run_another_revision_in_the_same_run() -> None:
    """``--against REV`` for ``sim`` and ``check``: that revision's simulator
    (on the same options) and check (of the same trace file) in a worktree,
    alternating with this checkout's; here REV is HEAD, which simulates the
    same run and judges the trace alike."""
    from sim.bench.check import bench_check
    from sim.bench.simulation import bench_sim

    sim = bench_sim(requests=40, check_lines=False, against="HEAD")
    assert sim["same_observations"] is True
    assert sim["against_seconds"] > 0 and sim["speedup"] > 0
    check = bench_check(requests=40, repeats=1, against="HEAD")
    assert check["against_same_verdict"] is True and check["against lines/s"] > 0


def test_bench_refuses_against_and_soak_options_before_running_anything(capsys) -> None:
    """A typo in ``--against`` or an option the named parts do not take is
    refused at once, not after minutes of benchmarks."""
    for argv, said in ((["bench", "sim", "--against", "no-such-rev"],
                        "--against 'no-such-rev': no such commit"),
                       (["bench", "core", "--against", "HEAD"],
                        "--against compares the model checker, the simulator or the trace "
                        "check"),
                       (["bench", "check", "--soak-scale", "16"],
                        "--soak-scale times the simulator's FAST'25 soak: name sim")):
        assert main(argv) == 2
        assert said in capsys.readouterr().err


def test_the_sim_bench_unchecked_row_runs_the_same_simulation_without_checks() -> None:
    """`kvstate bench sim` weighs the checks by running the same seed with a
    monitor that checks nothing: the same observations, and a buggy
    variant's violation goes unseen there."""
    from sim.bench.simulation import _Unchecked
    from sim.simulator.runner import SimOptions, simulate

    options = SimOptions(requests=40, protocol="e1")
    checked = simulate(options, stop_at_first=False)
    unchecked = simulate(options, stop_at_first=False, monitor=_Unchecked)
    assert checked.findings and not unchecked.findings
    assert unchecked.figures["observations"] == checked.figures["observations"]


def test_console_entry_point_runs_as_a_module() -> None:
    done = subprocess.run([sys.executable, "-m", "sim.cli", "demo", "--protocol", "bogus"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr


def test_readme_commands_and_ci_agree() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash")[1:3]]
    assert len(blocks) == 2 and blocks[0].endswith("kvstate sim")
    test_command = blocks[1]
    assert "pytest" in test_command and "ruff" in test_command and "mypy" in test_command
    assert test_command in ci, ".ci/run must run the README's test command verbatim"


def test_json_output_carries_the_error_when_a_command_exits_2(tmp_path, capsys) -> None:
    """Issue 27: a tool reading `--json` got nothing on standard output when
    the command refused its input; now an object with ``ok`` false and the
    error (the file, line and field where the error knows them)."""
    code, out = run_json(capsys, "check", str(tmp_path / "missing.jsonl"))
    assert code == 2 and out["ok"] is False and out["violations"] == []
    assert out["error"]["where"] == str(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kvstate_trace": 1, "configs": [{"block_size": "x"}]}\n')
    code, out = run_json(capsys, "check", str(bad))
    assert code == 2 and out["error"]["where"] == f"{bad}:1" and out["error"]["field"]
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal
        main(["sim", "--seed", "-1", "--json"])
    assert exited.value.code == 2
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and "--seed" in out["error"]["message"]


def _renumbered(trace: Path, shift: int) -> Path:
    """The trace with every store job id moved by ``shift`` (the plans' and
    the ranks' ``job_id`` fields and the settlements' released job lists)."""
    def move(o):
        if isinstance(o, dict):
            return {k: (v + shift if k == "job_id" else [j + shift for j in v]
                        if k == "released_jobs" else move(v)) for k, v in o.items()}
        return [move(x) for x in o] if isinstance(o, list) else o

    lines = trace.read_text().splitlines()
    out = trace.with_name("renumbered.jsonl")
    out.write_text("\n".join([lines[0]] + [json.dumps(move(json.loads(x))) for x in lines[1:]])
                   + "\n")
    return out


def test_job_ids_numbered_from_zero_as_upstream_does_are_no_violation(tmp_path, capsys) -> None:
    """Issue 27: a producer numbering store jobs from 0, as vLLM's connector
    does, got a false S22 at its first job (kvstate numbers from 1, and the
    checker had taken that for the contract)."""
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "--requests", "20", "--faults", "none", "--trace", str(trace)]) == 0
    capsys.readouterr()
    zero = _renumbered(trace, -1)
    assert '"job_id": 0' in zero.read_text()
    code, out = run_json(capsys, "check", str(zero))
    assert code == 0 and out["ok"] is True, out["violations"][:3]
