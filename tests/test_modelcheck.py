"""The model checker: exhaustive, sound under its reductions, shortest counterexamples."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import attrs
import pytest

from kvstate.coverage import Coverage, recording
from kvstate.tables import JOB, JobEvent, JobState
from kvstate.variants import VARIANTS
from sim.cli import main
from sim.explore.campaign import comparable
from sim.explore.modelcheck.model import (
    SCOPES,
    Scope,
    ScopeRequest,
    apply,
    enabled,
    initial,
    random_walk,
    replay_actions,
)
from sim.explore.modelcheck.search import check
from sim.traces.check import check_trace
from sim.traces.replay import replay_trace

TINY = SCOPES["tiny"]
# Two interchangeable requests on one rank: small enough for an unreduced run.
TWINS_ONE_RANK = Scope(
    "twins-1", "two identical requests on one rank",
    (ScopeRequest("a", (1, 2, 3), decode=1), ScopeRequest("b", (1, 2, 3), decode=1)),
    world_size=1, num_blocks=6, faults=0, evictions=0, preemptions=0)
# A reused id on two ranks (random walks; too large to exhaust in a test).
REUSE = Scope(
    "reuse", "one id used twice on two ranks",
    (ScopeRequest("a", (1, 2, 3), decode=2), ScopeRequest("a", (1, 2), decode=1)),
    faults=1, evictions=1, preemptions=1)
# The default scope's requests without faults: two ranks, exhaustively (~6k states).
TWO_RANKS = attrs.evolve(SCOPES["default"], name="two-ranks", faults=0)


def test_the_tiny_scope_is_explored_exhaustively_without_violation() -> None:
    r = check(TINY, "kvstate", out_dir=None)
    assert r.exhaustive and r.ok
    assert r.states > 100 and r.transitions >= r.states - 1 and r.depth > 5
    assert r.quiet_states > 0  # the liveness check at quiescence ran


def test_a_state_survives_a_copy_unchanged_in_behaviour() -> None:
    """The search copies states by rebuilding them from their values; an
    identity-keyed table (the executor once keyed skipped entries by id())
    would silently change behaviour after a copy. Same random walk, with and
    without copies."""
    import random

    from sim.explore.modelcheck.values import form_for

    # Walks run to the end and quiesce: the id()-keyed skip table showed as a
    # skipped entry left at quiescence in 2 of these 30 tiny walks.
    for scope in (TINY, REUSE):
        form = form_for(scope, "kvstate", False, None)
        for seed in range(30):
            walks = []
            for copy in (False, True):
                rng = random.Random(seed)
                s = form.loads(form.dumps(form.template)[1])
                s.h.record = True
                for _ in range(200):
                    actions = enabled(scope, s)
                    if not actions:
                        break
                    if copy:  # the run's records are scratch: not in the value
                        log, times = s.h.log, s.h.times
                        s = form.loads(form.dumps(s)[1])
                        s.h.log, s.h.times = log, times
                    apply(scope, s, rng.choice(actions), set())
                s.h.quiesce()
                walks.append(s.h.trace_text())
            assert walks[0] == walks[1], f"{scope.name} seed {seed}: a copy behaved differently"


@pytest.mark.parametrize("protocol", ["kvstate", "e1"])
def test_reductions_keep_the_verdict_and_shrink_the_state_space(protocol: str) -> None:
    """Symmetry and counter reduction are sound here: the unreduced search
    reaches the same verdict (and the same shortest counterexample length)."""
    reduced = check(TWINS_ONE_RANK, protocol, out_dir=None)
    plain = check(TWINS_ONE_RANK, protocol, out_dir=None, reduce=False)
    assert (reduced.violation is None) == (plain.violation is None)
    if reduced.violation is not None and plain.violation is not None:
        assert reduced.violation.invariant == plain.violation.invariant
        assert len(reduced.violation.actions) == len(plain.violation.actions)
    else:
        assert reduced.exhaustive and plain.exhaustive
        assert reduced.states < plain.states  # the twins and the counters merged


def test_symmetric_requests_merge_states() -> None:
    from sim.explore.modelcheck.model import _symmetric

    assert _symmetric(TWINS_ONE_RANK) == {0, 1}
    assert _symmetric(REUSE) == set()  # a reused id is not interchangeable


def test_e1_stale_job_is_found_with_a_shortest_replayable_trace(tmp_path) -> None:
    r = check(TINY, "e1", out_dir=str(tmp_path))
    assert r.violation is not None, "e1 survived the tiny scope"
    v = r.violation
    assert v.trace is not None
    # The trace is a kvstate trace: the checker flags it, replay reproduces it.
    judged = check_trace(v.trace)
    assert not judged.ok
    assert replay_trace(v.trace).ok
    # Breadth-first: no shorter action sequence breaks an invariant. Every
    # prefix of the counterexample is clean.
    text = replay_actions(TINY, "e1", v.actions[:-1])
    prefix = tmp_path / "prefix.jsonl"
    prefix.write_text(text)
    assert check_trace(str(prefix)).ok


@pytest.mark.slow
def test_kvstate_survives_two_ranks_and_a_reused_id_exhaustively() -> None:
    r = check(TWO_RANKS, "kvstate", out_dir=None)
    assert r.exhaustive and r.ok, r.violation


def test_model_checking_records_coverage_of_the_tables() -> None:
    cov = Coverage()
    with recording(cov):
        check(TINY, "kvstate", out_dir=None)
    job = cov.pairs(JOB)
    assert (JobState.PUTTING, JobEvent.PUT_FAILED) in job  # a scripted -200 / -800
    assert (JobState.CHECKING, JobEvent.RAISED) in job  # a scripted raise of the check


def test_a_parallel_search_records_the_tables_its_workers_fired(monkeypatch) -> None:
    """Workers record what fired in their slices and send it back: here the
    driver expands nothing itself, as on a Ray cluster. Before, its table
    (and the "never fired" list after an exhaustive run) held only what this
    process expanded: on a cluster, the narrow first levels."""
    import sim.explore.modelcheck.compact as mc

    alone = Coverage()
    with recording(alone):
        whole = check(SCOPES["default"], "kvstate", out_dir=None)
    real = mc._slices
    monkeypatch.setattr(mc, "_slices", lambda level, n: [[], *real(level, n - 1)])
    shared = Coverage()
    with recording(shared):
        r = check(SCOPES["default"], "kvstate", out_dir=None, workers=2)
    assert r.workers == 2 and r.outcome == whole.outcome
    assert shared.fired == alone.fired


@pytest.mark.slow
def test_modelcheck_command(tmp_path, capsys) -> None:
    assert main(["modelcheck", "--scope", "tiny", "--json", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["exhaustive"] and doc["runs"][0]["states"] > 100
    assert "never_fired" in doc
    assert main(["modelcheck", "--scope", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "exhaustive" in out and "spec smell" in out
    assert main(["modelcheck", "--scope", "nope"]) == 2
    assert "unknown scope" in capsys.readouterr().err


def test_a_budget_makes_the_search_not_exhaustive(capsys) -> None:
    assert main(["modelcheck", "--scope", "default", "--max-states", "50",
                 "--require-exhaustive"]) == 1
    assert "NOT exhaustive" in capsys.readouterr().out


def test_modelcheck_reports_a_violation_with_exit_1(tmp_path, capsys) -> None:
    code = main(["modelcheck", "--scope", "tiny", "--protocol", "e0",
                 "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "VIOLATION" in out and "shortest counterexample" in out
    assert list(tmp_path.glob("modelcheck-e0-tiny-*.jsonl"))


def test_scope_description_names_its_bounds() -> None:
    text = SCOPES["default"].describe()
    assert "2 ranks" in text and "1 store fault" in text
    assert attrs.evolve(TINY, faults=0).describe() != TINY.describe()
    assert "; 1 rank, put_step" in TINY.describe()


# The scope in which the model checker finds each variant's own bug (measured
# by `kvstate bench tools`). Every variant is listed.
SCOPE_FINDS = {
    "e2": "tiny", "e1": "tiny", "e0": "tiny", "req-id-counter-ledger": "tiny",
    "no-pins-on-preemption": "tiny", "delayed-free-at-finish": "tiny",
    "parent-previous-emitted": "tiny", "retry-keyed-by-request": "tiny",
    "missing-finally": "tiny", "boundary-without-plus-one": "decode",
    "save-on-loading-step": "twins", "consumer-without-backfill": "tiny",
    "consumer-saves-prefill": "pd", "advance-offset-on-failure": "tiny",
    "stride-by-relative-chunk": "mla", "skip-exists-check": "tiny",
    "lookup-first-namespace": "twins", "swallow-load-errors": "load",
    "snapshot-from-zero": "tiny", "key-without-rank": "default",
}


# The upstream shapes on two ranks (issue 11): the variants whose bug each
# scope's ingredients can show, all found (measured: `kvstate modelcheck
# --scope S --protocol V`). save-on-loading-step, lookup-first-namespace and
# swallow-load-errors need a second request loading (`load2`, and `twins`,
# `load` on one rank); stride-by-relative-chunk needs put_step 2 (`mla`);
# no-pins-on-preemption needs a preemption (not in `reuse2`), consumer-saves-
# prefill a consumer (only `pd-decode`), and boundary-without-plus-one a decode
# step that completes a block after the prompt's own (not in `decode2`).
_TWO_RANK_FINDS = ("e2", "e1", "e0", "req-id-counter-ledger", "delayed-free-at-finish",
                   "missing-finally", "consumer-without-backfill", "key-without-rank")
UPSTREAM_SCOPE_FINDS = {
    "decode2": (*_TWO_RANK_FINDS, "no-pins-on-preemption", "parent-previous-emitted",
                "retry-keyed-by-request", "advance-offset-on-failure", "skip-exists-check",
                "snapshot-from-zero"),
    "reuse2": (*_TWO_RANK_FINDS, "parent-previous-emitted", "retry-keyed-by-request",
               "boundary-without-plus-one", "advance-offset-on-failure", "skip-exists-check",
               "snapshot-from-zero"),
    "pd-decode": (*_TWO_RANK_FINDS, "no-pins-on-preemption", "boundary-without-plus-one",
                  "consumer-saves-prefill"),
    # The load path on two ranks (issue 30): 15 of the 20, the three that need
    # a load among them. Not there, by shape: no id is reused
    # (req-id-counter-ledger, retry-keyed-by-request), nothing is preempted
    # (no-pins-on-preemption), no consumer (consumer-saves-prefill), put_step 1
    # (stride-by-relative-chunk).
    "load2": ("e2", "e1", "e0", "delayed-free-at-finish", "parent-previous-emitted",
              "missing-finally", "boundary-without-plus-one", "save-on-loading-step",
              "consumer-without-backfill", "advance-offset-on-failure", "skip-exists-check",
              "lookup-first-namespace", "swallow-load-errors", "snapshot-from-zero",
              "key-without-rank"),
    # P/D with two groups and striding (issue 29): 15 of the 20. Not there,
    # by shape: a decode node looks nothing up and loads nothing
    # (save-on-loading-step, lookup-first-namespace, swallow-load-errors); with
    # put_step 2 each of a chunk's keys is one rank's, so dropping the rank
    # from keys collides nothing (key-without-rank), and the decode jobs start
    # on chunks whose relative and absolute positions stride alike
    # (stride-by-relative-chunk): `mla` and `default` find those two.
    "hybrid-pd": ("e2", "e1", "e0", "req-id-counter-ledger", "no-pins-on-preemption",
                  "delayed-free-at-finish", "parent-previous-emitted",
                  "retry-keyed-by-request", "missing-finally", "boundary-without-plus-one",
                  "consumer-without-backfill", "consumer-saves-prefill",
                  "advance-offset-on-failure", "skip-exists-check", "snapshot-from-zero"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(UPSTREAM_SCOPE_FINDS))
def test_the_upstream_shapes_are_exhaustive_for_kvstate(name: str) -> None:
    r = check(SCOPES[name], "kvstate", out_dir=None, workers=2)
    assert r.exhaustive and r.ok, (name, r.states)
    assert r.quiet_states > 0


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", [(name, variant)
                                          for name, found in UPSTREAM_SCOPE_FINDS.items()
                                          for variant in found])
def test_the_upstream_shapes_find_each_variant_they_can_show(name: str, variant: str) -> None:
    from kvstate.invariants import broken_by

    own = broken_by(variant)
    r = check(SCOPES[name], variant, out_dir=None, only=own)
    assert r.violation is not None and r.violation.invariant in own, (name, variant)


def test_every_variant_has_a_scope_that_finds_it() -> None:
    from kvstate.variants import VARIANTS

    assert set(SCOPE_FINDS) == set(VARIANTS) - {"kvstate"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(SCOPE_FINDS))
def test_model_checker_finds_the_variants_own_bug(variant: str, tmp_path) -> None:
    from kvstate.invariants import broken_by

    own = broken_by(variant)
    r = check(SCOPES[SCOPE_FINDS[variant]], variant, out_dir=str(tmp_path), only=own)
    assert r.violation is not None, f"{variant} survived scope {SCOPE_FINDS[variant]}"
    assert r.violation.invariant in own
    assert r.violation.trace is not None and replay_trace(r.violation.trace).ok


@pytest.mark.slow
def test_bench_tools_fills_a_variants_row(tmp_path, capsys) -> None:
    from kvstate.invariants import broken_by

    assert main(["bench", "tools", "--quick", "--tool-protocol", "e1", "--json",
                 "--out-dir", str(tmp_path)]) == 0
    row = json.loads(capsys.readouterr().out)["tools"]["e1"]
    for tool in ("sim", "hypothesis", "modelcheck"):
        assert row[tool]["found"] in broken_by("e1"), (tool, row[tool])
        assert row[tool]["length"] > 0


@pytest.mark.slow
def test_bench_tools_gives_the_same_rows_with_two_workers(tmp_path) -> None:
    """The per-variant tool table across processes: same variants in the same
    order, same findings and counterexample lengths as one process."""
    from sim.bench.tools import bench_tools

    def findings(report):
        return [(name, [(tool, row[tool]["found"], row[tool].get("length"))
                        for tool in ("sim", "hypothesis", "modelcheck")])
                for name, row in report.items()]

    names = ["e1", "key-without-rank", "e0"]
    one = bench_tools(names, sim_budget=5, mc_budget=10, out_dir=str(tmp_path))
    seen: list[str] = []
    two = bench_tools(names, sim_budget=5, mc_budget=10, out_dir=str(tmp_path), workers=2,
                      progress=lambda name, row: seen.append(name))
    assert list(two) == names and seen == names
    assert findings(two) == findings(one)
    assert all(row["modelcheck"]["found"] for row in two.values())


# ---------------------------------------------------------------------------
# The value engine against the pickle engine it replaced (issue 30). The
# pickle engine keyed a state by a pickled digest, which told apart states
# that are equal as values (equal strings that were one object in one state
# and two in another); tests/data/modelcheck_reference.py (commit 57d0b72,
# deleted with the pickle engine after it had run) ran it on this
# matrix and grouped its states by value key before it was deleted. The
# value engine must visit exactly those groups (states, transitions out of
# them, quiet ones) and find the same shortest counterexamples.

REFERENCE = json.loads((Path(__file__).resolve().parent / "data"
                        / "modelcheck_reference.json").read_text())["rows"]
_REFERENCE_SCOPES = {**SCOPES, "twins-1": TWINS_ONE_RANK, "two-ranks": TWO_RANKS}


def _row_id(row: dict) -> str:
    return (f"{row['scope']}-{row['protocol']}{'-own' if row['only'] else ''}"
            f"{'' if row['reduce'] else '-unreduced'}")


def test_the_reference_covers_every_variant_and_scope() -> None:
    assert {r["protocol"] for r in REFERENCE} == set(VARIANTS)
    exhaustive = {r["scope"] for r in REFERENCE if r["protocol"] == "kvstate"}
    assert set(SCOPES) - exhaustive == {"decode2", "reuse2", "pd-decode", "upstream", "large",
                                        "three-ranks", "load2"}
    assert all(row["legacy"]["exhaustive"] == ("values" in row) for row in REFERENCE)


@pytest.mark.slow
@pytest.mark.parametrize("row", REFERENCE, ids=_row_id)
def test_the_value_engine_agrees_with_the_pickle_engine(row: dict) -> None:
    scope = _REFERENCE_SCOPES[row["scope"]]
    only = tuple(row["only"]) if row["only"] else None
    small = row["legacy"]["states"] < 5_000
    for workers in (1, 2) if small else (1,):
        r = check(scope, row["protocol"], out_dir=None, only=only, reduce=row["reduce"],
                  workers=workers)
        if "values" in row:
            assert r.exhaustive and r.ok, (row["scope"], workers)
            assert {"states": r.states, "transitions": r.transitions,
                    "quiet_states": r.quiet_states} == row["values"], workers
            assert r.states <= row["legacy"]["states"]
        else:
            assert r.violation is not None, workers
            found = (r.violation.invariant, [list(a) for a in r.violation.actions])
            assert found == (row["violation"]["invariant"], row["violation"]["actions"])


@pytest.mark.slow
def test_three_ranks_with_striding_are_exhaustive_for_kvstate(tmp_path) -> None:
    """Issue 30's new shape: three ranks, each chunk stored by one of them,
    decode-phase saves and a -200 per path; kvstate survives every path, and
    a variant whose bug the shape can show is found with a replayable trace."""
    from kvstate.invariants import broken_by

    r = check(SCOPES["three-ranks"], "kvstate", out_dir=None, workers=2)
    assert r.exhaustive and r.ok and r.quiet_states > 0
    assert r.states > 40_000
    found = check(SCOPES["three-ranks"], "advance-offset-on-failure", out_dir=str(tmp_path),
                  only=broken_by("advance-offset-on-failure"))
    assert found.violation is not None and found.violation.trace is not None
    assert replay_trace(found.violation.trace).ok


@pytest.mark.slow
def test_a_counterexample_found_with_workers_replays(tmp_path) -> None:
    r = check(SCOPES["twins"], "save-on-loading-step", workers=2, out_dir=str(tmp_path))
    assert r.violation is not None
    assert r.violation.trace is not None and replay_trace(r.violation.trace).ok


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCOPES))
def test_every_scope_prefix_is_the_same_with_workers(name: str) -> None:
    """A state cap cuts a search at the same place whatever the workers."""
    one = check(SCOPES[name], "kvstate", out_dir=None, max_states=600)
    two = check(SCOPES[name], "kvstate", workers=2, out_dir=None, max_states=600)
    assert two.outcome == one.outcome


def _walks(seeds: int, steps: int = 40):
    """Every scope, ``seeds`` random walks of up to ``steps`` actions: yields
    (scope name, seed, state) after each action."""
    for name, scope in SCOPES.items():
        for seed in range(seeds):
            for s in random_walk(scope, seed, steps):
                yield name, seed, s


def _scramble_end_only_fields(s, rng) -> None:
    """Overwrite every field the state's key leaves out as read by `Monitor.end`
    alone (and the observation number) with garbage of the same type."""
    from sim.explore.modelcheck.model import END_ONLY_FIELDS

    monitor = s.h.monitor
    monitor.index = type(monitor.index)(rng.randrange(10**6))
    monitor.step = type(monitor.step)(rng.randrange(10**6))
    monitor.last_report = {rank: rng.randrange(10**6) for rank in monitor.last_report}
    monitor.pinned_since = {block: rng.randrange(10**6) for block in monitor.pinned_since}
    for job in monitor.jobs.values():
        job.step = rng.randrange(10**6)
    from kvstate.invariants import Monitor, _Job

    assert END_ONLY_FIELDS == {Monitor: {"step", "last_report", "pinned_since"},
                               _Job: {"step"}}, "scramble the new field here too"


def _random_actions(scope: Scope, protocol: str, seed: int, steps: int = 60):
    """A random walk's (state, next action, rng): the caller applies the
    action to the state (or not) before asking for the next."""
    import random

    rng = random.Random(seed)
    s = initial(scope, protocol)
    for _ in range(steps):
        actions = enabled(scope, s)
        if not actions:
            return
        yield s, rng.choice(actions), rng


def _verdicts_with_and_without_scrambling(scope: Scope, protocol: str, seed: int) -> list:
    differences = []
    for s, action, rng in _random_actions(scope, protocol, seed):
        twin = pickle.loads(pickle.dumps(s))
        _scramble_end_only_fields(twin, rng)
        verdicts = []
        for state in (s, twin):
            state.h.monitor.findings.clear()
            apply(scope, state, action, set())
            verdicts.append([(f.invariant, f.message) for f in state.h.monitor.findings])
        if verdicts[0] != verdicts[1]:
            differences.append((action, verdicts))
        if verdicts[0]:
            break
    for state in (s, twin):  # the quiescence check reads none of them either
        state.h.monitor.findings.clear()
        state.h.quiesce()
    quiet = [[(f.invariant, f.message) for f in st.h.monitor.findings] for st in (s, twin)]
    if quiet[0] != quiet[1]:
        differences.append((("quiesce",), quiet))
    return differences


def _key_after(scope: Scope, actions: list) -> bytes:
    """The key of the state ``actions`` (each enabled in turn) reach."""
    from sim.explore.modelcheck.model import _symmetric
    from sim.explore.modelcheck.values import form_for

    form = form_for(scope, "kvstate", True, None)
    s = form.loads(form.dumps(form.template)[1])
    for action in actions:
        assert action in enabled(scope, s), (action, enabled(scope, s))
        apply(scope, s, action, _symmetric(scope))
    return form.key(s)


def test_the_order_in_which_two_ranks_check_a_job_is_one_state() -> None:
    """Both ranks dequeue the prefill's save job; whether rank 0 or rank 1
    gets its existence answer first, the next state is the same: the monitor
    keeps the keys each rank checked (S9) as facts, not in arrival order."""
    scope = SCOPES["default"]
    both_checking = [("admit", 0), ("step",), ("rank", 0, "ok"), ("rank", 1, "ok")]
    zero_first = _key_after(scope, both_checking + [("rank", 0, "ok"), ("rank", 1, "ok")])
    one_first = _key_after(scope, both_checking + [("rank", 1, "ok"), ("rank", 0, "ok")])
    assert zero_first == one_first


@pytest.mark.slow
@pytest.mark.parametrize("protocol", list(VARIANTS))
def test_fields_the_key_leaves_out_decide_no_verdict(protocol: str) -> None:
    """The key leaves out the monitor's step bookkeeping and observation
    number (sim/explore/modelcheck/model.py, "What only the end of a trace reads"): sound
    only while no checker but `Monitor.end` reads them. Random walks on every
    scope, each action taken twice, once with those fields scrambled: the
    findings must be the same, message for message."""
    for scope in SCOPES.values():
        for seed in range(3):
            assert _verdicts_with_and_without_scrambling(scope, protocol, seed) == [], (
                scope.name, seed)


def test_the_scrambling_test_catches_a_checker_that_reads_a_left_out_field(
        monkeypatch) -> None:
    """The test above can fail: a checker that starts reading a job's step
    (here: a made-up rule on PutDone) gives different verdicts once scrambled."""
    from kvstate.invariants import Monitor

    original = Monitor._on_PutDone

    def reads_the_step(self, obs) -> None:
        original(self, obs)
        job = self.jobs.get(obs.job_id)
        if job is not None and job.step % 2:
            self.fail("S1", f"made-up rule: job emitted at odd step {job.step}")

    monkeypatch.setattr(Monitor, "_on_PutDone", reads_the_step)
    assert any(_verdicts_with_and_without_scrambling(SCOPES["default"], "kvstate", seed)
               for seed in range(5))


@pytest.mark.slow
def test_state_counts_do_not_depend_on_the_string_hash_seed() -> None:
    """Sets of strings iterate in an order set by PYTHONHASHSEED; the pickled
    digest the key replaced once wrote them as they iterated, and `twins` counted 1,549, 2,015 or
    2,123 states by the seed. Two processes, two seeds, one count."""
    import os
    import subprocess
    import sys

    code = ("from sim.explore.modelcheck.model import SCOPES\n"
            "from sim.explore.modelcheck.search import check\n"
            "print(check(SCOPES['twins'], 'kvstate', out_dir=None).states)")
    counts = set()
    for seed in ("0", "8"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        counts.add(int(out.stdout.split()[-1]))
    assert len(counts) == 1, counts


# ---------------------------------------------------------------------------
# Dicts the key writes sorted (UNORDERED_FIELDS): nothing may read their order.

_ORDER_FREE_METHODS = frozenset({"get", "pop", "setdefault", "clear"})
_ORDER_FREE_CALLS = frozenset({"len", "sorted", "bool", "min", "max", "set", "frozenset"})

# Uses that do read the order, each outside anything the model checker runs.
_ORDER_READ_ELSEWHERE = {
    # the scripted scenario evicts every key, oldest first
    ("kvstate/scenarios.py", "objects", "evicted_and_reput"),
    # the Hypothesis state machine evicts the oldest key
    ("kvstate/testing.py", "objects", "ConnectorMachine.evict"),
    # the simulator's capacity-bounded store (a subclass the model checker
    # never holds: UNORDERED_FIELDS and the value form go by exact type)
    ("sim/simulator/store.py", "objects", "SimStore.evict_oldest"),
    # the monitor's own ``current`` (request -> generation), not the
    # harness's (the scan goes by attribute name); the value form writes the
    # monitor's in order
    ("kvstate/invariants.py", "current", "Monitor._on_Planned"),
    # the derivation (kvstate/derive.py) is not run by the model checker
    ("kvstate/derive.py", "current", "Derivation._on_Planned"),
}


def _order_free(node, parents) -> bool:
    """Whether this use of a dict can see nothing of its order: a lookup, a
    write, a ``get``/``pop``, ``in``, ``len``, ``sorted``, a truth test, or
    binding a new dict."""
    import ast

    p = parents.get(node)
    if isinstance(p, ast.Subscript) and p.value is node:
        return True
    if isinstance(p, ast.Compare) and node in p.comparators:
        return isinstance(p.ops[p.comparators.index(node)], (ast.In, ast.NotIn))
    if isinstance(p, ast.Attribute) and p.value is node and p.attr in _ORDER_FREE_METHODS:
        call = parents.get(p)
        return isinstance(call, ast.Call) and call.func is p
    if (isinstance(p, ast.Call) and isinstance(p.func, ast.Name)
            and p.func.id in _ORDER_FREE_CALLS and node in p.args):
        return True
    if isinstance(p, (ast.Assign, ast.AnnAssign)) and node is not p.value:
        return True
    if isinstance(p, (ast.If, ast.While, ast.IfExp)) and p.test is node:
        return True
    return isinstance(p, ast.UnaryOp) and isinstance(p.op, ast.Not)


def _order_reading_uses(source: str, fields: set[str]) -> list[tuple[str, str]]:
    """(field, enclosing Class.function) of every use of an attribute named
    in ``fields`` that is not order-free."""
    import ast

    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in fields \
                and not _order_free(node, parents):
            names, up = [], node
            while up in parents:
                up = parents[up]
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.append(up.name)
            found.append((node.attr, ".".join(reversed(names)) or "<module>"))
    return found


def test_no_code_reads_the_order_of_a_dict_the_key_sorts() -> None:
    """The key writes the store's objects, the monitor's frontier and the
    harness's current calls sorted; that is sound only while the code the
    model checker runs never iterates them. Every module of kvstate and sim,
    parsed; the only uses that read an order are the ones listed (none of
    these dicts, or none run by the model checker)."""
    from pathlib import Path

    from sim.explore.modelcheck.model import UNORDERED_FIELDS

    root = Path(__file__).resolve().parent.parent
    fields = {name for names in UNORDERED_FIELDS.values() for name in names}
    assert fields == {"objects", "frontier", "current"}, "check the new field's uses here"
    found = set()
    for top in ("kvstate", "sim"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            found |= {(rel, *use) for use in _order_reading_uses(path.read_text(), fields)}
    assert found == _ORDER_READ_ELSEWHERE


def test_the_source_scan_sees_a_loop_over_a_sorted_dict() -> None:
    source = """
