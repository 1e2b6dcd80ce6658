"""One engine's observations, put in causal order, written as a trace and monitored.

Design notes
------------
The scheduler sees its own observations as they happen (lookups, allocations,
each step's ``SchedulerStep`` and ``Plan``, reports delivered and what they
settled). Every rank's observations (its jobs, store calls and answers, loads)
arrive later, inside the worker metadata of some step, and the ranks run
concurrently with the scheduler. A trace that wrote lines as they *arrived*
would place a rank's job after a plan the rank had not yet taken, and a
checker or ``kvstate replay`` would then see effects before their causes.

Each rank observation carries ``plan`` (the last plan its rank had taken) and
``shipped`` (the step whose worker metadata carried it). The order written is:

    step k's scheduling (lookups, allocations, StepScheduled, Planned)
    rank observations with plan == k shipped in step k      (rank by rank)
    step k's settlement (ReportDelivered..., Settled)
    rank observations with plan == k shipped later          (rank by rank)
    step k+1's scheduling ...

which is, per rank, exactly the order the rank lived (its observations stay
contiguous and in sequence, so every output follows the input that caused
it) and, across ranks and the scheduler, an order consistent with causality:
a rank acts on plan k only after Planned k, and a report is delivered only
after the rank produced it. When step k's settlement arrives (at
``update_connector_output`` of step k) everything up to it is known, so lines
are written then, through step k, and flushed to the operating system. A
recording engine's ranks ship worker metadata every step (empty or not), so
vLLM calls ``update_connector_output`` every step and each step's lines are
written when the step ends: a process killed (SIGKILL) loses at most the
step it was in, and what was written is a whole trace of the steps before
(check it with ``--at-end open``).

The trace's time is the step number (the executors' clock in the connector);
line indexes are assigned as lines are written, so both only go forward.
The online monitor sees exactly the written order.

Two producers use this log. ``KvstateConnector`` knows its generations and
kvstate's internals, and writes them (``layer="annotated"``) or cuts them
away (``"observed"``); its monitor sees the records as built. The observer of
upstream's connector (`adapters.vllm.observer`) knows no generations: it
builds records with a placeholder generation and asks for
``derive_generations``, so each line is cut to its observed layer (plus the
annotations named in ``keep``: facts the observer saw itself) and the
monitor judges what that line *decodes to* with the generations
`kvstate.derive` numbers: exactly what ``kvstate check`` of the file judges.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from typing import IO, Any

import attrs

from kvstate.contract import ANNOTATIONS, OMITTABLE, observed_layer
from kvstate.invariants import Monitor
from kvstate.observations import Observation
from kvstate.trace import encode_header, encode_observation
from kvstate.trace.codec import NO_ABSENT, encode_value, field_names

from .worker_side import RankObservation

logger = logging.getLogger("kvstate.vllm")
_DUMPS = json.JSONEncoder(separators=(",", ":")).encode

# Where a line sorts within its step (see the module docstring).
_SCHEDULING, _SETTLEMENT = 0, 2


def _observed_fields(record: Any, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """``record``'s fields as `kvstate.trace.codec.encode_value` writes them,
    cut to the observed layer as it goes (`kvstate.contract.observed_layer`
    strips a finished line instead: the same result, at twice the cost on
    the lines of a big step), plus the annotations in ``keep`` that are set."""
    kind = type(record).__name__
    omit = OMITTABLE.get(kind, {})
    holder, names = ANNOTATIONS.get(kind, (None, ()))
    drop = frozenset(n for n in names if n not in keep) if holder is None else frozenset()
    out: dict[str, Any] = {}
    for name in field_names(type(record)):
        if name in omit or name in drop:
            continue
        value = getattr(record, name)
        if name in keep and value is None:
            continue
        if name == holder:
            inner = _observed_fields(value)
            inner["@"] = type(value).__name__
            for annotation in names:
                inner.pop(annotation, None)
            out[name] = inner
        else:
            out[name] = _observed_value(value)
    return out


def _observed_value(value: Any) -> Any:
    kind = type(value)
    if kind is tuple or kind is list:
        if all(type(v) is int for v in value):
            return list(value)
        return [_observed_value(v) for v in value]
    if attrs.has(kind) and kind.__name__ in OMITTABLE:
        return {"@": kind.__name__, **_observed_fields(value)}
    return encode_value(value)


class InvariantViolated(RuntimeError):
    """``kvstate_monitor: raise`` and an invariant fired inside the engine."""


class EngineLog:
    """Orders, writes and monitors one engine's observations."""

    def __init__(self, config: Any, protocol: str | None, *, path: str | None, monitor: str,
                 header: Callable[[], dict[str, Any]], layer: str = "annotated",
                 derive_generations: bool = False,
                 keep: dict[str, tuple[str, ...]] | None = None,
                 background: bool = False) -> None:
        """``header`` is called once, at the first flush: what it names (the
        engine's block-hash function and its NONE_HASH) is settled only once
        the engine core initialised its hashing, after the connector was built."""
        self.config = config
        self.protocol = protocol
        self.path = path
        self.monitor_mode = monitor
        self.monitor: Monitor | None = None
        self._header = header
        self._started = False
        self._file: IO[str] | None = None
        self._pending: list[tuple[tuple[int, int, int, int], Observation]] = []
        self._seq = 0
        self._index = 0
        self._reported = 0
        self.violations: list[Any] = []
        self.active = path is not None or monitor != "off"
        # "observed": write only what vLLM's own objects show (specs/trace.md),
        # as a recorder that knows nothing of kvstate would.
        self.layer = "observed" if derive_generations else layer
        self.keep = keep or {}
        self._derivation: Any = None
        if derive_generations:
            from kvstate.derive import Derivation

            self._derivation = Derivation([config])
        # ``background``: lines are encoded, written and judged on a thread
        # of their own, so the scheduler only orders them (a monitor that
        # raises must raise in the engine's own call, so it stays inline).
        self.failed: str | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if background and monitor != "raise" and self.active:
            self._writer = threading.Thread(target=self._drain, daemon=True,
                                            name="kvstate-trace-writer")
            self._writer.start()

    def _start(self) -> None:
        self._started = True
        header = self._header()
        if self.monitor_mode != "off":
            hashing: dict[str, Any] = {"block_hash": header.get("block_hash", "opaque")}
            if header.get("none_hash"):
                hashing["none_hash"] = bytes.fromhex(header["none_hash"])
            self.monitor = Monitor(self.config, shared_store=True, **hashing)
        if self.path is not None:
            self._file = open(self.path, "w")  # noqa: SIM115 - closed by close()
            named = {} if self.protocol is None else {"protocol": self.protocol}
            self._file.write(encode_header([self.config], **named, **header) + "\n")

    def reserve(self) -> int:
        """A place in the scheduling order for a record written later
        (``scheduling(..., seq=)``): the observer learns a lookup's store
        answers only from the worker metadata, after the step's plan."""
        self._seq += 1
        return self._seq

    def scheduling(self, step: int, obs: Observation, seq: int | None = None) -> None:
        if seq is None:
            seq = self.reserve()
        self._pending.append(((step, _SCHEDULING, -1, seq), obs))

    def settlement(self, step: int, obs: Observation) -> None:
        self._seq += 1
        self._pending.append(((step, _SETTLEMENT, -1, self._seq), obs))

    def ranks(self, observations: list[RankObservation]) -> None:
        for ro in observations:
            late = 2 * max(0, ro.shipped - ro.plan) + 1
            self._pending.append(((ro.plan, late, ro.rank, ro.seq), ro.observation))

    def flush(self, through_step: int | None) -> None:
        """Write every line up to step ``through_step``'s settlement (all when None)."""
        if not self._pending:
            return
        if not self._started:
            self._start()
        self._pending.sort(key=lambda item: item[0])
        if through_step is None:
            cut = len(self._pending)
        else:
            limit = (through_step, _SETTLEMENT, 1 << 30, 1 << 62)
            cut = 0
            while cut < len(self._pending) and self._pending[cut][0] <= limit:
                cut += 1
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        if self._writer is not None:
            self._queue.put(ready)
            return
        self._write(ready)

    def _write(self, ready: list[tuple[tuple[int, int, int, int], Observation]]) -> None:
        """Encode, write and judge ``ready`` (on the writer thread, if any)."""
        lines: list[str] = []
        if self._derivation is not None:
            self._flush_derived(ready, lines)
        else:
            observed_only = self.layer == "observed"
            for key, obs in ready:
                if self._file is not None:
                    line = encode_observation(obs, self._index, 0, float(key[0]))
                    if observed_only:
                        kept = observed_layer(json.loads(line))
                        line = json.dumps(kept, separators=(",", ":")) if kept else ""
                    if line:
                        lines.append(line)
                self._index += 1
                if self.monitor is not None:
                    self.monitor.observe(obs)
        if lines and self._file is not None:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        self._check()

    def _flush_derived(self, ready: list[tuple[tuple[int, int, int, int], Observation]],
                       lines: list[str]) -> None:
        """Records whose generations are placeholders (`UNKNOWN`): each is
        written cut to its observed layer plus ``keep``, and the monitor
        judges it with the generations `kvstate.derive` gives it and the
        annotations the line leaves out: what ``kvstate check`` of the
        written line judges, without parsing it back."""
        derivation = self._derivation
        monitor = self.monitor
        keep = self.keep
        for key, obs in ready:
            kind = type(obs).__name__
            kept_names = keep.get(kind, ())
            if self._file is not None:
                line: dict[str, Any] = {"i": self._index, "e": 0, "t": float(key[0]),
                                        "type": kind}
                line.update(_observed_fields(obs, kept_names))
                lines.append(_DUMPS(line))
            self._index += 1
            if monitor is not None:
                holder, names = ANNOTATIONS.get(kind, (None, ()))
                absent = frozenset(n for n in names if n not in kept_names
                                   or getattr(obs, n, None) is None)
                where = f"{self.path or 'trace'}:{self._index + 1}"
                derived, absent = derivation.apply(where, 0, obs, absent or NO_ABSENT)
                monitor.observe(derived, absent)

    def _check(self) -> None:
        if self.monitor is None:
            return
        fresh = self.monitor.findings[self._reported:]
        self._reported = len(self.monitor.findings)
        for violation in fresh:
            self.violations.append(violation)
            logger.error("kvstate invariant %s violated: %s", violation.invariant,
                         violation.message)
        if fresh and self.monitor_mode == "raise":
            first = fresh[0]
            raise InvariantViolated(f"{first.invariant}: {first.message}")

    def _drain(self) -> None:
        """The writer thread: batches in order; a failure is logged once and
        stops the trace, never the engine."""
        while True:
            ready = self._queue.get()
            if ready is None:
                return
            if self.failed is not None:
                continue
            try:
                self._write(ready)
            except Exception as exc:  # noqa: BLE001 - the engine must not die of its log
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.exception("kvstate trace writer failed; the trace stops here")

    def close(self) -> None:
        try:
            self.flush(None)
        finally:
            writer = self._writer
            if writer is not None:
                self._writer = None
                self._queue.put(None)
                writer.join()
            if self._file is not None:
                self._file.close()
                self._file = None
