"""Replay of traces that kvstate did not write (issue 27, item 2).

An engine's own recorder encodes the same run differently from kvstate:
vLLM's connector numbers its store jobs from 0, ships every job the whole
block table, lists released blocks in its own order. Each scenario takes a
trace kvstate recorded, rewrites it the way such a producer would, and
replays it: the encoding alone must not diverge (specs/replay.md lists the
normalisations), while a real difference in what the protocol decides still
does, in words that name the decision.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from sim.cli import main
from sim.simulator.runner import SimOptions, simulate
from sim.traces.observed import write_observed
from sim.traces.replay import replay_trace

Lines = list[dict[str, Any]]
RUN = SimOptions(requests=20, faults=())  # preemptions, decode saves, failed puts

# Records that name a store job by its id, on a rank.
RANK_JOB_RECORDS = ("JobStarted", "StateWritten", "JobFinished", "ExistsAnswered", "PutDone",
                    "StoreCallRaised")


def kvstate_trace(tmp_path: Path, options: SimOptions = RUN) -> Lines:
    path = tmp_path / "kvstate.jsonl"
    with path.open("w") as out:
        simulate(options, trace=out)
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Lines:
    return kvstate_trace(tmp_path_factory.mktemp("recorded"))


@pytest.fixture
def lines(recorded: Lines) -> Lines:
    return copy.deepcopy(recorded)


def write(path: Path, lines: Lines) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def records(lines: Lines, kind: str) -> list[dict[str, Any]]:
    return [line for line in lines[1:] if line["type"] == kind]


# --------------------------------------------------------------------------
# How an outside producer encodes the same run.


def jobs_renumbered(lines: Lines, number: Callable[[int], int]) -> Lines:
    """Every job id written through ``number`` (plans, rank records, reports,
    settlements)."""
    for line in lines[1:]:
        kind = line["type"]
        if kind == "Planned":
            for save in line["plan"]["saves"]:
                save["job_id"] = number(save["job_id"])
        elif kind in RANK_JOB_RECORDS:
            line["job_id"] = number(line["job_id"])
        elif kind == "ReportDelivered":
            line["report"]["job_id"] = number(line["report"]["job_id"])
        elif kind == "Settled" and "released_jobs" in line["settlement"]:
            line["settlement"]["released_jobs"] = [
                number(j) for j in line["settlement"]["released_jobs"]]
    return lines


def whole_tables(lines: Lines) -> Lines:
    """Every job ships its generation's whole block table and hash chain from
    position 0, as upstream's connector does, instead of the slice new since
    the generation's previous job."""
    sliced = 0
    known: dict[tuple[str, int], tuple[list[list[int]], list[Any]]] = {}
    for plan in (line["plan"] for line in records(lines, "Planned")):
        for save in plan["saves"]:
            blocks, hashes = known.setdefault((save["req_id"], save["generation"]),
                                              ([[] for _ in save["block_ids"]], []))
            sliced += save["block_ids_start"] > 0
            for table, new in zip(blocks, save["block_ids"]):
                table[save["block_ids_start"]:] = new
            hashes[save["hashes_start"]:] = save["block_hashes"]
            save.update(block_ids_start=0, block_ids=[list(t) for t in blocks],
                        hashes_start=0, block_hashes=list(hashes))
    assert sliced, "no job shipped a slice: the scenario shows nothing"
    return lines


def releases_reversed(lines: Lines) -> Lines:
    """Pins and releases listed in the opposite order."""
    reordered = 0
    for line in lines[1:]:
        holder = line.get("plan") or line.get("settlement") or {}
        for name in ("pins", "releases"):
            if len(set(holder.get(name, ()))) > 1:
                holder[name] = holder[name][::-1]
                reordered += 1
    assert reordered
    return lines


def without_protocol(lines: Lines) -> Lines:
    del lines[0]["protocol"]  # an engine's recorder may not know it
    return lines


