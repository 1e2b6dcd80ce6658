"""A Mooncake store client configured like vLLM's connector, with bounded calls.

Configuration comes from the JSON file named by ``MOONCAKE_CONFIG_PATH`` (the
keys vLLM's connector reads: ``metadata_server``, ``master_server_address``,
``protocol`` tcp|rdma, ``device_name``, ``global_segment_size``,
``local_buffer_size`` with "4gb"-style sizes) or from explicit fields.

Every store call runs on a worker thread and is bounded by ``timeout``
seconds: upstream has no bound, so a hung master pins engine blocks forever
(S6). A call that times out raises ``TimeoutError`` — the
executor then reports its job failed and its pins are released — and the
client is marked broken, because the stuck call still owns the connection.
Failures are return codes, named by ``code_name`` (`kvstate.store_codes`).
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from kvstate.store_codes import code_name

T = TypeVar("T")



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


def parse_size(value: Any, field: str) -> int:
    """``"4gb"``, ``"512MB"``, ``"1.5 gib"``, ``"0"`` or a plain integer, in
    whole bytes, at most `MAX_SIZE`. A fraction of a byte (``"1.5"``) and
    anything that is not a number with a unit are refused, naming the field."""
    from fractions import Fraction

    def bad(why: str) -> ValueError:
        return ValueError(f"MooncakeConfig.{field}={value!r}: {why}")

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise bad("expected a size like '4gb' or a whole number of bytes")
    if isinstance(value, int):
        size = Fraction(value)
    else:
        match = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*([kmgt]?)(i?b?)\s*",
                             value.lower())
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
                raise ValueError(f"MooncakeConfig.{name}={value!r}: expected a string")
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value <= MAX_SIZE):
                raise ValueError(f"MooncakeConfig.{name}={value!r}: expected 0 to {MAX_SIZE} "
                                 "bytes")
        if self.local_buffer_size == 0:
            raise ValueError("MooncakeConfig.local_buffer_size=0: the client needs a transfer "
                             "buffer (upstream refuses 0 too)")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"MooncakeConfig.protocol={self.protocol!r}: expected tcp or rdma")
        if self.mode not in MODES:
            raise ValueError(f"MooncakeConfig.mode={self.mode!r}: expected one of "
                             f"{', '.join(MODES)}")
        if self.mode == "embedded" and self.global_segment_size <= 0:
            raise ValueError("MooncakeConfig.global_segment_size=0: mode 'embedded' needs a "
                             "segment; a store held by a mooncake_client process is mode "
                             "'standalone-store'")
        if self.mode == "standalone-store" and self.global_segment_size != 0:
            raise ValueError(f"MooncakeConfig.global_segment_size={self.global_segment_size}: "
                             "mode 'standalone-store' mounts no segment (0); the "
                             "mooncake_client process holds the store's memory")
        address = re.fullmatch(r"([^:\s]+):(\d{1,5})", self.master_server_address)
        if not address or not 1 <= int(address.group(2)) <= 65535:
            raise ValueError(f"MooncakeConfig.master_server_address="
                             f"{self.master_server_address!r}: expected host:port with a port "
                             "in 1..65535")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> MooncakeConfig:
        # Fields vLLM's MooncakeStoreConfig reads that this client does not use.
        ignored = {"enable_offload", "tenant_id"}
        known = {f.name for f in attrs.fields(cls)} | ignored
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"{where}: field names must be strings, got {key!r}")
            if key not in known:
                raise ValueError(f"{where}: unknown field {key!r}")
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
            data = json.loads(raw.decode("utf-8"))
        except OSError as exc:
            raise ValueError(f"{path}: cannot open ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply") from None
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


class _Call:
    """One bounded call handed to the worker thread. A bare lock, released by
    the worker when the call returns, is the cheapest hand-off CPython has: a
    no-op call round trip measured 20 us median here, against 61 us with a
    ``concurrent.futures.Future`` (which waits on a condition variable)."""

    __slots__ = ("fn", "value", "error", "done")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()


def probe_master(address: str, timeout: float) -> None:
    """Fail at once, naming the address, when no master listens there: the
    client's own ``setup`` retries for a minute or more before it gives up.
    Addresses that are not ``HOST:PORT`` (an HA ``etcd://`` list) are left to
    the client."""
    if "://" in address or "," in address:
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


class MooncakeStore:
    """One ``MooncakeDistributedStore`` with every call bounded by ``timeout``."""

    def __init__(self, config: MooncakeConfig, timeout: float = 5.0,
                 setup_timeout: float = 30.0) -> None:
        self.config = config
        self.timeout = timeout
        self.broken: str | None = None
        # The call that outlived its bound: it may still write into the
        # buffers it was given (a get) until it returns (`wait_for_straggler`).
        self._straggler: _Call | None = None
        probe_master(config.master_server_address, min(timeout, setup_timeout))
        self._store = _import_store()()
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        threading.Thread(target=self._worker, daemon=True, name="mooncake-calls").start()
        rc = self._bounded(lambda: self._store.setup(
            config.local_hostname, config.metadata_server, config.global_segment_size,
            config.local_buffer_size, config.protocol, config.device_name,
            config.master_server_address), setup_timeout, "setup")
        if rc != 0:
            raise ConnectionError(f"mooncake setup against {config.master_server_address} "
                                  f"returned {rc} ({code_name(rc)})")

    def _worker(self) -> None:
        while True:
            call = self._calls.get()
            try:
                call.value = call.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call.error = exc
            call.done.release()

    def _bounded(self, call: Callable[[], T], timeout: float, what: str) -> T:
        """Run ``call`` on the store's worker thread; give up after ``timeout``.
        One long-lived worker (not a thread per call) keeps the bound cheap."""
        if self.broken is not None:
            raise TimeoutError(f"mooncake store unusable: {self.broken}")
        pending = _Call(call)
        self._calls.put(pending)
        if not pending.done.acquire(timeout=timeout):
            self.broken = f"{what} did not return within {timeout}s"
            self._straggler = pending
            raise TimeoutError(f"mooncake {what} did not return within {timeout}s")
        if pending.error is not None:
            raise pending.error
        return pending.value

    def wait_for_straggler(self, timeout: float | None = None) -> bool:
        """Wait until the call that timed out has returned (at once when none
        did): until then it may still write into the buffers it was handed.
        False when ``timeout`` passed first."""
        straggler = self._straggler
        if straggler is None:
            return True
        if not straggler.done.acquire(timeout=-1 if timeout is None else timeout):
            return False
        straggler.done.release()  # a second waiter returns at once too
        return True

    def register(self, ptr: int, size: int) -> None:
        rc = self._bounded(lambda: self._store.register_buffer(ptr, size), self.timeout,
                           "register_buffer")
        if rc != 0:
            raise RuntimeError(f"register_buffer({size} bytes) returned {rc} ({code_name(rc)})")

    def unregister(self, ptr: int) -> None:
        """Forget a registered buffer. Required before its memory is freed: a
        later allocation at the same address could not be registered again."""
        self._bounded(lambda: self._store.unregister_buffer(ptr), self.timeout,
                      "unregister_buffer")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        answers = self._bounded(lambda: self._store.batch_is_exist(list(keys)), self.timeout,
                                "batch_is_exist")
        if any(a < 0 for a in answers):
            raise ConnectionError(f"batch_is_exist failed for {sum(a < 0 for a in answers)} "
                                  f"of {len(keys)} keys")
        return [a == 1 for a in answers]

    # The binding wants plain lists (one list of buffer addresses and one of
    # sizes per key); callers build them so, and nothing is copied here.

    def put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._bounded(
            lambda: self._store.batch_put_from_multi_buffers(keys, ptrs, sizes),
            self.timeout, "batch_put_from_multi_buffers"))

    def get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._bounded(
            lambda: self._store.batch_get_into_multi_buffers(keys, ptrs, sizes),
            self.timeout, "batch_get_into_multi_buffers"))

    def close(self) -> None:
        """Idempotent; the client is unusable afterwards."""
        if self.broken is None:
            self._store.close()
            self.broken = "closed"
