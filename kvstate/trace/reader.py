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
from pathlib import Path
from typing import IO, Any

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


# What a number in a trace can be (issue 32, class 6): the decoders check
# types, these check what the protocol allows. Every id and count fits in 62
# bits (vLLM's block ids, token counts and kvstate's generations are far
# below); token counts, block ids and chunk ids are never negative; a
# generation is >= 1, or the observed layer's "left out" (`UNKNOWN`, -1).
_MAX_ID = 1 << 62
# Field name -> what its value is, for the records the scheduler writes (one
# or a few per step, so walking them costs little next to the rank lines).
_COUNTS = frozenset({
    "num_computed_tokens", "num_scheduled_tokens", "num_prompt_tokens",
    "num_external_tokens", "token_ids_start", "token_len", "hit_tokens",
    "block_ids_start", "hashes_start"})
_BLOCKS = frozenset({"block_ids", "new_block_ids", "pins", "releases",
                     "failed_block_ids", "reported_block_ids"})
_STEP_RECORDS = frozenset({"StepScheduled", "Planned", "LookupDone", "Allocated", "LoadDone",
                           "Settled"})


# Fields that hold nested scheduler records (or lists of them) to walk into.
_NESTED = frozenset({"step", "plan", "settlement", "new", "cached", "resumed", "saves",
                     "loads", "published"})
_PLANS: dict[type, tuple[tuple[str, str], ...]] = {}


def _plan(kind: type, obj: Any) -> tuple[tuple[str, str], ...]:
    """(field, rule) for the fields of ``kind`` a rule applies to, once per
    type: the walk touches nothing else (token lists, hashes, keys)."""
    fields = getattr(obj, "__struct_fields__", None)  # the fast path's msgspec structs
    if fields is None:
        fields = [a.name for a in getattr(kind, "__attrs_attrs__", ())]
    plan = []
    for name in fields:
        if name in _COUNTS:
            plan.append((name, "count"))
        elif name in _BLOCKS:
            plan.append((name, "blocks"))
        elif name == "generation":
            plan.append((name, "generation"))
        elif name == "req_id":
            plan.append((name, "req_id"))
        elif name in ("preempted", "finished"):
            plan.append((name, "req_ids"))
        elif name in _NESTED:
            plan.append((name, "nested"))
    out = _PLANS[kind] = tuple(plan)
    return out


def _request_id(where: str, field: str, value: Any) -> None:
    if type(value) is not str or value.isascii() and "\x00" not in value:
        return  # the decoders name a wrong type; the common case costs two C calls
    if "\x00" in value:
        raise TraceError(where, field, f"request id {value!r} holds a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise TraceError(where, field, f"request id {value!r} holds a lone surrogate (not "
                         "text: JSON's \\ud800-style escapes must come in pairs)") from None


def _block_ids(where: str, field: str, value: Any) -> None:
    """Block ids (a flat list, or one list per KV-cache group) in [0, 2^62)."""
    if type(value) is int:
        if not 0 <= value < _MAX_ID:
            raise TraceError(where, field, f"block id {value} outside [0, 2^62)")
        return
    if not value:
        return
    if type(value[0]) is int:
        try:
            low, high = min(value), max(value)
        except TypeError:
            low, high = 0, 0  # mixed types: the decoders' to name
        if low >= 0 and high < _MAX_ID:
            return
    for i, item in enumerate(value):
        if type(item) is int:
            if not 0 <= item < _MAX_ID:
                raise TraceError(where, f"{field}[{i}]", f"block id {item} outside [0, 2^62)")
        elif isinstance(item, (tuple, list)):
            _block_ids(where, f"{field}[{i}]", item)


def _check_numbers(where: str, path: str, obj: Any) -> None:
    """Walk a scheduler-side record and its nested records, checking every
    field whose name says what it holds (`_COUNTS`, `_BLOCKS`, ``generation``,
    ``req_id``)."""
    kind = type(obj)
    plan = _PLANS.get(kind)
    if plan is None:
        plan = _plan(kind, obj)
    for name, rule in plan:
        value = getattr(obj, name)
        if rule == "count":
            if type(value) is int and not 0 <= value < _MAX_ID:
                raise TraceError(where, f"{path}{name}", f"{value} is no token count or "
                                 "position (expected 0 <= n < 2^62)")
        elif rule == "blocks":
            _block_ids(where, f"{path}{name}", value)
        elif rule == "generation":
            if type(value) is int and not (1 <= value < _MAX_ID or value == UNKNOWN):
                raise TraceError(where, f"{path}{name}",
                                 f"generation {value} outside [1, 2^62)")
        elif rule == "req_id":
            _request_id(where, f"{path}{name}", value)
        elif rule == "req_ids":
            for i, item in enumerate(value or ()):
                if type(item) is str:
                    _request_id(where, f"{path}{name}[{i}]", item)
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if not isinstance(item, (int, float, str, bytes)):
                    _check_numbers(where, f"{path}{name}[{i}].", item)
        elif value is not None:
            _check_numbers(where, f"{path}{name}.", value)


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
            if kind.__name__ in _STEP_RECORDS:
                check = self._by_type[kind] = self._numbered(check)
        if check is not None:
            check(where, engine, obs)

    @staticmethod
    def _numbered(check: Callable[[str, int, Any], None] | None
                  ) -> Callable[[str, int, Any], None]:
        """``check`` (if any) after the number rules of `_check_numbers`."""
        def both(where: str, engine: int, obs: Any) -> None:
            _check_numbers(where, "", obs)
            if check is not None:
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
