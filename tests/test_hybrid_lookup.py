"""Lookups and loads in a hybrid model (full attention plus a sliding window).

A sliding-window group stores only the blocks some aligned hit needs (its
store mask), so a lookup that wants every group's key of every chunk never
hits: the store was safe but useless to hybrid models, and their load path
never ran. vLLM 0.33.0's Mooncake store connector looks a window group up only
where its lookup mask covers a chunk and hits where the window before the hit
boundary is held (``MooncakeStoreWorker.lookup``,
``MooncakeStoreCoordinator.find_longest_cache_hit``); the engine gives a hit's
blocks before the window the null block (``SlidingWindowManager``).
"""

from __future__ import annotations

import attrs

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec
from kvstate.harness import Harness
from kvstate.invariants import Monitor
from kvstate.keys import chunk_hash, key_for, key_prefix
from kvstate.memory_store import MemoryStore
from kvstate.observations import Allocated, LoadDone, LookupDone, PutDone
from kvstate.records import NULL_BLOCK_ID
from kvstate.scenarios import ScriptedAnswers, prompt, run
from kvstate.store_codes import StoreCode

SWA = GroupSpec(GroupKind.SLIDING_WINDOW, 8)
# Blocks of 4 tokens, stored prefixes aligned to 16: the window group keeps the
# 2 blocks before each boundary (a window of 8 needs the 7 tokens before it).
HYBRID = ConnectorConfig(block_size=4, world_size=2, groups=(GroupSpec(), SWA), alignment=16)
SINGLE = ConnectorConfig(block_size=4, world_size=2, alignment=16)


def _repeat(config: ConnectorConfig, variant: str = "kvstate", store: MemoryStore | None = None,
            *, load_async: bool = False, evict_after_load: bool = False,
            n: int = 33) -> Harness:
    """Request "a" stores an ``n``-token prompt; "b" repeats it with a lookup.
    ``evict_after_load``: the store forgets everything once "b" loaded, so b's
    own saves put its loaded blocks again and K1 judges their content."""
    h = Harness(config, variant, num_blocks=64, store=store)
    h.add("a", prompt(n), max_new_tokens=2)
    h.settle()
    h.add("b", prompt(n), max_new_tokens=6, lookup=True, load_async=load_async)
    if evict_after_load:
        h.step()
        h.run_ranks()
        h.step()
        assert [o for o in h.log if isinstance(o, LoadDone)], "b loaded nothing"
        for key in list(h.store.objects):
            h.evict(key)
    h.settle()
    return h


def _lookup(h: Harness, req_id: str) -> LookupDone:
    return next(o for o in h.log if isinstance(o, LookupDone) and o.req_id == req_id)


def test_a_repeated_prompt_hits_in_a_hybrid_model_as_with_one_group() -> None:
    single = _repeat(SINGLE)
    hybrid = _repeat(HYBRID)
    assert single["b"].hit == 32
    assert hybrid["b"].hit == 32, "the window group's unstored blocks blocked the hit"
    assert hybrid.monitor.findings == []
    # Looked up as upstream does: the window group only where its mask covers
    # a chunk (chunks 2, 3, 6, 7 of 8), in both namespaces.
    keys = _lookup(hybrid, "b").keys
    assert len(keys) == 2 * (8 + 4)
    # The window group's blocks before the window are the null block, the
    # window's two blocks are real and loaded; nothing failed.
    alloc = next(o for o in hybrid.log if isinstance(o, Allocated) and o.req_id == "b")
    assert alloc.num_external_tokens == 32
    assert alloc.block_ids[1][:6] == (NULL_BLOCK_ID,) * 6
    assert NULL_BLOCK_ID not in alloc.block_ids[1][6:] and NULL_BLOCK_ID not in alloc.block_ids[0]
    loads = [o for o in hybrid.log if isinstance(o, LoadDone)]
    assert len(loads) == 2 and all(o.failed_block_ids == () for o in loads)


