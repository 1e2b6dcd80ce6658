"""KvstateConnector inside vLLM 0.33.0's real Scheduler, against a real mooncake_master.

No model and no GPU: `adapters.vllm.rig` runs vLLM's scheduler and KV cache
manager, builds the worker connectors, and plays the forward pass by writing
prefix-derived values into CPU KV tensors. Every scenario runs with the online
monitor raising on any invariant, writes a trace, and that trace must pass
``kvstate check`` and replay identically with ``kvstate replay``.
"""

from __future__ import annotations

import json
import time
import uuid

import attrs
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

pytest.importorskip("vllm")
pytest.importorskip("torch")

from adapters.master import Master  # noqa: E402
from adapters.vllm.rig import Rig, make_vllm_config, tiny_model_dir  # noqa: E402
from sim.traces.check import check_trace  # noqa: E402
from sim.traces.replay import replay_trace  # noqa: E402

BS = 16


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def store_config(mooncake_master, tmp_path, monkeypatch):
    """MOONCAKE_CONFIG_PATH for the connectors, pointing at the session master."""
    return _store_config(mooncake_master.address, tmp_path, monkeypatch)


def _store_config(address, tmp_path, monkeypatch, segment: str = "64mb"):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": address, "metadata_server": "P2PHANDSHAKE",
                                "protocol": "tcp", "global_segment_size": segment,
                                "local_buffer_size": "32mb"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    return path


class Engines:
    """Engines of one test share a key namespace (their own cache prefix) and
    each writes its own trace; ``close`` checks and replays every trace."""

    def __init__(self, model_dir, tmp_path, **extra):
        self.model_dir = model_dir
        self.tmp_path = tmp_path
        self.extra = {"cache_prefix": f"t{uuid.uuid4().hex[:8]}", "kvstate_monitor": "raise",
                      **extra}
        self.rigs: list[Rig] = []
        self.traces: list[str] = []

    def engine(self, num_blocks: int = 64, tp: int = 1, put_step: int = 1, **config) -> Rig:
        trace = str(self.tmp_path / f"engine{len(self.rigs)}.jsonl")
        extra = dict(self.extra, kvstate_trace=trace)
        if put_step > 1:
            extra["kvstate_put_step"] = put_step
        head_dim = config.pop("head_dim", 8)
        vc = make_vllm_config(self.model_dir, extra=extra, num_blocks=num_blocks, tp=tp, **config)
        rig = Rig(vc, num_blocks, put_step=put_step, head_dim=head_dim)
        self.rigs.append(rig)
        self.traces.append(trace)
        return rig

    def close(self, *, check: bool = True) -> None:
        for rig in self.rigs:
            rig.close()
        if not check:
            return
        for trace in self.traces:
            checked = check_trace(trace)
            assert checked.ok, [str(v) for v in checked.violations][:5]
            replayed = replay_trace(trace)
            assert replayed.ok, replayed.divergence


@pytest.fixture
def engines(model_dir, tmp_path, store_config):
    made: list[Engines] = []

    def make(**extra) -> Engines:
        e = Engines(model_dir, tmp_path, **extra)
        made.append(e)
        return e

    yield make
    for e in made:
        for rig in e.rigs:
            rig.close()


def settled(rig: Rig) -> None:
    """Nothing left: no pins, no jobs, every engine block free again. A rank
    forgets a finished generation whose last job was still running when the
    finish arrived at its next step (upstream's deferred delete): one more
    engine step comes first."""
    rig.step()
    side = rig.connector.scheduler
    assert side.pins_held == 0
    assert not side.planner.jobs
    pool = rig.scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
    for worker in rig.workers:
        assert not worker.worker.executor.queue and len(worker.worker.executor.ledger) == 0


