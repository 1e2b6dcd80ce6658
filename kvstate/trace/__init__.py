"""Traces: a run's observations as JSON Lines, read back with errors that say where.

A trace is data, never code: no ``eval``, no ``pickle``. Line 1 is a header::

    {"kvstate_trace": 1, "configs": [<ConnectorConfig>...], "protocol": "kvstate", ...}

and every further line is one observation of engine ``e`` (an index into
``configs``)::

    {"i": 17, "e": 0, "t": 3.0, "type": "PutDone", "rank": 0, "job_id": 4, ...}

Records nest as ``{"@": "SaveMeta", ...fields}``, enum values as
``{"@enum": "JobState", "value": "stored"}``, bytes (hashes) as ``{"@hex": "..."}``;
sequences are lists and decode to tuples. Decoding checks every field against
the record's annotations, so a malformed line is refused with the line number,
the field path and the value (``TraceError``), never with a traceback from deep
inside a monitor. ``specs/trace.schema.json`` is generated from the same
registry.

Header fields besides ``configs`` (each optional): ``protocol`` (a string; the
kvstate variant replay re-drives), ``block_hash`` (the engine's block-hash
function, `kvstate.blockhash`; default ``kvstate``), ``none_hash`` (vLLM's
``NONE_HASH`` as hex), ``liveness_steps`` (the age bound for liveness where the
trace ends). Sizes are checked against ``LIMITS`` before anything is built.
Every line is then checked for order, identity and range (``_Validator``)
before a monitor or the model sees it.
"""

from kvstate.trace.codec import (
    ENUMS,
    LIMITS,
    NO_ABSENT,
    OBSERVATIONS,
    RECORDS,
    TRACE_VERSION,
    TraceError,
    absent_annotations,
    decode_line,
    decode_line_absent,
    decode_record,
    decode_value,
    decoder_for,
    encode_header,
    encode_observation,
    encode_value,
    header_none_hash,
    parse_json,
    read_header,
)
from kvstate.trace.fast import fast_codec
from kvstate.trace.reader import (
    TraceReader,
    iter_lines,
    iter_raw_lines,
    line_text,
    open_trace_file,
)
from kvstate.trace.schema import trace_schema

__all__ = [
    "ENUMS", "LIMITS", "NO_ABSENT", "OBSERVATIONS", "RECORDS", "TRACE_VERSION", "TraceError",
    "TraceReader", "absent_annotations", "decode_line", "decode_line_absent", "decode_record",
    "decode_value", "decoder_for", "encode_header", "encode_observation", "encode_value",
    "fast_codec", "header_none_hash", "iter_lines", "iter_raw_lines", "line_text",
    "open_trace_file", "parse_json", "read_header", "trace_schema",
]