def steps_from_0(lines: Lines) -> Lines:
    for line in records(lines, "Planned"):
        line["plan"]["step"] -= 1
    return lines


def upstream_encoded(lines: Lines) -> Lines:
    """All of it at once: vLLM's job numbering, whole tables, its own order
    of releases, steps counted from 0, no protocol in the header."""
    return without_protocol(steps_from_0(releases_reversed(whole_tables(jobs_renumbered(
        lines, lambda job: job - 1)))))


# --------------------------------------------------------------------------
# The encoding alone does not diverge.


@pytest.mark.parametrize("number", [lambda job: job - 1, lambda job: 1000 + 7 * job],
                         ids=["from-0", "from-1007-with-gaps"])
def test_jobs_numbered_from_any_start_replay(tmp_path: Path, lines: Lines,
                                             number: Callable[[int], int]) -> None:
    """vLLM numbers store jobs from 0, kvstate from 1; any strictly increasing
    numbering names the same jobs in the same order."""
    path = write(tmp_path / "t.jsonl", jobs_renumbered(lines, number))
    result = replay_trace(path)
    assert result.ok, result.divergence


def test_plan_steps_counted_by_the_engine_replay(tmp_path: Path, lines: Lines) -> None:
    """An engine may number its steps from 0, or count scheduler steps the
    connector planned nothing in; the step number labels a plan, nothing
    more."""
    for line in records(lines, "Planned"):
        line["plan"]["step"] = 2 * line["plan"]["step"] - 2
    result = replay_trace(write(tmp_path / "t.jsonl", lines))
    assert result.ok, result.divergence


def test_whole_block_tables_replay_against_the_protocol_that_ships_slices(
        tmp_path: Path, lines: Lines) -> None:
    """A job with the whole table from 0 covers the same blocks as kvstate's
    slice applied to what the generation's earlier jobs shipped."""
    path = write(tmp_path / "t.jsonl", without_protocol(whole_tables(lines)))
    result = replay_trace(path, protocol="kvstate")
    assert result.ok, result.divergence


def test_pins_and_releases_in_another_order_replay(tmp_path: Path, lines: Lines) -> None:
    path = write(tmp_path / "t.jsonl", releases_reversed(lines))
    result = replay_trace(path)
    assert result.ok, result.divergence


def test_a_plan_listing_its_jobs_out_of_id_order_replays(tmp_path: Path, lines: Lines) -> None:
    """The saves' list order is how the metadata was serialised; the job ids
    say which job came first, and the ranks' JobStarted lines say which they
    ran first."""
    plans = [line["plan"] for line in records(lines, "Planned") if len(line["plan"]["saves"]) > 1]
    assert plans
    for plan in plans:
        plan["saves"].reverse()
    result = replay_trace(write(tmp_path / "t.jsonl", lines))
    assert result.ok, result.divergence


def keys_reversed(lines: Lines) -> Lines:
    """A lookup's and an existence check's keys, with their answers, in reverse."""
    for line in records(lines, "LookupDone") + records(lines, "ExistsAnswered"):
        line["keys"].reverse()
        line["present"].reverse()
    return lines


def puts_reversed(lines: Lines) -> Lines:
    """The PutDone lines of each put call in reverse: each line keeps its
    place in the trace (index, time) and takes another key's record."""
    calls: dict[tuple[int, int], list[int]] = {}  # a job puts once per rank
    for n, line in enumerate(lines[1:], 1):
        if line["type"] == "PutDone":
            calls.setdefault((line["rank"], line["job_id"]), []).append(n)
    places = [p for p in calls.values() if len(p) > 1]
    assert places
    for call in places:
        moved = [{k: v for k, v in lines[n].items() if k not in ("i", "t")} for n in call]
        for n, record in zip(call, reversed(moved)):
            lines[n].update(record)
    return lines


