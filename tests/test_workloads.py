"""Production-shaped workloads (issue 10): Mooncake trace readers, sound
scaling, admission, liveness attribution, event-flood figures."""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import attrs
import pytest

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec
from kvstate.events import BlockStored, OrderedQuorum
from kvstate.harness import Harness
from kvstate.invariants import Monitor
from kvstate.keys import HashChain
from kvstate.observations import Settled
from kvstate.records import Settlement
from kvstate.workloads import FAST25_BLOCK, Remap, WorkloadError, fast25, read_mooncake
from sim.cli import main
from sim.simulator.engine import SimEngine
from sim.simulator.runner import SimOptions, simulate

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}


def _line(**fields: object) -> str:
    return json.dumps({**GOOD, **fields})


def _write(tmp_path: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ---------------------------------------------------------------------------
# 1. Readers: every malformed line is one `file:line: ...` error, exit 2.

DEEP = "[" * 200_000 + "]" * 200_000
BIG = "9" * 5000

MALFORMED = [
    ("empty-hash-ids", _line(hash_ids=[]), "field 'hash_ids': []"),
    ("too-few-hash-ids", _line(input_length=5000), "field 'hash_ids': [0, 1]"),
    ("5000-digit-length", f'{{"timestamp": 0, "input_length": {BIG}, "output_length": 1, '
     '"hash_ids": [0]}', "invalid JSON"),
    ("5000-digit-hash-id", f'{{"timestamp": 0, "input_length": 1, "output_length": 1, '
     f'"hash_ids": [{BIG}]}}', "invalid JSON"),
    ("5000-digit-float-timestamp", f'{{"timestamp": {BIG}.5, "input_length": 1, '
     '"output_length": 1, "hash_ids": [0]}', "field 'timestamp': inf"),
    ("huge-hash-id", _line(input_length=1, hash_ids=[1 << 64]), "field 'hash_ids': element"),
    ("deep-nesting", DEEP, "nested too deeply"),
    ("deep-nesting-in-field", '{"timestamp": ' + DEEP + "}", "nested too deeply"),
    ("infinite-timestamp", '{"timestamp": Infinity, "input_length": 1, "output_length": 1, '
     '"hash_ids": [0]}', "field 'timestamp': inf"),
    ("overflowing-timestamp", '{"timestamp": 1e999, "input_length": 1, "output_length": 1, '
     '"hash_ids": [0]}', "field 'timestamp': inf"),
    ("nan-timestamp", '{"timestamp": NaN, "input_length": 1, "output_length": 1, '
     '"hash_ids": [0]}', "field 'timestamp': nan"),
    ("negative-timestamp", _line(timestamp=-5), "field 'timestamp': -5"),
    ("negative-input-length", _line(input_length=-3), "field 'input_length': -3"),
    ("zero-input-length", _line(input_length=0, hash_ids=[]), "field 'input_length': 0"),
    ("float-input-length", _line(input_length=999.5), "field 'input_length': 999.5"),
    ("integral-float-length", _line(output_length=20.0), "field 'output_length': 20.0"),
    ("bool-length", _line(output_length=True), "field 'output_length': True"),
    ("string-length", _line(input_length="1000"), "field 'input_length': '1000'"),
    ("negative-output-length", _line(output_length=-1), "field 'output_length': -1"),
    ("huge-output-length", _line(output_length=10**12), "field 'output_length'"),
    ("negative-hash-id", _line(hash_ids=[0, -1]), "field 'hash_ids': element -1"),
    ("string-hash-id", _line(hash_ids=[0, "1"]), "field 'hash_ids': element '1'"),
    ("hash-ids-not-a-list", _line(hash_ids={"0": 1}), "field 'hash_ids': {'0': 1}"),
    ("missing-field", json.dumps({k: v for k, v in GOOD.items() if k != "output_length"}),
     "field 'output_length': missing"),
    ("array-line", "[1, 2, 3]", "expected an object"),
    ("null-line", "null", "expected an object"),
    ("number-line", "12", "expected an object"),
    ("invalid-json", "{not json", "invalid JSON"),
]


@pytest.mark.parametrize(("line", "needle"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_line_is_a_file_line_error_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, needle: str) -> None:
    path = _write(tmp_path, [_line(), line, _line(timestamp=5)])
    with pytest.raises(WorkloadError) as err:
        list(read_mooncake(path))
    assert str(err.value).startswith(f"{path}:2: ")
    assert needle in str(err.value)
    assert len(str(err.value)) < 400  # a 5,000-digit value is shown shortened
    code = main(["sim", "--workload", "fast25", "--fast25-path", str(path), "--requests", "3"])
    captured = capsys.readouterr()
    assert code == 2
    assert f"{path}:2: " in captured.err and needle in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_timestamps_must_not_go_backwards_and_bad_bytes_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(timestamp=10), _line(timestamp=3)])
    with pytest.raises(WorkloadError, match=r":2: field 'timestamp': 3 \(earlier"):
        list(read_mooncake(path))
    raw = tmp_path / "bytes.jsonl"
    raw.write_bytes(_line().encode() + b"\n\xff\xfe\n")
    with pytest.raises(WorkloadError, match=r"bytes.jsonl:2: not UTF-8"):
        list(read_mooncake(raw))


