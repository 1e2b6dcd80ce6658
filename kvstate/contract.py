"""The trace contract: what an engine writes, what kvstate adds, where it comes from.

Theory of operation
-------------------
A trace has two layers. The *observed* layer is what an engine and its
connector can see and log without knowing anything of kvstate: the
scheduler's output per step, the connector metadata per store job, each
rank's store calls and their answers, reports as workers send them, KV events
as published, block allocations and frees, errors. The *annotation* layer is
what kvstate adds when it is the producer: its own verdicts, its rank-state
internals, its generation numbers. A trace with no annotations at all is
fully checkable; the checker derives what the annotations would have said
(`kvstate.derive`), and where an annotation is present it is compared with
the checker's own judgement, never believed.

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
    and the invariants that need them say they were not checkable.
``ANNOTATION_RECORDS``
    Whole observation types kvstate writes about itself (its rank-state
    writes, its own claim of quiescence). An engine never needs to write
    them: liveness is judged where the trace ends (``--liveness-steps``).

``VLLM_SOURCES`` maps every observed record to the vLLM 0.33.0 object it is
read from, for a recorder inside vLLM (the kvstate connector's recorder,
``adapters/vllm/recorder.py``, writes these from exactly those objects).
``specs/trace.md`` is rendered from these tables (`render_markdown`).
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
        "`content` optional (a digest of the bytes, `kvstate.invariants.expected_content`)"),
    "StoreCallRaised": "rank: a store call that raised or timed out",
    "JobFinished": (
        "rank: the job's verdict before the report is sent: chunks stored (put or found), "
        "chunks whose put failed, events"),
    "LoadDone": (
        "rank: `start_load_kv` finished a load (`batch_get_into`): block ids that got no or "
        "wrong data (`get_block_ids_with_load_errors`)"),
    "BlockAllocated": "the `BlockPool` handed a block to a request (`get_new_blocks`)",
    "BlockWritten": "rank: the forward pass wrote a block (optional; feeds content checks)",
    "BlockFreed": "the `BlockPool` took a block back (`free_blocks`, ref count 0)",
    "KeyEvicted": "the store's eviction (from the master's metrics or logs; optional)",
}


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
        "can see and log; a trace of only that layer is fully checkable. The **annotation**",
        "layer is what kvstate adds as a producer (its verdicts and internals); where present",
        "it is compared with the checker's own judgement, never believed. A left-out",
        "annotation is unknown, never its empty default.",
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
        "- Numbers the protocol bounds are checked when the trace is read (exit 2, line and",
        "  field): token counts and positions and block ids are in `[0, 2^62)`, generations",
        "  in `[1, 2^62)` (or left out), request ids are text without NUL, store job ids",
        "  strictly increase from any start (vLLM's connector numbers from 0, kvstate from 1).",
        "  Times (`t`, `JobFinished.now`, `skipped_since`) are on the producer's clocks,",
        "  whatever their epoch: only their order and differences are judged, so negative",
        "  times are valid.",
    ]
    out += _header_rows()
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
    return "\n".join(out) + "\n"


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