def admitted(rig: Rig, req_id: str, timeout: float = 10.0):
    """Step until ``req_id`` is scheduled; return its new-request data.
    An asynchronous load parks it first (vLLM's ``WAITING_FOR_REMOTE_KVS``):
    it is scheduled in a step after the receive thread landed the load and
    ``get_finished`` named it. A synchronous load schedules it at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        so = rig.step()
        for new in so.scheduled_new_reqs:
            if new.req_id == req_id:
                return new
        time.sleep(0.002)
    raise AssertionError(f"{req_id!r} was not scheduled within {timeout} s")


def loaded_blocks_hold(rig: Rig, req_id: str, tokens: list[int], hit: int) -> int:
    """Check every rank's copy of the blocks a request loaded; return how many."""
    (table,) = rig.scheduler.kv_cache_manager.get_block_ids(req_id)
    for rank in range(len(rig.workers)):
        for index in range(hit // BS):
            assert rig.block_holds(rank, table[index], tokens, index * BS), (
                f"rank {rank} block {table[index]} (chunk {index}) holds the wrong bytes")
    return hit // BS


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_round_trip_a_second_engine_loads_what_the_first_stored(engines, load_async) -> None:
    e = engines(save_decode_cache=False, kvstate_load_async=load_async)
    first = e.engine()
    shared = prompt(64, salt=1)
    first.add("a", shared + prompt(7, salt=2), max_tokens=3)
    first.run()
    first.drain()
    first.run()
    settled(first)
    totals = first.totals()
    assert totals["keys_put"] == 4  # the prompt's four full blocks, once each

    second = e.engine()
    tokens = shared + prompt(5, salt=3)
    second.add("b", tokens, max_tokens=2)
    parked = second.step()
    if load_async:
        assert not parked.scheduled_new_reqs  # waits in WAITING_FOR_REMOTE_KVS
        new = admitted(second, "b")
    else:
        (new,) = parked.scheduled_new_reqs
    assert new.num_computed_tokens == 64  # four blocks from the store
    assert loaded_blocks_hold(second, "b", tokens, 64) == 4
    second.run()
    assert second.invalid_block_ids == set()
    assert second.totals()["keys_loaded"] == 4
    e.close()
    # The engine smoke script counts store hits from a trace the same way.
    from adapters.vllm.engine_smoke import store_hits

    assert store_hits(e.traces[1]) == {"lookups": 1, "lookups_with_hits": 1, "hit_tokens": 64}


def test_decode_phase_kv_is_saved_and_served(engines) -> None:
    e = engines(save_decode_cache=True)
    first = e.engine()
    first.add("a", prompt(20, salt=4), max_tokens=40)
    first.run()
    first.drain()
    first.run()
    settled(first)
    request = first.requests["a"]
    full = list(request.all_token_ids)
    assert len(full) == 60
    # Saved: the prompt's one full block at prefill, then each block decode filled.
    assert first.totals()["keys_put"] == 59 // BS

    second = e.engine()
    second.add("b", full[:48] + [7, 7, 7], max_tokens=3)
    assert admitted(second, "b").num_computed_tokens == 48  # decode-phase blocks hit
    assert loaded_blocks_hold(second, "b", full[:48] + [7, 7, 7], 48) == 3
    second.run()
    e.close()


def test_preemption_from_a_small_block_pool_leaves_nothing_pinned(engines) -> None:
    e = engines(save_decode_cache=True)
    rig = e.engine(num_blocks=12)
    for i in range(3):
        rig.add(f"r{i}", prompt(40, salt=10 + i), max_tokens=40)
    rig.run()
    rig.drain()
    rig.run()
    assert sum(r.num_preemptions for r in rig.requests.values()) > 0
    assert sorted(rig.finished) == ["r0", "r1", "r2"]
    settled(rig)
    e.close()


def test_the_recorder_can_write_only_what_vllm_shows(engines) -> None:
    """``kvstate_trace_layer: observed``: no generations, no rank-state
    writes, no verdicts (specs/trace.md); the trace of a preemption-heavy run
    still checks clean and replays, the checker numbering the lifetimes."""
    e = engines(save_decode_cache=True, kvstate_trace_layer="observed")
    rig = e.engine(num_blocks=12)
    for i in range(3):
        rig.add(f"r{i}", prompt(40, salt=30 + i), max_tokens=30)
    rig.run()
    rig.drain()
    rig.run()
    assert sum(r.num_preemptions for r in rig.requests.values()) > 0
    e.close()  # check_trace and replay_trace, as for every trace here
    with open(e.traces[0]) as handle:
        text = handle.read()
    for internal in ('"generation"', '"StateWritten"', '"confirmed_offset"', '"started"'):
        assert internal not in text
    assert '"preempted":["r' in text  # the scheduler's own output is there


def test_request_id_reused_in_the_very_next_step(engines) -> None:
    e = engines(save_decode_cache=True)
    rig = e.engine()
    rig.add("a", prompt(40, salt=20), max_tokens=2)
    while "a" not in rig.finished:
        rig.step()
    rig.add("a", prompt(50, salt=21), max_tokens=20)  # same id, a stale job may be in flight
    rig.run()
    rig.drain()
    rig.run()
    settled(rig)
    e.close()


@pytest.mark.parametrize("put_step", [1, 2])
def test_two_ranks_store_and_load_their_own_shards(engines, put_step) -> None:
    e = engines(save_decode_cache=True)
    first = e.engine(tp=2, put_step=put_step)
    shared = prompt(64, salt=30)
    first.add("a", shared + [1, 2, 3], max_tokens=20)
    first.run()
    first.drain()
    first.run()
    settled(first)
    stored = first.totals()["keys_put"]
    # put_step 1: every rank stores every chunk; 2: the ranks split the chunks.
    assert stored == (2 * 5 if put_step == 1 else 5)

    second = e.engine(tp=2, put_step=put_step)
    tokens = shared + [4, 5]
    second.add("b", tokens, max_tokens=3)
    assert admitted(second, "b").num_computed_tokens == 64
    loaded_blocks_hold(second, "b", tokens, 64)
    second.run()
    e.close()


def test_a_full_store_puts_minus_200_and_the_engine_keeps_serving(model_dir, tmp_path,
                                                                  monkeypatch) -> None:
    master = Master()  # its own master: capacity is what the test's clients contribute
    try:
        _store_config(master.address, tmp_path, monkeypatch, segment="16mb")
        e = Engines(model_dir, tmp_path, save_decode_cache=True)
        # Blocks of 512 KiB and 2 x 16 MiB of segments: about 60 keys fit.
        rig = e.engine(num_blocks=140, head_dim=1024)
        for i in range(4):
            rig.add(f"r{i}", prompt(480, salt=40 + i), max_tokens=20)
        rig.run()
        rig.drain()
        rig.run()
        totals = rig.totals()
        assert totals["pressure_rejections"] > 0
        assert sorted(rig.finished) == ["r0", "r1", "r2", "r3"]
        settled(rig)
        e.close()
    finally:
        master.stop()


def test_a_put_that_raises_is_reported_and_retried(engines) -> None:
    e = engines(save_decode_cache=True)
    rig = e.engine()
    store = rig.workers[0].worker.store
    real_put = store.put
    calls = {"n": 0}

    def flaky_put(keys, ptrs, sizes):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("injected: transfer engine lost the connection")
        return real_put(keys, ptrs, sizes)

    store.put = flaky_put
    rig.add("a", prompt(40, salt=50), max_tokens=30)
    rig.run()
    rig.drain()
    rig.run()
    totals = rig.totals()
    assert totals["store_errors"] == 1
    assert totals["keys_put"] == 69 // BS  # the failed chunks were stored by a later job
    settled(rig)
    e.close()


def test_a_store_answer_short_of_its_keys_fails_the_job_not_the_send_thread(engines,
                                                                             caplog) -> None:
    # One existence answer too few (a store or binding bug). The send thread
    # used to die on it (the executor refuses it outside the thread's try),
    # leaving the job's blocks pinned and the engine unable to drain, without
    # a word; now the call counts as failed, is logged, and the job reports.
    e = engines(save_decode_cache=True)
    rig = e.engine()
    worker = rig.workers[0].worker
    real_exists = worker.store.exists
    calls = {"n": 0}

    def short_exists(keys):
        calls["n"] += 1
        answers = list(real_exists(keys))
        return answers[:-1] if calls["n"] == 1 else answers

    worker.store.exists = short_exists
    with caplog.at_level("WARNING", logger="kvstate.vllm"):
        rig.add("a", prompt(40, salt=80), max_tokens=30)
        rig.run()
        rig.drain()
        rig.run()
    assert worker._thread.is_alive()
    assert rig.totals()["store_errors"] == 1
    assert "a store call of job 1 failed: RuntimeError: the store gave 1 answers for 2 keys" \
        in caplog.text, caplog.text
    settled(rig)
    e.close()


# ---------------------------------------------------------------------------
# The load path (asynchronous loads, the default) on vLLM 0.33.0's Scheduler:
# its recovery (``_handle_invalid_blocks``, ``_update_waiting_for_remote_kv``,
# the delayed free of an aborted request's blocks) is vLLM's own code here.

OBJECT_NOT_FOUND = -704


def failing_gets(rig: Rig, chunks, ranks=None) -> dict[str, int]:
    """Every rank's (or ``ranks``') reads of the chunks ``chunks`` (a load
    from chunk 0) answer -704 and leave the block zeroed; returns a count of
    failed reads."""
    import ctypes

    failed = {"reads": 0}
    for rank, worker in enumerate(rig.workers):
        if ranks is not None and rank not in ranks:
            continue
        store = worker.worker.store
        real_get = store.get

        def get(keys, ptrs, sizes, real_get=real_get):
            got = list(real_get(keys, ptrs, sizes))
            for i, (buffers, lengths) in enumerate(zip(ptrs, sizes)):
                if chunks is all or i in chunks:
                    for ptr, length in zip(buffers, lengths):
                        ctypes.memset(ptr, 0, length)
                    got[i] = OBJECT_NOT_FOUND
                    failed["reads"] += 1
            return got

        store.get = get
    return failed


def stored_prefix(e: Engines, shared: list[int]) -> None:
    first = e.engine()
    first.add("a", shared + [1, 2, 3], max_tokens=2)
    first.run()
    first.drain()
    first.run()
    settled(first)
    assert first.totals()["keys_put"] == len(shared) // BS


@pytest.mark.parametrize("position", [0, 2, 3], ids=["first", "middle", "last"])
def test_an_async_load_failing_at_a_block_resumes_from_it(engines, position) -> None:
    """The get of one chunk answers -704 (gone since the lookup): vLLM
    truncates the request to that block, caches the valid prefix, and
    schedules it from there; the failed block is never served as loaded.
    When the first block failed vLLM frees the blocks and schedules the
    request afresh: the connector asks the store nothing again (it lost no
    hit) instead of loading the same failing key forever."""
    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=60)
    stored_prefix(e, shared)
    second = e.engine()
    failing_gets(second, {position})
    tokens = shared + [4, 5]
    second.add("b", tokens, max_tokens=3)
    new = admitted(second, "b")
    assert new.num_computed_tokens == position * BS
    if position:
        loaded_blocks_hold(second, "b", tokens, position * BS)
    second.run()
    assert second.invalid_block_ids
    totals = second.totals()
    assert totals["lookups"] == 1 and totals["loads_failed"] == 1
    assert totals["lookups_skipped_after_failed_load"] == (1 if position == 0 else 0)
    assert "b" in second.finished
    second.drain()
    settled(second)
    e.close()


