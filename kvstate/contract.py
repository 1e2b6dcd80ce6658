"""The trace contract: what an engine writes, what kvstate adds, where it comes from.

Theory of operation
-------------------
A trace has two layers. The *observed* layer is what an engine and its
connector can see and log without knowing anything of kvstate: the
scheduler's output per step, the connector metadata per store job, each
rank's store calls and their answers, reports as workers send them, KV events
as published, block allocations and frees, errors. The *annotation* layer is
what kvstate adds when it is the producer: its own verdicts, its rank-state
internals, its generation numbers. A trace with no annotations is checked:
the checker derives the generation numbers (`kvstate.derive`), and where an
annotation is present it is compared with the checker's own judgement, never
believed. A few invariants, or halves of them, rest on what only kvstate
writes and are not judged without it (``NEEDS`` says which).

Three tables say which is which, field by field:

``ANNOTATIONS``
    Optional fields only kvstate knows as a producer. A left-out one is
    *unknown*, not its empty default: the monitor neither reads it as a
    verdict nor compares it; replay does not compare it. The fast decoder
    marks them unset so the reader can tell "left out" from "empty".
``OMITTABLE``
    Fields of records the observed layer may leave out, and the value a
    left-out one reads as. ``UNKNOWN`` (generation numbers, a report's
    confirmed offset) is filled in by `kvstate.derive` before any monitor
    sees the record; the others read as "not observed" (a put whose bytes
    were not digested, a job start whose rank-state provenance is unknown)
    and the invariants that need them do not judge them (``NEEDS`` says
    which, and whether the check's notes say so).
``ANNOTATION_RECORDS``
    Whole observation types kvstate writes about itself (its rank-state
    writes, its own claim of quiescence). An engine never needs to write
    them: liveness is judged where the trace ends (``--liveness-steps``).

``VLLM_SOURCES`` maps every observed record to the vLLM 0.33.0 object it is
read from, for a recorder inside vLLM (the kvstate connector's recorder,
``adapters/vllm/recorder.py``, writes these from exactly those objects).

What an outside producer needs besides the field lists, each a table here so
the tests can hold it to the code: ``CONFIG_FIELDS`` (every header config
field), ``FIELD_RULES`` (meaning, unit and what the checker requires, per
field), ``ORDER_RULES`` (which line must come before which), ``NEEDS`` (per
invariant of `kvstate.invariants.CATALOGUE`: what of the trace it reads),
the block-hash formulas with a worked example (`hash_example`) and a complete
example trace (`example_trace`), both computed by `kvstate.blockhash` and
`kvstate.keys`, never typed. ``specs/trace.md`` is rendered from all of them
(`render_markdown`); `tests/test_trace_contract_example.py` checks the
rendered example.
"""

from __future__ import annotations

from typing import Any

# A generation number or offset the trace left out, until `kvstate.derive`
# fills it in. Negative, so it can never be a real one (generations count
# from 1, offsets from 0).
UNKNOWN = -1

# Per observation type: the record field holding its annotations (None: the
# line itself) and their names.
ANNOTATIONS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    # ``preempted``/``finished`` repeat the step's scheduler output as
    # generation keys; without them the checker derives them from the
    # StepScheduled line before it.
    "Planned": ("plan", ("violations", "started", "ended", "preempted", "finished")),
    "Settled": ("settlement", ("released_jobs", "published_by", "violations",
                               "dropped_events")),
    "JobFinished": (None, ("now", "skipped_since")),
}

# Per record type (observations and the records nested in them): the fields
# the observed layer may leave out, and the value a left-out one reads as.
OMITTABLE: dict[str, dict[str, Any]] = {
    "SaveMeta": {"generation": UNKNOWN},
    "LoadMeta": {"generation": UNKNOWN},
    "Report": {"generation": UNKNOWN, "confirmed_offset": UNKNOWN},
    "JobStarted": {"generation": UNKNOWN, "state_generation": None, "retry_generation": None},
    "JobFinished": {"generation": UNKNOWN},
    "PutDone": {"generation": UNKNOWN, "content": ""},
    "LookupDone": {"generation": UNKNOWN},
    "LoadDone": {"generation": UNKNOWN},
}

# Fields of ``OMITTABLE`` that name a generation: all written or none (a
# trace that numbers some generations and not others cannot be matched up).
GENERATION_FIELDS = ("generation", "state_generation", "retry_generation")

ANNOTATION_RECORDS = ("StateWritten", "Quiescent")

