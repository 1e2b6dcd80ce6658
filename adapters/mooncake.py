"""A Mooncake store client configured like vLLM's connector, with bounded calls
and a fresh client after a call that did not return.

Configuration comes from the JSON file named by ``MOONCAKE_CONFIG_PATH`` (the
keys vLLM's connector reads: ``metadata_server``, ``master_server_address``,
``protocol`` tcp|rdma, ``device_name``, ``global_segment_size``,
``local_buffer_size`` with "4gb"-style sizes) or from explicit fields.

Every store call runs on a worker thread and is bounded by ``timeout``
seconds: upstream has no bound, so a hung master pins engine blocks forever
(S6). A call that times out raises ``TimeoutError`` — the executor then
reports its job failed and its pins are released — and the client it ran on
is retired: `MooncakeStore` sets up a fresh one in the background (an
*episode*, see there) while calls fail at once. Setup asks the master first
in a child process (`probe_master_setup`): the binding's own setup can hold
the GIL for minutes against a port that is not a master's. Failures are
return codes, named by ``code_name`` (`kvstate.store_codes`).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import queue
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvstate.store_codes import code_name
from kvstate.trace.codec import unique_keys

logger = logging.getLogger("kvstate.mooncake")

MODES = ("embedded", "standalone-store")


class MooncakeUnavailable(RuntimeError):
    """The mooncake package (or its system libraries) cannot be imported."""


# The largest size a config may ask for: 1 PiB, far above any machine's
# memory, so a typo ("99999999999t", 10**30) is refused here, naming the
# field, instead of failing inside Mooncake's allocator.
MAX_SIZE = 1 << 50
# A Mooncake config file is a few hundred bytes; a file far larger (or a
# FIFO, a device) is not one, and reading it must not block or fill memory.
CONFIG_FILE_LIMIT = 1 << 20
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut where it would not fit a line (a
    70,000-character string, an integer of 400 digits): the message names
    the value, it does not copy it. (The connector's options use it too.)"""
    if isinstance(value, str) and len(value) > 80:
        return repr(f"{value[:40]}... ({len(value)} characters)")
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"{text[:40]}... ({len(text)} {'digits' if isinstance(value, int) else 'characters'})"


def not_text(value: str) -> str | None:
    """Why a string cannot go to Mooncake (a C++ string, a host name, a key)
    or into a store key (``None`` when it can): a NUL ends a C string early;
    a lone surrogate (JSON's unpaired ``\\ud800``) is no text and fails
    when it is encoded."""
    if "\x00" in value:
        return "holds a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate (not text)"
    return None


def parse_size(value: Any, field: str) -> int:
    """``"4gb"``, ``"512MB"``, ``"1.5 gib"``, ``"0"`` or a plain integer, in
    whole bytes, at most `MAX_SIZE`. A fraction of a byte (``"1.5"``) and
    anything that is not a number with a unit are refused, naming the field."""
    from fractions import Fraction

    def bad(why: str) -> ValueError:
        return ValueError(f"MooncakeConfig.{field}={shown(value)}: {why}")

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise bad("expected a size like '4gb' or a whole number of bytes")
    if isinstance(value, int):
        size = Fraction(value)
    else:
        # ASCII digits only: Python's \d and int() take any script's ("١٢").
        match = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*([kmgt]?)(i?b?)\s*",
                             value.lower(), re.ASCII)
        if not match or (match.group(3) and not match.group(2) and match.group(3) != "b"):
            raise bad("expected a size like '4gb'")
        size = Fraction(match.group(1)) * _UNITS[match.group(2)]
    if size.denominator != 1:
        raise bad("not a whole number of bytes")
    if not 0 <= size <= MAX_SIZE:
        raise bad(f"expected 0 to {MAX_SIZE} bytes (1 PiB)")
    return int(size)


