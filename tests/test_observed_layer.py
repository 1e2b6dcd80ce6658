"""The observed layer: traces with none of kvstate's internals still show every bug.

The fixtures here are written by hand from only what a vLLM engine and its
connector can see (`specs/trace.md`): request ids, job ids, ranks, store calls
and answers, reports, block-pool changes. No generation numbers, no rank-state
writes, no verdicts, no content tags, no claim of quiescence. The checker must
number the request ids' lifetimes itself (`kvstate.derive`) and still judge
every scenario; and for every protocol variant, a simulator trace cut to its
observed layer (`kvstate trace observed`) must still show the variant's bug,
with the derived generations exactly the recorded ones (replay compares them).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvstate.contract import ANNOTATION_RECORDS, GENERATION_FIELDS, observed_layer
from kvstate.keys import block_hash
from kvstate.trace import TraceReader
from kvstate.variants import VARIANTS
from sim.cli import main
from sim.simulator.runner import SimOptions, simulate
from sim.traces.check import check_trace
from sim.traces.observed import write_observed
from sim.traces.replay import replay_trace

BS = 4
WORLD = 2
TOKENS = list(range(200, 208))  # two blocks


def h(value: bytes) -> dict[str, str]:
    return {"@hex": value.hex()}


def chain(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(0, len(tokens), BS):
        out.append(block_hash(out[-1] if out else None, tokens[i:i + BS]))
    return out


HASHES = chain(TOKENS)


def key(rank: int, digest: bytes) -> str:
    return f"test-model@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:0@{digest.hex()}"


class Engine:
    """Writes what an engine's recorder would: one method per thing it sees."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = [{
            "kvstate_trace": 1, "protocol": "kvstate", "configs": [{
                "@": "ConnectorConfig", "block_size": BS, "world_size": WORLD,
                "enable_kv_events": False}]}]
        self.step = 0

    def add(self, kind: str, **fields: Any) -> None:
        i = len(self.lines) - 1
        self.lines.append({"i": i, "e": 0, "t": float(self.step), "type": kind, **fields})

    def lookup(self, req: str) -> None:
        self.add("LookupDone", req_id=req, num_prompt_tokens=len(TOKENS),
                 block_hashes=[h(x) for x in HASHES],
                 keys=[key(r, d) for d in HASHES for r in range(WORLD)],
                 present=[False] * (len(HASHES) * WORLD), hit_tokens=0)

    def schedule(self, new: list[tuple[str, list[int]]] = (), resumed: list[tuple[str, list[int]]] = (),
                 preempted: list[str] = (), finished: list[str] = ()) -> None:
        self.step += 1
        for req, blocks in list(new) + list(resumed):
            for b in blocks:
                self.add("BlockAllocated", block_id=b, req_id=req)
        for req, blocks in new:
            self.add("Allocated", req_id=req, block_ids=[blocks], num_computed_tokens=0,
                     num_external_tokens=0, load_async=False)
        self.add("StepScheduled", step={
            "@": "SchedulerStep",
            "new": [{"@": "NewRequest", "req_id": req, "prompt_token_ids": TOKENS,
                     "num_computed_tokens": 0, "num_scheduled_tokens": len(TOKENS),
                     "block_ids": [blocks], "block_hashes": [h(x) for x in HASHES]}
                    for req, blocks in new],
            "resumed": [{"@": "ResumedRequest", "req_id": req, "all_token_ids": TOKENS,
                         "num_computed_tokens": 0, "num_scheduled_tokens": len(TOKENS),
                         "block_ids": [blocks], "block_hashes": [h(x) for x in HASHES]}
                        for req, blocks in resumed],
            "preempted": list(preempted), "finished": list(finished)})

    def plan(self, saves: list[tuple[str, int, list[int]]] = (), releases: list[int] = ()) -> None:
        """The connector metadata: one job per (request, job id, blocks)."""
        self.add("Planned", plan={"@": "Plan", "step": self.step, "saves": [{
            "@": "SaveMeta", "req_id": req, "job_id": job, "token_ids_start": 0,
            "token_len": len(TOKENS), "num_prompt_tokens": len(TOKENS), "is_decode": False,
            "block_ids_start": 0, "block_ids": [blocks], "hashes_start": 0,
            "block_hashes": [h(x) for x in HASHES]} for req, job, blocks in saves],
            "pins": [b for _, _, blocks in saves for b in blocks], "releases": list(releases)})

    def run_job(self, rank: int, req: str, job: int, blocks: list[int],
                present: bool = False) -> None:
        """One rank's send thread: dequeue, check, put what is missing, verdict."""
        keys = [key(rank, d) for d in HASHES]
        self.add("JobStarted", rank=rank, job_id=job, req_id=req, live=True, save_start=0,
                 token_len=len(TOKENS))
        self.add("ExistsAnswered", rank=rank, job_id=job, keys=keys,
                 present=[present] * len(keys))
        if not present:
            for c, k in enumerate(keys):
                self.add("PutDone", rank=rank, job_id=job, req_id=req, key=k, group=0,
                         chunk_id=c, block_id=blocks[c], code=0, accepted=True)
        self.add("JobFinished", rank=rank, job_id=job, req_id=req, outcome="stored",
                 save_start=0, token_len=len(TOKENS),
                 stored=[[0, c] for c in range(len(keys))], failed=[], events=[])

    def report(self, rank: int, req: str, job: int) -> None:
        self.add("ReportDelivered", report={
            "@": "Report", "job_id": job, "rank": rank, "req_id": req,
            "outcome": {"@enum": "JobState", "value": "stored"}, "events": []})

    def settle(self, releases: list[int]) -> None:
        self.add("Settled", settlement={"@": "Settlement", "releases": releases,
                                        "published": []})

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.add("BlockFreed", block_id=b)

    def write(self, path: Path) -> Path:
        with open(path, "w") as out:
            for line in self.lines:
                out.write(json.dumps(line) + "\n")
        return path