# Where each observed record comes from inside vLLM 0.33.0 (scheduler process
# unless it says rank). "Connector" is the KV connector's two roles:
# ``KVConnectorBase_V1`` with ``KVConnectorRole.SCHEDULER`` / ``WORKER``.
VLLM_SOURCES: dict[str, str] = {
    "StepScheduled": (
        "`SchedulerOutput` passed to the scheduler connector's `build_connector_meta`: "
        "`scheduled_new_reqs` (NewRequestData: req_id, prompt_token_ids, block_ids, "
        "num_computed_tokens; num_scheduled_tokens[req_id]; block hashes from the "
        "`Request`'s `block_hashes`) -> `new`; `scheduled_cached_reqs` (CachedRequestData) "
        "rows not in `resumed_req_ids` -> `cached` (new_token_ids: the request's "
        "`all_token_ids[num_computed_tokens:num_computed_tokens + num_scheduled_tokens]`, "
        "drafts excluded), rows in `resumed_req_ids` -> `resumed` (a replaced block table); "
        "`preempted_req_ids` -> `preempted`; `finished_req_ids` -> `finished`"),
    "Planned": (
        "the connector metadata `build_connector_meta` returns: one `SaveMeta` per store job "
        "(request id, job id, token range, block ids and hashes it covers), one `LoadMeta` "
        "per load; `pins`/`releases`: the block ids the connector `touch`es on / "
        "`free_blocks` back to the `BlockPool` to keep a job's blocks alive"),
    "Settled": (
        "the scheduler connector's `update_connector_output(KVConnectorOutput)`: blocks "
        "released, KV events published (`take_events`)"),
    "ReportDelivered": (
        "one rank's report of one job as it reaches the scheduler: "
        "`KVConnectorOutput.kv_connector_worker_meta` (or `finished_sending`) aggregated by "
        "`KVOutputAggregator`; `events`: the rank's `BlockStored` events for the job"),
    "LookupDone": (
        "`get_num_new_matched_tokens(request, num_computed_tokens)`: the keys the "
        "connector asked the store about (`batch_is_exist`), its answers, the hit returned"),
    "Allocated": (
        "`update_state_after_alloc(request, blocks, num_external_tokens)`: "
        "`blocks.get_block_ids()`"),
    "JobStarted": (
        "rank: the worker connector's send thread dequeues a job from the metadata it got "
        "in `bind_connector_metadata`/`wait_for_save`; `save_start` the first token it "
        "considers, `live` whether the rank holds saved-offset state for the request"),
    "ExistsAnswered": "rank: `MooncakeDistributedStore.batch_is_exist(keys)` and its answers",
    "PutDone": (
        "rank: one key of `batch_put_from`/`batch_put_from_multi_buffers`; `code` the "
        "store's return code (0, -200 no space, ...), `block_id` the GPU block read; "
        "`content`: leave it out (see the field rules)"),
    "StoreCallRaised": "rank: a store call that raised or timed out",
    "JobFinished": (
        "rank: the job's verdict before the report is sent: chunks stored (put or found), "
        "chunks whose put failed, events"),
    "LoadDone": (
        "rank: `start_load_kv` finished a load (`batch_get_into`): block ids that got no or "
        "wrong data (`get_block_ids_with_load_errors`)"),
    "BlockAllocated": "the `BlockPool` handed a block to a request (`get_new_blocks`)",
    "BlockWritten": "rank: the forward pass wrote a block (optional; no invariant reads it)",
    "BlockFreed": "the `BlockPool` took a block back (`free_blocks`, ref count 0)",
    "KeyEvicted": "the store's eviction (from the master's metrics or logs; optional)",
}


# Steps (``plan.step``) after which a job or pin still held where a trace ends
# is stuck, when neither the header's ``liveness_steps`` nor ``kvstate check
# --liveness-steps`` says otherwise (`sim.traces.check.DEFAULT_LIVENESS_STEPS`, which
# a test holds equal).
DEFAULT_LIVENESS_STEPS = 64

# Every `kvstate.config.ConnectorConfig` field as the header writes it: what
# it means and which checks read it (the defaults come from the class).
CONFIG_FIELDS: dict[str, str] = {
    "role": "`kv_role`, written `{\"@enum\": \"Role\", \"value\": ...}`: `kv_producer`, "
            "`kv_consumer` or `kv_both`; a consumer may save only decode tokens (S14)",
    "block_size": "tokens per chunk, the unit the connector stores and keys (vLLM's "
                  "block size, or the lcm chunk of a hybrid model)",
    "hash_block_size": "tokens per hash of the request's hash chain where it differs from "
                       "`block_size` (a divisor of it); `null`: `block_size`",
    "world_size": "tensor-parallel ranks; rank records carry `rank` in `[0, world_size)`",
    "put_step": "ranks per key namespace (upstream's replication factor): a rank's namespace "
                "is `rank // put_step`, its keys say `tp_rank:<namespace>`; 1 when every "
                "rank holds its own heads, `world_size` for MLA (S8, S11, S16, S20)",
    "save_decode_cache": "whether decode tokens are saved (S14 for a consumer)",
    "enable_kv_events": "whether ranks announce KV events; the checker judges every event a "
                        "trace holds either way",
    "model_name": "the model; keys use its last path component (`Qwen/Qwen3-0.6B` -> "
                  "`Qwen3-0.6B`)",
    "cache_prefix": "key prefix before the model name (`<cache_prefix>@`), empty for none",
    "config_fingerprint": "key segment `@cfg:<fingerprint>` after the model name, empty for "
                          "none",
    "pcp_rank": "the key's `pcp` segment", "dcp_rank": "the key's `dcp` segment",
    "pp_rank": "the key's `pp_rank` segment",
    "groups": "KV-cache groups, each `{\"@\": \"GroupSpec\", \"kind\": {\"@enum\": "
              "\"GroupKind\", \"value\": \"full\"}, \"sliding_window\": null}`, or kind "
              "`sliding_window` with the window in tokens; a group's index is the key's "
              "`group` segment",
    "alignment": "the lcm boundary only whose prefixes are stored (a multiple of "
                 "`block_size`); `null`: `block_size` (S7)",
    "pressure_backoff": "how long a rank skips a request after the store refused a put for "
                        "space, in the unit of `JobFinished.now` (K6)",
}