@attrs.frozen(slots=True)
class MooncakeConfig:
    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 256 << 20
    local_buffer_size: int = 64 << 20
    # Upstream's topology switch (vLLM's MooncakeStoreConfig, 0.32 and 0.33):
    # "embedded", each client mounts global_segment_size of store memory, or
    # "standalone-store", clients mount none and a mooncake_client process
    # owns the store's memory (`adapters.store_server`): the store outlives
    # the engines. The same rule as upstream's, so one file serves both
    # connectors.
    mode: str = "embedded"

    def __attrs_post_init__(self) -> None:
        for name in ("master_server_address", "metadata_server", "local_hostname", "protocol",
                     "device_name", "mode"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"MooncakeConfig.{name}={shown(value)}: expected a string")
            why = not_text(value)
            if why:
                raise ValueError(f"MooncakeConfig.{name}={shown(value)}: {why}")
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value <= MAX_SIZE):
                raise ValueError(f"MooncakeConfig.{name}={shown(value)}: expected 0 to {MAX_SIZE} "
                                 "bytes")
        if self.local_buffer_size == 0:
            raise ValueError("MooncakeConfig.local_buffer_size=0: the client needs a transfer "
                             "buffer (upstream refuses 0 too)")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"MooncakeConfig.protocol={shown(self.protocol)}: expected tcp or "
                             "rdma")
        if self.mode not in MODES:
            raise ValueError(f"MooncakeConfig.mode={shown(self.mode)}: expected one of "
                             f"{', '.join(MODES)}")
        if self.mode == "embedded" and self.global_segment_size <= 0:
            raise ValueError("MooncakeConfig.global_segment_size=0: mode 'embedded' needs a "
                             "segment; a store held by a mooncake_client process is mode "
                             "'standalone-store'")
        if self.mode == "standalone-store" and self.global_segment_size != 0:
            raise ValueError(f"MooncakeConfig.global_segment_size={self.global_segment_size}: "
                             "mode 'standalone-store' mounts no segment (0); the "
                             "mooncake_client process holds the store's memory")
        address = re.fullmatch(r"([^:\s]+):(\d{1,5})", self.master_server_address, re.ASCII)
        if not address or not 1 <= int(address.group(2)) <= 65535:
            raise ValueError(f"MooncakeConfig.master_server_address="
                             f"{shown(self.master_server_address)}: expected host:port with a port "
                             "in 1..65535")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> MooncakeConfig:
        # Fields vLLM's MooncakeStoreConfig reads that this client does not use.
        ignored = {"enable_offload", "tenant_id"}
        known = {f.name for f in attrs.fields(cls)} | ignored
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"{where}: field names must be strings, got {shown(key)}")
            if key not in known:
                raise ValueError(f"{where}: unknown field {shown(key)}")
        if "master_server_address" not in data:
            raise ValueError(f"{where}: field 'master_server_address' missing")
        fields = {k: v for k, v in data.items() if k not in ignored}
        try:
            for size in ("global_segment_size", "local_buffer_size"):
                if size in fields:
                    fields[size] = parse_size(fields[size], size)
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def from_env(cls) -> MooncakeConfig:
        path = os.environ.get("MOONCAKE_CONFIG_PATH")
        if not path:
            raise ValueError("MOONCAKE_CONFIG_PATH is not set")
        try:
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{path}: not a regular file (MOONCAKE_CONFIG_PATH must name "
                                 "a JSON file)")
            if info.st_size > CONFIG_FILE_LIMIT:
                raise ValueError(f"{path}: {info.st_size} bytes; a Mooncake config is at most "
                                 f"{CONFIG_FILE_LIMIT}")
            with open(path, "rb") as handle:
                raw = handle.read(CONFIG_FILE_LIMIT + 1)
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except OSError as exc:
            raise ValueError(f"{path}: cannot open ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply") from None
        except ValueError as exc:  # a key given twice; an integer past 4,300 digits
            raise ValueError(f"{path}: invalid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(data, path)


def _import_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # also raised when libibverbs1 is missing
        raise MooncakeUnavailable(
            "cannot import mooncake.store: pip install 'kvstate[mooncake]' and "
            f"apt-get install libibverbs1 libnuma1 libcurl4 ({exc})") from exc
    return MooncakeDistributedStore


# ----------------------------------------------------------------------
# Is a mooncake_master there? A TCP check, then a client's setup in a child.

# Start-up of the probe's child (Python, ``import mooncake.store``, a setup
# against a live master): 0.07-0.16 s measured here; 0.5 s leaves margin on
# a loaded machine. The child's own RPC timeouts are the probe's budget less
# this, so it answers (with Mooncake's words) just before it would be killed.
PROBE_START_S = 0.5
# The child's transfer buffer: it moves no data, and Mooncake refuses 0;
# 1 MiB is a fraction of the 16 MiB default.
PROBE_BUFFER_BYTES = 1 << 20

# The child: one setup with no segment (it mounts nothing: the master's
# metrics show no active client and no mount after it) and one try
# (``MC_STORE_CLIENT_SETUP_RETRIES``; a second try only repeats the wait). It
# leaves by ``os._exit``: ``close()`` would hold it a second or more for nothing.
_PROBE_SOURCE = """\
import os, sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup(sys.argv[2], "P2PHANDSHAKE", 0, int(sys.argv[3]), "tcp", "", sys.argv[1])
print(rc, flush=True)
os._exit(0)
"""


def _is_ha(address: str) -> bool:
    """An HA master list (``etcd://...``, several addresses) is left to the client."""
    return "://" in address or "," in address


def probe_master(address: str, timeout: float) -> None:
    """Fail at once, naming the address, when nothing accepts a TCP
    connection there (a dead address): the client's own ``setup`` retries for
    a minute or more before it gives up. Addresses that are not ``HOST:PORT``
    (an HA ``etcd://`` list) are left to the client. A port that accepts
    connections passes: `probe_master_setup` asks whether it is a master."""
    if _is_ha(address):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"master address {address!r}: expected HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ConnectionError(f"no mooncake_master reachable at {address} "
                              f"({exc.strerror or exc})") from None