class Store:
    def keys_in_order(self):
        for key in self.objects:
            yield key
    def first(self):
        return list(self.frontier)[0]
    def fine(self, key):
        if key in self.objects and self.frontier.get(key) and len(self.objects):
            self.objects[key] = sorted(self.frontier)
"""
    assert _order_reading_uses(source, {"objects", "frontier"}) == [
        ("objects", "Store.keys_in_order"), ("frontier", "Store.first")]


def _shuffle_unordered_dicts(s, rng) -> None:
    from sim.explore.modelcheck.model import UNORDERED_FIELDS

    for obj in (s.h, s.h.store, s.h.monitor):
        for name in UNORDERED_FIELDS.get(type(obj), ()):
            items = list(getattr(obj, name).items())
            rng.shuffle(items)
            setattr(obj, name, dict(items))


def _futures_with_dicts_shuffled(scope: Scope, seed: int) -> list:
    """A random walk; before each action a copy gets its order-free dicts
    shuffled; the action's findings and the key after must not differ."""
    from sim.explore.modelcheck.model import _symmetric
    from sim.explore.modelcheck.values import form_for

    form = form_for(scope, "kvstate", True, None)

    symmetric = _symmetric(scope)
    differences = []
    for s, action, rng in _random_actions(scope, "kvstate", seed):
        # Two copies, one of them shuffled.
        blob = pickle.dumps(s)
        plain, twin = pickle.loads(blob), pickle.loads(blob)
        _shuffle_unordered_dicts(twin, rng)
        apply(scope, s, action, symmetric)
        outcome = []
        for state in (plain, twin):
            state.h.monitor.findings.clear()
            apply(scope, state, action, symmetric)
            outcome.append(([(f.invariant, f.message) for f in state.h.monitor.findings],
                            enabled(scope, state), form.key(state)))
        if outcome[0] != outcome[1]:
            differences.append(action)
    return differences


