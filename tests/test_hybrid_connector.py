"""KvstateConnector serving a hybrid model inside vLLM 0.33.0's real Scheduler.

The rig's hybrid model (`adapters.vllm.rig.Rig` with ``sliding_window``):
full attention on layers 0 and 2, a sliding window on layers 1 and 3, two
KV-cache groups in vLLM's hybrid KV cache manager, which stays on only
because the connector declares ``SupportsHMA``. Against a real
mooncake_master: each engine writes a trace with the online monitor raising,
and every trace must pass ``kvstate check`` and replay identically.

Every test here is slow (the module is one of conftest's
``WHOLLY_SLOW_MODULES``: the default selection does not even collect it).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
slow = pytest.mark.slow

BS = 16
WINDOW = 32  # two blocks before a hit boundary: cdiv(WINDOW - 1, BS)
FULL, SWA = 0, 1  # the rig's groups


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from adapters.vllm.rig import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def store_config(mooncake_master, tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": mooncake_master.address,
                                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                "global_segment_size": "64mb", "local_buffer_size": "32mb"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    return path


class Engines:
    """Hybrid engines sharing one key namespace, each with its own trace;
    ``close`` checks and replays every trace. Engines stay up until then: a
    store client takes the objects in its segment with it."""

    def __init__(self, model_dir: str, tmp_path: Any, **extra: Any) -> None:
        self.model_dir = model_dir
        self.tmp_path = tmp_path
        self.extra = {"cache_prefix": f"h{uuid.uuid4().hex[:8]}", "kvstate_monitor": "raise",
                      **extra}
        self.rigs: list[Any] = []
        self.traces: list[str] = []

    def engine(self, num_blocks: int = 64, tp: int = 1, **config: Any) -> Any:
        from adapters.vllm.rig import Rig, make_vllm_config

        trace = str(self.tmp_path / f"engine{len(self.rigs)}.jsonl")
        extra = dict(self.extra, kvstate_trace=trace)
        vc = make_vllm_config(self.model_dir, extra=extra, num_blocks=num_blocks, tp=tp,
                              **config)
        rig = Rig(vc, num_blocks, sliding_window=WINDOW)
        self.rigs.append(rig)
        self.traces.append(trace)
        return rig

    def close(self) -> None:
        from sim.traces.check import check_trace
        from sim.traces.replay import replay_trace

        for rig in self.rigs:
            rig.close()
        self.rigs = []
        for trace in self.traces:
            checked = check_trace(trace)
            assert checked.ok, [str(f) for f in checked.findings][:5]
            replayed = replay_trace(trace)
            assert replayed.ok, replayed.divergence


@pytest.fixture
def engines(model_dir, tmp_path, store_config):
    made: list[Engines] = []

    def make(**extra: Any) -> Engines:
        e = Engines(model_dir, tmp_path, **extra)
        made.append(e)
        return e

    yield make
    for e in made:
        for rig in e.rigs:
            rig.close()


def tables(rig: Any, req_id: str) -> tuple[list[int], ...]:
    return rig.scheduler.kv_cache_manager.get_block_ids(req_id)


def settled(rig: Any) -> None:
    """No pins, no jobs, every engine block free again (one more step first:
    a rank forgets a generation whose last job outlived its finish then)."""
    rig.step()
    side = rig.connector.scheduler
    assert side.pins_held == 0 and not side.planner.jobs
    pool = rig.scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])


def stored(rig: Any, req_id: str) -> None:
    """Run ``req_id`` to its end on the first engine and let the saves land."""
    rig.run()
    rig.drain()
    rig.run()
    settled(rig)
    assert req_id in rig.finished


def admitted(rig: Any, req_id: str, timeout: float = 10.0) -> Any:
    """Step until ``req_id`` is scheduled (its asynchronous load landed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        so = rig.step()
        for new in so.scheduled_new_reqs:
            if new.req_id == req_id:
                return new
        time.sleep(0.002)
    raise AssertionError(f"{req_id!r} was not scheduled within {timeout} s")


def holds_every_group(rig: Any, req_id: str, tokens: list[int], hit: int) -> dict[int, list[int]]:
    """Check every rank's blocks of every group over the hit: a block the
    group holds has this prefix's bytes in each of the group's layers; a
    null block is one the group does not need. Returns the chunks each group
    holds."""
    held: dict[int, list[int]] = {}
    for group, table in enumerate(tables(rig, req_id)):
        held[group] = []
        for chunk in range(hit // BS):
            if table[chunk] == 0:
                continue
            held[group].append(chunk)
            for rank in range(len(rig.workers)):
                assert rig.block_holds(rank, table[chunk], tokens, chunk * BS, group), (
                    f"rank {rank} group {group} chunk {chunk} (block {table[chunk]}) holds "
                    "the wrong bytes")
    return held


def store_key(rig: Any, req_id: str, group: int, chunk: int, rank: int = 0) -> str:
    from kvstate.keys import key_for, key_prefix

    request = rig.requests[req_id]
    return key_for(key_prefix(rig.connector.kv_config, rank, group), request.block_hashes[chunk])


def remove(rig: Any, keys: list[str]) -> None:
    """Take keys out of the store (as an eviction would), through the
    binding of the scheduler's own client (`MooncakeStore` has no remove:
    the connector never removes)."""
    client = rig.connector.scheduler.store._store
    for key in keys:
        assert client.remove(key, True) == 0, key


# ----------------------------------------------------------------------


@slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_hybrid_engine_stores_every_group_and_a_second_loads_them(engines, tp) -> None:
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    e = engines()
    first = e.engine(tp=tp, kv_events=True)
    # vLLM's hybrid manager is on: two groups, each with its own tables.
    assert first.config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert isinstance(first.scheduler.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
    assert [g.kind.value for g in first.connector.kv_config.groups] == ["full", "sliding_window"]
    shared = prompt(64, salt=1)
    first.add("a", shared + prompt(7, salt=2), max_tokens=3)
    first.step()
    full, window = tables(first, "a")
    assert 0 not in full and 0 not in window and not set(full) & set(window)
    first.step()  # decode: the window left the prompt's first two blocks
    assert tables(first, "a")[FULL] == full
    assert tables(first, "a")[SWA][:2] == [0, 0] and tables(first, "a")[SWA][2:] == window[2:]
    stored(first, "a")
    totals = first.totals()
    # The prompt's four chunks in both groups, each rank its own namespace
    # (two KV heads: no replication at TP 2); saved before the window moved.
    assert totals["keys_put"] == 2 * 4 * tp
    assert totals["window_blocks_freed_before_save"] == 0
    # Each group's chunks published once every rank stored them.
    groups = sorted({ev.group_idx for ev in first.events})
    assert groups == [FULL, SWA]
    assert sum(len(ev.block_hashes) for ev in first.events) == 2 * 4

    second = e.engine(tp=tp)
    tokens = shared + prompt(5, salt=3)
    second.add("b", tokens, max_tokens=2)
    assert not second.step().scheduled_new_reqs  # parked: WAITING_FOR_REMOTE_KVS
    new = admitted(second, "b")
    assert new.num_computed_tokens == 64
    held = holds_every_group(second, "b", tokens, 64)
    # Full attention loaded every chunk; the window only the two before the
    # hit boundary (vLLM allotted the null block to the others).
    assert held == {FULL: [0, 1, 2, 3], SWA: [2, 3]}
    second.run()
    assert second.invalid_block_ids == set()
    assert second.totals()["keys_loaded"] == 6 * tp
    e.close()


@slow
def test_window_chunks_before_the_window_are_not_needed_and_a_missing_one_shortens_the_hit(
        engines) -> None:
    e = engines()
    first = e.engine()
    evicted_early, evicted_late = prompt(64, salt=4), prompt(64, salt=8)
    first.add("a", evicted_early + prompt(9, salt=5), max_tokens=2)
    first.add("z", evicted_late + prompt(9, salt=9), max_tokens=2)
    stored(first, "a")
    assert first.totals()["keys_put"] == 2 * 2 * 4
    # Gone from the store (evicted, or never stored, as upstream's default
    # retention leaves them): the window's first two chunks of one prefix,
    # the window's last chunk of the other. Full attention's all stay.
    remove(first, [store_key(first, "a", SWA, chunk) for chunk in (0, 1)])
    remove(first, [store_key(first, "z", SWA, 3)])

    second = e.engine()
    tokens = evicted_early + prompt(40, salt=6)
    second.add("b", tokens, max_tokens=2)
    # The whole aligned prefix: a hit at chunk 4's boundary needs the
    # window's chunks 2 and 3 only.
    assert admitted(second, "b").num_computed_tokens == 64
    assert holds_every_group(second, "b", tokens, 64) == {FULL: [0, 1, 2, 3], SWA: [2, 3]}
    second.run()
    second.drain()
    second.run()
    settled(second)
    totals = second.totals()
    assert totals["keys_loaded"] == 6 and totals["load_failures"] == 0
    # Its own save skipped the window's null blocks (nothing put back for
    # chunks 0 and 1); the 40-token suffix added chunks 4 and 5 to both
    # groups, the prefix's others were present.
    assert totals["keys_put"] == 4
    assert second.connector.scheduler.store.exists(
        [store_key(second, "b", SWA, c) for c in range(6)]) == [False, False] + [True] * 4

    # The window lacks chunk 3: no hit at chunk 4's boundary; chunks 1 and
    # 2 end the longest one (48 tokens), where full attention has chunks
    # 0 to 2 and the window needs chunks 1 and 2.
    tokens = evicted_late + prompt(3, salt=10)
    second.add("y", tokens, max_tokens=2)
    assert admitted(second, "y").num_computed_tokens == 48
    assert holds_every_group(second, "y", tokens, 48) == {FULL: [0, 1, 2], SWA: [1, 2]}
    second.run()
    assert second.invalid_block_ids == set()
    assert second.totals()["window_blocks_freed_before_save"] == 0
    e.close()


@slow
def test_a_failed_load_of_a_hybrid_engine_is_told_per_request_and_computed_afresh(
        engines) -> None:
    e = engines()
    first = e.engine()
    shared = prompt(64, salt=11)
    first.add("a", shared + prompt(7, salt=12), max_tokens=2)
    stored(first, "a")

    second = e.engine()
    side = second.workers[0].worker
    real_get = side.store.get

    def first_key_gone(keys: list[str], ptrs: Any, sizes: Any) -> list[int]:
        got = real_get(keys, ptrs, sizes)
        return [-704] + list(got[1:])  # Mooncake's "object not found"

    side.store.get = first_key_gone
    tokens = shared + prompt(5, salt=13)
    second.add("b", tokens, max_tokens=2)
    # vLLM takes no block ids of a failed load from an engine with several
    # groups (it raises): the load is told failed per request, vLLM drops
    # what it loaded and the request computes from its start.
    assert admitted(second, "b").num_computed_tokens == 0
    side.store.get = real_get
    assert second.invalid_block_ids == set()
    assert holds_every_group(second, "b", tokens, 64) == {FULL: [0, 1, 2, 3], SWA: [0, 1, 2, 3]}
    second.run()
    totals = second.totals()
    assert totals["loads_failed"] == 1 and totals["load_failures"] == 1
    assert totals["lookups"] == 1  # not looked up again after its load failed
    assert "b" in second.finished
    e.close()


@slow
def test_the_planner_is_told_each_window_block_vllm_frees(engines) -> None:
    """vLLM's sliding-window manager nulls and frees a running request's
    window blocks as its window moves; the connector reads what it nulled
    from vLLM's current tables and tells the planner with the request
    (``CachedRequest.freed_positions``, in the trace), each position once.
    The trace then checks and replays (its planner nulls them too)."""
    e = engines(save_decode_cache=True)
    rig = e.engine()
    rig.add("a", prompt(64, salt=21) + prompt(7, salt=22), max_tokens=40)
    nulled: set[int] = set()
    for _ in range(200):
        rig.step()
        if "a" in rig.finished:
            break
        nulled |= {i for i, b in enumerate(tables(rig, "a")[SWA]) if b == 0}
    assert "a" in rig.finished
    rig.drain()
    rig.run()
    trace = e.traces[0]
    e.close()
    told: list[int] = []
    with open(trace) as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("type") != "StepScheduled":
                continue
            for cached in record["step"]["cached"]:
                if cached["req_id"] == "a" and cached.get("freed_positions"):
                    assert cached["freed_positions"][FULL] == []
                    told.extend(cached["freed_positions"][SWA])
    # A prefix of the table, from the left, as the window moved over 100+
    # tokens of 16-token blocks (a 32-token window).
    assert len(nulled) >= 3 and nulled == set(range(len(nulled)))
    assert sorted(told) == sorted(nulled), "each freed position told once"


@slow
def test_the_fence_counts_a_window_block_freed_before_its_job_was_planned(
        engines, monkeypatch) -> None:
    """The default protocol plans a block's job in the step that computes
    it, so no test above reaches this; here vLLM's current table claims the
    window's first block was freed before the prompt's job."""
    e = engines()
    rig = e.engine()
    manager = rig.scheduler.kv_cache_manager
    real = manager.get_block_ids

    def freed_early(req_id: str) -> tuple[list[int], ...]:
        full, window = real(req_id)
        return full, [0] + window[1:]

    rig.add("a", prompt(40, salt=14), max_tokens=2)
    monkeypatch.setattr(manager, "get_block_ids", freed_early)
    rig.step()
    monkeypatch.setattr(manager, "get_block_ids", real)
    rig.run()
    rig.drain()
    assert rig.totals()["window_blocks_freed_before_save"] == 1
    e.close()


# ----------------------------------------------------------------------
# What the connector refuses when it starts, with the reason.


def _config(model_dir: str, groups: list[Any], **config: Any) -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from adapters.vllm.rig import hybrid_manager_on, make_vllm_config

    vc = make_vllm_config(model_dir, **config)
    hybrid_manager_on(vc)
    return vc, KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)


def _full(block_size: int = BS) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype=torch.float32)


def _window(block_size: int = BS) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype=torch.float32, sliding_window=WINDOW)


