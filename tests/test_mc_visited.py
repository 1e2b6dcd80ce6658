"""The model checker's packed visited table (`sim.explore.modelcheck.visited`) behaves as the
dict of key -> (parent key, action) and the key list it replaced."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.explore.modelcheck.model import path_to
from sim.explore.modelcheck.visited import START_SLOTS, KeySet, Visited

ACTIONS = [("step",), ("rank", 0, "ok"), ("rank", 1, "-200"), ("evict", "k"), ("quiesce",)]


def _key(n: int) -> bytes:
    return hashlib.blake2b(str(n).encode(), digest_size=16).digest()


def _same_as_model(table: Visited, model: dict, order: list) -> None:
    assert len(table) == len(model)
    assert list(table) == order
    for key, link in model.items():
        assert key in table
        assert table[key] == link
    assert _key(-1) not in table
    with pytest.raises(KeyError):
        table[_key(-1)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.sampled_from(ACTIONS)),
                max_size=120))
def test_reaching_keys_matches_a_dict(steps) -> None:
    """Keys from a small pool, so many are reached twice (the first way in
    counts, as in the breadth-first merge)."""
    table, model, order = Visited(), {}, []
    root = _key(1000)
    table.reach(root)
    model[root], order = None, [root]
    for child, parent, action in steps:
        key, via = _key(child), _key(parent)
        if via not in model:
            via = root
        new = key not in model
        assert table.reach(key, via, action) is new
        if new:
            model[key] = (via, action)
            order.append(key)
    _same_as_model(table, model, order)
    _same_as_model(pickle.loads(pickle.dumps(table)), model, order)


def test_a_table_past_many_growths_keeps_every_key_path_and_order() -> None:
    n = START_SLOTS * 9  # four doublings
    keys = [_key(i) for i in range(n)]
    table, model = Visited(), {keys[0]: None}
    table.reach(keys[0])
    for i in range(1, n):
        link = (keys[(i - 1) // 3], ACTIONS[i % len(ACTIONS)])
        table.reach(keys[i], *link)
        model[keys[i]] = link
    _same_as_model(table, model, keys)
    for key in keys[::997]:
        assert path_to(table, key) == path_to(model, key)
    loaded = pickle.loads(pickle.dumps(table))
    assert path_to(loaded, keys[-1]) == path_to(model, keys[-1])
    copied = table.copy()
    copied.reach(_key(-5), keys[0], ACTIONS[0])
    assert _key(-5) in copied and _key(-5) not in table


def test_a_worker_learns_keys_from_the_packed_slices_it_is_sent() -> None:
    """The driver sends the keys merged since the last call as one packed
    slice; the worker's set then knows exactly those keys."""
    driver, worker = Visited(), KeySet()
    driver.reach(_key(0))
    told = 0
    for level in range(1, 6):
        for i in range(level * 300, level * 300 + 250):
            driver.reach(_key(i), _key(0), ACTIONS[0])
        worker.add_packed(driver.packed_from(told))
        told = len(driver)
        assert len(worker) == len(driver) and list(worker) == list(driver)
    assert all(key in worker for key in driver)
    assert _key(5) not in worker


@pytest.mark.parametrize("bad,message", [
    (b"short", "16 bytes, not 5"),
    (b"x" * 17, "16 bytes, not 17"),
])
def test_a_key_of_another_width_is_refused(bad: bytes, message: str) -> None:
    table = Visited()
    with pytest.raises(ValueError, match=message):
        table.reach(bad)
    assert bad not in table  # membership of a foreign key is simply False


def test_damaged_packed_keys_and_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="whole 16-byte keys, not 20 bytes"):
        KeySet().add_packed(b"k" * 20)
    table = Visited()
    table.reach(_key(0))
    keys, parents, action_of, actions = table.__getstate__()
    with pytest.raises(ValueError, match="1 keys with 0 parents"):
        Visited().__setstate__((keys, b"", action_of, actions))
    with pytest.raises(ValueError, match="not a packed key table"):
        Visited().__setstate__(((keys[0] + b"xx", keys[1]), parents, action_of, actions))
    with pytest.raises(ValueError, match="not a packed key table"):
        Visited().__setstate__(((keys[0], b""), parents, action_of, actions))