@pytest.mark.parametrize("name", ["default", "churn", "decode", "reuse2"])
def test_shuffling_the_dicts_the_key_sorts_changes_no_future(name: str) -> None:
    for seed in range(4):
        assert _futures_with_dicts_shuffled(SCOPES[name], seed) == [], seed


def test_the_shuffling_test_catches_code_that_reads_the_store_order(monkeypatch) -> None:
    """A store whose existence check answers for the oldest keys only (a made-up
    order-reading rule) gives different futures once its dict is shuffled."""
    from kvstate.memory_store import MemoryStore

    def oldest_only(self, rank, keys):
        oldest = set(list(self.objects)[:1])
        return [k in oldest for k in keys]

    monkeypatch.setattr(MemoryStore, "exists", oldest_only)
    assert any(_futures_with_dicts_shuffled(SCOPES[name], seed)
               for name in ("default", "reuse2") for seed in range(4))


def test_bad_worker_counts_are_refused(capsys) -> None:
    with pytest.raises(ValueError, match="workers"):
        check(TINY, "kvstate", workers=0)
    with pytest.raises(SystemExit) as e:
        main(["modelcheck", "--scope", "tiny", "--workers", "0"])
    assert e.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize("argv,expected", [
    ([], 3),  # every core (the stand-in machine has 3)
    (["--workers", "1"], 1),
])
def test_modelcheck_uses_every_core_unless_told(monkeypatch, capsys, argv, expected) -> None:
    import sim.explore.modelcheck.compact
    import sim.explore.modelcheck.search

    monkeypatch.setattr(sim.explore.modelcheck.compact, "default_workers", lambda: 3)
    used = []
    real = sim.explore.modelcheck.search.check

    def spy(*args, **kwargs):
        used.append(kwargs["workers"])
        return real(*args, **{**kwargs, "workers": 1})

    monkeypatch.setattr(sim.explore.modelcheck.search, "check", spy)
    assert main(["modelcheck", "--scope", "tiny", "--json", *argv]) == 0
    assert used == [expected]
    capsys.readouterr()


