"""The trace contract, judged on traces written by hand (never by the simulator).

Each fixture is what an engine's recorder could write: a header naming the
configs (and the block-hash function), then observations. The tests break one
thing at a time and require the checker to say so: order, identity and range
(exit 2 with file:line:field), the header's block-hash function (S17 recomputed
with it, or reported not checkable), malformed input of every class the probe
found (exit 2, never a traceback, in every command that reads traces), bounded
work from any header, and liveness where a trace simply ends.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import blockhash
from kvstate.keys import block_hash as kvstate_hash
from sim.cli import main

BS = 4
TOKENS = list(range(100, 108))  # two chunks of BS tokens
MODEL = "test-model"


def h(value: bytes) -> dict[str, str]:
    return {"@hex": value.hex()}


def vllm_chain(tokens: list[int], none_hash: bytes, cbor: bool = False) -> list[bytes]:
    fn = blockhash.vllm_sha256_cbor if cbor else blockhash.vllm_sha256
    out: list[bytes] = []
    for i in range(0, len(tokens), BS):
        out.append(fn((out[-1] if out else none_hash, tuple(tokens[i:i + BS]), None)))
    return out


def kvstate_chain(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(0, len(tokens), BS):
        out.append(kvstate_hash(out[-1] if out else None, tokens[i:i + BS]))
    return out


def key(rank: int, digest: bytes) -> str:
    return f"{MODEL}@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:0@{digest.hex()}"


def event(hashes: list[bytes], cid: int, tokens: list[int]) -> dict[str, Any]:
    return {"@": "BlockStored", "block_hashes": [h(hashes[cid])],
            "parent_block_hash": h(hashes[cid - 1]) if cid else None,
            "token_ids": tokens[cid * BS:(cid + 1) * BS], "block_size": BS}


def fixture(world: int = 2, events: bool = True, hashes: list[bytes] | None = None,
            tokens: list[int] = TOKENS, finish: bool = True, reporting: int | None = None,
            idle_steps: int = 0, **header: Any) -> list[dict[str, Any]]:
    """One request, one save job of two chunks on every rank, each rank's
    store calls and report, the settlement, then the request finishing.
    ``reporting``: only ranks below it report (the rest fell silent) and
    nothing is released; ``idle_steps``: empty scheduler steps at the end."""
    tokens = list(tokens)
    hashes = hashes if hashes is not None else kvstate_chain(tokens)
    chunks = len(tokens) // BS
    blocks = list(range(1, chunks + 1))
    head = {"kvstate_trace": 1, "protocol": "kvstate", "configs": [{
        "@": "ConnectorConfig", "block_size": BS, "world_size": world,
        "enable_kv_events": events}], **header}
    obs: list[dict[str, Any]] = []

    def add(kind: str, **fields: Any) -> None:
        obs.append({"type": kind, **fields})

    for b in blocks:
        add("BlockAllocated", block_id=b, req_id="a")
    add("Allocated", req_id="a", block_ids=[blocks], num_computed_tokens=0,
        num_external_tokens=0, load_async=False)
    add("StepScheduled", step={"@": "SchedulerStep", "new": [{
        "@": "NewRequest", "req_id": "a", "prompt_token_ids": tokens, "num_computed_tokens": 0,
        "num_scheduled_tokens": len(tokens), "block_ids": [blocks],
        "block_hashes": [h(x) for x in hashes]}]})
    add("Planned", plan={"@": "Plan", "step": 1, "saves": [{
        "@": "SaveMeta", "req_id": "a", "generation": 1, "job_id": 1, "token_ids_start": 0,
        "token_len": len(tokens), "num_prompt_tokens": len(tokens), "is_decode": False,
        "block_ids_start": 0, "block_ids": [blocks], "hashes_start": 0,
        "block_hashes": [h(x) for x in hashes], "token_ids": tokens if events else None}],
        "pins": blocks, "started": [{"@": "GenerationStart", "req_id": "a", "generation": 1,
                                     "reason": "new", "num_prompt_tokens": len(tokens)}]})
    for b, digest in zip(blocks, hashes):
        add("BlockWritten", block_id=b, content=digest.hex())
    evs = [event(hashes, c, tokens) for c in range(chunks)] if events else []
    for rank in range(world):
        keys = [key(rank, d) for d in hashes]
        add("JobStarted", rank=rank, job_id=1, req_id="a", generation=1, live=True,
            save_start=0, token_len=len(tokens), state_generation=1, retry_generation=None)
        add("ExistsAnswered", rank=rank, job_id=1, keys=keys, present=[False] * chunks)
        for c in range(chunks):
            add("PutDone", rank=rank, job_id=1, req_id="a", generation=1, key=keys[c],
                group=0, chunk_id=c, block_id=blocks[c],
                content=f"{hashes[c].hex()}|ns{rank}|g0", code=0, accepted=True)
        add("StateWritten", rank=rank, job_id=1, req_id="a", generation=1, field="offset",
            value=len(tokens), scope_generation=1)
        add("JobFinished", rank=rank, job_id=1, req_id="a", generation=1, outcome="stored",
            save_start=0, token_len=len(tokens), stored=[[0, c] for c in range(chunks)],
            failed=[], events=copy.deepcopy(evs))
    silent = reporting is not None
    for rank in range(world if reporting is None else reporting):
        add("ReportDelivered", report={
            "@": "Report", "job_id": 1, "rank": rank, "req_id": "a", "generation": 1,
            "outcome": {"@enum": "JobState", "value": "stored"}, "confirmed_offset": len(tokens),
            "events": copy.deepcopy(evs)})
    if not silent:
        add("Settled", settlement={"@": "Settlement", "releases": blocks[::-1],
                                   "released_jobs": [1], "published": copy.deepcopy(evs),
                                   "published_by": [["a", 1]] * len(evs)})
    step = 1
    if finish:
        step += 1
        add("StepScheduled", step={"@": "SchedulerStep", "finished": ["a"]})
        add("Planned", plan={"@": "Plan", "step": step, "finished": [["a", 1]],
                             "ended": [{"@": "GenerationEnd", "req_id": "a", "generation": 1,
                                        "reason": "finished"}]})
        if not silent:
            for b in blocks[::-1]:
                add("BlockFreed", block_id=b)
    for _ in range(idle_steps):
        step += 1
        add("StepScheduled", step={"@": "SchedulerStep"})
        add("Planned", plan={"@": "Plan", "step": step})
    lines: list[dict[str, Any]] = [head]
    for i, o in enumerate(obs):
        lines.append({"i": i, "e": 0, "t": float(i // 10), **o})
    return copy.deepcopy(lines)  # no list shared between lines (tests mutate them)


def write(path: Path, lines: list[Any]) -> Path:
    with open(path, "w") as out:
        for line in lines:
            out.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def run(capsys, *argv: str) -> tuple[int, Any, str]:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    try:
        out = json.loads(captured.out)
    except json.JSONDecodeError:
        out = captured.out
    return code, out, captured.err


def line_of(lines: list[dict[str, Any]], kind: str, nth: int = 0, **match: Any) -> int:
    """Index into ``lines`` (file line = index + 1) of the nth ``kind`` line."""
    found = [i for i, line in enumerate(lines) if line.get("type") == kind
             and all(line.get(k) == v for k, v in match.items())]
    return found[nth]


def test_the_hand_written_fixture_checks_clean(tmp_path: Path, capsys) -> None:
    for world in (1, 2):
        path = write(tmp_path / f"w{world}.jsonl", fixture(world=world))
        code, out, _ = run(capsys, "check", str(path))
        assert code == 0, out
        assert out["notes"] == []


# --------------------------------------------------------------------------
# Item 3: order, identity, range.


def _error(capsys, argv: list[str], where: str, field: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert f"{where}: field {field!r}" in err, err
    return err


@pytest.mark.parametrize("mutate, field, words", [
    (lambda ls, n: ls[n].update(i=ls[n - 1]["i"]), "i", "strictly increase"),
    (lambda ls, n: ls[n].update(i=ls[n - 1]["i"] - 1), "i", "strictly increase"),
    (lambda ls, n: ls[n].update(t=ls[n - 1]["t"] - 0.5), "t", "run backwards"),
])
def test_indexes_strictly_increase_and_time_never_runs_backwards(
        tmp_path: Path, capsys, mutate: Callable[..., None], field: str, words: str) -> None:
    lines = fixture()
    n = line_of(lines, "PutDone")
    lines[n - 1]["t"] = lines[n]["t"] = 3.0
    mutate(lines, n)
    path = write(tmp_path / "t.jsonl", lines)
    assert words in _error(capsys, ["check", str(path)], f"{path}:{n + 1}", field)


def test_plan_steps_never_run_backwards(tmp_path: Path, capsys) -> None:
    lines = fixture(idle_steps=2)
    n = line_of(lines, "Planned", 2)
    lines[n]["plan"]["step"] = 1
    path = write(tmp_path / "t.jsonl", lines)
    assert "steps must not run backwards" in _error(
        capsys, ["check", str(path)], f"{path}:{n + 1}", "plan.step")


@pytest.mark.parametrize("kind, field, value", [
    ("PutDone", "rank", 2), ("PutDone", "rank", -1), ("PutDone", "rank", 10 ** 30),
    ("JobStarted", "rank", 5), ("JobFinished", "rank", -3), ("ExistsAnswered", "rank", 2),
    ("StateWritten", "rank", 2), ("ReportDelivered", "report.rank", 2),
    ("ReportDelivered", "report.rank", -1), ("PutDone", "group", 1), ("PutDone", "chunk_id", -2),
])
def test_ranks_groups_and_chunks_within_the_header(tmp_path: Path, capsys, kind: str,
                                                    field: str, value: int) -> None:
    lines = fixture()
    n = line_of(lines, kind)
    target = lines[n]
    *parents, last = field.split(".")
    for p in parents:
        target = target[p]
    target[last] = value
    path = write(tmp_path / "t.jsonl", lines)
    err = _error(capsys, ["check", str(path)], f"{path}:{n + 1}", field)
    assert str(value) in err


@pytest.mark.parametrize("kind, field", [
    ("JobStarted", "job_id"), ("PutDone", "job_id"), ("ExistsAnswered", "job_id"),
    ("JobFinished", "job_id"), ("ReportDelivered", "report.job_id"),
    ("Settled", "settlement.released_jobs[0]"),
])
def test_jobs_are_known_before_use(tmp_path: Path, capsys, kind: str, field: str) -> None:
    lines = fixture()
    n = line_of(lines, kind)
    if kind == "ReportDelivered":
        lines[n]["report"]["job_id"] = 7
    elif kind == "Settled":
        lines[n]["settlement"]["released_jobs"] = [7]
    else:
        lines[n]["job_id"] = 7
    path = write(tmp_path / "t.jsonl", lines)
    assert "never emitted" in _error(capsys, ["check", str(path)], f"{path}:{n + 1}", field)


def test_a_rank_outside_the_world_is_refused_by_replay_too(tmp_path: Path, capsys) -> None:
    lines = fixture()
    n = line_of(lines, "JobStarted")
    lines[n]["rank"] = -1  # today: executors[-1], the last rank, silently
    path = write(tmp_path / "t.jsonl", lines)
    _error(capsys, ["replay", str(path)], f"{path}:{n + 1}", "rank")


# --------------------------------------------------------------------------
# Item 5: the header names the block-hash function.


CUSTOM_NONE = hashlib.sha256(b"engine ran with PYTHONHASHSEED=7").digest()
DEFAULT_NONE = blockhash.vllm_sha256(blockhash.VLLM_DEFAULT_NONE_HASH_SEED)


def test_vllm_sha256_hashes_check_with_the_named_function(tmp_path: Path, capsys) -> None:
    hashes = vllm_chain(TOKENS, CUSTOM_NONE)
    named = fixture(hashes=hashes, block_hash="vllm-sha256", none_hash=CUSTOM_NONE.hex())
    code, out, _ = run(capsys, "check", str(write(tmp_path / "v.jsonl", named)))
    assert code == 0 and out["notes"] == [], out
    # The same trace read as kvstate's hash is what the checker did before the
    # header could name the function: a false S17.
    unnamed = fixture(hashes=hashes)
    code, out, _ = run(capsys, "check", str(write(tmp_path / "k.jsonl", unnamed)))
    assert code == 1 and {v["invariant"] for v in out["violations"]} == {"S17"}


def test_s17_still_fires_under_vllm_sha256(tmp_path: Path, capsys) -> None:
    hashes = vllm_chain(TOKENS, CUSTOM_NONE)
    lines = fixture(hashes=hashes, block_hash="vllm-sha256", none_hash=CUSTOM_NONE.hex())
    n = line_of(lines, "JobFinished")
    lines[n]["events"][1]["token_ids"] = [0, 0, 0, 0]  # not the chunk's tokens
    code, out, _ = run(capsys, "check", str(write(tmp_path / "v.jsonl", lines)))
    assert code == 1 and [v["invariant"] for v in out["violations"]] == ["S17"]
    assert out["violations"][0]["line"] == n + 1


def test_vllm_default_none_hash_is_tried_and_an_unknown_one_is_not_a_violation(
        tmp_path: Path, capsys) -> None:
    default = fixture(hashes=vllm_chain(TOKENS, DEFAULT_NONE), block_hash="vllm-sha256")
    code, out, _ = run(capsys, "check", str(write(tmp_path / "d.jsonl", default)))
    assert code == 0 and out["notes"] == []
    custom = fixture(hashes=vllm_chain(TOKENS, CUSTOM_NONE), block_hash="vllm-sha256")
    code, out, _ = run(capsys, "check", str(write(tmp_path / "c.jsonl", custom)))
    assert code == 0, out
    assert any(n.startswith("S17 not checked") and "none_hash" in n for n in out["notes"])


def test_opaque_hashes_are_reported_not_checkable(tmp_path: Path, capsys) -> None:
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
    lines = fixture(hashes=hashes, block_hash="opaque")
    code, out, _ = run(capsys, "check", str(write(tmp_path / "o.jsonl", lines)))
    assert code == 0, out
    assert any("S17 not checked" in n and "opaque" in n for n in out["notes"])
    # The length of the token ids does not depend on the hash: still judged.
    lines[line_of(lines, "JobFinished")]["events"][0]["token_ids"] = [1, 2]
    code, out, _ = run(capsys, "check", str(write(tmp_path / "o2.jsonl", lines)))
    assert code == 1 and out["violations"][0]["invariant"] == "S17"


def test_sha256_cbor_is_recomputed_where_cbor2_imports(tmp_path: Path, capsys) -> None:
    pytest.importorskip("cbor2")
    hashes = vllm_chain(TOKENS, CUSTOM_NONE, cbor=True)
    lines = fixture(hashes=hashes, block_hash="vllm-sha256_cbor", none_hash=CUSTOM_NONE.hex())
    code, out, _ = run(capsys, "check", str(write(tmp_path / "c.jsonl", lines)))
    assert code == 0 and out["notes"] == [], out
    lines[line_of(lines, "JobFinished")]["events"][0]["token_ids"] = [9, 9, 9, 9]
    code, out, _ = run(capsys, "check", str(write(tmp_path / "c2.jsonl", lines)))
    assert code == 1 and out["violations"][0]["invariant"] == "S17"


def test_without_cbor2_sha256_cbor_is_not_checkable(monkeypatch) -> None:
    monkeypatch.setattr(blockhash, "_cbor_dumps", lambda: None)
    hasher = blockhash.BlockHasher(blockhash.VLLM_SHA256_CBOR)
    assert not hasher.checkable and "cbor2" in hasher.reason


def test_the_vllm_functions_match_vllms_own() -> None:
    """Same bytes as the installed vLLM's ``vllm/utils/hashing.py`` (loaded
    by path: importing the vllm package would pull in torch)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "hashing.py"
    module_spec = importlib.util.spec_from_file_location("_vllm_hashing", path)
    assert module_spec is not None and module_spec.loader is not None
    vllm_hashing = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(vllm_hashing)
    except ImportError as exc:
        pytest.skip(f"vllm's hashing module does not load here: {exc}")
    value = (CUSTOM_NONE, tuple(TOKENS[:BS]) + (70000, 2 ** 40), None)
    assert blockhash.vllm_sha256(value) == vllm_hashing.sha256(value)
    assert blockhash.vllm_sha256_cbor(value) == vllm_hashing.sha256_cbor(value)
    seed = blockhash.VLLM_DEFAULT_NONE_HASH_SEED
    assert blockhash.vllm_sha256(seed) == vllm_hashing.sha256(seed)
    assert hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest() == \
        blockhash.vllm_sha256(value)


