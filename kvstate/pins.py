"""Pin policies: which engine blocks a store job holds, and until when.

A pin is one extra reference on an engine block. While a block is pinned the
engine cannot free and reuse it, so a job that reads it reads the bytes of the
prefix its key names (S1, S2; vLLM#52360 was a job reading a block preemption
had just freed and handed to another request).

``IncrementalPins`` (kvstate) pins each block once per generation, when the
first job whose range covers it is emitted, and releases it when every rank has
confirmed saving past it (ranks report their confirmed offset with each
completion) or when the generation ended and its last job was released. Per-job
work is proportional to the *new* blocks, never to the context.

``PerJobPins`` (upstream E2) pins every allocated block of the request for
every job and frees them all when every rank reported that job: ~126 ns a
block, so ~1 ms per job at 128k tokens (measured on vLLM 0.33.0's shipped scheduler: `kvstate bench vllm`).

``PreemptionDropsPins`` is E2 with the pins of a preempted generation's
in-flight jobs dropped at once (the mutant "no pins on preemption").
``DelayedFreeAtFinish`` (E1) pins nothing while running and holds the blocks
only at finish, until the request's jobs drain; preemption frees at once.
``NoPins`` (E0) never holds anything.

All methods append block ids to the caller's ``pins``/``releases`` lists.

Each pin or release of a batch of blocks fires the PIN machine once for the
batch (the states are implied by the policy's own offsets and lists, so the
machine is not stored): the table stays the single description of a pin's
life, and coverage sees which of its transitions a run took.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstate.records import NULL_BLOCK_ID
from kvstate.tables import PIN, PinEvent, PinState
from kvstate.tracker import JobBook, Tracker

_PINNED = PinState.PINNED


def _blocks(tracker: Tracker, first: int, last: int) -> list[int]:
    """Non-null block ids of every group for block indexes ``[first, last)``."""
    out: list[int] = []
    for table in tracker.block_ids:
        for block in table[first:last]:
            if block != NULL_BLOCK_ID:
                out.append(block)
    return out


class PinPolicy:
    """No-op base: subclasses override the moments they care about."""

    name = "none"

    def on_job(
        self, tracker: Tracker, book: JobBook, token_len: int, block_size: int, pins: list[int]
    ) -> None:
        pass

    def on_report(self, tracker: Tracker, block_size: int, releases: list[int]) -> None:
        pass

    def on_job_released(self, book: JobBook, releases: list[int]) -> None:
        pass

    def on_generation_end(
        self, tracker: Tracker, reason: str, books: Iterable[JobBook], pins: list[int],
        releases: list[int],
    ) -> None:
        pass

    def on_drained(self, tracker: Tracker, releases: list[int]) -> None:
        pass

    def holds(self, tracker: Tracker, position: int) -> bool:
        """Whether the block at ``position`` of the generation's tables is
        pinned by this policy and released by reading the tables again (so
        the planner must not null it there when the engine frees it)."""
        return False


class NoPins(PinPolicy):
    name = "none"


class IncrementalPins(PinPolicy):
    name = "incremental"

    def on_job(
        self, tracker: Tracker, book: JobBook, token_len: int, block_size: int, pins: list[int]
    ) -> None:
        upto = token_len // block_size
        if upto > tracker.pinned_upto:
            PIN.fire((tracker.gen_key, tracker.pinned_upto), PinState.UNPINNED, PinEvent.PIN)
            pins.extend(_blocks(tracker, tracker.pinned_upto, upto))
            tracker.pinned_upto = upto

    def on_report(self, tracker: Tracker, block_size: int, releases: list[int]) -> None:
        upto = min(min(tracker.rank_confirmed) // block_size, tracker.pinned_upto)
        if upto > tracker.released_upto:
            PIN.fire((tracker.gen_key, tracker.released_upto), _PINNED,
                     PinEvent.CONFIRMED_BY_ALL_RANKS)
            # Tail first, as vLLM frees: the tail is the least likely to be shared.
            releases.extend(reversed(_blocks(tracker, tracker.released_upto, upto)))
            tracker.released_upto = upto

    def holds(self, tracker: Tracker, position: int) -> bool:
        return tracker.released_upto <= position < tracker.pinned_upto

    def on_drained(self, tracker: Tracker, releases: list[int]) -> None:
        if tracker.pinned_upto > tracker.released_upto:
            PIN.fire((tracker.gen_key, tracker.released_upto), _PINNED, PinEvent.UNREADABLE)
            releases.extend(
                reversed(_blocks(tracker, tracker.released_upto, tracker.pinned_upto))
            )
            tracker.released_upto = tracker.pinned_upto


class PerJobPins(PinPolicy):
    name = "per-job"

    def on_job(
        self, tracker: Tracker, book: JobBook, token_len: int, block_size: int, pins: list[int]
    ) -> None:
        book.pinned = _blocks(tracker, 0, max(len(t) for t in tracker.block_ids))
        PIN.fire(book.job_id, PinState.UNPINNED, PinEvent.PIN)
        pins.extend(book.pinned)

    def on_job_released(self, book: JobBook, releases: list[int]) -> None:
        if book.pinned:
            PIN.fire(book.job_id, _PINNED, PinEvent.CONFIRMED_BY_ALL_RANKS)
        releases.extend(reversed(book.pinned))
        book.pinned = []


class PreemptionDropsPins(PerJobPins):
    name = "per-job-dropped-on-preemption"

    def on_generation_end(
        self, tracker: Tracker, reason: str, books: Iterable[JobBook], pins: list[int],
        releases: list[int],
    ) -> None:
        if reason == "preempted":
            for book in books:
                if book.pinned:
                    # The mutant's bug: released while ranks may still read them.
                    PIN.fire(book.job_id, _PINNED, PinEvent.UNREADABLE)
                releases.extend(reversed(book.pinned))
                book.pinned = []


class DelayedFreeAtFinish(PinPolicy):
    name = "delayed-free-at-finish"

    def on_generation_end(
        self, tracker: Tracker, reason: str, books: Iterable[JobBook], pins: list[int],
        releases: list[int],
    ) -> None:
        if reason == "finished" and tracker.outstanding:
            tracker.delayed = _blocks(tracker, 0, max(len(t) for t in tracker.block_ids))
            PIN.fire(tracker.gen_key, PinState.UNPINNED, PinEvent.PIN)
            pins.extend(tracker.delayed)

    def on_drained(self, tracker: Tracker, releases: list[int]) -> None:
        if tracker.delayed:
            PIN.fire(tracker.gen_key, _PINNED, PinEvent.UNREADABLE)
        releases.extend(reversed(tracker.delayed))
        tracker.delayed = []
