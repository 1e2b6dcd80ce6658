"""The trace's JSON schema (``specs/trace.schema.json``), from the registry."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

import attrs

from kvstate import blockhash as _blockhash
from kvstate.contract import OMITTABLE
from kvstate.trace.codec import ENUMS, LIMITS, OBSERVATIONS, RECORDS, STORE_KINDS, TRACE_VERSION


def _schema_of(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any or annotation is object:
        return {}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of(a) for a in args]}
    if annotation is type(None):
        return {"type": "null"}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema_of(args[0])}
        return {"type": "array", "prefixItems": [_schema_of(a) for a in args],
                "minItems": len(args), "maxItems": len(args)}
    if annotation is bytes:
        return {"$ref": "#/$defs/bytes"}
    if annotation is bool:
        return {"type": "boolean"}
    if annotation is int:
        return {"type": "integer"}
    if annotation is float:
        return {"type": "number"}
    if annotation is str:
        return {"type": "string"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"$ref": f"#/$defs/{annotation.__name__}"}
    if isinstance(annotation, type) and attrs.has(annotation):
        return {"$ref": f"#/$defs/{annotation.__name__}"}
    return {}


def _record_schema(cls: type, tag: str | None) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required = []
    if tag == "@":
        props["@"] = {"const": cls.__name__}
        required.append("@")
    omittable = OMITTABLE.get(cls.__name__, {})
    for field in attrs.fields(cls):
        props[field.name] = _schema_of(field.type)
        if field.default is attrs.NOTHING and field.name not in omittable:
            required.append(field.name)
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def trace_schema() -> dict[str, Any]:
    defs: dict[str, Any] = {"bytes": {
        "type": "object", "properties": {"@hex": {"type": "string", "pattern": "^[0-9a-f]*$"}},
        "required": ["@hex"], "additionalProperties": False}}
    for name, cls in sorted(ENUMS.items()):
        defs[name] = {"type": "object", "properties": {
            "@enum": {"const": name}, "value": {"enum": [m.value for m in cls]}},
            "required": ["@enum", "value"], "additionalProperties": False}
    for name, cls in sorted(RECORDS.items()):
        if name not in OBSERVATIONS:
            defs[name] = _record_schema(cls, "@")
    lines = []
    for name, cls in sorted(OBSERVATIONS.items()):
        schema = _record_schema(cls, None)
        schema["properties"].update({
            "i": {"type": "integer", "minimum": 0}, "e": {"type": "integer", "minimum": 0},
            "t": {"type": "number"}, "type": {"const": name}})
        schema["required"] = ["i", "e", "t", "type", *schema["required"]]
        lines.append(schema)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/kvstate/kvstate/specs/trace.schema.json",
        "title": f"kvstate trace, version {TRACE_VERSION}",
        "description": "Line 1 is the header; every further line is one observation. "
                       "Generated from kvstate.trace; do not edit.",
        "$defs": {**defs, "header": header_schema()},
        "oneOf": [{"$ref": "#/$defs/header"}, *lines],
    }


def header_schema() -> dict[str, Any]:
    """The header line's schema (also rendered as ``specs/trace.md``'s
    header table; `kvstate.trace.codec.read_header` checks the same)."""
    return {"type": "object", "properties": {
        "kvstate_trace": {"const": TRACE_VERSION, "description": "the trace format's version"},
        "configs": {"type": "array", "items": {"$ref": "#/$defs/ConnectorConfig"}, "minItems": 1,
                    "maxItems": LIMITS["engines"],
                    "description": "one ConnectorConfig per engine; observation field 'e' "
                    "indexes it. Limits: " + ", ".join(f"{k} <= {v}" for k, v in LIMITS.items())},
        "protocol": {"type": "string", "description": "the kvstate protocol variant that "
                     "produced the trace (replay needs one; an engine's recorder may omit it)"},
        "block_hash": {"enum": list(_blockhash.NAMES), "default": _blockhash.KVSTATE,
                       "description": "the engine's block-hash function, which S17 "
                       "recomputes (see kvstate.blockhash); 'opaque': not recomputable"},
        "none_hash": {"type": "string", "pattern": "^[0-9a-fA-F]+$", "maxLength": 128,
                      "description": "vLLM's NONE_HASH (parent of a request's first block) "
                      "as hex; without it the default seed 'vllm-none-hash' is tried"},
        "liveness_steps": {"type": "integer", "minimum": 1, "description": "steps after "
                           "which a job or pin still held where the trace ends is stuck "
                           "(kvstate check --liveness-steps overrides it)"},
        "store": {"enum": list(STORE_KINDS), "default": "private", "description": "'shared' "
                  "when writers outside the trace use the same store: a hit on a key no "
                  "engine of the trace stored is then a note, not an S20 violation"},
    }, "required": ["kvstate_trace", "configs"]}
