"""A KV-event consumer shaped like NVIDIA Dynamo's KV router.

It keeps a radix index of announced blocks keyed by block hash: a
``BlockStored`` whose parent it does not know is rejected (counted as an
orphan), exactly the behaviour that collapsed router hit rates to one block
when parents were wrong (Dynamo#671, vllm-ascend#12012). For each arriving
request it reports how many leading chunks of the prompt the index would
route to a cached prefix — the figure wrong parents destroy.

Blocks are indexed by (group, hash): the KV-cache groups of a hybrid model
share their hashes, and a parent announced in one group does not make a child
of another group routable. Sliding-window groups announce sparse chains (only
the blocks inside the window), so their parents are not required.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvstate.events import BlockStored


class RadixConsumer:
    __slots__ = ("blocks", "chained", "accepted", "orphans", "duplicates", "lookups",
                 "hit_chunks")

    def __init__(self, chained_groups: Collection[int] = (0,)) -> None:
        self.blocks: dict[tuple[int, bytes], bytes | None] = {}  # (group, hash) -> parent
        self.chained = frozenset(chained_groups)
        self.accepted = 0
        self.orphans = 0
        self.duplicates = 0
        self.lookups = 0
        self.hit_chunks = 0

    def accept(self, event: BlockStored) -> bool:
        group = event.group_idx
        chunk = (group, event.block_hashes[-1])
        parent = event.parent_block_hash
        if chunk in self.blocks:
            self.duplicates += 1  # idempotent: an announced block announced again
            return True
        if parent is not None and group in self.chained and (group, parent) not in self.blocks:
            self.orphans += 1
            return False
        self.blocks[chunk] = parent
        self.accepted += 1
        return True

    def forget(self, group: int, digest: bytes) -> None:
        self.blocks.pop((group, digest), None)

    def prefix_hit(self, chunk_hashes: Sequence[bytes]) -> int:
        """Leading chunks of a request the index knows in group 0 (the router's
        hit length)."""
        n = 0
        for digest in chunk_hashes:
            if (0, digest) not in self.blocks:
                break
            n += 1
        self.lookups += 1
        self.hit_chunks += n
        return n
