"""The contract's own example, read the way an outside engineer reads it.

`specs/trace.md` ends with a complete trace (a TP-2 engine, `vllm-sha256`
hashes, job ids from 0) and gives a worked block-hash example. These tests
take both from the published file, not from `kvstate.contract`: the trace
must check clean with exactly the notes the contract predicts, one edited
field must break exactly the invariant the contract says it breaks, on the
line it names, and the worked hash must be what its own formula gives.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstate.contract import NEEDS
from sim.cli import main

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "trace.md"


def spec_example() -> list[dict[str, Any]]:
    (block,) = re.findall(r"```jsonl\n(.*?)```", SPEC.read_text(), re.S)
    return [json.loads(line) for line in block.splitlines()]


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str],
          lines: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """`kvstate check --json` on ``lines``."""
    path = tmp_path / "engine.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    capsys.readouterr()
    code = main(["check", str(path), "--json"])
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    return code, json.loads(captured.out)


def line_of(lines: list[dict[str, Any]], kind: str, **fields: Any) -> int:
    """The index in ``lines`` (its trace line number minus one) of the first
    ``kind`` record with ``fields``."""
    return next(n for n, line in enumerate(lines)
                if line.get("type") == kind and all(line.get(k) == v for k, v in fields.items()))


def test_the_spec_example_checks_clean_with_only_the_notes_the_contract_predicts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = spec_example()
    head = lines[0]
    assert head["block_hash"] == "vllm-sha256" and head["configs"][0]["world_size"] == 2
    assert [line for line in lines[1:] if "generation" in line] == []  # observed layer only
    code, out = check(tmp_path, capsys, lines)
    assert code == 0 and out["violations"] == [], out
    # Every note is an invariant the contract says an observed-only trace
    # leaves unjudged with a note.
    noted = {note.split()[0] for note in out["notes"]}
    assert noted == {"K1", "S18"}, out["notes"]
    assert all("(a note)" in NEEDS[inv][1] for inv in noted)


def test_the_spec_example_saves_from_job_0_on_both_ranks_and_publishes_a_chain() -> None:
    lines = spec_example()
    (save,) = lines[line_of(lines, "Planned")]["plan"]["saves"]
    assert save["job_id"] == 0 and save["token_len"] == 8 and save["num_prompt_tokens"] == 10
    for kind in ("JobStarted", "ExistsAnswered", "JobFinished"):
        assert {line["rank"] for line in lines if line.get("type") == kind} == {0, 1}
    assert {line["report"]["rank"] for line in lines if line.get("type") == "ReportDelivered"} \
        == {0, 1}
    first, second = lines[line_of(lines, "Settled")]["settlement"]["published"]
    assert first["parent_block_hash"] is None
    assert second["parent_block_hash"] == first["block_hashes"][0]


# One field of the example edited: the invariant the contract says it breaks,
# and the edit, which returns the index of the line the violation must name.
Edit = Callable[[list[dict[str, Any]]], int]


def _wrong_token(lines: list[dict[str, Any]]) -> int:
    n = line_of(lines, "JobFinished", rank=0)
    lines[n]["events"][1]["token_ids"][0] = 0
    return n


def _wrong_parent(lines: list[dict[str, Any]]) -> int:
    n = line_of(lines, "JobFinished", rank=1)
    lines[n]["events"][1]["parent_block_hash"] = None
    return n


def _silent_rank(lines: list[dict[str, Any]]) -> int:
    lines[line_of(lines, "JobFinished", rank=1)]["events"] = []
    return line_of(lines, "Settled")


def _refused_put_claimed(lines: list[dict[str, Any]]) -> int:
    puts = [n for n, line in enumerate(lines)
            if line.get("type") == "PutDone" and line["rank"] == 1]
    lines[puts[1]].update(code=-200, accepted=False)
    return line_of(lines, "JobFinished", rank=1)


def _child_first(lines: list[dict[str, Any]]) -> int:
    n = line_of(lines, "Settled")
    lines[n]["settlement"]["published"].reverse()
    return n


def _save_beyond_computed(lines: list[dict[str, Any]]) -> int:
    n = line_of(lines, "Planned")
    lines[n]["plan"]["saves"][0]["token_len"] = 12
    return n


BROKEN: dict[str, tuple[str, Edit]] = {
    "a token id an event announces that does not hash to its chunk": ("S17", _wrong_token),
    "an event whose parent is not the chunk's predecessor": ("S15", _wrong_parent),
    "a rank that announces nothing while the settlement publishes": ("S16", _silent_rank),
    "a put the store refused that the rank still counts as stored":
        ("K7", _refused_put_claimed),
    "a published child before its parent": ("K4", _child_first),
    "a save beyond the tokens the step computed": ("S7", _save_beyond_computed),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_one_edited_field_breaks_exactly_the_invariant_the_contract_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    invariant, edit = BROKEN[case]
    lines = spec_example()
    target = edit(lines)
    code, out = check(tmp_path, capsys, lines)
    assert code == 1, out
    assert {v["invariant"] for v in out["violations"]} == {invariant}, out["violations"]
    assert {v["line"] for v in out["violations"]} == {target + 1}, out["violations"]


def test_a_put_key_without_its_rank_namespace_is_s8_on_the_put(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 putting under rank 0's namespace: S8 on the put, and K7 on the
    verdict that claims the chunk its own namespace never received."""
    lines = spec_example()
    put = line_of(lines, "PutDone", rank=1)
    lines[put]["key"] = lines[put]["key"].replace("@tp_rank:1@", "@tp_rank:0@")
    code, out = check(tmp_path, capsys, lines)
    assert code == 1
    found = sorted((v["invariant"], v["line"]) for v in out["violations"])
    assert found == [("K7", line_of(lines, "JobFinished", rank=1) + 1), ("S8", put + 1)], found


def test_the_worked_hash_example_is_its_own_formula_and_names_the_example_chunk() -> None:
    text = SPEC.read_text()
    seed_pickle, none_hash = re.search(
        r'seed `"vllm-none-hash"` pickled: `([0-9a-f]+)`; its sha256, `NONE_HASH` \(the '
        r"header's `none_hash`\): `([0-9a-f]+)`", text).groups()
    tokens = json.loads(re.search(r"- tokens `(\[[0-9, ]+\])`", text).group(1))
    pickled = re.search(r"pickled:\n  `([0-9a-f]+)`", text).group(1)
    digest = re.search(r"the chunk's hash \(key suffix, `block_hashes`\): `([0-9a-f]+)`",
                       text).group(1)
    assert pickle.dumps("vllm-none-hash", protocol=5).hex() == seed_pickle
    assert hashlib.sha256(bytes.fromhex(seed_pickle)).hexdigest() == none_hash
    value = (bytes.fromhex(none_hash), tuple(tokens), None)
    assert pickle.dumps(value, protocol=5).hex() == pickled
    assert hashlib.sha256(bytes.fromhex(pickled)).hexdigest() == digest
    lines = spec_example()
    assert lines[0]["none_hash"] == none_hash
    new = lines[line_of(lines, "StepScheduled")]["step"]["new"][0]
    assert new["prompt_token_ids"][:len(tokens)] == tokens
    assert new["block_hashes"][0] == {"@hex": digest}
