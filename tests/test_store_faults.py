"""The simulated store fails the way Mooncake's store does.

Each new fault site of `sim.simulator.faults` as a scenario: first the store alone
keeping its contract (a restart loses every object and takes puts right
after; a get whose lease ran out answers -707; a put whose client went
silent after its PutStart holds the key for 30 s, then a put preempts it),
then the protocol on top of it: the default protocol keeps every invariant,
and an existing variant that mishandles the failure is caught where one
exists. Faults fire where a scenario says (`Scripted`), or at a fixed rate on
every visit in whole simulator runs (`swarm`), instead of the seed's draw.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Sequence

import pytest

import sim.simulator.runner
from kvstate.config import ConnectorConfig
from kvstate.harness import Harness
from kvstate.observations import KeyEvicted, LoadDone
from kvstate.scenarios import prompt
from sim.simulator.faults import SITES, Faults
from sim.simulator.kernel import Kernel
from sim.simulator.runner import SimOptions, simulate
from sim.simulator.store import (
    GET_CODES,
    LEASE_EXPIRED,
    OBJECT_NOT_FOUND,
    PUT_CODES,
    PUT_START_DISCARD_TIMEOUT,
    REPLICA_IS_NOT_READY,
    SimStore,
)

NEW_SITES = ("master_restart", "lease_expired", "get_error", "put_codes", "put_preempted")


class _Pick:
    """The code a site that draws one answers: the scenario's (None: the first)."""

    def __init__(self, code: int | None) -> None:
        self.code = code

    def choice(self, codes: Sequence[int]) -> int:
        assert self.code is None or self.code in codes, (self.code, codes)
        return codes[0] if self.code is None else self.code


class Scripted(Faults):
    """Faults that fire where the scenario says: per site, the visits (from
    0) it fires on, or None for every visit; ``code`` is what a site that
    draws a code answers."""

    def __init__(self, fires: dict[str, Collection[int] | None] | None = None,
                 code: int | None = None) -> None:
        super().__init__(random.Random(0), sites=())
        self.fires = fires or {}
        self.visits: Counter[str] = Counter()
        self.rng = _Pick(code)  # type: ignore[assignment]

    def fire(self, site: str) -> bool:
        if site not in self.fires or not self.enabled:
            return False
        visit = self.visits[site]
        self.visits[site] += 1
        when = self.fires[site]
        if when is None or visit in when:
            self.fired[site] += 1
            return True
        return False


def store_with(faults: Faults | None = None, capacity: int = 64) -> tuple[SimStore, list[str]]:
    """A simulated store on a kernel of its own; the keys it told as lost."""
    told: list[str] = []
    return SimStore(Kernel(0), faults or Scripted(), capacity, told.append), told


def later(store: SimStore, seconds: float) -> None:
    """Let ``seconds`` of virtual time pass."""
    kernel = store.kernel
    kernel.schedule(seconds, lambda: None)
    kernel.run()


def harness_on(store: SimStore, variant: str, world_size: int = 1) -> Harness:
    """An engine on the simulated store; what the store loses is told to its
    monitor as an eviction, as the simulator does."""
    config = ConnectorConfig(block_size=4, world_size=world_size, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32, store=store)
    store.on_evict = lambda key: h.observe(KeyEvicted(key))
    return h


def load_reports(h: Harness) -> list[LoadDone]:
    return [obs for obs in h.log if isinstance(obs, LoadDone)]


def invariants(h: Harness) -> set[str]:
    return {f.invariant for f in h.monitor.findings}


def test_every_new_site_is_listed_with_a_description() -> None:
    for site in NEW_SITES:
        assert SITES[site]


# ---------------------------------------------------------------------------
# master_restart


def test_a_master_restart_loses_every_object_and_the_store_takes_puts_right_after() -> None:
    store, told = store_with()
    keys = ["k2", "k0", "k1"]
    assert store.put_many(0, keys, [0] * 3, [1, 2, 3], ["c2", "c0", "c1"]) == [(0, True)] * 3
    store.start_puts(["k9"])  # a put in progress is lost with the rest

    store.restart_master()

    assert store.objects == {} and store.put_started == {}
    assert told == sorted(keys)  # each lost key told, as an eviction is
    assert (store.restarts, store.lost_to_restarts) == (1, 3)
    assert store.exists(0, keys + ["k9"]) == [False] * 4
    assert store.read(0, "k0") == (OBJECT_NOT_FOUND, None)
    # The clients remounted: the next puts store, the one in progress included.
    assert store.put_many(0, ["k0", "k9"], [0, 0], [1, 2], ["c0", "c9"]) == [(0, True)] * 2
    assert store.read(0, "k9") == (0, "c9")


class RestartsBeforeTheFirstGet(SimStore):
    """The master restarts after the lookup found the prompt and before the
    first get reads it."""

    def read(self, rank: int, key: str) -> tuple[int, str | None]:
        if not self.restarts:
            self.restart_master()
        return super().read(rank, key)


