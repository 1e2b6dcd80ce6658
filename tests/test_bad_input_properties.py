"""Bad input, bounded work (issue 32): a Hypothesis property per reader and parser.

The probe behind issue 32 fed about 2,190 hostile inputs to every reader a
user's input reaches. Each property here does the same by construction: it
takes a VALID input (a trace, a FAST'25 workload, a command line, a connector
configuration, a Mooncake config file), so that what it breaks is deep inside
(a field of the 30th record, a duplicated key in a nested object, the gzip
body past its header), and breaks it in the ways the issue lists: integers
beyond 64 bits or 4,300 digits, ``1e999``, ``NaN``, negative counts, NUL and
lone surrogates, wrong JSON types, duplicate keys, truncated lines, deep
nesting, a byte-order mark, binary garbage, a corrupt gzip. Then it asserts
what a careless or hostile user is owed:

* the command exits 0, 1 or 2 (run in-process: an exception escaping
  ``sim.cli.main`` is the traceback a user would see, and fails the test);
* nothing on standard output or error reads ``Traceback``;
* a refusal (exit 2) names the file, and the line where the input has lines
  (``file:line:``), or the option or field;
* a value the reader takes is one the program can use: an impossible value
  (a negative count, a block id of 2^64, an infinite budget) is refused, not
  read;
* bounded time: every example runs under a Hypothesis ``deadline``.

Where a command's work would start (a simulation, a search, a master), a stub
takes its place and reports what got through, so only the reading and
checking is exercised (and bounded). Readers and their properties:

=====================================  =============================================
reader                                 property
=====================================  =============================================
trace readers (check, check --at-end   ``test_any_corrupted_trace_is_read_or_refused
open, replay, coverage, trace          _naming_file_and_line``
observed, diagram --coverage,
minimize TRACE)
plot, diagram --svg --coverage         ``test_drawing_commands_read_or_refuse_...``
the reader's value rules               ``test_an_impossible_value_in_any_record_...``
FAST'25 workload (sim, real)           ``test_any_corrupted_workload_...``
every command's options (argparse      ``test_any_option_value_is_refused_naming_...``
and each command's own checks)
modelcheck --resume (checkpoints)      ``test_any_damaged_checkpoint_is_refused_...``
kv_connector_extra_config              ``test_hostile_connector_strings_...``
MOONCAKE_CONFIG_PATH                   ``test_any_corrupted_mooncake_config_file_...``
=====================================  =============================================

(``tests/test_vllm_options.py`` and ``tests/test_store_deployment.py`` feed
both configuration parsers arbitrary JSON values; the properties here add what
those generate not: hostile strings, file bytes.) The tests at the end are
one example of each defect the properties and a rerun of the probe found,
each failing before its fix. ``KVSTATE_PROBE_SCALE=10`` runs ten times the
examples (a deeper probe, minutes); the default takes well under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import math
import os
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_trace_contract import _paths  # every path into a JSON value

from sim.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "trace.md"
SCENARIO = ROOT / "specs" / "scenarios" / "preempt-with-queued-job.jsonl"
FAST25 = ROOT / "kvstate" / "data" / "mooncake_fast25_conversation.jsonl.gz"

# Examples run a handful of commands on a small file each: seconds are far
# above what one takes (tens of milliseconds), and far below a hang.
DEADLINE = timedelta(seconds=20)


def examples(n: int) -> int:
    """``n`` examples, times ``KVSTATE_PROBE_SCALE`` (a deeper probe: 10)."""
    return n * int(os.environ.get("KVSTATE_PROBE_SCALE", "1"))
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
            HealthCheck.data_too_large]


# --------------------------------------------------------------------------
# Writing hostile JSON: values the json module would never write.


class Raw(str):
    """JSON text written as it is (``1e999``, ``NaN``, 5,000 digits, ``[[[...]]]``)."""


class Dup:
    """A key written a second time in one object (the JSON text has it twice)."""

    def __init__(self, name: str) -> None:
        self.name = name


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k.name if isinstance(k, Dup) else k)}:{dumps(v)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


HUGE = "1" + "0" * 400
RAW_NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", HUGE, "-" + HUGE,
               str(1 << 64), str((1 << 64) - 1), str(1 << 63), str((1 << 63) - 1), str(1 << 62),
               str(-(1 << 63) - 1), "-1", "-2", "0", "-0", "1e-400", "0.5", "1E2", "9" * 5000,
               "1.0", "-0.0"]
HOSTILE_TEXT = ["\x00", "a\x00b", "\ud800", "x\udfff", "\udc80", "\ufeff", "\u202e", "é",
                "x" * 70_000, "", " ", "@", "a@tp_rank:1@group:0@ff", "../../etc/passwd",
                "\n", "１２", "١٢٣"]
WRONG_TYPES = ["null", "true", "false", "[]", "{}", '"1"', "[[[]]]", '{"@": "Nope"}',
               '{"@hex": "zz"}', '{"@hex": "00"}', '{"@enum": "Role", "value": "x"}', "[1, 2]",
               '[null]', '{"": 1}']


def hostile_json() -> st.SearchStrategy[Raw]:
    """JSON text of a hostile value (sometimes not JSON at all: a reader meets both)."""
    return st.one_of(
        st.sampled_from(RAW_NUMBERS),
        st.integers().map(str),
        st.integers(min_value=(1 << 62) - 2, max_value=(1 << 64) + 2).map(str),
        st.integers(min_value=-(1 << 64), max_value=-1).map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
        st.sampled_from(HOSTILE_TEXT).map(json.dumps),
        st.text(max_size=6).map(json.dumps),
        st.sampled_from(WRONG_TYPES),
        st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
        st.just("[" * 100_000 + "]" * 100_000),
    ).map(Raw)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


@st.composite
def mutated_json(draw: st.DrawFn, records: list[Any], at_most: int = 3) -> list[Any]:
    """``records`` (JSON values, a file's lines) with one to ``at_most``
    field-level changes: a value replaced by hostile JSON text, a key written
    twice (first or last), a field deleted, a line duplicated, swapped or
    dropped. Returns the records; `dumps` writes them."""
    lines = copy.deepcopy(records)
    for _ in range(draw(st.integers(1, at_most))):
        if not lines:
            break
        n = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["value", "value", "value", "dup", "delete", "line"]))
        if op == "line":
            what = draw(st.sampled_from(["duplicate", "swap", "drop"]))
            if what == "duplicate":
                lines.insert(n, copy.deepcopy(lines[n]))
            elif what == "swap" and n + 1 < len(lines):
                lines[n], lines[n + 1] = lines[n + 1], lines[n]
            elif what == "drop":
                del lines[n]
            continue
        paths = _paths(lines[n])
        if op == "value":
            where = draw(st.sampled_from(paths))
            if not where:
                lines[n] = draw(hostile_json())
            else:
                _at(lines[n], where[:-1])[where[-1]] = draw(hostile_json())
            continue
        objects = [p for p in paths if isinstance(_at(lines[n], p), dict) and _at(lines[n], p)]
        if not objects:
            continue
        where = draw(st.sampled_from(objects))
        obj = _at(lines[n], where)
        key = draw(st.sampled_from(sorted(k for k in obj if isinstance(k, str))))
        if op == "delete":
            del obj[key]
            continue
        again = draw(st.one_of(hostile_json(), st.just(Raw(dumps(obj[key])))))
        items = list(obj.items())
        obj.clear()
        if draw(st.booleans()):  # the repeated key first: a last-wins reader takes the original
            obj[Dup(key)] = again
            obj.update(items)
        else:
            obj.update(items)
            obj[Dup(key)] = again
    return lines


def _text(records: list[Any]) -> str:
    return "".join(dumps(r) + "\n" for r in records)


BYTE_OPS = ("none", "none", "none", "bom", "bom_line", "truncate", "garbage", "nul",
            "crlf", "invalid_utf8", "surrogate_bytes", "gzip", "gzip_cut", "empty",
            "long_line", "blank_lines")


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> tuple[bytes, str]:
    """``data`` after one byte-level change (or none): a UTF-8 BOM at the start
    of the file or of a line, a cut at any byte, binary garbage, a NUL byte,
    CRLF line ends, bytes that are not UTF-8 (a raw surrogate among them),
    the whole file gzip-compressed (whole or cut), nothing at all, a 5 MB line."""
    op = draw(st.sampled_from(BYTE_OPS))
    at = draw(st.integers(0, max(0, len(data))))
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A and i + 1 < len(data)]
    line_start = draw(st.sampled_from(starts))
    if op == "bom":
        data = b"\xef\xbb\xbf" + data
    elif op == "bom_line":
        data = data[:line_start] + b"\xef\xbb\xbf" + data[line_start:]
    elif op == "truncate":
        data = data[:at]
    elif op == "garbage":
        data = data[:at] + draw(st.binary(min_size=1, max_size=64)) + data[at:]
    elif op == "nul":
        data = data[:at] + b"\x00" + data[at:]
    elif op == "crlf":
        data = data.replace(b"\n", b"\r\n")
    elif op == "invalid_utf8":
        data = data[:at] + b"\xff\xfe" + data[at:]
    elif op == "surrogate_bytes":
        data = data[:at] + b"\xed\xa0\x80" + data[at:]
    elif op == "gzip":
        data = gzip.compress(data)
    elif op == "gzip_cut":
        packed = gzip.compress(data)
        data = packed[:draw(st.integers(0, len(packed)))]
    elif op == "empty":
        data = b""
    elif op == "long_line":
        data = data[:line_start] + b'{"i": "' + b"x" * (5 << 20) + b'"}\n' + data[line_start:]
    elif op == "blank_lines":
        data = data[:line_start] + b"\n  \n\t\n" + data[line_start:]
    return data, op


# --------------------------------------------------------------------------
# Running a command in-process.


class Reached(Exception):  # noqa: N818 - not an error: the command got to its work
    """The command passed its checks and reached its work (a stub's signal)."""

    def __init__(self, what: str, value: Any = None) -> None:
        super().__init__(what)
        self.what = what
        self.value = value


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int | str, str, str]:
    """``kvstate ARGV`` in-process: (exit code or ``"reached"``, stdout, stderr).
    Any other exception escapes: it is the traceback a user would see."""
    capsys.readouterr()
    try:
        code: int | str = main(argv)
    except SystemExit as exc:  # argparse's refusals, --help
        code = exc.code if isinstance(exc.code, int) else 2
    except Reached:
        code = "reached"
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean(code: int | str, out: str, err: str) -> None:
    assert code in (0, 1, 2, "reached"), (code, err[-2000:])
    assert "Traceback" not in out and "Traceback" not in err, err[-2000:]


def assert_names(err: str, path: Path, *, line: bool) -> None:
    """A refusal names the file (and, where ``line``, the line: ``file:N:``)."""
    name = re.escape(str(path))
    if line:
        assert re.search(rf"{name}:\d+: ", err), err[-2000:]
    else:
        assert re.search(rf"{name}(:\d+)?: ", err), err[-2000:]


# --------------------------------------------------------------------------
# Valid traces to break: the contract's example (observed layer, TP 2,
# vllm-sha256), a scenario (annotated), a simulator run (TP 2, faults, events,
# the header's simulator options).


def _spec_example() -> list[Any]:
    (block,) = re.findall(r"```jsonl\n(.*?)```", SPEC.read_text(), re.S)
    return [json.loads(line) for line in block.splitlines()]


class _Bases(dict):  # type: ignore[type-arg]
    """The base traces, shown by name in a falsifying example (not whole)."""

    def __repr__(self) -> str:
        return f"<base traces: {', '.join(self)}>"


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    path = tmp_path_factory.mktemp("base") / "sim.jsonl"
    assert main(["sim", "--requests", "3", "--world-size", "2", "--seed", "3", "--trace",
                 str(path), "--no-progress"]) in (0, 1)
    return _Bases({
        "observed": _spec_example(),
        "annotated": [json.loads(line) for line in SCENARIO.read_text().splitlines()],
        "simulated": [json.loads(line) for line in path.read_text().splitlines()],
    })


@contextlib.contextmanager
def _minimize_stubbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`kvstate minimize TRACE` reads the trace's header options and then
    runs the simulator up to --max-runs times: the stub stops it there,
    checking that what the reader accepted is a run `sim` would take."""
    import sim.traces.minimize
    from sim.commands.options import validate_options

    def stub(options: Any, **kwargs: Any) -> Any:
        validate_options(options)  # what got through is a valid run
        raise Reached("minimize", options)

    monkeypatch.setattr(sim.traces.minimize, "minimize", stub)
    yield


def _trace_commands(path: Path, out: Path) -> list[list[str]]:
    return [["check", str(path)], ["check", str(path), "--at-end", "open", "--json"],
            ["replay", str(path)], ["coverage", str(path)],
            ["trace", "observed", str(path), "-o", str(out)],
            ["diagram", "job", "--coverage", str(path)],
            ["minimize", str(path), "--out", str(out)]]


@settings(max_examples=examples(40), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_any_corrupted_trace_is_read_or_refused_naming_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        traces: dict[str, list[Any]], data: st.DataObject) -> None:
    base = data.draw(st.sampled_from(sorted(traces)), label="base")
    records = data.draw(mutated_json(traces[base]), label="records")
    raw, op = data.draw(mutated_bytes(_text(records).encode("utf-8", "surrogatepass")),
                        label="bytes")
    path = tmp_path / "trace.jsonl"
    path.write_bytes(raw)
    out = tmp_path / "out.jsonl"
    with _minimize_stubbed(monkeypatch):
        for argv in _trace_commands(path, out):
            code, stdout, err = run(capsys, argv)
            assert_clean(code, stdout, err)
            if code == 2:
                # Every refusal of a file with lines names one (an empty file:
                # line 1, where its header should be).
                assert_names(err, path, line=True)


@settings(max_examples=examples(8), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_drawing_commands_read_or_refuse_any_corrupted_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], traces: dict[str, list[Any]],
        data: st.DataObject) -> None:
    pytest.importorskip("matplotlib")
    base = data.draw(st.sampled_from(["observed", "annotated"]), label="base")
    records = data.draw(mutated_json(traces[base], at_most=2), label="records")
    raw, op = data.draw(mutated_bytes(_text(records).encode("utf-8", "surrogatepass")),
                        label="bytes")
    path = tmp_path / "trace.jsonl"
    path.write_bytes(raw)
    for argv in (["plot", str(path), "-o", str(tmp_path / "p.png")],
                 ["diagram", "request", "--svg", str(tmp_path / "d.svg"), "--coverage",
                  str(path)]):
        code, stdout, err = run(capsys, argv)
        assert_clean(code, stdout, err)
        if code == 2:
            assert_names(err, path, line=True)


# --------------------------------------------------------------------------
# The reader's value rules: what no engine can write is refused, in every
# record kind, by both decoders (check: the fast one; replay: the plain one).

_MAX = 1 << 62
# Field name -> values no trace can hold there (the contract: ids, counts and
# positions in [0, 2^62), generations in [1, 2^62) or left out, every other
# integer within 64 bits, identifiers are text without NUL).
_COUNT_FIELDS = frozenset({
    "num_computed_tokens", "num_scheduled_tokens", "num_prompt_tokens", "num_external_tokens",
    "token_ids_start", "token_len", "hit_tokens", "block_ids_start", "hashes_start",
    "save_start", "start_token", "end_token", "chunk_id", "chunk_ids", "pinned_blocks",
    "dropped_events", "block_id", "block_ids", "new_block_ids", "pins", "releases",
    "failed_block_ids", "reported_block_ids", "released_jobs", "job_id", "group", "groups",
    "group_idx", "rank"})
_GENERATION_FIELDS = frozenset({"generation", "state_generation", "retry_generation",
                                "scope_generation"})
_ID_FIELDS = frozenset({"req_id", "key", "keys", "preempted", "finished"})


def _bounded_leaves(line: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    """(path, rule) of the integers and identifiers in ``line`` a rule bounds."""
    out: list[tuple[tuple[Any, ...], str]] = []
    if isinstance(line, dict):
        for k, v in line.items():
            out += _bounded_leaves(v, (*path, k))
        return out
    if isinstance(line, list):
        for i, v in enumerate(line):
            out += _bounded_leaves(v, (*path, i))
        return out
    name = next((p for p in reversed(path) if isinstance(p, str)), "")
    if type(line) is int:
        if name in _COUNT_FIELDS:
            out.append((path, "count"))
        elif name in _GENERATION_FIELDS:
            out.append((path, "generation"))
        elif name not in ("i", "e", "world_size", "block_size", "put_step", "hash_block_size",
                          "alignment", "pcp_rank", "dcp_rank", "pp_rank", "sliding_window",
                          "kvstate_trace", "liveness_steps", "seed", "requests"):
            out.append((path, "int64"))
    elif type(line) is str and name in _ID_FIELDS:
        out.append((path, "id"))
    return out


_IMPOSSIBLE = {
    "count": [-1, -5, _MAX, 1 << 64, 10 ** 400],
    "generation": [0, -2, _MAX, 10 ** 400],
    "int64": [1 << 63, -(1 << 63) - 1, 10 ** 400],
    "id": ["a\x00b", "\ud800", "x\udfff"],
}


@settings(max_examples=examples(60), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_an_impossible_value_in_any_record_is_refused_naming_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], traces: dict[str, list[Any]],
        data: st.DataObject) -> None:
    """Issue 32, class 6, in every record kind (it was fixed in the
    scheduler's records only: a rank's ``PutDone.block_id`` of -1, a
    ``JobStarted.token_len`` of -4, a ``JobFinished.generation`` of 10^400, a
    ``BlockAllocated.req_id`` with a NUL still read as valid)."""
    base = data.draw(st.sampled_from(sorted(traces)), label="base")
    lines = copy.deepcopy(traces[base])
    candidates = [(n, p, rule) for n, line in enumerate(lines) if n
                  for p, rule in _bounded_leaves(line)]
    n, where, rule = data.draw(st.sampled_from(candidates), label="leaf")
    value = data.draw(st.sampled_from(_IMPOSSIBLE[rule]), label="value")
    _at(lines[n], where[:-1])[where[-1]] = value
    path = tmp_path / "impossible.jsonl"
    path.write_text(_text(lines))
    field = next(p for p in reversed(where) if isinstance(p, str))
    # Replay reads as far as the model agrees: the contract's example (no
    # protocol in its header) is another producer's and diverges early.
    for command in (["check"], ["replay"]) if base != "observed" else (["check"],):
        code, out, err = run(capsys, [*command, str(path)])
        assert_clean(code, out, err)
        assert code == 2, (command, lines[n].get("type"), where, value, out[-500:])
        assert f"{path}:{n + 1}: " in err and field in err, err


# --------------------------------------------------------------------------
# The FAST'25 workload reader (`sim --workload fast25 --fast25-path`, and
# `kvstate real`, which reads it before it starts a master).


def _workload_rows(count: int = 6) -> list[Any]:
    with gzip.open(FAST25, "rt") as handle:
        return [json.loads(next(handle)) for _ in range(count)]


@contextlib.contextmanager
def _real_stubbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`kvstate real` with no master and no store: starting one (or
    connecting to --master) reports what got through instead."""
    import adapters.master
    import adapters.mooncake

    def no_master(*args: Any, **kwargs: Any) -> Any:
        raise Reached("master")

    def no_store(config: Any, *args: Any, **kwargs: Any) -> Any:
        raise Reached("store", (config, args, kwargs))

    monkeypatch.setattr(adapters.master, "Master", no_master)
    monkeypatch.setattr(adapters.mooncake, "MooncakeStore", no_store)
    yield


@settings(max_examples=examples(40), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_any_corrupted_workload_is_read_or_refused_naming_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        data: st.DataObject) -> None:
    rows = data.draw(mutated_json(_workload_rows()), label="rows")
    raw, op = data.draw(mutated_bytes(_text(rows).encode("utf-8", "surrogatepass")),
                        label="bytes")
    if op == "none" and data.draw(st.booleans(), label="gzip it"):
        packed = gzip.compress(raw)
        raw = data.draw(st.sampled_from([
            packed,
            packed[:len(packed) // 2],  # cut
            packed[:20] + bytes(b ^ 0x5A for b in packed[20:40]) + packed[40:],  # corrupt
            packed + b"garbage after the member",
            packed + packed]), label="gzip")
    suffix = data.draw(st.sampled_from([".jsonl", ".gz"]), label="suffix")
    path = tmp_path / f"workload{suffix}"
    path.write_bytes(raw)
    requests = str(data.draw(st.integers(1, 8), label="requests"))
    with _real_stubbed(monkeypatch):
        for argv in (["sim", "--workload", "fast25", "--fast25-path", str(path), "--requests",
                      requests, "--scale", "512", "--world-size", "1", "--no-progress"],
                     ["real", "--workload", "fast25", "--fast25-path", str(path), "--requests",
                      requests, "--scale", "512", "--no-progress"]):
            code, stdout, err = run(capsys, argv)
            assert_clean(code, stdout, err)
            if code == 2:
                # Whole-file refusals name no line: nothing to read, or no row.
                assert_names(err, path, line=not any(
                    w in err for w in ("no requests", "cannot open (", "not a regular")))


# --------------------------------------------------------------------------
# Every command's options: argparse's types and each command's own checks.

# Command -> positional arguments it needs (then options are added).
COMMANDS = {
    "sim": [], "check": ["TRACE"], "replay": ["TRACE"], "coverage": ["TRACE"],
    "trace": ["observed", "TRACE"], "plot": ["TRACE"], "diagram": ["job"],
    "minimize": [], "fuzz": [], "campaign": [], "modelcheck": [], "real": [],
    "bench": [], "demo": [], "scenarios": [], "specs": [],
}
HOSTILE_ARGS = [
    "", " ", "-1", "0", "-0", "1", "2", "3", "7", "65", "1025", "4097", "100001",
    "9" * 30, "9" * 400, "9" * 5000, "1e999", "-1e999", "inf", "-inf", "Infinity", "nan", "NaN",
    "1e-300", "5e-324", "0.0001", "1e18", "1.5", "0x10", "1_000", " 5 ", "١٢", "１２", "²",
    "\udcff", "\udc80x", "\u202e", "a,b", "all", "none", "all,none", ",", ",,", "local", "::::",
    "kvstate", "e2", "tiny", "default", "all", "full", "swa:8", "swa:0", "swa:-1", "swa:1e999",
    "full,swa:8", "fast25", "synthetic", "pd", "both", "/proc/x", "/dev/null", "/", ".",
    "-", "--", "x" * 5000, "127.0.0.1:0", "127.0.0.1:99999", "h:١٢", "vllm-sha256",
]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)
            and "--ray" not in a.option_strings]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@contextlib.contextmanager
