"""Keys, chunks and store masks (upstream's key format; incremental saving)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec
from kvstate.keys import (
    HashChain,
    block_hash,
    chain_hashes,
    chunk_hash,
    chunk_ids,
    config_fingerprint,
    key_for,
    key_prefix,
    parent_hash,
    store_mask,
)


def test_key_string_is_byte_identical_to_upstream_example() -> None:
    config = ConnectorConfig(model_name="test-model")
    assert key_for(key_prefix(config, 0, 0), bytes.fromhex("6130")) == (
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@6130"
    )


def test_key_uses_last_model_path_component_prefix_and_striding() -> None:
    config = ConnectorConfig(model_name="/models/org/Llama-3-8B/", cache_prefix="prod",
                             world_size=4, put_step=2, pp_rank=1)
    assert key_prefix(config, 3, 1) == "prod@Llama-3-8B@tp_rank:1@pcp0@dcp0@pp_rank:1@group:1"


def test_config_fingerprint_segment_separates_deployments() -> None:
    fp16 = config_fingerprint(dtype="float16", layout="NHD")
    fp8 = config_fingerprint(dtype="fp8_e4m3", layout="NHD")
    assert fp16 != fp8 and len(fp16) == 16
    assert config_fingerprint(layout="NHD", dtype="float16") == fp16  # order-free
    a = key_prefix(ConnectorConfig(config_fingerprint=fp16), 0, 0)
    b = key_prefix(ConnectorConfig(config_fingerprint=fp8), 0, 0)
    assert a.startswith(f"test-model@cfg:{fp16}@tp_rank:0") and a != b
    # Empty keeps the historical format.
    assert "@cfg:" not in key_prefix(ConnectorConfig(), 0, 0)


def test_hash_chain_is_incremental_and_chained() -> None:
    tokens = list(range(40))
    chain = HashChain(8)
    new = chain.extend(tokens[:13]) + chain.extend(tokens[13:])
    assert new == chain.hashes == chain_hashes(tokens, 8)
    assert len(chain.hashes) == 5
    assert chain.hashes[1] == block_hash(chain.hashes[0], tokens[8:16])
    # A different first block changes every later hash (the chain names the prefix).
    other = chain_hashes([99] + tokens[1:], 8)
    assert all(x != y for x, y in zip(other, chain.hashes))


def test_a_continued_chain_is_the_chain_extended_from_the_start() -> None:
    tokens = list(range(45))
    whole = HashChain(8, tokens[:21])
    continued = HashChain.continued(8, whole.hashes, tokens[16:21])
    assert continued.num_tokens == 21
    assert continued.extend(tokens[21:]) == whole.extend(tokens[21:])
    assert continued.hashes == whole.hashes == chain_hashes(tokens, 8)
    with pytest.raises(ValueError, match="8 pending tokens"):
        HashChain.continued(8, [], tokens[:8])


def test_the_engines_hash_cache_answers_as_hashing_afresh() -> None:
    """The harness hashes a request's prefix once (lookup, admission,
    resumption, load recovery) and keeps it; whatever the cache holds (a
    shorter prefix, tokens a rewind cut, another request's tokens), the
    answer is the chain hashed from the start."""
    from kvstate.harness import Harness

    h = Harness(ConnectorConfig(block_size=4, world_size=1))
    h.add("r", list(range(30)), 8)
    req = h["r"]
    fresh = lambda n: tuple(chain_hashes(req.tokens[:n], 4))  # noqa: E731
    assert h._hashes(req, req.prompt[:9]) == fresh(9)  # two blocks, cached
    assert len(req.hashed[1]) == 2
    assert h._hashes(req, req.prompt) == fresh(30)  # extends the cache
    assert h._hashes(req, req.tokens[:13]) == fresh(13)  # a shorter prefix: a slice
    assert len(req.hashed[1]) == 7  # ... of the cache, which stays whole
    req.tokens += [7, 7, 7, 7]
    assert h._hashes(req, req.tokens) == fresh(34)
    del req.tokens[20:]  # a rewind: the cache holds tokens no longer there
    req.tokens += [1, 2, 3, 4]
    assert h._hashes(req, req.tokens) == fresh(24)
    req.hashed = (tuple(range(100, 112)), tuple(chain_hashes(range(100, 112), 4)))
    assert h._hashes(req, req.tokens) == fresh(24)  # another request's cache: unused


def test_chunk_is_keyed_by_its_last_sub_hash_and_parent_is_the_predecessor() -> None:
    hashes = chain_hashes(list(range(64)), 4)  # 16 hash blocks of 4 tokens
    assert chunk_hash(hashes, 0, 4) == hashes[3]
    assert chunk_hash(hashes, 2, 4) == hashes[11]
    assert parent_hash(hashes, 0, 4) is None
    assert parent_hash(hashes, 32, 4) == hashes[7]


def _reference_chunks(start, end, bs, mask, step, residue):
    first = -(-start // bs)
    out = []
    for i, cid in enumerate(range(first, -(-end // bs))):
        if mask is not None and (i >= len(mask) or not mask[i]):
            continue
        if cid % step == residue:
            out.append(cid)
    return out


def test_process_tokens_over_mask_and_stride_combinations() -> None:
    bs = 4
    for start, end, step in itertools.product((0, 4, 6, 12), (16, 32), (1, 2, 4)):
        n = -(-end // bs) - (-(-start // bs))
        for mask in (None, [True] * n, [i % 3 == 0 for i in range(n)], [False] * n):
            seen: list[int] = []
            for residue in range(step):
                got = list(chunk_ids(start, end, bs, mask, step, residue))
                assert got == _reference_chunks(start, end, bs, mask, step, residue)
                assert all(cid % step == residue for cid in got)  # absolute chunk id
                seen.extend(got)
            # The ranks' strides partition the masked chunks: each exactly once (S11).
            assert sorted(seen) == _reference_chunks(start, end, bs, mask, 1, 0)


def _swa(window: int, alignment: int, bs: int = 4) -> ConnectorConfig:
    return ConnectorConfig(
        block_size=bs,
        alignment=alignment,
        groups=(GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, window)),
    )


def test_sliding_window_mask_keeps_only_blocks_before_each_boundary() -> None:
    config = _swa(window=6, alignment=16)  # 5 earlier tokens: 2 blocks before each boundary
    full, swa = store_mask(config, 32)
    assert full is None
    assert swa == [False, False, True, True] * 2


windows = st.integers(1, 40)
blocks = st.sampled_from([2, 4, 8])
segments = st.integers(1, 6)


@given(windows, blocks, segments, st.integers(1, 8), st.integers(0, 8))
def test_store_mask_prefix_is_stable_as_the_aligned_length_grows(w, bs, seg, n, more) -> None:
    config = _swa(w, seg * bs, bs)
    align = config.lcm_block_size
    short = store_mask(config, n * align)[1]
    long = store_mask(config, (n + more) * align)[1]
    if short is None:
        assert long is None
    else:
        assert long is not None and long[: len(short)] == short


@given(windows, blocks, segments, st.integers(1, 8), st.integers(0, 64))
def test_suffix_mask_equals_the_full_masks_tail(w, bs, seg, n, start) -> None:
    config = _swa(w, seg * bs, bs)
    end = n * config.lcm_block_size
    start = min(start, end)
    full = store_mask(config, end)[1]
    suffix = store_mask(config, end, start)[1]
    first = -(-start // bs)
    if full is None:
        assert suffix is None
    else:
        assert suffix == full[first:]


def test_parse_key_reads_back_what_key_for_wrote() -> None:
    from kvstate.keys import StoreKey, key_digest, key_for, key_head, parse_key

    config = ConnectorConfig(block_size=4, world_size=4, put_step=2, cache_prefix="pq",
                             config_fingerprint="abc")
    digest = bytes(range(16))
    for rank in range(4):
        for group in (0, 3):
            key = key_for(key_prefix(config, rank, group), digest)
            assert key == key_for(key_prefix(config, rank, group), digest.hex())
            # The executor's chunk loop writes keys as head + hex.
            assert key == key_head(key_prefix(config, rank, group)) + digest.hex()
            assert parse_key(key) == StoreKey(digest.hex(), rank // 2, group)
            assert parse_key(key).chunk_hash() == digest  # type: ignore[union-attr]
            assert key_digest(key) == digest.hex()
    for other in ("plain", "a@b", "m@tp_rank:x@group:0@ff", "m@tp_rank:0@group:@ff"):
        assert parse_key(other) is None


def test_chunk_ids_limit_and_origin() -> None:
    assert chunk_ids(4, 40, 4, None, 1, 0) == list(range(1, 10))
    assert chunk_ids(4, 40, 4, None, 1, 0, limit=5) == [1, 2, 3, 4]
    assert chunk_ids(0, 40, 4, None, 3, 1) == [1, 4, 7]
    assert chunk_ids(4, 40, 4, None, 3, 1, origin=1) == [2, 5, 8]  # relative striding
    assert chunk_ids(8, 24, 4, [True, False, True, True], 1, 0) == [2, 4, 5]
