"""Reading a trace: files, lines, order/identity/range checks, the reader.

``TraceReader`` streams a trace: the header checked at once, then per line
decoding (the fast path where msgspec is installed, `kvstate.trace.fast`),
order, identity and range checks (``_Validator``) and the generation numbers
the observed layer left out (`kvstate.derive`), before a monitor or the model
sees the record.
"""

from __future__ import annotations

import bisect
import math
import os
import stat
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import IO, Any

import attrs

from kvstate.contract import UNKNOWN
from kvstate.trace.codec import NO_ABSENT, TraceError, decode_line_absent, read_header
from kvstate.trace.fast import fast_codec

MAX_LINE_BYTES = 64 << 20  # a line longer than this is refused, not read into memory


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
            if number == 1:
                raise TraceError(f"{name}:1", "", "truncated first line (no newline): the "
                                 "writer stopped before its header was whole; there is no "
                                 "trace to check")
            raise TraceError(f"{name}:{number}", "", "truncated last line (no newline): the "
                             "writer stopped mid-line; the lines before it are whole, so "
                             f"`head -n {number - 1}` of the file gives a trace to check "
                             "(with --at-end open, as it ends mid-run)")
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


def trace_name(path: str | Path) -> str:
    """A trace's path as errors show it: as given, or quoted where it would
    not read as a name (empty, blank at an end, control characters, bytes
    that are not UTF-8)."""
    name = str(path)
    if name and name == name.strip() and name.isprintable():
        return name
    return repr(name)


def open_trace_file(path: str | Path) -> IO[bytes]:
    """Open a trace for reading; only a regular file is taken (a FIFO would
    block until some writer appears, a device never ends)."""
    name = trace_name(path)
    if not str(path):  # os.stat('') says "No such file", naming nothing
        raise TraceError(name, "", "an empty path: give a trace file")
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


# What a value in a trace can be (issue 32, class 6): the decoders check
# types, these check what the protocol allows, in every record a trace holds
# (they were checked in the scheduler's records only, so a rank's
# ``PutDone.block_id`` of -1 or a ``JobStarted.token_len`` of -4 read as
# valid). Every id and count fits in 62 bits (vLLM's block ids, token counts
# and kvstate's generations are far below) and is never negative; a
# generation is >= 1, or the observed layer's "left out" (`UNKNOWN`, -1), as
# is a report's confirmed offset; every other integer (token ids, store
# codes) fits in 64 bits; request ids and store keys are text: no NUL, no
# lone surrogate. The rule of a field comes from its name and its type in
# the record (`kvstate.trace.RECORDS`), compiled once per record type.
_MAX_ID = 1 << 62
_INT64 = 1 << 63
# Field name -> what the integers in it are (a field or a list of them).
_COUNTS = frozenset({
    "num_computed_tokens", "num_scheduled_tokens", "num_prompt_tokens",
    "num_external_tokens", "token_ids_start", "token_len", "hit_tokens",
    "block_ids_start", "hashes_start", "save_start", "start_token", "end_token",
    "dropped_events", "pinned_blocks"})
_IDS = {"block_id": "block id", "block_ids": "block id", "new_block_ids": "block id",
        "pins": "block id", "releases": "block id", "failed_block_ids": "block id",
        "reported_block_ids": "block id", "chunk_id": "chunk id", "chunk_ids": "chunk id",
        "stored": "group or chunk id", "failed": "group or chunk id", "job_id": "job id",
        "released_jobs": "job id", "step": "step", "block_size": "block size"}
# (Ranks and groups are checked against the header's world size and group
# count, `_Validator`, which names both.)
_GENERATIONS = frozenset({"generation", "state_generation", "retry_generation",
                          "scope_generation"})
_TEXT_IDS = frozenset({"req_id", "key", "keys", "preempted", "finished", "published_by"})

# (where, path, field, value) -> None, or a TraceError naming ``path + field``
# (joined only then: this runs for every field of every line).
_Rule = Callable[[str, str, str, Any], None]


def _number(value: int) -> str:
    return str(value) if -(10 ** 40) < value < 10 ** 40 else f"an integer of " \
        f"{value.bit_length()} bits"