def _work_stubbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every command's work replaced by a stub that reports it was reached."""
    import importlib
    import pkgutil

    import sim.bench
    import sim.explore.campaign
    import sim.explore.cluster
    import sim.explore.fuzz
    import sim.explore.modelcheck.search
    import sim.simulator.demo
    import sim.simulator.runner
    from sim.commands import bench

    def stub(what: str) -> Any:
        def reached(*args: Any, **kwargs: Any) -> Any:
            raise Reached(what, (args, kwargs))
        return reached

    for module, names in ((sim.simulator.runner, ["simulate"]), (sim.explore.campaign, ["campaign"]),
                          (sim.explore.fuzz, ["fuzz"]), (sim.explore.modelcheck.search, ["check"]),
                          (sim.simulator.demo, ["run_demo"]), (sim.explore.cluster, ["Cluster"]),
                          (bench, ["_bench_vllm", "_bench_engine"]),
                          *((m, [n for n in dir(m) if n.startswith("bench_")])
                            for m in (importlib.import_module(f"sim.bench.{i.name}")
                                      for i in pkgutil.iter_modules(sim.bench.__path__)))):
        for name in names:
            monkeypatch.setattr(module, name, stub(f"{module.__name__}.{name}"))
    import kvstate.scenarios

    monkeypatch.setattr(kvstate.scenarios, "run", stub("scenarios"))
    with _real_stubbed(monkeypatch), _minimize_stubbed(monkeypatch):
        yield


