"""Protocol variants: kvstate's default, upstream's eras, and named mutants.

A variant is a small frozen record of *policies* — functions and strategy
objects the planner and executor call at the points where the eras differ. The
core holds no ``if variant == ...``: it asks its variant. That keeps every
historical behaviour runnable (so the simulator can rediscover its bugs) and
lets a test show each policy changes something observable.

Names are the command line's: ``kvstate`` (default), ``e2`` (vLLM 0.33.0 as
shipped), ``e1``, ``e0``, and kebab-case mutants of ``e2`` that each undo one
upstream fix (docs/invariants.md cites the bugs they bring back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvstate.events import EventQuorum, OrderedQuorum, ValueCountQuorum
from kvstate.keys import cdiv, parent_hash
from kvstate.ledger import CounterLedger, GenerationLedger, Ledger, RequestIdLedger
from kvstate.pins import (
    DelayedFreeAtFinish,
    IncrementalPins,
    NoPins,
    PerJobPins,
    PinPolicy,
    PreemptionDropsPins,
)
from kvstate.protocols import MetadataPolicy, RetryPolicy

# --------------------------------------------------------------------------
# Scheduler-side policies.


def boundary_plus_one(saved: int, block_size: int) -> int:
    """The next save needs at least one *new* full block (LMCache#653)."""
    return cdiv(saved + 1, block_size) * block_size


def boundary_without_plus_one(saved: int, block_size: int) -> int:
    """The pre-#653 boundary: at an aligned mark it equals the mark, so every
    step after a full block emits a job with nothing new to save."""
    return cdiv(saved, block_size) * block_size


def snapshot_suffix(tokens: list[int], start: int, end: int) -> tuple[int, ...]:
    """The token snapshot a job carries: only ``[token_ids_start, num_tokens_to_save)``."""
    return tuple(tokens[start:end])


def snapshot_from_zero(tokens: list[int], start: int, end: int) -> tuple[int, ...]:
    """Mutant: the snapshot starts at token 0 while ``token_ids_start`` says
    ``start`` — the off-by-offset the incremental token snapshot risks."""
    return tuple(tokens[0:end - start])


def backfill_prompt(prefill_end: int, block_size: int) -> int:
    """A consumer's first decode save starts at 0: with direct P→D transfer the
    prompt may not be in the store, so the decode node puts it (decode-phase saving)."""
    return 0


def no_backfill(prefill_end: int, block_size: int) -> int:
    return prefill_end // block_size * block_size


class DeltaMetadata:
    """Only what is new since the generation's previous job travels; ranks
    keep a mirror of the block table and hash chain."""

    name = "delta"

    @staticmethod
    def slice(tracker: Any) -> tuple[int, tuple[tuple[int, ...], ...], int, tuple[bytes, ...]]:
        sent = tracker.sent_blocks
        tables = tracker.block_ids
        # Groups grow in lockstep here (one shared block size), so one start;
        # a group's mark is behind the others only when the engine freed a
        # block already sent (`Planner._forget_freed`): resent from there.
        start = min(sent)
        blocks = tuple(tuple(t[start:]) for t in tables)
        for g, t in enumerate(tables):
            sent[g] = len(t)
        hstart = tracker.sent_hashes
        hashes = tuple(tracker.hashes[hstart:])
        tracker.sent_hashes = len(tracker.hashes)
        return start, blocks, hstart, hashes

    @staticmethod
    def resolve(entry: Any, meta: Any) -> tuple[list[list[int]], list[bytes]]:
        """Apply a meta's slice to the rank's mirror; return the mirror."""
        start = meta.block_ids_start
        for g, ids in enumerate(meta.block_ids):
            table = entry.block_ids[g]
            if start == len(table):
                table.extend(ids)  # the usual case; ~2x cheaper than slice assignment
            else:
                table[start:] = ids  # a step the rank missed or a replaced table
        hashes = entry.hashes
        if meta.hashes_start == len(hashes):
            hashes.extend(meta.block_hashes)
        else:
            hashes[meta.hashes_start:] = meta.block_hashes
        return entry.block_ids, hashes


class FullMetadata:
    """Upstream: every job carries the whole block table and hash list."""

    name = "full"

    @staticmethod
    def slice(tracker: Any) -> tuple[int, tuple[tuple[int, ...], ...], int, tuple[bytes, ...]]:
        return 0, tuple(tuple(t) for t in tracker.block_ids), 0, tuple(tracker.hashes)

    @staticmethod
    def resolve(entry: Any, meta: Any) -> tuple[Sequence[Sequence[int]], Sequence[bytes]]:
        return meta.block_ids, meta.block_hashes


# --------------------------------------------------------------------------
# Worker-side policies.


def parent_from_chain(
    hashes: Sequence[bytes], start: int, hash_block: int, prev_emitted: bytes | None,
    prev_missing: bytes | None,
) -> bytes | None:
    return parent_hash(hashes, start, hash_block)


def parent_previous_emitted(
    hashes: Sequence[bytes], start: int, hash_block: int, prev_emitted: bytes | None,
    prev_missing: bytes | None,
) -> bytes | None:
    """E1: the block this rank emitted just before (None for the first)."""
    return prev_emitted


def parent_previous_missing(
    hashes: Sequence[bytes], start: int, hash_block: int, prev_emitted: bytes | None,
    prev_missing: bytes | None,
) -> bytes | None:
    """E0: the previous block that was missing in this batch."""
    return prev_missing


def events_for_stored_prefix(groups: Sequence[int], status: Sequence[int]) -> list[int]:
    """kvstate: announce every chunk of the job's range that is now in the
    store — put by this job *or found present* — in chain order, per group up
    to the first failure. Found-present chunks are announced again (consumers
    treat duplicates as idempotent) so a generation's events always form a
    chain from its first chunk, and a failure never lets a child reach the
    quorum before its parent; the next job resumes at the failure and
    announces the rest."""
    out: list[int] = []
    stopped: set[int] = set()
    for i, g in enumerate(groups):
        if g in stopped:
            continue
        out.append(i)
        if status[i] == 2:  # FAILED: later chunks of this group wait for the retry
            stopped.add(g)
    return out


def events_for_puts(groups: Sequence[int], status: Sequence[int]) -> list[int]:
    """Upstream: one event per chunk this job put (failed ones only move the
    "previous missing" cursor E0 used for parents)."""
    return [i for i, st in enumerate(status) if st != 0]


class GuardedRetry:
    """Retry suffixes live in the generation's entry; only a live job reads or
    writes them (the store_job_id guard of vLLM#52466)."""

    name = "guarded"

    @staticmethod
    def get(executor: Any, live: Any, meta: Any) -> tuple[int, tuple[int, ...], int] | None:
        return live.retry if live is not None else None

    @staticmethod
    def put(executor: Any, live: Any, meta: Any, value: tuple[int, tuple[int, ...], int] | None) -> bool:
        if live is None:
            return False
        if value is not None or live.retry is not None:
            live.set_retry(value)
        return True


class RetryByRequestId:
    """Mutant: retry state in a rank-wide dict keyed by request id, unguarded,
    never dropped at preemption — a stale job writes it and a reused id reads it."""

    name = "by-request-id"

    @staticmethod
    def get(executor: Any, live: Any, meta: Any) -> tuple[int, tuple[int, ...], int] | None:
        return executor.retry_by_request.get(meta.req_id)

    @staticmethod
    def put(executor: Any, live: Any, meta: Any, value: tuple[int, tuple[int, ...], int] | None) -> bool:
        if value is None:
            executor.retry_by_request.pop(meta.req_id, None)
        else:
            executor.retry_by_request[meta.req_id] = value
        return True


def backoff_expires(skipped_since: float, now: float, backoff: float) -> bool:
    """kvstate: a skipped request is retried after a bounded backoff even if no
    other put succeeds (otherwise an idle engine strands it: K6)."""
    return now - skipped_since >= backoff


def backoff_never(skipped_since: float, now: float, backoff: float) -> bool:
    """Upstream: only some other successful put clears the skip."""
    return False


def any_success_clears(put_something: bool) -> bool:
    """kvstate: any job that ends with its range in the store (put, found
    present, or nothing to store) shows the store accepts writes again."""
    return True


def only_a_put_clears(put_something: bool) -> bool:
    """Upstream: only a successful put batch clears the pressure flag and the
    skip set; a job whose keys were all present leaves both set (vLLM 0.33.0
    ``_handle_request``: ``_clear_store_pressure`` runs only after the put)."""
    return put_something


def offset_to_first_failure(old: int, first_failed: int, token_len: int) -> int:
    """kvstate: after a partial failure the rank has really saved every chunk
    it owes below the first failed one, so it resumes there — the next job
    checks exactly the chunks not yet confirmed, not the whole range again."""
    return max(old, first_failed)


def offset_kept(old: int, first_failed: int, token_len: int) -> int:
    """Upstream: a partial failure leaves the offset where it was."""
    return old


def offset_advanced(old: int, first_failed: int, token_len: int) -> int:
    """Mutant: the failed range is treated as saved and never retried."""
    return token_len


def save_from_offset(offset: int, meta_start: int) -> int:
    """Seed 2: a rank resumes at what it really saved, whatever the scheduler
    thinks (its mark is optimistic)."""
    return offset


def save_from_zero(offset: int, meta_start: int) -> int:
    """E0: every job re-checks from chunk 0 (dedup by exists)."""
    return 0


def save_from_meta(offset: int, meta_start: int) -> int:
    """Before incremental saving a rank trusted the scheduler's start; with it, skipping
    the prompt at the scheduler skips it in the store too."""
    return max(offset, meta_start)


def stride_absolute(first_chunk: int) -> int:
    return 0


def stride_relative(first_chunk: int) -> int:
    """Mutant: stride by position within the job, so the same chunk lands on
    different ranks depending on where each rank's offset starts."""
    return first_chunk


def check_all(keys: tuple[str, ...]) -> tuple[str, ...]:
    return keys


def check_none(keys: tuple[str, ...]) -> tuple[str, ...]:
    return ()


def report_after_raise(job: Any) -> Any:
    """The ``finally`` of vLLM#43742: a job that raised still reports."""
    return job


def swallow_after_raise(job: Any) -> Any:
    return None


def all_namespaces(num_namespaces: int) -> range:
    return range(num_namespaces)


def first_namespace(num_namespaces: int) -> range:
    return range(1)


def keep_load_errors(failed: tuple[int, ...]) -> tuple[int, ...]:
    return failed


def drop_load_errors(failed: tuple[int, ...]) -> tuple[int, ...]:
    return ()


def key_rank_own(tp_rank: int) -> int:
    return tp_rank


def key_rank_zero(tp_rank: int) -> int:
    return 0


def consumer_skips_prefill(is_consumer: bool) -> bool:
    return is_consumer


def consumer_saves_prefill(is_consumer: bool) -> bool:
    return False


def loading_step_skips(can_load: bool) -> bool:
    return can_load


def loading_step_saves(can_load: bool) -> bool:
    return False


# --------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Variant:
    name: str
    summary: str
    upstream: str = ""
    # scheduler side
    chunk_boundary: Callable[[int, int], int] = boundary_plus_one
    token_snapshot: Callable[[list[int], int, int], tuple[int, ...]] = snapshot_suffix
    consumer_decode_start: Callable[[int, int], int] = backfill_prompt
    skip_prefill_save: Callable[[bool], bool] = consumer_skips_prefill
    skip_on_loading_step: Callable[[bool], bool] = loading_step_skips
    pins: PinPolicy = IncrementalPins()
    metadata: MetadataPolicy = DeltaMetadata
    quorum: Callable[[Any], EventQuorum] = OrderedQuorum
    lookup_namespaces: Callable[[int], range] = all_namespaces
    # worker side
    ledger: Callable[[int], Ledger] = GenerationLedger
    save_start: Callable[[int, int], int] = save_from_offset
    offset_after_failure: Callable[[int, int, int], int] = offset_to_first_failure
    parent: Callable[..., bytes | None] = parent_from_chain
    event_chunks: Callable[[Sequence[int], Sequence[int]], list[int]] = events_for_stored_prefix
    retry: RetryPolicy = GuardedRetry
    skip_expired: Callable[[float, float, float], bool] = backoff_expires
    success_clears_pressure: Callable[[bool], bool] = any_success_clears
    # Upstream's ``finally`` keeps a pressure-skipped job's token suffix as retry
    # state (the skip counts as a failed save), so the next live job's events
    # still carry the skipped range's tokens; kvstate's default drops it there.
    skip_keeps_retry: bool = False
    # A request whose context shares a block that a load of this very step
    # fills (vLLM's prefix cache hands out blocks as soon as they are
    # allocated for a load) computes over that block before the load's
    # outcome is known; if the load fails, the KV it computes is wrong and a
    # save in that step stores it under valid keys (found in the real engine:
    # a later engine loaded the wrong bytes and generated other tokens).
    # kvstate defers such saves to the next step, when the load's outcome and
    # vLLM's recompute are in; upstream saves in that step.
    defer_saves_over_loads: bool = True
    # After an asynchronous load whose first block failed, vLLM frees the
    # blocks and admits the request afresh, asking the connector again.
    # Upstream looks the store up again: while the master says "present" and
    # every get fails, the request loops for ever (specs/conformance.md, H4).
    # kvstate computes instead (what lay before the failed block is kept).
    lookup_after_failed_load: bool = False
    # A request whose next block another request's asynchronous load is
    # filling: vLLM caches a loading block only once it landed, so a lookup
    # now would load the same keys a second time into other blocks. kvstate
    # answers "ask again" until the load landed (then vLLM's own prefix cache
    # serves the block); upstream looks up and loads again.
    defer_lookup_behind_loads: bool = True
    # vLLM cuts a running request back to its first failed block after a
    # failed synchronous load (or a partial one of an asynchronous load): the
    # planner takes the step's computed count over its own (S7 otherwise;
    # found in the real engine). Every protocol does; False only to show S7
    # firing (tests/test_load_path.py).
    follow_rewinds: bool = True
    stride_origin: Callable[[int], int] = stride_absolute
    exists_keys: Callable[[tuple[str, ...]], tuple[str, ...]] = check_all
    after_raise: Callable[[Any], Any] = report_after_raise
    load_errors: Callable[[tuple[int, ...]], tuple[int, ...]] = keep_load_errors
    key_rank: Callable[[int], int] = key_rank_own
    # For drivers (simulator, adapters): how long a store call may take before
    # it counts as failed. Upstream has no bound, so a hung master pins blocks
    # forever (S6); seconds of the driver's clock.
    call_timeout: float | None = 5.0

    def __reduce__(self) -> tuple[Any, ...]:
        # A registered variant pickles as its name (its policies are module
        # functions anyway); an ad-hoc one field by field.
        if VARIANTS.get(self.name) is self:
            return get_variant, (self.name,)
        return Variant, tuple(getattr(self, f.name) for f in attrs.fields(Variant))


KVSTATE = Variant(
    name="kvstate",
    summary="E2's semantics with incremental pins, delta metadata, per-generation rank "
    "state, pressure backoff and a distinct-rank event quorum that forgets the unreachable",
)

E2 = attrs.evolve(
    KVSTATE,
    name="e2",
    summary="vLLM 0.33.0 as shipped: job-set ledger keyed by request id, per-job full pins "
    "and full metadata, value-counted event quorum, no pressure backoff",
    upstream="vLLM#52372, #52466",
    pins=PerJobPins(),
    metadata=FullMetadata,
    quorum=ValueCountQuorum,
    event_chunks=events_for_puts,
    ledger=RequestIdLedger,
    skip_expired=backoff_never,
    success_clears_pressure=only_a_put_clears,
    skip_keeps_retry=True,
    offset_after_failure=offset_kept,
    call_timeout=None,
    defer_saves_over_loads=False,
    lookup_after_failed_load=True,
    defer_lookup_behind_loads=False,
)

E1 = attrs.evolve(
    E2,
    name="e1",
    summary="job counter per request id, blocks held only at finish (preemption frees at "
    "once), event parent = previous emitted block",
    upstream="vLLM#52360, #51637",
    pins=DelayedFreeAtFinish(),
    ledger=CounterLedger,
    parent=parent_previous_emitted,
)

E0 = attrs.evolve(
    E1,
    name="e0",
    summary="job counter, no pins at all, every job re-checks from chunk 0, event parent = "
    "previous missing block of the batch",
    upstream="vLLM#44103",
    pins=NoPins(),
    save_start=save_from_zero,
    parent=parent_previous_missing,
)


def _mutant(name: str, summary: str, upstream: str, **changes: Any) -> Variant:
    return attrs.evolve(E2, name=name, summary=summary, upstream=upstream, **changes)


MUTANTS: tuple[Variant, ...] = (
    _mutant("req-id-counter-ledger", "E2 with a job counter per request id instead of job "
            "sets", "vLLM#51637/#51662", ledger=CounterLedger),
    _mutant("no-pins-on-preemption", "E2 whose preemption drops the in-flight jobs' pins at "
            "once", "vLLM#52360", pins=PreemptionDropsPins()),
    _mutant("delayed-free-at-finish", "E2 holding blocks only at finish (E1's pins)",
            "vLLM#52360", pins=DelayedFreeAtFinish()),
    _mutant("parent-previous-emitted", "E2 whose event parent is the block emitted before",
            "vLLM#52466, vllm-ascend#12012", parent=parent_previous_emitted),
    _mutant("retry-keyed-by-request", "E2 whose retry suffix is keyed by request id, "
            "unguarded", "vLLM#52466 review", retry=RetryByRequestId),
    _mutant("missing-finally", "E2 whose job that raised never reports", "vLLM#43742",
            after_raise=swallow_after_raise),
    _mutant("boundary-without-plus-one", "E2 with chunk boundary cdiv(saved, bs)*bs",
            "LMCache#653", chunk_boundary=boundary_without_plus_one),
    _mutant("save-on-loading-step", "E2 that saves in the step it loads", "vLLM build_connector_meta",
            skip_on_loading_step=loading_step_saves),
    _mutant("consumer-without-backfill", "E2 whose consumer starts saving at the prompt's "
            "end (and ranks that trust the scheduler's start)", "vLLM#52466 review",
            consumer_decode_start=no_backfill, save_start=save_from_meta),
    _mutant("consumer-saves-prefill", "E2 whose consumer also saves prefill", "vLLM build_connector_meta",
            skip_prefill_save=consumer_saves_prefill),
    _mutant("advance-offset-on-failure", "E2 that advances the saved offset after a partial "
            "failure", "incremental saving", offset_after_failure=offset_advanced),
    _mutant("stride-by-relative-chunk", "E2 striding by chunk position within the job",
            "incremental saving (absolute chunk id)", stride_origin=stride_relative),
    _mutant("skip-exists-check", "E2 that puts without checking existence", "incremental saving",
            exists_keys=check_none),
    _mutant("lookup-first-namespace", "E2 whose lookup checks only rank 0's namespace",
            "vLLM load path", lookup_namespaces=first_namespace),
    _mutant("swallow-load-errors", "E2 that never reports failed loads", "vLLM build_connector_meta",
            load_errors=drop_load_errors),
    _mutant("snapshot-from-zero", "E2 whose event token snapshot ignores token_ids_start",
            "vLLM#52466 (incremental snapshot)", token_snapshot=snapshot_from_zero),
    _mutant("key-without-rank", "E2 whose keys drop the rank namespace", "vLLM#56971",
            key_rank=key_rank_zero),
)

VARIANTS: dict[str, Variant] = {v.name: v for v in (KVSTATE, E2, E1, E0, *MUTANTS)}
BUILTIN: frozenset[str] = frozenset(VARIANTS)

# --------------------------------------------------------------------------
# Variants defined outside the package.
#
# A user's variant lives in their own module, which calls `register`; the
# environment variable names the modules (comma-separated), imported the first
# time a name is not found. An environment variable rather than a flag so that
# every process that looks a variant up by name finds it the same way: a
# campaign's or a model check's worker processes, a replay of the trace a run
# wrote, the command a failure prints to reproduce it (`with_plugins`).
PLUGINS_ENV = "KVSTATE_VARIANTS"
_imported: set[str] = set()


def register(variant: Variant) -> Variant:
    """Make ``variant`` known by its name (from a module `PLUGINS_ENV`
    names); returns it. A name taken by another variant is refused."""
    if not isinstance(variant, Variant):
        raise TypeError(f"register() takes a Variant, not {type(variant).__name__}")
    known = VARIANTS.get(variant.name)
    if known is not None and known is not variant:
        raise ValueError(f"a protocol variant named {variant.name!r} exists already")
    VARIANTS[variant.name] = variant
    return variant


def import_plugins() -> None:
    """Import the modules `PLUGINS_ENV` names (each once); a ValueError
    naming the module when one cannot be imported."""
    import importlib
    import os

    for module in os.environ.get(PLUGINS_ENV, "").split(","):
        module = module.strip()
        if not module or module in _imported:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ValueError(f"{PLUGINS_ENV}: cannot import {module!r} "
                             f"({type(exc).__name__}: {exc})") from exc
        _imported.add(module)


def get_variant(name: str) -> Variant:
    variant = VARIANTS.get(name)
    if variant is None:
        import_plugins()
        variant = VARIANTS.get(name)
    if variant is None:
        known = ", ".join(VARIANTS)
        raise ValueError(f"unknown protocol variant {name!r} (known: {known}; variants of "
                         f"your own: {PLUGINS_ENV}=your.module, which calls "
                         "kvstate.variants.register)") from None
    return variant


def is_variant(name: str) -> bool:
    """Whether ``name`` names a variant (built in or registered); a module
    `PLUGINS_ENV` names that cannot be imported is a ValueError."""
    if name not in VARIANTS:
        import_plugins()
    return name in VARIANTS


def with_plugins(command: str, name: str) -> str:
    """``command`` as a shell line that finds variant ``name``: prefixed by
    the `PLUGINS_ENV` setting when ``name`` is not built in."""
    import os
    import shlex

    modules = os.environ.get(PLUGINS_ENV)
    if name in BUILTIN or not modules:
        return command
    return f"{PLUGINS_ENV}={shlex.quote(modules)} {command}"