@pytest.mark.parametrize("field, value", [
    ("block_hash", "md5"), ("block_hash", ["kvstate"]), ("none_hash", "zz"),
    ("none_hash", 12), ("liveness_steps", 0), ("liveness_steps", "many"),
    ("store", "Shared"), ("store", True),
])
def test_bad_hash_fields_in_the_header_exit_2(tmp_path: Path, capsys, field: str,
                                              value: Any) -> None:
    lines = fixture(**{field: value})
    path = write(tmp_path / "t.jsonl", lines)
    _error(capsys, ["check", str(path)], f"{path}:1", field)


def test_k1_skips_a_put_whose_content_was_not_observed(tmp_path: Path, capsys) -> None:
    lines = fixture()
    for n, line in enumerate(lines):
        if line.get("type") == "PutDone":
            lines[n]["content"] = ""
    code, out, _ = run(capsys, "check", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 0, out
    assert any(n.startswith("K1 not checked for 4 observations") for n in out["notes"])
    lines[line_of(lines, "PutDone")]["content"] = "somebody else's bytes"
    code, out, _ = run(capsys, "check", str(write(tmp_path / "t2.jsonl", lines)))
    assert code == 1 and [v["invariant"] for v in out["violations"]] == ["K1"]


# --------------------------------------------------------------------------
# Item 6: malformed input exits 2 with file:line:field, never a traceback.

TRACE_COMMANDS = (("check",), ("replay",), ("coverage",), ("diagram", "job", "--coverage"))


def _corrupt_line(kind: str) -> Callable[[list[Any]], tuple[int, str]]:
    """Corruptions of the first observation line (line 2), so every command
    reaches it before anything else could diverge."""
    def apply(lines: list[Any]) -> tuple[int, str]:
        if kind == "nested":
            lines[1] = '{"i": ' + "[" * 100_000 + "]" * 100_000 + "}"
            return 2, ""
        if kind == "digits":
            lines[1] = json.dumps(lines[1]).replace('"i": 0', '"i": ' + "7" * 5000)
            return 2, ""
        if kind == "nan":
            lines[1] = json.dumps(lines[1]).replace('"t": 0.0', '"t": NaN')
            return 2, ""
        if kind == "infinite":
            lines[1] = json.dumps(lines[1]).replace('"t": 0.0', '"t": 1e999')
            return 2, "t"
        raise AssertionError(kind)
    return apply


@pytest.mark.parametrize("command", TRACE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("kind", ["nested", "digits", "nan", "infinite"])
def test_malformed_lines_exit_2_in_every_command(tmp_path: Path, capsys, command, kind) -> None:
    lines: list[Any] = fixture()
    number, field = _corrupt_line(kind)(lines)
    path = write(tmp_path / "bad.jsonl", lines)
    code, _, err = run(capsys, *command, str(path))
    assert code == 2, err
    assert f"{path}:{number}:" in err and "Traceback" not in err
    if field:
        assert f"field {field!r}" in err


@pytest.mark.parametrize("command", TRACE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("protocol", [["kvstate"], "no-such-protocol", 7])
def test_header_protocol_of_the_wrong_type_or_unknown(tmp_path: Path, capsys, command,
                                                      protocol) -> None:
    path = write(tmp_path / "t.jsonl", fixture(protocol=protocol))
    code, out, err = run(capsys, *command, str(path))
    if command == ("check",) and isinstance(protocol, str):
        assert code == 0, out  # check needs no protocol: an engine's name for itself is fine
        return
    assert code == 2, (out, err)
    assert f"{path}:1: field 'protocol'" in err


def test_an_event_with_no_hash_exits_2(tmp_path: Path, capsys) -> None:
    lines = fixture()
    n = line_of(lines, "JobFinished")
    lines[n]["events"][0]["block_hashes"] = []
    path = write(tmp_path / "t.jsonl", lines)
    _error(capsys, ["check", str(path)], f"{path}:{n + 1}", "events[0].block_hashes")
    lines = fixture()
    n = line_of(lines, "Settled")
    lines[n]["settlement"]["published"][0]["block_hashes"] = []
    path = write(tmp_path / "s.jsonl", lines)
    _error(capsys, ["check", str(path)], f"{path}:{n + 1}",
           "settlement.published[0].block_hashes")


@pytest.mark.parametrize("foreign", ["just-a-key", "mooncake/other/0123abcd",
                                     "m@tp_rank:x@group:0@ab", "m@tp_rank:1@group:²@ab", ""])
def test_a_key_in_another_tools_format_is_judged_not_crashed(tmp_path: Path, capsys,
                                                              foreign: str) -> None:
    lines = fixture()
    for kind in ("PutDone", "ExistsAnswered"):
        n = line_of(lines, kind)
        if kind == "PutDone":
            lines[n]["key"] = foreign
        else:
            lines[n]["keys"][0] = foreign
    lines.insert(2, {"i": -1, "e": 0, "t": 0.0, "type": "KeyEvicted", "key": foreign})
    lines.insert(3, {"i": -0, "e": 0, "t": 0.0, "type": "LookupDone", "req_id": "z",
                     "generation": 1, "num_prompt_tokens": 8, "block_hashes": [],
                     "keys": [foreign], "present": [True], "hit_tokens": 4})
    for i, line in enumerate(lines[1:]):
        line["i"] = i
    code, out, err = run(capsys, "check", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 1, (out, err)  # S8: the key is not the one the chunk must have
    assert "S8" in {v["invariant"] for v in out["violations"]}
    assert any("K1 not checked" in n and "key format" in n for n in out["notes"])


def _sim_header(**options: Any) -> list[Any]:
    lines: list[Any] = fixture()
    lines[0]["options"] = {"requests": 2, "faults": [], "world_size": 1, **options}
    return lines


@pytest.mark.parametrize("options, field", [
    ({"requests": "two"}, "options.requests"), ({"requests": 10 ** 12}, "options.requests"),
    ({"faults": ["no-such-site"]}, "options.faults"), ({"faults": "put_fail"}, "options.faults"),
    ({"rate": -1}, "options.rate"), ({"rate": "fast"}, "options.rate"),
    ({"events": 1}, "options.events"), ({"protocol": ["e2"]}, "options.protocol"),
    ({"protocol": "e9"}, "options.protocol"), ({"setup": "tri"}, "options.setup"),
    ({"colour": "blue"}, "options.colour"), ({"world_size": 3, "put_step": 2}, "options"),
    ({"fast25_path": "/nonexistent/trace.jsonl"}, "options.fast25_path"),
    ({"world_size": 10 ** 6}, "options.world_size"),
])
def test_minimize_refuses_bad_header_options(tmp_path: Path, capsys, options, field) -> None:
    path = write(tmp_path / "t.jsonl", _sim_header(**options))
    code, _, err = run(capsys, "minimize", str(path), "--out", str(tmp_path / "min.jsonl"))
    assert code == 2, err
    assert f"{path}:1: field {field!r}" in err


def test_minimize_without_options_or_on_a_fifo_exits_2(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "t.jsonl", fixture())
    code, _, err = run(capsys, "minimize", str(path), "--out", str(tmp_path / "m.jsonl"))
    assert code == 2 and "field 'options'" in err


# --------------------------------------------------------------------------
# Item 6: a Hypothesis test over schema-valid and corrupted traces.


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                        st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                        st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=8), st.sampled_from(["@", "a@tp_rank:1@group:0@ff"]))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3),
        st.fixed_dictionaries({"@hex": st.text("0123456789abcdefg", max_size=6)}),
        st.fixed_dictionaries({"@": st.sampled_from(["BlockStored", "Report", "Nope"])})),
        max_leaves=6)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _valid_for(annotation: Any) -> st.SearchStrategy[Any]:
    """JSON values that decode as ``annotation``: schema-valid, semantically
    anything (small ints, so ranks, jobs and chunks often look plausible)."""
    import enum
    import types
    import typing

    import attrs

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_valid_for(a) for a in args])
    if annotation is type(None):
        return st.none()
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_valid_for(args[0]), max_size=3)
        return st.tuples(*[_valid_for(a) for a in args]).map(list)
    if annotation is bytes:
        return st.binary(max_size=16).map(h)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.one_of(st.integers(-1, 4), st.integers(-(2 ** 64), 2 ** 64))
    if annotation is float:
        return st.floats(0, 100)
    if annotation is str:
        return st.one_of(st.sampled_from(["a", "stored", "offset", "",
                                          key(0, bytes(16)), "a@tp_rank:9@group:7@zz"]),
                         st.text(max_size=6))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from([{"@enum": annotation.__name__, "value": m.value}
                                for m in annotation])
    if isinstance(annotation, type) and attrs.has(annotation):
        fields = {f.name: _valid_for(f.type) for f in attrs.fields(annotation)}
        return st.fixed_dictionaries(fields).map(lambda d: {"@": annotation.__name__, **d})
    return st.none()


