"""A store whose call timed out gets a fresh client back (issue 28, item 1).

Against a real ``mooncake_master`` on 127.0.0.1: a call on a stopped master
times out, and once the master answers (SIGCONT) puts and gets work again; a
master killed and restarted on its port serves again, with every old key
missing. Against a fake binding driven by a fake clock: the backoff, the
counters, one log line each way, a call that never returns (a fresh client
takes over, its buffers stay fenced), a timed-out queued call that never runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Only what the store had before recovery, up here: the real-master tests
# then fail on the old store by what it does, not by an import.
from adapters.mooncake import MooncakeConfig, MooncakeStore


def until(ok: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``ok`` (errors count as not yet) for ``within`` seconds of real time."""
    deadline = time.monotonic() + within
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except (TimeoutError, ConnectionError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {within:g} s (last error: {last})")


@pytest.fixture
def master() -> Iterator[Any]:
    if os.environ.get("KVSTATE_NO_MOONCAKE") == "1":
        pytest.skip("KVSTATE_NO_MOONCAKE=1: the real store is switched off")
    from adapters.master import Master

    started = Master()
    yield started
    if started.process.poll() is None:
        started.resume()  # a stopped master ignores SIGTERM
    started.stop()


class Buffer:
    """Registered host memory, one 4 KiB slot per value."""

    SLOT = 4096

    def __init__(self, slots: int) -> None:
        self.raw = ctypes.create_string_buffer(slots * self.SLOT)
        self.base = ctypes.addressof(self.raw)

    def ptr(self, slot: int) -> int:
        return self.base + slot * self.SLOT

    def fill(self, slot: int, byte: bytes) -> None:
        ctypes.memmove(self.ptr(slot), byte * self.SLOT, self.SLOT)

    def slot(self, slot: int) -> bytes:
        return self.raw.raw[slot * self.SLOT:(slot + 1) * self.SLOT]


def _store(master: Any, **kwargs: Any) -> MooncakeStore:
    return MooncakeStore(MooncakeConfig(master_server_address=master.address,
                                        global_segment_size=16 << 20,
                                        local_buffer_size=16 << 20), **kwargs)


def _put(store: MooncakeStore, buf: Buffer, key: str, slot: int) -> bool:
    return store.put([key], [[buf.ptr(slot)]], [[Buffer.SLOT]]) == [0]


def _missing_or_right(store: MooncakeStore, buf: Buffer, key: str, byte: bytes) -> bool:
    """Never wrong bytes: ``key`` is missing, or it reads back as ``byte``s."""
    buf.fill(3, b"\x00")
    (got,) = store.get([key], [[buf.ptr(3)]], [[Buffer.SLOT]])
    if got < 0:
        return buf.slot(3) == b"\x00" * Buffer.SLOT  # nothing written into the block
    return got == Buffer.SLOT and buf.slot(3) == byte * Buffer.SLOT


@pytest.mark.slow
@pytest.mark.mooncake
def test_a_call_on_a_stopped_master_times_out_and_the_store_recovers_once_it_answers(
        master) -> None:
    store = _store(master, timeout=1.0, setup_timeout=10.0)
    buf = Buffer(4)
    store.register(buf.base, 4 * Buffer.SLOT)
    tag = uuid.uuid4().hex[:8]
    try:
        buf.fill(0, b"a")
        assert _put(store, buf, f"{tag}-before", 0)
        master.pause()  # returns once every thread of it is stopped
        with pytest.raises(TimeoutError, match="batch_is_exist did not return within 1"):
            store.exists([f"{tag}-before"])
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"{master.address} recovering .*stuck call"):
            store.exists([f"{tag}-before"])
        assert time.monotonic() - started < 1.0  # refused at once, not after a timeout
        assert store.episode == 1
        master.resume()
        buf.fill(1, b"b")
        until(lambda: _put(store, buf, f"{tag}-after", 1), 20, "a put after SIGCONT")
        assert store.exists([f"{tag}-after"]) == [True]
        assert _missing_or_right(store, buf, f"{tag}-after", b"b")
        assert _missing_or_right(store, buf, f"{tag}-before", b"a")
        assert store.episode is None and store.recoveries == 1
        assert store.stats()["store_recovery_attempts"] >= 1
    finally:
        master.resume()
        store.close()