def _sane(value: Any) -> bool:
    """A value a command may go on with: finite numbers within 64 bits."""
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):
        return -(1 << 63) <= value < (1 << 63)
    if isinstance(value, (list, tuple)):
        return all(_sane(v) for v in value)
    return True


@settings(max_examples=examples(150), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_any_option_value_is_refused_naming_the_option_or_taken_within_bounds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        traces: dict[str, list[Any]], data: st.DataObject) -> None:
    parsers = _subparsers()
    command = data.draw(st.sampled_from([c for c in sorted(COMMANDS) if _options(parsers[c])]),
                        label="command")
    trace = tmp_path / "t.jsonl"
    trace.write_text(_text(traces["annotated"]))
    argv = [command, *[str(trace) if a == "TRACE" else a for a in COMMANDS[command]]]
    actions = _options(parsers[command])
    chosen = data.draw(st.lists(st.sampled_from(actions), min_size=1, max_size=3,
                                unique_by=id), label="options")
    named = []
    for action in chosen:
        choices = [str(c) for c in action.choices] if action.choices else []
        value = data.draw(st.one_of(st.sampled_from(HOSTILE_ARGS),
                                    st.sampled_from(choices or ["1"]),
                                    st.integers(-(1 << 70), 1 << 70).map(str),
                                    st.text(st.characters(exclude_characters="\x00"),
                                            max_size=8)), label=action.option_strings[-1])
        option = action.option_strings[-1]
        argv += [f"{option}={value}"]  # '=' so a value starting with '-' stays a value
        named.append((" ".join(action.option_strings), action.dest, value))
    monkeypatch.chdir(tmp_path)  # relative outputs (specs --write, --out-dir) land here
    with _work_stubbed(monkeypatch):
        code, out, err = run(capsys, [*argv, "--no-progress"]
                             if any("--no-progress" in a.option_strings
                                    for a in parsers[command]._actions) else argv)
    assert_clean(code, out, err)
    if code == 2:
        # argparse names the option ("argument --seed: ..."), the commands
        # their own checks ("--requests=..." or the dest, "options.requests").
        words = [w for option, dest, value in named
                 for w in (*option.split(), dest, dest.replace("_", "-"), value, repr(value))
                 if w.strip()]
        assert any(w in err for w in words) or "the following arguments" in err \
            or "unrecognized arguments" in err or "an empty path" in err, (argv, err[-1500:])
    if code == "reached":
        # What got through to the work holds no impossible number.
        args = build_parser().parse_args(argv)
        for option, dest, _ in named:
            assert _sane(getattr(args, dest, None)), (option, getattr(args, dest, None))