def _valid_observation() -> st.SearchStrategy[dict[str, Any]]:
    import attrs

    from kvstate.trace import OBSERVATIONS

    def of(name: str, cls: type) -> st.SearchStrategy[dict[str, Any]]:
        fields = {f.name: _valid_for(f.type) for f in attrs.fields(cls)}
        return st.fixed_dictionaries(fields).map(lambda d: {"type": name, **d})
    return st.one_of([of(name, cls) for name, cls in sorted(OBSERVATIONS.items())])


@st.composite
def traces(draw: st.DrawFn) -> list[Any]:
    lines: list[Any] = fixture(world=draw(st.sampled_from([1, 2])),
                               events=draw(st.booleans()),
                               reporting=draw(st.sampled_from([None, 0, 1])),
                               idle_steps=draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["set", "delete", "swap", "duplicate", "text", "header",
                                   "valid", "valid"]))
        if op in ("set", "delete") and isinstance(lines[n], (dict, list)):
            paths = [p for p in _paths(lines[n]) if p]
            if not paths:
                continue
            where = draw(st.sampled_from(paths))
            parent = lines[n]
            for part in where[:-1]:
                parent = parent[part]
            if op == "set":
                parent[where[-1]] = draw(st.one_of(_json_values(), st.integers(-2, 5)))
            elif isinstance(parent, dict):
                del parent[where[-1]]
            else:
                parent.pop(where[-1])
        elif op == "swap" and n + 1 < len(lines):
            lines[n], lines[n + 1] = lines[n + 1], lines[n]
        elif op == "duplicate":
            lines.insert(n, copy.deepcopy(lines[n]))
        elif op == "text":
            lines[n] = draw(st.sampled_from(["", "{", "[]", "null", '{"type": "PutDone"}',
                                             '{"i": ' + "[" * 5000 + "]" * 5000 + "}"]))
        elif op == "valid" and n > 0:  # a schema-valid observation, in order
            lines.insert(n, {"i": 0, "e": 0, "t": 0.0, **draw(_valid_observation())})
            t = 0.0
            for i, line in enumerate(lines[1:]):
                if isinstance(line, dict):
                    line["i"] = i
                    t = line["t"] = max(t, line["t"]) if isinstance(line.get("t"), float) else t
        elif op == "header" and isinstance(lines[0], dict):
            lines[0][draw(st.sampled_from(["protocol", "block_hash", "none_hash",
                                           "liveness_steps", "configs", "store"]))] = \
                draw(_json_values())
    return lines


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(lines=traces())
def test_any_trace_exits_0_1_or_2_and_never_a_traceback(tmp_path: Path, capsys,
                                                        lines: list[Any]) -> None:
    path = write(tmp_path / "fuzzed.jsonl", lines)
    for command in TRACE_COMMANDS:
        code = main([*command, str(path), "--json"])
        err = capsys.readouterr().err
        assert code in (0, 1, 2)
        if code == 2:
            assert str(path) in err


