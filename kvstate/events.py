"""KV events and their cross-rank quorum (docs/background.md, "KV events").

Each rank emits a ``BlockStored`` for every chunk whose shards it stored. A
chunk is really in the store only once *every* key namespace holds its shard,
so the scheduler side publishes an event only when enough distinct ranks have
reported it (``ConnectorConfig.quorum``).

Upstream counts reports *by value*: the same rank reporting the same chunk
twice (two requests racing the exists-then-put window, S9) counts twice and
publishes a chunk another namespace never stored (S16). Events that never reach
the quorum stay in its counter forever (measured on vLLM 0.33.0's shipped code:
101 entries after 100 steps with two ranks). ``OrderedQuorum`` counts distinct ranks per generation, publishes in
chain order, and drops a generation's pending events once it has ended and its
last job was released — from then on no rank can report them. A resumed
generation does not re-publish what an earlier generation of the same request
already published (``OrderedQuorum``, "Re-announcements").
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

    def request_finished(self, req_id: str) -> None:
        """The request finished: forget what its generations published."""

    def batch_ended(self) -> None:
        """The reports of one ``update_connector_output`` call (one engine
        step) were all added."""


class _GenerationEvents:
    __slots__ = ("ranks", "waiting", "published", "earlier")

    def __init__(self, earlier: _RequestEvents) -> None:
        self.ranks: dict[BlockStored, set[int]] = {}
        # Keyed by (group, hash): every group's chunks share the request's
        # hashes, so a hash alone would let one group's event stand in for
        # another's (issue 10).
        self.waiting: dict[tuple[int, bytes], list[BlockStored]] = {}
        self.published: set[tuple[int, bytes]] = set()
        self.earlier = earlier


class _RequestEvents:
    """What a request's generations published: (group, hash) pairs."""

    __slots__ = ("published",)

    def __init__(self) -> None:
        self.published: set[tuple[int, bytes]] = set()


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
    Everything is keyed by (group, hash), never by hash alone: the groups of
    a hybrid model store the same chunks under the same hashes, so a
    hash-keyed memory dropped a second group's event as a duplicate of the
    first group's (uncounted) and released a full-attention child behind
    another group's parent (an orphan in its own group).

    Re-announcements: every generation announces its chain from its first
    chunk, so each resumption after a preemption used to re-publish the whole
    prefix (issue 10: a million duplicates for 400 requests under preemption
    storms). A chunk (of any group) that an earlier generation of
    the same request published is now counted as published for the new
    generation — its children are released behind it, in chain order — but
    not published again; the chain needs no second copy, since the consumer
    already holds it. What a request's generations published is kept until
    the request has no live generation (``request_finished``, called by the
    planner when a request finishes and when a generation settles after it):
    bounded by the live requests' chains. The one case it cannot see is a chunk evicted from the store
    between two generations and put again: the consumer may have forgotten
    it (the monitor's K4 tolerates that for the last ``EVICTED_MEMORY``
    evictions); telling it apart needs the rank to report which chunks it put
    rather than found present.
    """

    __slots__ = ("quorum", "ordered_groups", "_gens", "_requests", "suppressed")

    def __init__(self, config: Any) -> None:
        self.quorum: int = config.quorum
        self.ordered_groups = frozenset(
            i for i, g in enumerate(config.groups) if g.kind.value == "full"
        )
        self._gens: dict[GenKey, _GenerationEvents] = {}
        # req id -> what its generations published (until it finished and settled).
        self._requests: dict[str, _RequestEvents] = {}
        self.suppressed = 0  # re-announcements not published again

    def add(self, gen: GenKey, rank: int, events: tuple[BlockStored, ...]) -> list[BlockStored]:
        state = self._gens.get(gen)
        if state is None:
            request = self._requests.get(gen[0])
            if request is None:
                request = self._requests[gen[0]] = _RequestEvents()
            state = self._gens[gen] = _GenerationEvents(request)
        out: list[BlockStored] = []
        earlier = state.earlier.published
        for event in events:
            ranks = state.ranks.get(event)
            if ranks is None:
                ranks = state.ranks[event] = set()
            ranks.add(rank)
            if len(ranks) >= self.quorum:
                del state.ranks[event]
                self._release(state, event, out, earlier)
        return out

    def _release(self, state: _GenerationEvents, event: BlockStored, out: list[BlockStored],
                 earlier: set[tuple[int, bytes]]) -> None:
        parent = event.parent_block_hash
        group = event.group_idx
        if (parent is not None and group in self.ordered_groups
                and (group, parent) not in state.published):
            state.waiting.setdefault((group, parent), []).append(event)
            return
        ready = [event]
        while ready:
            ev = ready.pop()
            chunk = (ev.group_idx, ev.block_hashes[-1])
            if chunk in state.published:
                continue  # a duplicate announcement: consumers are idempotent, skip it
            if chunk in earlier:
                self.suppressed += 1  # an earlier generation published it
            else:
                out.append(ev)
                earlier.add(chunk)
            state.published.add(chunk)
            ready.extend(reversed(state.waiting.pop(chunk, ())))

    def generation_settled(self, gen: GenKey) -> int:
        state = self._gens.pop(gen, None)
        if state is None:
            return 0
        return len(state.ranks) + sum(len(w) for w in state.waiting.values())

    def pending(self) -> int:
        return sum(
            len(s.ranks) + sum(len(w) for w in s.waiting.values()) for s in self._gens.values()
        )

    def request_finished(self, req_id: str) -> None:
        # Generations still reporting keep their own reference to the record.
        self._requests.pop(req_id, None)

    def remembered(self) -> int:
        """Requests whose published chunks are remembered."""
        return len(self._requests)

    def batch_ended(self) -> None:
        pass  # counts ranks, not reports: a rank's second report is not counted again


class ValueCountQuorum:
    """Upstream (vLLM 0.33.0): counts reports by event value, never forgets.

    Upstream adds a whole step's reports to its ``Counter`` and then pops
    each event that reached the quorum with every count it has: reports of
    the same event beyond the quorum *within that step* are dropped with it
    (an eviction makes a rank put a chunk again, so a step can hold more
    reports of one event than there are ranks). Counting report by report,
    an event is published when it reaches the quorum and its further
    reports in the same step are swallowed until ``batch_ended``; a report
    in a later step counts from one again (specs/conformance.md, F5)."""

    __slots__ = ("quorum", "_counts", "_published")

    def __init__(self, config: Any) -> None:
        self.quorum: int = config.quorum
        self._counts: dict[BlockStored, int] = {}
        self._published: set[BlockStored] = set()  # reached the quorum in this batch

    def add(self, gen: GenKey, rank: int, events: tuple[BlockStored, ...]) -> list[BlockStored]:
        published: list[BlockStored] = []
        counts = self._counts
        done = self._published
        for event in events:
            if event in done:
                continue  # surplus of this batch: popped with the rest by upstream
            n = counts.get(event, 0) + 1
            if n >= self.quorum:
                published.append(event)
                counts.pop(event, None)
                done.add(event)
            else:
                counts[event] = n
        return published

    def batch_ended(self) -> None:
        self._published.clear()

    def generation_settled(self, gen: GenKey) -> int:
        return 0

    def pending(self) -> int:
        return len(self._counts)

    def request_finished(self, req_id: str) -> None:
        return None
