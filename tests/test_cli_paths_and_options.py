"""What a command is told to write and to run, refused when it starts (exit 2,
naming the option), and files written whole or not at all: the defects an
outside audit of the command line found, as a class (`sim.commands.paths`,
`sim.simulator.runner.OPTION_LIMITS`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from sim.cli import main
from sim.commands.options import validate_options
from sim.commands.paths import written_whole
from sim.simulator.runner import OPTION_LIMITS, SimOptions
from sim.traces.minimize import options_from_trace

ROOT = Path(__file__).resolve().parent.parent


def _refused(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    return err


# --- Output files: the previous file survives a run that stops on its input.

def test_a_bad_workload_leaves_the_previous_trace_as_it_was(tmp_path: Path, capsys) -> None:
    previous = tmp_path / "run.jsonl"
    assert main(["sim", "--requests", "5", "--trace", str(previous)]) == 0
    before = previous.read_bytes()
    bad = tmp_path / "workload.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    _refused(capsys, ["sim", "--workload", "fast25", "--fast25-path", str(bad),
                      "--trace", str(previous)], f"{bad}:1", "input_length")
    assert previous.read_bytes() == before  # it was truncated to its header
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl", "workload.jsonl"]


def test_the_workload_given_as_the_trace_is_read_before_it_is_replaced(
        tmp_path: Path, capsys) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({
        "timestamp": 10 * i, "input_length": 1024, "output_length": 4, "hash_ids": [i, i + 1],
    }) + "\n" for i in range(3)))
    assert main(["sim", "--workload", "fast25", "--fast25-path", str(workload),
                 "--scale", "256", "--requests", "3", "--trace", str(workload)]) == 0
    # The run read three requests (it used to find none: the file was
    # emptied before it was read), then its trace replaced the file.
    out = capsys.readouterr().out
    assert "FAST'25 trace, 3 requests" in out, out
    assert json.loads(workload.read_text().splitlines()[0])["kvstate_trace"] == 1


def test_written_whole_leaves_nothing_but_the_old_file_when_the_block_fails(
        tmp_path: Path) -> None:
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), written_whole(target) as out:
        out.write("half a result\n")
        raise RuntimeError("the run stopped")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    with written_whole(target) as out:
        out.write("new\n")
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_a_device_is_written_in_place_not_replaced(tmp_path: Path, capsys) -> None:
    # Renaming over /dev/null would replace the device with a file.
    assert main(["sim", "--requests", "3", "--trace", os.devnull]) == 0
    assert Path(os.devnull).is_char_device()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_names_the_file(capsys) -> None:
    _refused(capsys, ["sim", "--requests", "3", "--trace", "/dev/full"],
             "/dev/full: No space left on device")


@pytest.mark.parametrize(("argv", "words"), [
    (["sim", "--trace", ""], ["--trace: an empty path"]),
    (["sim", "--trace", "-"], ["--trace -: not standard output here"]),
    (["sim", "--trace", "{dir}"], ["--trace", "is a directory"]),
    (["sim", "--trace", "{dir}/missing/t.jsonl"], ["--trace", "no directory"]),
    (["trace", "observed", "{trace}", "-o", "{dir}"], ["-o", "is a directory"]),
    (["trace", "observed", "{trace}", "-o", ""], ["-o: an empty path"]),
    (["diagram", "request", "--svg", ""], ["--svg", "unknown suffix"]),
    (["minimize", "--out", "{dir}/missing/m.jsonl"], ["--out", "no directory"]),
    (["fuzz", "--protocol", "e2", "--budget", "30", "--out-dir", "{file}"],
     ["--out-dir", "is not a directory"]),
    (["modelcheck", "--scope", "tiny", "--protocol", "e2", "--workers", "1",
      "--out-dir", "{file}/below"], ["--out-dir", "is not a directory"]),
    (["modelcheck", "--scope", ""], ["unknown scope ''"]),
    # Issue 32, class 3: destinations root may "access" but nobody can write
    # (os.access says yes to root for /proc), and a directory as a
    # checkpoint file, used to be found only when the first write failed.
    (["fuzz", "--protocol", "e2", "--budget", "30", "--out-dir", "/proc/kvstate-x"],
     ["--out-dir /proc/kvstate-x: "]),
    (["sim", "--requests", "3", "--trace", "/proc/kvstate-x.jsonl"],
     ["--trace /proc/kvstate-x.jsonl: "]),
    (["modelcheck", "--scope", "default", "--budget", "30", "--checkpoint", "{dir}"],
     ["--checkpoint", "is a directory"]),
    (["modelcheck", "--scope", "default", "--budget", "30", "--checkpoint", "/proc/kvstate-ck"],
     ["--checkpoint /proc/kvstate-ck: "]),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(
        tmp_path: Path, capsys, argv: list[str], words: list[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "--requests", "3", "--trace", str(trace)]) == 0
    afile = tmp_path / "a-file"
    afile.write_text("mine\n")
    capsys.readouterr()
    argv = [a.format(dir=tmp_path, trace=trace, file=afile) for a in argv]
    # The old code ran the fuzz and model-check rows to the end and only then
    # failed ("File exists"): the option named in the words says it was
    # refused first (no timing: tests do not time).
    _refused(capsys, argv, *words)
    assert afile.read_text() == "mine\n"


def test_a_reader_that_stops_reading_is_no_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "--requests", "20", "--trace", str(trace)]) == 0
    reader = subprocess.Popen(["head", "-c", "10"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL)
    cut = subprocess.run([sys.executable, "-m", "sim.cli", "trace", "observed", str(trace)],
                         stdout=reader.stdin, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert reader.stdin is not None
    reader.stdin.close()
    reader.wait()
    assert cut.returncode == 141 and cut.stderr == "", cut.stderr


# --- Options: what `sim` runs, `minimize` takes from its trace, and back.

@pytest.mark.parametrize("name", sorted(OPTION_LIMITS))
def test_sim_and_minimize_refuse_the_same_option_values(tmp_path: Path, name: str) -> None:
    limit = OPTION_LIMITS[name]
    beyond: float = limit * 2 if isinstance(getattr(SimOptions(), name), float) else int(limit) + 1
    options = attrs.evolve(SimOptions(), **{name: beyond})
    with pytest.raises(Exception, match=f"--{name.replace('_', '-')}={beyond}: expected"):
        validate_options(options)
    header = {"kvstate_trace": 1, "configs": [{"@": "ConnectorConfig"}],
              "options": {name: beyond}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(Exception, match=f"options.{name}"):
        options_from_trace(path)


@pytest.mark.parametrize(("argv", "words"), [
    (["sim", "--block-size", "2000000"], ["--block-size=2000000", "[1, 4096]"]),
    (["sim", "--world-size", "1100"], ["--world-size=1100", "[1, 64]"]),
    (["sim", "--groups", "full,swa:100000000"], ["groups[1].sliding_window", "LIMITS"]),
    (["sim", "--groups", ",".join(["full"] * 65)], ["65 groups", "at most 64"]),
    (["sim", "--seed", str(1 << 64)], ["--seed="]),
    (["sim", "--fast25-path", "x.jsonl"], ["--fast25-path x.jsonl", "--workload fast25"]),
    (["minimize", "--world-size", "3", "--put-step", "2", "--max-runs", "2"],
     ["--put-step=2", "divide"]),
    (["minimize", "--num-blocks", str(10 ** 12), "--max-runs", "2"], ["--num-blocks="]),
    (["campaign", "--seeds", "2", "--budget", "1"], ["--seeds 2 and --budget 1"]),
    (["minimize", "--invariant", "NOPE", "--max-runs", "2"], ["--invariant NOPE: no such"]),
])
def test_options_out_of_range_or_ignored_are_refused(tmp_path: Path, capsys, argv: list[str],
                                                      words: list[str]) -> None:
    _refused(capsys, [*argv[:1], *argv[1:], *(
        ["--out", str(tmp_path / "m.jsonl")] if argv[0] == "minimize" else [])], *words)
    assert not (tmp_path / "m.jsonl").exists()


def test_minimize_refuses_options_beside_a_trace(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "--protocol", "e2", "--requests", "3", "--trace", str(trace)]) in (0, 1)
    _refused(capsys, ["minimize", str(trace), "--requests", "3", "--out",
                      str(tmp_path / "m.jsonl")], "a trace brings its run's options", "--requests")


def test_specs_write_refuses_before_writing_any_file(tmp_path: Path, capsys) -> None:
    root = tmp_path / "specs"
    (root / "trace.md").mkdir(parents=True)
    _refused(capsys, ["specs", "--write", "--root", str(root)], "trace.md is a directory")
    assert [p.name for p in root.iterdir()] == ["trace.md"]  # it wrote the others first


# --------------------------------------------------------------------------
# Bad input, the probe's class 1: a number too large for a float in a trace's
# time (``t``, every record) or in ``JobFinished.now`` ended in OverflowError
# (exit 1, a traceback) in every command that reads traces.

SCENARIO_TRACE = Path(__file__).resolve().parents[1] / "specs" / "scenarios" / \
    "preempt-with-queued-job.jsonl"
HUGE = int("9" * 400)


def _with_field(tmp_path: Path, kind: str, field: str, value: object) -> tuple[Path, int]:
    """The scenario trace with ``field`` of the first ``kind`` line replaced."""
    lines = SCENARIO_TRACE.read_text().splitlines()
    number = next(i for i, line in enumerate(lines) if i and f'"type":"{kind}"'
                  in line.replace(" ", ""))
    record = json.loads(lines[number])
    record[field] = value
    lines[number] = json.dumps(record)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, number + 1


@pytest.mark.parametrize(("kind", "field"), [("StepScheduled", "t"), ("JobFinished", "now")])
@pytest.mark.parametrize("command", [["check"], ["replay"], ["coverage"], ["trace", "observed"],
                                     ["diagram", "job", "--coverage"]])
def test_a_number_beyond_a_float_is_refused_naming_line_and_field(tmp_path, capsys, kind, field,
                                                                 command) -> None:
    path, line = _with_field(tmp_path, kind, field, HUGE)
    assert main([*command, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}: field {field!r}: expected a number within a float's range, " \
        "got an integer of 1329 bits" in err, err


def test_a_float_literal_beyond_range_is_refused_naming_line_and_field(tmp_path, capsys) -> None:
    """``1e999`` is valid JSON that Python reads as infinity."""
    path, line = _with_field(tmp_path, "JobFinished", "now", 12345.5)
    path.write_text(path.read_text().replace("12345.5", "1e999"))
    assert main(["check", str(path)]) == 2
    assert f"{path}:{line}: field 'now': expected a finite number, got inf" in \
        capsys.readouterr().err


def test_any_json_number_as_a_time_or_now_is_read_or_refused_cleanly(tmp_path_factory) -> None:
    """Whatever number a trace holds in ``t`` or ``JobFinished.now`` (huge,
    tiny, negative, integral or not), ``check`` exits 0, 1 or 2, never with a
    traceback."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    numbers = st.integers() | st.integers(min_value=10**300, max_value=10**2000) | st.floats(
        allow_nan=False, allow_infinity=False)

    @settings(max_examples=60, deadline=None)
    @given(kind_field=st.sampled_from([("StepScheduled", "t"), ("JobFinished", "now")]),
           value=numbers)
    def read(kind_field, value) -> None:
        tmp = tmp_path_factory.mktemp("number")
        path, _ = _with_field(tmp, *kind_field, value)
        assert main(["check", str(path)]) in (0, 1, 2)

    read()