# Per field (``Record.field``; ``*`` for every record that has it): meaning,
# unit and what the checker requires of it. `kvstate check` reads nothing
# else; a field said "not read" is the replayer's (`kvstate replay`).
FIELD_RULES: tuple[tuple[str, str], ...] = (
    ("*.t", "a number on the producer's clock, any unit and epoch; no invariant reads it, "
            "only its order (never decreasing)"),
    ("*.req_id", "the engine's request id; a reused id after the request finished is a new "
                 "generation"),
    ("*.generation", "leave out: the checker derives it (above); if written, then on every "
                     "record"),
    ("NewRequest.num_computed_tokens, num_scheduled_tokens",
     "tokens already computed (prefix-cache and external hits) and scheduled this step: a "
     "save planned in the step may reach their sum (S7)"),
    ("CachedRequest.new_token_ids",
     "exactly the tokens this step computes (drafts excluded): S7 counts "
     "`num_computed_tokens + len(new_token_ids)`"),
    ("ResumedRequest.num_computed_tokens, num_scheduled_tokens", "as for `NewRequest`"),
    ("NewRequest.prompt_token_ids, block_ids, block_hashes; CachedRequest.new_block_ids, "
     "new_block_hashes; ResumedRequest.all_token_ids, block_ids, block_hashes", "not read"),
    ("CachedRequest.freed_positions",
     "optional, not read by the checker: per group, the table positions the engine nulled "
     "and freed since the request was last scheduled (a sliding window's blocks that left "
     "it); a replay's planner nulls them so its jobs neither read nor pin them"),
    ("SaveMeta.job_id", "the store job id, unique per engine and strictly increasing from any "
                        "start (S22); every rank record of the job names it"),
    ("SaveMeta.token_ids_start, token_len",
     "the job covers tokens `[token_ids_start, token_len)`: `token_len` a multiple of "
     "`block_size` and at most the tokens computed in this step (S7), with a full block "
     "past `token_ids_start` (`token_ids_start // block_size < token_len // block_size`, "
     "K5); kvstate and vLLM start where the generation's previous job ended (0 for its "
     "first), which the checker does not require"),
    ("SaveMeta.hashes_start, block_hashes",
     "a slice of the generation's hash chain (one hash per `hash_block_size` tokens) from "
     "index `hashes_start`: the checker sets its copy of the chain to `chain[:hashes_start] "
     "+ block_hashes`, so kvstate's delta (`hashes_start` = hashes the generation's jobs "
     "shipped so far) and upstream's whole chain (`hashes_start` 0) are both valid; a "
     "`hashes_start` past the hashes shipped so far leaves a gap the checker does not "
     "report (later chunks are misnamed or not judged)"),
    ("SaveMeta.block_ids_start, block_ids",
     "per group, a slice of the request's block table from index `block_ids_start` "
     "(kvstate: only blocks new since the generation's previous job; upstream: the whole "
     "table, start 0); both valid, not read (S1 and S2 judge `PutDone.block_id`)"),
    ("SaveMeta.num_prompt_tokens", "upstream's prefill end: the prompt's length for a new "
                                   "request, all its tokens when resumed; not read"),
    ("SaveMeta.is_decode", "whether the request was decoding when the job was planned "
                           "(`num_computed_tokens >= num_prompt_tokens`); S14 reads it"),
    ("SaveMeta.token_ids", "the tokens `[token_ids_start, token_len)` the job's events "
                           "carry, `null` with events off; not read"),
    ("Plan.pins", "block ids the connector takes a reference on (`touch`), one reference "
                  "per entry: every block a put reads must hold one (S2), and every one must "
                  "be released (S6)"),
    ("Plan.releases; Settlement.releases",
     "block ids whose reference the connector drops, one per entry, any order; a release "
     "with no reference is not reported"),
    ("Plan.saves, loads", "the step's store jobs (`SaveMeta`) and loads (`LoadMeta`); a save "
                          "and a load of one generation in one plan is S13"),
    ("JobStarted.live",
     "false when the rank found the job stale (its generation already preempted or "
     "finished on the rank: it stores nothing, and a put of it is S21); true otherwise, "
     "including a resumed request's jobs"),
    ("JobStarted.save_start",
     "the first token the rank considers (its saved offset for the generation). For a live "
     "job at most the generation's highest planned `token_len` (S12) and at most what this "
     "rank stored in the same generation (S10: its frontier, the `token_len` of its last "
     "job stored in full, or the start of its first failed chunk). A resumed request is a "
     "new generation: its first live job on a rank starts at 0; what the store already "
     "holds is found present"),
    ("JobStarted.token_len; JobFinished.token_len",
     "the job's `token_len` aligned down to the lcm (`alignment`): a multiple of it (S7), "
     "and every put's chunk ends within it (S7)"),
    ("JobStarted.state_generation, retry_generation",
     "kvstate's provenance of the rank state the job read (K2's rank half); leave out"),
    ("ExistsAnswered.keys, present",
     "one `batch_is_exist`: `present[i]` answers `keys[i]` (equal lengths, any order); "
     "every key asked counts as checked for S9, a present one as held for K7"),
    ("PutDone.key", "upstream's key of the chunk for this rank's namespace and group (S8)"),
    ("PutDone.group, chunk_id", "the key's group and absolute chunk index (chunk `c` is "
                                "tokens `[c * block_size, (c + 1) * block_size)`)"),
    ("PutDone.block_id", "the engine block the put read: pinned (S2), not freed since the job "
                         "was planned (S1)"),
    ("PutDone.code", "the store's return code: 0 stored, negative failed (-200 no space); a "
                     "put with code 0 counts as held for K7"),
    ("PutDone.accepted",
     "whether the store kept these bytes: false for a failed put and for a code-0 put of a "
     "key it already held (first write wins); a recorder that cannot tell writes `code == "
     "0`, and then S9 can never fire. Only accepted puts count as stored for S20 and are "
     "judged by K1"),
    ("PutDone.content", "kvstate's simulator tag `<chunk hash>|ns<namespace>|g<group>`, not a "
                        "digest of real bytes (K1 would fire on every put): leave out"),
    ("JobFinished.outcome",
     "`stored`: every chunk of the rank's range put with code 0 or found present (or none "
     "to store); `partially_stored`: some puts returned 0, some failed; `failed`: every put "
     "failed, or a store call raised; `skipped`: skipped for store pressure before any "
     "store call; `stale`: `live` was false. The checker reads it with `failed`: `stored` "
     "and no failed chunk moves the rank's frontier to `token_len`, any failed chunk moves "
     "it to that chunk's start (never back), anything else leaves it (S10); frontiers move "
     "only from a job whose `save_start` is at most the frontier"),
    ("JobFinished.stored, failed",
     "`[group, chunk id]` pairs: `stored` every chunk the rank now holds (put with code 0 "
     "or found present, K7), `failed` every chunk whose put failed or was not made because "
     "a call raised; both on the rank's own stride residue (S11)"),
    ("JobFinished.events",
     "one `BlockStored` per chunk the rank announces: the checker judges each (S15, S17) "
     "and counts it towards the quorum (S16). Found-present chunks may be announced "
     "(kvstate) or not (upstream); only what the settlement publishes needs announcing"),
    ("BlockStored.block_hashes, parent_block_hash",
     "`[chunk hash]` (the last entry is read) and the hash just before the chunk's first "
     "token in the request's chain, `null` for chunk 0 (S15)"),
    ("BlockStored.token_ids", "the chunk's `block_size` tokens, from which S17 recomputes its "
                              "hash, or empty (not recomputed); any other length is S17, "
                              "even under `opaque`"),
    ("BlockStored.group_idx", "the chunk's group"),
    ("BlockStored.block_size, medium, lora_id", "not read"),
    ("Report.outcome, events", "the rank's `JobFinished` outcome (as a `JobState` enum) and "
                               "events; not read"),
    ("ReportDelivered.report", "one rank's report of one job, exactly once per rank and job "
                               "(S4)"),
    ("Settlement.published",
     "the events the scheduler published: each chunk announced in `JobFinished.events` by "
     "a rank of every namespace, all within one generation still held (S16; different "
     "jobs of that generation may contribute, different generations may not); a "
     "full-attention chunk's parent published before it, here or earlier (K4)"),
    ("LookupDone.num_prompt_tokens", "the request's `num_tokens` when asked (its prompt, plus "
                                     "tokens generated before a preemption); a non-zero "
                                     "`hit_tokens` stays below it (K9)"),
    ("LookupDone.keys, present",
     "chunk-major in chain order: for chunk 0, 1, ... the key of every namespace "
     "(`tp_rank:0` .. `tp_rank:<world_size / put_step - 1>`) in every group; with a "
     "sliding-window group, that group's key only where its store mask keeps the chunk. "
     "`present[i]` answers `keys[i]`. S20 takes the first `ceil(hit_tokens / block_size)` "
     "chunk hashes in key order as the hit and requires each one's keys answered present "
     "and stored by an accepted put of an engine of the trace, unless the header's `store` "
     "is `shared` (a window group: only the blocks its window needs)"),
    ("LookupDone.block_hashes", "the request's hash chain when asked; read only with a "
                                "sliding-window group"),
    ("LoadDone.failed_block_ids, reported_block_ids",
     "blocks the load did not fill, and those the rank reported for recomputation: the "
     "first within the second (S19); after a failed load the generation is not looked up "
     "again (K8)"),
    ("LoadMeta.start_token, end_token, block_ids, block_hashes", "not read"),
    ("Allocated", "not read (it may open a request's lifetime, as a lookup does)"),
    ("BlockWritten, StoreCallRaised", "not read; a rank whose store call raised still "
                                      "writes `JobFinished` and reports the job (S4)"),
    ("BlockAllocated, BlockFreed", "the pool handing a block to a request and taking it back "
                                   "at reference count 0 (S1)"),
    ("KeyEvicted.key", "a key the store dropped: no longer counts as stored (S20)"),
)