def _glog_lines(stderr: bytes) -> str:
    """Mooncake's own error lines (glog), without their time and thread."""
    said = []
    for line in stderr.decode(errors="replace").splitlines():
        match = re.match(r"[EF]\d{4} [\d:.]+ +\d+ (.*)", line)
        if match and match.group(1) not in said:
            said.append(match.group(1))
    return " | ".join(said[:3]) or stderr.decode(errors="replace").strip()[-300:] or "-"


def probe_master_setup(config: MooncakeConfig, timeout: float) -> None:
    """Fail within ``timeout`` seconds, naming the address, unless a
    mooncake_master answers a client's setup at ``config.master_server_address``.

    The binding's ``setup`` holds the GIL while it retries (20 tries of up to
    30 s each against a port that accepts and never answers), so no thread
    can bound it, and Ctrl-C waits too. The setup is tried here in a child
    process instead, killed when the time is up; this process only waits on
    a pipe, which a signal interrupts. The child runs the same binding as the
    real client, so "a master" means whatever that client accepts, in any
    Mooncake version (speaking the master's RPC framing here would pin one).
    Cost: one Python start and import, ~0.1 s."""
    address = config.master_server_address
    deadline = time.monotonic() + timeout
    probe_master(address, timeout)
    if _is_ha(address):
        return
    left = max(0.0, deadline - time.monotonic())
    child_ms = str(max(100, int((left - PROBE_START_S) * 1000)))
    env = dict(os.environ, MC_LOG_LEVEL="ERROR", MC_STORE_CLIENT_SETUP_RETRIES="1",
               MC_RPC_TIMEOUT_MS=child_ms, MC_RPC_CONNECT_TIMEOUT_MS=child_ms)
    # -P: the working directory is not put on the child's path (3.11+).
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    command = [sys.executable, *safe_path, "-c", _PROBE_SOURCE, address,
               config.local_hostname, str(PROBE_BUFFER_BYTES)]
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env) as child:
        try:
            out, err = child.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise ConnectionError(
                f"no mooncake_master answered at {address} within {timeout:.3g} s: something "
                "accepts connections there, but a Mooncake client's setup got no answer "
                "(another service on that port, or a stopped master)") from None
        except BaseException:  # Ctrl-C: the child goes with us
            child.kill()
            child.wait()
            raise
    answer = out.decode(errors="replace").strip()
    if answer == "0":
        return
    what = (f"returned {answer} ({code_name(int(answer))})"
            if re.fullmatch(r"-?\d+", answer) else f"exited with {child.returncode}")
    raise ConnectionError(f"no mooncake_master at {address}: a Mooncake client's setup there "
                          f"{what} ({_glog_lines(err)})")


# ----------------------------------------------------------------------
# One client: a binding object and the thread that runs its calls.