# --------------------------------------------------------------------------
# The model checker's checkpoint reader (`modelcheck --resume FILE`).


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("checkpoint") / "tiny.ckpt"
    assert main(["modelcheck", "--scope", "tiny", "--checkpoint", str(path), "--max-states",
                 "30", "--workers", "1", "--no-progress", "--json"]) in (0, 1)
    return path.read_bytes()


@settings(max_examples=examples(40), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_any_damaged_checkpoint_is_refused_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        checkpoint: bytes, data: st.DataObject) -> None:
    """Every change to a checkpoint's bytes is refused (its digest covers
    them all), naming the file; the intact one is resumed."""
    raw = bytearray(checkpoint)
    op = data.draw(st.sampled_from(["none", "flip", "flip_start", "cut", "append", "insert",
                                    "empty", "garbage", "other_pickle"]), label="op")
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    if op == "flip":
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    elif op == "flip_start":
        raw[at % 40] ^= 0x01
    elif op == "cut":
        raw = raw[:at]
    elif op == "append":
        raw += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    elif op == "insert":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=64), label="inserted")
    elif op == "empty":
        raw = bytearray()
    elif op == "garbage":
        raw = bytearray(data.draw(st.binary(max_size=4096), label="garbage"))
    elif op == "other_pickle":
        import pickle

        raw = bytearray(pickle.dumps(data.draw(st.sampled_from(
            [None, [1, 2], ("kvstate model-checker checkpoint", 999), {"a": 1}])), protocol=5))
    path = tmp_path / "resume.ckpt"
    path.write_bytes(bytes(raw))
    import sim.explore.modelcheck.search

    def reached(*args: Any, **kwargs: Any) -> Any:
        raise Reached("modelcheck.check")

    monkeypatch.setattr(sim.explore.modelcheck.search, "check", reached)
    code, out, err = run(capsys, ["modelcheck", "--resume", str(path), "--workers", "1",
                                  "--no-progress"])
    assert_clean(code, out, err)
    if bytes(raw) == checkpoint:
        assert code == "reached", err
    else:
        assert code == 2, (op, err)
        assert_names(err, path, line=False)