# Which record comes before which. The checker reads a trace in line order;
# where two orders are both accepted the rule says so.
ORDER_RULES: tuple[str, ...] = (
    "Line 1 is the header. Then `i` strictly increases, `t` never decreases and "
    "`plan.step` never decreases per engine (else exit 2).",
    "A request's `LookupDone` and `Allocated` come before the `StepScheduled` that schedules "
    "it. `Allocated` of a resumed request is optional (kvstate writes it when the request "
    "was looked up again at re-admission); no check reads it.",
    "Every `StepScheduled` is followed by its step's `Planned`, empty if nothing was "
    "planned, before the next `StepScheduled`: the plan takes the step's computed tokens "
    "and its preempted and finished requests from it.",
    "Every rank record of a job (`JobStarted`, `ExistsAnswered`, `PutDone`, "
    "`StoreCallRaised`, `JobFinished`, `ReportDelivered`) follows the `Planned` that emitted "
    "the job (else exit 2).",
    "Per rank and job: `JobStarted`, then its `ExistsAnswered` and `PutDone` lines, then "
    "`JobFinished`, then that rank's `ReportDelivered`. The ranks' lines interleave freely.",
    "A `Settled` follows the `ReportDelivered` lines it settles and comes before the next "
    "`Planned`: without `released_jobs`, a plan releases every job all ranks have "
    "reported, and a settlement after the plan that finished its request finds the "
    "generation gone (a false S16 on what it publishes). kvstate writes one `Settled` per "
    "batch of delivered reports; an empty one is accepted. Pins are released only by "
    "`releases`.",
    "`BlockFreed` is written when the block's last reference goes, before or after the "
    "`Settled` or `Planned` whose release dropped it (both accepted; kvstate writes it "
    "before). It follows every `PutDone` that reads the block for a job planned before the "
    "free (S1), and a freed block is `BlockAllocated` again before a later job reads it.",
    "Inside records: `LookupDone.keys` chunk-major in chain order; `Settlement.published` "
    "with parents before children (K4). Free: `ExistsAnswered.keys` (with `present` "
    "alongside), `pins`, `releases`, `JobFinished.stored`, `failed` and `events`.",
)

