"""KV events and their cross-rank quorum (REFERENCE.md §3, §7).

Each rank emits a ``BlockStored`` for every chunk whose shards it stored. A
chunk is really in the store only once *every* key namespace holds its shard,
so the scheduler side publishes an event only when enough distinct ranks have
reported it (``ConnectorConfig.quorum``).

Upstream counts reports *by value*: the same rank reporting the same chunk
twice (two requests racing the exists-then-put window, S9) counts twice and
publishes a chunk another namespace never stored (S16). Events that never reach
the quorum stay in its counter forever (REFERENCE.md §11: 101 entries after 100
steps). ``OrderedQuorum`` counts distinct ranks per generation, publishes in
chain order, and drops a generation's pending events once it has ended and its
last job was released — from then on no rank can report them.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs


@attrs.frozen(slots=True)
class BlockStored:
    """Shaped like vLLM's ``BlockStored`` (lora fields kept for the wire shape)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int = 0
    medium: str = "cpu"
    lora_id: int | None = None


GenKey = tuple[str, int]


class EventQuorum(Protocol):
    def add(self, gen: GenKey, rank: int, events: tuple[BlockStored, ...]) -> list[BlockStored]:
        """Count a rank's events; return those that reached the quorum now."""

    def generation_settled(self, gen: GenKey) -> int:
        """The generation can report no more events; return how many were dropped."""

    def pending(self) -> int:
        """Events waiting for the quorum."""


class _GenerationEvents:
    __slots__ = ("ranks", "waiting", "published")

    def __init__(self) -> None:
        self.ranks: dict[BlockStored, set[int]] = {}
        self.waiting: dict[bytes, list[BlockStored]] = {}
        self.published: set[bytes] = set()


class OrderedQuorum:
    """kvstate: quorum over *distinct* ranks, per generation, published in
    chain order, forgetting what can no longer be reached.

    Ordering: an event of a full-attention group is published only once its
    parent was published by the same generation (or it has none). Each rank
    announces a generation's chunks in chain order from the generation's first
    chunk (`kvstate.variants.events_for_stored_prefix`), so every parent does
    reach the quorum; holding children until then means a consumer that
    rejects orphans (Dynamo's radix router) never sees one — even with TP
    striding, where different ranks announce neighbouring chunks (K4).
    Sliding-window groups skip the hold: their chains are sparse by design.
    """

    __slots__ = ("quorum", "ordered_groups", "_gens")

    def __init__(self, config: Any) -> None:
        self.quorum: int = config.quorum
        self.ordered_groups = frozenset(
            i for i, g in enumerate(config.groups) if g.kind.value == "full"
        )
        self._gens: dict[GenKey, _GenerationEvents] = {}

    def add(self, gen: GenKey, rank: int, events: tuple[BlockStored, ...]) -> list[BlockStored]:
        state = self._gens.get(gen)
        if state is None:
            state = self._gens[gen] = _GenerationEvents()
        out: list[BlockStored] = []
        for event in events:
            ranks = state.ranks.get(event)
            if ranks is None:
                ranks = state.ranks[event] = set()
            ranks.add(rank)
            if len(ranks) >= self.quorum:
                del state.ranks[event]
                self._release(state, event, out)
        return out

    def _release(self, state: _GenerationEvents, event: BlockStored, out: list[BlockStored]) -> None:
        parent = event.parent_block_hash
        if (parent is not None and event.group_idx in self.ordered_groups
                and parent not in state.published):
            state.waiting.setdefault(parent, []).append(event)
            return
        ready = [event]
        while ready:
            ev = ready.pop()
            digest = ev.block_hashes[-1]
            if digest in state.published and ev.group_idx in self.ordered_groups:
                continue  # a duplicate announcement: consumers are idempotent, skip it
            out.append(ev)
            state.published.add(digest)
            ready.extend(reversed(state.waiting.pop(digest, ())))

    def generation_settled(self, gen: GenKey) -> int:
        state = self._gens.pop(gen, None)
        if state is None:
            return 0
        return len(state.ranks) + sum(len(w) for w in state.waiting.values())

    def pending(self) -> int:
        return sum(
            len(s.ranks) + sum(len(w) for w in s.waiting.values()) for s in self._gens.values()
        )


class ValueCountQuorum:
    """Upstream (vLLM 0.33.0): counts reports by event value, never forgets."""

    __slots__ = ("quorum", "_counts")

    def __init__(self, config: Any) -> None:
        self.quorum: int = config.quorum
        self._counts: dict[BlockStored, int] = {}

    def add(self, gen: GenKey, rank: int, events: tuple[BlockStored, ...]) -> list[BlockStored]:
        published: list[BlockStored] = []
        counts = self._counts
        for event in events:
            n = counts.get(event, 0) + 1
            if n >= self.quorum:
                published.append(event)
                counts.pop(event, None)
            else:
                counts[event] = n
        return published

    def generation_settled(self, gen: GenKey) -> int:
        return 0

    def pending(self) -> int:
        return len(self._counts)