# --------------------------------------------------------------------------
# The connector's configuration (adapters/vllm/options.py): hostile strings
# and numbers in every field, the trace path included.

_CONNECTOR_FIELDS = ["kvstate_protocol", "kvstate_trace", "kvstate_trace_layer", "kvstate_monitor",
                     "kvstate_store_timeout", "kvstate_put_step", "kvstate_load_async",
                     "save_decode_cache", "enable_lookup", "cache_prefix"]


def _hostile_values() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(HOSTILE_TEXT),
        st.sampled_from(["/tmp/\x00x", "/tmp/\ud800.jsonl", "~" + "x" * 5000, "/proc/x/t",
                         "/dev/null", "/", "x" * 300, "a@b", "TRUE", " true ", "1"]),
        st.sampled_from([10 ** 400, -(10 ** 400), 1 << 64, -1, 0, 1e-300, 1e300, math.inf,
                         -math.inf, math.nan, 0.0009, 3600.0001, True, None, [], {}, [1, 2]]),
        st.text(max_size=8), st.integers(), st.floats())


@settings(max_examples=examples(200), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(extra=st.dictionaries(st.sampled_from(_CONNECTOR_FIELDS), _hostile_values(), max_size=4))
def test_hostile_connector_strings_and_numbers_are_refused_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]) -> None:
    from adapters.vllm.options import ConnectorOptions

    monkeypatch.chdir(tmp_path)
    try:
        options = ConnectorOptions.from_extra_config(extra)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith("kv_connector_extra_config"), message
        assert len(message) < 2000, len(message)  # a 10^400 or a 70,000-char value is cut
        return
    # What is taken can be used: text without NUL or lone surrogates (store
    # keys, file names), finite bounds.
    for text in (options.cache_prefix, options.protocol):
        assert "\x00" not in text
        text.encode("utf-8")
    if options.trace is not None:
        assert "\x00" not in options.trace
        os.fsencode(options.trace)  # a file name (bytes that are not UTF-8 included)
    assert 0.001 <= options.store_timeout <= 3600.0
    assert options.put_step is None or 1 <= options.put_step <= 1024


