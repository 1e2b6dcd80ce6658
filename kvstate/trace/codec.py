"""Trace codec: observations as JSON Lines and back, with errors that say where.

The registry of record types a trace may hold (everything reachable from the
observation types and the header's ``ConnectorConfig``, found by walking field
annotations, so nothing private or unrelated leaks into the format), encoding,
checked decoding of one line (every field against its annotation: a malformed
line is refused with the line, the field path and the value as a
``TraceError``), and the header with its size ``LIMITS``.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from collections.abc import Callable
from typing import Any

import attrs

from kvstate import blockhash as _blockhash
from kvstate import config as _config
from kvstate import observations as _observations
from kvstate.contract import ANNOTATIONS, OMITTABLE

TRACE_VERSION = 1

# The header's "store": who else writes the store the trace's engines use.
# "shared" turns a hit on a key no engine of the trace stored into a note
# (`kvstate.invariants.Monitor`, ``shared_store``) instead of an S20 finding.
STORE_KINDS = ("private", "shared")

# What a header may ask for. Monitors and replay allocate per engine, rank and
# group, so these are checked before anything is built: a hostile header costs
# no more than its own length.
LIMITS = {
    "engines": 64,  # configs in one trace
    "world_size": 1024,
    "groups": 64,  # KV-cache groups per engine
    "block_size": 1 << 20,  # tokens; also hash_block_size, alignment and sliding windows
    "ranks_x_groups": 1 << 16,  # world_size * groups, summed over the engines
    "rank_ids": 1 << 20,  # pcp_rank, dcp_rank, pp_rank (they only name key namespaces)
    # A backoff in the clock's units (seconds for an engine): a day is already
    # past any liveness bound; 1e18 would silence K6 for ever.
    "pressure_backoff": 86_400.0,
}


class TraceError(ValueError):
    """A malformed trace: ``where`` is ``file:line`` and ``field`` the path."""

    def __init__(self, where: str, field: str, message: str) -> None:
        self.where = where
        self.field = field
        self.message = message
        super().__init__(f"{where}: {('field ' + repr(field) + ': ') if field else ''}{message}")



def _registry() -> tuple[dict[str, type], dict[str, type[enum.Enum]], dict[str, type]]:
    """Records and enums reachable from the observation types and the header's
    ``ConnectorConfig`` through field annotations, by name; the observations."""
    observations = {cls.__name__: cls for cls in typing.get_args(_observations.Observation)}
    records: dict[str, type] = {}
    enums: dict[str, type[enum.Enum]] = {}
    todo: list[Any] = [*observations.values(), _config.ConnectorConfig]
    while todo:
        annotation = todo.pop()
        origin = typing.get_origin(annotation)
        if origin is not None:  # a union, a tuple, ...
            todo.extend(a for a in typing.get_args(annotation) if a is not Ellipsis)
        elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            enums[annotation.__name__] = annotation
        elif isinstance(annotation, type) and attrs.has(annotation):
            if annotation.__name__ in records:
                continue
            module = __import__(annotation.__module__, fromlist=["_"])
            attrs.resolve_types(annotation, globalns=vars(module))
            records[annotation.__name__] = annotation
            todo.extend(f.type for f in attrs.fields(annotation))
    return records, enums, observations


RECORDS, ENUMS, OBSERVATIONS = _registry()


# --------------------------------------------------------------------------
# Encoding.


_NAMES: dict[type, tuple[str, ...]] = {}
_PLAIN = (type(None), bool, int, float, str)


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in attrs.fields(cls))
    return names


field_names = _names  # a record's field names in trace order, cached


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
    if isinstance(value, enum.IntEnum):  # a named integer (a store code): the integer
        return int(value)
    if isinstance(value, enum.Enum):
        return {"@enum": kind.__name__, "value": value.value}
    if attrs.has(kind):
        out = {"@": kind.__name__}
        for name in _names(kind):
            out[name] = encode_value(getattr(value, name))
        return out
    raise TypeError(f"cannot encode {kind.__name__} in a trace")


_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


def observation_line(obs: Any, index: int, engine: int = 0, time: float = 0.0
                     ) -> dict[str, Any]:
    """One trace line as the JSON object ``encode_observation`` writes."""
    line: dict[str, Any] = {"i": index, "e": engine, "t": time, "type": type(obs).__name__}
    for name in _names(type(obs)):
        line[name] = encode_value(getattr(obs, name))
    return line


def encode_observation(obs: Any, index: int, engine: int = 0, time: float = 0.0) -> str:
    return _DUMPS(observation_line(obs, index, engine, time))


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
            if type(value) is float:
                if math.isfinite(value):
                    return value
                raise TraceError(where, path, f"expected a finite number, got {value!r}")
            if type(value) is int:
                try:
                    return float(value)
                except OverflowError:
                    # Not str(value): beyond 4,300 digits that raises too.
                    raise TraceError(where, path, "expected a number within a float's range, "
                                     f"got an integer of {value.bit_length()} bits") from None
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
        omittable = OMITTABLE.get(cls.__name__, {})
        found = _FIELDS[cls] = (
            frozenset(f.name for f in fields),
            tuple((f.name, decoder_for(f.type),
                   f.default is attrs.NOTHING and f.name not in omittable) for f in fields),
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
            omitted = OMITTABLE.get(cls.__name__)
            if omitted is not None and name in omitted:  # the observed layer left it out
                kwargs[name] = omitted[name]
            continue
        kwargs[name] = decode(data[name], where, f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise TraceError(where, path, f"invalid {cls.__name__}: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_JSON = json.JSONDecoder(parse_constant=_reject_constant)


# A liveness bound past any trace's length (`liveness_steps`, header or option).
LIVENESS_STEPS_MAX = 1 << 62


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all distinct (JSON leaves a repeated key to
    the reader; Python's takes the last without a word): ``json``'s
    ``object_pairs_hook`` for every file kvstate reads whole or by the line
    (a trace's header, a FAST'25 workload, a Mooncake config)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


_JSON_UNIQUE = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=unique_keys)


def parse_json(text: str, where: str, unique_keys: bool = False) -> Any:
    """``json.loads`` whose every failure is a ``TraceError``: invalid JSON,
    ``NaN``/``Infinity``, an integer too long to convert (Python refuses more
    than 4,300 digits), nesting too deep to parse; with ``unique_keys`` (the
    header, read once), a key repeated in one object."""
    try:
        return (_JSON_UNIQUE if unique_keys else _JSON).decode(text)
    except json.JSONDecodeError as exc:
        if text.startswith("\ufeff"):
            raise TraceError(where, "", "starts with a UTF-8 byte-order mark (U+FEFF, as some "
                             "editors save): JSON Lines has none; save the file without it"
                             ) from None
        raise TraceError(where, "", f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:
        raise TraceError(where, "", f"invalid JSON ({exc})") from None
    except RecursionError:
        raise TraceError(where, "", "invalid JSON (nested too deeply)") from None


# The annotation fields (`kvstate.contract.ANNOTATIONS`): a left-out one is
# unknown; ``absent_annotations`` names those a line left out.
NO_ABSENT: frozenset[str] = frozenset()


def absent_annotations(kind: str, data: dict[str, Any]) -> frozenset[str]:
    spec = ANNOTATIONS.get(kind)
    if spec is None:
        return NO_ABSENT
    holder, names = spec
    record = data if holder is None else data.get(holder)
    if not isinstance(record, dict):
        return NO_ABSENT
    missing = [name for name in names if name not in record]
    return frozenset(missing) if missing else NO_ABSENT


def decode_line(text: str, where: str) -> tuple[int, int, float, Any]:
    """(index, engine, time, observation) of one trace line."""
    index, engine, when, obs, _ = decode_line_absent(text, where)
    return index, engine, when, obs


def decode_line_absent(text: str, where: str) -> tuple[int, int, float, Any, frozenset[str]]:
    """``decode_line`` plus the annotation fields the line left out."""
    data = parse_json(text, where)
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
    if not math.isfinite(meta["t"]):
        raise TraceError(where, "t", f"time must be finite, got {meta['t']!r}")
    try:
        obs = decode_record(cls, data, where, skip=("i", "e", "t", "type"))
    except RecursionError:
        raise TraceError(where, "", "nested too deeply") from None
    return meta["i"], meta["e"], meta["t"], obs, absent_annotations(kind, data)


def read_header(text: str, where: str) -> dict[str, Any]:
    """The header as a dict: ``configs`` decoded and within ``LIMITS``,
    ``block_hash`` set (default ``kvstate``), ``none_hash`` checked hex.
    Other keys (``protocol``, ``options``, ``seed``...) are kept as written;
    ``protocol``, where present, must be a string."""
    data = parse_json(text, where, unique_keys=True)
    if not isinstance(data, dict) or "kvstate_trace" not in data:
        raise TraceError(where, "kvstate_trace", "missing: not a kvstate trace header")
    version = data["kvstate_trace"]
    if type(version) is not int or version != TRACE_VERSION:
        raise TraceError(where, "kvstate_trace",
                         f"unsupported trace version {version!r} (this kvstate reads {TRACE_VERSION})")
    configs = data.get("configs")
    if not isinstance(configs, list) or not configs:
        raise TraceError(where, "configs", "missing or empty")
    if len(configs) > LIMITS["engines"]:
        raise TraceError(where, "configs", f"{len(configs)} engines; at most "
                         f"{LIMITS['engines']} are supported")
    decoded = []
    for i, raw in enumerate(configs):
        if isinstance(raw, dict) and isinstance(raw.get("groups"), list) and \
                len(raw["groups"]) > LIMITS["groups"]:
            raise TraceError(where, f"configs[{i}].groups", f"{len(raw['groups'])} groups; at "
                             f"most {LIMITS['groups']} are supported")
        config = decode_value(raw, _config.ConnectorConfig, where, f"configs[{i}]")
        check_limits(config, where, f"configs[{i}]")
        decoded.append(config)
    total = sum(c.world_size * len(c.groups) for c in decoded)
    if total > LIMITS["ranks_x_groups"]:
        raise TraceError(where, "configs", f"world sizes times groups add up to {total}; at "
                         f"most {LIMITS['ranks_x_groups']} are supported")
    data["configs"] = decoded
    engines = data.get("engines")
    if engines is not None and not (isinstance(engines, list) and len(engines) == len(decoded)
                                    and all(type(e) is str for e in engines)):
        raise TraceError(where, "engines", f"expected one name per config ({len(decoded)}), "
                         f"got {str(engines)[:80]}")
    protocol = data.get("protocol")
    if protocol is not None and type(protocol) is not str:
        raise TraceError(where, "protocol", f"expected a string, got {protocol!r}")
    name = data.setdefault("block_hash", _blockhash.KVSTATE)
    if name not in _blockhash.NAMES:
        raise TraceError(where, "block_hash", f"{name!r} is not one of "
                         f"{', '.join(_blockhash.NAMES)}")
    store = data.get("store", "private")
    if store not in STORE_KINDS:
        # A misspelt "shared" would otherwise read as private without a word,
        # and every hit on another writer's key would be blamed on the trace.
        raise TraceError(where, "store", f"{store!r} is not one of {', '.join(STORE_KINDS)}")
    steps = data.get("liveness_steps")
    if steps is not None and not (type(steps) is int and 1 <= steps <= LIVENESS_STEPS_MAX):
        raise TraceError(where, "liveness_steps",
                         f"expected an integer in [1, {LIVENESS_STEPS_MAX}], got {steps!r}")
    none_hash = data.get("none_hash")
    if none_hash is not None:
        if not (type(none_hash) is str and 0 < len(none_hash) <= 128):
            raise TraceError(where, "none_hash", f"expected a hex string, got {none_hash!r}")
        try:
            bytes.fromhex(none_hash)
        except ValueError:
            raise TraceError(where, "none_hash",
                             f"expected a hex string, got {none_hash!r}") from None
    return data


def header_none_hash(header: dict[str, Any]) -> bytes | None:
    text = header.get("none_hash")
    return bytes.fromhex(text) if text else None


def check_limits(config: Any, where: str, path: str) -> None:
    """A `TraceError` if ``config`` asks for more than ``LIMITS`` (also what
    the simulator checks its own configs against, so it writes no trace that
    the reader refuses)."""
    if len(config.groups) > LIMITS["groups"]:
        raise TraceError(where, f"{path}.groups", f"{len(config.groups)} groups; at most "
                         f"{LIMITS['groups']} are supported")
    checks = [("world_size", config.world_size, LIMITS["world_size"])]
    for name in ("block_size", "hash_block_size", "alignment"):
        checks.append((name, getattr(config, name), LIMITS["block_size"]))
    for name in ("pcp_rank", "dcp_rank", "pp_rank"):
        checks.append((name, getattr(config, name), LIMITS["rank_ids"]))
    for i, group in enumerate(config.groups):
        checks.append((f"groups[{i}].sliding_window", group.sliding_window,
                       LIMITS["block_size"] * 64))
    for name, value, limit in checks:
        if value is not None and value > limit:
            raise TraceError(where, f"{path}.{name}", f"{value} is beyond the supported "
                             f"maximum {limit}")
    if not (math.isfinite(config.pressure_backoff)
            and config.pressure_backoff <= LIMITS["pressure_backoff"]):
        raise TraceError(where, f"{path}.pressure_backoff",
                         f"must be at most {LIMITS['pressure_backoff']:g}, got "
                         f"{config.pressure_backoff}")