# --------------------------------------------------------------------------
# Bad input, the probe's class 4: library errors that escaped as tracebacks.

def test_a_workload_whose_gzip_body_is_corrupt_is_refused_naming_it(tmp_path, capsys) -> None:
    """A valid gzip header over a damaged deflate stream: zlib.error used to
    escape (exit 1, a traceback); a truncated file was already handled."""
    import gzip

    line = b'{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
    data = gzip.compress(line * 100)
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(data[:20] + bytes(b ^ 0x5A for b in data[20:60]) + data[60:])
    assert main(["sim", "--workload", "fast25", "--fast25-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: cannot read (Error -3 while decompressing data" in err, err


def test_a_ray_address_rays_parser_refuses_is_a_usage_error(capsys) -> None:
    pytest.importorskip("ray")
    assert main(["campaign", "--ray", "::::"]) == 2
    err = capsys.readouterr().err
    assert "--ray '::::': not an address Ray can join (Invalid address format: ::::)" in err, err


# The probe's class 7: `trace observed X -o X` replaced the annotated trace
# with its cut (the output is written whole, then renamed over X).

def test_trace_observed_refuses_to_write_over_the_trace_it_reads(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(SCENARIO_TRACE.read_text())
    before = trace.read_bytes()
    for output in (str(trace), str(tmp_path / "." / "t.jsonl")):
        assert main(["trace", "observed", str(trace), "-o", output]) == 2
        assert "that is the trace being read" in capsys.readouterr().err
    assert trace.read_bytes() == before
    assert main(["trace", "observed", str(trace), "-o", str(tmp_path / "cut.jsonl")]) == 0


def test_a_checkpoint_not_written_because_the_search_ended_says_so(tmp_path, capsys) -> None:
    """Issue 32, class 3: an exhaustive search given --checkpoint used to
    exit 0 writing nothing and saying nothing about it."""
    path = tmp_path / "ck.bin"
    assert main(["modelcheck", "--scope", "tiny", "--checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint: none written to {path} (the search ended" in out
    assert not path.exists()


# --- Issue 32, class 7: limits that agree and messages that say what is wrong.

@pytest.mark.parametrize(("argv", "words"), [
    (["sim", "--seed", str(1 << 63)], ["--seed", f"[0, {(1 << 63) - 1}]"]),
    (["sim", "--faults", "all,none"], ["'all' stands alone"]),
    (["sim", "--faults", "preempt,none"], ["'none' stands alone"]),
    (["sim", "--world-size", "1024"], ["the simulator's bound", "up to 1024 ranks"]),
    (["sim", "--requests", "3", "--trace", "/proc/self/status"],
     ["--trace /proc/self/status: no file can be created in '/proc/self'"]),
    (["check", "--liveness-steps", str(10 ** 30), "{trace}"],
     ["--liveness-steps", f"[1, {1 << 62}]"]),
    (["check", "{bom}"], ["byte-order mark"]),
    (["check", "{torn}"], ["truncated first line", "no trace to check"]),
    (["real", "--master", ""], ["--master '': an empty address"]),
])
def test_limits_agree_and_messages_name_the_real_fault(tmp_path: Path, capsys, argv: list[str],
                                                      words: list[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "--requests", "3", "--trace", str(trace)]) == 0
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + trace.read_bytes())
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(trace.read_bytes()[:20])
    capsys.readouterr()
    argv = [a.format(trace=trace, bom=bom, torn=torn) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal of an option's value
        code = exc.code
    assert code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_a_header_and_the_option_refuse_the_same_liveness_bound(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "--requests", "3", "--trace", str(trace)]) == 0
    lines = trace.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["liveness_steps"] = (1 << 62) + 1
    trace.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    capsys.readouterr()
    _refused(capsys, ["check", str(trace)], "liveness_steps", f"[1, {1 << 62}]")
    assert main(["check", "--liveness-steps", str(1 << 62), str(tmp_path / "t.jsonl")]) == 2


# --- Issue 32, class 2: work bounded by the input's use, or refused up front.

@pytest.mark.parametrize(("argv", "words"), [
    (["fuzz", "--steps", "100000000", "--budget", "2"], ["--steps", "[1, 1000]"]),
    (["fuzz", "--examples", "1000000000", "--budget", "2"], ["--examples", "[1, 10000]"]),
])
def test_a_fuzz_round_that_could_outrun_its_budget_is_refused(capsys, argv, words) -> None:
    """The budget is checked between rounds of programs: a round of 10^8
    rules a program ran far past --budget 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_a_workload_is_read_only_as_far_as_the_run_takes(tmp_path: Path) -> None:
    """A 5-request run read the whole FAST'25 file first (a gzip of millions
    of lines took minutes). Line 10 here is garbage: a reader that stops at
    its limit never reaches it, one that reads everything refuses it."""
    import gzip

    from kvstate.workloads import WorkloadError, fast25

    rows = [json.dumps({"timestamp": 10 * i, "input_length": 64, "output_length": 4,
                        "hash_ids": [i]}) for i in range(9)]
    path = tmp_path / "w.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write("\n".join(rows) + "\nnot json\n")
    assert len(list(fast25(path, scale=16, limit=5))) == 5
    with pytest.raises(WorkloadError, match=":10: "):
        list(fast25(path, scale=16))
