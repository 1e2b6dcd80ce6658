"""The block-hash functions a trace's header may name (``"block_hash"``).

S17 recomputes a KV event's digest from its token ids, so the checker must
hash exactly as the engine that wrote the trace did:

``kvstate``           kvstate's own chain (`kvstate.keys.block_hash`: blake2b,
                      16 bytes, a fixed all-zero ``NONE_HASH``). The default
                      when the header names none.
``vllm-sha256``       vLLM 0.33.0's prefix-cache hash with
                      ``--prefix-caching-hash-algo sha256``:
                      ``sha256(pickle.dumps((parent or NONE_HASH, tuple(tokens),
                      extra_keys), protocol=pickle.HIGHEST_PROTOCOL))``
                      (``vllm/v1/core/kv_cache_utils.py: hash_block_tokens``,
                      ``vllm/utils/hashing.py: sha256``).
``vllm-sha256_cbor``  the same over ``cbor2.dumps(..., canonical=True)``;
                      recomputable only where ``cbor2`` imports.
``opaque``            anything else: the digests are names, not recomputable.

vLLM's ``NONE_HASH`` (the parent of a request's first block) is
``hash_fn(seed)`` with ``seed`` = ``PYTHONHASHSEED`` if the engine had it set,
else ``"vllm-none-hash"`` (vLLM 0.33.0, ``init_none_hash``). A header may carry
it as ``"none_hash": "<hex>"``; without it the checker tries the default seed
and, where a first block does not match, counts it as not checkable instead of
reporting a violation it cannot be sure of. Only requests without extra keys
(no LoRA, multimodal inputs, cache salt or prompt embeddings) hash with
``extra_keys=None``; a recorder of such requests should write ``opaque``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from kvstate.keys import block_hash as _kvstate_block_hash

KVSTATE = "kvstate"
VLLM_SHA256 = "vllm-sha256"
VLLM_SHA256_CBOR = "vllm-sha256_cbor"
OPAQUE = "opaque"
NAMES = (KVSTATE, VLLM_SHA256, VLLM_SHA256_CBOR, OPAQUE)

VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def vllm_sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_dumps() -> Callable[..., bytes] | None:
    try:
        import cbor2
    except ImportError:
        return None
    return cbor2.dumps


def vllm_sha256_cbor(value: Any) -> bytes:
    dumps = _cbor_dumps()
    if dumps is None:
        raise RuntimeError("vllm-sha256_cbor needs the cbor2 package")
    return hashlib.sha256(dumps(value, canonical=True)).digest()


def chain_hash_fn(name: str, none_hash: bytes | None = None
                  ) -> Callable[[bytes | None, Sequence[int]], bytes]:
    """The engine's ``(parent, block tokens) -> digest`` for `kvstate.keys.HashChain`,
    so a chain built here names blocks as that engine does (requests without
    extra keys). ``none_hash``: the first block's parent (vLLM's default seed's
    hash if ``None``)."""
    if name == KVSTATE:
        return _kvstate_block_hash
    if name == VLLM_SHA256:
        fn = vllm_sha256
    elif name == VLLM_SHA256_CBOR:
        if _cbor_dumps() is None:
            raise ValueError("block hash 'vllm-sha256_cbor' needs cbor2, which is not installed")
        fn = vllm_sha256_cbor
    else:
        raise ValueError(f"block hash {name!r} cannot build a chain (known: {KVSTATE}, "
                         f"{VLLM_SHA256}, {VLLM_SHA256_CBOR})")
    seed = none_hash if none_hash is not None else fn(VLLM_DEFAULT_NONE_HASH_SEED)

    def vllm_block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return fn((parent or seed, tuple(tokens), None))
    return vllm_block_hash


class BlockHasher:
    """Recompute a chunk's digest from its token ids, as the trace's engine did.

    ``reason`` is ``""`` when digests can be recomputed, else why not (the
    check result shows it as a note). ``digest`` returns ``None`` for a chunk
    it cannot judge (a vLLM first block whose ``NONE_HASH`` is unknown and not
    the default one).
    """

    __slots__ = ("name", "reason", "_fn", "_none_hash", "_none_hash_known")

    def __init__(self, name: str = KVSTATE, none_hash: bytes | None = None) -> None:
        if name not in NAMES:
            raise ValueError(f"unknown block hash function {name!r} (known: {', '.join(NAMES)})")
        self.name = name
        self.reason = ""
        self._fn: Callable[[Any], bytes] | None = None
        self._none_hash = none_hash
        self._none_hash_known = none_hash is not None
        if name == OPAQUE:
            self.reason = "the header's block_hash is 'opaque'"
        elif name == VLLM_SHA256:
            self._fn = vllm_sha256
        elif name == VLLM_SHA256_CBOR:
            if _cbor_dumps() is None:
                self.reason = "block_hash 'vllm-sha256_cbor' needs cbor2, which is not installed"
            else:
                self._fn = vllm_sha256_cbor
        if self._fn is not None and none_hash is None:
            self._none_hash = self._fn(VLLM_DEFAULT_NONE_HASH_SEED)

    @property
    def checkable(self) -> bool:
        return not self.reason

    def digest(self, parent: bytes | None, tokens: Sequence[int], size: int) -> tuple[bytes, bool]:
        """(digest of the chunk ``tokens`` hashed ``size`` tokens at a time from
        ``parent``, whether a mismatch is certain). Raises ``ValueError`` for
        token ids the function cannot take."""
        fn = self._fn
        current = parent
        if fn is None:  # kvstate
            try:
                for i in range(0, len(tokens), size):
                    current = _kvstate_block_hash(current, tokens[i:i + size])
            except OverflowError as exc:
                raise ValueError(f"token ids outside int64: {exc}") from None
            assert current is not None
            return current, True
        certain = parent is not None or self._none_hash_known
        for i in range(0, len(tokens), size):
            current = fn((current or self._none_hash, tuple(tokens[i:i + size]), None))
        assert current is not None
        return current, certain