def test_a_hybrid_load_is_verified_by_the_monitor() -> None:
    """b's loaded blocks are put again once the store forgot them: K1 compares
    each put's content (the loaded block's) with the key's prefix shard."""
    decode_saving = attrs.evolve(HYBRID, save_decode_cache=True)  # b saves from token 0
    for load_async in (False, True):
        h = _repeat(decode_saving, evict_after_load=True, load_async=load_async)
        assert h["b"].hit == 32
        assert h.monitor.findings == [], load_async
        reput = {(o.rank, o.group, o.chunk_id) for o in h.log
                 if isinstance(o, PutDone) and o.req_id == "b" and o.accepted and o.content}
        loaded = {(r, 0, c) for r in (0, 1) for c in range(8)} | {
            (r, 1, c) for r in (0, 1) for c in (6, 7)}
        assert loaded <= reput, sorted(loaded - reput)
        assert not {(r, 1, c) for r in (0, 1) for c in (0, 1, 4, 5)} & reput  # null blocks


def test_a_whole_aligned_prompt_hit_is_searched_again_below_its_last_token() -> None:
    """Upstream: a hit covering the prompt is redone at
    ``align_lookup_length(num_tokens - 1)``, an aligned boundary whose window
    the store holds (16 here); one group keeps kvstate's rule (28)."""
    assert _repeat(SINGLE, n=32)["b"].hit == 28
    hybrid = _repeat(HYBRID, n=32)
    assert hybrid["b"].hit == 16
    assert hybrid.monitor.findings == []


def test_lookup_first_namespace_is_still_caught_in_a_hybrid_model() -> None:
    """Rank 1's puts all fail: only namespace 0 holds the prompt. The mutant
    that looks up namespace 0 alone hits anyway (S20); kvstate misses."""
    def failing_rank1() -> MemoryStore:
        return MemoryStore(ScriptedAnswers().when("put", 1, lambda n, k: True,
                                                  StoreCode.TRANSFER_FAIL))
    caught = _repeat(HYBRID, "lookup-first-namespace", failing_rank1())
    assert caught["b"].hit == 32
    assert "S20" in caught.monitor.fired()
    safe = _repeat(HYBRID, "kvstate", failing_rank1())
    assert safe["b"].hit == 0
    assert "S20" not in safe.monitor.fired()


def test_s20_still_fires_on_its_breaker() -> None:
    assert "S20" in run("lookup-partial-namespace", "lookup-first-namespace").monitor.fired()
    assert "S20" not in run("lookup-partial-namespace", "kvstate").monitor.fired()


def _hybrid_hit(absent: set[tuple[int, int, int]], hit: int) -> Monitor:
    """A monitor judging a hybrid lookup of 8 chunks that claims ``hit``
    tokens; every key was stored and answered present except ``absent``
    (namespace, group, chunk)."""
    hashes = tuple(bytes([i + 1]) * 16 for i in range(8))
    keys, present, stored = [], [], set()
    for cid in range(8):
        for ns in (0, 1):
            for g in (0, 1):
                key = key_for(key_prefix(HYBRID, ns, g), chunk_hash(hashes, cid, 1))
                keys.append(key)
                present.append((ns, g, cid) not in absent)
                if (ns, g, cid) not in absent:
                    stored.add(key)
    monitor = Monitor(HYBRID, store_view=stored)
    monitor.observe(LookupDone("b", 1, 33, hashes, tuple(keys), tuple(present), hit))
    return monitor


def test_s20_judges_a_hybrid_hit_by_the_window_before_its_boundary() -> None:
    outside_window = {(ns, 1, c) for ns in (0, 1) for c in (0, 1, 2, 3, 4, 5)}
    assert _hybrid_hit(outside_window, 32).findings == []
    assert _hybrid_hit(outside_window, 16).fired() == {"S20"}  # window of 16: chunks 2, 3
    assert _hybrid_hit({(1, 1, 7)}, 32).fired() == {"S20"}  # in the window, one namespace
    assert _hybrid_hit({(0, 0, 1)}, 32).fired() == {"S20"}  # full attention needs every chunk
    assert _hybrid_hit({(0, 0, 7), (1, 1, 7)}, 16).findings == []  # beyond the hit