def verdict_chunks_reversed(lines: Lines) -> Lines:
    reordered = 0
    for line in records(lines, "JobFinished"):
        reordered += len(line["stored"]) > 1
        line["stored"].reverse()
        line["failed"].reverse()
    assert reordered
    return lines


@pytest.mark.parametrize("rewrite", [keys_reversed, puts_reversed, verdict_chunks_reversed])
def test_store_call_answers_in_another_order_replay(tmp_path: Path, lines: Lines,
                                                   rewrite: Callable[[Lines], Lines]) -> None:
    """A lookup's and an existence check's keys with their answers, the puts
    of one batch, a verdict's chunks: each is answered per key or chunk, so
    the order they are written in is not a decision."""
    result = replay_trace(write(tmp_path / "t.jsonl", rewrite(lines)))
    assert result.ok, result.divergence


def test_a_token_snapshot_written_when_events_are_off_replays(tmp_path: Path) -> None:
    """With KV events off no rank reads a job's token snapshot: kvstate
    writes none, an outside producer may write one anyway."""
    lines = kvstate_trace(tmp_path, attrs.evolve(RUN, events=False))
    saves = [save for line in records(lines, "Planned") for save in line["plan"]["saves"]]
    assert saves and all(save["token_ids"] is None for save in saves)
    for save in saves:
        save["token_ids"] = list(range(save["token_ids_start"], save["token_len"]))
    result = replay_trace(write(tmp_path / "t.jsonl", lines))
    assert result.ok, result.divergence


def test_an_upstream_recorders_observed_layer_replays_from_the_command_line(
        tmp_path: Path, lines: Lines, capsys: pytest.CaptureFixture[str]) -> None:
    """Everything an engine's own recorder does differently at once, cut to
    the observed layer (no generations, no kvstate verdicts), replayed with
    the protocol named on the command line."""
    full = write(tmp_path / "full.jsonl", upstream_encoded(lines))
    observed = tmp_path / "observed.jsonl"
    with observed.open("w") as out:
        write_observed(full, out)
    for path in (full, observed):
        assert main(["replay", str(path), "--protocol", "kvstate"]) == 0
        assert "result: identical" in capsys.readouterr().out


# --------------------------------------------------------------------------
# What replay needs: the protocol.


def test_a_header_without_protocol_is_refused_naming_the_field(
        tmp_path: Path, lines: Lines, capsys: pytest.CaptureFixture[str]) -> None:
    """Without it replay silently re-drove kvstate's default protocol, and a
    trace of another protocol diverged for no reason it could tell."""
    path = write(tmp_path / "t.jsonl", without_protocol(lines))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: field 'protocol': missing" in err, err
    assert "--protocol" in err and "Traceback" not in err


def test_an_unknown_protocol_is_refused_naming_line_1_and_the_field(
        tmp_path: Path, lines: Lines, capsys: pytest.CaptureFixture[str]) -> None:
    lines[0]["protocol"] = "vllm-0.33"
    path = write(tmp_path / "t.jsonl", lines)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: field 'protocol': 'vllm-0.33' is not a kvstate protocol" in err, err
    assert "--protocol" in err


# --------------------------------------------------------------------------
# A difference in behaviour still diverges, named as the decision.


def _first(lines: Lines, kind: str, holds: Callable[[dict[str, Any]], bool]) -> int:
    return next(n for n, line in enumerate(lines) if n and line["type"] == kind and holds(line))