_QUEUED, _RUNNING, _CANCELLED, _RETURNED = range(4)


class _Call:
    """One bounded call handed to a client's worker thread. A bare lock,
    released by the worker when the call returns, is the cheapest hand-off
    CPython has: a no-op call round trip measured 20 us median here, against
    61 us with a ``concurrent.futures.Future`` (which waits on a condition
    variable). ``buffers`` (the ptrs and sizes of a put or get) are what the
    call may read or write until it returns."""

    __slots__ = ("fn", "args", "what", "buffers", "value", "error", "done", "state", "late")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str,
                 buffers: tuple[list[list[int]], list[list[int]]] | None = None) -> None:
        self.fn = fn
        self.args = args
        self.what = what
        self.buffers = buffers
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()
        self.state = _QUEUED  # changed under the client's lock
        self.late = False  # its caller gave up while it ran: a straggler


class _Client:
    """One ``MooncakeDistributedStore`` and its worker thread, which runs the
    client's calls one at a time. A call whose caller gave up before it
    started never runs (it is cancelled); one that was already running is a
    straggler, and ``running`` says so until it returns."""

    def __init__(self, binding: Any, name: str, on_late_return: Callable[[], None]) -> None:
        self.binding = binding
        self.running: _Call | None = None
        self.stopped = False
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._on_late_return = on_late_return
        threading.Thread(target=self._work, daemon=True, name=name).start()

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            with self._lock:
                if call.state == _CANCELLED:
                    continue
                call.state = _RUNNING
                self.running = call
            try:
                call.value = call.fn(*call.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call.error = exc
            with self._lock:
                call.state = _RETURNED
                self.running = None
                late = call.late
            call.done.release()
            if late:
                self._on_late_return()

    def run(self, call: _Call, timeout: float) -> bool:
        """Hand ``call`` over; True once it returned, False after ``timeout``
        (then it was cancelled if it had not started, else it is late)."""
        self._calls.put(call)
        if call.done.acquire(timeout=timeout):
            return True
        with self._lock:
            if call.state == _QUEUED:
                call.state = _CANCELLED
                return False
            if call.state == _RUNNING:
                call.late = True
                return False
        call.done.acquire()  # it returned between the wait and the lock
        return True

    def busy(self) -> _Call | None:
        """The call running now (after a timeout: the straggler), if any."""
        return self.running

    def stop(self) -> None:
        """The worker ends after the call it runs, if any; nothing runs after."""
        self.stopped = True
        self._calls.put(None)


def _wait_returned(call: _Call, timeout: float | None) -> bool:
    if not call.done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
        return False
    call.done.release()  # a second waiter returns at once too
    return True


# ----------------------------------------------------------------------
# Recovery.

# Mooncake's client -> master RPC timeout: coro_rpc's 30 s default
# (``MC_RPC_TIMEOUT_MS`` overrides it; mooncake-store master_client.h).
# Measured: a call against a SIGSTOPped master returns RPC_TIMEOUT (-901)
# after 30.0 s.
RPC_TIMEOUT_S = 30.0
# How long a timed-out call may stay out before it is taken as never
# returning, in RPC timeouts: a put makes two master RPCs in a row (start,
# then end or revoke), and close() measured 61 s against a stopped master,
# two timeouts. A call out longer than that waits on something else (a
# transfer to a peer that does not answer), maybe for good.
STRAGGLER_PATIENCE_RPCS = 2
# Backoff between recovery attempts: first 1 s (a restarting master opens its
# port well under 1 s after it starts, adapters/master.py; Mooncake's own
# client pings once a second), doubling, at most 30 s (Mooncake's own RPC
# timeout: the longest it waits for a master; a master back after a long
# outage is found within that, and an absent one costs a probe process
# every 30 s, ~0.1 s of CPU).
BACKOFF_FIRST_S = 1.0
BACKOFF_FACTOR = 2.0
BACKOFF_MAX_S = 30.0


def rpc_timeout_s() -> float:
    """Mooncake's RPC timeout in this process (``MC_RPC_TIMEOUT_MS`` or 30 s)."""
    value = os.environ.get("MC_RPC_TIMEOUT_MS", "")
    return int(value) / 1000 if value.isdigit() and int(value) > 0 else RPC_TIMEOUT_S


def backoff_s(failed: int) -> float:
    """The wait after the ``failed``-th failed attempt of an episode (1, 2, 4, ... 30 s)."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * BACKOFF_FACTOR ** max(0, failed - 1))


@attrs.define
class Episode:
    """One stretch of unusability: from a call that timed out to a fresh client.

    ``client`` is the client it retires: closed once its straggler returned,
    or kept aside (never closed while a call runs in it) when given up on."""

    number: int
    cause: str
    started: float
    client: _Client | None
    next_attempt: float
    attempts: int = 0
    last_error: str | None = None
    gave_up: bool = False


class _Fence:
    """The buffers a straggler of a retired client may still write into or
    read from: no call of a fresh client may touch them until it returns, so
    two clients never use one buffer (the straggler rule). Ranges merged and
    sorted, for a bisect per buffer."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        spans = []
        if call.buffers is not None:
            for ptrs, sizes in zip(*call.buffers):
                spans += [(p, p + s) for p, s in zip(ptrs, sizes) if s > 0]
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [m[0] for m in merged]
        self.ends = [m[1] for m in merged]

    def overlaps(self, ptr: int, size: int) -> bool:
        i = bisect.bisect_left(self.starts, ptr + size) - 1
        return size > 0 and i >= 0 and self.ends[i] > ptr


class MooncakeStore:
    """One ``MooncakeDistributedStore`` with every call bounded by ``timeout``,
    and a fresh one whenever a call timed out.

    A call that outlives its bound raises ``TimeoutError`` and starts an
    *episode*: the client it ran on is done for. Until a fresh client is set
    up, calls fail at once with ``TimeoutError`` ("... recovering ...";
    nothing ran, nothing to wait for), and each one (or `recover`) starts a
    recovery attempt when one is due, on a background thread:

    1. the stuck call must have returned (the straggler rule:
       `wait_for_straggler`); after ``STRAGGLER_PATIENCE_RPCS`` RPC timeouts
       it is given up on: its client is kept aside, never closed under it,
       and its buffers are refused to the fresh client until it returns;
    2. `probe_master_setup` asks the master in a child process (setup holds
       the GIL, see there);
    3. the old client is closed (``close()`` holds the GIL: 1-2 s with a live
       master, 15 s dead, 61 s stopped, so only after a good probe), a new
       binding object is set up (its segment mounted anew) and every buffer
       `register` was given is registered on it. In mode embedded the old
       segment goes with the old client: what it held is missing afterwards,
       even when the master only stalled (a restarted master has lost it all
       anyway).

    A failed attempt waits ``backoff_s`` (1, 2, 4 ... 30 s, on ``clock``) before
    the next. Counted in ``recovery_attempts``, ``recoveries``, ``episodes``;
    ``episode`` is the current one's number (None when usable); `stats`
    has them all. Logged once when an episode starts and once when it ends.

    ``clock`` (seconds, monotonic) times the backoff and the patience, so a
    test can drive them; ``binding`` makes a client object and ``probe`` asks
    the master (defaults: Mooncake's class, `probe_master_setup`)."""

    def __init__(self, config: MooncakeConfig, timeout: float = 5.0,
                 setup_timeout: float = 30.0, *, clock: Callable[[], float] = time.monotonic,
                 binding: Callable[[], Any] | None = None,
                 probe: Callable[[MooncakeConfig, float], None] | None = None) -> None:
        self.config = config
        self.timeout = timeout
        self.setup_timeout = setup_timeout
        self.recovery_attempts = 0
        self.recoveries = 0
        self.episodes = 0
        self._clock = clock
        self._probe = probe or probe_master_setup
        self._patience = STRAGGLER_PATIENCE_RPCS * rpc_timeout_s()
        self._lock = threading.Lock()  # the fields below
        self._registry = threading.Lock()  # held by register/unregister and a swap
        self._registered: dict[int, int] = {}  # ptr -> size, for a fresh client
        self._episode: Episode | None = None
        self._attempt: threading.Thread | None = None
        self._retired: list[_Client] = []  # given up on: a call still runs in each
        self._fences: list[_Fence] = []
        self._closed = False
        deadline = time.monotonic() + setup_timeout
        if probe is None:  # a dead address fails at once, wheel or not
            probe_master(config.master_server_address, min(timeout, setup_timeout))
        self._binding = binding or _import_store()
        self._probe(config, max(0.0, deadline - time.monotonic()))
        self._client = self._set_up(max(0.0, deadline - time.monotonic()))

    # -- clients ------------------------------------------------------

    def _set_up(self, timeout: float) -> _Client:
        """A new binding object, set up (its segment mounted) within ``timeout``."""
        config = self.config
        client = _Client(self._binding(), "mooncake-calls", self._straggler_returned)
        call = _Call(client.binding.setup, (
            config.local_hostname, config.metadata_server, config.global_segment_size,
            config.local_buffer_size, config.protocol, config.device_name,
            config.master_server_address), "setup")
        if not client.run(call, timeout):
            raise TimeoutError(f"mooncake setup against {config.master_server_address} did "
                               f"not return within {timeout:g} s")
        if call.error is not None or call.value != 0:
            client.stop()  # nothing set up: nothing to close
        if call.error is not None:
            raise call.error
        if call.value != 0:
            raise ConnectionError(f"mooncake setup against {config.master_server_address} "
                                  f"returned {call.value} ({code_name(call.value)})")
        return client

    def _close_client(self, client: _Client) -> bool:
        """Close ``client`` on its own worker (after any call running there);
        False when that did not happen within ``setup_timeout``."""
        if client.stopped:
            return True
        call = _Call(client.binding.close, (), "close")
        done = client.run(call, self.setup_timeout)
        client.stop()
        return done

    @property
    def _store(self) -> Any:
        """The current binding object (benchmarks and tests call it directly)."""
        return self._client.binding

    # -- bounded calls ------------------------------------------------

    def _bounded(self, what: str, args: tuple[Any, ...], timeout: float,
                 buffers: tuple[list[list[int]], list[list[int]]] | None = None) -> Any:
        """Run the binding's ``what`` on the worker thread; give up after ``timeout``."""
        # Read after the checks: a swap sets the client before it ends the episode.
        if self._episode is not None or self._closed or self._fences:
            client = self._usable_client(what, buffers)
        else:
            client = self._client
        call = _Call(getattr(client.binding, what), args, what, buffers)
        if not client.run(call, timeout):
            self._timed_out(client, call, timeout)
        if call.error is not None:
            raise call.error
        return call.value

    def _usable_client(self, what: str, buffers: tuple[list[list[int]], list[list[int]]] | None
                       ) -> _Client:
        """The client to call, or a refusal. A refusal is a plain
        ``TimeoutError``, as every call's was once the store was broken before
        recovery existed: callers already take it as "the store failed this
        call" and count it by its class. Nothing ran, so nothing is left to
        wait for; its message says "recovering" (a stuck call's says "did not
        return")."""
        with self._lock:
            if self._closed:
                raise TimeoutError(f"mooncake store at {self.config.master_server_address} "
                                   f"is closed ({what} refused)")
            if self._episode is not None:
                self._kick()
                raise TimeoutError(self._refusal(what, self._episode))
            self._fences = [f for f in self._fences if f.call.state != _RETURNED]
            if buffers is not None:
                self._check_fences(what, *buffers)
            return self._client

    def _check_fences(self, what: str, ptrs: list[list[int]], sizes: list[list[int]]) -> None:
        for fence in self._fences:
            for key_ptrs, key_sizes in zip(ptrs, sizes):
                for ptr, size in zip(key_ptrs, key_sizes):
                    if fence.overlaps(ptr, size):
                        raise TimeoutError(
                            f"mooncake {what} refused: buffer {ptr:#x} (+{size}) is one a "
                            f"{fence.call.what} that never returned may still use; refused "
                            "until it returns")

    def _timed_out(self, client: _Client, call: _Call, timeout: float) -> None:
        ran = call.state != _CANCELLED
        cause = (f"{call.what} did not return within {timeout:g} s" if ran else
                 f"{call.what} waited {timeout:g} s behind a call that did not return")
        with self._lock:
            if self._episode is None and client is self._client and not self._closed:
                self._begin(cause, client)
        if ran:
            raise TimeoutError(f"mooncake {cause} (it may use its buffers until it returns: "
                               "wait_for_straggler)")
        raise TimeoutError(f"mooncake {cause}; it never ran")

    # -- episodes -----------------------------------------------------

    def _begin(self, cause: str, client: _Client) -> None:
        """An episode starts (``self._lock`` held)."""
        now = self._clock()
        self.episodes += 1
        self._episode = Episode(self.episodes, cause, now, client, next_attempt=now)
        logger.warning("mooncake store at %s unusable (episode %d): %s; calls fail until a "
                       "fresh client is set up", self.config.master_server_address,
                       self.episodes, cause)

    def _refusal(self, what: str, episode: Episode) -> str:
        now = self._clock()
        old = episode.client
        if self._attempt is not None:
            state = "a fresh client is being set up"
        elif old is not None and old.busy() is not None and not episode.gave_up:
            state = (f"waiting for the stuck call to return ({now - episode.started:.0f} s of "
                     f"{self._patience:.0f} s)")
        elif episode.last_error is not None:
            state = (f"attempt {episode.attempts} failed ({episode.last_error}); next in "
                     f"{max(0.0, episode.next_attempt - now):.1f} s")
        else:
            state = "an attempt is due"
        return (f"mooncake store at {self.config.master_server_address} recovering (episode "
                f"{episode.number}: {episode.cause}): {state}; {what} refused")

    def _kick(self) -> None:
        """Start a recovery attempt if one is due (``self._lock`` held)."""
        episode = self._episode
        if episode is None or self._attempt is not None or self._closed:
            return
        now = self._clock()
        if now < episode.next_attempt:
            return
        old = episode.client
        stuck = old.busy() if old is not None else None
        if stuck is not None and not episode.gave_up:
            if now - episode.started < self._patience:
                return
            episode.gave_up = True
            logger.warning("mooncake store at %s: %s did not return within %.0f s; a fresh "
                           "client takes over, and the buffers it was given are refused until "
                           "it returns", self.config.master_server_address, stuck.what,
                           self._patience)
        self._attempt = threading.Thread(target=self._recover, args=(episode,), daemon=True,
                                         name="mooncake-recovery")
        self._attempt.start()

    def _straggler_returned(self) -> None:
        """Called by a worker when a call its caller gave up on returns: the
        attempt it held back can start now, not at the next call."""
        with self._lock:
            self._kick()

    def _recover(self, episode: Episode) -> None:
        """One attempt (on its own thread): a fresh client in place, or a later attempt."""
        try:
            fresh = self._fresh_client(episode)
        except Exception as exc:  # noqa: BLE001 - counted, named, retried
            self._attempt_failed(episode, exc)
            return
        try:
            with self._registry:  # no register/unregister between these and the swap
                for ptr, size in self._registered.items():
                    self._register_on(fresh, ptr, size, self.setup_timeout)
                with self._lock:
                    if self._closed:
                        raise ConnectionError("the store was closed during recovery")
                    self._client = fresh
                    self._episode = None
                    self._attempt = None
                    episode.attempts += 1
                    self.recovery_attempts += 1
                    self.recoveries += 1
                    logger.info("mooncake store at %s recovered (episode %d): a fresh client "
                                "after %d attempt(s), %.1f s", self.config.master_server_address,
                                episode.number, episode.attempts,
                                self._clock() - episode.started)
        except Exception as exc:  # noqa: BLE001 - counted, named, retried
            self._close_client(fresh)
            self._attempt_failed(episode, exc)

    def _attempt_failed(self, episode: Episode, exc: Exception) -> None:
        with self._lock:
            self._attempt = None
            episode.attempts += 1
            self.recovery_attempts += 1
            episode.last_error = f"{type(exc).__name__}: {exc}"
            episode.next_attempt = self._clock() + backoff_s(episode.attempts)

    def _fresh_client(self, episode: Episode) -> _Client:
        """Ask the master, retire the old client, set up a new one."""
        self._probe(self.config, self.setup_timeout)
        old = episode.client
        if old is not None:
            stuck = old.busy()
            if stuck is None and not self._close_client(old):
                stuck = old.busy()
            if stuck is not None:  # given up on: kept aside, its buffers fenced
                with self._lock:
                    self._retired.append(old)
                    self._fences.append(_Fence(stuck))
            episode.client = None
        return self._set_up(self.setup_timeout)

    def recover(self, wait: float = 0.0) -> bool:
        """Start a recovery attempt if one is due and wait up to ``wait``
        seconds for it; True when the store is usable. Calls do this too,
        without waiting, and so does a stuck call when it returns; nothing
        runs on a timer, so ``clock`` alone says when an attempt is due."""
        with self._lock:
            self._kick()
            attempt = self._attempt
        if attempt is not None:
            attempt.join(wait)
        with self._lock:
            return self._episode is None and not self._closed

    @property
    def episode(self) -> int | None:
        """The current episode's number; None while the store is usable."""
        episode = self._episode
        return None if episode is None else episode.number

    @property
    def broken(self) -> str | None:
        """Why calls fail now ("closed", or the current episode's cause)."""
        if self._closed:
            return "closed"
        episode = self._episode
        return None if episode is None else episode.cause

    def stats(self) -> dict[str, int]:
        """Counters for a caller's stats (all monotonic but ``recovering``)."""
        with self._lock:
            return {"store_episodes": self.episodes,
                    "store_recovery_attempts": self.recovery_attempts,
                    "store_recoveries": self.recoveries,
                    "store_recovering": int(self._episode is not None),
                    "store_retired_clients": len(self._retired)}

    def wait_for_straggler(self, timeout: float | None = None) -> bool:
        """Wait until every call that timed out has returned (at once when
        none did): until then it may still write into the buffers it was
        handed. False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            clients = [self._client, *self._retired]
            if self._episode is not None and self._episode.client is not None:
                clients.append(self._episode.client)
        for client in clients:
            call = client.busy()
            if call is not None and call.late and not _wait_returned(
                    call, None if deadline is None else deadline - time.monotonic()):
                return False
        return True

    # -- the store's calls ----------------------------------------------

    def _register_on(self, client: _Client, ptr: int, size: int, timeout: float) -> None:
        call = _Call(client.binding.register_buffer, (ptr, size), "register_buffer")
        if not client.run(call, timeout):
            raise TimeoutError(f"mooncake register_buffer({size} bytes) did not return within "
                               f"{timeout:g} s")
        if call.error is not None:
            raise call.error
        if call.value != 0:
            raise RuntimeError(f"register_buffer({size} bytes) returned {call.value} "
                               f"({code_name(call.value)})")

    def register(self, ptr: int, size: int) -> None:
        """Register a buffer; a fresh client registers it again. While the
        store recovers it is only noted (the fresh client registers it)."""
        with self._registry:
            if self._episode is None and not self._closed:
                rc = self._bounded("register_buffer", (ptr, size), self.timeout)
                if rc != 0:
                    raise RuntimeError(f"register_buffer({size} bytes) returned {rc} "
                                       f"({code_name(rc)})")
            self._registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        """Forget a registered buffer. Required before its memory is freed: a
        later allocation at the same address could not be registered again."""
        with self._registry:
            self._registered.pop(ptr, None)
            if self._episode is None and not self._closed:
                self._bounded("unregister_buffer", (ptr,), self.timeout)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        answers = self._bounded("batch_is_exist", (list(keys),), self.timeout)
        if any(a < 0 for a in answers):
            raise ConnectionError(f"batch_is_exist failed for {sum(a < 0 for a in answers)} "
                                  f"of {len(keys)} keys")
        return [a == 1 for a in answers]

    # The binding wants plain lists (one list of buffer addresses and one of
    # sizes per key); callers build them so, and nothing is copied here.

    def put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._bounded("batch_put_from_multi_buffers", (keys, ptrs, sizes),
                                  self.timeout, (ptrs, sizes)))

    def get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._bounded("batch_get_into_multi_buffers", (keys, ptrs, sizes),
                                  self.timeout, (ptrs, sizes)))

    def close(self) -> None:
        """Idempotent; the store is unusable afterwards. A client with a call
        still running in it is not closed (its call may use its memory)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            attempt = self._attempt
        if attempt is not None:  # it sees the store closed and closes its client
            attempt.join(self.setup_timeout)
        with self._lock:
            clients = [self._client, *self._retired]
            if self._episode is not None and self._episode.client is not None:
                clients.append(self._episode.client)
        for client in dict.fromkeys(clients):
            if client.busy() is None:
                self._close_client(client)
