"""Trace codec: observations as JSON Lines, and back, with errors that say where.

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
"""

from __future__ import annotations

import enum
import json
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from kvstate import config as _config
from kvstate import events as _events
from kvstate import observations as _observations
from kvstate import records as _records
from kvstate import tables as _tables

TRACE_VERSION = 1
MAX_LINE_BYTES = 64 << 20  # a line longer than this is refused, not read into memory


class TraceError(ValueError):
    """A malformed trace: ``where`` is ``file:line`` and ``field`` the path."""

    def __init__(self, where: str, field: str, message: str) -> None:
        self.where = where
        self.field = field
        super().__init__(f"{where}: {('field ' + repr(field) + ': ') if field else ''}{message}")


def _registry() -> tuple[dict[str, type], dict[str, type[enum.Enum]]]:
    records: dict[str, type] = {}
    enums: dict[str, type[enum.Enum]] = {}
    for module in (_records, _events, _observations, _config, _tables):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == module.__name__:
                records[name] = obj
            elif (isinstance(obj, type) and issubclass(obj, enum.Enum)
                  and obj.__module__ == module.__name__ and len(obj)):
                enums[name] = obj
    for cls in records.values():
        attrs.resolve_types(cls, globalns=vars(__import__(cls.__module__, fromlist=["_"])))
    return records, enums


RECORDS, ENUMS = _registry()
OBSERVATIONS = {
    name: cls for name, cls in RECORDS.items() if cls.__module__ == _observations.__name__
}


# --------------------------------------------------------------------------
# Encoding.


_NAMES: dict[type, tuple[str, ...]] = {}
_PLAIN = (type(None), bool, int, float, str)


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in attrs.fields(cls))
    return names


def encode_value(value: Any) -> Any:
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is tuple or kind is list:
        if all(type(v) is int for v in value):
            return list(value)
        return [encode_value(v) for v in value]
    if kind is bytes:
        return {"@hex": value.hex()}
    if isinstance(value, enum.Enum):
        return {"@enum": kind.__name__, "value": value.value}
    if attrs.has(kind):
        out = {"@": kind.__name__}
        for name in _names(kind):
            out[name] = encode_value(getattr(value, name))
        return out
    raise TypeError(f"cannot encode {kind.__name__} in a trace")


_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


def encode_observation(obs: Any, index: int, engine: int = 0, time: float = 0.0) -> str:
    line: dict[str, Any] = {"i": index, "e": engine, "t": time, "type": type(obs).__name__}
    for name in _names(type(obs)):
        line[name] = encode_value(getattr(obs, name))
    return _DUMPS(line)


def encode_header(configs: list[Any], **extra: Any) -> str:
    header = {"kvstate_trace": TRACE_VERSION, "configs": [encode_value(c) for c in configs]}
    header.update(extra)
    return json.dumps(header, separators=(",", ":"), sort_keys=True)


# --------------------------------------------------------------------------
# Decoding with checks.


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)


Decoder = Callable[[Any, str, str], Any]
_DECODERS: dict[Any, Decoder] = {}


def decoder_for(annotation: Any) -> Decoder:
    """A decoder compiled once per annotation: checking a line costs a few
    isinstance calls per field, not a walk of the typing machinery."""
    found = _DECODERS.get(annotation)
    if found is None:
        found = _DECODERS[annotation] = _compile(annotation)
    return found


def _scalar(kind: type, label: str) -> Decoder:
    def decode(value: Any, where: str, path: str) -> Any:
        if type(value) is kind:
            return value
        raise TraceError(where, path, f"expected {label}, got {value!r}")
    return decode