def test_workers_start_only_when_a_level_is_wide_enough_to_share(monkeypatch) -> None:
    """Every core is the default: on a machine with many, a small scope must
    not fork a process per core (a level narrower than two states a worker is
    expanded inline), and the answer is the one-process answer."""
    import sim.explore.modelcheck.compact

    started = []
    real = sim.explore.modelcheck.compact._Pool

    def spy(workers, *args):
        started.append(workers)
        return real(workers, *args)

    monkeypatch.setattr(sim.explore.modelcheck.compact, "_Pool", spy)
    many = check(TINY, "kvstate", out_dir=None, workers=1000)
    assert started == [] and many.workers == 1
    assert many.outcome == check(TINY, "kvstate", out_dir=None).outcome
    two = check(TINY, "kvstate", out_dir=None, workers=2)
    assert started == [2] and two.workers == 2 and two.outcome == many.outcome


def test_modelcheck_reports_the_processes_that_expanded_states(capsys) -> None:
    assert main(["modelcheck", "--scope", "tiny", "--json", "--workers", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["workers"] == 2
    assert main(["modelcheck", "--scope", "tiny", "--json", "--workers", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["workers"] == 1  # none started


def test_compact_engine_leaves_the_garbage_collector_as_it_found_it() -> None:
    import gc

    assert gc.isenabled()
    check(TINY, "kvstate", out_dir=None, max_states=200)
    assert gc.isenabled()
    gc.disable()
    try:
        check(TINY, "kvstate", out_dir=None, max_states=200)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bench_modelcheck_reports_rates_and_phases_on_the_same_states() -> None:
    from sim.bench.modelcheck import bench_modelcheck

    figures = bench_modelcheck("tiny", max_states=300, workers=[2])
    # The cap is checked between expansions: the last state expanded may add
    # a few successors past it (every run the same, hence same_counts).
    assert figures["same_counts"] and 300 <= figures["states"] < 320
    assert figures["w1_states_per_s"] > 0 and figures["w2_states_per_s"] > 0
    # the phases of a transition: each took time, together not more than the run
    shares = [figures[f"phase_{p}_share"] for p in ("copy", "step", "key")]
    assert all(0 < x < 1 for x in shares) and sum(shares) <= 1
    assert all(figures[f"phase_{p}_us_per_transition"] > 0 for p in ("copy", "step", "key"))


@pytest.mark.slow
def test_bench_modelcheck_runs_another_revision_in_the_same_run() -> None:
    """``--against REV``: that revision's model checker in a worktree, beside
    this one; here the revision is this checkout's HEAD (a model checker
    that counts the same states)."""
    from sim.bench.modelcheck import bench_modelcheck

    figures = bench_modelcheck("tiny", workers=[], against="HEAD")
    assert figures["against_seconds"] > 0 and figures["ratio_time_to_exhaust"] > 0
    assert figures["against_transitions"] > 0


def test_bench_modelcheck_says_which_revision_it_cannot_check_out(capsys) -> None:
    assert main(["bench", "modelcheck", "--quick", "--against", "no-such-revision"]) == 2
    assert "--against 'no-such-revision': no such commit" in capsys.readouterr().err


def test_a_timed_expander_explores_the_same_states() -> None:
    from sim.explore.modelcheck.compact import TimedExpander, check_compact

    timed = TimedExpander(TINY, "kvstate", True, None)
    r = check_compact(TINY, "kvstate", out_dir=None, expander=timed)
    assert r.outcome == check(TINY, "kvstate", out_dir=None).outcome
    assert timed.transitions == r.transitions and timed.seconds["copy"] > 0
    with pytest.raises(ValueError, match="another scope"):
        check_compact(SCOPES["default"], "kvstate", out_dir=None, expander=timed)


# ---------------------------------------------------------------------------
# Campaigns across processes and Ray: folded in seed order, so the result
# does not depend on the number of workers.

def _small():
    from sim.simulator.runner import SimOptions

    return SimOptions(requests=24)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["kvstate", "e1"])
def test_campaign_result_is_the_same_for_any_number_of_workers(protocol: str) -> None:
    from sim.explore.campaign import campaign

    one = campaign(protocol, seeds=6, base=_small(), workers=1)
    two = campaign(protocol, seeds=6, base=_small(), workers=2)
    assert one.runs == two.runs == 6
    assert comparable(one) == comparable(two)
    if protocol == "e1":
        assert one.counts and all("--protocol=e1" in c for c in one.first_command.values())


def test_a_parallel_campaign_stops_at_the_same_seed_as_a_sequential_one() -> None:
    from sim.explore.campaign import campaign

    one = campaign("e1", seeds=8, base=_small(), workers=1, stop_when_found=True)
    three = campaign("e1", seeds=8, base=_small(), workers=3, stop_when_found=True)
    assert comparable(one) == comparable(three)
    assert one.runs == 1


def test_the_invariants_one_seed_broke_share_one_fold_time() -> None:
    """`kvstate bench tools` ranks a seed's findings by time, then by
    observation: if the clock ticked between two invariants of one seed, the
    later-named one looked found later, and the row (e1: S2 at observation 21
    or S1 at 25,347) depended on the machine's speed."""
    import itertools

    from sim.explore.campaign import campaign

    ticks = itertools.count()  # a clock that moves 10 ms every time it is read
    result = campaign("e1", seeds=1, base=_small(), clock=lambda: next(ticks) * 0.01)
    assert len(result.first_found) >= 2
    assert len(set(result.first_found.values())) == 1


def test_a_campaign_counts_the_observations_of_the_seeds_it_folded() -> None:
    """What a campaign costs is its runs' length: the sum over its seeds."""
    from sim.explore.campaign import campaign, seed_options
    from sim.simulator.runner import simulate

    result = campaign("kvstate", seeds=2, base=_small())
    each = [simulate(seed_options(_small(), "kvstate", seed, ("both", "pd")),
                     stop_at_first=False).figures["observations"] for seed in range(2)]
    assert min(each) > 0
    assert result.observations == sum(each)


@pytest.mark.slow
def test_bench_campaign_sizes_the_issue_campaign_from_its_own_run() -> None:
    from sim.bench.campaign import SIZING_OBSERVATIONS, SIZING_SEEDS, bench_campaign

    figures = bench_campaign(seeds=2, workers=[1])
    per_cpu_s = figures["observations_per_seed"] / figures["cpu_s_per_seed_w1"]
    hours = SIZING_SEEDS * SIZING_OBSERVATIONS / per_cpu_s / 3600
    assert figures["observations_per_seed"] > 0 and figures["same_results"]
    assert figures["cpu_hours_for_10k_seeds_of_1e5_observations"] == pytest.approx(hours, rel=0.02)


@pytest.mark.slow
def test_campaign_command_workers_and_reproduce_line(capsys) -> None:
    assert main(["campaign", "--protocol", "e1", "--seeds", "2", "--workers", "2",
                 "--stop-when-found"]) == 1
    out = capsys.readouterr().out
    assert "reproduce: kvstate sim" in out and "--protocol=e1" in out
    with pytest.raises(SystemExit) as e:
        main(["campaign", "--workers", "0"])
    assert e.value.code == 2
    capsys.readouterr()


def test_campaign_ray_without_ray_is_a_usage_error(capsys, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["campaign", "--seeds", "1", "--ray", "local"]) == 2
    assert "pip install" in capsys.readouterr().err


@pytest.mark.slow
def test_campaign_on_a_local_ray_instance_matches_local_workers() -> None:
    pytest.importorskip("ray")
    from sim.explore.campaign import campaign

    local = campaign("e1", seeds=4, base=_small(), workers=1)
    ray = campaign("e1", seeds=4, base=_small(), ray_address="local")
    assert comparable(ray) == comparable(local)


def test_an_exception_in_a_worker_reaches_the_parent(monkeypatch) -> None:
    """A crash inside the core during a worker's expansion is raised in the
    parent with the worker's traceback (not a bare broken pipe)."""
    import os

    import sim.explore.modelcheck.compact as mc

    parent = os.getpid()
    real = mc.apply

    def crashing(scope, s, action, symmetric):
        if os.getpid() != parent:
            raise ValueError("the core crashed in a worker")
        return real(scope, s, action, symmetric)

    monkeypatch.setattr(mc, "apply", crashing)  # workers are forked: they inherit it
    with pytest.raises(mc.WorkerError, match="the core crashed in a worker"):
        check(TINY, "kvstate", workers=2, out_dir=None)


# ---------------------------------------------------------------------------
# The same answer in any process. A spawned worker (the default start method
# on macOS and Windows) and a Ray actor get the scope as a copy; a request
# name entered the state as the copy's object, and the digest, which sees
# which equal strings are one object, then counted other numbers of states
# there (default: 2,486 against 2,550).

# The scopes a test run can afford twice in one process (seconds each).
_AFFORDABLE = ["tiny", "default", "churn", "twins", "mla", "load", "pd", "hybrid", "pd-decode"]


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in ("tiny", "default") else pytest.mark.slow)
    for n in _AFFORDABLE])
