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

Header fields besides ``configs`` (each optional): ``protocol`` (a string; the
kvstate variant replay re-drives), ``block_hash`` (the engine's block-hash
function, `kvstate.blockhash`; default ``kvstate``), ``none_hash`` (vLLM's
``NONE_HASH`` as hex), ``liveness_steps`` (the age bound for liveness where the
trace ends). Sizes are checked against ``LIMITS`` before anything is built.
Every line is then checked for order, identity and range (``_Validator``)
before a monitor or the model sees it.
"""

from __future__ import annotations

import bisect
import enum
import json
import math
import os
import stat
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from kvstate import blockhash as _blockhash
from kvstate import config as _config
from kvstate import events as _events
from kvstate import observations as _observations
from kvstate import records as _records
from kvstate import tables as _tables
from kvstate.contract import ANNOTATIONS, OMITTABLE

TRACE_VERSION = 1
MAX_LINE_BYTES = 64 << 20  # a line longer than this is refused, not read into memory

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
}


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


def parse_json(text: str, where: str) -> Any:
    """``json.loads`` whose every failure is a ``TraceError``: invalid JSON,
    ``NaN``/``Infinity``, an integer too long to convert (Python refuses more
    than 4,300 digits), nesting too deep to parse."""
    try:
        return _JSON.decode(text)
    except json.JSONDecodeError as exc:
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
    data = parse_json(text, where)
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
        _check_limits(config, where, f"configs[{i}]")
        decoded.append(config)
    total = sum(c.world_size * len(c.groups) for c in decoded)
    if total > LIMITS["ranks_x_groups"]:
        raise TraceError(where, "configs", f"world sizes times groups add up to {total}; at "
                         f"most {LIMITS['ranks_x_groups']} are supported")
    data["configs"] = decoded
    protocol = data.get("protocol")
    if protocol is not None and type(protocol) is not str:
        raise TraceError(where, "protocol", f"expected a string, got {protocol!r}")
    name = data.setdefault("block_hash", _blockhash.KVSTATE)
    if name not in _blockhash.NAMES:
        raise TraceError(where, "block_hash", f"{name!r} is not one of "
                         f"{', '.join(_blockhash.NAMES)}")
    steps = data.get("liveness_steps")
    if steps is not None and not (type(steps) is int and 1 <= steps <= 1 << 62):
        raise TraceError(where, "liveness_steps", f"expected an integer >= 1, got {steps!r}")
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


def _check_limits(config: Any, where: str, path: str) -> None:
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
    if not math.isfinite(config.pressure_backoff):
        raise TraceError(where, f"{path}.pressure_backoff",
                         f"must be finite, got {config.pressure_backoff}")


def iter_raw_lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) pairs, streaming, blank lines included; a line
    longer than ``MAX_LINE_BYTES`` or a last line without its newline (a
    truncated write) is refused."""
    number = 0
    readline = stream.readline
    limit = MAX_LINE_BYTES + 1
    while True:
        raw = readline(limit)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{name}:{number}", "", f"line longer than {MAX_LINE_BYTES} bytes")
        if raw[-1:] != b"\n":
            raise TraceError(f"{name}:{number}", "", "truncated last line (no newline)")
        yield number, raw


def line_text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(where, "", f"not UTF-8 ({exc.reason})") from None


def iter_lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, str]]:
    """(line number, text) pairs of the non-blank lines, streaming (see
    ``iter_raw_lines``)."""
    for number, raw in iter_raw_lines(stream, name):
        text = line_text(raw, f"{name}:{number}")
        if text.strip():
            yield number, text