# --------------------------------------------------------------------------
# Item 7: bounded work from any header; no reads that block.


@pytest.mark.parametrize("field, value", [
    ("world_size", 10 ** 30), ("world_size", 5000), ("block_size", 10 ** 9),
    ("alignment", 2 ** 40), ("pp_rank", 10 ** 12),
])
def test_absurd_header_sizes_are_refused_before_allocating(tmp_path: Path, capsys, field,
                                                           value) -> None:
    for command in (["check"], ["replay"]):
        lines = fixture()
        lines[0]["configs"][0][field] = value
        path = write(tmp_path / "t.jsonl", lines)
        err = _error(capsys, [*command, str(path)], f"{path}:1", f"configs[0].{field}")
        assert "maximum" in err


def test_too_many_groups_or_engines_are_refused(tmp_path: Path, capsys) -> None:
    lines = fixture()
    lines[0]["configs"][0]["groups"] = [{"@": "GroupSpec"}] * 65
    path = write(tmp_path / "g.jsonl", lines)
    _error(capsys, ["check", str(path)], f"{path}:1", "configs[0].groups")
    lines = fixture()
    lines[0]["configs"] = lines[0]["configs"] * 65
    path = write(tmp_path / "e.jsonl", lines)
    _error(capsys, ["check", str(path)], f"{path}:1", "configs")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("command", [*TRACE_COMMANDS, ("minimize",)], ids=lambda c: c[0])
