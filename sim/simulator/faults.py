"""Fault sites, BUGGIFY style (FoundationDB's simulation testing).

Every site is *activated* for a run with one probability and, when active,
*fires* on each visit with a rate drawn from a small menu — both from the
run's seed — so each seed is a different "swarm" of faults (Groce et al.,
"Swarm Testing", ISSTA 2012: varying which faults are on finds more bugs than
turning all of them on at once). The configuration is printed at the start of
a run and every site counts how often it fired; a campaign fails when a site
it was asked to exercise never fired.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

SITES: dict[str, str] = {
    "preempt": "the engine preempts its newest running request this step",
    "id_reuse": "a client resubmits a request id that just finished",
    "put_pressure": "a put answers -200 (store full)",
    "put_error": "a put answers -800 (transfer failure)",
    "put_raise": "a put raises",
    "exists_raise": "an existence check raises",
    "store_slow": "a store call takes 50x its usual latency",
    "store_hang": "a store call hangs (until the timeout, if the protocol has one)",
    "evict": "the store evicts its oldest key",
    "rank_stall": "a rank's send thread stalls for a while",
    # Mooncake's own failure modes (mooncake-store docs and source; sim/simulator/store.py).
    "master_restart": "the master restarts: every object is lost at once, puts work again "
                      "right after (clients remount)",
    "lease_expired": "a get of a key the store holds answers -707 (its lease ran out "
                     "before the transfer ended)",
    "get_error": "a get answers -800, -801, -900 or -901",
    "put_codes": "a put answers -704, -900 or -901",
    "put_preempted": "a put hangs after its PutStart: its keys stay puts in progress (absent "
                     "to lookups; a put of one answers 0, stores nothing) until a put 30s "
                     "later preempts it",
}

# Per-visit firing rates a site may draw; rare to frequent.
RATES = (0.002, 0.01, 0.03, 0.1)
ACTIVATION = 0.6


class Faults:
    def __init__(self, rng: random.Random, sites: Iterable[str] = SITES,
                 activation: float = ACTIVATION) -> None:
        self.rng = rng
        self.rates: dict[str, float] = {}
        for site in sites:
            if site not in SITES:
                raise ValueError(f"unknown fault site {site!r}; known: {', '.join(SITES)}")
            active = rng.random() < activation
            rate = rng.choice(RATES)
            if active:
                self.rates[site] = rate
        self.configured = tuple(sites)
        self.fired: Counter[str] = Counter()
        self.enabled = True

    def fire(self, site: str) -> bool:
        rate = self.rates.get(site)
        if rate is None or not self.enabled:
            return False
        if self.rng.random() < rate:
            self.fired[site] += 1
            return True
        return False

    def fire_any(self, site: str, visits: int) -> bool:
        """``visits`` visits of ``site`` in a row, up to the first that fires:
        whether one did. The draws are exactly those of as many `fire` calls
        stopping there (the same seed gives the same run), in one loop: an
        existence check of 80 keys is 80 visits."""
        rate = self.rates.get(site)
        if rate is None or not self.enabled:
            return False
        draw = self.rng.random
        for _ in range(visits):
            if draw() < rate:
                self.fired[site] += 1
                return True
        return False
