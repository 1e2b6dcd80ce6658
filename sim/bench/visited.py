"""The model checker's packed visited table against a plain dict: bytes and time
a key."""

from __future__ import annotations

import time
from typing import Any


def bench_visited(keys: int = 200_000) -> dict[str, Any]:
    """Bytes and microseconds a state of the compact engine's visited table
    (`sim.explore.modelcheck.visited.Visited`) against the dict and key list it replaced, and
    of a worker's key set (`KeySet`) against the set it replaced, on
    the same ``keys`` random 16-byte keys (the digests are uniformly random)
    and the same three actions, in one run: `tracemalloc` for the bytes, each
    structure built alone."""
    import random
    import tracemalloc

    from sim.explore.modelcheck.visited import KeySet, Visited

    rng = random.Random(0)
    # One blob, cut per state: each key a new bytes object, as each digest is.
    blob = rng.randbytes(16 * keys)
    actions = [("step",), ("rank", 0, "ok"), ("rank", 1, "-200")]

    def packed() -> Any:
        table = Visited()
        table.reach(blob[:16])
        for n in range(1, keys):
            parent = 16 * (n // 2)
            table.reach(blob[16 * n:16 * n + 16], blob[parent:parent + 16], actions[n % 3])
        return table

    def plain() -> Any:
        first = blob[:16]
        table: dict[bytes, Any] = {first: None}
        order = [first]
        for n in range(1, keys):
            key = blob[16 * n:16 * n + 16]
            table[key] = (order[n // 2], actions[n % 3])
            order.append(key)
        return table, order

    def packed_seen() -> Any:  # a worker's: keys only
        table = KeySet()
        table.add_packed(blob)
        return table

    def plain_seen() -> Any:
        return {blob[16 * n:16 * n + 16] for n in range(keys)}

    made = [blob[16 * n:16 * n + 16] for n in range(keys)]
    out: dict[str, Any] = {"visited_keys": keys}
    for name, build in (("packed", packed), ("dict", plain), ("worker_packed", packed_seen),
                        ("worker_set", plain_seen)):
        tracemalloc.start()
        built = build()
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del built
        started = time.perf_counter()
        built = build()
        seconds = time.perf_counter() - started
        started = time.perf_counter()
        found = sum(key in (built[0] if name == "dict" else built) for key in made)
        lookup = time.perf_counter() - started
        assert found == keys
        out[f"visited_{name}_bytes_per_state"] = round(size / keys, 1)
        out[f"visited_{name}_add_us"] = round(seconds / keys * 1e6, 2)
        out[f"visited_{name}_lookup_us"] = round(lookup / keys * 1e6, 2)
    return out