@pytest.mark.slow
@pytest.mark.mooncake
def test_a_master_restarted_on_its_port_serves_again_and_the_old_keys_are_missing(
        master) -> None:
    store = _store(master, timeout=1.0, setup_timeout=10.0)
    buf = Buffer(4)
    store.register(buf.base, 4 * Buffer.SLOT)
    tag = uuid.uuid4().hex[:8]
    try:
        buf.fill(0, b"o")
        assert _put(store, buf, f"{tag}-old", 0)
        master.process.kill()
        master.process.wait()
        # Against a dead master a get waits on reconnects (~4 s measured):
        # it outlives its bound, the episode the restart must end.
        timed_out = False
        deadline = time.monotonic() + 15
        while not timed_out and time.monotonic() < deadline:
            try:
                store.get([f"{tag}-old"], [[buf.ptr(2)]], [[Buffer.SLOT]])
            except TimeoutError:
                timed_out = True
        assert timed_out, "no call timed out against the dead master"
        master.restart()
        buf.fill(1, b"n")
        until(lambda: _put(store, buf, f"{tag}-new", 1), 30, "a put after the restart")
        assert store.exists([f"{tag}-old", f"{tag}-new"]) == [False, True]
        assert _missing_or_right(store, buf, f"{tag}-old", b"o")
        (got,) = store.get([f"{tag}-old"], [[buf.ptr(3)]], [[Buffer.SLOT]])
        assert got < 0  # missing, never the old bytes nor anyone else's
        assert _missing_or_right(store, buf, f"{tag}-new", b"n")
        assert store.exists([f"{tag}-new"]) == [True]
        assert store.recoveries >= 1 and store.episode is None
    finally:
        store.close()


# ----------------------------------------------------------------------
# The episode machinery, on a fake binding and a fake clock.