# --------------------------------------------------------------------------
# The Mooncake config file (MOONCAKE_CONFIG_PATH): the file's bytes.

_MOONCAKE = {"master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
             "local_hostname": "127.0.0.1", "protocol": "tcp", "device_name": "",
             "global_segment_size": "512MB", "local_buffer_size": 67108864, "mode": "embedded",
             "tenant_id": "t"}


@settings(max_examples=examples(200), deadline=DEADLINE, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_any_corrupted_mooncake_config_file_is_refused_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: st.DataObject) -> None:
    from adapters.mooncake import MAX_SIZE, MooncakeConfig

    records = data.draw(mutated_json([_MOONCAKE], at_most=2), label="config")
    text = "\n".join(dumps(r) for r in records)  # two documents when the line was duplicated
    if data.draw(st.booleans(), label="indent"):
        text = text.replace(",", ",\n  ")  # errors past line 1 name their line
    raw, op = data.draw(mutated_bytes(text.encode("utf-8", "surrogatepass")), label="bytes")
    path = tmp_path / "mooncake.json"
    path.write_bytes(raw)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    try:
        config = MooncakeConfig.from_env()
    except ValueError as exc:
        message = str(exc)
        assert message.startswith(str(path)), message
        assert len(message) < 2000, len(message)
        return
    for name in ("master_server_address", "metadata_server", "local_hostname", "device_name"):
        value = getattr(config, name)
        assert "\x00" not in value, (name, value)
        value.encode("ascii" if name == "master_server_address" else "utf-8")
    host, _, port = config.master_server_address.rpartition(":")
    assert port.isascii() and 1 <= int(port) <= 65535
    assert 0 <= config.global_segment_size <= MAX_SIZE
    assert 0 < config.local_buffer_size <= MAX_SIZE