def test_requests_sharing_a_prefix_wait_for_one_load_of_it(engines) -> None:
    """Three requests admitted together share a four-block prefix in the
    store. vLLM caches a loading request's blocks only once its load landed,
    so each used to load the prefix itself; the connector answers "ask
    again" for a request whose next block another request's load fills, and
    the later two find the prefix in vLLM's own cache."""
    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=64)
    stored_prefix(e, shared)
    second = e.engine()
    for i in range(3):
        second.add(f"b{i}", shared + [4, 5, i], max_tokens=3)
    second.run()
    totals = second.totals()
    assert totals["keys_loaded"] == 4  # the prefix, once: the later two hit vLLM's cache
    assert totals["lookups"] == 3 and totals["lookups_deferred"] > 0
    assert sorted(second.finished) == ["b0", "b1", "b2"]
    second.drain()
    settled(second)
    e.close()


def test_an_async_load_failing_on_one_rank_of_two_resumes_both_at_the_failed_block(
        engines) -> None:
    """TP 2: rank 1's get of chunk 2 fails, rank 0's load is whole. vLLM
    counts a load finished once both ranks named it, and unions their failed
    blocks: the request is scheduled from block 2 on both ranks, and every
    rank's kept blocks hold its own shard."""
    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=66)
    first = e.engine(tp=2)
    first.add("a", shared + [1, 2, 3], max_tokens=2)
    first.run()
    first.drain()
    first.run()
    settled(first)
    second = e.engine(tp=2)
    failing_gets(second, {2}, ranks={1})
    tokens = shared + [4, 5]
    second.add("b", tokens, max_tokens=3)
    assert admitted(second, "b").num_computed_tokens == 2 * BS
    loaded_blocks_hold(second, "b", tokens, 2 * BS)
    second.run()
    totals = second.totals()
    assert totals["load_failures"] == 1 and totals["loads_failed"] == 1
    assert "b" in second.finished
    second.drain()
    settled(second)
    e.close()


