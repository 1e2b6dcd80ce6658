"""Paged KV caches as torch tensors, with bytes derived from content tags.

One cache per rank: for each KV-cache group and layer a tensor of shape
``(num_blocks + 1, block_size, heads, head_dim)`` (index 0 is vLLM's null
block), any dtype, CPU in tests, CUDA in production. ``buffers`` turns
(rank, group, block id) into the per-layer (address, size) lists the store's
multi-buffer calls take. ``fill`` writes a block's bytes from its content tag
— a deterministic pattern of (prefix hash, rank namespace, group, layer) — so
any byte read back from the store can be checked against what its key names.
"""

from __future__ import annotations

import hashlib

try:
    import torch
except ImportError as exc:  # pragma: no cover
    raise ImportError("adapters.torch_kv needs torch: pip install 'kvstate[torch]'") from exc


def _pattern(tag: str, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")
    gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


class PagedKV:
    def __init__(self, ranks: int, groups: int, num_blocks: int, block_size: int,
                 layers: int = 2, heads: int = 2, head_dim: int = 16,
                 dtype: torch.dtype = torch.float16, device: str = "cpu",
                 put_step: int = 1, first_rank: int = 0) -> None:
        """``ranks`` caches for global ranks ``first_rank, first_rank + 1, ...``
        (a rank process holds only its own: ``ranks=1, first_rank=r``); methods
        take the local index."""
        self.put_step = put_step
        self.first_rank = first_rank
        self.layers = layers
        self.caches = [
            [[torch.zeros((num_blocks + 1, block_size, heads, head_dim), dtype=dtype,
                          device=device) for _ in range(layers)] for _ in range(groups)]
            for _ in range(ranks)
        ]
        sample = self.caches[0][0][0]
        self.block_bytes = sample[0].numel() * sample.element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [t for rank in self.caches for group in rank for t in group]

    def buffers(self, rank: int, group: int, block: int) -> tuple[list[int], list[int]]:
        ptrs = [t.data_ptr() + block * self.block_bytes for t in self.caches[rank][group]]
        return ptrs, [self.block_bytes] * len(ptrs)

    def block_view(self, rank: int, group: int, block: int, layer: int) -> torch.Tensor:
        return self.caches[rank][group][layer][block].view(torch.uint8).reshape(-1)

    def expected(self, digest_hex: str, namespace: int, group: int, layer: int) -> torch.Tensor:
        return _pattern(f"{digest_hex}|ns{namespace}|g{group}|l{layer}", self.block_bytes)

    def fill(self, block: int, digest_hex: str) -> None:
        """Every rank's shard of ``block`` gets the bytes its content tag names
        (ranks sharing a namespace under TP striding hold identical bytes)."""
        for rank, groups in enumerate(self.caches):
            for group in range(len(groups)):
                for layer in range(self.layers):
                    view = self.block_view(rank, group, block, layer)
                    if digest_hex:
                        ns = (self.first_rank + rank) // self.put_step
                        view.copy_(self.expected(digest_hex, ns, group, layer))
                    else:
                        view.zero_()

    def matches(self, rank: int, group: int, block: int, digest_hex: str,
                namespace: int | None = None) -> bool:
        ns = (self.first_rank + rank) // self.put_step if namespace is None else namespace
        return all(
            torch.equal(self.block_view(rank, group, block, layer),
                        self.expected(digest_hex, ns, group, layer))
            for layer in range(self.layers)
        )