# --------------------------------------------------------------------------
# What the properties (and a rerun of the probe) found, one example each:
# every one of these failed before its fix.

_RANK_RECORD_VALUES = [
    ("PutDone", "block_id", -1), ("PutDone", "chunk_id", 1 << 64),
    ("JobStarted", "token_len", -4), ("JobFinished", "generation", 10 ** 400),
    ("BlockAllocated", "block_id", 10 ** 400), ("BlockAllocated", "req_id", "a\x00b"),
    ("KeyEvicted", "key", "k\ud800"), ("StateWritten", "scope_generation", 1 << 62),
]


@pytest.mark.parametrize(("kind", "field", "value"), _RANK_RECORD_VALUES,
                         ids=[f"{k}.{f}" for k, f, _ in _RANK_RECORD_VALUES])
def test_an_impossible_value_in_a_ranks_record_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], traces: dict[str, list[Any]],
        kind: str, field: str, value: Any) -> None:
    lines = copy.deepcopy(traces["simulated"])
    n = next(i for i, line in enumerate(lines)
             if line.get("type") == kind and line.get(field) is not None)
    lines[n][field] = value
    path = tmp_path / "t.jsonl"
    path.write_text(_text(lines))
    for command in ("check", "replay"):
        code, out, err = run(capsys, [command, str(path)])
        assert code == 2, (command, out[-300:])
        assert f"{path}:{n + 1}: field '{field}'" in err, err


