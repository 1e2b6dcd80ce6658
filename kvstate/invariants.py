"""The invariant catalogue and the monitor that checks it.

Every invariant the project knows is one ``Invariant`` record in ``CATALOGUE``:
its id (``S1``–``S23`` for upstream's, ``K1``… for kvstate's own; `docs/invariants.md`
tells each one's history), a
one-line statement, whether it is a safety or a liveness property, which
observation checks it, the variant or fault that breaks it (a check that
cannot fail is a defect: `tests/test_invariants.py` runs each breaker and
requires the check to fire, and runs the default protocol through the same
scenario and requires silence) and the upstream issue it comes from.
`specs/invariants.md` is generated from this table and a test keeps it in sync.

``Monitor`` consumes observations (`kvstate.observations`) one at a time and
keeps only what the checks need: per-job and per-generation records that it
forgets when the job or generation settles, so a long simulation's monitor
stays small. It never raises on a violation; it records a ``Finding`` with the
invariant id, the index of the observation that broke it and a message. The
simulator, the trace checker and the scenario tests all read ``findings``.

S5 ("no job dequeued without a ledger entry") has no checker: the executor
registers a job in the same call that enqueues it, so there is no window to
observe (it matters again for the threaded adapter, which drives the same
``receive``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any

import attrs

from kvstate.blockhash import KVSTATE, BlockHasher
from kvstate.config import ConnectorConfig, GroupKind
from kvstate.events import BlockStored
from kvstate.keys import (
    blocks_needed_for_hit,
    chunk_hash,
    key_digest,
    key_for,
    key_prefix,
    parse_key,
)
from kvstate.observations import (
    BlockAllocated,
    BlockFreed,
    ExistsAnswered,
    JobFinished,
    JobStarted,
    KeyEvicted,
    LoadDone,
    LookupDone,
    Observation,
    Planned,
    PutDone,
    Quiescent,
    ReportDelivered,
    Settled,
    StateWritten,
    StepScheduled,
)
from kvstate.records import GenKey, Plan


@attrs.frozen(slots=True)
class Invariant:
    id: str
    statement: str
    kind: str  # "safety" | "liveness"
    checked_at: str
    broken_by: str
    scenario: str
    upstream: str


@attrs.frozen(slots=True)
class Finding:
    invariant: str
    event_index: int
    message: str


CATALOGUE: tuple[Invariant, ...] = (
    Invariant("S1", "No store job reads an engine block that was freed after the job was emitted",
              "safety", "PutDone", "e1", "preempt-running-job", "vLLM#52360"),
    Invariant("S2", "Every block a job reads is pinned while it reads it", "safety", "PutDone",
              "no-pins-on-preemption", "preempt-running-job", "vLLM#52372"),
    Invariant("S3", "A job of an older generation never writes the saved offset, skip or retry "
              "state a newer generation of its request id reads", "safety", "StateWritten",
              "req-id-counter-ledger", "reuse-with-stale-job", "vLLM#51637"),
    Invariant("S4", "Each rank reports each job exactly once", "safety+liveness",
              "ReportDelivered, Settled, Quiescent", "missing-finally", "store-raises",
              "vLLM#43742"),
    Invariant("S6", "Every pin is eventually released", "liveness", "Quiescent",
              "missing-finally", "store-raises", "vLLM#43742"),
    Invariant("S7", "Only full blocks of computed tokens are saved, aligned to the lcm",
              "safety", "Planned, JobStarted, PutDone",
              "fault: a meta beyond the computed tokens, or a rank aligning to the block "
              "size, not the lcm", "synthetic", "LMCache#2929"),
    Invariant("S8", "A key depends only on prefix hash, model, rank namespace and group",
              "safety", "PutDone", "key-without-rank", "reverse-ranks", "vLLM#56971"),
    Invariant("S9", "No job puts a key the store already holds without checking it first",
              "safety", "PutDone", "skip-exists-check", "shared-prefix",
              "vLLM incremental saving"),
    Invariant("S10", "A range a rank skipped or failed is retried by the generation's next "
              "live job on that rank", "safety", "JobStarted", "advance-offset-on-failure",
              "partial-put-failure", "vLLM incremental saving"),
    Invariant("S11", "TP-strided chunks go to the rank owning their absolute chunk id",
              "safety", "JobFinished", "stride-by-relative-chunk", "strided-events",
              "vLLM incremental saving"),
    Invariant("S12", "A rank's saved offset never exceeds the scheduler's mark for the "
              "generation and never moves backwards", "safety", "JobStarted, StateWritten",
              "e2", "reuse-with-stale-job", "vLLM#52372"),
    Invariant("S13", "No save job is emitted in a step that loads the same generation",
              "safety", "Planned", "save-on-loading-step", "load-hit",
              "vLLM 0.33.0 build_connector_meta"),
    Invariant("S14", "A consumer saves only decode tokens, and only with save_decode_cache",
              "safety", "Planned", "consumer-saves-prefill", "consumer-backfill",
              "vLLM#52466"),
    Invariant("S15", "A KV event's parent is the chunk's predecessor in the request's hash "
              "chain", "safety", "JobFinished", "parent-previous-emitted", "shared-prefix",
              "vLLM#52466, vllm-ascend#12012"),
    Invariant("S16", "A published event's chunk was reported stored by a rank of every "
              "namespace (published only at quorum)",
              "safety", "Settled", "e2", "evicted-and-reput",
              "vLLM 0.33.0 (measured: value counting)"),
    Invariant("S17", "A KV event's token ids are the chunk's tokens, or empty (recomputed with "
              "the hash function the trace's header names; not judged where it cannot be)",
              "safety",
              "JobFinished", "snapshot-from-zero", "snapshot-events", "vLLM#52466"),
    Invariant("S18", "Ledger entries of finished requests are eventually deleted", "liveness",
              "Quiescent", "req-id-counter-ledger", "preempt-with-queued-job", "vLLM#51662"),
    Invariant("S19", "Every failed load is reported so the engine recomputes it", "safety",
              "LoadDone", "swallow-load-errors", "load-evicted",
              "vLLM get_block_ids_with_load_errors"),
    Invariant("S20", "A lookup hit was present in every rank namespace at lookup time",
              "safety", "LookupDone", "lookup-first-namespace", "lookup-partial-namespace",
              "vLLM 0.33.0 lookup"),
    Invariant("S21", "After a preemption, no job of the preempted generation dequeued later "
              "puts", "safety",
              "PutDone", "req-id-counter-ledger", "preempt-with-queued-job", "vLLM#51637"),
    Invariant("S22", "Store job ids strictly increase and are never reused", "safety",
              "Planned", "fault: a plan repeating a job id", "synthetic", "vLLM#52372"),
    Invariant("S23", "A request is never scheduled in the step it is preempted", "safety",
              "Planned", "fault: engine schedules a preempted request", "synthetic",
              "vLLM 0.33.0 (assumed, unchecked)"),
    Invariant("K1", "The content stored under a key is exactly that key's prefix shard (a put "
              "whose content was not observed, \"\", is not judged)", "safety", "PutDone", "e1",
              "preempt-running-job", "vLLM#52360"),
    Invariant("K2", "A job reads only its own generation's rank state (offset, retry suffix)",
              "safety", "JobStarted", "retry-keyed-by-request", "reuse-with-failed-retry",
              "vLLM#51637, #52466"),
    Invariant("K3", "At quiescence nothing is left: no pins, jobs, ledger entries, trackers "
              "or pending events", "liveness", "Quiescent", "e2", "store-raises",
              "vLLM 0.33.0 (measured: events kept)"),
    Invariant("K4", "A consumer that rejects orphans accepts every published event",
              "safety", "Settled", "e2", "strided-events", "Dynamo#671"),
    Invariant("K5", "Every save job covers at least one new full block", "safety", "Planned",
              "boundary-without-plus-one", "decode-save", "LMCache#653"),
    Invariant("K6", "A generation skipped for store pressure is retried once the backoff "
              "expired", "liveness", "JobFinished", "e2", "pressure-idle",
              "vLLM 0.33.0 pressure skip"),
    Invariant("K7", "A rank reports as stored only chunks its job put with code 0 or found "
              "present in the store", "safety", "JobFinished",
              "fault: a verdict claiming a failed put", "synthetic",
              "vLLM 0.33.0 send thread (a failed put is not saved)"),
    Invariant("K8", "A request whose load failed computes: its generation is not looked up "
              "again, so lookups and loads stay bounded however the store fails", "liveness",
              "LookupDone", "e2", "load-async-evicted",
              "specs/conformance.md H4 (MooncakeStoreConnector looks up after a failed load)"),
    Invariant("K9", "A lookup leaves at least one prompt token to compute (a hit never covers "
              "the whole prompt)", "safety", "LookupDone",
              "fault: a lookup answer covering the whole prompt", "synthetic",
              "vLLM Scheduler (a request needs one computed token to sample from)"),
)

INVARIANTS: dict[str, Invariant] = {inv.id: inv for inv in CATALOGUE}

# The catalogue names one breaker per invariant; variants it names for none are
# upstream eras or mutants whose bug it credits to a sibling. Their own bugs:
_ALSO_BROKEN_BY: dict[str, tuple[str, ...]] = {
    "e0": ("S1", "K1"),  # no pins at all, as e1
    "e1": ("S2",),  # blocks freed at preemption while a job reads them
    "delayed-free-at-finish": ("S1", "S2", "K1"),
    "consumer-without-backfill": ("S10",),
}


def broken_by(variant: str) -> tuple[str, ...]:
    """The invariants ``variant`` exists to break (empty for ``kvstate``).
    E2-based mutants also inherit e2's bugs; a tool that is to show it finds
    *this* variant's bug checks these only."""
    own = [inv.id for inv in CATALOGUE if inv.broken_by == variant]
    return tuple(dict.fromkeys([*own, *_ALSO_BROKEN_BY.get(variant, ())]))