def test_a_store_that_says_present_but_never_serves_costs_one_load(engines) -> None:
    """The master keeps answering "present" while every get fails (a broken
    data plane): the first request loads, fails and computes; the two that
    share its prefix waited for that load and find the prefix in vLLM's
    cache once it computed — one failed load in all, then progress."""
    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=61)
    stored_prefix(e, shared)
    second = e.engine()
    failed = failing_gets(second, all)
    for i in range(3):
        second.add(f"b{i}", shared + [4, 5, i], max_tokens=3)
    second.run()
    assert sorted(second.finished) == ["b0", "b1", "b2"]
    totals = second.totals()
    assert totals["lookups"] == 3 and totals["loads_failed"] == 1
    assert failed["reads"] == 4
    second.drain()
    settled(second)
    e.close()


def test_with_policy_fail_a_failed_async_load_ends_the_request(engines) -> None:
    from vllm.v1.request import RequestStatus

    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=62)
    stored_prefix(e, shared)
    second = e.engine(kv_load_failure_policy="fail")
    failing_gets(second, {1})
    second.add("b", shared + [4, 5], max_tokens=3)
    second.run()
    assert second.requests["b"].status == RequestStatus.FINISHED_ERROR
    settled(second)
    e.close()


def test_a_request_aborted_while_its_load_is_in_flight_frees_its_blocks_once_it_lands(
        engines) -> None:
    """vLLM keeps an aborted request's blocks while its load may still write
    them (``finish_requests``: delayed free for ``WAITING_FOR_REMOTE_KVS``)
    and frees them when ``get_finished`` names it: the receive thread must
    land every load, an abandoned one included, or the blocks leak."""
    import threading

    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=63)
    stored_prefix(e, shared)
    second = e.engine()
    store = second.workers[0].worker.store
    real_get = store.get
    entered, release = threading.Event(), threading.Event()

    def slow_get(keys, ptrs, sizes):
        entered.set()
        release.wait(10)
        return real_get(keys, ptrs, sizes)

    store.get = slow_get
    second.add("b", shared + [4, 5], max_tokens=3)
    second.step()
    assert entered.wait(10)
    (table,) = second.scheduler.kv_cache_manager.get_block_ids("b")
    second.abort("b")
    for _ in range(3):
        second.step()
    pool = second.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].ref_cnt > 0 for b in table)  # the load may still write them
    release.set()
    # Nothing is waiting or running: vLLM would step on only for other
    # requests. Step until the landed load is reported and the blocks free.
    deadline = time.monotonic() + 10
    while any(pool.blocks[b].ref_cnt for b in table) and time.monotonic() < deadline:
        second.step()
        time.sleep(0.002)
    assert second.totals()["keys_loaded"] == 4
    settled(second)  # every block free again
    e.close()