def restart_between_lookup_and_get(variant: str) -> tuple[Harness, SimStore]:
    """Request "a" stores a 12-token prompt; "b" with the same prompt finds
    it, and the master restarts before b's gets: every get answers -704."""
    told: list[str] = []
    store = RestartsBeforeTheFirstGet(Kernel(0), Scripted(), 64, told.append)
    h = harness_on(store, variant)
    h.add("a", prompt(12))
    h.settle()
    stored = set(store.objects)
    h.add("b", prompt(12), lookup=True)
    h.settle()
    evicted = {obs.key for obs in h.log if isinstance(obs, KeyEvicted)}
    assert store.restarts == 1 and stored and evicted == stored
    return h, store


def test_a_restart_between_lookup_and_get_is_recomputed_and_the_prompt_stored_again() -> None:
    h, store = restart_between_lookup_and_get("kvstate")
    (load,) = load_reports(h)
    assert load.failed_block_ids and load.reported_block_ids == load.failed_block_ids
    assert h.monitor.findings == []
    assert "b" in h.finished
    assert store.objects  # b's saves put the prompt back after the restart


def test_a_protocol_that_swallows_the_failed_gets_after_a_restart_is_caught() -> None:
    h, _ = restart_between_lookup_and_get("swallow-load-errors")
    assert "S19" in invariants(h)


# ---------------------------------------------------------------------------
# lease_expired and get_error


def test_a_get_whose_lease_ran_out_answers_707_and_the_object_stays() -> None:
    store, _ = store_with(Scripted({"lease_expired": {0}}))
    store.put(0, "k", "c")
    assert store.exists(0, ["k"]) == [True]  # the existence check leases it
    assert store.read(0, "k") == (LEASE_EXPIRED, None)  # the get outlived its lease
    assert store.read(0, "k") == (0, "c")  # a second get takes a fresh lease
    # A key the store does not hold grants no lease: -704, the site not visited.
    assert store.read(0, "gone") == (OBJECT_NOT_FOUND, None)
    assert store.faults.visits["lease_expired"] == 2


@pytest.mark.parametrize("code", GET_CODES)
def test_a_failed_get_answers_its_code_and_the_object_stays(code: int) -> None:
    store, _ = store_with(Scripted({"get_error": {0}}, code=code))
    store.put(0, "k", "c")
    assert store.read(0, "k") == (code, None)
    assert store.get(0, "k") == "c"


def failing_gets(site: str, code: int | None, variant: str) -> Harness:
    """As the scripted load-evicted scenario, the gets failing with a store
    code while the store still holds every key: "a" stores a 12-token
    prompt on two ranks, "b" finds it and loads it, every get of b failing."""
    store, _ = store_with(Scripted({site: None}, code=code))
    h = harness_on(store, variant, world_size=2)
    h.add("a", prompt(12))
    h.settle()
    h.add("b", prompt(12), lookup=True)
    h.settle()
    assert store.faults.fired[site] > 0 and store.objects
    return h


GET_FAILURES = [("lease_expired", None)] + [("get_error", code) for code in GET_CODES]


@pytest.mark.parametrize(("site", "code"), GET_FAILURES)
def test_failed_gets_are_reported_and_recomputed(site: str, code: int | None) -> None:
    h = failing_gets(site, code, "kvstate")
    loads = load_reports(h)
    assert loads and all(d.failed_block_ids == d.reported_block_ids != () for d in loads)
    assert h.monitor.findings == []
    assert "b" in h.finished


@pytest.mark.parametrize(("site", "code"), GET_FAILURES)
def test_a_protocol_that_treats_a_failed_get_as_loaded_is_caught(site: str,
                                                                  code: int | None) -> None:
    assert "S19" in invariants(failing_gets(site, code, "swallow-load-errors"))


# ---------------------------------------------------------------------------
# put_codes


@pytest.mark.parametrize("code", PUT_CODES)
def test_a_put_answering_a_failure_code_stores_nothing(code: int) -> None:
    store, _ = store_with(Scripted({"put_codes": {0}}, code=code))
    assert store.put_many(0, ["k0", "k1"], [0, 0], [1, 2], ["c0", "c1"]) == [
        (code, False), (0, True)]
    assert store.exists(0, ["k0", "k1"]) == [False, True]


def middle_put_fails(code: int, variant: str) -> tuple[Harness, SimStore]:
    """As the scripted partial-put-failure scenario: the middle chunk's put
    answers ``code`` once; the next decode job must retry it from the rank's
    saved offset."""
    store, _ = store_with(Scripted({"put_codes": {1}}, code=code))
    config = ConnectorConfig(block_size=4, save_decode_cache=True, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32, store=store)
    h.add("a", prompt(12), max_new_tokens=8)
    h.settle()
    return h, store


@pytest.mark.parametrize("code", PUT_CODES)
def test_a_chunk_whose_put_failed_is_retried_and_stored(code: int) -> None:
    h, store = middle_put_fails(code, "kvstate")
    assert h.monitor.findings == []
    assert len(store.objects) == 4  # 12 prompt and 8 decode tokens: 4 full chunks saved