def test_blank_lines_are_skipped_and_extra_fields_ignored(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(), "", "   ", _line(timestamp=2.5, session="abc")])
    assert [row[0] for row in read_mooncake(path)] == [0.0, 2.5]


def test_paths_that_are_not_regular_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="not a regular file"):
        list(read_mooncake(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(WorkloadError, match="not a regular file"):  # never blocks opening it
        list(read_mooncake(fifo))
    with pytest.raises(WorkloadError, match="no requests"):
        list(fast25(_write(tmp_path, [""], "empty.jsonl")))


# ---------------------------------------------------------------------------
# 1b. --scale: any positive integer, hash ids remapped soundly.


def _covered_ids(ids: list[int], scale: int, end_token: int) -> tuple[int, ...]:
    """The original hash ids the scaled tokens [0, end_token) cover."""
    return tuple(ids[: (end_token * scale - 1) // FAST25_BLOCK + 1])


@pytest.mark.parametrize("scale", [1, 3, 7, 32, 100, 511, 512, 513, 1000, 2048])
def test_scaled_blocks_are_shared_iff_the_original_blocks_they_cover_are(scale: int) -> None:
    """The argument in ``Remap``'s docstring, checked on every pair of prompts
    and every scaled block: prompts built from few distinct hash ids (so they
    share and diverge at every position), including ids 0 and 50,000 (which
    the old reader turned into identical tokens) and ids that recur at other
    positions (no prefix structure assumed)."""
    rng = random.Random(scale)
    block = 4 if scale < FAST25_BLOCK else 2
    remap = Remap(scale)
    prompts = []
    for _ in range(24):
        n = rng.randint(1, max(6, 4 * block * scale // FAST25_BLOCK))
        ids = [rng.choice((0, 50_000, 1, 2)) for _ in range(n)]
        length = rng.randint(max(1, (n - 1) * FAST25_BLOCK + 1), n * FAST25_BLOCK)
        scaled = length // scale
        if scaled < block:
            continue
        prompts.append((ids, scaled, HashChain(block, remap.tokens(ids, scaled)).hashes))
    assert len(prompts) >= 6
    for (ids_a, _, hashes_a), (ids_b, _, hashes_b) in itertools.combinations(prompts, 2):
        for k in range(min(len(hashes_a), len(hashes_b))):
            end = (k + 1) * block
            same_ids = _covered_ids(ids_a, scale, end) == _covered_ids(ids_b, scale, end)
            assert (hashes_a[k] == hashes_b[k]) == same_ids, (scale, ids_a, ids_b, k)


def test_fast25_at_a_scale_not_dividing_512(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(input_length=1000, hash_ids=[7, 8]),
                             _line(input_length=600, hash_ids=[7, 9])])
    first, second = fast25(path, scale=3)
    assert len(first.prompt) == 333 and len(second.prompt) == 200
    # Tokens 0..169 cover only original block 0 (positions < 512): shared.
    assert first.prompt[:170] == second.prompt[:170]
    assert first.prompt[170] != second.prompt[170]  # positions 510..512 cover block 1
    assert main(["sim", "--workload", "fast25", "--fast25-path", str(path), "--scale", "3",
                 "--requests", "2", "--faults", "none"]) == 0


# ---------------------------------------------------------------------------
# 2. Admission, rejected requests, who stalled.


def _oversized_trace(tmp_path: Path) -> Path:
    """A 40k-token prompt among ordinary ones (at scale 32: 1,250 tokens, 313
    blocks of 4, in a 160-block pool)."""
    lines = [_line(timestamp=t * 100, input_length=1800 + 40 * t, output_length=64,
                   hash_ids=[0, 100 + t, 200 + t, 300 + t]) for t in range(6)]
    lines.insert(2, _line(timestamp=150, input_length=40_000, output_length=300,
                          hash_ids=list(range(1000, 1079))))
    return _write(tmp_path, lines)


def test_a_prompt_larger_than_the_kv_cache_is_rejected_not_blamed_on_the_protocol(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _oversized_trace(tmp_path)
    options = SimOptions(workload="fast25", fast25_path=str(path), requests=7, seed=3)
    result = simulate(options)
    assert result.ok, result.findings
    assert result.figures["rejected"] == 1
    assert result.figures["liveness_stall"] == "none"
    assert main(["sim", "--workload", "fast25", "--fast25-path", str(path), "--requests", "7",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["figures"]["rejected"] == 1
    assert main(["sim", "--workload", "fast25", "--fast25-path", str(path), "--requests", "7"]) == 0
    assert "requests rejected at admission" in capsys.readouterr().out


def test_max_model_len_refuses_prompt_plus_max_tokens(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = _oversized_trace(tmp_path)
    base = SimOptions(workload="fast25", fast25_path=str(path), requests=7, faults=())
    # At scale 32 the ordinary requests need 56..62 prompt + 2 output tokens: 60 keeps 3.
    result = simulate(attrs.evolve(base, max_model_len=60))
    assert result.ok and result.figures["rejected"] == 4
    assert simulate(attrs.evolve(base, max_model_len=10)).figures["rejected"] == 7
    # vLLM refuses to start when the cache cannot hold one max-length request.
    assert main(["sim", "--max-model-len", "100000"]) == 2
    assert "--max-model-len=100000: the KV cache holds 640 tokens" in capsys.readouterr().err


def test_a_liveness_failure_says_the_environment_stalled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without admission (the old engine model) the oversized prompt never
    runs: the run is not settled, and the report blames the engine model, not
    the protocol."""
    monkeypatch.setattr(SimEngine, "refusal", lambda self, prompt, max_new: None)
    path = _oversized_trace(tmp_path)
    result = simulate(SimOptions(workload="fast25", fast25_path=str(path), requests=7,
                                 faults=(), settle_time=2.0))
    assert not result.ok
    assert result.figures["liveness_stall"] == "environment"
    assert "engine model stalled" in result.figures["liveness_detail"]


def test_a_liveness_failure_says_the_protocol_stalled() -> None:
    """Upstream's value-counted quorum keeps events that never reach quorum
    (K3) although every request finished: the protocol's own leftovers."""
    result = simulate(SimOptions(protocol="e2", requests=100, seed=0), stop_at_first=False)
    assert "K3" in {f.invariant for _, f in result.findings}
    assert result.figures["liveness_stall"] == "protocol"
    assert "every request finished" in result.figures["liveness_detail"]


def test_traces_record_the_new_options_and_minimize_reads_them_back(tmp_path: Path) -> None:
    from sim.traces.minimize import options_from_trace

    path = _oversized_trace(tmp_path)
    options = SimOptions(workload="fast25", fast25_path=str(path), requests=3, scale=1000,
                         faults=(), max_model_len=0)
    out = tmp_path / "run.jsonl"
    with out.open("w") as handle:
        simulate(options, trace=handle)
    assert options_from_trace(out) == options


# ---------------------------------------------------------------------------
# 3. Event floods under preemption.


def _resumed_run(variant: str, resumptions: int = 5) -> Harness:
    """One 48-token prompt on 2 ranks: saved and announced, then preempted and
    resumed ``resumptions`` times (each resumption recomputes the prompt and
    its first save finds every chunk present), then finished."""
    from kvstate.config import ConnectorConfig
    from kvstate.scenarios import prompt

    config = ConnectorConfig(block_size=4, world_size=2, save_decode_cache=True,
                             enable_kv_events=True)
    h = Harness(config, variant, num_blocks=64)
    h.add("a", prompt(48), max_new_tokens=6)
    h.step()
    h.run_ranks()
    for _ in range(resumptions):
        h.step(preempt=["a"], hold=["a"])
        h.run_ranks()
        h.step()
        h.run_ranks()
    h.settle()
    return h


def _announcements(h: Harness) -> dict[tuple[int, bytes], int]:
    counts: dict[tuple[int, bytes], int] = {}
    for event in h.published:
        key = (event.group_idx, event.block_hashes[-1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_a_resumed_generation_does_not_republish_what_is_published() -> None:
    h = _resumed_run("kvstate")
    assert h.preemptions == 5
    counts = _announcements(h)
    assert len(counts) >= 12  # the prompt's chunks (and decode chunks) were announced
    assert max(counts.values()) == 1, "a chunk was published again at a resumption"
    assert not h.monitor.findings  # K4/S15/S16 and settlement stay green
    # Parents still precede children for a consumer that rejects orphans.
    from sim.simulator.consumer import RadixConsumer
    consumer = RadixConsumer()
    assert all(consumer.accept(e) for e in h.published) and consumer.orphans == 0
    # What the quorum remembered for the request is gone once it finished.
    assert h.planner.quorum.remembered() == 0  # type: ignore[attr-defined]


def test_e2_announces_only_what_it_put_and_keeps_its_own_quorum() -> None:
    h = _resumed_run("e2")
    counts = _announcements(h)
    assert counts and max(counts.values()) == 1  # upstream announces puts only


def test_sim_prints_events_per_stored_chunk_and_the_duplicate_ratio(
        capsys: pytest.CaptureFixture[str]) -> None:
    for protocol in ("kvstate", "e2"):
        args = ["sim", "--protocol", protocol, "--requests", "60", "--faults", "preempt",
                "--seed", "4"]
        main(args + ["--json"])
        figures = json.loads(capsys.readouterr().out)["figures"]
        for name in ("events_per_stored_chunk", "event_duplicate_ratio", "events_duplicate",
                     "events_republished", "chunks_stored", "rejected"):
            assert name in figures, name
        assert 0.0 <= figures["event_duplicate_ratio"] < 1.0
        main(args)
        assert "events per stored chunk / duplicate ratio" in capsys.readouterr().out


@pytest.mark.parametrize("num_blocks", [40, 160])
def test_preemption_storm_republishes_nothing_at_resumptions(num_blocks: int) -> None:
    """Under a preemption storm the default protocol re-published every
    resumed prefix (duplicates grew with the preemptions: a duplicate ratio of
    0.40-0.49 here); now a resumed generation publishes none of what its
    request already published, and the duplicates left are chunks other
    requests share (e2 announces only what it put)."""
    options = SimOptions(requests=120, faults=("preempt",), seed=2, num_blocks=num_blocks)
    result = simulate(options)
    assert result.ok, result.findings
    f = result.figures
    assert f["preemptions"] >= 20
    assert f["events_republished"] == 0, f
    assert f["event_duplicate_ratio"] < 0.37, f
    assert f["events_per_stored_chunk"] < 1.45, f


# ---------------------------------------------------------------------------
# 5. Several KV-cache groups: everything keyed by (group, hash).
# A hybrid model's groups store the same chunks under the same hashes (the
# request's hash chain), in keys that differ only in their `@group:` segment.

def _groups_config(*groups: GroupSpec, world_size: int = 1, put_step: int = 1) -> ConnectorConfig:
    return ConnectorConfig(block_size=4, world_size=world_size, put_step=put_step,
                           enable_kv_events=True, groups=groups, alignment=16)


FIRST, SECOND = b"\x01" * 16, b"\x02" * 16  # two chained chunks of one request


def _event(digest: bytes, parent: bytes | None, group: int) -> BlockStored:
    return BlockStored((digest,), parent, (), 4, group)


def test_a_second_groups_events_are_published_not_dropped() -> None:
    """Two full-attention groups announce the same chunks: a quorum that
    remembered published chunks by hash dropped the second group's first
    chunk as a duplicate (counted nowhere) and then published its child, an
    orphan in group 1."""
    quorum = OrderedQuorum(_groups_config(GroupSpec(), GroupSpec()))
    events = (_event(FIRST, None, 0), _event(FIRST, None, 1),
              _event(SECOND, FIRST, 0), _event(SECOND, FIRST, 1))
    published = quorum.add(("a", 1), 0, events)
    assert sorted((e.group_idx, e.block_hashes[-1]) for e in published) == [
        (0, FIRST), (0, SECOND), (1, FIRST), (1, SECOND)]
    assert quorum.generation_settled(("a", 1)) == 0  # nothing left waiting or dropped


def test_a_full_attention_child_waits_for_its_own_groups_parent() -> None:
    """MLA-style striding over a hybrid model (2 ranks, put_step 2): rank 1
    owns the sliding-window group's first chunk and the full group's second.
    Its report must not let the sliding-window copy of the first chunk stand
    in for the full group's parent."""
    quorum = OrderedQuorum(_groups_config(
        GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 8), world_size=2, put_step=2))
    gen = ("a", 1)
    early = quorum.add(gen, 1, (_event(FIRST, None, 1), _event(SECOND, FIRST, 0)))
    assert [(e.group_idx, e.block_hashes[-1]) for e in early] == [(1, FIRST)]
    late = quorum.add(gen, 0, (_event(FIRST, None, 0),))
    assert [(e.group_idx, e.block_hashes[-1]) for e in late] == [(0, FIRST), (0, SECOND)]


def test_the_orphan_check_is_keyed_by_group() -> None:
    """K4: a full-attention event whose parent only another group announced
    is an orphan in its own group's chain; a sliding-window group's sparse
    chain needs no parent."""
    config = _groups_config(GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 8))
    monitor = Monitor(config, only=("K4",))
    monitor.observe(Settled(Settlement(published=(
        _event(FIRST, None, 1), _event(SECOND, FIRST, 0)))))
    assert [f.invariant for f in monitor.findings] == ["K4"]
    assert "group 0" in monitor.findings[0].message
    monitor = Monitor(config, only=("K4",))
    monitor.observe(Settled(Settlement(published=(
        _event(FIRST, None, 0), _event(SECOND, FIRST, 0), _event(SECOND, FIRST, 1)))))
    assert monitor.findings == []


@pytest.mark.parametrize("groups, extra", [
    (("full", "swa:8"), {"alignment": 16, "put_step": 2}),  # hybrid with MLA-style striding
    (("full", "full"), {}),
    (("full", "swa:8"), {"alignment": 16, "setup": "pd"}),
])
def test_two_group_setups_run_clean_in_the_simulator(groups: tuple[str, ...],
                                                     extra: dict[str, object]) -> None:
    """With the hash-keyed quorum each of these runs published an orphan (K4
    on its first 40 requests); now every group's events arrive in chain order."""
    result = simulate(SimOptions(requests=40, groups=groups, **extra))  # type: ignore[arg-type]
    assert result.ok, result.findings[:2]
    assert result.figures["liveness_ok"]
    assert result.figures["events_published"] > 0


def test_the_sliding_window_group_stores_only_its_window_and_announces_it() -> None:
    """A window of 8 tokens in 16-token segments of 4-token blocks keeps the
    2 blocks before each boundary: of a 32-token prompt the sliding-window
    group stores chunks 2, 3, 6, 7 and announces exactly those, the full
    group all 8, each in chain order."""
    from kvstate.scenarios import prompt

    config = attrs.evolve(_groups_config(GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 8),
                                         world_size=2), save_decode_cache=True)
    h = Harness(config, "kvstate", num_blocks=64)
    h.add("a", prompt(33), max_new_tokens=1)
    h.step()
    h.run_ranks()
    h.settle()
    assert not h.monitor.findings
    hashes = HashChain(4, prompt(33)).hashes
    for group, chunks in ((0, range(8)), (1, (2, 3, 6, 7))):
        stored = {k.rpartition("@")[2] for k in h.store.objects if f"@group:{group}@" in k}
        assert stored == {hashes[c].hex() for c in chunks}, group
        announced = [e.block_hashes[-1] for e in h.published if e.group_idx == group]
        assert announced == [hashes[c] for c in chunks], group


def test_the_model_checker_explores_the_two_group_scope_exhaustively(tmp_path: Path) -> None:
    """Every interleaving of the hybrid scope (full attention + sliding window,
    striding, one fault): the default protocol stays silent; the hash-keyed
    quorum published a full-attention orphan 5 actions in; e2, which counts
    by value and never orders, does too."""
    from sim.explore.modelcheck.model import SCOPES
    from sim.explore.modelcheck.search import check

    clean = check(SCOPES["hybrid"], "kvstate", out_dir=str(tmp_path))
    assert clean.exhaustive and clean.violation is None
    assert clean.states > 100
    e2 = check(SCOPES["hybrid"], "e2", out_dir=str(tmp_path))
    assert e2.violation is not None and e2.violation.invariant == "K4"


@pytest.mark.parametrize("profile", ["hybrid", "hybrid-pd"])
def test_the_hypothesis_hybrid_profiles_are_clean_for_the_default_protocol(
        profile: str, tmp_path: Path) -> None:
    """The CI profile's fixed programs in the hybrid engine shapes (with
    striding, the hash-keyed quorum broke K4 in its first program)."""
    from sim.explore.fuzz import CI_EXAMPLES, CI_STEPS, fuzz

    result = fuzz("kvstate", budget=float("inf"), examples=CI_EXAMPLES, steps=CI_STEPS,
                  out_dir=str(tmp_path), profile=profile, derandomize=True)
    assert result.ok, result.message


@pytest.mark.parametrize("argv, why", [
    (["--groups", "full,swa"], "swa:W"),
    (["--groups", "full,swa:0"], "swa:W"),
    (["--groups", "full,,swa:8"], "expected 'full'"),
    (["--groups", "full,swa:8", "--alignment", "6"], "alignment"),
])
def test_bad_groups_are_a_usage_error(argv: list[str], why: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["sim", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    assert why in capsys.readouterr().err


# ---------------------------------------------------------------------------
# 6. Soak figures: a buggy protocol measured to the end, dedup and pins.

def test_keep_going_measures_e2_to_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --keep-going e2's run stops at its first violation, so its
    figures describe a few requests; with it every arrival is served and the
    violations are counted by invariant."""
    assert main(["sim", "--protocol", "e2", "--requests", "60", "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["figures"]
    assert main(["sim", "--protocol", "e2", "--requests", "60", "--keep-going", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    figures = out["figures"]
    assert first["arrivals"] < figures["arrivals"] == 60
    counted = figures["violations_by_invariant"]
    assert counted.get("S16", 0) > 1 and sum(counted.values()) == len(out["violations"])


def test_sim_reports_dedup_hits_and_pins() -> None:
    """The dedup hit rate counts the ranks' existence checks that found the
    key (the engine's own lookups are not saves); pins rise while jobs run and
    are all released at the end."""
    result = simulate(SimOptions(requests=60, seed=3))
    f = result.figures
    assert result.ok
    assert 0 < f["dedup_hits"] and 0.0 < f["dedup_hit_rate"] < 1.0
    assert f["peak_pins"] > 0 and f["pins_at_end"] == 0