def test_a_copy_of_the_scope_explores_the_same_states(name: str) -> None:
    scope = SCOPES[name]
    copied = pickle.loads(pickle.dumps(scope))
    assert copied.requests[0].name is not scope.requests[0].name  # what a worker gets
    assert (check(copied, "kvstate", out_dir=None).outcome
            == check(scope, "kvstate", out_dir=None).outcome)


@pytest.mark.slow
def test_spawned_workers_count_what_one_process_counts(monkeypatch) -> None:
    """Where fork is missing, `_Pool` spawns its workers: a fresh
    interpreter that imports everything again and unpickles the scope."""
    import sim.explore.modelcheck.compact

    monkeypatch.setattr(sim.explore.modelcheck.compact.multiprocessing, "get_all_start_methods",
                        lambda: ["spawn"])
    spawned = check(SCOPES["default"], "kvstate", out_dir=None, workers=2)
    assert spawned.workers == 2
    assert spawned.outcome == check(SCOPES["default"], "kvstate", out_dir=None).outcome


# ---------------------------------------------------------------------------
# The model checker and the tool table on a Ray cluster (a local instance).


def test_modelcheck_and_bench_tools_ray_without_ray_are_usage_errors(capsys,
                                                                      monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["modelcheck", "--scope", "tiny", "--ray", "local"]) == 2
    assert "pip install" in capsys.readouterr().err
    assert main(["bench", "tools", "--tool-protocol", "e1", "--ray", "local"]) == 2
    assert "pip install" in capsys.readouterr().err


