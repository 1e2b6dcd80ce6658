"""Workloads: what clients send, and when.

``synthetic`` draws arrivals (Poisson), prompt and output lengths, shared
prefixes (so lookups hit and existence checks deduplicate) from the kernel's
seeded generator. ``fast25`` reads the Mooncake FAST'25 conversation trace
(packaged, gzip-compressed, in kvstate/data: arrival ms, input/output lengths, 512-token
prefix hash ids), or any trace in that format; token ids are derived from the
hash ids deterministically (``Remap``: two prompts share a scaled block iff
they share every original block it covers), and ``scale`` (any positive
integer) divides every length so a 12k-token prompt stays cheap to simulate.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import random
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from kvstate.trace.codec import unique_keys

# The Mooncake FAST'25 conversation trace, shipped gzip-compressed (kvstate/data/README.md:
# source and licence).
DEFAULT_FAST25 = Path(__file__).resolve().parent / "data" / "mooncake_fast25_conversation.jsonl.gz"
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
    """Token ids of one whole FAST'25 hash block at a scale dividing 512 (equal
    ids, equal tokens). Kept for callers of the old reader; ``fast25`` itself
    derives tokens with ``Remap``, which is exact for every scale."""
    return tuple(hash_id * FAST25_BLOCK + i for i in range(tokens_per_block))


class Remap:
    """Token ids for FAST'25 prompts at any positive ``scale``, sound for prefix
    sharing.

    Scaled token ``p`` stands for the original positions ``[p*s, p*s + s)``
    (``s`` = scale); those positions lie in the original 512-token blocks
    ``j0 = p*s // 512`` .. ``j1 = (p*s + s - 1) // 512``, indexes that depend
    on ``p`` and ``s`` only. Its id is ``intern(hash_ids[j0..j1]) * 512 + p % 512``
    where ``intern`` numbers each distinct tuple of hash ids (per replay lap)
    in order of first appearance: an injection.

    Claim: two requests share the scaled prefix block ``k`` (its chained hash
    covers scaled tokens ``0 .. (k+1)*b - 1``, ``b`` the engine's block size)
    iff their hash ids agree on every original block that block's tokens cover,
    i.e. on blocks ``0 .. ((k+1)*b*s - 1) // 512``.

    If: every token up to the block's end is a function of ``p`` and of hash
    ids of covered blocks only, so equal ids give equal tokens and equal
    chained hashes. Only if: let the requests differ on a covered original
    block ``j``; the scaled token ``p`` whose range contains position
    ``max(512*j, 0)`` (it exists and lies in the prefix, because the prefix
    covers a position of block ``j``) has ``j`` among its ``j0..j1``, so its
    tuples differ, the interned numbers differ, the token ids at the same
    position ``p`` differ, and so do the chained hashes from that block on
    (up to a collision of the 128-bit chain hash, which every key already
    assumes). The scaled prompt covers original positions ``[0, L//s * s)``,
    within the ``ceil(L/512)`` ids the line must carry, so every ``hash_ids``
    index used exists. (The reader before this one gave hash ids that differ
    by 50,000 identical tokens, and required ``s`` to divide 512.)
    """

    def __init__(self, scale: int) -> None:
        if scale < 1:
            raise WorkloadError(f"--scale={scale}: must be a positive integer")
        self.scale = scale
        self._ids: dict[tuple[int, object], int] = {}

    def _intern(self, lap: int, key: object) -> int:
        ids = self._ids
        k = (lap, key)
        n = ids.get(k)
        if n is None:
            n = ids[k] = len(ids) + 1
        return n

    def tokens(self, hash_ids: list[int], length: int, lap: int = 0) -> tuple[int, ...]:
        """The first ``length`` scaled token ids of a prompt with ``hash_ids``."""
        s, blk = self.scale, FAST25_BLOCK
        out: list[int] = []
        p = 0
        while p < length:
            start = p * s
            j0, j1 = start // blk, (start + s - 1) // blk
            if j0 == j1:
                # A run of tokens inside block j0: the last p with p*s + s - 1 < 512*(j0+1).
                stop = min(length, (blk * (j0 + 1) - s) // s + 1)
                # ``q % blk`` never wraps on [p, stop): a wrap would need a
                # multiple of blk strictly inside (j0 * blk / s, (j0 + 1) * blk / s),
                # that is an integer m * s strictly between j0 and j0 + 1.
                first = self._intern(lap, hash_ids[j0]) * blk + p % blk
                out.extend(range(first, first + stop - p))
                p = stop
            else:
                out.append(self._intern(lap, tuple(hash_ids[j0:j1 + 1])) * blk + p % blk)
                p += 1
        return tuple(out)


def fast25(path: Path, scale: int = 32, limit: int | None = None, repeat: int = 1,
           time_scale: float = 1.0) -> Iterator[Arrival]:
    """Arrivals from a Mooncake trace in the FAST'25 format (any path; see
    ``read_mooncake``); ``scale`` divides every length (any positive integer,
    token ids from ``Remap``); ``repeat`` replays it with fresh ids (and
    disjoint hash ids) after its last arrival, to reach large counts."""
    remap = Remap(scale)
    # Only the rows the run takes are read (issue 32, class 2: a file, or a
    # small gzip, of millions of lines used to be read whole for a 5-request
    # run). With a limit the arrivals are the same: a lap that reaches the
    # limit ends the run, so the later rows (and the span) never matter.
    rows = list(itertools.islice(read_mooncake(path), limit))
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    span = rows[-1][0] / 1000.0 * time_scale + 1.0
    count = 0
    for lap in range(repeat):
        for ts, input_len, output_len, hash_ids in rows:
            if limit is not None and count >= limit:
                return
            length = max(1, input_len // scale)
            yield Arrival(ts / 1000.0 * time_scale + lap * span, f"fast25-{lap}-{count}",
                          remap.tokens(hash_ids, length, lap), max(1, output_len // scale))
            count += 1


# Bounds on one line of a Mooncake trace: generous for any real trace, small
# enough that nothing downstream (virtual time, block pools, int64 token ids)
# overflows or runs for ever.
MAX_LINE_BYTES = 1 << 24
MAX_TOKENS = 10_000_000  # per prompt or output (vLLM's largest context is ~10M)
MAX_TIMESTAMP_MS = 10 ** 12  # ~31 years of arrivals
MAX_HASH_ID = (1 << 63) - 1


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def read_mooncake(path: Path) -> Iterator[tuple[float, int, int, list[int]]]:
    """Rows ``(timestamp ms, input_length, output_length, hash_ids)`` of a
    Mooncake trace (the FAST'25 JSONL fields: one object a line; other fields
    are ignored; blank lines are skipped). Every malformed line is a
    ``WorkloadError`` ``file:line: field 'F': value (why)``: not UTF-8 or JSON,
    numbers beyond Python's digit limit, nesting too deep, not an object, a
    missing field, a timestamp not finite, negative, beyond ``MAX_TIMESTAMP_MS``
    or earlier than the previous line's, lengths that are not integers in
    ``[1, MAX_TOKENS]`` (output ``[0, MAX_TOKENS]``), ``hash_ids`` not a list
    of ``ceil(input_length / 512)`` integers in ``[0, 2**63)``. A path that is
    not a regular file (a FIFO, a directory) is refused without reading."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot open ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise WorkloadError(f"{path}: cannot open (not a regular file)")
    try:
        handle = gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot open ({exc.strerror})") from None
    last_ts = 0.0
    with handle:
        number = 0
        while True:
            try:
                raw = handle.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as exc:  # a corrupt or truncated .gz
                raise WorkloadError(f"{path}:{number + 1}: cannot read ({exc})") from None
            if not raw:
                return
            number += 1
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise WorkloadError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            row = _parse_line(raw, where)
            ts, input_len, output_len, hash_ids = _fields(row, where)
            if ts < last_ts:
                raise WorkloadError(f"{where}: field 'timestamp': {_shown(row['timestamp'])} "
                                    f"(earlier than the previous line's {last_ts:g})")
            last_ts = ts
            yield ts, input_len, output_len, hash_ids


def _parse_line(raw: bytes, where: str) -> Any:  # a dict, checked by _fields
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{where}: not UTF-8 ({exc.reason})") from None
    try:
        # A key given twice was read last-wins without a word.
        return json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:
        raise WorkloadError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, and ints beyond the digit limit
        raise WorkloadError(f"{where}: invalid JSON ({exc})") from None


def _fields(row: object, where: str) -> tuple[float, int, int, list[int]]:
    if not isinstance(row, dict):
        raise WorkloadError(f"{where}: expected an object with timestamp, input_length, "
                            f"output_length, hash_ids; got {type(row).__name__}")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in row:
            raise WorkloadError(f"{where}: field {name!r}: missing")

    def bad(name: str, why: str) -> WorkloadError:
        return WorkloadError(f"{where}: field {name!r}: {_shown(row[name])} ({why})")

    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise bad("timestamp", "must be a number of milliseconds")
    if not (isinstance(ts, int) or math.isfinite(ts)) or not 0 <= ts <= MAX_TIMESTAMP_MS:
        raise bad("timestamp", f"must be finite, in [0, {MAX_TIMESTAMP_MS}] ms")
    lengths = []
    for name, low in (("input_length", 1), ("output_length", 0)):
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(name, "must be an integer number of tokens")
        if not low <= value <= MAX_TOKENS:
            raise bad(name, f"must be in [{low}, {MAX_TOKENS}]")
        lengths.append(value)
    ids = row["hash_ids"]
    if not isinstance(ids, list):
        raise bad("hash_ids", "must be a list of integers")
    want = -(-lengths[0] // FAST25_BLOCK)
    if len(ids) != want:
        raise bad("hash_ids", f"{len(ids)} ids for input_length {lengths[0]}: must be "
                  f"ceil(input_length / {FAST25_BLOCK}) = {want}")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise WorkloadError(f"{where}: field 'hash_ids': element {_shown(h)} "
                                "(must be an integer in [0, 2**63))")
    return float(ts), lengths[0], lengths[1], ids
