"""Scheduler-side records: one ``Tracker`` per request generation, one
``JobBook`` per store job awaiting its ranks' reports.

Mutable and slotted on purpose: they are updated every step on the hot path,
and never leave the planner (what crosses to the ranks is a frozen
``SaveMeta``).
"""

from __future__ import annotations

from kvstate.tables import REQUEST, RequestEvent, RequestState


class Tracker:
    """Upstream's ``RequestTracker``, per generation, plus pin and report marks.

    ``num_saved_tokens`` is the scheduler's optimistic saved mark (advanced
    when a job is emitted); ``rank_confirmed[r]`` is what rank ``r`` reported
    it really saved. Blocks ``[released_upto, pinned_upto)`` are pinned by
    this generation (default protocol).
    """

    __slots__ = (
        "req_id",
        "generation",
        "state",
        "token_len",
        "block_ids",
        "num_saved_tokens",
        "save_at",
        "token_ids",
        "prefill_end",
        "hashes",
        "sent_blocks",
        "sent_hashes",
        "pinned_upto",
        "released_upto",
        "rank_confirmed",
        "outstanding",
        "ended",
        "load",
        "can_load",
        "delayed",
    )

    def __init__(self, req_id: str, generation: int, num_groups: int, world_size: int) -> None:
        self.req_id = req_id
        self.generation = generation
        self.state = RequestState.ABSENT
        self.token_len = 0
        self.block_ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_saved_tokens = 0
        # The next chunk boundary: a save needs token_len >= save_at.
        self.save_at = 0
        self.token_ids: list[int] | None = None
        self.prefill_end = 0
        self.hashes: list[bytes] = []
        self.sent_blocks = [0] * num_groups
        self.sent_hashes = 0
        self.pinned_upto = 0
        self.released_upto = 0
        self.rank_confirmed = [0] * world_size
        self.outstanding = 0
        self.ended = False
        self.load: tuple[int, int] | None = None
        self.can_load = False
        self.delayed: list[int] = []

    @property
    def gen_key(self) -> tuple[str, int]:
        return (self.req_id, self.generation)

    def fire(self, event: RequestEvent) -> None:
        """Move along the REQUEST table (`kvstate.tables`); an event the table
        does not allow in this state raises ``IllegalTransition`` naming both."""
        self.state = REQUEST.fire(self.gen_key, self.state, event)


class JobBook:
    """A store job the planner emitted and not every rank has reported yet."""

    __slots__ = ("job_id", "tracker", "ranks", "pinned")

    def __init__(self, job_id: int, tracker: Tracker) -> None:
        self.job_id = job_id
        self.tracker = tracker
        self.ranks: set[int] = set()
        self.pinned: list[int] = []