@pytest.mark.parametrize("code", PUT_CODES)
def test_a_protocol_that_advances_its_offset_past_the_failed_put_is_caught(code: int) -> None:
    h, _ = middle_put_fails(code, "advance-offset-on-failure")
    assert "S10" in invariants(h)


# ---------------------------------------------------------------------------
# put_preempted


def test_a_put_in_progress_holds_its_key_until_a_put_preempts_it_after_30s() -> None:
    store, _ = store_with()
    store.put(0, "old", "c")
    store.start_puts(["k", "old"])  # PutStart of a stored key starts nothing
    assert store.put_started == {"k": 0.0}
    # No readable replica: absent to an existence check, -703 to a get.
    assert store.exists(0, ["k"]) == [False]
    assert store.read(0, "k") == (REPLICA_IS_NOT_READY, None)
    # Within the discard timeout a put answers 0 (the master's
    # OBJECT_ALREADY_EXISTS, which the client reports as success) and stores nothing.
    later(store, PUT_START_DISCARD_TIMEOUT)
    assert store.put(1, "k", "mine") == (0, False)
    assert "k" not in store.objects and store.preempted_puts == 0
    # Past it, the next put preempts the silent one and stores the key.
    later(store, 0.5)
    assert store.put(1, "k", "mine") == (0, True)
    assert store.read(0, "k") == (0, "mine")
    assert store.preempted_puts == 1 and store.put_started == {}


def stored_keys(prompt_tokens: list[int]) -> list[str]:
    """The keys two ranks store for a prompt on a store of their own."""
    store, _ = store_with()
    h = harness_on(store, "kvstate", world_size=2)
    h.add("a", prompt_tokens)
    h.settle()
    return sorted(store.objects)


def test_puts_into_keys_in_progress_store_nothing_and_break_no_invariant() -> None:
    """Another client's puts of a prompt went silent after their PutStarts.
    A request with that prompt misses (nothing readable), computes, and its
    ranks' puts answer 0 and store nothing: they report the chunks stored and
    the events are published; the protocol cannot tell. Once the silent puts
    are past the discard timeout, the next request's puts store the prompt."""
    keys = stored_keys(prompt(12))
    store, _ = store_with()
    store.start_puts(keys)
    h = harness_on(store, "kvstate", world_size=2)
    h.add("b", prompt(12), lookup=True)
    h.settle()
    assert store.objects == {} and h.published_count > 0
    later(store, PUT_START_DISCARD_TIMEOUT + 1)
    h.add("c", prompt(12), lookup=True)
    h.settle()
    assert sorted(store.objects) == keys and store.preempted_puts == len(keys)
    assert h.monitor.findings == []


# ---------------------------------------------------------------------------
# Whole simulator runs: each new site on at a fixed rate, nothing else.


def swarm(monkeypatch: pytest.MonkeyPatch, rates: dict[str, float]) -> None:
    """Every run switches on exactly these sites at these rates, instead of
    the swarm the seed draws."""

    def fixed(rng: random.Random, sites: Collection[str] = SITES,
              activation: float = 0.0) -> Faults:
        faults = Faults(rng, sites=())
        faults.configured = tuple(sites)
        faults.rates = dict(rates)
        return faults

    monkeypatch.setattr(sim.simulator.runner, "Faults", fixed)


@pytest.mark.parametrize("site", NEW_SITES)
@pytest.mark.parametrize("setup", ["both", "pd"])
def test_the_default_protocol_keeps_every_invariant_with_the_site_on(
        monkeypatch: pytest.MonkeyPatch, site: str, setup: str) -> None:
    swarm(monkeypatch, {site: 0.1})
    result = simulate(SimOptions(requests=60, setup=setup, faults=(site,)))
    assert result.fault_fired.get(site, 0) > 0
    assert result.ok, (result.findings[:3], result.options.command())
    assert result.figures["liveness_ok"]


def test_a_restart_run_tells_each_lost_key_in_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import json

    swarm(monkeypatch, {"master_restart": 0.05})
    out = io.StringIO()
    result = simulate(SimOptions(requests=60, faults=("master_restart",)), trace=out)
    figures = result.figures
    evicted = sum(1 for line in out.getvalue().splitlines()[1:]
                  if json.loads(line)["type"] == "KeyEvicted")
    assert figures["store_restarts"] > 0 and figures["store_lost_to_restarts"] > 0
    assert evicted == figures["store_evictions"] + figures["store_lost_to_restarts"]
    assert result.ok


def test_a_protocol_without_a_call_timeout_hangs_on_a_silent_put(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream (e2) has no bound on a store call: a put that went silent
    after its PutStart holds the rank, and its pins, for ever (S6); kvstate
    times the call out and retries the range."""
    swarm(monkeypatch, {"put_preempted": 0.01})
    upstream = simulate(SimOptions(requests=60, faults=("put_preempted",), protocol="e2"),
                        stop_at_first=False)
    assert upstream.figures["hung_calls"] > 0
    assert "S6" in upstream.figures["violations_by_invariant"]
    kvstate = simulate(SimOptions(requests=60, faults=("put_preempted",)))
    assert kvstate.ok and kvstate.figures["hung_calls"] == 0