def _refusal(vc: Any, kv_cache_config: Any) -> str:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match="KvstateConnector does not support") as refused:
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kv_cache_config)
    return str(refused.value)


@slow
def test_a_mamba_group_is_refused_naming_what_the_model_cannot_state(model_dir) -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")
    vc, kv = _config(model_dir, [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], _full()),
                                 KVCacheGroupSpec(["model.layers.1.mixer"], mamba)])
    why = _refusal(vc, kv)
    assert "KV-cache group 1 (MambaSpec)" in why
    assert "boundary states and partial tails" in why and "cannot state or check" in why


@slow
@pytest.mark.parametrize(("case", "reason"), [
    ("block sizes", "KV-cache groups of different block sizes [16, 32]"),
    ("sync loads", "kvstate_load_async=false with several KV-cache groups"),
    ("consumer backfill", "save_decode_cache on a kv_consumer with a sliding-window group"),
])
def test_what_a_hybrid_engine_cannot_run_is_refused_at_start(model_dir, case, reason) -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    names = ["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]
    config: dict[str, Any] = {}
    window = _window()
    if case == "block sizes":
        window = _window(2 * BS)
    elif case == "sync loads":
        config["extra"] = {"kvstate_load_async": False}
    else:
        config.update(role="kv_consumer", extra={"save_decode_cache": True})
    vc, kv = _config(model_dir, [KVCacheGroupSpec(names[0], _full()),
                                 KVCacheGroupSpec(names[1], window)], **config)
    assert reason in _refusal(vc, kv)


@slow
def test_the_connector_config_has_one_group_spec_per_kv_cache_group(model_dir) -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from adapters.vllm.options import ConnectorOptions, connector_config
    from kvstate.config import GroupKind, GroupSpec

    vc, kv = _config(model_dir, [KVCacheGroupSpec(["a"], _full()),
                                 KVCacheGroupSpec(["b"], _window()),
                                 KVCacheGroupSpec(["c"], _full())])
    config = connector_config(vc, kv, ConnectorOptions())
    assert config.groups == (GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, WINDOW),
                             GroupSpec())
    assert config.block_size == BS and config.lcm_block_size == BS