def test_a_get_that_outlives_its_timeout_keeps_its_blocks_until_it_returns(engines) -> None:
    """A get that did not return within ``kvstate_store_timeout`` may still
    write into the blocks it was handed. The load is failed only once the
    call returned: until then the request stays parked and vLLM holds its
    blocks (freeing them would hand them to another request under a late
    write). Then it computes, and everything settles."""
    import threading

    e = engines(save_decode_cache=False)
    shared = prompt(64, salt=65)
    stored_prefix(e, shared)
    second = e.engine()
    worker = second.workers[0].worker
    release = threading.Event()

    class HangingGets:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
            release.wait(20)
            return self.real.batch_get_into_multi_buffers(keys, ptrs, sizes)

    worker.store.timeout = 0.2
    worker.store._client.binding = HangingGets(worker.store._client.binding)
    second.add("b", shared + [4, 5], max_tokens=3)
    second.step()
    (table,) = second.scheduler.kv_cache_manager.get_block_ids("b")
    pool = second.scheduler.kv_cache_manager.block_pool
    # Until the get timed out (0.2 s after it started) and a while after.
    deadline = time.monotonic() + 20
    while worker.store.broken is None and time.monotonic() < deadline:
        assert not second.step().scheduled_new_reqs  # still parked
        time.sleep(0.01)
    assert worker.store.broken is not None
    for _ in range(50):
        assert not second.step().scheduled_new_reqs  # parked: the get may still write
        time.sleep(0.01)
    assert all(pool.blocks[b].ref_cnt > 0 for b in table)
    release.set()
    assert admitted(second, "b").num_computed_tokens == 0  # the load failed: computed
    second.run()
    assert "b" in second.finished
    settled(second)
    e.close()