def test_a_dropped_pin_diverges_at_its_plan_naming_the_blocks_and_the_job(
        tmp_path: Path, lines: Lines, capsys: pytest.CaptureFixture[str]) -> None:
    lines = upstream_encoded(lines)
    n = _first(lines, "Planned", lambda line: len(line["plan"]["pins"]) > 1
               and len(line["plan"]["saves"]) == 1)
    plan = lines[n]["plan"]
    dropped = plan["pins"].pop()
    path = write(tmp_path / "t.jsonl", lines)
    d = replay_trace(path, protocol="kvstate").divergence
    assert d is not None and d.line == n + 1 and d.field == ".plan.pins", d
    job = plan["saves"][0]
    assert f"step {plan['step']}: the model pins blocks" in d.decision, d.decision
    assert f"job {job['job_id']} of {job['req_id']!r}" in d.decision  # the trace's numbering
    assert f"only the model pins [{dropped}]" in d.decision
    assert main(["replay", str(path), "--protocol", "kvstate"]) == 1
    out = capsys.readouterr().out
    assert f"DIVERGENCE at line {n + 1}" in out and d.decision in out
    assert main(["replay", str(path), "--protocol", "kvstate", "--json"]) == 1
    violation = json.loads(capsys.readouterr().out)["violations"][0]
    assert violation["event_index"] == n + 1 and violation["decision"] == d.decision


def test_a_put_of_another_key_diverges_naming_the_chunks(tmp_path: Path, lines: Lines) -> None:
    lines = upstream_encoded(lines)
    n = _first(lines, "PutDone", lambda line: True)
    put = lines[n]
    put["key"] = put["key"][:-4] + "beef"
    d = replay_trace(write(tmp_path / "t.jsonl", lines), protocol="kvstate").divergence
    assert d is not None and d.line == n + 1 and d.field == ".key", d
    assert f"rank {put['rank']}, job {put['job_id']}" in d.decision
    assert "the trace puts" in d.decision and put["key"] in d.decision, d.decision


def test_a_job_for_another_token_range_diverges_naming_the_job(tmp_path: Path,
                                                                lines: Lines) -> None:
    """In a plan that lists its jobs out of id order, the field named is the
    save's place in the line."""
    lines = upstream_encoded(lines)
    n = _first(lines, "Planned", lambda line: len(line["plan"]["saves"]) > 1)
    saves = lines[n]["plan"]["saves"]
    saves.reverse()
    save = saves[0]  # the step's last job
    save["token_len"] -= 4
    d = replay_trace(write(tmp_path / "t.jsonl", lines), protocol="kvstate").divergence
    assert d is not None and d.line == n + 1 and d.field == ".plan.saves[0].token_len", d
    assert f"job {save['job_id']} of {save['req_id']!r}: the model saves tokens" in d.decision, \
        d.decision


def test_a_job_id_that_does_not_increase_diverges(tmp_path: Path, lines: Lines) -> None:
    """The pairing of jobs rests on the order of ids: a producer that emits
    an id again (S22 for `kvstate check`) emits a job the model does not."""
    lines = jobs_renumbered(lines, lambda job: job - 1)
    plans = [n for n, line in enumerate(lines) if n and line["type"] == "Planned"
             and line["plan"]["saves"]]
    n = plans[1]
    earlier = lines[plans[0]]["plan"]["saves"][-1]["job_id"]
    lines[n]["plan"]["saves"][0]["job_id"] = earlier
    d = replay_trace(write(tmp_path / "t.jsonl", lines)).divergence
    assert d is not None and d.line == n + 1 and d.field == ".plan.saves[0].job_id", d
    assert f"after job {earlier}" in d.decision and "S22" in d.decision, d.decision


def test_upstreams_protocol_parts_ways_on_a_decision_not_on_the_encoding(
        tmp_path: Path) -> None:
    """e2 (vLLM as shipped) ships whole tables and pins per job; replayed
    with kvstate's protocol, the first divergence is a decision (pins or
    releases), never how the block table travelled."""
    lines = kvstate_trace(tmp_path, attrs.evolve(RUN, protocol="e2"))
    d = replay_trace(write(tmp_path / "t.jsonl", lines), protocol="kvstate").divergence
    assert d is not None and "block_ids" not in d.field and "hashes" not in d.field, d
    assert "pins" in d.decision or "releases" in d.decision, d.decision