# How many evicted chunk hashes the consumer model remembers (bounded: a child
# announced later than this many evictions after its parent is flagged).
EVICTED_MEMORY = 1 << 17


def expected_content(key: str) -> str | None:
    """The content tag K1 expects under ``key`` (``None``: not kvstate's key format)."""
    fields = parse_key(key)
    if fields is None:
        return None
    digest, ns, group = fields
    return f"{digest}|ns{ns}|g{group}"


# What the monitor keeps is what a later verdict can read, and no more. Where
# a check compares *when* two things happened (a block freed after a job was
# emitted, a job started after its generation was preempted), the comparison
# is settled when the later of the two is observed and kept as a fact (a set
# member, a flag), not as two observation numbers compared later: the monitor's
# state then says the same for every interleaving that leads to the same facts.
# The model checker's state space shrinks by that (a state is the whole harness,
# monitor included: `sim.explore.modelcheck.model`), and a long trace's monitor stops
# carrying one number per block ever freed.


class _Gen:
    """What the monitor knows about one request generation."""

    __slots__ = ("mark", "hashes", "computed", "preempted", "outstanding", "ended",
                 "announced")

    def __init__(self) -> None:
        self.mark = 0
        self.hashes: list[bytes] = []
        self.computed = 0
        self.preempted = False  # a plan ended it as preempted
        self.outstanding = 0  # jobs emitted and not yet released
        self.ended = False
        # (chunk digest, group) -> rank namespaces whose ranks announced it stored
        self.announced: dict[tuple[bytes, int], set[int]] = {}


class _Job:
    __slots__ = ("gen", "step", "freed", "late_start", "token_len", "checked", "held",
                 "reports", "complete", "claimed")

    def __init__(self, gen: GenKey, step: int) -> None:
        self.gen = gen
        self.step = step  # the plan step that emitted it (read by `Monitor.end` only)
        # Blocks freed since the job was emitted (S1).
        self.freed: set[int] = set()
        # Ranks that dequeued the job after its generation was preempted (S21).
        self.late_start: set[int] = set()
        self.token_len = 0
        # (rank, key) of every existence check a rank made for the job (S9).
        # A set of facts, not a dict per rank: which rank checked first is no
        # verdict's business, and a dict would keep it (insertion order), so
        # the model checker would count the two orders as two states.
        self.checked: set[tuple[int, str]] = set()
        # (rank, key) the store holds by what the rank saw in this job: a put
        # answered 0 or an existence check answered present (K7), until the
        # rank's verdict; a set of facts for the same reason as ``checked``.
        self.held: set[tuple[int, str]] = set()
        self.reports: set[int] = set()
        self.complete = False  # every rank reported it (derived, never taken from a recorder)
        self.claimed = False  # a settlement listed it as released before it was complete