def _compile(annotation: Any) -> Decoder:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any or annotation is object:
        return _decode_untyped
    if origin in (typing.Union, types.UnionType):
        options = [decoder_for(a) for a in args]
        nullable = type(None) in args
        names = " | ".join(_type_name(a) for a in args)

        def union(value: Any, where: str, path: str) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value, where, path)
                except TraceError:
                    continue
            raise TraceError(where, path, f"{value!r} matches none of {names}")
        return union
    if annotation is type(None):
        def null(value: Any, where: str, path: str) -> Any:
            if value is None:
                return None
            raise TraceError(where, path, f"expected null, got {value!r}")
        return null
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = args[0]
            if item in (int, str):
                def flat(value: Any, where: str, path: str) -> Any:
                    if type(value) is list and all(type(v) is item for v in value):
                        return tuple(value)
                    if type(value) is not list:
                        raise TraceError(where, path, f"expected a list, got {value!r}")
                    bad = next(i for i, v in enumerate(value) if type(v) is not item)
                    raise TraceError(where, f"{path}[{bad}]",
                                     f"expected {_type_name(item)}, got {value[bad]!r}")
                return flat
            inner = decoder_for(item)

            def homogeneous(value: Any, where: str, path: str) -> Any:
                if type(value) is not list:
                    raise TraceError(where, path, f"expected a list, got {value!r}")
                return tuple([inner(v, where, f"{path}[{i}]") for i, v in enumerate(value)])
            return homogeneous
        parts = [decoder_for(a) for a in args]

        def fixed(value: Any, where: str, path: str) -> Any:
            if type(value) is not list:
                raise TraceError(where, path, f"expected a list, got {value!r}")
            if len(value) != len(parts):
                raise TraceError(where, path, f"expected {len(parts)} items, got {len(value)}")
            return tuple([p(v, where, f"{path}[{i}]") for i, (v, p) in enumerate(zip(value, parts))])
        return fixed
    if annotation is bytes:
        def hexbytes(value: Any, where: str, path: str) -> Any:
            if type(value) is dict and len(value) == 1:
                text = value.get("@hex")
                if type(text) is str:
                    try:
                        return bytes.fromhex(text)
                    except ValueError:
                        pass
            raise TraceError(where, path, f"expected {{'@hex': ...}} bytes, got {value!r}")
        return hexbytes
    if annotation is bool:
        return _scalar(bool, "true/false")
    if annotation is int:
        return _scalar(int, "an integer")
    if annotation is str:
        return _scalar(str, "a string")
    if annotation is float:
        def number(value: Any, where: str, path: str) -> Any:
            if type(value) in (int, float):
                return float(value)
            raise TraceError(where, path, f"expected a number, got {value!r}")
        return number
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        enum_cls = annotation

        def member(value: Any, where: str, path: str) -> Any:
            if type(value) is dict and value.get("@enum") == enum_cls.__name__:
                try:
                    return enum_cls(value.get("value"))
                except ValueError:
                    pass
            raise TraceError(where, path, f"expected a {enum_cls.__name__} value, got {value!r}")
        return member
    if isinstance(annotation, type) and attrs.has(annotation):
        cls = annotation
        label = cls.__name__

        def record(value: Any, where: str, path: str) -> Any:
            if type(value) is not dict or value.get("@") != label:
                raise TraceError(where, path, f"expected a {label} record, got "
                                 f"{str(value)[:80]!r}")
            return decode_record(cls, value, where, path, skip=("@",))
        return record
    raise ValueError(f"cannot decode type {_type_name(annotation)}")


def decode_value(value: Any, annotation: Any, where: str, path: str) -> Any:
    return decoder_for(annotation)(value, where, path)


def _decode_untyped(value: Any, where: str, path: str) -> Any:
    if isinstance(value, dict):
        if "@" in value and value["@"] in RECORDS:
            return decode_record(RECORDS[value["@"]], value, where, path, skip=("@",))
        if "@hex" in value:
            return decode_value(value, bytes, where, path)
        if "@enum" in value and value["@enum"] in ENUMS:
            return decode_value(value, ENUMS[value["@enum"]], where, path)
        raise TraceError(where, path, f"unknown object {str(value)[:80]!r}")
    if isinstance(value, list):
        return tuple(_decode_untyped(v, where, f"{path}[{i}]") for i, v in enumerate(value))
    return value


_FIELDS: dict[type, tuple[frozenset[str], tuple[tuple[str, Decoder, bool], ...]]] = {}


def _fields_of(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Decoder, bool], ...]]:
    found = _FIELDS.get(cls)
    if found is None:
        fields = attrs.fields(cls)
        found = _FIELDS[cls] = (
            frozenset(f.name for f in fields),
            tuple((f.name, decoder_for(f.type), f.default is attrs.NOTHING) for f in fields),
        )
    return found


