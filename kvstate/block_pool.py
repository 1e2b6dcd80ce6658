"""A test double of the engine's block pool: reference counts and content tags.

Like vLLM's pool, a block whose count drops to zero goes to the *tail* of the
free queue and allocation takes from the head, so a freed block is reused only
after older free blocks. A connector pin is one more reference. Each block
carries a content tag — a stand-in for its KV bytes, written when the engine
computes the block — so a job that reads a block freed and reused by another
request reads the other request's content, and the content-integrity monitor
sees it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvstate.observations import BlockAllocated, BlockFreed, BlockWritten, Observation
from kvstate.records import NULL_BLOCK_ID


class BlockPool:
    def __init__(
        self, num_blocks: int, observer: Callable[[Observation], None] | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool.num_blocks={num_blocks!r}: must be >= 1")
        self.refs = [0] * (num_blocks + 1)  # index 0 is the null block, never handed out
        self.free: deque[int] = deque(range(1, num_blocks + 1))
        self.content: list[str] = [""] * (num_blocks + 1)
        self.observer = observer
        # Called with (block, content) on every write: real KV caches fill the
        # block's bytes from the content tag here (adapters.torch_kv).
        self.on_write: Callable[[int, str], None] | None = None

    def allocate(self, n: int, req_id: str) -> list[int] | None:
        """``n`` blocks with one reference each, or ``None`` if too few are free."""
        if n > len(self.free):
            return None
        out = [self.free.popleft() for _ in range(n)]
        for block in out:
            self.refs[block] = 1
            self.content[block] = ""
            if self.observer is not None:
                self.observer(BlockAllocated(block, req_id))
        return out

    def write(self, block: int, content: str) -> None:
        self.content[block] = content
        if self.on_write is not None:
            self.on_write(block, content)
        if self.observer is not None:
            self.observer(BlockWritten(block, content))

    def ref(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            if self.refs[block] <= 0:
                raise ValueError(f"pin of block {block}, which is free")
            self.refs[block] += 1

    def unref(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            if self.refs[block] <= 0:
                raise ValueError(f"release of block {block}, which is already free")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
                if self.observer is not None:
                    self.observer(BlockFreed(block))

    @property
    def num_free(self) -> int:
        return len(self.free)