class Monitor:
    def __init__(self, config: ConnectorConfig, only: Sequence[str] | None = None,
                 store_view: set[str] | None = None, block_hash: str = KVSTATE,
                 none_hash: bytes | None = None, shared_store: bool = False) -> None:
        """``store_view``: the keys believed stored; engines sharing one store
        share one view (each monitor sees only its own engine's puts).
        ``block_hash``/``none_hash``: the engine's block-hash function
        (`kvstate.blockhash`), which S17 recomputes."""
        self.config = config
        # True when writers outside this trace share the store (a production
        # engine's trace): a key it never saw stored may still be present.
        self.shared_store = shared_store
        unknown = sorted(set(only or ()) - set(INVARIANTS))
        if unknown:
            raise ValueError(f"unknown invariant id(s) {', '.join(unknown)} "
                             f"(known: {', '.join(INVARIANTS)})")
        self.enabled = frozenset(only) if only is not None else frozenset(INVARIANTS)
        self.findings: list[Finding] = []
        self.hasher = BlockHasher(block_hash, none_hash)
        # (invariant, why) -> how many times a check could not be made: shown
        # as notes, never as findings.
        self.unchecked: Counter[tuple[str, str]] = Counter()
        # (invariant, what) -> how often a recorder's own verdict (a plan's or a
        # settlement's violations, its released jobs, published_by) disagreed
        # with what the monitor derived from the observations: notes.
        self.disagreements: Counter[tuple[str, str]] = Counter()
        self.index = -1
        self.absent: frozenset[str] = frozenset()
        self._handlers: dict[type, Any] = {}  # observation type -> bound checker (or None)
        self.gens: dict[GenKey, _Gen] = {}
        # request id -> the generation a load of which failed (K8); the
        # request's next lookup of a later generation clears it.
        self.load_failed: dict[str, int] = {}
        self.current: dict[str, int] = {}
        self.jobs: dict[int, _Job] = {}
        # Job ids are integers >= 0 that strictly increase; the first may be
        # 0 (upstream numbers from 0, kvstate from 1: neither is the contract).
        self.last_job_id = -1
        self.step = 0  # the latest plan's step number
        self.quiescent = False  # the latest observation was a Quiescent line
        self.last_report: dict[int, int] = {}  # rank -> step of its latest report
        # Derived from the scheduler's own output, never from the planner's
        # verdicts: requests running now, the invariants the latest step broke
        # (to compare with the plan's own list), whether that step was seen.
        self.running: set[str] = set()
        self._step_found: set[str] = set()
        self._step_seen = False
        # Jobs every rank has reported since the latest settlement (released
        # by it, derived); whether this trace's settlements list their
        # released jobs at all (an annotation a recorder may leave out).
        self._completed: list[int] = []
        self.releases_recorded = False
        # (chunk digest, group) -> live generations whose ranks announced it.
        self.announcers: dict[tuple[bytes, int], list[GenKey]] = {}
        self._report_found: set[str] = set()  # S4 derived from this batch's reports
        self._late: dict[int, None] = {}  # jobs released late (bounded), not flagged twice
        self.pinned: Counter[int] = Counter()
        self.pinned_since: dict[int, int] = {}  # block -> step it was first pinned
        self.free: set[int] = set()
        self.store: set[str] = store_view if store_view is not None else set()
        self.frontier: dict[tuple[int, GenKey], int] = {}
        self.offsets: dict[tuple[int, str, int], int] = {}
        # The orphan-rejecting consumer's index: announced chunks still in the
        # store, by (group, hash) — a hybrid model's groups share hashes, and
        # one group's chunk is no parent in another's chain. A chunk the store
        # evicted is forgotten but remembered as evicted (bounded), so a child
        # naming it is not mistaken for an orphan.
        self.known_blocks: dict[tuple[int, bytes], None] = {}
        self.evicted_blocks: dict[tuple[int, bytes], None] = {}
        # Groups whose events form a chain (full attention); a sliding-window
        # group's chain is sparse by design, so its parents are not required.
        self._chained_groups = frozenset(
            i for i, g in enumerate(config.groups) if g.kind is GroupKind.FULL)
        self._computed_next: dict[str, int] = {}
        self._prefixes = {
            (r, g): key_prefix(config, r, g)
            for r in range(config.world_size) for g in range(len(config.groups))
        }
        # K1's expected tag of a key with a prefix above, after its digest.
        self._tag_suffixes = {
            where: (tag[2:] if (tag := expected_content(prefix + "@00")) is not None else None)
            for where, prefix in self._prefixes.items()
        }
        self._hashes_per_block = config.hashes_per_block  # properties, read per event
        # S20 with a sliding-window group: per group, the blocks a hit needs
        # before its boundary (None: every chunk, full attention). A window
        # group stores only the blocks some aligned hit needs, so a lookup hit
        # needs no more of it (vLLM 0.33.0's mask-aware lookup).
        needs = tuple(None if g.kind is GroupKind.FULL or g.sliding_window is None
                      else blocks_needed_for_hit(g.sliding_window, config.block_size)
                      for g in config.groups)
        self._hit_needs = needs if any(n is not None for n in needs) else None
        self._hash_block = config.hash_block

    def __getstate__(self) -> dict[str, Any]:
        # The handler cache holds bound methods; a copy rebuilds it lazily.
        state = self.__dict__.copy()
        state["_handlers"] = {}
        return state

    # ------------------------------------------------------------------

    def fail(self, invariant: str, message: str) -> None:
        if invariant in self.enabled:
            self.findings.append(Finding(invariant, self.index, message))
        elif invariant not in INVARIANTS:  # a checker's typo must not vanish silently
            raise ValueError(f"a checker reported unknown invariant {invariant!r}")

    def fired(self) -> set[str]:
        return {f.invariant for f in self.findings}

    def skip(self, invariant: str, why: str) -> None:
        """A check that could not be made for one observation (not a finding)."""
        if invariant in self.enabled:
            self.unchecked[(invariant, why)] += 1
        elif invariant not in INVARIANTS:
            raise ValueError(f"a checker skipped unknown invariant {invariant!r}")

    def disagree(self, invariant: str, what: str) -> None:
        """A recorder's own verdict that the observations do not bear out (a note)."""
        self.disagreements[(invariant, what)] += 1

    def notes(self) -> list[str]:
        """What the monitor could not judge, one line per invariant and reason,
        and where a recorder's own verdicts disagreed with the monitor's."""
        return [f"{inv} not checked for {count} observation{'s' if count > 1 else ''}: {why}"
                for (inv, why), count in sorted(self.unchecked.items())] + [
                f"{inv}: {what} ({count} time{'s' if count > 1 else ''})"
                for (inv, what), count in sorted(self.disagreements.items())]

    def observe(self, obs: Observation, absent: frozenset[str] = frozenset()) -> None:
        """Check one observation. ``absent``: the optional annotation fields
        its trace line left out (`kvstate.trace.ANNOTATIONS`); a left-out
        field is unknown, never read as its empty default."""
        self.index += 1
        kind = type(obs)
        self.quiescent = False  # _on_Quiescent sets it
        self.absent = absent
        try:
            handler = self._handlers[kind]
        except KeyError:
            handler = self._handlers[kind] = getattr(self, "_on_" + kind.__name__, None)
        if handler is not None:
            handler(obs)

    # ------------------------------------------------------------------
    # Scheduler side.

    def _on_StepScheduled(self, obs: StepScheduled) -> None:
        step = obs.step
        nxt = self._computed_next
        nxt.clear()
        found = self._step_found
        found.clear()
        self._step_seen = True
        running = self.running
        for req_id in step.finished:
            running.discard(req_id)
        if step.preempted:
            scheduled = {r.req_id for r in step.new}
            scheduled.update(r.req_id for r in step.cached)
            scheduled.update(r.req_id for r in step.resumed)
            for req_id in step.preempted:
                if req_id in scheduled:
                    found.add("S23")
                    self.fail("S23", f"request {req_id!r} is scheduled in the step that "
                              "preempts it")
                elif req_id not in running:
                    found.add("S23")
                    self.fail("S23", f"preemption of request {req_id!r}, which is not running")
                running.discard(req_id)
        for new in step.new:
            if new.req_id in running:
                found.add("K2")
                self.fail("K2", f"request {new.req_id!r} scheduled as new while it is still "
                          "running")
            running.add(new.req_id)
            nxt[new.req_id] = new.num_computed_tokens + new.num_scheduled_tokens
        for res in step.resumed:
            running.add(res.req_id)
        for res in step.resumed:
            nxt[res.req_id] = res.num_computed_tokens + res.num_scheduled_tokens
        for cached in step.cached:
            if cached.req_id not in running:
                found.add("S23")
                self.fail("S23", f"request {cached.req_id!r} scheduled as running but it is "
                          "not running (finished, preempted or never scheduled)")
            nxt[cached.req_id] = cached.num_computed_tokens + len(cached.new_token_ids)

    def _gen(self, key: GenKey) -> _Gen:
        gen = self.gens.get(key)
        if gen is None:
            gen = self.gens[key] = _Gen()
        return gen

    def _on_Planned(self, obs: Planned) -> None:
        plan: Plan = obs.plan
        config = self.config
        step = self.step = plan.step
        self._compare_verdicts("plan", plan.violations, self._step_found,
                               self._step_seen, "violations" in self.absent)
        self._step_seen = False
        self._step_found.clear()
        self._release_completed()  # a trace with no Settled lines: released when reported
        # Generations end by the plan's own output (``finished``/``preempted``,
        # what the ranks act on); ``ended`` is kvstate's annotation of the same
        # and may be left out.
        ended = []
        for keys, reason in ((plan.finished, "finished"), (plan.preempted, "preempted")):
            for req_id, gen_no in keys:
                ended.append(((req_id, gen_no), reason))
        for end in plan.ended:
            ended.append(((end.req_id, end.generation), end.reason))
        for key, reason in ended:
            gen = self._gen(key)
            gen.ended = True
            if reason == "preempted":
                gen.preempted = True
        for start in plan.started:
            self.current[start.req_id] = start.generation
            self._gen((start.req_id, start.generation))
        current = self.current
        for meta in plan.saves:  # without ``started``: the newest generation saved
            known = current.get(meta.req_id)
            if known is None or meta.generation > known:
                current[meta.req_id] = meta.generation
        for req_id, computed in self._computed_next.items():
            newest = current.get(req_id)
            if newest is not None:
                self._gen((req_id, newest)).computed = computed
        loading = {(load.req_id, load.generation) for load in plan.loads}
        for meta in plan.saves:
            key = (meta.req_id, meta.generation)
            gen = self._gen(key)
            if meta.job_id <= self.last_job_id:
                self.fail("S22", f"job id {meta.job_id} after job id {self.last_job_id}")
            self.last_job_id = max(self.last_job_id, meta.job_id)
            if meta.token_len % config.block_size or meta.token_len > gen.computed:
                self.fail("S7", f"job {meta.job_id} saves up to token {meta.token_len}; "
                          f"{gen.computed} tokens computed, block size {config.block_size}")
            if meta.token_len <= meta.token_ids_start or (
                    meta.token_ids_start // config.block_size == meta.token_len // config.block_size):
                self.fail("K5", f"job {meta.job_id} of {key} covers tokens "
                          f"[{meta.token_ids_start}, {meta.token_len}): no new full block")
            if key in loading:
                self.fail("S13", f"job {meta.job_id} saves {key} in the step that loads it")
            if config.is_consumer and not (meta.is_decode and config.save_decode_cache):
                self.fail("S14", f"consumer emitted job {meta.job_id} for {key} "
                          f"(decode={meta.is_decode}, save_decode_cache={config.save_decode_cache})")
            gen.mark = max(gen.mark, meta.token_len)
            gen.hashes[meta.hashes_start:] = meta.block_hashes
            gen.outstanding += 1
            self.jobs[meta.job_id] = _Job(key, step)
        pinned, since = self.pinned, self.pinned_since
        for block in plan.pins:
            if block not in pinned:
                since[block] = step
            pinned[block] += 1
        self._release(plan.releases)
        for key, _ in ended:
            self._maybe_forget(key)

    # Invariants the monitor derives itself from what a plan's step and a
    # settlement's reports show; a recorder listing one of these that the
    # observations do not bear out is a note, not a finding.
    _DERIVED = {"plan": frozenset({"S23", "K2"}), "settlement": frozenset({"S4"})}

    def _compare_verdicts(self, where: str, listed: Sequence[Any], found: set[str],
                          seen: bool, left_out: bool) -> None:
        """Compare a recorder's own list of violations with what the monitor
        derived from the observations (``found``). Never believed: a listed
        violation the monitor could judge and did not find is a note; one it
        cannot derive (the step was not observed, or an invariant it does not
        derive at this line) stays a finding, marked as the recorder's own
        verdict; one the monitor found and the list omits is a note (the
        monitor's own finding stands)."""
        derived = self._DERIVED[where] if seen else frozenset()
        names = set()
        for v in listed:
            names.add(v.invariant)
            if v.invariant in found:
                continue
            if v.invariant in derived:
                self.disagree(v.invariant, f"the recorder's {where} lists a violation the "
                              f"observations do not show ({v.message})")
            else:
                self.fail(v.invariant, f"the recorder's {where} reports: {v.message} "
                          "(its own verdict; not derivable from the observations here)")
        if not left_out:
            for invariant in sorted(found - names):
                self.disagree(invariant, f"the recorder's {where} does not list a violation "
                              "the checker found")

    def _maybe_forget(self, key: GenKey) -> None:
        """A generation that ended with every job released can produce no more
        observations worth checking: drop what the monitor kept for it, so a
        long run's monitor holds state only for live work."""
        gen = self.gens.get(key)
        if gen is None or not gen.ended or gen.outstanding > 0:
            return
        del self.gens[key]
        announcers = self.announcers
        for chunk in gen.announced:
            holders = announcers.get(chunk)
            if holders is not None:
                try:
                    holders.remove(key)
                except ValueError:
                    pass
                if not holders:
                    del announcers[chunk]
        req_id, generation = key
        for rank in range(self.config.world_size):
            self.frontier.pop((rank, key), None)
            self.offsets.pop((rank, req_id, generation), None)
        if self.current.get(req_id) == generation:
            del self.current[req_id]

    def _release(self, blocks: Sequence[int]) -> None:
        pinned = self.pinned
        for block in blocks:
            pinned[block] -= 1
            if pinned[block] <= 0:
                del pinned[block]
                self.pinned_since.pop(block, None)

    def _on_Settled(self, obs: Settled) -> None:
        settlement = obs.settlement
        absent = self.absent
        self._compare_verdicts("settlement", settlement.violations, self._report_found,
                               True, "violations" in absent)
        self._report_found.clear()
        self._release(settlement.releases)
        by = () if "published_by" in absent else settlement.published_by
        for i, event in enumerate(settlement.published):
            self._published(event, by[i] if i < len(by) else None)
        if "released_jobs" in absent:
            self._release_completed()
            return
        # The settlement's list of released jobs is the recorder's word:
        # compared with the jobs every rank has reported, never believed.
        self.releases_recorded = True
        jobs = self.jobs
        listed = set()
        for job_id in settlement.released_jobs:
            listed.add(job_id)
            job = jobs.get(job_id)
            if job is None:
                if job_id in self._late:
                    del self._late[job_id]  # its omission was flagged already
                else:
                    self.fail("S4", f"settlement lists job {job_id} as released, but it is "
                              "not outstanding (released before or never emitted)")
            elif not job.complete:
                if not job.claimed:
                    job.claimed = True
                    missing = sorted(set(range(self.config.world_size)) - job.reports)
                    self.fail("S4", f"settlement releases job {job_id} before ranks {missing} "
                              "reported it")
            else:
                self._drop(job_id, job)
        for job_id in self._completed:
            job = jobs.get(job_id)
            if job is not None and job_id not in listed:
                self.fail("S18", f"every rank reported job {job_id} of {job.gen}, but the "
                          "settlement of those reports does not release it")
                self._late[job_id] = None
                if len(self._late) > EVICTED_MEMORY:
                    del self._late[next(iter(self._late))]
                self._drop(job_id, job)
        self._completed.clear()

    def _drop(self, job_id: int, job: _Job) -> None:
        del self.jobs[job_id]
        gen = self.gens.get(job.gen)
        if gen is not None:
            gen.outstanding -= 1
            self._maybe_forget(job.gen)

    def _release_completed(self) -> None:
        """Release the jobs every rank has reported (derived; for traces whose
        settlements do not list released jobs, or that have no settlements)."""
        if self.releases_recorded or not self._completed:
            return
        jobs = self.jobs
        for job_id in self._completed:
            job = jobs.get(job_id)
            if job is not None:
                self.skip("S18", "no settlement lists the jobs it released (a job counts as "
                          "released once every rank reported it)")
                self._drop(job_id, job)
        self._completed.clear()

    def _published(self, event: BlockStored, by: GenKey | None) -> None:
        digest = event.block_hashes[-1]
        chunk = (digest, event.group_idx)
        namespaces = self.config.num_namespaces
        gens = self.gens
        gen = gens.get(by) if by is not None else None
        if gen is None or len(gen.announced.get(chunk, ())) < namespaces:
            # The generation ``published_by`` names (kvstate's annotation, may
            # be left out) did not complete the quorum: any live generation
            # whose ranks announced the chunk from every namespace does.
            best: set[int] = set()
            for holder in self.announcers.get(chunk, ()):
                announced = gens[holder].announced[chunk]
                if len(announced) >= namespaces:
                    best = announced
                    if by is not None:
                        self.disagree("S16", "published_by names a generation that did not "
                                      "complete the event's quorum (another one did)")
                    break
                if len(announced) > len(best):
                    best = announced
            missing = set(range(namespaces)) - best
            if missing:
                self.fail("S16", f"event for {digest.hex()} published, but rank namespaces "
                          f"{sorted(missing)} never reported storing it")
        parent = event.parent_block_hash
        group = event.group_idx
        if (parent is not None and group in self._chained_groups
                and (group, parent) not in self.known_blocks
                and (group, parent) not in self.evicted_blocks):
            self.fail("K4", f"event for {digest.hex()} of group {group} names parent "
                      f"{parent.hex()}, which no earlier event of group {group} announced "
                      "(an orphan)")
        self.known_blocks[(group, digest)] = None

    # ------------------------------------------------------------------
    # Rank side.

    def _on_JobStarted(self, obs: JobStarted) -> None:
        job = self.jobs.get(obs.job_id)
        if job is None:
            self.fail("S4", f"rank {obs.rank} started job {obs.job_id}, which is not outstanding")
            return
        job.token_len = obs.token_len
        lcm = self.config.lcm_block_size
        if obs.token_len % lcm:
            # The put-side S7 check trusts this length, so it must be aligned
            # itself: a rank that rounds to the block size instead of the lcm
            # stores a hybrid prefix no lookup at an lcm boundary can use.
            self.fail("S7", f"rank {obs.rank} job {obs.job_id} aligned its length to "
                      f"{obs.token_len}, not a multiple of the lcm {lcm}")
        gen_key = (obs.req_id, obs.generation)
        gen = self.gens.get(gen_key)
        if gen is not None and gen.preempted:
            job.late_start.add(obs.rank)
        else:
            job.late_start.discard(obs.rank)  # a later start decides
        if not obs.live:
            return
        if gen is not None and obs.save_start > gen.mark:
            self.fail("S12", f"rank {obs.rank} job {obs.job_id} of {gen_key} resumes at offset "
                      f"{obs.save_start}, beyond the generation's mark {gen.mark}")
        for what, writer in (("state", obs.state_generation), ("retry suffix", obs.retry_generation)):
            if writer is not None and writer != obs.generation:
                self.fail("K2", f"rank {obs.rank} job {obs.job_id} of generation "
                          f"{obs.generation} reads the {what} of generation {writer}")
        frontier = self.frontier.get((obs.rank, gen_key), 0)
        if obs.save_start > frontier:
            self.fail("S10", f"rank {obs.rank} job {obs.job_id} of {gen_key} starts at "
                      f"{obs.save_start} but has really saved only up to {frontier}")

    def _on_StateWritten(self, obs: StateWritten) -> None:
        newest = self.current.get(obs.req_id)
        if newest is not None and newest != obs.generation and (
                obs.scope_generation is None or obs.scope_generation == newest):
            self.fail("S3", f"rank {obs.rank} job {obs.job_id} of generation {obs.generation} "
                      f"wrote the {obs.field} of {obs.req_id!r}, now generation {newest}")
        if obs.field == "offset":
            key = (obs.rank, obs.req_id, obs.generation)
            before = self.offsets.get(key, 0)
            if obs.value < before:
                self.fail("S12", f"rank {obs.rank} offset of {obs.req_id!r} moved back "
                          f"{before} -> {obs.value} (job {obs.job_id})")
            self.offsets[key] = obs.value

    def _on_ExistsAnswered(self, obs: ExistsAnswered) -> None:
        job = self.jobs.get(obs.job_id)
        if job is not None:
            ranks = repeat(obs.rank)  # (rank, key) pairs built in C: one per checked key
            job.checked.update(zip(ranks, obs.keys))
            job.held.update(zip(ranks, compress(obs.keys, obs.present)))

    def _on_PutDone(self, obs: PutDone) -> None:
        config = self.config
        job = self.jobs.get(obs.job_id)
        gen_key = (obs.req_id, obs.generation)
        gen = self.gens.get(gen_key)
        if job is not None:
            if obs.block_id in self.free or obs.block_id in job.freed:
                self.fail("S1", f"rank {obs.rank} job {obs.job_id} read block {obs.block_id}, "
                          "freed after the job was emitted")
            if obs.rank in job.late_start and gen is not None and gen.preempted:
                self.fail("S21", f"rank {obs.rank} job {obs.job_id} dequeued after {gen_key} "
                          "was preempted and still put")
            if obs.accepted is False and obs.code == 0 and (
                    obs.rank, obs.key) not in job.checked:
                self.fail("S9", f"rank {obs.rank} job {obs.job_id} put {obs.key} unchecked; "
                          "the store already held it")
            if (obs.chunk_id + 1) * config.block_size > max(job.token_len, 0):
                self.fail("S7", f"rank {obs.rank} job {obs.job_id} put chunk {obs.chunk_id} "
                          f"beyond its aligned length {job.token_len}")
            if obs.code == 0:
                job.held.add((obs.rank, obs.key))
        if self.pinned.get(obs.block_id, 0) <= 0:
            self.fail("S2", f"rank {obs.rank} job {obs.job_id} read block {obs.block_id}, "
                      "which no pin holds")
        expected_tag = None
        hpb = self._hashes_per_block
        if gen is not None and (obs.chunk_id + 1) * hpb <= len(gen.hashes):
            digest = chunk_hash(gen.hashes, obs.chunk_id, hpb).hex()
            where = (obs.rank, obs.group)
            expected = key_for(self._prefixes[where], digest)
            if obs.key != expected:
                self.fail("S8", f"rank {obs.rank} put chunk {obs.chunk_id} of {gen_key} under "
                          f"{obs.key!r}, expected {expected!r}")
            elif obs.accepted and obs.content:
                # The key is the one S8 expects: its tag needs no parsing.
                suffix = self._tag_suffixes[where]
                expected_tag = digest + suffix if suffix is not None else None
        if obs.accepted:
            if not obs.content:
                self.skip("K1", "content not observed (\"\")")
            else:
                if expected_tag is None:
                    expected_tag = expected_content(obs.key)
                if expected_tag is None:
                    self.skip("K1", "key not in kvstate's key format")
                elif obs.content != expected_tag:
                    self.fail("K1", f"rank {obs.rank} job {obs.job_id} stored {obs.content!r} "
                              f"under {obs.key!r}")
            self.store.add(obs.key)

    def _on_JobFinished(self, obs: JobFinished) -> None:
        config = self.config
        gen_key = (obs.req_id, obs.generation)
        gen = self.gens.get(gen_key)
        step = config.put_step
        for group, cid in obs.stored + obs.failed:
            if cid % step != (obs.rank + group) % step:
                self.fail("S11", f"rank {obs.rank} handled chunk {cid} of group {group}, owned "
                          f"by stride residue {cid % step}")
        if obs.outcome in ("stored", "partially_stored", "failed") and obs.save_start <= \
                self.frontier.get((obs.rank, gen_key), 0):
            if not obs.failed and obs.outcome == "stored":
                self.frontier[(obs.rank, gen_key)] = obs.token_len
            elif obs.failed:
                first_failed = min(cid for _, cid in obs.failed) * config.block_size
                self.frontier[(obs.rank, gen_key)] = max(
                    self.frontier.get((obs.rank, gen_key), 0),
                    min(first_failed, obs.token_len))
        if obs.outcome == "skipped" and obs.skipped_since is not None and "now" in self.absent:
            self.skip("K6", "a skip whose rank clock (now) was not recorded")
        elif obs.outcome == "skipped" and obs.skipped_since is not None and \
                obs.now - obs.skipped_since >= config.pressure_backoff:
            self.fail("K6", f"rank {obs.rank} skipped job {obs.job_id} of {gen_key}: skipped "
                      f"since {obs.skipped_since}, now {obs.now}, backoff "
                      f"{config.pressure_backoff}")
        job = self.jobs.get(obs.job_id)
        if job is not None:
            self._check_claims(obs, gen, job)
        if gen is None:
            return
        ns = obs.rank // step
        announced = gen.announced
        for event in obs.events:
            chunk = (event.block_hashes[-1], event.group_idx)
            namespaces = announced.get(chunk)
            if namespaces is None:
                namespaces = announced[chunk] = set()
                self.announcers.setdefault(chunk, []).append(gen_key)
            namespaces.add(ns)
        for event in obs.events:
            self._check_event(obs, gen, event)

    def _check_claims(self, obs: JobFinished, gen: _Gen | None, job: _Job) -> None:
        """K7: every chunk the verdict holds as stored is one the rank saw
        the store take (a put answered 0) or hold (an existence check): the
        announcements S16 counts and the offsets S10 follows rest on these
        claims, so a rank that counts a failed put as stored would otherwise
        have events published for chunks the store does not have."""
        rank = obs.rank
        held = job.held
        if obs.stored:
            hpb = self._hashes_per_block
            hashes = gen.hashes if gen is not None else ()
            for group, cid in obs.stored:
                if (cid + 1) * hpb > len(hashes) or (rank, group) not in self._prefixes:
                    self.skip("K7", "a stored chunk beyond the hash chain the plans gave")
                    continue
                key = key_for(self._prefixes[rank, group], chunk_hash(hashes, cid, hpb).hex())
                if (rank, key) not in held:
                    self.fail("K7", f"rank {rank} job {obs.job_id} reports chunk {cid} of group "
                              f"{group} stored, but no put of {key!r} succeeded and no "
                              "existence check found it")
        if held:
            job.held = {fact for fact in held if fact[0] != rank}

    def _check_event(self, obs: JobFinished, gen: _Gen, event: BlockStored) -> None:
        config = self.config
        digest = event.block_hashes[-1]
        try:
            index = gen.hashes.index(digest)
        except ValueError:
            self.fail("S15", f"rank {obs.rank} announced {digest.hex()}, not in the hash chain "
                      f"of {(obs.req_id, obs.generation)}")
            return
        hpb = self._hashes_per_block
        expected = gen.hashes[index - hpb] if index >= hpb else None
        if event.parent_block_hash != expected:
            self.fail("S15", f"rank {obs.rank} announced {digest.hex()} with parent "
                      f"{event.parent_block_hash.hex() if event.parent_block_hash else None}, "
                      f"expected {expected.hex() if expected else None}")
        if event.token_ids:
            ids = event.token_ids
            if len(ids) != config.block_size:
                self.fail("S17", f"rank {obs.rank} announced {digest.hex()} with "
                          f"{len(ids)} token ids; a chunk holds {config.block_size}")
                return
            hasher = self.hasher
            if hasher.reason:
                self.skip("S17", hasher.reason)
                return
            parent = expected
            if parent is not None and type(parent) is not bytes:
                parent = bytes(parent)  # a trace reader's bytes subclass: hash plain bytes
            try:
                digest_now, certain = hasher.digest(parent, ids, self._hash_block)
            except ValueError as exc:
                self.fail("S17", f"rank {obs.rank} announced {digest.hex()} with token ids "
                          f"the {hasher.name} hash cannot take ({exc})")
                return
            if digest_now != digest:
                if not certain:
                    self.skip("S17", "a request's first block and the header gives no "
                              "none_hash (vLLM's default seed does not match)")
                    return
                self.fail("S17", f"rank {obs.rank} announced {digest.hex()} with token ids "
                          f"that do not hash to it ({hasher.name})")

    def _on_ReportDelivered(self, obs: ReportDelivered) -> None:
        report = obs.report
        world = self.config.world_size
        if not 0 <= report.rank < world:
            self._report_found.add("S4")
            self.fail("S4", f"report for job {report.job_id} from rank {report.rank}, not one "
                      f"of the {world} ranks")
            return
        job = self.jobs.get(report.job_id)
        if job is None or job.complete:
            self._report_found.add("S4")
            self.fail("S4", f"rank {report.rank} reported job {report.job_id}, which is not "
                      "outstanding (every rank reported it already, or it was never emitted)")
            return
        if report.rank in job.reports:
            self._report_found.add("S4")
            self.fail("S4", f"rank {report.rank} reported job {report.job_id} twice")
        job.reports.add(report.rank)
        self.last_report[report.rank] = self.step
        if len(job.reports) == world:
            job.complete = True
            if job.claimed:  # released early by a settlement: gone now
                self._drop(report.job_id, job)
            else:
                self._completed.append(report.job_id)

    # ------------------------------------------------------------------
    # Engine and store.

    def _on_BlockFreed(self, obs: BlockFreed) -> None:
        block = obs.block_id
        self.free.add(block)
        for job in self.jobs.values():  # jobs emitted before this free
            job.freed.add(block)

    def _on_BlockAllocated(self, obs: BlockAllocated) -> None:
        self.free.discard(obs.block_id)

    def _on_KeyEvicted(self, obs: KeyEvicted) -> None:
        self.store.discard(obs.key)
        fields = parse_key(obs.key)
        if fields is None:
            return  # not kvstate's key format: no group to forget it in
        try:
            chunk = (fields.group, fields.chunk_hash())
        except ValueError:
            return
        if self.known_blocks.pop(chunk, 0) is None:
            evicted = self.evicted_blocks
            evicted[chunk] = None
            if len(evicted) > EVICTED_MEMORY:
                del evicted[next(iter(evicted))]

    def _lookup_required(self, obs: LookupDone, hit_chunks: int) -> list[tuple[str, list[int]]]:
        """The hit chunks' digests and the groups each needs: full attention
        every chunk of the hit, a sliding window only the blocks of its
        window right before the hit boundary (upstream loads the null block
        below it). Digests come from the lookup's hash chain, since a window
        group's chunk outside every window has no key to read one from."""
        needs = self._hit_needs
        assert needs is not None
        hpb = self._hashes_per_block
        covered = len(obs.block_hashes) // hpb
        if hit_chunks > covered:
            # One finding, and the loop below bounded by the chain, not by
            # the hit: a trace's hit_tokens is any integer it says.
            self.fail("S20", f"lookup of {obs.req_id!r} counted {hit_chunks} chunks as a hit "
                      f"but its hash chain of {len(obs.block_hashes)} hashes covers {covered}")
        out: list[tuple[str, list[int]]] = []
        for cid in range(min(hit_chunks, covered)):
            groups = [g for g, need in enumerate(needs) if need is None or cid >= hit_chunks - need]
            if groups:
                out.append((chunk_hash(obs.block_hashes, cid, hpb).hex(), groups))
        return out

    def _on_LookupDone(self, obs: LookupDone) -> None:
        if obs.hit_tokens and obs.hit_tokens >= obs.num_prompt_tokens:
            self.fail("K9", f"lookup of {obs.req_id!r} offers {obs.hit_tokens} tokens of a "
                      f"{obs.num_prompt_tokens}-token prompt: nothing left to compute")
        failed_in = self.load_failed.get(obs.req_id)
        if failed_in is not None:
            if failed_in == obs.generation:
                self.fail("K8", f"{obs.req_id!r} (generation {obs.generation}) is looked up "
                          "again after a load of it failed: while the store says present and "
                          "every get fails, it never computes")
            else:
                del self.load_failed[obs.req_id]
        config = self.config
        hit_chunks = -(-obs.hit_tokens // config.block_size)
        required: Sequence[tuple[str, Sequence[int]]]
        if self._hit_needs is not None:
            required = self._lookup_required(obs, hit_chunks)
        else:
            # Lookup keys are chunk-major: collect the chunk digests in order,
            # then require every namespace's and group's key of each hit chunk.
            hashes_seen: list[str] = []
            for key in obs.keys:
                digest = key_digest(key)
                if not hashes_seen or hashes_seen[-1] != digest:
                    hashes_seen.append(digest)
            every_group = range(len(config.groups))
            required = [(digest, every_group) for digest in hashes_seen[:hit_chunks]]
        present = dict(zip(obs.keys, obs.present))
        for digest, groups in required:
            for ns in range(config.num_namespaces):
                for g in groups:
                    key = key_for(key_prefix(config, ns * config.put_step, g), digest)
                    if not present.get(key, False):
                        # The store's own answer did not support the hit: the
                        # planner concluded more than it was told.
                        self.fail("S20", f"lookup of {obs.req_id!r} counted {digest} as a hit "
                                  f"but the store did not answer {key} as present")
                    elif key not in self.store:
                        if self.shared_store:
                            # Another engine may have stored it: only the
                            # store's answer can be judged (header "store": "shared").
                            self.skip("S20", "hit on a key no engine of this trace stored "
                                      "(shared store)")
                        else:
                            self.fail("S20", f"lookup of {obs.req_id!r} counted {digest} as a "
                                      f"hit but {key} was not stored")

    def _on_LoadDone(self, obs: LoadDone) -> None:
        if obs.failed_block_ids:
            self.load_failed[obs.req_id] = obs.generation
        missing = set(obs.failed_block_ids) - set(obs.reported_block_ids)
        if missing:
            self.fail("S19", f"rank {obs.rank} failed to load blocks {sorted(missing)} of "
                      f"{obs.req_id!r} and did not report them")

    def _on_Quiescent(self, obs: Quiescent) -> None:
        self.quiescent = True
        if obs.pinned_blocks or self.pinned:
            self.fail("S6", f"at quiescence {len(self.pinned)} blocks are still pinned and "
                      f"{obs.pinned_blocks} still referenced")
        for job_id, job in self.jobs.items():
            missing = set(range(self.config.world_size)) - job.reports
            if missing:
                self.fail("S4", f"job {job_id} never reported by ranks {sorted(missing)}")
        # ``leftovers`` is the recorder's own account of its internal state: what
        # it confesses stays a finding (the monitor cannot see inside), marked as
        # its own word; an empty account proves nothing (the checks above stand).
        for name, count in obs.leftovers:
            if ".ledger_entries" in name:
                self.fail("S18", f"{name}={count} at quiescence (the recorder's own account)")
        if obs.leftovers:
            self.fail("K3", "left at quiescence (the recorder's own account): "
                      + ", ".join(f"{n}={c}" for n, c in obs.leftovers))

    # ------------------------------------------------------------------
    # Liveness at the end of a trace.

    def finish(self, liveness_steps: int = 64, at_end: str = "closed") -> list[str]:
        """Judge liveness where a trace simply ends (a real engine writes no
        ``Quiescent`` line; with a dead rank it keeps stepping). Ages are in
        scheduler steps, counted to the latest plan's step. With ``at_end``
        ``"closed"`` (the run ended with the trace) a job some rank has not
        reported (S4, naming each rank that stopped reporting), a job every
        rank reported but nobody released (S18) and a pinned block (S6) are
        findings once older than ``liveness_steps``; younger ones were still in
        flight and are notes. With ``"open"`` (a trace cut mid-run) nothing at
        the end is a finding; all of it is listed as notes. An engine whose
        last observation was ``Quiescent`` was judged there already.
        Returns the notes."""
        if at_end not in ("closed", "open"):
            raise ValueError(f"at_end={at_end!r}: expected 'closed' or 'open'")
        if self.quiescent:
            return []
        self._release_completed()
        settling = set(self._completed)  # reported since the last settlement: in flight
        now, bound = self.step, liveness_steps
        world = range(self.config.world_size)
        unreported: dict[int, list[tuple[int, _Job]]] = {}
        unreleased: list[tuple[int, _Job]] = []
        young = 0
        for job_id, job in self.jobs.items():
            if now - job.step < bound:
                young += 1
                continue
            missing = [r for r in world if r not in job.reports]
            for rank in missing:
                unreported.setdefault(rank, []).append((job_id, job))
            if not missing and job_id not in settling:
                unreleased.append((job_id, job))
        old_pins = sorted((since, block) for block, since in self.pinned_since.items()
                          if now - since >= bound)
        young_pins = len(self.pinned_since) - len(old_pins)
        found: list[tuple[str, str]] = []
        for rank, jobs in sorted(unreported.items()):
            job_id, job = jobs[0]
            last = self.last_report.get(rank)
            found.append(("S4", f"rank {rank} has not reported {len(jobs)} job(s) older than "
                          f"{bound} steps (oldest: job {job_id} of {job.gen}, emitted at step "
                          f"{job.step}, age {now - job.step} steps); its last report was "
                          + (f"at step {last}" if last is not None else "never")
                          + " — it stopped reporting"))
        if unreleased:
            job_id, job = unreleased[0]
            found.append(("S18", f"{len(unreleased)} job(s) reported by every rank but never "
                          f"released for more than {bound} steps (oldest: job {job_id} of "
                          f"{job.gen}, emitted at step {job.step}, age {now - job.step} steps)"))
        if old_pins:
            since, block = old_pins[0]
            found.append(("S6", f"{len(old_pins)} block(s) pinned for more than {bound} steps "
                          f"at the end of the trace (oldest: block {block}, pinned since step "
                          f"{since}, age {now - since} steps)"))
        notes = []
        if at_end == "open":
            notes += [f"at the end (open, not judged): {message}" for _, message in found]
        else:
            for invariant, message in found:
                self.fail(invariant, message)
        if young or young_pins:
            notes.append(f"in flight at the end (younger than {bound} steps, not judged): "
                         f"{young} job(s), {young_pins} pinned block(s)")
        return notes