def _count(where: str, path: str, field: str, value: Any) -> None:
    if type(value) is int and not 0 <= value < _MAX_ID:
        raise TraceError(where, path + field, f"{_number(value)} is no token count or position "
                         "(expected 0 <= n < 2^62)")


def _generation(where: str, path: str, field: str, value: Any) -> None:
    if type(value) is int and not (1 <= value < _MAX_ID or value == UNKNOWN):
        raise TraceError(where, path + field, f"generation {_number(value)} outside [1, 2^62)")


def _offset(where: str, path: str, field: str, value: Any) -> None:
    if type(value) is int and not (0 <= value < _MAX_ID or value == UNKNOWN):
        raise TraceError(where, path + field, f"offset {_number(value)} outside [0, 2^62)")


def _int64(where: str, path: str, field: str, value: Any) -> None:
    if type(value) is int and not -_INT64 <= value < _INT64:
        raise TraceError(where, path + field, f"{_number(value)} does not fit in 64 bits")


def _ids(what: str, low: int = 0, high: int = _MAX_ID) -> _Rule:
    """Integers in ``[low, high)``: one, a list of them, or lists of lists
    (a block table: one list per KV-cache group)."""
    label = "[0, 2^62)" if (low, high) == (0, _MAX_ID) else "64 bits"

    def rule(where: str, path: str, field: str, value: Any) -> None:
        if type(value) is int:
            if not low <= value < high:
                raise TraceError(where, path + field,
                                 f"{what} {_number(value)} outside {label}")
            return
        if not value or type(value) not in (tuple, list):
            return
        try:  # the common case in C: a list's (or a table's) least and greatest
            flat = value if type(value[0]) is int else list(chain.from_iterable(value))
            if not flat or low <= min(flat) and max(flat) < high:
                return
        except TypeError:
            pass  # mixed types: the decoders' to name
        for i, item in enumerate(value):
            if type(item) is int or isinstance(item, (tuple, list)):
                rule(where, path, f"{field}[{i}]", item)
    rule.bounds = (low, high)  # type: ignore[attr-defined]  # `_checker` inlines flat lists
    return rule