# Per invariant of `kvstate.invariants.CATALOGUE`: (what of the observed layer
# it reads, what it needs beyond that and what happens without it, optional
# observed records or fields that sharpen it). From each checker's code.
NEEDS: dict[str, tuple[str, str, str]] = {
    "S1": ("`SaveMeta.job_id`, `PutDone.block_id`, `BlockFreed`, `BlockAllocated`", "-", "-"),
    "S2": ("`Plan.pins`, `releases`, `Settlement.releases`, `PutDone.block_id`", "-", "-"),
    "S3": ("-", "`StateWritten` (annotation record); without: not judged", "-"),
    "S4": ("`ReportDelivered`, `JobStarted`; at the trace's end, jobs older than "
           "`liveness_steps`",
           "a job released before every rank reported it: `Settlement.released_jobs` "
           "(annotation); without: that half not judged", "-"),
    "S6": ("`Plan.pins`, `releases`, `Settlement.releases`; at the trace's end", "-", "-"),
    "S7": ("`StepScheduled` token counts, `SaveMeta.token_len`, `JobStarted.token_len`, "
           "`PutDone.chunk_id`", "-", "-"),
    "S8": ("`SaveMeta.hashes_start`, `block_hashes`, `PutDone.key`, `group`, `chunk_id`",
           "-", "-"),
    "S9": ("`ExistsAnswered`, `PutDone.code`, `accepted`", "-",
           "`accepted` false for a put the store ignored (a recorder writing `code == 0` "
           "makes S9 unable to fire)"),
    "S10": ("`JobStarted.live`, `save_start`; `JobFinished.outcome`, `save_start`, "
            "`token_len`, `failed`", "-", "-"),
    "S11": ("`JobFinished.stored`, `failed`", "-", "-"),
    "S12": ("`JobStarted.save_start`, `SaveMeta.token_len`",
            "an offset moving back: `StateWritten` (annotation record); without: that half "
            "not judged", "-"),
    "S13": ("`Plan.saves`, `loads`", "-", "-"),
    "S14": ("`SaveMeta.is_decode`, the config's `role` and `save_decode_cache`", "-", "-"),
    "S15": ("`SaveMeta.block_hashes`, `JobFinished.events`", "-", "-"),
    "S16": ("`JobFinished.events`, `Settlement.published`", "-",
            "`Settlement.published_by` (annotation) names the completing generation; "
            "without it any generation held may"),
    "S17": ("`JobFinished.events` token ids, the header's `block_hash` and `none_hash`", "-",
            "not judged (a note) under `opaque`, for empty token ids, and for a first block "
            "whose `none_hash` is neither written nor vLLM's default"),
    "S18": ("-", "`Settlement.released_jobs` (annotation) or `Quiescent`; without: not "
                 "judged (a note)", "-"),
    "S19": ("`LoadDone`", "-", "-"),
    "S20": ("`LookupDone`, accepted `PutDone` keys, the header's `store`", "-",
            "`KeyEvicted` (without it a stored key stays stored)"),
    "S21": ("`StepScheduled.preempted`, `JobStarted`, `PutDone`", "-", "-"),
    "S22": ("`SaveMeta.job_id`", "-", "-"),
    "S23": ("`StepScheduled`", "-", "-"),
    "K1": ("-", "`PutDone.content` (kvstate's simulator tag, left out of the observed "
                "layer); without: not judged (a note)", "-"),
    "K2": ("`StepScheduled` (a request scheduled as new while running)",
           "the rank half: `JobStarted.state_generation`, `retry_generation` (kvstate "
           "only); without: not judged", "-"),
    "K3": ("-", "`Quiescent` (annotation record); without: not judged", "-"),
    "K4": ("`Settlement.published`", "-", "`KeyEvicted` (an evicted parent's child is no "
                                          "orphan)"),
    "K5": ("`SaveMeta.token_ids_start`, `token_len`", "-", "-"),
    "K6": ("-", "`JobFinished.skipped_since` and `now` (annotations); without "
                "`skipped_since`: not judged; without `now`: a note", "-"),
    "K7": ("`ExistsAnswered`, `PutDone.key`, `code`, `JobFinished.stored`, "
           "`SaveMeta.block_hashes`", "-", "-"),
    "K8": ("`LoadDone.failed_block_ids`, `LookupDone`", "-", "-"),
    "K9": ("`LookupDone.num_prompt_tokens`, `hit_tokens`", "-", "-"),
}


# --------------------------------------------------------------------------
# The worked example: one request on a TP-2 engine hashing with vLLM's
# sha256, written as an outside recorder would (observed layer only, job ids
# from 0). Everything below the data is computed by `kvstate.blockhash` and
# `kvstate.keys`.

EXAMPLE_MODEL = "Qwen/Qwen3-0.6B"
EXAMPLE_BLOCK_SIZE = 4
EXAMPLE_WORLD_SIZE = 2
EXAMPLE_REQUEST = "req-0"
# Two full blocks and two tokens of a third: the job saves the two full ones.
EXAMPLE_PROMPT = (151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645)


def example_none_hash() -> bytes:
    """vLLM 0.33.0's ``NONE_HASH`` under sha256 with ``PYTHONHASHSEED`` unset."""
    from kvstate import blockhash

    return blockhash.vllm_sha256(blockhash.VLLM_DEFAULT_NONE_HASH_SEED)


def example_hashes() -> list[bytes]:
    """The example prompt's full blocks, hashed as the engine did."""
    from kvstate import blockhash
    from kvstate.keys import HashChain

    fn = blockhash.chain_hash_fn(blockhash.VLLM_SHA256, example_none_hash())
    return HashChain(EXAMPLE_BLOCK_SIZE, EXAMPLE_PROMPT, fn).hashes


def hash_example() -> dict[str, str]:
    """The example's first block, step by step: the value hashed, its bytes
    under each function, the digests (hex)."""
    import pickle

    from kvstate import blockhash
    from kvstate.keys import block_hash

    none_hash = example_none_hash()
    tokens = EXAMPLE_PROMPT[:EXAMPLE_BLOCK_SIZE]
    value = (none_hash, tokens, None)
    pickled = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    digest = blockhash.vllm_sha256(value)
    chain = example_hashes()
    assert digest == chain[0]  # the formula written is the one the chain used
    return {
        "tokens": str(list(tokens)),
        "seed_pickle": pickle.dumps(blockhash.VLLM_DEFAULT_NONE_HASH_SEED,
                                    protocol=pickle.HIGHEST_PROTOCOL).hex(),
        "none_hash": none_hash.hex(),
        "pickle": pickled.hex(),
        "sha256": digest.hex(),
        "second": chain[1].hex(),
        "kvstate": block_hash(None, tokens).hex(),
    }