@pytest.mark.slow
def test_modelcheck_on_a_local_ray_instance_matches_one_process(tmp_path) -> None:
    """Frontier slices as calls on Ray actors: the same states, transitions,
    verdicts and shortest counterexamples as one process, for an actor per
    CPU and for more actors than the cluster has CPUs."""
    pytest.importorskip("ray")
    from sim.explore.cluster import Cluster

    alone = check(SCOPES["default"], "kvstate", out_dir=None)
    buggy = check(SCOPES["twins"], "save-on-loading-step", out_dir=None)
    assert alone.exhaustive and buggy.violation is not None
    with Cluster("local") as cluster:
        for actors in (cluster.cpus, cluster.cpus + 1):
            r = check(SCOPES["default"], "kvstate", out_dir=None, workers=actors,
                      cluster=cluster)
            assert r.workers == actors and r.outcome == alone.outcome, actors
        found = check(SCOPES["twins"], "save-on-loading-step", out_dir=str(tmp_path),
                      workers=2, cluster=cluster)
    assert found.outcome == buggy.outcome
    assert found.violation.trace is not None and replay_trace(found.violation.trace).ok


@pytest.mark.slow
def test_modelcheck_command_on_a_local_ray_instance(capsys) -> None:
    pytest.importorskip("ray")
    assert main(["modelcheck", "--scope", "default", "--ray", "local", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    alone = check(SCOPES["default"], "kvstate", out_dir=None)
    assert (run["states"], run["transitions"], run["exhaustive"]) == (
        alone.states, alone.transitions, True)
    assert run["workers"] > 1  # actors expanded it (an actor per CPU; CI has two)


@pytest.mark.slow
def test_bench_tools_on_a_local_ray_instance_gives_the_same_rows(tmp_path) -> None:
    """A row per Ray task, in variant order; the model checker's trace is
    written where the task ran and lands in ``out_dir`` here."""
    pytest.importorskip("ray")
    from sim.bench.tools import bench_tools
    from sim.explore.cluster import Cluster

    names = ["e1", "e0"]
    here = tmp_path / "here"
    there = tmp_path / "ray"
    one = bench_tools(names, sim_budget=5, mc_budget=10, out_dir=str(here))
    with Cluster("local") as cluster:
        ray = bench_tools(names, sim_budget=5, mc_budget=10, out_dir=str(there),
                          cluster=cluster)
    assert list(ray) == names
    for name in names:
        for tool in ("sim", "hypothesis", "modelcheck"):
            assert (ray[name][tool]["found"], ray[name][tool].get("length")) == (
                one[name][tool]["found"], one[name][tool].get("length")), (name, tool)
        trace = ray[name]["modelcheck"]["trace"]
        assert trace.startswith(str(there)) and replay_trace(trace).ok