def test_a_fifo_is_refused_instead_of_blocking(tmp_path: Path, capsys, command) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(main([*command, str(fifo)])),
                              daemon=True)
    worker.start()
    worker.join(60)  # generous: a loaded machine imports slowly; a blocked read never ends
    if worker.is_alive():  # unblock the reader so the test process can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail(f"kvstate {command[0]} blocked on a FIFO")
    assert result == [2]
    assert "FIFO" in capsys.readouterr().err


def test_a_directory_is_refused(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "check", str(tmp_path))
    assert code == 2 and "a directory" in err


# --------------------------------------------------------------------------
# Item 4: liveness where a trace simply ends (no Quiescent line).


def test_a_rank_that_stopped_reporting_is_named_with_the_age(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "t.jsonl", fixture(reporting=1, idle_steps=70))
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1, out
    by = {v["invariant"]: v["message"] for v in out["violations"]}
    assert set(by) == {"S4", "S6"}
    assert "rank 1 has not reported 1 job" in by["S4"] and "stopped reporting" in by["S4"]
    assert "age 71 steps" in by["S4"] and "last report was never" in by["S4"]
    assert "2 block(s) pinned" in by["S6"]
    # Younger than the bound: in flight, a note, not a finding.
    code, out, _ = run(capsys, "check", str(path), "--liveness-steps", "100")
    assert code == 0 and any("in flight at the end" in n for n in out["notes"]), out
    # The header may set the bound.
    path = write(tmp_path / "h.jsonl", fixture(reporting=1, idle_steps=70, liveness_steps=500))
    assert run(capsys, "check", str(path))[0] == 0


def test_a_trace_cut_mid_run_is_listed_not_judged(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "t.jsonl", fixture(reporting=1, idle_steps=70))
    code, out, _ = run(capsys, "check", str(path), "--at-end", "open")
    assert code == 0, out
    assert any(n.startswith("at the end (open, not judged)") and "rank 1" in n
               for n in out["notes"])


