"""A model-checker state as a value (`sim.explore.modelcheck.values`): rebuilt
field for field, keyed by what it holds (not by which objects hold it), and
loud about any field the value form does not name."""

from __future__ import annotations

import copy
import marshal
import os
import subprocess
import sys

import pytest

from kvstate.variants import VARIANTS
from sim.explore.modelcheck import compact as mc_compact
from sim.explore.modelcheck import values as mc_values
from sim.explore.modelcheck.compact import check_compact
from sim.explore.modelcheck.model import SCOPES, _symmetric, apply, enabled, random_walk
from sim.explore.modelcheck.values import (
    FORMS,
    SharedStateChanged,
    ValueForm,
    ValueFormError,
    form_for,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _walks(seeds: int, steps: int = 40, protocols=("kvstate",)):
    """Every scope, ``seeds`` random walks that start from the form's
    template rebuilt, as the engine's states do: yields (scope, form, state)."""
    for protocol in protocols:
        for scope in SCOPES.values():
            form = form_for(scope, protocol, True, None)
            for seed in range(seeds):
                start = form.loads(form.dumps(form.template)[1])
                for s in random_walk(scope, seed, steps, start=start):
                    yield scope, form, s


def _deep_copy(form: ValueForm, s):
    """A deep copy of ``s`` that keeps the template's constants (a copy of
    those would be written by value: another key, rightly)."""
    return copy.deepcopy(s, {id(c): c for c in form.constants})


def _scratch(obj) -> frozenset[str]:
    form = FORMS.get(type(obj))
    return frozenset(form.scratch) if form is not None else frozenset()


def _same(a, b) -> str | None:
    """Where the object graphs ``a`` and ``b`` differ (a path), or None:
    same types, equal values, dicts with the same keys in the same order,
    objects with the same fields (scratch fields aside; the dicts nothing
    iterates in any order), shared structure
    where ``a`` shares mutable structure."""
    pairs: dict[int, tuple] = {}
    stack = [(a, b, "state")]
    while stack:
        x, y, path = stack.pop()
        if type(x) is not type(y):
            return f"{path}: {type(x).__name__} against {type(y).__name__}"
        if isinstance(x, (str, bytes, int, float, bool, type(None), frozenset, set)):
            if x != y:
                return f"{path}: {x!r} against {y!r}"
            continue
        if isinstance(x, type) or (callable(x) and not hasattr(x, "__func__")
                                   and not hasattr(x, "__dict__")
                                   and not hasattr(type(x), "__slots__")):
            if x is not y:
                return f"{path}: {x!r} against {y!r}"
            continue
        if not isinstance(x, tuple) and type(x).__setattr__ is not mc_values._FROZEN:
            # (tuples and frozen records are values: equal is the same)
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
            skip = _scratch(x)
            fields = [n for c in type(x).__mro__ for n in c.__dict__.get("__slots__", ())
                      if n not in ("__dict__", "__weakref__")]
            if hasattr(x, "__dict__"):
                fields += list(vars(x))
            form = FORMS.get(type(x))
            unordered = form.unordered if form is not None else frozenset()
            for n in fields:
                u, v = getattr(x, n, None), getattr(y, n, None)
                if n in unordered:  # rebuilt sorted by key (nothing reads the order)
                    u, v = dict(sorted(u.items())), dict(sorted(v.items()))
                if n not in skip:
                    stack.append((u, v, f"{path}.{n}"))
    return None


def test_the_comparison_sees_a_changed_field() -> None:
    form = form_for(SCOPES["default"], "kvstate", True, None)
    blob = form.dumps(form.template)[1]
    s, other = form.loads(blob), form.loads(blob)
    assert _same(s, other) is None
    other.h.ranks[1].ledger.entries[99] = None
    assert "ranks" in (_same(s, other) or "")
    other = form.loads(blob)
    other.h.pool.free.rotate(1)
    assert _same(s, other) is not None


def test_a_stored_state_is_rebuilt_field_for_field() -> None:
    """Rebuilt, a state is the state stored, field for field (cycles, shared
    structure, dict order and its own block ids included), holds the
    template's constants, and each successor of it has the key the same
    successor of the original has."""
    for scope, form, s in _walks(seeds=3):
        key, blob = form.dumps(s)
        back = form.loads(blob)
        assert _same(s, back) is None, (scope.name, _same(s, back))
        assert back.h.config is form.template.h.config
        assert back.h.monitor.enabled is form.template.h.monitor.enabled
        assert back.h.ranks[1 % len(back.h.ranks)].observer.__self__ is back.h
        assert form.dumps(back) == (key, blob)
        for action in enabled(scope, s):
            ours, theirs = form.loads(blob), _deep_copy(form, s)
            apply(scope, ours, action, _symmetric(scope))
            apply(scope, theirs, action, _symmetric(scope))
            assert form.key(ours) == form.key(theirs), (scope.name, action)


def test_every_field_of_every_state_is_named_under_every_protocol() -> None:
    """The value form takes a class's fields from `FORMS`: every class met
    on random walks of every scope under every protocol has exactly the
    fields named there (else writing raises `ValueFormError`), and every
    state round-trips."""
    for scope, form, s in _walks(seeds=2, steps=30, protocols=tuple(VARIANTS)):
        key, blob = form.dumps(s)
        assert form.key(form.loads(blob)) == key, scope.name


def test_a_field_the_value_form_does_not_name_fails_loudly() -> None:
    """A class that gains a field (here: the planner, in one state) cannot
    be written until `FORMS` names it: left out, the field would make two
    different states one."""
    form = form_for(SCOPES["default"], "kvstate", True, None)
    s = form.loads(form.dumps(form.template)[1])
    s.h.planner.newly_added = {}
    with pytest.raises(ValueFormError, match=r"Planner's fields .* \(not named: newly_added\)"):
        form.dumps(s)
    del s.h.planner.newly_added
    del s.h.planner._loading
    with pytest.raises(ValueFormError, match="named but absent: _loading"):
        form.dumps(s)


def test_the_key_is_a_function_of_the_value() -> None:
    """Equal strings that are one object in one state and two in another,
    equal tuples likewise: one key (the pickled digest this replaced told
    them apart and counted 16 % more states on ``decode``)."""
    scope = SCOPES["decode"]
    form = form_for(scope, "kvstate", True, None)
    s = form.loads(form.dumps(form.template)[1])
    for _ in random_walk(scope, 3, 25, start=s):  # steps ``s`` itself
        pass
    twin = _deep_copy(form, s)
    for request in twin.h.requests.values():
        request.prompt = tuple(int(str(t)) for t in request.prompt)  # new, equal objects
    store = twin.h.store.objects
    twin.h.store.objects = {"".join(list(k)): "".join(list(v)) for k, v in store.items()}
    assert form.key(twin) == form.key(s)
    twin.h.store.objects[next(iter(store), "k")] = "other content"
    assert form.key(twin) != form.key(s)


def test_renamed_values_share_a_key_and_keep_their_own_names() -> None:
    """Two states that differ only in which physical blocks hold what share
    a key; each rebuilt state keeps its own block ids."""
    scope = SCOPES["default"]
    form = form_for(scope, "kvstate", True, None)
    start = form.loads(form.dumps(form.template)[1])
    one, other = start, form.loads(form.dumps(form.template)[1])
    other.h.pool.free.rotate(2)  # the next allocation takes other blocks
    for s in (one, other):
        apply(scope, s, ("admit", 0), _symmetric(scope))
        apply(scope, s, ("step",), _symmetric(scope))
    assert one.h.requests["a"].blocks[0] != other.h.requests["a"].blocks[0]
    assert form.key(one) == form.key(other)
    back = form.loads(form.dumps(other)[1])
    assert back.h.requests["a"].blocks == other.h.requests["a"].blocks


def test_a_fixed_field_the_core_rebinds_is_written_by_value_and_changes_nothing(
        monkeypatch) -> None:
    scope = SCOPES["default"]
    plain = check_compact(scope, "kvstate", out_dir=None)
    real_apply = mc_compact.apply

    def rebinding(scope, s, action, symmetric) -> None:
        real_apply(scope, s, action, symmetric)
        s.h.monitor._tag_suffixes = dict(s.h.monitor._tag_suffixes)  # equal, not the template's

    monkeypatch.setattr(mc_compact, "apply", rebinding)
    rebound = check_compact(scope, "kvstate", out_dir=None)
    assert rebound.outcome == plain.outcome and rebound.exhaustive


@pytest.mark.parametrize("workers", [1, 2])
def test_a_fixed_value_changed_in_place_stops_the_search(monkeypatch, workers: int) -> None:
    """Every rebuilt state holds the template's fixed values: one changed in
    place would change them all, so the search stops; the spoiled template is
    not used again, so the next search of the scope is sound."""
    real_apply = mc_compact.apply
    calls = [0]

    def changing(scope, s, action, symmetric) -> None:
        real_apply(scope, s, action, symmetric)
        calls[0] += 1
        if calls[0] == 50:
            s.h.ranks[0].prefixes.append("changed")

    scope = SCOPES["churn"]
    spoiled = form_for(scope, "kvstate", True, None)
    with monkeypatch.context() as patch:
        patch.setattr(mc_compact, "apply", changing)
        with pytest.raises(Exception) as raised:
            check_compact(scope, "kvstate", out_dir=None, workers=workers)
    assert isinstance(raised.value, (SharedStateChanged, mc_compact.WorkerError))
    assert "changed in place" in str(raised.value)
    if workers == 1:  # (with 2 the worker's copy was spoiled, then ended with its pool)
        assert form_for(scope, "kvstate", True, None) is not spoiled
    after = check_compact(scope, "kvstate", out_dir=None, max_states=300)
    assert after.states == 300 and after.ok


def test_a_state_stored_here_is_rebuilt_in_another_process() -> None:
    """A spawned worker, a Ray actor or a resumed checkpoint rebuilds states
    it did not store, classes it has not met yet included, under another
    string-hash seed: same state, same key."""
    scope = SCOPES["decode2"]
    form = form_for(scope, "kvstate", True, None)
    s = form.loads(form.dumps(form.template)[1])
    for _ in random_walk(scope, 7, 12, start=s):  # steps ``s`` itself
        pass
    key, blob = form.dumps(s)
    program = (
        "import sys\n"
        "from sim.explore.modelcheck.model import SCOPES\n"
        "from sim.explore.modelcheck.values import form_for\n"
        "form = form_for(SCOPES['decode2'], 'kvstate', True, None)\n"
        "s = form.loads(sys.stdin.buffer.read())\n"
        "assert s.h.config is form.template.h.config\n"
        "sys.stdout.write(form.key(s).hex())\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", program], input=blob, capture_output=True,
                         env=env, cwd=ROOT, check=True, timeout=120)
    assert out.stdout.decode() == key.hex()


def test_a_stored_value_naming_a_foreign_class_is_refused() -> None:
    """A damaged or foreign file naming a class outside kvstate and sim (or one
    this code lacks) is refused with the name, not imported."""
    form = ValueForm(form_for(SCOPES["tiny"], "kvstate", True, None).template, True)
    key, blob = form.dumps(form.template)
    size = int.from_bytes(blob[:4], "little")
    canonical = marshal.loads(blob[4:4 + size])
    names = marshal.loads(blob[4 + size:])
    for bad, says in (("os:system", "not a class of kvstate or sim"),
                      ("kvstate.harness:NoSuchThing", "which this code does not have")):
        value = (bad, *canonical[0][1:]), *canonical[1:]
        with pytest.raises(ValueFormError, match=says):
            mc_values.ValueForm(form.template, True).decode(value, names)
