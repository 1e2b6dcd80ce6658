"""How the compact engine stores a state: what every state shares, by reference.

Theory of operation
-------------------
A model-checker state is a whole `kvstate.harness.Harness` (engine, planner,
one executor a rank, invariant monitor), stored between levels as a pickle
and copied for every transition by loading it (`sim.explore.modelcheck.compact.Expander`).
About a third of each stored state is the same in every state of one
search: the connector config, the protocol variant (some twenty hook
functions, each a global to look up on every load), and the fields the
harness, monitor, planner and executors derive from them at construction
(key prefixes, stride residues, the enabled invariants, the block hasher).
Written in every state, they cost time on every copy and every store and
tell no two states apart.

`StateCodec` writes each such object of a search as a reference to the one
in its *template*, the search's initial state: an object of a class in
`SHARED_FIELDS` is written as its other fields only and rebuilt, on load, as
a copy of the template's attribute dict with those fields put back in place
(the dict keeps the template's key order, which the canonical digest writes:
a rebuilt object digests exactly as the one that was stored). The config and
the variant, wherever else they are referenced, are written as a tag.

Why this is sound: a reference stands for the template's object only when
the stored object's shared fields *are* the template's (identity, checked at
every store; an object that fails the check, say a field the core rebound, is
written whole, as plain pickle would), so a loaded state is the state that
was stored, field for field. What identity cannot see is a shared value
changed in place: every state would then see the change. Nothing in the core
does that today (the values are frozen records, tuples, strings and dicts
filled once at construction), and `StateCodec.check_unchanged` re-pickles the
template's shared values at the end of every level and of the search (in
every worker and actor too) and raises `SharedStateChanged` if any differs
from the bytes taken at the start; the spoiled template is dropped (a test
changes one in place during a search and sees both).

Measured on the ``default`` scope's 2,550 states: loading a state ~108 ->
~81 us (with the monitor's Counters rebuilt without Python), pickling one
~138 -> ~123 us, a third fewer bytes; in ``kvstate bench modelcheck``'s
phases, copying 107 -> 81 and storing 59 -> 54 us a transition.

A stored state names its codec (a digest of the scope, the variant, the
reduction and the invariant set, the same in every process): a worker process, a Ray actor or
a resumed checkpoint builds the same template from the same search and
registers it under the same name, so a state stored in one loads in another.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import operator
import pickle
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvstate.config import ConnectorConfig
from kvstate.executor import Executor
from kvstate.harness import Harness
from kvstate.invariants import Monitor
from kvstate.planner import Planner
from kvstate.variants import Variant
from sim.explore.modelcheck.model import Scope, System, initial

# Per class: fields set from the config and variant at construction and
# never rebound or changed afterwards. Leaving a field out only costs speed;
# listing one that changes is caught (rebound: written whole; changed in
# place: `SharedStateChanged`).
SHARED_FIELDS: dict[type, frozenset[str]] = {
    Harness: frozenset({"config", "variant", "hash_fn", "record", "keep_finished",
                        "auto_preempt", "sink", "token_budget"}),
    Monitor: frozenset({"config", "shared_store", "enabled", "hasher",
                        "_chained_groups", "_prefixes", "_tag_suffixes", "_hashes_per_block",
                        "_hit_needs", "_hash_block"}),
    Planner: frozenset({"config", "variant", "_num_groups", "_lookup_prefixes",
                        "_spec_groups", "_windowed", "_simple_hybrid"}),
    Executor: frozenset({"config", "rank", "variant", "prefixes", "residues", "_masked"}),
}

# Pickle writes a call of this function as the NEWOBJ opcode (``cls.__new__``
# from C), https://docs.python.org/3/library/pickle.html#object.__reduce__
_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]

# Codecs of this process by name (see the module docstring's last paragraph).
_CODECS: dict[str, StateCodec] = {}


class SharedStateChanged(RuntimeError):
    """A value every stored state shares was changed in place during a search:
    the states stored after the change do not hold what was computed."""


def codec_for(scope: Scope, protocol: str, reduce: bool, only: Sequence[str] | None
              ) -> StateCodec:
    """This process's codec for the search, made (with its template, the
    search's initial state) the first time it is asked for. One a search:
    states loaded through one codec share its template's objects, so storing
    them through another would write every shared object whole."""
    text = repr((scope, protocol, reduce, tuple(sorted(only)) if only is not None else None))
    name = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    codec = _CODECS.get(name)
    if codec is None:
        codec = _CODECS[name] = StateCodec(initial(scope, protocol, reduce=reduce, only=only),
                                           name)
    return codec


def _codec(name: str) -> StateCodec:
    codec = _CODECS.get(name)
    if codec is None:
        raise pickle.UnpicklingError(
            f"a stored model-checker state of search {name}, which this process has not "
            f"started (states load only through the Expander of their own search)")
    return codec


def _shared_object(name: str, tag: int) -> Any:
    """Unpickling: a new object of a shared class, filled by `_fill_object`."""
    return object.__new__(_codec(name).templates[tag][0])


def _fill_object(obj: Any, values: tuple[Any, ...]) -> None:
    """Unpickling: the object's attribute dict, the template's with the
    stored fields put in their places (so in the template's key order)."""
    name, tag, rest = values
    _, full, varying, _ = _codec(name).templates[tag]
    fields = full.copy()
    fields.update(zip(varying, rest))
    obj.__dict__ = fields


def _fields(obj: Any) -> dict[str, Any]:
    """What pickle would write of ``obj``: its ``__getstate__`` (the
    monitor's leaves its handler cache out), else its attribute dict (Python
    3.10 has no ``object.__getstate__``)."""
    getstate = getattr(type(obj), "__getstate__", None)
    if getstate is None or getstate is _OBJECT_GETSTATE:
        return obj.__dict__
    return getstate(obj)


_OBJECT_GETSTATE = getattr(object, "__getstate__", None)


def _constant(name: str, tag: str) -> Any:
    return _codec(name).constants[tag]


def _reduce_counter(counter: Counter[Any]) -> Any:
    """A `collections.Counter` as an empty one filled item by item: loading
    it runs no Python (its own reduction calls ``Counter.__init__`` and
    ``update``, ~8 us a state for the monitor's three)."""
    return _NEWOBJ, (type(counter),), None, None, iter(counter.items())


class StateCodec:
    """Stores and loads the states of one search (see the module docstring).
    ``template``: the search's initial state; it is kept, never stepped."""

    def __init__(self, template: System, name: str) -> None:
        self.name = name
        self.template = template
        h = template.h
        self.constants: dict[str, Any] = {"config": h.config, "variant": h.variant}
        self._constant_ids = {id(v): k for k, v in self.constants.items()}
        # tag -> (class, full attribute dict, varying names, shared values in
        # the order of `_shared_names`)
        self.templates: list[tuple[type[Any], dict[str, Any], tuple[str, ...],
                                   tuple[Any, ...]]] = []
        self._tags: dict[tuple[type, int], int] = {}
        self._keys: list[tuple[str, ...]] = []
        self._shared_names: list[tuple[str, ...]] = []
        # Objects of a shared class written whole since the codec was made
        # (their shared fields were not the template's): a test holds every
        # scope's search to none, so a field the core rebinds is noticed.
        self.written_whole = 0
        for obj in (h, h.monitor, h.planner, *h.ranks):
            cls = type(obj)
            if cls not in SHARED_FIELDS:  # another implementation (a factory's)
                continue
            fields = _fields(obj)
            shared = tuple(k for k in fields if k in SHARED_FIELDS[cls])
            varying = tuple(k for k in fields if k not in SHARED_FIELDS[cls])
            self._tags[cls, self._ident(obj)] = len(self.templates)
            self.templates.append((cls, dict(fields), varying,
                                   tuple(fields[k] for k in shared)))
            self._keys.append(tuple(fields))
            self._shared_names.append(shared)
        table = copyreg.dispatch_table.copy()
        for cls in SHARED_FIELDS:
            table[cls] = self._reduce_shared
        table[ConnectorConfig] = table[Variant] = self._reduce_constant
        table[Counter] = _reduce_counter
        self._table = table
        self._at_start = self._shared_bytes()

    @staticmethod
    def _ident(obj: Any) -> int:
        return obj.rank if type(obj) is Executor else 0

    def _reduce_constant(self, obj: Any) -> Any:
        tag = self._constant_ids.get(id(obj))
        if tag is None:
            return obj.__reduce_ex__(5)
        return _constant, (self.name, tag)

    def _reduce_shared(self, obj: Any) -> Any:
        tag = self._tags.get((type(obj), self._ident(obj)))
        if tag is not None:
            fields = _fields(obj)
            _, _, varying, values = self.templates[tag]
            if (tuple(fields) == self._keys[tag]
                    and all(map(operator.is_, map(fields.__getitem__, self._shared_names[tag]), values))):
                # The state item goes through `_fill_object` (the sixth
                # item), after the object is memoized: the harness is
                # reachable from its own fields (bound methods), so it cannot
                # be a constructor argument.
                return (_shared_object, (self.name, tag), (self.name, tag,
                        tuple(map(fields.__getitem__, varying))), None, None, _fill_object)
        self.written_whole += 1
        return obj.__reduce_ex__(5)

    def dumps(self, state: System) -> bytes:
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=5)
        p.dispatch_table = self._table
        p.dump(state)
        return buf.getvalue()

    def loads(self, blob: bytes) -> System:
        return pickle.loads(blob)

    def _shared_bytes(self) -> list[bytes]:
        return [pickle.dumps(values, protocol=5) for *_, values in self.templates]

    def changed(self) -> list[str]:
        """The shared fields ("Class.field") whose values are not what they
        were when the codec was made. A codec with any is dropped from this
        process's registry: the next search of the scope makes a new
        template. (Also called as a search ends by an exception, say a
        worker's: this process's template may be spoiled as well.)"""
        found = []
        for (cls, _, _, values), names, before in zip(self.templates, self._shared_names,
                                                      self._at_start):
            if pickle.dumps(values, protocol=5) == before:
                continue
            old = pickle.loads(before)
            found += [f"{cls.__name__}.{n}" for n, a, b in zip(names, old, values)
                      if pickle.dumps(a, protocol=5) != pickle.dumps(b, protocol=5)]
        if found and _CODECS.get(self.name) is self:
            del _CODECS[self.name]
        return found

    def check_unchanged(self) -> None:
        """Raise `SharedStateChanged` naming the fields `changed` finds."""
        found = self.changed()
        if found:
            raise SharedStateChanged(
                f"{', '.join(found)} changed in place during the search, but every stored "
                f"state shares it (sim.explore.modelcheck.state.SHARED_FIELDS): the search's states and "
                f"verdict cannot be trusted; take the field out of SHARED_FIELDS")