def test_a_killed_master_costs_hits_not_correctness(model_dir, tmp_path, monkeypatch) -> None:
    master = Master()
    _store_config(master.address, tmp_path, monkeypatch)
    e = Engines(model_dir, tmp_path, save_decode_cache=True, kvstate_store_timeout=1.0)
    try:
        rig = e.engine()
        rig.add("a", prompt(40, salt=60), max_tokens=5)
        rig.run()
        rig.drain()
        master.stop()  # the store is gone; the engine must keep serving
        rig.add("b", prompt(40, salt=60) + [9], max_tokens=20)
        rig.add("c", prompt(64, salt=61), max_tokens=20)
        rig.run(max_steps=20000)
        assert sorted(rig.finished) == ["a", "b", "c"]
        assert rig.totals()["store_errors"] > 0
        settled(rig)
        e.close()
    finally:
        master.stop()


def test_worker_built_through_vllms_own_initialisation(model_dir, tmp_path, store_config) -> None:
    """The worker role as vLLM's model runner gets it: distributed state
    initialised (gloo, world size 1), then ``ensure_kv_transfer_initialized``."""
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized

    from adapters.master import free_port
    from adapters.vllm.connector import KvstateConnector
    from adapters.vllm.rig import make_kv_cache_config

    trace = str(tmp_path / "engine.jsonl")
    extra = {"cache_prefix": f"t{uuid.uuid4().hex[:8]}", "kvstate_trace": trace,
             "kvstate_monitor": "raise"}
    from vllm.config import set_current_vllm_config

    vc = make_vllm_config(model_dir, extra=extra, num_blocks=32)
    with set_current_vllm_config(vc):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ps.ensure_model_parallel_initialized(1, 1)
        ensure_kv_transfer_initialized(vc, make_kv_cache_config(32, BS))
    worker = get_kv_transfer_group()
    assert isinstance(worker, KvstateConnector) and worker.worker is not None
    rig = Rig(vc, 32, workers=[worker])
    try:
        rig.add("a", prompt(40, salt=70), max_tokens=4)
        rig.run()
        rig.drain()
        rig.run()
        assert rig.totals()["keys_put"] == 2
        settled(rig)
    finally:
        rig.close()
        import vllm.distributed.kv_transfer.kv_transfer_state as state

        state._KV_CONNECTOR_AGENT = None
    assert check_trace(trace).ok and replay_trace(trace).ok


def test_bad_extra_config_is_refused_with_the_field(model_dir, store_config) -> None:
    with pytest.raises(ValueError, match="kvstate_protocol.*unknown protocol"):
        Rig(make_vllm_config(model_dir, extra={"kvstate_protocol": "e9"}), 16)
    with pytest.raises(ValueError, match="unknown kvstate field"):
        Rig(make_vllm_config(model_dir, extra={"kvstate_montior": "raise"}), 16)