def _text(where: str, path: str, field: str, value: Any) -> None:
    if type(value) is not str or value.isascii() and "\x00" not in value:
        return  # the decoders name a wrong type; the common case costs two C calls
    if "\x00" in value:
        raise TraceError(where, path + field, f"{_shown(value)} holds a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise TraceError(where, path + field, f"{_shown(value)} holds a lone surrogate (not text: "
                         "JSON's \\ud800-style escapes must come in pairs)") from None


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 60 else f"{value[:40]!r}... ({len(value)} characters)"


def _texts(where: str, path: str, field: str, value: Any) -> None:
    for i, item in enumerate(value or ()):
        if type(item) is str:
            _text(where, path, f"{field}[{i}]", item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:  # a GenKey: (req_id, gen)
            _text(where, path, f"{field}[{i}][0]", item[0])
            _generation(where, path, f"{field}[{i}][1]", item[1])


def _rule(name: str, annotation: Any) -> _Rule | None:
    """The rule of field ``name`` with type ``annotation`` (``None``: nothing
    to check: hashes, booleans, free text, enums, times)."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None
        inner = [a for a in args if a is not type(None)]
        return _rule(name, inner[0]) if len(inner) == 1 else None
    if isinstance(annotation, type) and attrs.has(annotation):
        kind = annotation.__name__

        def nested(where: str, path: str, field: str, value: Any) -> None:
            check = _checker(kind)
            if value is not None and check is not None:
                try:
                    check(where, "", value)
                except TraceError as exc:  # the field's path, built only now
                    raise TraceError(where, f"{path}{field}.{exc.field}", exc.message) from None
        return nested
    if origin is tuple and args and args[-1] is Ellipsis:
        item = args[0]
        if isinstance(item, type) and attrs.has(item):
            kind = item.__name__

            def each(where: str, path: str, field: str, value: Any) -> None:
                check = _checker(kind)
                if check is None:
                    return
                for i, record in enumerate(value):
                    try:
                        check(where, "", record)
                    except TraceError as exc:
                        raise TraceError(where, f"{path}{field}[{i}].{exc.field}",
                                         exc.message) from None
            return each
    if name in _TEXT_IDS:
        return _text if annotation is str else _texts
    flat = annotation
    while typing.get_origin(flat) is tuple:  # the int inside tuple[tuple[int, ...], ...]
        inner_args = [a for a in typing.get_args(flat) if a is not Ellipsis]
        if len(set(inner_args)) != 1:
            return None  # (str, int) pairs (leftovers): names and counts of state
        flat = inner_args[0]
    if flat is not int:
        return None
    if name in _GENERATIONS:
        return _generation
    if name == "confirmed_offset":
        return _offset
    if name in _COUNTS:
        return _count if annotation is int else _ids("token count or position")
    if name in _IDS:
        return _ids(_IDS[name])
    return _int64 if annotation is int else _ids("integer", -_INT64, _INT64)


# (where, path, record) -> None: every rule of one record type.
_Check = Callable[[str, str, Any], None]
_CHECKS: dict[str, _Check | None] = {}
# A scalar rule as a condition on ``o.F`` (the common case, inlined: a
# rank's line is checked in a handful of comparisons, no call per field).
_INLINE = {
    _count: f"0 <= o.F < {_MAX_ID}",
    _generation: f"(0 < o.F < {_MAX_ID} or o.F == {UNKNOWN})",
    _offset: f"{UNKNOWN} <= o.F < {_MAX_ID}",
    _int64: f"{-_INT64} <= o.F < {_INT64}",
    _text: "(o.F.isascii() and '\\x00' not in o.F)",
}


def _checker(kind: str) -> _Check | None:
    """The value rules of record type ``kind`` as one function, compiled once
    (the fast path's structs share the records' names and fields), or
    ``None`` when it has none. Its scalar fields are one condition, written
    out and compiled (as attrs and dataclasses write their methods); lists
    and nested records call their rules. Only when the condition fails are
    the fields looked at one by one, to name the one that broke it."""
    try:
        return _CHECKS[kind]
    except KeyError:
        pass
    from kvstate.trace.codec import OBSERVATIONS, RECORDS

    cls = OBSERVATIONS.get(kind) or RECORDS[kind]
    rules = [(f.name, f.type, rule) for f in attrs.fields(cls)
             if (rule := _rule(f.name, f.type)) is not None]
    if not rules:
        _CHECKS[kind] = None
        return None
    conditions, calls = [], []
    namespace: dict[str, Any] = {"slow": None}
    for k, (name, annotation, rule) in enumerate(rules):
        inline = _INLINE.get(rule)  # type: ignore[arg-type]
        bounds = getattr(rule, "bounds", None)
        if inline is not None and annotation in (int, str):
            conditions.append(inline.replace("F", name))
        elif inline is not None and annotation == int | None:
            conditions.append(f"(o.{name} is None or {inline.replace('F', name)})")
        elif bounds is not None and annotation is int:
            conditions.append(f"{bounds[0]} <= o.{name} < {bounds[1]}")
        elif bounds is not None and annotation == tuple[int, ...]:  # a flat list, in C
            low, high = bounds
            conditions.append(f"(not o.{name} or {low} <= min(o.{name}) and "
                              f"max(o.{name}) < {high})")
        else:
            namespace[f"r{k}"] = rule
            calls.append(f"    r{k}(where, path, {name!r}, o.{name})")
    source = ["def check(where, path, o):"]
    if conditions:
        source.append(f"    if not ({' and '.join(conditions)}):")
        source.append("        slow(where, path, o)")
    source += calls

    def slow(where: str, path: str, obj: Any) -> None:
        for name, _, rule in rules:
            rule(where, path, name, getattr(obj, name))
    namespace["slow"] = slow
    exec("\n".join(source), namespace)  # noqa: S102 - source built above from field names
    check: _Check = namespace["check"]
    _CHECKS[kind] = check
    return check


def _check_numbers(where: str, path: str, obj: Any, kind: str | None = None) -> None:
    """Every value of ``obj`` (a record: an observation or one nested in one)
    against its field's rule."""
    check = _checker(kind or type(obj).__name__)
    if check is not None:
        check(where, path, obj)


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

    def out_of_order(self, where: str, index: int) -> None:
        raise TraceError(where, "i", f"index {index} after index {self.index}: indexes "
                         "must strictly increase")

    def backwards(self, where: str, when: float) -> None:
        raise TraceError(where, "t", f"time {when} after time {self.time}: time must "
                         "not run backwards")

    def check_of(self, kind: type) -> Callable[[str, int, Any], None] | None:
        """Every check of a record of type ``kind`` but order (the reader's
        line loop checks that): its value rules and its identity and range
        checks, as one call (``None``: nothing to check)."""
        try:
            return self._by_type[kind]
        except KeyError:
            check = self._by_type[kind] = self._numbered(kind.__name__,
                                                         self.checks.get(kind.__name__))
            return check

    @staticmethod
    def _numbered(kind: str, check: Callable[[str, int, Any], None] | None
                  ) -> Callable[[str, int, Any], None] | None:
        """``check`` (if any) after the value rules of record type ``kind``
        (`_checker`)."""
        rules = _checker(kind)
        if rules is None:
            return check
        if check is None:
            return lambda where, engine, obs: rules(where, "", obs)

        def both(where: str, engine: int, obs: Any) -> None:
            rules(where, "", obs)
            check(where, engine, obs)
        return both

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


class TraceReader:
    """Open a trace for streaming: ``header`` is read and checked at once;
    iterate for ``(line number, engine, time, observation)``, each line
    checked for order, identity and range first (``_Validator``). A context
    manager. ``fast``: decode with the fast path where msgspec is installed
    (`fast_codec`); observations are then structs shaped like the records,
    for readers that only read their fields (the monitors)."""

    def __init__(self, path: str | Path, fast: bool = False) -> None:
        self.name = trace_name(path)
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
        derivation = self.derivation
        lives = derivation.engines
        codec = self.fast
        decode = codec.decoder.decode if codec is not None else None
        annotated = frozenset(codec.defaults) if codec is not None else frozenset()
        fill = codec.fill if codec is not None else None
        engines = self.engines
        name = self.name
        # Per record type, once: (its checks, its derivation, whether it has
        # annotations to fill). This loop runs once per line and is most of
        # `kvstate check`'s own time, so a type's two lookups and the calls
        # it does not need are left out here rather than in every line.
        plans: dict[type, tuple[Any, Any, bool]] = {}
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
                index, engine, when, obs, absent = decode_line_absent(text, where)
                fast = False
            else:
                # msgspec refuses numbers beyond a float's range (no inf, no
                # NaN: JSON has neither), so ``t`` is finite here.
                index, engine, when = obs.i, obs.e, obs.t
                fast = True
            kind = type(obs)
            plan = plans.get(kind)
            if plan is None:
                plan = plans[kind] = self._plan(kind, validator, annotated)
            if fast:  # the struct holds UNSET where the line left an annotation out
                absent = fill(kind.__name__, obs) if plan[2] else NO_ABSENT  # type: ignore[misc]
            if not 0 <= engine < engines:
                raise TraceError(where, "e",
                                 f"engine {engine} but the header configures {engines}")
            # The order checks (`_Validator`), written out: once per line.
            if index <= validator.index:
                validator.out_of_order(where, index)
            validator.index = index
            if when < validator.time:
                validator.backwards(where, when)
            validator.time = when
            check, derive, _ = plan
            if check is not None:
                check(where, engine, obs)
            if derive is not None:
                obs, absent = derive(where, lives[engine], obs, absent)
            self.absent = absent
            yield number, engine, when, obs

    def _plan(self, kind: type, validator: _Validator, annotated: frozenset[str]
              ) -> tuple[Any, Any, bool]:
        return (validator.check_of(kind), self.derivation.handler_of(kind),
                kind.__name__ in annotated)

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
