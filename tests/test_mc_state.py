"""The compact engine's stored states (`sim.explore.modelcheck.state`): what every state of a
search shares is written once as a reference to the search's initial state,
and a loaded state is still, field for field, the state that was stored."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest

from sim.explore.modelcheck import compact as mc_compact
from sim.explore.modelcheck import state as mc_state
from sim.explore.modelcheck.compact import check_compact, fast_digest
from sim.explore.modelcheck.model import SCOPES, _symmetric, apply, enabled, random_walk
from sim.explore.modelcheck.search import check
from sim.explore.modelcheck.state import SharedStateChanged, _fields, codec_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _codec_walks(seeds: int, steps: int = 40):
    """Every scope, ``seeds`` random walks that start from the codec's
    template as the engine does: yields (scope name, codec, state)."""
    for name, scope in SCOPES.items():
        codec = codec_for(scope, "kvstate", True, None)
        for seed in range(seeds):
            start = codec.loads(codec.dumps(codec.template))
            for s in random_walk(scope, seed, steps, start=start):
                yield name, codec, s


def _same(a, b, pairs=None) -> str | None:
    """Where the object graphs ``a`` and ``b`` differ (a path), or None:
    same types, equal values, dicts with the same keys in the same order,
    objects with the same fields, shared structure where ``a`` shares it.
    Equal strings that are one object in one and two in the other are the
    same here (pickle's own copies differ that way too)."""
    pairs = {} if pairs is None else pairs
    stack = [(a, b, "state")]
    while stack:
        x, y, path = stack.pop()
        if type(x) is not type(y):
            return f"{path}: {type(x).__name__} against {type(y).__name__}"
        if isinstance(x, (str, bytes, int, float, bool, type(None), frozenset, set)):
            if x != y:
                return f"{path}: {x!r} against {y!r}"
            continue
        if callable(x) and not hasattr(x, "__dict__") and not hasattr(x, "__func__") \
                and not hasattr(type(x), "__slots__") or isinstance(x, type):
            if x is not y:
                return f"{path}: {x!r} against {y!r}"
            continue
        if id(x) in pairs:
            if pairs[id(x)][1] is not y:
                return f"{path}: shared in one state, not in the other"
            continue
        pairs[id(x)] = (x, y)  # both kept alive: no id is reused meanwhile
        if hasattr(x, "__func__"):  # a bound method
            if x.__func__ is not y.__func__:
                return f"{path}: another method"
            stack.append((x.__self__, y.__self__, path + ".__self__"))
        elif isinstance(x, dict):  # keys in order, then values
            if len(x) != len(y):
                return f"{path}: {len(x)} keys against {len(y)}"
            for (kx, vx), (ky, vy) in zip(x.items(), y.items()):
                stack.append((vx, vy, f"{path}[{kx!r}]"))
                stack.append((kx, ky, f"{path} key {kx!r}"))
        elif isinstance(x, (list, tuple)) or type(x).__name__ == "deque":
            if len(x) != len(y):
                return f"{path}: length {len(x)} against {len(y)}"
            stack.extend((u, v, f"{path}[{i}]") for i, (u, v) in enumerate(zip(x, y)))
        else:
            fields = [n for c in type(x).__mro__ for n in c.__dict__.get("__slots__", ())]
            if hasattr(x, "__dict__"):  # what pickle writes (no handler cache)
                stack.append((_fields(x), _fields(y), path + ".__dict__"))
            stack.extend((getattr(x, n, None), getattr(y, n, None), f"{path}.{n}")
                         for n in fields if n != "__dict__")
    return None


def test_the_comparison_sees_a_changed_field() -> None:
    codec = codec_for(SCOPES["default"], "kvstate", True, None)
    s = codec.loads(codec.dumps(codec.template))
    other = codec.loads(codec.dumps(codec.template))
    assert _same(s, other) is None
    other.h.ranks[1].ledger.entries[99] = None
    assert "ranks" in (_same(s, other) or "")
    other = codec.loads(codec.dumps(codec.template))
    other.h.pool.free.rotate(1)
    assert _same(s, other) is not None


def test_a_stored_state_loads_field_for_field() -> None:
    """Loaded, a state is the state stored, field for field (cycles, shared
    structure and dict order included), shares the template's objects, and
    each of its successors digests as a plain pickle copy's does; stored, it
    is smaller than a plain pickle."""
    smaller = 0
    for name, codec, s in _codec_walks(seeds=3):
        scope = SCOPES[name]
        blob = codec.dumps(s)
        back = codec.loads(blob)
        assert _same(s, back) is None, (name, _same(s, back))
        assert back.h.config is codec.template.h.config
        assert back.h.monitor.enabled is codec.template.h.monitor.enabled
        plain = pickle.dumps(s, protocol=5)
        smaller += len(blob) < len(plain)
        for action in enabled(scope, s):
            ours, theirs = codec.loads(blob), pickle.loads(plain)
            apply(scope, ours, action, _symmetric(scope))
            apply(scope, theirs, action, _symmetric(scope))
            assert fast_digest(ours) == fast_digest(theirs), (name, action)
    assert smaller > 0


def test_every_scopes_search_writes_no_shared_object_whole() -> None:
    """A class's shared fields that some state does not hold as the
    template's (a field the core rebinds, like the monitor's ``absent``,
    which every observation sets) would quietly make every store write the
    object whole: no scope's search may."""
    for name, scope in SCOPES.items():
        codec = codec_for(scope, "kvstate", True, None)
        before = codec.written_whole
        r = check_compact(scope, "kvstate", out_dir=None, max_states=300)
        assert r.states >= 1
        assert codec.written_whole == before, name


def test_listing_a_field_the_core_rebinds_is_noticed(monkeypatch) -> None:
    """The check above fires on the mistake it guards against: ``absent``
    listed as shared (it was, at first)."""
    from kvstate.invariants import Monitor

    monkeypatch.setattr(mc_state, "_CODECS", {})
    monkeypatch.setitem(mc_state.SHARED_FIELDS, Monitor,
                        mc_state.SHARED_FIELDS[Monitor] | {"absent"})
    scope = SCOPES["default"]
    codec = codec_for(scope, "kvstate", True, None)
    r = check_compact(scope, "kvstate", out_dir=None, max_states=300)
    assert codec.written_whole > 0
    assert r.outcome == check(scope, "kvstate", engine="legacy", out_dir=None,
                              max_states=300).outcome


def test_a_shared_field_the_core_rebinds_is_written_whole_and_changes_nothing(
        monkeypatch) -> None:
    scope = SCOPES["default"]
    plain = check_compact(scope, "kvstate", out_dir=None)
    real_apply = mc_compact.apply

    def rebinding(scope, s, action, symmetric) -> None:
        real_apply(scope, s, action, symmetric)
        s.h.monitor.hasher = copy.copy(s.h.monitor.hasher)  # equal, not the template's

    monkeypatch.setattr(mc_compact, "apply", rebinding)
    codec = codec_for(scope, "kvstate", True, None)
    before = codec.written_whole
    rebound = check_compact(scope, "kvstate", out_dir=None)
    assert codec.written_whole > before
    assert rebound.outcome == plain.outcome and rebound.exhaustive


@pytest.mark.parametrize("workers", [1, 2])
def test_a_shared_value_changed_in_place_stops_the_search(monkeypatch, workers: int) -> None:
    """Every stored state shares the template's values: one changed in place
    would change them all, so the search stops and names the field; the
    spoiled template is dropped, so the next search of the scope is sound."""
    real_apply = mc_compact.apply
    calls = [0]

    def changing(scope, s, action, symmetric) -> None:
        real_apply(scope, s, action, symmetric)
        calls[0] += 1
        if calls[0] == 50:
            s.h.ranks[0].prefixes.append("changed")

    scope = SCOPES["churn"]
    spoiled = codec_for(scope, "kvstate", True, None)
    with monkeypatch.context() as patch:
        patch.setattr(mc_compact, "apply", changing)
        with pytest.raises(Exception) as raised:
            check_compact(scope, "kvstate", out_dir=None, workers=workers)
    assert isinstance(raised.value, (SharedStateChanged, mc_compact.WorkerError))
    assert "Executor.prefixes changed in place" in str(raised.value)
    if workers == 1:  # (with 2 the worker's copy was spoiled, then ended with its pool)
        assert codec_for(scope, "kvstate", True, None) is not spoiled
    after = check_compact(scope, "kvstate", out_dir=None, max_states=300)
    assert after.outcome == check(scope, "kvstate", engine="legacy", out_dir=None,
                                  max_states=300).outcome


def test_a_state_of_a_search_this_process_never_started_is_refused(monkeypatch) -> None:
    codec = codec_for(SCOPES["tiny"], "kvstate", True, None)
    blob = codec.dumps(codec.template)
    monkeypatch.setattr(mc_state, "_CODECS", {})
    with pytest.raises(pickle.UnpicklingError, match="has not started"):
        pickle.loads(blob)


def test_a_state_stored_here_loads_in_another_process() -> None:
    """A spawned worker, a Ray actor or a resumed checkpoint loads states it
    did not store: the codec's name and template must come out the same
    there (another string-hash seed too)."""
    scope = SCOPES["decode2"]
    codec = codec_for(scope, "kvstate", True, None)
    s = codec.loads(codec.dumps(codec.template))
    for _ in random_walk(scope, 7, 12, start=s):  # steps ``s`` itself
        pass
    blob = codec.dumps(s)
    program = (
        "import sys, pickle\n"
        "from sim.explore.modelcheck.model import SCOPES\n"
        "from sim.explore.modelcheck.state import codec_for\n"
        "from sim.explore.modelcheck.compact import fast_digest\n"
        "codec = codec_for(SCOPES['decode2'], 'kvstate', True, None)\n"
        "s = codec.loads(sys.stdin.buffer.read())\n"
        "assert s.h.config is codec.template.h.config\n"
        "sys.stdout.write(fast_digest(s).hex())\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", program], input=blob, capture_output=True,
                         env=env, cwd=ROOT, check=True, timeout=120)
    assert out.stdout.decode() == fast_digest(s).hex()
