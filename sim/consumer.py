"""A KV-event consumer shaped like NVIDIA Dynamo's KV router.

It keeps a radix index of announced blocks keyed by block hash: a
``BlockStored`` whose parent it does not know is rejected (counted as an
orphan), exactly the behaviour that collapsed router hit rates to one block
when parents were wrong (Dynamo#671, vllm-ascend#12012). For each arriving
request it reports how many leading chunks of the prompt the index would
route to a cached prefix — the figure wrong parents destroy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstate.events import BlockStored


class RadixConsumer:
    __slots__ = ("blocks", "accepted", "orphans", "duplicates", "lookups", "hit_chunks")

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes | None] = {}  # block hash -> parent hash
        self.accepted = 0
        self.orphans = 0
        self.duplicates = 0
        self.lookups = 0
        self.hit_chunks = 0

    def accept(self, event: BlockStored) -> bool:
        digest = event.block_hashes[-1]
        parent = event.parent_block_hash
        if digest in self.blocks:
            self.duplicates += 1  # idempotent: an announced block announced again
            return True
        if parent is not None and parent not in self.blocks:
            self.orphans += 1
            return False
        self.blocks[digest] = parent
        self.accepted += 1
        return True

    def forget(self, digest: bytes) -> None:
        self.blocks.pop(digest, None)

    def prefix_hit(self, chunk_hashes: Sequence[bytes]) -> int:
        """Leading chunks of a request the index knows (the router's hit length)."""
        n = 0
        for digest in chunk_hashes:
            if digest not in self.blocks:
                break
            n += 1
        self.lookups += 1
        self.hit_chunks += n
        return n