def saved_then_preempted_then_resumed() -> Engine:
    """Request a: saved, preempted, resumed on new blocks (its keys are found),
    finished. Every rank reports every job; every pin is released."""
    eng = Engine()
    eng.lookup("a")
    eng.schedule(new=[("a", [1, 2])])
    eng.plan(saves=[("a", 1, [1, 2])])
    for rank in range(WORLD):
        eng.run_job(rank, "a", 1, [1, 2])
        eng.report(rank, "a", 1)
    eng.settle([2, 1])
    eng.schedule(preempted=["a"])
    eng.plan()
    eng.free([1, 2])
    eng.schedule(resumed=[("a", [3, 4])])  # no lookup: a resumption recomputes
    eng.plan(saves=[("a", 2, [3, 4])])
    for rank in range(WORLD):
        eng.run_job(rank, "a", 2, [3, 4], present=True)
        eng.report(rank, "a", 2)
    eng.settle([4, 3])
    eng.schedule(finished=["a"])
    eng.plan()
    eng.free([3, 4])
    return eng


def check(capsys, path: Path) -> tuple[int, dict[str, Any]]:
    code = main(["check", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def fired(out: dict[str, Any]) -> set[str]:
    return {v["invariant"] for v in out["violations"]}


def test_the_fixture_carries_no_internals() -> None:
    text = json.dumps(saved_then_preempted_then_resumed().lines)
    for word in (*GENERATION_FIELDS, *ANNOTATION_RECORDS, "confirmed_offset", "content",
                 "started", "released_jobs", "violations"):
        assert f'"{word}"' not in text


def test_an_observed_only_trace_checks_clean(tmp_path: Path, capsys) -> None:
    path = saved_then_preempted_then_resumed().write(tmp_path / "ok.jsonl")
    code, out = check(capsys, path)
    assert code == 0, out["violations"]
    # What it could not judge, and says so: content tags (not digested) and
    # which settlement released which job (judged when every rank reported).
    assert {note.split()[0] for note in out["notes"]} == {"K1", "S18"}, out["notes"]


def test_generations_are_numbered_as_the_planner_numbers_them(tmp_path: Path) -> None:
    path = saved_then_preempted_then_resumed().write(tmp_path / "ok.jsonl")
    with TraceReader(path) as reader:
        records = [obs for _, _, _, obs in reader]
    lookups = [o.generation for o in records if type(o).__name__ == "LookupDone"]
    plans = [o.plan for o in records if type(o).__name__ == "Planned"]
    reports = [(o.report.job_id, o.report.generation) for o in records
               if type(o).__name__ == "ReportDelivered"]
    # The lookup opens lifetime 1, the new request takes it; the resumption
    # opens lifetime 2.
    assert lookups == [1]
    assert [(m.job_id, m.generation) for p in plans for m in p.saves] == [(1, 1), (2, 2)]
    assert [p.preempted for p in plans] == [(), (("a", 1),), (), ()]
    assert [p.finished for p in plans] == [(), (), (), (("a", 2),)]
    assert reports == [(1, 1), (1, 1), (2, 2), (2, 2)]


def test_a_stale_job_put_after_its_request_was_preempted_is_caught(
        tmp_path: Path, capsys) -> None:
    """The hazard of upstream's preemption bugs: rank 1 dequeues job 1 only
    after the scheduler preempted request a and resumed it. Without derived
    generations and derived plan.preempted the checker could not tell the
    put belongs to the dead lifetime."""
    eng = Engine()
    eng.lookup("a")
    eng.schedule(new=[("a", [1, 2])])
    eng.plan(saves=[("a", 1, [1, 2])])
    eng.run_job(0, "a", 1, [1, 2])
    eng.report(0, "a", 1)
    eng.schedule(preempted=["a"])
    eng.plan()
    eng.run_job(1, "a", 1, [1, 2])  # dequeued after the preemption: still puts
    eng.report(1, "a", 1)
    eng.settle([2, 1])
    path = eng.write(tmp_path / "stale.jsonl")
    code, out = check(capsys, path)
    assert code == 1
    assert "S21" in fired(out), out["violations"]


def test_a_put_from_a_block_freed_under_the_job_is_caught(tmp_path: Path, capsys) -> None:
    eng = Engine()
    eng.lookup("a")
    eng.schedule(new=[("a", [1, 2])])
    eng.plan(saves=[("a", 1, [1, 2])])
    eng.free([2])  # the engine reused block 2 while job 1 still needed it
    for rank in range(WORLD):
        eng.run_job(rank, "a", 1, [1, 2])
        eng.report(rank, "a", 1)
    path = eng.write(tmp_path / "freed.jsonl")
    code, out = check(capsys, path)
    assert code == 1
    assert {"S1", "S2"} & fired(out), out["violations"]


def test_a_request_id_reused_while_running_is_caught(tmp_path: Path, capsys) -> None:
    eng = Engine()
    eng.lookup("a")
    eng.schedule(new=[("a", [1, 2])])
    eng.plan(saves=[("a", 1, [1, 2])])
    eng.schedule(new=[("a", [3, 4])])  # same id, new request, old one never finished
    eng.plan(saves=[("a", 2, [3, 4])])
    path = eng.write(tmp_path / "reuse.jsonl")
    code, out = check(capsys, path)
    assert code == 1
    assert "K2" in fired(out), out["violations"]
    with TraceReader(path) as reader:
        plans = [o.plan for _, _, _, o in reader if type(o).__name__ == "Planned"]
    # The old lifetime ends (finished) in the plan that opens the new one.
    assert plans[1].finished == (("a", 1),)
    assert [m.generation for m in plans[1].saves] == [2]


def test_a_rank_that_never_reports_is_named_where_the_trace_ends(
        tmp_path: Path, capsys) -> None:
    eng = Engine()
    eng.lookup("a")
    eng.schedule(new=[("a", [1, 2])])
    eng.plan(saves=[("a", 1, [1, 2])])
    eng.run_job(0, "a", 1, [1, 2])
    eng.report(0, "a", 1)  # rank 1 fell silent
    for _ in range(80):
        eng.schedule()
        eng.plan()
    path = eng.write(tmp_path / "silent.jsonl")
    code, out = check(capsys, path)
    assert code == 1
    assert any("rank 1" in v["message"] for v in out["violations"]), out["violations"]


@pytest.mark.parametrize("where", ["report", "put"])
def test_generations_written_on_some_records_only_are_refused(
        tmp_path: Path, capsys, where: str) -> None:
    eng = saved_then_preempted_then_resumed()
    kind = {"report": "ReportDelivered", "put": "PutDone"}[where]
    n = next(i for i, line in enumerate(eng.lines) if line.get("type") == kind)
    if where == "report":
        eng.lines[n]["report"]["generation"] = 1
    else:
        eng.lines[n]["generation"] = 1
    path = eng.write(tmp_path / "mixed.jsonl")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"mixed.jsonl:{n + 1}: field" in err
    assert "on every record or on none" in err


def test_a_generation_that_cannot_be_derived_is_an_input_error(
        tmp_path: Path, capsys) -> None:
    eng = Engine()
    eng.step = 1
    eng.plan(saves=[("ghost", 1, [1, 2])])  # a job for a request never scheduled
    path = eng.write(tmp_path / "ghost.jsonl")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ghost.jsonl:2: field 'plan.saves[0].generation'" in err
    assert "'ghost'" in err


def test_replay_of_an_observed_only_trace_compares_the_derived_generations(
        tmp_path: Path, capsys) -> None:
    path = saved_then_preempted_then_resumed().write(tmp_path / "ok.jsonl")
    assert replay_trace(path).ok


# --------------------------------------------------------------------------
# Every variant, cut to the observed layer.

SMALL = SimOptions(requests=60)
# What only annotations can show (specs/trace.md, "What each invariant
# needs"): K1 compares content tags, K2's and S3's rank-side checks read which
# generation wrote the rank state, S18 and K3 read the settlement's released
# jobs and the claims of quiescence, K6 the rank's clock, S4/S12 in part.
# Each variant whose bug shows there also shows it in the observed layer
# (asserted below).
NEEDS_ANNOTATIONS = {"K1", "K2", "K3", "K6", "S3", "S4", "S12", "S18"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_is_caught_from_the_observed_layer_alone(
        tmp_path: Path, variant: str) -> None:
    annotated: set[str] = set()
    observed: set[str] = set()
    for seed in range(6):
        options = attrs.evolve(SMALL, seed=seed, protocol=variant,
                               setup=("both", "pd")[seed % 2],
                               put_step=SMALL.world_size if seed % 4 >= 2 else SMALL.put_step)
        full = tmp_path / f"{seed}.jsonl"
        with full.open("w") as out:
            simulate(options, trace=out)
        with (tmp_path / f"{seed}.observed.jsonl").open("w") as out:
            cut = write_observed(full, out)
        assert cut.records_dropped > 0
        a = {f.invariant for _, _, f in check_trace(full).findings}
        b = {f.invariant for _, _, f in check_trace(tmp_path / f"{seed}.observed.jsonl").findings}
        assert b <= a, f"seed {seed}: the observed layer alone found {b - a} (false alarm)"
        assert a - b <= NEEDS_ANNOTATIONS, (seed, a - b)
        # Replay derives every generation and compares it with the model's.
        replayed = replay_trace(tmp_path / f"{seed}.observed.jsonl", protocol=variant)
        assert replayed.ok, (seed, replayed.divergence)
        annotated |= a
        observed |= b
    if variant == "kvstate":
        assert annotated == observed == set()
    else:
        assert observed, f"{variant}: no bug found in the observed layer"


def test_the_cut_keeps_every_observed_field(tmp_path: Path) -> None:
    full = tmp_path / "run.jsonl"
    with full.open("w") as out:
        simulate(attrs.evolve(SMALL, seed=3), trace=out)
    lines = [json.loads(x) for x in full.read_text().splitlines()]
    for line in lines[1:]:
        kept = observed_layer(copy.deepcopy(line))
        if kept is None:
            assert line["type"] in ANNOTATION_RECORDS
            continue
        assert set(kept) <= set(line)
        dropped = set(line) - set(kept)
        assert dropped <= {"generation", "state_generation", "retry_generation", "content",
                           "now", "skipped_since"}, (line["type"], dropped)
