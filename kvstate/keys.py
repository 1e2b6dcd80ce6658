"""Block hashes, chunks, store keys and store masks (upstream's key format).

A request's tokens are hashed in a chain at ``hash_block_size`` granularity:
each hash folds in its parent, so one hash names a whole prefix. The store
works in chunks of ``block_size`` tokens (a multiple), and a chunk is keyed by
its *last* sub-hash, which already names everything before it — the key stays
one digest long whatever the block/hash-block ratio.

Key strings are byte-identical to the upstream connector's
``PoolKey.to_string()`` so a store filled by kvstate and one filled by vLLM's
connector interoperate:
``[{cache_prefix}@]{model}[@cfg:{fingerprint}]@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{g}@{hash_hex}``.
The ``@cfg:`` segment is the open upstream proposal vLLM#56971 (empty keeps the
historical format): deployments with different dtypes or layouts must not read
each other's bytes under the same prefix hash.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvstate.config import ConnectorConfig, GroupKind

# The parent of a request's first block. Any fixed value works as long as every
# writer and reader agree; vLLM seeds its own from PYTHONHASHSEED (bug class 9).
NONE_HASH = b"\x00" * 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained hash of one hash block: parent digest, token ids, extra keys."""
    h = hashlib.blake2b(parent or NONE_HASH, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


class HashChain:
    """A request's growing hash chain; extending it costs O(new tokens).

    Engines compute this (vLLM's ``Request.block_hashes``); the planner only
    reads it. Tests and the harness use this class to play the engine's part.
    ``hash_fn`` is the engine's block hash (kvstate's own by default;
    `kvstate.blockhash.chain_hash_fn` gives vLLM's, so keys match vLLM's).
    """

    __slots__ = ("hash_block_size", "hashes", "_pending", "_hash_fn")

    def __init__(self, hash_block_size: int, tokens: Sequence[int] = (),
                 hash_fn: Callable[[bytes | None, Sequence[int]], bytes] | None = None) -> None:
        self.hash_block_size = hash_block_size
        self.hashes: list[bytes] = []
        self._pending: list[int] = []
        self._hash_fn = hash_fn or block_hash
        self.extend(tokens)

    @classmethod
    def continued(cls, hash_block_size: int, hashes: Sequence[bytes], pending: Sequence[int],
                  hash_fn: Callable[[bytes | None, Sequence[int]], bytes] | None = None
                  ) -> HashChain:
        """The chain that has hashed its first ``len(hashes)`` blocks into
        ``hashes`` and holds ``pending`` (fewer than a block's tokens) after
        them: what extending a new chain would give, without hashing again."""
        if len(pending) >= hash_block_size:
            raise ValueError(f"{len(pending)} pending tokens: a whole block of "
                             f"{hash_block_size} is hashed, not pending")
        chain = cls.__new__(cls)  # not __init__: nothing to extend
        chain.hash_block_size = hash_block_size
        chain.hashes = list(hashes)
        chain._pending = list(pending)
        chain._hash_fn = hash_fn or block_hash
        return chain

    @property
    def num_tokens(self) -> int:
        """How many tokens the chain has taken so far."""
        return len(self.hashes) * self.hash_block_size + len(self._pending)

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Append tokens; return the hashes of the blocks they completed."""
        new: list[bytes] = []
        pending = self._pending
        pending.extend(tokens)
        size = self.hash_block_size
        while len(pending) >= size:
            parent = self.hashes[-1] if self.hashes else None
            digest = self._hash_fn(parent, pending[:size])
            self.hashes.append(digest)
            new.append(digest)
            del pending[:size]
        return new


def chain_hashes(tokens: Sequence[int], hash_block_size: int) -> list[bytes]:
    return HashChain(hash_block_size, tokens).hashes


def chunk_hash(hashes: Sequence[bytes], chunk_id: int, hashes_per_block: int) -> bytes:
    """A chunk's key hash: the last sub-hash inside it."""
    return hashes[(chunk_id + 1) * hashes_per_block - 1]


def parent_hash(hashes: Sequence[bytes], start_token: int, hash_block_size: int) -> bytes | None:
    """The hash-chain predecessor of the chunk starting at ``start_token``
    (``None`` iff it is the request's first chunk) — the only correct KV-event
    parent (S15; vLLM#52466)."""
    if start_token == 0:
        return None
    return hashes[start_token // hash_block_size - 1]


# --------------------------------------------------------------------------
# Key strings.


def model_key_name(model_name: str) -> str:
    """Upstream keys use the last path component of the model name."""
    return model_name.rstrip("/").rsplit("/", 1)[-1]


def config_fingerprint(**settings: Any) -> str:
    """A short digest of what makes stored bytes incompatible (dtype,
    quantization, layout...), for ``ConnectorConfig.config_fingerprint``."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def key_prefix(config: ConnectorConfig, tp_rank: int, group: int) -> str:
    """Everything of a key before the hash, for one rank and group.

    With TP striding (``put_step > 1``) ranks that hold the same bytes share a
    namespace: the key's tp segment is ``tp_rank // put_step``.
    """
    head = f"{config.cache_prefix}@" if config.cache_prefix else ""
    cfg = f"@cfg:{config.config_fingerprint}" if config.config_fingerprint else ""
    return (
        f"{head}{model_key_name(config.model_name)}{cfg}"
        f"@tp_rank:{tp_rank // config.put_step}@pcp{config.pcp_rank}@dcp{config.dcp_rank}"
        f"@pp_rank:{config.pp_rank}@group:{group}"
    )


def key_for(prefix: str, digest: bytes | str) -> str:
    """The store key of a chunk: ``key_prefix(...)`` and the chunk hash (bytes,
    or already as hex). With `key_head`, the one place keys are formatted;
    `parse_key` reads them back."""
    return f"{prefix}@{digest if isinstance(digest, str) else digest.hex()}"


def key_head(prefix: str) -> str:
    """What every key of ``prefix`` starts with: ``key_for(prefix, d) ==
    key_head(prefix) + d.hex()`` (for a loop over many chunks of one prefix)."""
    return prefix + "@"


class StoreKey(NamedTuple):
    """A store key in kvstate's (upstream's) format, read back: the chunk hash
    as hex, the key's namespace (its ``tp_rank`` segment: ``tp_rank //
    put_step``) and the KV-cache group."""

    digest: str
    namespace: int
    group: int

    def chunk_hash(self) -> bytes:
        return bytes.fromhex(self.digest)


def parse_key(key: str) -> StoreKey | None:
    """The fields of a key `key_for` wrote, ``None`` for a key in any other
    format (a store shared with other writers holds those too)."""
    head, sep, digest = key.rpartition("@")
    _, tp, rest = head.partition("@tp_rank:")
    ns_text = rest.partition("@")[0]
    group_text = head.rpartition("@group:")[2]
    if not (sep and tp and ns_text.isascii() and ns_text.isdigit() and group_text.isascii()
            and group_text.isdigit() and len(ns_text) < 10 and len(group_text) < 10):
        return None
    return StoreKey(digest, int(ns_text), int(group_text))


def key_digest(key: str) -> str:
    """The hash part of a key: after its last ``@`` (the whole key if none)."""
    return key.rpartition("@")[2]


# --------------------------------------------------------------------------
# Store masks and chunk selection.


def blocks_needed_for_hit(window: int, block_size: int) -> int:
    """Contiguous blocks a sliding-window hit at a block boundary needs: the
    token right after the boundary attends to the ``window - 1`` before it."""
    return max(1, cdiv(window - 1, block_size))


def store_mask(
    config: ConnectorConfig, token_len: int, start_token: int = 0
) -> tuple[list[bool] | None, ...]:
    """Per-group masks over the chunks ``[cdiv(start_token, bs), token_len // bs)``.

    ``None`` means "store every chunk". A sliding-window group keeps only the
    blocks a hit at some ``lcm_block_size`` boundary can use: the ``need``
    blocks right before each boundary. Whether a block is kept depends only on
    its absolute index, so the mask of a prefix never changes as the aligned
    length grows, and a suffix mask is exactly the tail of the full mask (the
    properties upstream's incremental-saving tests pin).
    """
    if token_len % config.lcm_block_size:
        raise ValueError(
            f"store_mask: token_len={token_len} is not a multiple of the alignment "
            f"{config.lcm_block_size}"
        )
    bs = config.block_size
    end = token_len // bs
    start = min(end, cdiv(start_token, bs))
    per_segment = config.lcm_block_size // bs
    masks: list[list[bool] | None] = []
    for group in config.groups:
        if group.kind is GroupKind.FULL or group.sliding_window is None:
            masks.append(None)
            continue
        need = blocks_needed_for_hit(group.sliding_window, bs)
        if need >= per_segment:
            masks.append(None)  # every block sits inside some boundary's window
            continue
        masks.append(
            [((i // per_segment) + 1) * per_segment - i <= need for i in range(start, end)]
        )
    return tuple(masks)


def chunk_ids(
    start_token: int,
    token_len: int,
    block_size: int,
    mask: list[bool] | None,
    put_step: int,
    put_rank: int,
    *,
    limit: int | None = None,
    origin: int = 0,
) -> list[int]:
    """The chunks one rank owes for ``[start_token, token_len)`` (upstream
    ``process_tokens``): from ``cdiv(start_token, bs)``, masked, and strided by
    the *absolute* chunk id so a chunk always lands on the same rank whatever
    offset a job starts from (S11). ``limit``: chunks past it have no hash yet;
    ``origin``: where striding counts from (0; a variant's policy may move it).
    The executor selects a job's chunks with this function."""
    first = cdiv(start_token, block_size)
    last = cdiv(token_len, block_size)
    if mask is not None:
        last = min(last, first + len(mask))
    if limit is not None:
        last = min(last, limit)
    return [cid for cid in range(first, last)
            if (mask is None or mask[cid - first]) and (cid - origin) % put_step == put_rank]


def stride_residue(tp_rank: int, group: int, put_step: int) -> int:
    """Which stride residue a rank owns for a group."""
    return (tp_rank + group) % put_step