def open_trace_file(path: str | Path) -> IO[bytes]:
    """Open a trace for reading; only a regular file is taken (a FIFO would
    block until some writer appears, a device never ends)."""
    name = str(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise TraceError(name, "", f"cannot open ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a directory" if stat.S_ISDIR(info.st_mode) else
                "a FIFO" if stat.S_ISFIFO(info.st_mode) else "not a regular file")
        raise TraceError(name, "", f"{kind}: kvstate reads traces from regular files "
                         "(save a stream to a file first)")
    try:
        handle = open(path, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise TraceError(name, "", f"cannot open ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):  # replaced since the stat
        handle.close()
        raise TraceError(name, "", "not a regular file")
    return handle


class _JobIds:
    """The job ids an engine's plans emitted, as sorted disjoint ranges
    (ids mostly run consecutively, so this is a range or a few). Bounded: past
    ``MAX`` ranges the oldest two merge, so an old gap may read as known —
    never the other way round."""

    MAX = 4096
    __slots__ = ("lo", "hi")

    def __init__(self) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []

    def add(self, job_id: int) -> None:
        lo, hi = self.lo, self.hi
        if hi and lo[-1] <= job_id <= hi[-1] + 1:
            hi[-1] = max(hi[-1], job_id)
            return
        if not hi or job_id > hi[-1]:
            lo.append(job_id)
            hi.append(job_id)
        else:
            i = bisect.bisect_right(lo, job_id) - 1
            if i >= 0 and job_id <= hi[i] + 1:
                hi[i] = max(hi[i], job_id)
            else:
                lo.insert(i + 1, job_id)
                hi.insert(i + 1, job_id)
                i += 1
            if i + 1 < len(lo) and hi[i] + 1 >= lo[i + 1]:  # close a gap
                hi[i] = max(hi[i], hi[i + 1])
                del lo[i + 1], hi[i + 1]
        if len(lo) > self.MAX:
            hi[0] = hi[1]
            del lo[1], hi[1]

    def __contains__(self, job_id: int) -> bool:
        lo, hi = self.lo, self.hi
        if hi and lo[-1] <= job_id <= hi[-1]:
            return True
        i = bisect.bisect_right(lo, job_id) - 1
        return i >= 0 and job_id <= hi[i]


class _Validator:
    """Order, identity and range checks of a trace against itself and its
    header, before any monitor or model sees an observation: indexes strictly
    increase, time never runs backwards, plan steps never do per engine, every
    rank is below its engine's world size and every group index below its
    group count, every job a rank works on was emitted by an earlier plan of
    the same engine, every chunk id is >= 0 and every event names a hash.
    A failure is a ``TraceError`` (exit 2): the trace contradicts itself, so
    no verdict about the protocol can be drawn from it."""

    def __init__(self, configs: list[Any]) -> None:
        self.configs = configs
        self.index = -1
        self.time = -math.inf
        self.steps = [-(1 << 63)] * len(configs)
        self.jobs = [_JobIds() for _ in configs]
        # By type name: the fast path's structs share the records' names.
        self.checks: dict[str, Callable[[str, int, Any], None]] = {
            "JobStarted": self._ranked_job,
            "StateWritten": self._ranked_job,
            "ExistsAnswered": self._ranked_job,
            "StoreCallRaised": self._ranked_job,
            "PutDone": self._put,
            "JobFinished": self._finished,
            "LoadDone": self._ranked,
            "ReportDelivered": self._report,
            "Planned": self._planned,
            "Settled": self._settled,
        }
        self._by_type: dict[type, Callable[[str, int, Any], None] | None] = {}
        self.sizes = [c.world_size for c in configs]

    def line(self, where: str, index: int, engine: int, when: float, obs: Any) -> None:
        if index <= self.index:
            raise TraceError(where, "i", f"index {index} after index {self.index}: indexes "
                             "must strictly increase")
        self.index = index
        if when < self.time:
            raise TraceError(where, "t", f"time {when} after time {self.time}: time must "
                             "not run backwards")
        self.time = when
        kind = type(obs)
        try:
            check = self._by_type[kind]
        except KeyError:
            check = self._by_type[kind] = self.checks.get(kind.__name__)
        if check is not None:
            check(where, engine, obs)

    def _rank(self, where: str, engine: int, rank: int, field: str = "rank") -> None:
        size = self.configs[engine].world_size
        if not 0 <= rank < size:
            raise TraceError(where, field, f"rank {rank} outside engine {engine}'s world "
                             f"size {size}")

    def _group(self, where: str, engine: int, group: int, field: str) -> None:
        count = len(self.configs[engine].groups)
        if not 0 <= group < count:
            raise TraceError(where, field, f"group {group} but engine {engine} has {count} "
                             "KV-cache group(s)")

    def _job(self, where: str, engine: int, job_id: int, field: str = "job_id") -> None:
        if job_id not in self.jobs[engine]:
            raise TraceError(where, field, f"job {job_id} was never emitted by an earlier "
                             f"plan of engine {engine}")

    def _events(self, where: str, engine: int, events: Any, field: str) -> None:
        for i, event in enumerate(events):
            if not event.block_hashes:
                raise TraceError(where, f"{field}[{i}].block_hashes",
                                 "empty: an event names at least one block hash")
            self._group(where, engine, event.group_idx, f"{field}[{i}].group_idx")

    def _ranked(self, where: str, engine: int, obs: Any) -> None:
        self._rank(where, engine, obs.rank)

    def _ranked_job(self, where: str, engine: int, obs: Any) -> None:
        # The common case inline (this runs for most lines): a rank in range,
        # a job in the latest range of emitted ids.
        rank, job_id = obs.rank, obs.job_id
        if not 0 <= rank < self.sizes[engine]:
            self._rank(where, engine, rank)
        jobs = self.jobs[engine]
        hi = jobs.hi
        if not (hi and jobs.lo[-1] <= job_id <= hi[-1]):
            self._job(where, engine, job_id)

    def _put(self, where: str, engine: int, obs: Any) -> None:
        self._ranked_job(where, engine, obs)
        self._group(where, engine, obs.group, "group")
        if obs.chunk_id < 0:
            raise TraceError(where, "chunk_id", f"chunk id {obs.chunk_id} < 0")

    def _finished(self, where: str, engine: int, obs: Any) -> None:
        self._ranked_job(where, engine, obs)
        for field in ("stored", "failed"):
            for i, (group, cid) in enumerate(getattr(obs, field)):
                self._group(where, engine, group, f"{field}[{i}][0]")
                if cid < 0:
                    raise TraceError(where, f"{field}[{i}][1]", f"chunk id {cid} < 0")
        self._events(where, engine, obs.events, "events")

    def _report(self, where: str, engine: int, obs: Any) -> None:
        report = obs.report
        self._rank(where, engine, report.rank, "report.rank")
        self._job(where, engine, report.job_id, "report.job_id")
        self._events(where, engine, report.events, "report.events")

    def _planned(self, where: str, engine: int, obs: Any) -> None:
        plan = obs.plan
        if plan.step < self.steps[engine]:
            raise TraceError(where, "plan.step", f"step {plan.step} after step "
                             f"{self.steps[engine]} of engine {engine}: steps must not run "
                             "backwards")
        self.steps[engine] = plan.step
        jobs = self.jobs[engine]
        for i, meta in enumerate(plan.saves):
            if meta.job_id < 0:
                raise TraceError(where, f"plan.saves[{i}].job_id", f"job id {meta.job_id} < 0")
            jobs.add(meta.job_id)

    def _settled(self, where: str, engine: int, obs: Any) -> None:
        settlement = obs.settlement
        for i, job_id in enumerate(settlement.released_jobs):
            self._job(where, engine, job_id, f"settlement.released_jobs[{i}]")
        self._events(where, engine, settlement.published, "settlement.published")


# --------------------------------------------------------------------------
# The fast path: typed decoding in C (msgspec, optional).
#
# ``kvstate check`` spends most of its time turning JSON into checked records.
# With msgspec installed, every observation type is mirrored as a msgspec
# ``Struct`` built from the same registry (same names, fields, defaults), and
# one typed decoder parses and checks a line in C: types, required and unknown
# fields, record tags, list shapes. What it cannot express is kept exact:
# ``{"@hex": ...}`` goes through ``bytes.fromhex`` in a hook, a nested record
# must carry its ``"@"`` tag (a union with a never-matching twin makes msgspec
# require it), time must be finite, and any line msgspec refuses is decoded
# again by the checked Python decoder above, which raises the precise
# ``TraceError`` (file:line:field:value) or — where msgspec is stricter than
# the format (an integer beyond 64 bits, 1e999) — accepts it. So the fast path
# accepts exactly what the checked decoder accepts. Its records are structs
# shaped like the attrs records (same field names and values; hashes are a
# ``bytes`` subclass, enum values a small struct), so only readers that read
# fields (the monitors) take them: ``TraceReader(path, fast=True)``.
# Measured (`kvstate bench check`): see README "Measured".

try:
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - exercised where msgspec is absent
    _msgspec = None  # type: ignore[assignment]


class _Hex(bytes):
    """A block hash decoded on the fast path (``bytes`` in all but name)."""

    __slots__ = ()


class _Impossible:
    """The field type of a never-matching twin: its hook always refuses."""


def _fast_hook(kind: Any, value: Any) -> Any:
    if kind is _Hex and type(value) is dict and len(value) == 1:
        text = value.get("@hex")
        if type(text) is str:
            return _Hex.fromhex(text)  # ValueError: not hex, refused like the slow path
    raise ValueError(f"not a {getattr(kind, '__name__', kind)}")


class _FastCodec:
    """Structs mirroring the registry and one typed decoder over all
    observation types (tagged by ``"type"``)."""

    def __init__(self) -> None:
        ms = _msgspec
        assert ms is not None
        self.structs: dict[Any, Any] = {}
        self.defaults: dict[str, tuple[str | None, dict[str, Any]]] = {}
        # Records holding annotations (a Plan, a Settlement): those fields
        # decode to UNSET when left out, so ``fill`` can tell.
        self.unset: dict[Any, tuple[str, ...]] = {
            attrs.fields_dict(OBSERVATIONS[kind])[holder].type: names
            for kind, (holder, names) in ANNOTATIONS.items() if holder is not None}
        lines = []
        for name, cls in sorted(OBSERVATIONS.items()):
            holder, names = ANNOTATIONS.get(name, (None, ()))
            fields: list[tuple[Any, ...]] = [("i", int), ("e", int), ("t", float)]
            omittable = OMITTABLE.get(name, {})
            for f in attrs.fields(cls):
                unset = holder is None and f.name in names
                fields.append(self._field(f, unset, omittable))
            lines.append(ms.defstruct(name, fields, tag_field="type", tag=name,
                                      forbid_unknown_fields=True, gc=False, kw_only=True))
            if name in ANNOTATIONS:
                record: Any = attrs.fields_dict(cls)[holder].type if holder else cls
                self.defaults[name] = (holder, {
                    f.name: f.default for f in attrs.fields(record) if f.name in names})
        self.decoder = ms.json.Decoder(typing.Union[tuple(lines)],  # noqa: UP007 - built
                                       dec_hook=_fast_hook)

    def _field(self, f: Any, unset: bool, omittable: dict[str, Any]) -> tuple[Any, ...]:
        kind = self._type(f.type)
        if unset:
            return (f.name, typing.Union[kind, _msgspec.UnsetType],  # noqa: UP007
                    _msgspec.UNSET)
        if f.name in omittable:  # left out by the observed layer: reads as the table says
            return (f.name, kind, omittable[f.name])
        if f.default is attrs.NOTHING:
            return (f.name, kind)
        return (f.name, kind, f.default)

    def _type(self, annotation: Any) -> Any:
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if origin in (typing.Union, types.UnionType):
            return typing.Union[tuple(self._type(a) for a in args)]  # noqa: UP007
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple[self._type(args[0]), ...]  # type: ignore[misc]
            return tuple[tuple(self._type(a) for a in args)]  # type: ignore[misc]
        if annotation is bytes:
            return _Hex
        if annotation in (int, str, float, bool, type(None)):
            return annotation
        if isinstance(annotation, type) and (attrs.has(annotation)
                                             or issubclass(annotation, enum.Enum)):
            found = self.structs.get(annotation)
            if found is None:
                found = self.structs[annotation] = self._record(annotation)
            return found
        raise TypeError(f"no fast decoding for {_type_name(annotation)}")

    def _record(self, cls: type) -> Any:
        ms = _msgspec
        assert ms is not None
        if issubclass(cls, enum.Enum):
            values = tuple(m.value for m in cls)
            struct = ms.defstruct(cls.__name__, [("value", typing.Literal[values])],
                                  tag_field="@enum", tag=cls.__name__,
                                  forbid_unknown_fields=True, gc=False)
            tag = "@enum"
        else:
            unset = self.unset.get(cls, ())
            fields = attrs.fields(cls)  # type: ignore[arg-type]
            struct = ms.defstruct(cls.__name__,
                                  [self._field(f, f.name in unset,
                                               OMITTABLE.get(cls.__name__, {}))
                                   for f in fields],
                                  tag_field="@", tag=cls.__name__,
                                  forbid_unknown_fields=True, gc=False, kw_only=True)
            tag = "@"
        # A tagged struct alone accepts a missing tag; in a union it is required.
        twin = ms.defstruct(f"{cls.__name__}Twin", [("never", _Impossible)], tag_field=tag,
                            tag=f"\x00{cls.__name__}", forbid_unknown_fields=True, gc=False)
        return typing.Union[struct, twin]  # noqa: UP007

    def fill(self, kind: str, obs: Any) -> frozenset[str]:
        """Replace the annotations a line left out by their defaults; their names."""
        holder, defaults = self.defaults[kind]
        record = obs if holder is None else getattr(obs, holder)
        missing = []
        unset = _msgspec.UNSET
        for name, default in defaults.items():
            if getattr(record, name) is unset:
                setattr(record, name, default)
                missing.append(name)
        return frozenset(missing) if missing else NO_ABSENT


_FAST: list[_FastCodec | None] = []


def fast_codec() -> _FastCodec | None:
    """The fast decoder, built once; ``None`` without msgspec."""
    if not _FAST:
        _FAST.append(_FastCodec() if _msgspec is not None else None)
    return _FAST[0]


class TraceReader:
    """Open a trace for streaming: ``header`` is read and checked at once;
    iterate for ``(line number, engine, time, observation)``, each line
    checked for order, identity and range first (``_Validator``). A context
    manager. ``fast``: decode with the fast path where msgspec is installed
    (`fast_codec`); observations are then structs shaped like the records,
    for readers that only read their fields (the monitors)."""

    def __init__(self, path: str | Path, fast: bool = False) -> None:
        self.name = str(path)
        self._handle: IO[bytes] = open_trace_file(path)
        self._lines = iter_raw_lines(self._handle, self.name)
        try:
            for number, raw in self._lines:
                text = line_text(raw, f"{self.name}:{number}")
                if text.strip():
                    break
            else:
                raise TraceError(f"{self.name}:1", "", "empty trace (no header)")
            self.last_line = number
            self.header = read_header(text, f"{self.name}:{number}")
        except TraceError:
            self.close()
            raise
        self.engines = len(self.header["configs"])
        self.fast = fast_codec() if fast else None
        # The annotation fields the latest line left out (`ANNOTATIONS`).
        self.absent: frozenset[str] = NO_ABSENT
        from kvstate.derive import Derivation  # derive reads TraceError from here

        # Generation numbers the observed layer left out (`kvstate.derive`).
        self.derivation = Derivation(self.header["configs"])

    def __iter__(self) -> Iterator[tuple[int, int, float, Any]]:
        validator = _Validator(self.header["configs"])
        derive = self.derivation.apply
        codec = self.fast
        decode = codec.decoder.decode if codec is not None else None
        annotated = frozenset(codec.defaults) if codec is not None else frozenset()
        fill = codec.fill if codec is not None else None
        engines = self.engines
        check_line = validator.line
        name = self.name
        for number, raw in self._lines:
            self.last_line = number
            where = f"{name}:{number}"
            obs = None
            if decode is not None:
                try:
                    obs = decode(raw)
                except Exception:  # refused: the checked decoder says why (or accepts)
                    obs = None
            if obs is None:
                text = line_text(raw, where)
                if not text.strip():
                    continue
                index, engine, when, obs, self.absent = decode_line_absent(text, where)
            else:
                # msgspec refuses numbers beyond a float's range (no inf, no
                # NaN: JSON has neither), so ``t`` is finite here.
                index, engine, when = obs.i, obs.e, obs.t
                kind = type(obs).__name__
                self.absent = fill(kind, obs) if kind in annotated else NO_ABSENT  # type: ignore[misc]
            if not 0 <= engine < engines:
                raise TraceError(where, "e",
                                 f"engine {engine} but the header configures {engines}")
            check_line(where, index, engine, when, obs)
            obs, self.absent = derive(where, engine, obs, self.absent)
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
    header = {"type": "object", "properties": {
        "kvstate_trace": {"const": TRACE_VERSION},
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