def test_an_untested_vllm_version_is_refused_at_start(model_dir, store_config,
                                                      monkeypatch) -> None:
    import vllm

    monkeypatch.delenv("KVSTATE_ALLOW_UNTESTED_VLLM", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(RuntimeError, match="tested with vLLM 0.32, 0.33; this is vLLM '0.35.0'"):
        Rig(make_vllm_config(model_dir), 16)


@pytest.mark.parametrize("writer", ["upstream", "kvstate"])
def test_interop_with_upstreams_mooncake_store_connector(writer) -> None:
    """One master, two connectors (`adapters.vllm.interop`): the other one
    finds all four shared blocks and loads exactly the writer's bytes. Same
    keys (the engine's sha256 block hashes in upstream's key format) and the
    same value layout (every layer's block, in layer order). Run in a
    subprocess: upstream's worker threads would keep this one alive. A fresh
    master each time: a finished process's segment lingers at the master for
    its client TTL, and puts placed there vanish with it."""
    import subprocess
    import sys

    master = Master()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "adapters.vllm.interop", "--master", master.address,
             "--writer", writer], capture_output=True, text=True, timeout=300)
    finally:
        master.stop()
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(lines[-1])
    assert result["hit_tokens"] == 64, result
    assert result["blocks_with_writer_bytes"] == 4, result
    assert result["load_errors"] == [], result



def test_engine_specs_configure_vllm_and_both_connectors(tmp_path, monkeypatch) -> None:
    """What `adapters.vllm.engine` hands vLLM before any engine starts: a
    kv_transfer_config vLLM's own config class accepts for either connector,
    and an engine store file (no store memory in the engine, upstream's mode
    'standalone-store') that kvstate's and upstream's config readers both
    take the same way."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    from adapters.mooncake import MooncakeConfig
    from adapters.store_server import engine_store_config
    from adapters.vllm.engine import EngineRequest, EngineSpec, Wave, transfer_config
    from adapters.vllm.engine_smoke import smoke_prompts
    from adapters.vllm.options import ConnectorOptions

    prompts = smoke_prompts(batch=3, prefix=32, suffix=4)
    assert len({tuple(p[:32]) for p in prompts}) == 1 and len({tuple(p) for p in prompts}) == 3
    wave = Wave([EngineRequest("a", prompts[0], 4), EngineRequest("a", prompts[1], 4, "a")])
    trace = str(tmp_path / "t.jsonl")
    spec = EngineSpec(model="m", waves=[wave], connector="kvstate",
                      extra={"save_decode_cache": True, "kvstate_trace": trace})
    assert EngineSpec.from_json(spec.to_json()) == spec
    transfer = KVTransferConfig(**transfer_config(spec))
    assert transfer.kv_connector == "KvstateConnector"
    options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
    assert options.save_decode_cache and options.trace == trace
    upstream = KVTransferConfig(**transfer_config(attrs.evolve(spec, connector="mooncake",
                                                               extra={})))
    assert upstream.kv_connector == "MooncakeStoreConnector"
    assert transfer_config(attrs.evolve(spec, connector=None)) is None
    with pytest.raises(ValueError, match="EngineSpec.connector='lmcache'"):
        attrs.evolve(spec, connector="lmcache")

    path = engine_store_config(tmp_path / "mc.json", "127.0.0.1:5555")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", path)
    ours = MooncakeConfig.from_env()
    theirs = MooncakeStoreConfig.load_from_config()
    assert ours.master_server_address == theirs.master_server_address == "127.0.0.1:5555"
    assert ours.global_segment_size == theirs.global_segment_size == 0
    assert ours.mode == theirs.mode == "standalone-store"


def test_bench_vllm_measures_both_connectors_at_each_context() -> None:
    """`kvstate bench vllm`'s machinery on a tiny shape: every connector at
    every context gets a cost and a metadata size, and the process exits
    (upstream's lookup socket is closed, not left to block the collector)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "adapters.vllm.bench", "--json", "--context", "64",
         "--context", "256", "--requests", "4", "--world-size", "2", "--repeats", "2"],
        capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    rows = json.loads(lines[-1])["rows"]
    assert {(r["kind"], r["context"]) for r in rows} == {
        (kind, context) for kind in ("upstream", "upstream+observer", "kvstate",
                                     "kvstate+monitor")
        for context in (64, 256)}
    for row in rows:
        assert row["us_per_request_step"] > 0 and row["meta_bytes_per_job"] > 0, row
        assert row["decode_steps"] == 32 and row["jobs"] > 0, row
