"""Workloads: what clients send, and when.

``synthetic`` draws arrivals (Poisson), prompt and output lengths, shared
prefixes (so lookups hit and existence checks deduplicate) from the kernel's
seeded generator. ``fast25`` reads the Mooncake FAST'25 conversation trace
(shared/data/mooncake-fast25: arrival ms, input/output lengths, 512-token
prefix hash ids); token ids are derived from the hash ids deterministically,
so equal hash ids give equal blocks, and ``scale`` divides every length so a
12k-token prompt stays cheap to simulate.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import attrs

FAST25_BLOCK = 512  # tokens per hash id in the FAST'25 trace (its README)
VOCAB = 50000


@attrs.frozen(slots=True)
class Arrival:
    time: float
    req_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int


class WorkloadError(ValueError):
    pass


def synthetic(
    rng: random.Random,
    requests: int = 200,
    rate: float = 50.0,
    prompt_tokens: tuple[int, int] = (16, 160),
    output_tokens: tuple[int, int] = (4, 48),
    prefixes: int = 8,
    prefix_tokens: int = 64,
    shared: float = 0.6,
) -> Iterator[Arrival]:
    pool = [tuple(rng.randrange(VOCAB) for _ in range(prefix_tokens)) for _ in range(prefixes)]
    now = 0.0
    for n in range(requests):
        now += rng.expovariate(rate)
        length = rng.randint(*prompt_tokens)
        head: tuple[int, ...] = ()
        if pool and rng.random() < shared:
            head = rng.choice(pool)[: min(prefix_tokens, length)]
        tail = tuple(rng.randrange(VOCAB) for _ in range(max(0, length - len(head))))
        yield Arrival(now, f"req-{n}", head + tail, rng.randint(*output_tokens))


def fast25_tokens(hash_id: int, tokens_per_block: int) -> tuple[int, ...]:
    """Deterministic token ids of one FAST'25 hash block (equal ids, equal tokens)."""
    return tuple((hash_id * 1_000_003 + i * 7919) % VOCAB for i in range(tokens_per_block))


def fast25(path: Path, scale: int = 32, limit: int | None = None, repeat: int = 1,
           time_scale: float = 1.0) -> Iterator[Arrival]:
    """Arrivals from the FAST'25 trace; ``repeat`` replays it with fresh ids
    (and disjoint hash ids) after its last arrival, to reach large counts."""
    if scale < 1 or FAST25_BLOCK % scale:
        raise WorkloadError(f"--scale={scale}: must divide {FAST25_BLOCK}")
    per_block = FAST25_BLOCK // scale
    rows = list(_read_fast25(path))
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    span = rows[-1][0] / 1000.0 * time_scale + 1.0
    count = 0
    for lap in range(repeat):
        for ts, input_len, output_len, hash_ids in rows:
            if limit is not None and count >= limit:
                return
            tokens: list[int] = []
            for h in hash_ids:
                tokens.extend(fast25_tokens(h + lap * 10_000_000, per_block))
            length = max(1, input_len // scale)
            yield Arrival(ts / 1000.0 * time_scale + lap * span, f"fast25-{lap}-{count}",
                          tuple(tokens[:length]), max(1, output_len // scale))
            count += 1


def _read_fast25(path: Path) -> Iterator[tuple[float, int, int, list[int]]]:
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot open ({exc.strerror})") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            where = f"{path}:{number}"
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise WorkloadError(f"{where}: invalid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{where}: expected an object")
            for name, kind in (("timestamp", (int, float)), ("input_length", int),
                               ("output_length", int), ("hash_ids", list)):
                if name not in row:
                    raise WorkloadError(f"{where}: field {name!r} missing")
                if not isinstance(row[name], kind) or isinstance(row[name], bool):
                    raise WorkloadError(f"{where}: field {name!r} has the wrong type "
                                        f"({row[name]!r})")
            if not all(isinstance(h, int) and h >= 0 for h in row["hash_ids"]):
                raise WorkloadError(f"{where}: field 'hash_ids' must be non-negative integers")
            yield (float(row["timestamp"]), row["input_length"], row["output_length"],
                   row["hash_ids"])