def decode_record(cls: type, data: dict[str, Any], where: str, path: str = "",
                  skip: tuple[str, ...] = ()) -> Any:
    known, fields = _fields_of(cls)
    if len(data) - len(skip) > len(known) or not known.issuperset(
            k for k in data if k not in skip):
        for name in data:
            if name not in known and name not in skip:
                raise TraceError(where, f"{path}.{name}".lstrip("."),
                                 f"unknown field for {cls.__name__}")
    kwargs = {}
    for name, decode, required in fields:
        if name not in data:
            if required:
                raise TraceError(where, f"{path}.{name}".lstrip("."),
                                 f"missing (required by {cls.__name__})")
            continue
        kwargs[name] = decode(data[name], where, f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise TraceError(where, path, f"invalid {cls.__name__}: {exc}") from None


def decode_line(text: str, where: str) -> tuple[int, int, float, Any]:
    """(index, engine, time, observation) of one trace line."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(where, "", f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise TraceError(where, "", f"expected a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if kind is None:
        raise TraceError(where, "type", "missing")
    cls = OBSERVATIONS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TraceError(where, "type", f"unknown event type {kind!r}")
    meta = {}
    for name, ann in (("i", int), ("e", int), ("t", float)):
        if name not in data:
            raise TraceError(where, name, "missing")
        meta[name] = decode_value(data[name], ann, where, name)
    obs = decode_record(cls, data, where, skip=("i", "e", "t", "type"))
    return meta["i"], meta["e"], meta["t"], obs


def read_header(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(where, "", f"invalid JSON header ({exc.msg})") from None
    if not isinstance(data, dict) or "kvstate_trace" not in data:
        raise TraceError(where, "kvstate_trace", "missing: not a kvstate trace header")
    version = data["kvstate_trace"]
    if version != TRACE_VERSION:
        raise TraceError(where, "kvstate_trace",
                         f"unsupported trace version {version!r} (this kvstate reads {TRACE_VERSION})")
    configs = data.get("configs")
    if not isinstance(configs, list) or not configs:
        raise TraceError(where, "configs", "missing or empty")
    data["configs"] = [
        decode_value(c, _config.ConnectorConfig, where, f"configs[{i}]")
        for i, c in enumerate(configs)
    ]
    return data


def iter_lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, str]]:
    """(line number, text) pairs, streaming; a last line without its newline is
    a truncated write and is refused."""
    number = 0
    while True:
        raw = stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{name}:{number}", "", f"line longer than {MAX_LINE_BYTES} bytes")
        if not raw.endswith(b"\n"):
            raise TraceError(f"{name}:{number}", "", "truncated last line (no newline)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(f"{name}:{number}", "", f"not UTF-8 ({exc.reason})") from None
        if text.strip():
            yield number, text


class TraceReader:
    """Open a trace for streaming: ``header`` is read and checked at once;
    iterate for ``(line number, engine, time, observation)``. A context manager."""

    def __init__(self, path: str | Path) -> None:
        self.name = str(path)
        try:
            self._handle: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise TraceError(self.name, "", f"cannot open ({exc.strerror})") from None
        self._lines = iter_lines(self._handle, self.name)
        first = next(self._lines, None)
        if first is None:
            self.close()
            raise TraceError(f"{self.name}:1", "", "empty trace (no header)")
        self.last_line = first[0]
        try:
            self.header = read_header(first[1], f"{self.name}:{first[0]}")
        except TraceError:
            self.close()
            raise
        self.engines = len(self.header["configs"])

    def __iter__(self) -> Iterator[tuple[int, int, float, Any]]:
        for number, text in self._lines:
            self.last_line = number
            _, engine, when, obs = decode_line(text, f"{self.name}:{number}")
            if not 0 <= engine < self.engines:
                raise TraceError(f"{self.name}:{number}", "e",
                                 f"engine {engine} but the header configures {self.engines}")
            yield number, engine, when, obs

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------
# Schema.


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
    for field in attrs.fields(cls):
        props[field.name] = _schema_of(field.type)
        if field.default is attrs.NOTHING:
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
    header = {"type": "object", "properties": {
        "kvstate_trace": {"const": TRACE_VERSION},
        "configs": {"type": "array", "items": {"$ref": "#/$defs/ConnectorConfig"}, "minItems": 1},
    }, "required": ["kvstate_trace", "configs"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/kvstate/kvstate/specs/trace.schema.json",
        "title": f"kvstate trace, version {TRACE_VERSION}",
        "description": "Line 1 is the header; every further line is one observation. "
                       "Generated from kvstate.trace; do not edit.",
        "$defs": {**defs, "header": header},
        "oneOf": [{"$ref": "#/$defs/header"}, *lines],
    }