class FakeClock:
    """Trio's MockClock in miniature: time moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def jump(self, seconds: float) -> None:
        self.now += seconds


class World:
    """What the fake clients share: the master (up or down), a gate that
    holds calls, and a log of every call each client made."""

    def __init__(self) -> None:
        self.master_down = False
        self.hold = threading.Event()  # set: calls block until released
        self.released = threading.Event()
        self.entered = threading.Event()
        self.clients: list[FakeBinding] = []
        self.log: list[tuple[int, str, Any]] = []

    def binding(self) -> FakeBinding:
        client = FakeBinding(self, len(self.clients))
        self.clients.append(client)
        return client

    def probe(self, config: MooncakeConfig, timeout: float) -> None:
        if self.master_down:
            raise ConnectionError(f"no mooncake_master reachable at "
                                  f"{config.master_server_address}")

    def gate(self) -> None:
        if self.hold.is_set():
            self.entered.set()
            self.released.wait()


class FakeBinding:
    def __init__(self, world: World, number: int) -> None:
        self.world = world
        self.number = number
        self.registered: dict[int, int] = {}
        self.closed = False

    def _did(self, what: str, detail: Any = None) -> None:
        self.world.log.append((self.number, what, detail))

    def setup(self, *args: Any) -> int:
        self._did("setup")
        return -900 if self.world.master_down else 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self._did("register", ptr)
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self.registered.pop(ptr, None)
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._did("exists", keys)
        self.world.gate()
        return [0] * len(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], ptrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[int]:
        self._did("get", ptrs)
        self.world.gate()
        return [sum(s) for s in sizes]

    def batch_put_from_multi_buffers(self, keys: list[str], ptrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[int]:
        self._did("put", ptrs)
        self.world.gate()
        return [0] * len(keys)

    def close(self) -> int:
        self._did("close")
        self.closed = True
        return 0


def _fake_store(world: World, clock: FakeClock, timeout: float = 0.2) -> MooncakeStore:
    return MooncakeStore(MooncakeConfig(master_server_address="127.0.0.1:1"), timeout=timeout,
                         setup_timeout=5.0, clock=clock, binding=world.binding,
                         probe=world.probe)


def _stall_one_get(store: MooncakeStore, world: World, ptr: int) -> None:
    """A get that does not return within its bound (held at the gate)."""
    world.hold.set()
    with pytest.raises(TimeoutError, match="did not return within 0.2 s"):
        store.get(["k"], [[ptr]], [[4096]])
    world.hold.clear()


def test_failed_attempts_back_off_and_an_episode_is_logged_once_each_way(caplog) -> None:
    from adapters.mooncake import BACKOFF_MAX_S, backoff_s

    caplog.set_level(logging.INFO, logger="kvstate.mooncake")
    world, clock = World(), FakeClock()
    store = _fake_store(world, clock)
    store.register(0x10000, 4096)
    _stall_one_get(store, world, 0x10000)
    world.master_down = True
    world.released.set()  # the stuck get returns: an attempt starts, the master is down
    assert store.wait_for_straggler(5)
    assert not store.recover(wait=5)
    assert (store.episode, store.recovery_attempts) == (1, 1)
    waits = []
    for _ in range(8):  # the schedule, found by stepping the clock 0.5 s at a time
        attempts, waited = store.recovery_attempts, 0.0
        while store.recovery_attempts == attempts:
            with pytest.raises(TimeoutError, match="127.0.0.1:1 recovering"):
                store.exists(["k"])  # refused at once; starts an attempt when due
            assert not store.recover(wait=5)
            if store.recovery_attempts == attempts:
                clock.jump(0.5)
                waited += 0.5
        waits.append(waited)
    assert waits == [backoff_s(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert max(waits) == BACKOFF_MAX_S
    assert len(world.clients) == 1  # no client is made while the master is down
    world.master_down = False
    clock.jump(BACKOFF_MAX_S)
    assert store.recover(wait=5)
    old, fresh = world.clients
    assert old.closed and not fresh.closed and fresh.registered == {0x10000: 4096}
    order = [(n, what) for n, what, _ in world.log if what in ("close", "setup", "register")]
    assert order.index((0, "close")) < order.index((1, "setup")) < order.index((1, "register"))
    assert store.get(["k"], [[0x10000]], [[4096]]) == [4096]
    assert store.stats() == {"store_episodes": 1, "store_recovery_attempts": 10,
                             "store_recoveries": 1, "store_recovering": 0,
                             "store_retired_clients": 0}
    said = [r.getMessage() for r in caplog.records if r.name == "kvstate.mooncake"]
    assert len(said) == 2, said
    assert "unusable (episode 1): batch_get_into_multi_buffers did not return" in said[0]
    assert "recovered (episode 1): a fresh client after 10 attempt(s)" in said[1]
    store.close()


def test_a_call_that_never_returns_hands_over_to_a_fresh_client_and_its_buffers_stay_fenced(
        ) -> None:
    from adapters.mooncake import STRAGGLER_PATIENCE_RPCS, rpc_timeout_s

    world, clock = World(), FakeClock()
    store = _fake_store(world, clock)
    store.register(0x10000, 1 << 20)
    _stall_one_get(store, world, 0x10000)  # and it stays stuck: never released here
    patience = STRAGGLER_PATIENCE_RPCS * rpc_timeout_s()
    clock.jump(patience - 1)
    assert not store.recover(wait=1)
    with pytest.raises(TimeoutError, match="waiting for the stuck call to return"):
        store.exists(["k"])
    assert store.recovery_attempts == 0 and len(world.clients) == 1
    clock.jump(1)
    assert store.recover(wait=5)
    old, fresh = world.clients
    assert not old.closed  # its call still runs in it: never closed under it
    assert fresh.registered == {0x10000: 1 << 20}
    assert store.stats()["store_retired_clients"] == 1
    with pytest.raises(TimeoutError, match="never returned may still use"):
        store.get(["k"], [[0x10000 + 2048]], [[4096]])  # overlaps the stuck get's block
    with pytest.raises(TimeoutError, match="never returned may still use"):
        store.put(["k"], [[0x20000, 0x10000 - 16]], [[16, 32]])  # one buffer overlaps
    assert store.get(["k"], [[0x10000 + 4096]], [[4096]]) == [4096]  # the next block: fine
    assert store.put(["k"], [[0x10000 - 16]], [[16]]) == [0]  # ends where the fence starts
    assert not store.wait_for_straggler(0.05)
    world.released.set()
    assert store.wait_for_straggler(5)
    assert store.get(["k"], [[0x10000]], [[4096]]) == [4096]  # the fence is lifted
    gets = [(n, ptrs) for n, what, ptrs in world.log if what == "get"]
    assert gets[0] == (0, [[0x10000]])  # the stuck one, on the old client only
    assert all(n == 1 for n, _ in gets[1:])
    store.close()
    assert old.closed and fresh.closed  # its call returned: closed with the store


def test_a_call_that_timed_out_in_the_queue_never_runs() -> None:
    """Behind a stuck call, a second caller gives up before its call started:
    that call is dropped, so it never writes into blocks its caller reused."""
    world, clock = World(), FakeClock()
    store = _fake_store(world, clock, timeout=1.0)
    world.hold.set()
    raised: list[BaseException] = []

    def stuck_get() -> None:
        try:
            store.get(["a"], [[0x1000]], [[4096]])
        except TimeoutError as exc:
            raised.append(exc)

    stuck = threading.Thread(target=stuck_get)
    stuck.start()
    assert world.entered.wait(5)
    with pytest.raises(TimeoutError, match="it never ran"):
        store.get(["b"], [[0x9000]], [[4096]])
    stuck.join(5)
    assert "did not return within 1 s" in str(raised[0])
    world.hold.clear()
    world.released.set()
    assert store.wait_for_straggler(5)
    assert store.recover(wait=5)
    time.sleep(0.1)  # the old worker had its chance to run anything still queued
    assert [(n, p) for n, what, p in world.log if what == "get"] == [(0, [[0x1000]])]
    store.close()