def test_a_job_every_rank_reported_but_nobody_released(tmp_path: Path, capsys) -> None:
    lines = fixture(idle_steps=70)
    settled = lines[line_of(lines, "Settled")]["settlement"]
    settled["released_jobs"] = []
    settled["releases"] = []
    for _ in range(2):
        lines.pop(line_of(lines, "BlockFreed"))
    for i, line in enumerate(lines[1:]):
        line["i"] = i
    code, out, _ = run(capsys, "check", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 1
    assert {v["invariant"] for v in out["violations"]} == {"S18", "S6"}
    # With no settlement at all, which jobs were released is not recorded:
    # S18 is a note (the pins still held remain S6).
    lines.pop(line_of(lines, "Settled"))
    for i, line in enumerate(lines[1:]):
        line["i"] = i
    code, out, _ = run(capsys, "check", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 1
    assert {v["invariant"] for v in out["violations"]} == {"S6"}
    assert any(n.startswith("S18 not checked") for n in out["notes"]), out["notes"]


# --------------------------------------------------------------------------
# Defaults: an annotation left out (kvstate's own bookkeeping and verdicts,
# which an engine's recorder need not write) is unknown, never read as its
# empty default and so as a violation.


def _renumber(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, line in enumerate(lines[1:]):
        line["i"], line["t"] = i, float(i // 10)
    return lines


def _check(tmp_path: Path, capsys, lines: list[Any], *argv: str) -> tuple[int, Any]:
    code, out, err = run(capsys, "check", str(write(tmp_path / "t.jsonl", lines)), *argv)
    assert code in (0, 1), err
    return code, out


def test_an_event_published_without_a_publisher_list_is_judged_from_the_announcements(
        tmp_path: Path, capsys) -> None:
    lines = fixture()
    del lines[line_of(lines, "Settled")]["settlement"]["published_by"]
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0 and out["notes"] == [], out
    # Left out, and really published without a quorum: still S16.
    n = line_of(lines, "JobFinished", rank=1)
    lines[n]["events"] = []
    code, out = _check(tmp_path, capsys, lines)
    assert code == 1 and {v["invariant"] for v in out["violations"]} == {"S16"}, out


def test_a_settlement_without_released_jobs_releases_what_every_rank_reported(
        tmp_path: Path, capsys) -> None:
    lines = fixture(idle_steps=70)
    del lines[line_of(lines, "Settled")]["settlement"]["released_jobs"]
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0, out
    assert any(n.startswith("S18 not checked") for n in out["notes"]), out["notes"]


def test_a_plan_without_started_or_ended_records_is_judged_from_the_scheduler_output(
        tmp_path: Path, capsys) -> None:
    lines = fixture(idle_steps=70)
    for line in lines:
        if line.get("type") == "Planned":
            line["plan"].pop("started", None)
            line["plan"].pop("ended", None)
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0 and out["notes"] == [], out
    # Still judged: a save beyond the computed tokens is S7 without ``started``.
    lines[line_of(lines, "StepScheduled")]["step"]["new"][0]["num_scheduled_tokens"] = BS
    code, out = _check(tmp_path, capsys, lines)
    assert "S7" in {v["invariant"] for v in out["violations"]}, out


def _skipped_job(lines: list[dict[str, Any]], **fields: Any) -> None:
    n = line_of(lines, "JobFinished", rank=0)
    lines[n].update(outcome="skipped", stored=[], events=[], **fields)


def test_a_skip_without_the_ranks_clock_is_not_judged_by_k6(tmp_path: Path, capsys) -> None:
    lines = fixture(events=False)
    _skipped_job(lines, skipped_since=-5.0)  # the rank's clock, whatever its epoch
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0, out
    assert any(n.startswith("K6 not checked") for n in out["notes"]), out["notes"]
    _skipped_job(lines, skipped_since=-5.0, now=-1.0)  # recorded: judged
    code, out = _check(tmp_path, capsys, lines)
    assert {v["invariant"] for v in out["violations"]} == {"K6"}, out


# --------------------------------------------------------------------------
# Nothing on trust: every verdict derived from the observations; where the
# recorder states its own (a plan's or a settlement's violations, the jobs a
# settlement released, the publishing generation) it is compared, not believed.


def _preempt_while_scheduled(lines: list[dict[str, Any]]) -> int:
    """Step 2 schedules request ``a`` (a decode token) and preempts it."""
    n = line_of(lines, "StepScheduled", 1)
    lines[n]["step"] = {"@": "SchedulerStep", "cached": [{
        "@": "CachedRequest", "req_id": "a", "num_computed_tokens": 8, "new_token_ids": [9],
        "new_block_ids": [[]]}], "preempted": ["a"]}
    return n


def test_a_plan_that_lists_no_violation_while_scheduling_a_preempted_request(
        tmp_path: Path, capsys) -> None:
    lines = fixture()
    n = _preempt_while_scheduled(lines)
    lines[n + 1]["plan"]["violations"] = []  # the recorder says: nothing wrong
    code, out = _check(tmp_path, capsys, lines)
    assert code == 1, out
    s23 = [v for v in out["violations"] if v["invariant"] == "S23"]
    assert s23 and "scheduled in the step that preempts it" in s23[0]["message"]
    assert s23[0]["line"] == n + 1
    assert any("does not list a violation the checker found" in x for x in out["notes"])
    # The plan may leave its list out: S23 all the same, no note about the list.
    del lines[n + 1]["plan"]["violations"]
    code, out = _check(tmp_path, capsys, lines)
    assert code == 1 and not any("does not list" in x for x in out["notes"]), out


def test_preempting_a_request_that_is_not_running_is_s23(tmp_path: Path, capsys) -> None:
    lines = fixture()
    n = line_of(lines, "StepScheduled", 1)
    lines[n]["step"] = {"@": "SchedulerStep", "finished": ["a"], "preempted": ["ghost"]}
    code, out = _check(tmp_path, capsys, lines)
    assert code == 1 and {v["invariant"] for v in out["violations"]} == {"S23"}, out
    assert "'ghost'" in out["violations"][0]["message"]


def test_a_violation_a_plan_lists_but_the_observations_do_not_show_is_a_note(
        tmp_path: Path, capsys) -> None:
    lines = fixture()
    n = line_of(lines, "Planned", 1)
    lines[n]["plan"]["violations"] = [{"@": "Violation", "invariant": "S23",
                                       "message": "request 'a' is scheduled in step 2"}]
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0, out
    assert any(x.startswith("S23: the recorder's plan lists a violation the observations "
                            "do not show") for x in out["notes"]), out["notes"]


def test_a_settlement_releasing_a_job_before_every_rank_reported(tmp_path: Path,
                                                                 capsys) -> None:
    lines = fixture()
    late = lines.pop(line_of(lines, "ReportDelivered", 1))  # rank 1 reports after it
    lines.insert(line_of(lines, "Settled") + 1, late)
    code, out = _check(tmp_path, capsys, _renumber(lines))
    assert code == 1, out
    (s4,) = [v for v in out["violations"] if v["invariant"] == "S4"]
    assert "releases job 1 before ranks [1] reported it" in s4["message"]


def test_a_settlement_omitting_a_job_every_rank_reported(tmp_path: Path, capsys) -> None:
    lines = fixture()
    n = line_of(lines, "Settled")
    lines[n]["settlement"]["released_jobs"] = []
    code, out = _check(tmp_path, capsys, lines)
    assert code == 1, out
    (s18,) = out["violations"]
    assert s18["invariant"] == "S18" and s18["line"] == n + 1
    assert "does not release it" in s18["message"]
    # Released in a later settlement: the omission is reported once.
    late = copy.deepcopy(lines[n])
    late["settlement"] = {"@": "Settlement", "released_jobs": [1]}
    lines.insert(n + 1, late)
    code, out = _check(tmp_path, capsys, _renumber(lines))
    assert [v["invariant"] for v in out["violations"]] == ["S18"], out


def test_a_report_after_every_rank_reported_is_s4(tmp_path: Path, capsys) -> None:
    lines = fixture()
    again = copy.deepcopy(lines[line_of(lines, "ReportDelivered", 0)])
    lines.insert(line_of(lines, "Settled") + 1, again)
    code, out = _check(tmp_path, capsys, _renumber(lines))
    assert code == 1 and {v["invariant"] for v in out["violations"]} == {"S4"}, out
    assert "not outstanding" in out["violations"][0]["message"]


def test_a_settlement_listing_a_violation_the_reports_do_not_show_is_a_note(
        tmp_path: Path, capsys) -> None:
    lines = fixture()
    lines[line_of(lines, "Settled")]["settlement"]["violations"] = [{
        "@": "Violation", "invariant": "S4", "message": "rank 1 reported job 1 twice"}]
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0 and any(x.startswith("S4: the recorder's settlement lists") for x in
                             out["notes"]), out


def test_a_publishing_generation_the_recorder_misnames_is_a_note(tmp_path: Path,
                                                                 capsys) -> None:
    lines = fixture()
    lines[line_of(lines, "Settled")]["settlement"]["published_by"] = [["zz", 9]] * 2
    code, out = _check(tmp_path, capsys, lines)
    assert code == 0, out
    assert any("published_by names a generation" in x for x in out["notes"]), out["notes"]


def test_a_report_from_a_rank_outside_the_world_is_s4_in_the_monitor() -> None:
    """The trace reader refuses such a line (exit 2); the monitor, which the
    simulator and the vLLM connector feed directly, judges it itself."""
    from kvstate.config import ConnectorConfig
    from kvstate.invariants import Monitor
    from kvstate.observations import ReportDelivered
    from kvstate.records import Report
    from kvstate.tables import JobState

    monitor = Monitor(ConnectorConfig(block_size=BS, world_size=2))
    monitor.observe(ReportDelivered(Report(1, 7, "a", 1, JobState.STORED, 0)))
    assert monitor.fired() == {"S4"} and "rank 7" in monitor.findings[0].message


# --------------------------------------------------------------------------
# Speed without loss: the fast decoder (msgspec, where installed) accepts what
# the checked decoder accepts and yields the same values; what it refuses the
# checked decoder judges (the reader falls back line by line).


def _plain(value: Any) -> Any:
    import enum

    import attrs

    kind = type(value)
    if attrs.has(kind):
        return (kind.__name__, {f.name: _plain(getattr(value, f.name))
                                for f in attrs.fields(kind)})
    if isinstance(value, enum.Enum):
        return ("enum", kind.__name__, value.value)
    fields = getattr(kind, "__struct_fields__", None)
    if fields is not None:
        if fields == ("value",):
            return ("enum", kind.__name__, value.value)
        return (kind.__name__, {f: _plain(getattr(value, f)) for f in fields
                                if f not in ("i", "e", "t")})
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return (kind.__name__, value)


@st.composite
def _observation_lines(draw: st.DrawFn) -> str:
    line: dict[str, Any] = {"i": 0, "e": 0, "t": 1.0, **draw(_valid_observation())}
    for _ in range(draw(st.integers(0, 2))):
        paths = [p for p in _paths(line) if p]
        where = draw(st.sampled_from(paths))
        parent: Any = line
        for part in where[:-1]:
            parent = parent[part]
        if draw(st.booleans()):
            parent[where[-1]] = draw(_json_values())
        elif isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent.pop(where[-1])
    return json.dumps(line)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("msgspec") is None, reason="msgspec not installed")
@settings(max_examples=400, deadline=None)
@given(text=_observation_lines())
def test_the_fast_decoder_accepts_only_what_the_checked_decoder_accepts(text: str) -> None:
    from kvstate.trace import TraceError, decode_line_absent, fast_codec

    codec = fast_codec()
    assert codec is not None
    try:
        fast = codec.decoder.decode(text.encode())
    except Exception:
        return  # refused: the reader decodes the line again with the checked decoder
    kind = type(fast).__name__
    absent = codec.fill(kind, fast) if kind in codec.defaults else frozenset()
    try:
        index, engine, when, obs, slow_absent = decode_line_absent(text, "t:2")
    except TraceError as exc:
        raise AssertionError(f"fast path accepted what the checked decoder refuses: {exc}") \
            from None
    assert (fast.i, fast.e, fast.t) == (index, engine, when)
    assert _plain(fast) == _plain(obs)
    assert absent == slow_absent


def test_check_reads_the_same_with_and_without_the_fast_decoder(tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    from kvstate.trace import fast as fast_path

    lines = fixture(idle_steps=3)
    del lines[line_of(lines, "Settled")]["settlement"]["published_by"]
    lines.append({"i": 10 ** 30, "e": 0, "t": 1e300, "type": "KeyEvicted", "key": "k"})
    path = write(tmp_path / "t.jsonl", lines)
    fast = run(capsys, "check", str(path))
    monkeypatch.setattr(fast_path, "_FAST", [None])
    slow = run(capsys, "check", str(path))
    assert fast[0] == slow[0] == 0
    for key in ("violations", "notes", "observations"):
        assert fast[1][key] == slow[1][key]


def test_bench_check_reports_every_parser_and_the_ratios(tmp_path: Path) -> None:
    from sim.bench.check import bench_check

    figures = bench_check(path=str(write(tmp_path / "t.jsonl", fixture())), repeats=1)
    assert figures["check_ok"] and figures["lines"] == len(fixture()) - 1
    assert figures["json.loads lines/s"] > 0 and figures["kvstate check lines/s"] > 0
    assert figures["ratio check / fastest bare parse"] > 0


@pytest.mark.parametrize("world, events", [(1, True), (2, True), (2, False)])
def test_the_fixture_replays_identically_with_its_annotations_left_out(
        tmp_path: Path, capsys, world: int, events: bool) -> None:
    """Replay compares what a line records: an annotation it leaves out (a
    plan's generation records and verdicts, a settlement's released jobs and
    publishers, a skip's clock) is not compared with the model's."""
    lines = fixture(world=world, events=events)
    code, out, err = run(capsys, "replay", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 0 and out["ok"], (out, err)
    for line in lines:
        record = line.get("plan") or line.get("settlement") or {}
        for name in ("started", "ended", "violations", "released_jobs", "published_by",
                     "dropped_events"):
            record.pop(name, None)
        if line.get("type") == "JobFinished":
            line.pop("now", None)
    code, out, err = run(capsys, "replay", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 0 and out["ok"], (out, err)
    assert run(capsys, "check", str(tmp_path / "t.jsonl"))[0] == 0


# --------------------------------------------------------------------------
# A connector's bookkeeping bugs, as an outside reviewer wrote them by hand.


def _renumbered(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, line in enumerate(lines[1:]):
        line["i"] = i
    return lines


@pytest.mark.parametrize("layer", ["annotated", "observed"])
def test_a_rank_reporting_twice_is_s4_whether_or_not_generations_are_written(
        tmp_path: Path, capsys, layer: str) -> None:
    # The observed layer used to refuse the trace (exit 2: the job's
    # generation "cannot be derived", since every rank had reported it)
    # where the annotated one found the bug.
    lines = fixture()
    n = line_of(lines, "ReportDelivered", 1)
    lines.insert(line_of(lines, "Settled") + 1, copy.deepcopy(lines[n]))
    path = write(tmp_path / "t.jsonl", _renumbered(lines))
    if layer == "observed":
        assert main(["trace", "observed", str(path), "-o", str(tmp_path / "o.jsonl")]) == 0
        capsys.readouterr()
        path = tmp_path / "o.jsonl"
    code, out, err = run(capsys, "check", str(path))
    assert code == 1, (out, err)
    assert [v["invariant"] for v in out["violations"]] == ["S4"], out["violations"]
    assert "reported job 1, which is not outstanding" in out["violations"][0]["message"]


def test_a_refused_put_the_rank_reports_as_stored_is_k7(tmp_path: Path, capsys) -> None:
    lines = fixture()
    put = line_of(lines, "PutDone", 1, rank=1)
    lines[put].update(code=-200, accepted=False)
    code, out, _ = run(capsys, "check", str(write(tmp_path / "t.jsonl", lines)))
    assert code == 1
    k7 = [v for v in out["violations"] if v["invariant"] == "K7"]
    assert len(k7) == 1 and k7[0]["message"].startswith(
        "rank 1 job 1 reports chunk 1 of group 0 stored, but no put of"), k7
    assert k7[0]["event_index"] == line_of(lines, "JobFinished", rank=1) - 1


# --- Issue 32, class 6: impossible values are refused, not read as a valid trace.

def _sim_trace(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "sim.jsonl"
    assert main(["sim", "--requests", "30", "--faults", "none", "--trace", str(path)]) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def _first(lines: list[dict[str, Any]], kind: str,
           where: Callable[[dict[str, Any]], bool] = lambda d: True) -> dict[str, Any]:
    return next(d for d in lines[1:] if d.get("type") == kind and where(d))


def _new_request(d: dict[str, Any]) -> bool:
    return bool(d["step"]["new"])


IMPOSSIBLE: dict[str, tuple[Callable[[list[dict[str, Any]]], None], list[str]]] = {
    "negative block id": (
        lambda ls: _first(ls, "Allocated").update(block_ids=[[-1]]), ["block_ids", "-1"]),
    "block id of 2^64": (
        lambda ls: _first(ls, "Planned", lambda d: bool(d["plan"]["pins"]))["plan"].update(
            pins=[1 << 64]), ["plan.pins", str(1 << 64)]),
    "block id of 10^400": (
        lambda ls: _first(ls, "Allocated").update(block_ids=[[10 ** 400]]), ["block_ids"]),
    "negative computed tokens": (
        lambda ls: _first(ls, "StepScheduled", _new_request)["step"]["new"][0].update(
            num_computed_tokens=-5), ["num_computed_tokens", "-5"]),
    "negative prompt length": (
        lambda ls: _first(ls, "LookupDone").update(num_prompt_tokens=-3),
        ["num_prompt_tokens"]),
    "negative hit": (
        lambda ls: _first(ls, "LookupDone").update(hit_tokens=-1), ["hit_tokens"]),
    "negative token length": (
        lambda ls: _first(ls, "Planned", lambda d: bool(d["plan"]["saves"]))["plan"]["saves"][0]
        .update(token_len=-4), ["saves[0].token_len"]),
    "generation of 10^400": (
        lambda ls: _first(ls, "LookupDone").update(generation=10 ** 400), ["generation"]),
    "NUL in a request id": (
        lambda ls: _first(ls, "StepScheduled", _new_request)["step"]["new"][0].update(
            req_id="a\x00b"), ["req_id", "NUL"]),
    "lone surrogate in a request id": (
        lambda ls: _first(ls, "LookupDone").update(req_id="a\ud800"), ["req_id", "surrogate"]),
    "more engine names than configs": (
        lambda ls: ls[0].update(engines=["kv_both", "kv_both"]), ["engines"]),
    "a backoff of 1e18": (
        lambda ls: ls[0]["configs"][0].update(pressure_backoff=1e18), ["pressure_backoff"]),
    "negative requests in the options": (
        lambda ls: ls[0]["options"].update(requests=-5), ["options.requests"]),
    "a string world size in the options": (
        lambda ls: ls[0]["options"].update(world_size="x"), ["options.world_size"]),
    "an unknown fault in the options": (
        lambda ls: ls[0]["options"].update(faults=["nuke"]), ["options.faults", "nuke"]),
    "an unknown protocol in the options": (
        lambda ls: ls[0]["options"].update(protocol="nope"), ["options.protocol"]),
    "a string seed in the options": (
        lambda ls: ls[0]["options"].update(seed="7"), ["options.seed"]),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
@pytest.mark.parametrize("command", ["check", "replay"])
def test_an_impossible_value_is_refused_naming_line_and_field(tmp_path: Path, capsys,
                                                              case: str, command: str) -> None:
    """`check` (the fast decoder) and `replay` (the plain one) read each of
    these as a valid trace before (exit 0, "identical"); now exit 2 naming
    the line and the field."""
    lines = _sim_trace(tmp_path)
    mutate, words = IMPOSSIBLE[case]
    mutate(lines)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    capsys.readouterr()
    assert main([command, str(path)]) == 2, case
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}:" in err
    for word in words:
        assert word in err, (word, err)


def test_a_key_repeated_in_the_header_is_refused(tmp_path: Path, capsys) -> None:
    """JSON leaves repeated keys to the reader; Python's took the last, so a
    header with `kvstate_trace` 1 and then 2 was read as version 2."""
    lines = _sim_trace(tmp_path)
    header = json.dumps(lines[0])
    path = tmp_path / "dup.jsonl"
    path.write_text(header[:-1] + ', "store": "private", "store": "shared"}\n'
                    + "".join(json.dumps(d) + "\n" for d in lines[1:]))
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    assert "'store' appears twice" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Issue 27, item 1: the contract's tables say everything an outside producer
# needs, and say it of the code as it is.


def test_the_published_contract_is_the_one_the_code_renders() -> None:
    from kvstate.contract import render_markdown

    spec = Path(__file__).resolve().parent.parent / "specs" / "trace.md"
    assert spec.read_text() == render_markdown(), "stale: run `kvstate specs --write`"


def test_every_invariant_and_every_config_field_is_described() -> None:
    import attrs

    from kvstate.config import ConnectorConfig
    from kvstate.contract import CONFIG_FIELDS, NEEDS
    from kvstate.invariants import CATALOGUE

    assert list(NEEDS) == [inv.id for inv in CATALOGUE]
    assert list(CONFIG_FIELDS) == [f.name for f in attrs.fields(ConnectorConfig)]


def test_every_field_rule_names_a_field_that_exists() -> None:
    import attrs

    from kvstate.contract import FIELD_RULES
    from kvstate.trace import RECORDS

    every = {f.name for cls in RECORDS.values() for f in attrs.fields(cls)} | {"t"}
    for names, _ in FIELD_RULES:
        for part in names.split("; "):
            record, _, fields = part.partition(".")
            if record == "*":
                assert fields in every, part
                continue
            if not fields:  # whole records
                assert all(name in RECORDS for name in part.split(", ")), part
                continue
            own = {f.name for f in attrs.fields(RECORDS[record])}
            assert set(fields.split(", ")) <= own, part


def test_the_default_liveness_bound_is_the_checkers() -> None:
    import inspect

    from kvstate.contract import DEFAULT_LIVENESS_STEPS
    from kvstate.invariants import Monitor
    from sim.traces.check import DEFAULT_LIVENESS_STEPS as CHECK_DEFAULT

    finish = inspect.signature(Monitor.finish).parameters["liveness_steps"].default
    assert DEFAULT_LIVENESS_STEPS == CHECK_DEFAULT == finish


def _needs(kind: str) -> list[str]:
    """Invariants by what `NEEDS` says of them: ``"annotations"``, judged
    only with them; ``"observed"``, judged from the observed layer alone.
    Those whose breaker is a synthetic fault have no scenario to run."""
    from kvstate.contract import NEEDS
    from kvstate.invariants import INVARIANTS

    out = []
    for inv, (reads, needs, _) in NEEDS.items():
        if INVARIANTS[inv].scenario == "synthetic":
            continue
        if kind == "annotations" and reads == "-":
            out.append(inv)
        elif kind == "observed" and needs == "-":
            out.append(inv)
    return out


def _fired(tmp_path: Path, invariant: str) -> tuple[set[str], set[str]]:
    """What the invariant's catalogue breaker fires in its scenario: the
    annotated trace, and the trace cut to its observed layer (judged with a
    liveness bound of one step, so a short trace's end counts)."""
    from kvstate.invariants import INVARIANTS
    from kvstate.scenarios import run as run_scenario
    from sim.traces.check import check_trace
    from sim.traces.observed import write_observed

    inv = INVARIANTS[invariant]
    full = tmp_path / "full.jsonl"
    full.write_text(run_scenario(inv.scenario, inv.broken_by).trace_text(scenario=inv.scenario))
    observed = tmp_path / "observed.jsonl"
    with observed.open("w") as out:
        write_observed(full, out)
    return ({f.invariant for _, _, f in check_trace(full, liveness_steps=1).findings},
            {f.invariant for _, _, f in check_trace(observed, liveness_steps=1).findings})


@pytest.mark.parametrize("invariant", _needs("annotations"))
def test_what_the_contract_says_needs_annotations_is_not_judged_without(
        tmp_path: Path, invariant: str) -> None:
    annotated, observed = _fired(tmp_path, invariant)
    assert invariant in annotated and invariant not in observed, (annotated, observed)


@pytest.mark.parametrize("invariant", _needs("observed"))
def test_what_the_contract_says_the_observed_layer_judges_fires_from_it(
        tmp_path: Path, invariant: str) -> None:
    annotated, observed = _fired(tmp_path, invariant)
    assert invariant in observed, (annotated, observed)
