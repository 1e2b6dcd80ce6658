"""A sliding-window block the engine freed is never read or pinned by a save job.

vLLM's ``SlidingWindowManager.remove_skipped_blocks`` nulls a window group's
blocks that left the window when a running request is allocated again, frees
them, and the pool may hand them to another request in that very step. A
save job planned from then on must neither pin them (a pin of another
request's block) nor read them (that request's bytes stored under this
request's window key: wrong KV a later engine would load and compute over).

The harness's engine frees window blocks as vLLM does and tells the planner
the positions (``CachedRequest.freed_positions``). Before this, the planner
kept an append-only copy of each table: a save deferred over a same-step
load (planned one step after its blocks were computed) pinned and read the
blocks vLLM had freed meanwhile. ``AppendOnly`` below is that planner, kept
as the negative control: the same scenarios catch it (K1, wrong content
stored, when another request reused the block; the engine double refusing
a pin of a free block otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec
from kvstate.harness import Harness
from kvstate.observations import Planned, StepScheduled
from kvstate.pins import NoPins
from kvstate.planner import Planner
from kvstate.records import (
    NULL_BLOCK_ID,
    CachedRequest,
    NewRequest,
    Report,
    SaveMeta,
    SchedulerStep,
)
from kvstate.scenarios import prompt
from kvstate.tables import JobState
from kvstate.tracker import Tracker
from kvstate.variants import DeltaMetadata, get_variant

# Blocks of 4 tokens, a window of 8 (layer 1), stored prefixes aligned to 16.
HYBRID = ConnectorConfig(block_size=4, world_size=2, alignment=16,
                         groups=(GroupSpec(), GroupSpec(GroupKind.SLIDING_WINDOW, 8)))


class AppendOnly(Planner):
    """The planner as it was: the engine's freed positions are ignored, so
    its tables still list blocks the engine no longer holds."""

    def _forget_freed(self, tracker: Tracker, freed: Sequence[Sequence[int]]) -> None:
        pass


def _deferred_save(num_blocks: int, variant: str = "kvstate",
                   planner: type[Planner] = Planner) -> Harness:
    """"a" stores a 33-token prompt. "b" shares its first 32 tokens, loads
    them (a hit of 32) and computes 32 more in that step, so its save waits
    for the load (deferred to the next step). In the next step vLLM frees
    b's window blocks before the window of token 64 (positions 6..13, all
    of them blocks b computed or loaded in the first step) before it
    allocates b's and c's new blocks: in a small pool those are the blocks
    just freed. A 32-token budget a step."""
    h = Harness(HYBRID, variant, num_blocks=num_blocks, token_budget=32, planner_factory=planner)
    h.add("a", prompt(33), max_new_tokens=2)
    h.settle()
    h.add("b", list(prompt(33))[:32] + [7] * 48, max_new_tokens=2, lookup=True)
    h.add("c", [9] * 40, max_new_tokens=2)
    h.settle()
    return h


def test_the_deferred_job_finds_the_freed_window_blocks_nulled_and_pins_none_of_them() -> None:
    h = _deferred_save(64)
    assert h.monitor.findings == []
    steps = [o.step for o in h.log if isinstance(o, StepScheduled)]
    plans = [o.plan for o in h.log if isinstance(o, Planned)]
    admitted = next(n for s in steps for n in s.new if n.req_id == "b")
    # b's second step: vLLM freed window positions 6..13 (0..5 were never
    # allocated: the null block of the hit), told with the request.
    told = next(i for i, s in enumerate(steps)
                if any(c.req_id == "b" and c.freed_positions for c in s.cached))
    b = next(c for c in steps[told].cached if c.req_id == "b")
    assert sorted(b.freed_positions[1]) == list(range(6, 14)) and b.freed_positions[0] == ()
    freed_ids = set(admitted.block_ids[1][6:14])
    (job,) = [m for m in plans[told].saves if m.req_id == "b"]
    assert job.token_ids_start < 14 * 4, "the deferred job covers the freed blocks' chunks"
    window = job.block_ids[1]
    assert window[:14] == (NULL_BLOCK_ID,) * 14
    assert NULL_BLOCK_ID not in window[14:] and NULL_BLOCK_ID not in job.block_ids[0]
    # Pinned: every full-attention block and the window blocks still held,
    # none of the freed ones.
    assert set(job.block_ids[0]) | set(window[14:]) <= set(plans[told].pins)
    assert not freed_ids & set(plans[told].pins)


@pytest.mark.parametrize("num_blocks", range(26, 50, 2))
def test_a_deferred_save_never_pins_or_stores_a_window_block_the_engine_freed(
        num_blocks: int) -> None:
    """Every pool size from one where c takes b's freed blocks at once to
    one where they stay free: the planner told of them is clean."""
    for variant in ("kvstate", "e2"):
        h = _deferred_save(num_blocks, variant)
        assert h.monitor.findings == [], (variant, h.monitor.findings)
        assert h.pool.num_free == num_blocks, "a pin left behind"


@pytest.mark.parametrize("num_blocks", range(26, 50, 2))
def test_the_append_only_planner_is_caught_at_every_pool_size(num_blocks: int) -> None:
    try:
        h = _deferred_save(num_blocks, planner=AppendOnly)
    except ValueError as exc:  # the engine double: a pin of a block nobody holds
        assert "which is free" in str(exc)
        return
    found = {f.invariant for f in h.monitor.findings}
    assert "K1" in found, f"another request's bytes stored unseen: {found}"


def test_where_the_freed_blocks_are_reused_at_once_the_append_only_planner_stores_wrong_bytes(
        ) -> None:
    """The wrong-bytes case itself: with 26 blocks, b's own new blocks of
    its second step are the window blocks vLLM just freed; b computes into
    them, and the deferred job reads them for the old positions: b's later
    chunks stored under its earlier window keys (K1)."""
    h = _deferred_save(26, planner=AppendOnly)
    wrong = [f for f in h.monitor.findings if f.invariant == "K1"]
    assert wrong and all("stored" in f.message for f in wrong)
    assert _deferred_save(26).monitor.findings == []


def _two_jobs(confirmed: int | None) -> tuple[SaveMeta, SaveMeta]:
    """A planner shipping only what is new (the default protocol's delta
    metadata) with a pin policy that holds nothing: a 24-token prefill (job
    1, window blocks 11..16), then 8 more tokens in a step where vLLM freed
    window positions 0 and 1 (job 2). ``confirmed``: the offset both ranks
    reported saved for job 1 before the second step (None: no reports)."""
    planner = Planner(HYBRID, attrs.evolve(get_variant("kvstate"), pins=NoPins()))
    prompt_ids = tuple(range(40))
    plan = planner.step(SchedulerStep(new=(NewRequest(
        "a", prompt_ids, 0, 24, ((1, 2, 3, 4, 5, 6), (11, 12, 13, 14, 15, 16)),
        tuple(bytes([i]) * 16 for i in range(6))),)))
    (first,) = plan.saves
    if confirmed is not None:
        planner.on_reports([Report(first.job_id, r, "a", first.generation, JobState.STORED,
                                   confirmed) for r in range(2)])
    plan = planner.step(SchedulerStep(cached=(CachedRequest(
        "a", 24, prompt_ids[24:32], ((7, 8), (17, 18)),
        (bytes([6]) * 16, bytes([7]) * 16), ((), (1, 0))),)))
    (second,) = plan.saves
    return first, second


def test_ranks_get_a_freed_block_again_only_where_one_may_still_read_it() -> None:
    """A rank reads from its own saved offset on: a freed block below what
    every rank confirmed is never read again and the slice stays the new
    blocks only; one a rank may still read is sent again as the null block
    (the rank's copy of the table follows the planner's)."""
    first, unread = _two_jobs(confirmed=24)
    assert first.block_ids_start == 0 and unread.block_ids_start == 6
    assert unread.block_ids == ((7, 8), (17, 18))
    _, resent = _two_jobs(confirmed=None)
    assert resent.block_ids_start == 0
    assert resent.block_ids == ((1, 2, 3, 4, 5, 6, 7, 8), (0, 0, 13, 14, 15, 16, 17, 18))
    mirror = [[1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]]  # a rank's copy after job 1
    entry = type("Entry", (), {"block_ids": mirror, "hashes": []})()
    tables, _ = DeltaMetadata.resolve(entry, resent)
    assert tables[1][:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