def example_trace() -> list[dict[str, Any]]:
    """A complete trace of the example: a lookup that misses, the prefill
    step and its save job, both ranks' store calls and verdicts, the
    reports, the settlement publishing both chunks' events, the request
    finishing and its blocks freed. Checks clean (exit 0)."""
    from kvstate.config import ConnectorConfig
    from kvstate.keys import key_for, key_prefix

    bs, world, req = EXAMPLE_BLOCK_SIZE, EXAMPLE_WORLD_SIZE, EXAMPLE_REQUEST
    config = ConnectorConfig(block_size=bs, world_size=world, enable_kv_events=True,
                             model_name=EXAMPLE_MODEL)
    prompt = list(EXAMPLE_PROMPT)
    hashes = example_hashes()
    chunks = len(hashes)
    saved = chunks * bs
    table = list(range(1, -(-len(prompt) // bs) + 1))  # one block per started block of tokens
    job = 0

    def hexed(digests: list[bytes]) -> list[dict[str, str]]:
        return [{"@hex": d.hex()} for d in digests]

    def key(rank: int, chunk: int) -> str:
        return key_for(key_prefix(config, rank, 0), hashes[chunk])

    events = [{"@": "BlockStored", "block_hashes": hexed([hashes[c]]),
               "parent_block_hash": hexed([hashes[c - 1]])[0] if c else None,
               "token_ids": prompt[c * bs:(c + 1) * bs], "block_size": bs, "group_idx": 0}
              for c in range(chunks)]
    lines: list[dict[str, Any]] = [{
        "kvstate_trace": 1,
        "configs": [{"@": "ConnectorConfig", "block_size": bs, "world_size": world,
                     "enable_kv_events": True, "model_name": EXAMPLE_MODEL}],
        "block_hash": "vllm-sha256", "none_hash": example_none_hash().hex()}]
    clock = [0.0]

    def add(kind: str, **fields: Any) -> None:
        lines.append({"i": len(lines) - 1, "e": 0, "t": clock[0], "type": kind, **fields})

    namespaces = range(config.num_namespaces)
    add("LookupDone", req_id=req, num_prompt_tokens=len(prompt), block_hashes=hexed(hashes),
        keys=[key(ns * config.put_step, c) for c in range(chunks) for ns in namespaces],
        present=[False] * (chunks * len(namespaces)), hit_tokens=0)
    for block in table:
        add("BlockAllocated", block_id=block, req_id=req)
    add("Allocated", req_id=req, block_ids=[table], num_computed_tokens=0,
        num_external_tokens=0, load_async=False)
    add("StepScheduled", step={"@": "SchedulerStep", "new": [{
        "@": "NewRequest", "req_id": req, "prompt_token_ids": prompt, "num_computed_tokens": 0,
        "num_scheduled_tokens": len(prompt), "block_ids": [table],
        "block_hashes": hexed(hashes)}]})
    add("Planned", plan={"@": "Plan", "step": 1, "saves": [{
        "@": "SaveMeta", "req_id": req, "job_id": job, "token_ids_start": 0, "token_len": saved,
        "num_prompt_tokens": len(prompt), "is_decode": False, "block_ids_start": 0,
        "block_ids": [table[:chunks]], "hashes_start": 0, "block_hashes": hexed(hashes),
        "token_ids": prompt[:saved]}], "pins": table[:chunks]})
    clock[0] = 0.01
    for rank in range(world):
        add("JobStarted", rank=rank, job_id=job, req_id=req, live=True, save_start=0,
            token_len=saved)
        add("ExistsAnswered", rank=rank, job_id=job, keys=[key(rank, c) for c in range(chunks)],
            present=[False] * chunks)
        for c in range(chunks):
            add("PutDone", rank=rank, job_id=job, req_id=req, key=key(rank, c), group=0,
                chunk_id=c, block_id=table[c], code=0, accepted=True)
        add("JobFinished", rank=rank, job_id=job, req_id=req, outcome="stored", save_start=0,
            token_len=saved, stored=[[0, c] for c in range(chunks)], failed=[], events=events)
    clock[0] = 0.02
    for rank in range(world):
        add("ReportDelivered", report={
            "@": "Report", "job_id": job, "rank": rank, "req_id": req,
            "outcome": {"@enum": "JobState", "value": "stored"}, "events": events})
    add("Settled", settlement={"@": "Settlement", "releases": table[:chunks],
                               "published": events})
    add("StepScheduled", step={"@": "SchedulerStep", "finished": [req]})
    add("Planned", plan={"@": "Plan", "step": 2})
    for block in reversed(table):
        add("BlockFreed", block_id=block)
    return lines


def observed_layer(line: dict[str, Any]) -> dict[str, Any] | None:
    """One trace line (parsed JSON) cut to its observed layer: annotation
    fields and omittable fields dropped, nested records included; ``None``
    for an annotation record. The header passes unchanged."""
    kind = line.get("type")
    if kind is None:
        return line
    if kind in ANNOTATION_RECORDS:
        return None
    out = _strip(line, kind)
    holder, names = ANNOTATIONS.get(kind, (None, ()))
    target = out if holder is None else out.get(holder)
    if isinstance(target, dict):
        for name in names:
            target.pop(name, None)
    return out


def _strip(value: Any, kind: str | None) -> Any:
    if isinstance(value, list):
        return [_strip(v, None) for v in value]
    if not isinstance(value, dict):
        return value
    kind = kind or value.get("@")
    omit = OMITTABLE.get(kind, {}) if isinstance(kind, str) else {}
    return {k: _strip(v, None) for k, v in value.items() if k not in omit}


def render_markdown() -> str:
    """``specs/trace.md``: the two layers, field by field, from the tables."""
    import attrs

    from kvstate.trace import OBSERVATIONS, RECORDS, TRACE_VERSION

    out = [
        f"# The kvstate trace contract (version {TRACE_VERSION})",
        "",
        "Generated from `kvstate/contract.py` by `kvstate specs --write`; do not edit.",
        "The JSON schema of every record is `trace.schema.json`.",
        "",
        "A trace has two layers. The **observed** layer is what an engine and its connector",
        "can see and log; the checker judges a trace of only that layer, but not all of",
        f"it: {_unjudged()} rest on what only kvstate",
        "writes and are not judged without annotations (*What each invariant needs*,",
        "below). The **annotation** layer is what kvstate adds as a",
        "producer (its verdicts and internals); where present it is compared with the",
        "checker's own judgement, never believed. A left-out annotation is unknown, never",
        "its empty default.",
        "",
        "An outside producer needs the header, the record table, the *Field rules* (meaning,",
        "unit and what the checker requires of each field), the *Order* rules and the",
        "block-hash formulas; the *Example* at the end is a complete trace that checks",
        "clean.",
        "",
        "Generation numbers are written on every record or on none. Left out, the checker",
        "numbers a request id's lifetimes itself (`kvstate/derive.py`): a lookup or",
        "allocation of a request id with no open or a preempted lifetime opens one,",
        "scheduling it as new or resuming it opens one unless a lookup already did; a job",
        "belongs to the lifetime its plan was built in, a report, put or verdict to its",
        "job, a load answer to the request's latest load. The numbering is the one kvstate's",
        "planner uses, so a kvstate trace stripped of its generations derives the same",
        "numbers (`kvstate trace observed` strips a trace to its observed layer). The plan's",
        "`preempted`/`finished` generation keys, left out, come from the step's scheduler",
        "output the same way.",
        "",
        "Conventions every producer meets:",
        "",
        "- Token positions are offsets into the request's tokens: a save job covers",
        "  `[token_ids_start, token_len)`, so `token_len` is where it ends, not how many",
        "  tokens it has; chunk `c` is the tokens `[c * block_size, (c + 1) * block_size)`.",
        "- Store keys are upstream's (`kvstate/keys.py`, `key_prefix` and `key_for`;",
        "  `N` is `tp_rank // put_step`):",
        "  `[cache_prefix@]model[@cfg:F]@tp_rank:N@pcpP@dcpD@pp_rank:Q@group:G@<chunk hash>`.",
        "  S8 compares every put's key with it, and K7 and S20 find a chunk's key by it,",
        "  so a connector with another key format gets S8 on every put.",
        "- A field typed as an enum is written `{\"@enum\": \"JobState\", \"value\": ...}`",
        "  (`Report.outcome`); `JobFinished.outcome` is a plain string, a `JobState` value",
        "  (`stored`, `partially_stored`, `failed`, `skipped`, `stale`). A record nested in",
        "  a field carries its type as `\"@\"`.",
        "- Numbers the protocol bounds are checked when the trace is read, in every record",
        "  (exit 2, line and field): token counts and positions and block, chunk and job ids",
        "  are in `[0, 2^62)`, generations in `[1, 2^62)` (or left out), every other integer",
        "  (token ids, store codes) fits in 64 bits, request ids and store keys are text",
        "  without NUL or lone surrogates; store job ids strictly increase from any start",
        "  (vLLM's connector numbers from 0, kvstate from 1).",
        "  Times (`t`, `JobFinished.now`, `skipped_since`) are on the producer's clocks,",
        "  whatever their epoch: only their order and differences are judged, so negative",
        "  times are valid.",
    ]
    out += _header_rows()
    out += ["", f"Left out, `liveness_steps` is {DEFAULT_LIVENESS_STEPS}. Ages count plan steps "
            "(`plan.step`) to the last plan: a job or pin younger than the bound where the "
            "trace ends is listed as in flight, not judged, so a short trace is checked with "
            "a small `--liveness-steps`."]
    out += _config_rows()
    out += _block_hash_section()
    out += ["", "## Records", "",
            "| record | observed fields | may be left out (reads as) | annotations | "
            "vLLM 0.33.0 source |",
            "|---|---|---|---|---|"]
    holders = {holder: (kind, names) for kind, (holder, names) in ANNOTATIONS.items()
               if holder is not None}
    for name in sorted(OBSERVATIONS):
        cls = OBSERVATIONS[name]
        if name in ANNOTATION_RECORDS:
            out.append(f"| `{name}` | - | - | the whole record | kvstate only |")
            continue
        rows = [(name, cls, ANNOTATIONS.get(name, (None, ()))[1]
                 if ANNOTATIONS.get(name, (None, ()))[0] is None else ())]
        for field in attrs.fields(cls):
            if field.name in holders and holders[field.name][0] == name:
                rows.append((f"{name}.{field.name}", RECORDS[_type_name(field.type)],
                             holders[field.name][1]))
        for label, record, annotated in rows:
            omit = OMITTABLE.get(record.__name__, {})
            observed = [f.name for f in attrs.fields(record)
                        if f.name not in annotated and f.name not in omit]
            left = [f"{k} ({'derived' if v == UNKNOWN else repr(v)})" for k, v in omit.items()]
            source = VLLM_SOURCES.get(label, "") if label == name else ""
            out.append(f"| `{label}` | {', '.join(observed)} | {', '.join(left) or '-'} | "
                       f"{', '.join(annotated) or '-'} | {source} |")
    for nested in sorted(set(OMITTABLE) - set(OBSERVATIONS)):
        record = RECORDS[nested]
        omit = OMITTABLE[nested]
        observed = [f.name for f in attrs.fields(record) if f.name not in omit]
        left = [f"{k} ({'derived' if v == UNKNOWN else repr(v)})" for k, v in omit.items()]
        out.append(f"| `{nested}` (nested) | {', '.join(observed)} | {', '.join(left)} | - | "
                   "- |")
    out += ["", "## Field rules", "",
            "What each field means and what `kvstate check` requires of it; a field not",
            "listed is read as its name says, one marked *not read* only by `kvstate replay`.",
            "", "| field | rule |", "|---|---|"]
    out += [f"| `{name}` | {_cell(rule)} |" for name, rule in FIELD_RULES]
    out += ["", "## Order", ""]
    out += [f"- {rule}" for rule in ORDER_RULES]
    out += _needs_rows()
    out += _example_section()
    return "\n".join(out) + "\n"


def _unjudged() -> str:
    """The invariants (or halves) ``NEEDS`` says an observed-only trace leaves
    unjudged, as prose."""
    whole = [i for i, (reads, needs, _) in NEEDS.items() if reads == "-" and needs != "-"]
    half = [i for i, (reads, needs, _) in NEEDS.items() if reads != "-" and needs != "-"]
    return f"{', '.join(whole)} and part of {', '.join(half)}"


def _config_rows() -> list[str]:
    import enum
    import json

    import attrs

    from kvstate.config import ConnectorConfig

    rows = ["", "## Connector configuration", "",
            "Each `configs` entry is `{\"@\": \"ConnectorConfig\", ...}`; a left-out field "
            "takes its default.", "", "| field | default | meaning |", "|---|---|---|"]
    for field in attrs.fields(ConnectorConfig):
        default = field.default
        if isinstance(default, enum.Enum):
            shown = f"`{json.dumps(default.value)}`"
        elif isinstance(default, tuple):  # the groups: one `GroupSpec()`
            shown = "one full-attention group"
        else:
            shown = f"`{json.dumps(default)}`"
        rows.append(f"| `{field.name}` | {shown} | {_cell(CONFIG_FIELDS[field.name])} |")
    return rows


def _cell(text: str) -> str:
    """``text`` inside a markdown table cell: a bare ``|`` would end the cell."""
    return text.replace("|", "\\|")


def _block_hash_section() -> list[str]:
    from kvstate.keys import NONE_HASH

    ex = hash_example()
    return [
        "", "## Block hashes", "",
        "A request's hash chain has one hash per `hash_block_size` tokens, each folding in",
        "its parent: `h_i = f(h_(i-1), tokens of hash block i)`, with `NONE_HASH` as the",
        "first block's parent. A chunk is named (its key's hash, its event's",
        "`block_hashes`) by the last hash inside it; its event's parent is the hash just",
        "before its first token. S17 recomputes `f` from an event's token ids with the",
        "function the header's `block_hash` names:",
        "",
        "- `vllm-sha256` (vLLM 0.33.0, `--prefix-caching-hash-algo sha256`): `f(parent,",
        "  tokens) = sha256(pickle.dumps((parent, tuple(tokens), None), protocol=5))`: a",
        "  3-tuple of the parent digest (bytes), the hash block's token ids (Python ints) and",
        "  the extra keys (`None`), pickled with protocol 5 (`pickle.HIGHEST_PROTOCOL`);",
        "  32-byte digests (`vllm/v1/core/kv_cache_utils.py: hash_block_tokens`,",
        "  `vllm/utils/hashing.py: sha256`).",
        "- `vllm-sha256_cbor`: sha256 of the same 3-tuple as `cbor2.dumps(value,",
        "  canonical=True)`: a CBOR array of a byte string, an array of integers and null.",
        "  Recomputed only where `cbor2` imports (else a note).",
        "- `kvstate` (the default): blake2b with a 16-byte digest over the parent's bytes",
        f"  then the token ids as little-endian int64; `NONE_HASH` is `{NONE_HASH.hex()}`",
        "  (`kvstate/keys.py: block_hash`).",
        "- `opaque`: anything else, and every engine whose requests carry extra keys (LoRA,",
        "  multimodal inputs, `cache_salt`, prompt embeddings) or that hashes with xxhash:",
        "  not recomputed; S17 still requires `block_size` token ids, or none.",
        "",
        "`none_hash` is vLLM's `NONE_HASH` as hex: `f` of a seed, the engine's",
        "`PYTHONHASHSEED` if it was set, else `\"vllm-none-hash\"` under sha256 and",
        "sha256_cbor (vLLM 0.33.0 `init_none_hash`; xxhash draws a random seed per process).",
        "A recorder logs the engine's `vllm.v1.core.kv_cache_utils.NONE_HASH` there. Left",
        "out, the checker takes the default seed's; a request's first chunk whose token ids",
        "do not hash to its name under it is a note (`S17 not checked`), not a violation.",
        "Later chunks are recomputed from their parent in the chain and always judged.",
        "",
        "Worked example, the first block of the *Example* (`block_size` 4, `PYTHONHASHSEED`",
        "unset, `vllm-sha256`):",
        "",
        f"- seed `\"vllm-none-hash\"` pickled: `{ex['seed_pickle']}`; its sha256, `NONE_HASH`"
        f" (the header's `none_hash`): `{ex['none_hash']}`",
        f"- tokens `{ex['tokens']}`; `(NONE_HASH, tuple(tokens), None)` pickled:",
        f"  `{ex['pickle']}`",
        f"- its sha256, the chunk's hash (key suffix, `block_hashes`): `{ex['sha256']}`",
        f"- the second block, with that as parent: `{ex['second']}`",
        f"- the first block under `kvstate` would be `{ex['kvstate']}`",
    ]


def _needs_rows() -> list[str]:
    from kvstate.invariants import CATALOGUE

    rows = ["", "## What each invariant needs", "",
            "From each checker's code: what it reads of the observed layer, what it needs",
            "beyond it (and what happens without), and optional records or fields that",
            "sharpen it. A note is listed in `kvstate check`'s output; *not judged* without a",
            "note is silent. S5 has no checker.", "",
            "| id | invariant | reads (observed layer) | needs beyond it | optional |",
            "|---|---|---|---|---|"]
    for inv in CATALOGUE:
        reads, needs, optional = NEEDS[inv.id]
        cells = " | ".join(_cell(text) for text in (inv.statement, reads, needs, optional))
        rows.append(f"| {inv.id} | {cells} |")
    return rows


def _example_section() -> list[str]:
    import json

    return ["", "## Example", "",
            f"One request (`{EXAMPLE_REQUEST}`, a {len(EXAMPLE_PROMPT)}-token prompt: two "
            "full blocks and part of a third)",
            "on a TP-2 engine hashing with `vllm-sha256`, written as an outside recorder",
            "would: the observed layer only, job ids from 0. A lookup that misses (keys",
            "chunk-major, both namespaces); the prefill step and its save job of the two full",
            "blocks, pinned; each rank's existence check, puts and verdict with both chunks'",
            "events; both reports; the settlement releasing the pins and publishing the",
            "events (chunk 1's parent is chunk 0); the request finishing and its blocks",
            "freed. `kvstate check` exits 0 with two notes: K1 (no `content`) and S18 (no",
            "`released_jobs`).", "", "```jsonl"] + [
        json.dumps(line, separators=(",", ":")) for line in example_trace()] + ["```"]


def _header_rows() -> list[str]:
    """The header line's fields, from its JSON schema (one source)."""
    import json

    from kvstate.trace.schema import header_schema

    schema = header_schema()
    rows = ["", "## Header", "",
            "Line 1 is one JSON object; keys other than these are kept as written "
            "(`seed`, `options`, `producer`...).", "",
            "| field | required | values | meaning |", "|---|---|---|---|"]
    for name, field in schema["properties"].items():
        if "const" in field:
            values = json.dumps(field["const"])
        elif "enum" in field:
            values = ", ".join(json.dumps(v) for v in field["enum"])
        elif field.get("type") == "array":
            values = f"array of `{field['items']['$ref'].rsplit('/', 1)[-1]}`"
        else:
            values = field.get("type", "")
        if "default" in field:
            values += f" (default {json.dumps(field['default'])})"
        rows.append(f"| `{name}` | {'yes' if name in schema['required'] else 'no'} | "
                    f"{values} | {field.get('description', '')} |")
    return rows


def _type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else annotation.__name__