@pytest.mark.parametrize(("content", "message"), [
    (b'{"master_server_address": "h:1", "x": ' + b"9" * 5000 + b"}", "invalid JSON"),
    (b'{"master_server_address": "h:1", "master_server_address": "h:2"}', "appears twice"),
    ('{"master_server_address": "127.0.0.1:١٢"}'.encode(), "port in 1..65535"),
    ('{"master_server_address": "h:1", "global_segment_size": "١٢gb"}'.encode(),
     "expected a size"),
    (b'{"master_server_address": "h:1", "local_hostname": "a\\u0000b"}', "NUL"),
    (b'{"master_server_address": "h:1", "device_name": "\\ud800"}', "lone surrogate"),
])
def test_a_mooncake_config_the_rerun_found_is_refused_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes, message: str) -> None:
    from adapters.mooncake import MooncakeConfig

    path = tmp_path / "mc.json"
    path.write_bytes(content)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    with pytest.raises(ValueError, match=re.escape(str(path))) as caught:
        MooncakeConfig.from_env()
    assert message in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize(("extra", "message"), [
    ({"cache_prefix": "a\x00b"}, "NUL or lone surrogates"),
    ({"cache_prefix": "\ud800"}, "NUL or lone surrogates"),
    ({"kvstate_trace": "/tmp/a\x00b"}, "NUL character"),
    ({"kvstate_trace": "/tmp/\ud800.jsonl"}, "lone surrogate"),
    ({"kvstate_trace": "x" * 5000}, "too long"),
    ({"kvstate_monitor": "x" * 70_000}, "(70000 characters)"),
    ({"kvstate_store_timeout": 10 ** 400}, "(401 digits)"),
])
def test_connector_values_the_rerun_found_are_refused_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any],
        message: str) -> None:
    from adapters.vllm.options import ConnectorOptions

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as caught:
        ConnectorOptions.from_extra_config(extra)
    text = str(caught.value)
    assert text.startswith(f"kv_connector_extra_config[{next(iter(extra))!r}]=")
    assert message in text and len(text) < 300, text


@pytest.mark.parametrize("argv", [
    ["campaign", "--workers", str(1 << 63)], ["campaign", "--budget", "inf"],
    ["campaign", "--seed", str(1 << 63)], ["campaign", "--seed", str((1 << 63) - 2),
                                           "--seeds", "5"],
    ["fuzz", "--budget", "1e999"], ["modelcheck", "--max-states", str(10 ** 30)],
    ["modelcheck", "--workers", "100000"], ["modelcheck", "--checkpoint-every", "inf"],
    ["minimize", "--max-runs", str(10 ** 12)], ["bench", "--context", str(10 ** 12)],
    ["bench", "--world-size", "100000"], ["real", "--seed", str(1 << 63)],
    ["real", "--timeout", "1e-9"], ["real", "--repeats", str(10 ** 9)],
    ["real", "--fast25-path", "x.jsonl"],
])
def test_options_without_a_bound_before_are_refused(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        argv: list[str]) -> None:
    with _work_stubbed(monkeypatch):
        code, out, err = run(capsys, argv)
    assert code == 2, (argv, err)
    assert argv[-2] in err or argv[-2].lstrip("-").replace("-", "_") in err, err


def test_real_reads_its_workload_before_it_starts_a_master(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"timestamp": 0, "input_length": -5, "output_length": 1, '
                    '"hash_ids": []}\n')
    with _real_stubbed(monkeypatch):  # a master started would be "reached"
        code, out, err = run(capsys, ["real", "--workload", "fast25", "--fast25-path",
                                      str(path), "--no-progress"])
    assert code == 2 and f"{path}:1: field 'input_length'" in err, (code, err)


def test_python_311_argparse_quirks_reach_no_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11's argparse handed ``--root=--`` to the option as an empty
    list, past its type (a TypeError traceback in specs, a list as the
    seed), and refused ``kvstate bench`` with no part ("core sim") as
    "invalid choice: []"."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, ["specs", "--root=--"])
    assert code == 2 and "--root=--: no specs directory there" in err, err
    code, out, err = run(capsys, ["sim", "--seed=--"])
    assert code == 2 and "argument --seed: expected an integer, got '--'" in err, err
    with _work_stubbed(monkeypatch):
        code, out, err = run(capsys, ["bench", "--context", "64"])
    assert code == "reached", err


def _kvstate(*argv: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "sim.cli", *argv], capture_output=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})


def test_a_file_name_that_is_not_utf8_is_printed_not_a_traceback(tmp_path: Path) -> None:
    """Under a UTF-8 locale other than C.UTF-8 standard output is strict: a
    report naming a file whose name is not UTF-8 ended in UnicodeEncodeError
    after the check was done."""
    name = os.fsdecode(b"trace-\xff.jsonl")
    (tmp_path / name).write_bytes(SCENARIO.read_bytes())
    done = _kvstate("check", str(tmp_path / name), env={"PYTHONIOENCODING": "utf-8:strict"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"Traceback" not in done.stderr and b"trace-\\udcff.jsonl" in done.stdout


def test_a_fifo_given_to_resume_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = _kvstate("modelcheck", "--resume", str(fifo), timeout=60)
    assert done.returncode == 2 and b"not a regular file" in done.stderr, done.stderr


def test_a_workload_row_with_a_key_twice_is_refused_naming_line_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FAST'25 row's repeated key was read last-wins without a word."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 10, '
                    '"hash_ids": [1, 2]}\n{"timestamp": 5, "input_length": 600, '
                    '"input_length": 700, "output_length": 1, "hash_ids": [1, 2]}\n')
    code, out, err = run(capsys, ["sim", "--workload", "fast25", "--fast25-path", str(path),
                                  "--requests", "2", "--no-progress"])
    assert code == 2 and f"{path}:2: invalid JSON (the key 'input_length' appears twice" \
        in err, err
