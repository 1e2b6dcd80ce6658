"""A model-checker state as a value: nested tuples, canonical, rebuilt on load.

Theory of operation
-------------------
The model checker keeps, for every state it has seen, a key; for every state
still to expand, something it can turn back into a live
`kvstate.harness.Harness` to step on. Both come from one walk here:
`ValueForm.encode` turns a `sim.explore.modelcheck.model.System` into its
*value*, nested tuples of ints, strings, floats, bytes, ``None`` and
booleans built from the objects' fields; ``marshal`` writes it (C speed, and
reading it back runs no code); the key is a hash of those bytes;
`ValueForm.decode` builds a fresh `System` from the bytes. A state is
stored, hashed and copied as data, and the core's classes stay the single
source of behaviour: the value form only names their fields.

Every non-leaf node of a value is a tuple whose first item says what it is:
an object is ``(class name, field values...)`` in a fixed field order, a
container or a renamed value is ``(TAG, items...)`` with one of the small-int
tags below (a dict: its keys, then its values). A leaf is a plain int,
string, float, bytes, bool or ``None``, never a tuple, so nothing is
ambiguous; in a fixed field's place (below) a bare int is the index of a
constant.

**Sharing.** A mutable object (a core object, a list, dict, set, deque or
Counter) met a second time is written as a reference to its first
appearance, so a state with the same request in ``requests`` and
``running``, or the harness's own bound methods, comes back with the same
sharing. Immutable values (strings, tuples, frozen records) are written by
value wherever they occur: equal values give equal bytes, whether they are
one object or two.

**Fields of a class** (`FORMS`) are of three kinds:

* *value* fields, written;
* *fixed* fields, set from the config and the variant at construction and
  never rebound (the config, the variant, key prefixes, stride residues):
  written as an index into the search's constant table, taken from the
  search's initial state (the *template*), so a rebuilt object holds the
  template's very objects. A fixed field the core rebound is not in the table
  and is written by value; one the core changed in place is caught by
  `ValueForm.check_unchanged`, which the engine runs after every level;
* *scratch* fields: statistics, caches, the run's records and what only the
  end of a trace reads (`sim.explore.modelcheck.model.END_ONLY_FIELDS`);
  left out, and set to a copy of the template's value on rebuild.

Slotted records need no entry: their slots are all value fields. An object
whose fields are not exactly what its entry names fails loudly
(`ValueFormError`, naming the class and the fields) when it is first
written, and `tests/test_values.py` walks every scope under every protocol
to find such a class before a search does.

**Reductions** (the soundness argument is `sim.explore.modelcheck.model`'s,
unchanged). The key is the hash of the *canonical part* of the value: block
ids (`BlockId`) as numbers in order of first appearance, the pool written
last per numbered block (so blocks holding the same things in the same
places give one key); interchangeable request names (`RequestName`) the same
way; the counters (`Ordinal` subclasses) as first-appearance numbers plus
the order of their values (paths of different lengths that reach one
situation merge); sets sorted; with ``reduce``, the dicts no code iterates
(`sim.explore.modelcheck.model.UNORDERED_FIELDS`, the harness's ``current``)
sorted by key. The stored bytes add the *names part*: the physical block
ids, request names and counter values behind those numbers. So a rebuilt
state is the state that was stored, renamed nowhere (the counterexample a
search prints replays on a fresh harness action by action, and its actions
name requests), while two states equal up to the renamings share a key.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import importlib
import marshal
import types
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from attr._make import _frozen_setattrs as _FROZEN

from kvstate.block_pool import BlockPool
from kvstate.executor import Executor
from kvstate.harness import EngineRequest, Harness
from kvstate.invariants import Monitor, _Job
from kvstate.memory_store import MemoryStore
from kvstate.planner import Planner
from sim.explore.modelcheck.model import (
    END_ONLY_FIELDS,
    ORDINALS,
    UNORDERED_FIELDS,
    BlockId,
    RequestName,
    Scope,
    System,
    initial,
)

# Node tags: the first item of a node that is not an object.
TUPLE, LIST, DICT, SET, FROZENSET, DEQUE, COUNTER = range(7)
REF, CONST, ENUM, BLOCK, NAME, METHOD, UNSET, POOL, LEAF = range(7, 16)
ORDINAL = 16  # ORDINAL + k: the k-th class of `ORDINALS`

# ``marshal`` format 4 (Python 3.4+) writes a string met again in one value
# as a back reference: https://docs.python.org/3/library/marshal.html
MARSHAL_VERSION = 2


class ValueFormError(TypeError):
    """A state holds something the value form cannot write: a class whose
    fields `FORMS` does not name exactly, or a value of an unknown type."""


class Form:
    """How one class's fields enter the value (see the module docstring)."""

    __slots__ = ("value", "fixed", "scratch", "unordered")

    def __init__(self, value: Iterable[str] = (), fixed: Iterable[str] = (),
                 scratch: Iterable[str] = (), unordered: Iterable[str] = ()) -> None:
        self.value = tuple(value)
        self.fixed = tuple(fixed)
        self.scratch = tuple(scratch)
        self.unordered = frozenset(unordered)
        assert self.unordered <= set(self.value), "an unordered field is a value field"

    @property
    def names(self) -> frozenset[str]:
        return frozenset((*self.value, *self.fixed, *self.scratch))


# The classes with an attribute dict, and the slotted ones with fields to
# leave out (`_Job`: its value fields are its other slots). Every field of
# an instance must be named here, in exactly one kind.
FORMS: dict[type, Form] = {
    Harness: Form(
        value=("clock", "pool", "store", "planner", "ranks", "monitor", "requests", "running",
               "waiting", "outbox", "current", "now"),
        fixed=("config", "variant", "hash_fn", "record", "keep_finished", "auto_preempt",
               "sink", "token_budget"),
        # What the harness records of a run (trace lines, plans, settled
        # events, counts); a recording replay runs on a harness of its own.
        scratch=("log", "times", "finished", "published", "published_count", "plans",
                 "preemptions", "last_finished", "_load_reports"),
        unordered=("current",)),
    Monitor: Form(
        value=("unchecked", "disagreements", "absent", "gens", "load_failed", "current",
               "jobs", "last_job_id", "quiescent", "running", "_step_found", "_step_seen",
               "_completed", "releases_recorded", "announcers", "_report_found", "_late",
               "pinned", "free", "store", "frontier", "offsets", "known_blocks",
               "evicted_blocks", "_computed_next"),
        fixed=("config", "shared_store", "enabled", "hasher", "_chained_groups", "_prefixes",
               "_tag_suffixes", "_hashes_per_block", "_hit_needs", "_hash_block"),
        # ``findings`` is cleared before every transition and a state with
        # one is never stored; the handler cache refills itself.
        scratch=("findings", "_handlers", "index", *END_ONLY_FIELDS[Monitor]),
        unordered=UNORDERED_FIELDS[Monitor]),
    _Job: Form(scratch=END_ONLY_FIELDS[_Job]),
    # A cache of block hashes the harness checks against the tokens before
    # any use (`Harness._hashes`): a function of the value, not part of it.
    EngineRequest: Form(scratch=("hashed",)),
    Planner: Form(
        value=("trackers", "jobs", "closing", "quorum", "_next_job_id", "_next_generation",
               "_step", "_loads_pending", "_load_queue", "_loading"),
        fixed=("config", "variant", "_num_groups", "_lookup_prefixes", "_spec_groups",
               "_windowed", "_simple_hybrid")),
    Executor: Form(
        value=("clock", "observer", "ledger", "queue", "pressure", "skipped",
               "retry_by_request", "_no_masks"),
        fixed=("config", "rank", "variant", "prefixes", "residues", "_masked")),
    MemoryStore: Form(value=("objects", "answer"), scratch=("puts", "exists_keys"),
                      unordered=UNORDERED_FIELDS[MemoryStore]),
    # With ``reduce`` the blocks are written by `ValueForm` (renamed).
    BlockPool: Form(value=("refs", "free", "content", "observer", "on_write")),
}
# A scratch field of a class the template holds no instance of starts as this.
SCRATCH_DEFAULTS: dict[tuple[type, str], Any] = {(_Job, "step"): 0,
                                                  (EngineRequest, "hashed"): ((), ())}

_LEAVES: frozenset[type] = frozenset({int, str, float, bool, bytes, type(None)})
_ORDINAL_TAG = {cls: ORDINAL + k for k, cls in enumerate(ORDINALS)}
_UNSET = object()


def _qualname(cls: type) -> str:
    """How a value names a class: ``module:qualified name``."""
    return f"{cls.__module__}:{cls.__qualname__}"


# The packages a stored value may name classes of (`_resolve`).
_PACKAGES = ("kvstate.", "sim.")


def _resolve(name: str) -> Any:
    """The class (or enum) a value names, imported if need be (a worker
    process or a resumed search rebuilds classes it has not met yet)."""
    module_name, _, qualname = name.partition(":")
    if not module_name.startswith(_PACKAGES) or not qualname:
        raise ValueFormError(f"a stored model-checker value names {name!r}: not a class of "
                             f"kvstate or sim (a damaged or foreign file)")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueFormError(f"a stored model-checker value names {name!r}, which this "
                             f"code does not have ({e})") from None
    return obj


def _slots(cls: type) -> tuple[str, ...]:
    """Every slot of ``cls`` and its bases, bases first (``__weakref__`` and
    ``__dict__`` are not fields)."""
    out: list[str] = []
    for klass in reversed(cls.__mro__):
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        out += [s for s in slots if s not in ("__weakref__", "__dict__") and s not in out]
    return tuple(out)


def _has_dict(cls: type) -> bool:
    """Whether instances of ``cls`` keep an attribute dict."""
    return any("__dict__" in klass.__dict__ or (klass is not object
                                                 and "__slots__" not in klass.__dict__)
               for klass in cls.__mro__ if klass is not object)


class _ClassInfo:
    """What writing and rebuilding need of one class."""

    __slots__ = ("cls", "name", "slotted", "named_tuple", "frozen", "value", "fixed",
                 "scratch", "unordered", "size")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = _qualname(cls)
        self.named_tuple = issubclass(cls, tuple)
        # Frozen attrs records (and named tuples) cannot change: written by
        # value, never by reference, and rebuilt as a new equal record.
        self.frozen = self.named_tuple or getattr(cls, "__setattr__", None) is _FROZEN
        form = FORMS.get(cls)
        self.slotted = self.named_tuple or not _has_dict(cls)
        if self.named_tuple:
            value: tuple[str, ...] = tuple(cls._fields)  # type: ignore[attr-defined]
        elif self.slotted:
            left_out = form.names - set(form.value) if form is not None else frozenset()
            value = (form.value if form is not None and form.value
                     else tuple(s for s in _slots(cls) if s not in left_out))
        elif form is None:
            raise ValueFormError(
                f"{self.name} keeps an attribute dict and has no entry in "
                f"sim.explore.modelcheck.values.FORMS: name its fields there")
        else:
            value = form.value
        self.value = value
        self.fixed = form.fixed if form is not None else ()
        self.scratch = form.scratch if form is not None else ()
        self.unordered = form.unordered if form is not None else frozenset()
        self.size = len(self.value) + len(self.fixed) + len(self.scratch)

    def check(self, obj: Any) -> None:
        """Raise `ValueFormError` unless ``obj``'s fields are the ones named."""
        if self.named_tuple:
            return
        present = set(_slots(self.cls)) if self.slotted else set(vars(obj))
        known = {*self.value, *self.fixed, *self.scratch}
        if present == known:
            return
        parts = []
        if present - known:
            parts.append(f"not named: {', '.join(sorted(present - known))}")
        if known - present:
            parts.append(f"named but absent: {', '.join(sorted(known - present))}")
        raise ValueFormError(
            f"{self.name}'s fields are not the ones sim.explore.modelcheck.values.FORMS "
            f"names ({'; '.join(parts)}): a field left out of the value would make two "
            f"different states one")


def _slot_setter(cls: type, name: str) -> Any:
    """The slot's member descriptor's ``__set__`` (it sets the slots of frozen
    attrs records too, whose ``__setattr__`` refuses)."""
    for klass in cls.__mro__:
        descriptor = klass.__dict__.get(name)
        if descriptor is not None:
            return descriptor.__set__
    raise ValueFormError(f"{_qualname(cls)} has no slot {name!r}")


def _sorted(items: Any) -> list[Any]:
    try:
        return sorted(items)
    except TypeError:  # mixed kinds (None beside a value): any fixed order will do
        return sorted(items, key=repr)


def _fresh(default: Any, j: int) -> str:
    """Source for a scratch field's value on rebuild: a new empty container
    for an empty one, the template's value itself for an immutable one, else
    a copy of it (``default{j}`` in the reader's namespace)."""
    if type(default) in (list, dict, set, Counter, deque) and not default:
        return f"{type(default).__name__}()"
    if type(default) in _LEAVES or isinstance(default, (int, str, tuple, frozenset)):
        return f"default{j}"
    return f"copy(default{j})"


def _sorted_items(d: dict[Any, Any]) -> list[tuple[Any, Any]]:
    try:
        return sorted(d.items(), key=_first)
    except TypeError:
        return sorted(d.items(), key=lambda item: repr(item[0]))


def _first(item: tuple[Any, Any]) -> Any:
    return item[0]


class ValueForm:
    """Writes and rebuilds the states of one search (see the module
    docstring). ``template``: the search's initial state, kept and never
    stepped; ``reduce``: the symmetry and counter reductions and the sorted
    unordered dicts (off: the unreduced search, every order kept).

    Design note: each class gets a writer and a reader of its own, generated
    from its `Form` the first time it is met (as attrs generates ``__init__``),
    and every container's items are tested for leaves inline, so a call is
    made per non-leaf node only (about 230 a state of ``default``, each
    ~1 us; `kvstate bench modelcheck` prints the phases). A `ValueForm` is
    not thread-safe: the bookkeeping of one walk lives on it."""

    def __init__(self, template: System, reduce: bool) -> None:
        self.template = template
        self.reduce = reduce
        # The constant table: the template's fixed-field values, in the
        # order the template's objects are listed here (the same in every
        # process that builds the search's template).
        self.constants: list[Any] = []
        self._constant_ids: dict[int, int] = {}
        self._scratch: dict[tuple[type, str], Any] = dict(SCRATCH_DEFAULTS)
        h = template.h
        for obj in (h, h.monitor, h.planner, *h.ranks, h.store):
            form = FORMS.get(type(obj))
            if form is None:  # another implementation (a factory's): written whole
                continue
            for name in form.fixed:
                value = getattr(obj, name)
                if id(value) not in self._constant_ids:
                    self._constant_ids[id(value)] = len(self.constants)
                    self.constants.append(value)
            for name in form.scratch:
                self._scratch[type(obj), name] = getattr(obj, name)
        self._at_start = copy.deepcopy(self.constants)
        self._classes: dict[type, _ClassInfo] = {}
        self._enums: dict[str, Any] = {}
        self._walk()

    # -- writing -----------------------------------------------------------

    def dumps(self, s: System) -> tuple[bytes, bytes]:
        """(key, stored bytes) of a state: the key hashes the canonical part."""
        canonical, names = self.encode(s)
        head = marshal.dumps(canonical, MARSHAL_VERSION)
        return (hashlib.blake2b(head, digest_size=16).digest(),
                len(head).to_bytes(4, "little") + head
                + marshal.dumps(names, MARSHAL_VERSION))

    def key(self, s: System) -> bytes:
        return self.dumps(s)[0]

    def encode(self, s: System) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(canonical part, names part) of the state's value."""
        self._memo.clear()
        self._blocks.clear()
        self._names.clear()
        for seen in self._ordinals.values():
            seen.clear()
        self._pools.clear()
        value = self._enc(s)
        blocks = self._blocks
        # The pool last: its blocks in the order the state first mentions
        # them, then the free ones in queue order, then any other (a block
        # neither free nor held by anything written: ordered by what it
        # holds).
        pool_values = []
        for pool in self._pools:
            for block in pool.free:
                if block not in blocks:
                    blocks[block] = len(blocks)
            refs, content = pool.refs, pool.content
            if len(blocks) < len(refs) - 1:
                rest = sorted((b for b in range(1, len(refs)) if b not in blocks),
                              key=lambda b: (refs[b], content[b]))
                for b in rest:
                    blocks[BlockId(b)] = len(blocks)
            physical = list(blocks)  # in number order: numbers are insertion order
            pool_values.append((POOL, refs[0], content[0], *[refs[b] for b in physical],
                                *[content[b] for b in physical],
                                *[blocks[b] for b in pool.free]))
        ordinal_values = tuple(self._ordinals.values())
        order = tuple(tuple(n for _, n in sorted(seen.items())) for seen in ordinal_values)
        return ((value, tuple(pool_values), order),
                (tuple(map(int, blocks)), tuple(map(str, self._names)),
                 tuple(tuple(map(int, seen)) for seen in ordinal_values)))

    # -- rebuilding --------------------------------------------------------

    def loads(self, blob: bytes) -> System:
        """The state stored as ``blob`` (`dumps`'s second item), rebuilt."""
        size = int.from_bytes(blob[:4], "little")
        return self.decode(marshal.loads(blob[4:4 + size]), marshal.loads(blob[4 + size:]))

    def decode(self, canonical: tuple[Any, ...], names_part: tuple[Any, ...]) -> System:
        value, pool_values, _ = canonical
        by_number, names, ordinal_values = names_part
        self._rmemo.clear()
        self._rpools.clear()
        context = self._context
        context[0] = block_ids = [BlockId(b) for b in by_number]
        context[1] = [RequestName(n) for n in names]
        context[2] = [[cls(v) for v in values]
                      for cls, values in zip(ORDINALS, ordinal_values)]
        s = self._dec(value)
        for pool, pv in zip(self._rpools, pool_values):
            n = len(by_number)
            refs = [0] * (n + 1)
            content = [""] * (n + 1)
            refs[0], content[0] = pv[1], pv[2]
            for i, b in enumerate(by_number):
                refs[b] = pv[3 + i]
                content[b] = pv[3 + n + i]
            pool.refs = refs
            pool.content = content
            pool.free = deque(block_ids[i] for i in pv[3 + 2 * n:])
        return s

    # -- the walks ---------------------------------------------------------

    def _walk(self) -> None:
        """Make the two walks: ``self._enc`` and ``self._dec`` with their
        per-type writers and per-tag readers, sharing the bookkeeping dicts
        that `encode` and `decode` clear."""
        memo: dict[int, int] = {}
        blocks: dict[Any, int] = {}
        names: dict[str, int] = {}
        ordinals: dict[type, dict[int, int]] = {cls: {} for cls in ORDINALS}
        self._memo, self._blocks, self._names, self._ordinals = memo, blocks, names, ordinals
        self._pools: list[BlockPool] = []
        leaves = _LEAVES
        writers: dict[type, Callable[[Any], Any]] = {}
        self._writers = writers

        def enc(x: Any) -> Any:
            w = writers.get(type(x))
            if w is None:
                w = self._writer_for(x)
            return w(x)

        def same(x: Any) -> Any:
            return x

        def w_tuple(x: tuple[Any, ...]) -> Any:
            return (TUPLE, *[v if type(v) in leaves else enc(v) for v in x])

        def w_frozenset(x: frozenset[Any]) -> Any:
            return (FROZENSET, *[v if type(v) in leaves else enc(v) for v in _sorted(x)])

        # Each mutable container's writer checks the memo inline (the same
        # five lines each): a shared helper would cost one more call per
        # container, ~80 a state of ``default``.
        def w_list(x: list[Any]) -> Any:
            ident = id(x)
            ref = memo.get(ident)
            if ref is not None:
                return (REF, ref)
            memo[ident] = len(memo)
            return (LIST, *[v if type(v) in leaves else enc(v) for v in x])

        def w_deque(x: deque[Any]) -> Any:
            ident = id(x)
            ref = memo.get(ident)
            if ref is not None:
                return (REF, ref)
            memo[ident] = len(memo)
            return (DEQUE, *[v if type(v) in leaves else enc(v) for v in x])

        def w_set(x: set[Any]) -> Any:
            ident = id(x)
            ref = memo.get(ident)
            if ref is not None:
                return (REF, ref)
            memo[ident] = len(memo)
            return (SET, *[v if type(v) in leaves else enc(v) for v in _sorted(x)])

        # A dict is (tag, keys..., values...): two comprehensions, no loop
        # over pairs (keys are all written before values, in both walks, so
        # the references they number agree).
        def items(tag: int, x: dict[Any, Any]) -> Any:
            return (tag, *[k if type(k) in leaves else enc(k) for k in x],
                    *[v if type(v) in leaves else enc(v) for v in x.values()])

        def w_dict(x: dict[Any, Any]) -> Any:
            ident = id(x)
            ref = memo.get(ident)
            if ref is not None:
                return (REF, ref)
            memo[ident] = len(memo)
            return items(DICT, x)

        def w_counter(x: Counter[Any]) -> Any:
            ident = id(x)
            ref = memo.get(ident)
            if ref is not None:
                return (REF, ref)
            memo[ident] = len(memo)
            return items(COUNTER, x)

        def w_unordered(x: dict[Any, Any]) -> Any:
            """A dict no code iterates: its items sorted by key."""
            ident = id(x)
            ref = memo.get(ident)
            if ref is not None:
                return (REF, ref)
            memo[ident] = len(memo)
            return items(DICT, dict(_sorted_items(x)))

        def w_block(x: Any) -> Any:
            n = blocks.get(x)
            if n is None:
                n = blocks[x] = len(blocks)
            return (BLOCK, n)

        def w_name(x: str) -> Any:
            n = names.get(x)
            if n is None:
                n = names[x] = len(names)
            return (NAME, n)

        def w_ordinal(tag: int, seen: dict[int, int]) -> Callable[[Any], Any]:
            def write(x: Any) -> Any:
                n = seen.get(x)
                if n is None:
                    n = seen[x] = len(seen)
                return (tag, n)
            return write

        constant_ids = self._constant_ids

        def w_fixed(x: Any) -> Any:
            """A fixed field that is not the template's: never a bare int
            (that is a constant's index there)."""
            return (LEAF, x) if type(x) in leaves else enc(x)

        writers.update({kind: same for kind in leaves})
        writers.update({tuple: w_tuple, frozenset: w_frozenset, list: w_list, deque: w_deque,
                        set: w_set, dict: w_dict, Counter: w_counter, BlockId: w_block,
                        RequestName: w_name})
        for k, cls in enumerate(ORDINALS):
            writers[cls] = w_ordinal(ORDINAL + k, ordinals[cls])
        self._enc = enc
        self._names_for_writers = {
            "memo": memo, "leaves": leaves, "enc": enc, "REF": REF, "CONST": CONST,
            "constant_ids": constant_ids,
            "unordered": w_unordered if self.reduce else w_dict, "fixed": w_fixed}

        # Rebuilding. ``context``: this decode's block ids, request names and
        # counter values by number (set by `decode`).
        rmemo: list[Any] = []
        self._rmemo = rmemo
        self._rpools: list[BlockPool] = []
        context: list[Any] = [[], [], []]
        self._context = context
        readers: dict[str, Callable[[Any], Any]] = {}
        self._readers = readers

        def dec(x: tuple[Any, ...]) -> Any:
            tag = x[0]
            if type(tag) is str:
                r = readers.get(tag)
                if r is None:
                    r = self._reader_for(tag)
                return r(x)
            return by_tag[tag](x)

        def r_tuple(x: Any) -> Any:
            return tuple([v if type(v) is not tuple else dec(v) for v in x[1:]])

        def r_list(x: Any) -> Any:
            out: list[Any] = []
            rmemo.append(out)
            out.extend([v if type(v) is not tuple else dec(v) for v in x[1:]])
            return out

        def r_deque(x: Any) -> Any:
            out: deque[Any] = deque()
            rmemo.append(out)
            out.extend([v if type(v) is not tuple else dec(v) for v in x[1:]])
            return out

        def r_set(x: Any) -> Any:
            out: set[Any] = set()
            rmemo.append(out)
            out.update([v if type(v) is not tuple else dec(v) for v in x[1:]])
            return out

        def r_frozenset(x: Any) -> Any:
            return frozenset([v if type(v) is not tuple else dec(v) for v in x[1:]])

        dict_update = dict.update

        def fill(out: dict[Any, Any], x: Any) -> dict[Any, Any]:
            rmemo.append(out)
            n = len(x) // 2 + 1
            keys = [k if type(k) is not tuple else dec(k) for k in x[1:n]]
            # (dict.update: a Counter's own would count the pairs)
            dict_update(out, zip(keys, [v if type(v) is not tuple else dec(v) for v in x[n:]]))
            return out

        def r_dict(x: Any) -> Any:
            return fill({}, x)

        def r_counter(x: Any) -> Any:
            return fill(Counter(), x)

        def r_ref(x: Any) -> Any:
            return rmemo[x[1]]

        constants = self.constants

        def r_const(x: Any) -> Any:
            return constants[x[1]]

        def r_enum(x: Any) -> Any:
            member = self._enums.get(x[1])
            return member if member is not None else self._enum_named(x[1])

        def r_block(x: Any) -> Any:
            return context[0][x[1]]

        def r_name(x: Any) -> Any:
            return context[1][x[1]]

        def r_method(x: Any) -> Any:
            return getattr(dec(x[1]), x[2])

        def r_leaf(x: Any) -> Any:
            return x[1]

        def r_bad(x: Any) -> Any:
            raise ValueFormError(f"a stored model-checker value holds an unknown node {x!r:.80}")

        def r_ordinal(k: int) -> Callable[[Any], Any]:
            def read(x: Any) -> Any:
                return context[2][k][x[1]]
            return read

        by_tag: list[Callable[[Any], Any]] = [r_bad] * (ORDINAL + len(ORDINALS))
        for tag, reader in ((TUPLE, r_tuple), (LIST, r_list), (DICT, r_dict), (SET, r_set),
                            (FROZENSET, r_frozenset), (DEQUE, r_deque), (COUNTER, r_counter),
                            (REF, r_ref), (CONST, r_const), (ENUM, r_enum), (BLOCK, r_block),
                            (NAME, r_name), (METHOD, r_method), (LEAF, r_leaf)):
            by_tag[tag] = reader
        for k in range(len(ORDINALS)):
            by_tag[ORDINAL + k] = r_ordinal(k)
        self._dec = dec
        self._names_for_readers = {"rmemo": rmemo, "dec": dec, "UNSET": UNSET,
                                   "Counter": Counter, "deque": deque, "copy": copy.copy,
                                   "constants": constants}

    def _writer_for(self, x: Any) -> Callable[[Any], Any]:
        """The writer for ``x``'s type, made and kept (`_walk`'s ``enc``
        asks for it the first time it meets the type)."""
        kind = type(x)
        if isinstance(x, enum.Enum):
            for member in kind:
                self._enums[f"{_qualname(kind)}.{member.name}"] = member
            prefix = _qualname(kind)

            def w_enum(m: Any) -> Any:
                return (ENUM, f"{prefix}.{m.name}")
            writer: Callable[[Any], Any] = w_enum
        elif kind is types.MethodType:
            enc = self._enc

            def w_method(m: Any) -> Any:
                return (METHOD, enc(m.__self__), m.__func__.__name__)
            writer = w_method
        elif kind is types.FunctionType or not (hasattr(x, "__dict__")
                                                 or hasattr(kind, "__slots__")):
            constant_ids = self._constant_ids

            def w_constant(c: Any) -> Any:
                n = constant_ids.get(id(c))
                if n is None:
                    raise ValueFormError(
                        f"a model-checker state holds {c!r:.80}, a "
                        f"{_qualname(type(c))}, which the value form cannot write: only "
                        f"the template's fixed fields (sim.explore.modelcheck.values.FORMS) "
                        f"may hold such values")
                return (CONST, n)
            writer = w_constant
        else:
            info = self._info(kind)
            info.check(x)
            writer = self._generate_writer(info)
        self._writers[kind] = writer
        return writer

    def _info(self, kind: type) -> _ClassInfo:
        info = self._classes.get(kind)
        if info is None:
            info = self._classes[kind] = _ClassInfo(kind)
        return info

    def _generate_writer(self, info: _ClassInfo) -> Callable[[Any], Any]:
        lines = ["def write(x):"]
        if info.frozen:
            lines += ["    n = constant_ids.get(id(x))",
                      "    if n is not None:",
                      "        return (CONST, n)"]
        else:
            lines += ["    ident = id(x)",
                      "    ref = memo.get(ident)",
                      "    if ref is not None:",
                      "        return (REF, ref)",
                      "    memo[ident] = len(memo)"]
        if info.cls is BlockPool and self.reduce:
            lines += ["    pools.append(x)",
                      "    return (NAME_, enc(x.observer), enc(x.on_write))"]
        else:
            if info.slotted:
                lines.append("    try:")
                lines += [f"        v{i} = x.{name}" for i, name in enumerate(info.value)]
                lines += ["    except AttributeError:",
                          "        return with_unset(x)"]
            else:
                lines += ["    d = x.__dict__",
                          f"    if len(d) != {info.size}:",
                          "        check(x)"]
                lines += [f"    v{i} = d[{name!r}]" for i, name in enumerate(info.value)]
            parts = ["NAME_"]
            for i, name in enumerate(info.value):
                if name in info.unordered:
                    parts.append(f"unordered(v{i})")
                else:
                    parts.append(f"v{i} if type(v{i}) in leaves else enc(v{i})")
            # A fixed field: the constant's index, a bare int (`w_fixed` if
            # the core rebound it).
            for j, name in enumerate(info.fixed):
                lines += [f"    f{j} = x.{name}",
                          f"    c{j} = constant_ids.get(id(f{j}))"]
                parts.append(f"c{j} if c{j} is not None else fixed(f{j})")
            lines.append("    return (" + ", ".join(parts) + ",)")
        namespace = dict(self._names_for_writers, NAME_=info.name, check=info.check,
                         pools=self._pools, with_unset=self._with_unset(info))
        exec("\n".join(lines), namespace)  # noqa: S102 - source made here from field names
        return cast(Callable[[Any], Any], namespace["write"])

    def _with_unset(self, info: _ClassInfo) -> Callable[[Any], Any]:
        """A slotted object with a slot never set: written with UNSET there
        (already in the memo: the generated writer registered it)."""
        enc = self._enc

        def write(x: Any) -> Any:
            out: list[Any] = [info.name]
            for name in info.value:
                v = getattr(x, name, _UNSET)
                out.append((UNSET,) if v is _UNSET else v if type(v) in _LEAVES else enc(v))
            return tuple(out)
        return write

    def _reader_for(self, name: str) -> Callable[[Any], Any]:
        kind = _resolve(name)
        info = self._info(kind)
        if info.name != name:
            raise ValueFormError(f"a stored model-checker value names class {name!r}, "
                                 f"which resolves to {info.name}")
        reader = self._generate_reader(info)
        self._readers[name] = reader
        return reader

    def _generate_reader(self, info: _ClassInfo) -> Callable[[Any], Any]:
        namespace = dict(self._names_for_readers, cls=info.cls, new=object.__new__,
                         pools=self._rpools)
        lines = ["def read(a):"]
        if info.named_tuple:
            lines.append("    return cls._make([v if type(v) is not tuple else dec(v) "
                         "for v in a[1:]])")
        else:
            lines.append("    obj = new(cls)")
            if not info.frozen:
                lines.append("    rmemo.append(obj)")
            if info.cls is BlockPool and self.reduce:
                lines += ["    pools.append(obj)",
                          "    v = a[1]",
                          "    obj.observer = v if type(v) is not tuple else dec(v)",
                          "    v = a[2]",
                          "    obj.on_write = v if type(v) is not tuple else dec(v)"]
            elif info.slotted:
                for i, name in enumerate(info.value):
                    namespace[f"set{i}"] = _slot_setter(info.cls, name)
                    lines += [f"    v = a[{i + 1}]",
                              "    if type(v) is not tuple:",
                              f"        set{i}(obj, v)",
                              "    elif v[0] != UNSET:",
                              f"        set{i}(obj, dec(v))"]
                for j, name in enumerate(info.scratch):
                    namespace[f"scratch{j}"] = _slot_setter(info.cls, name)
                    namespace[f"default{j}"] = self._scratch[info.cls, name]
                    lines.append(f"    scratch{j}(obj, "
                                 f"{_fresh(self._scratch[info.cls, name], j)})")
            else:
                n = len(info.value)
                for i in range(n):
                    lines += [f"    v{i} = a[{i + 1}]",
                              f"    if type(v{i}) is tuple:",
                              f"        v{i} = dec(v{i})"]
                for j in range(len(info.fixed)):
                    lines += [f"    v{n + j} = a[{n + j + 1}]",
                              f"    v{n + j} = constants[v{n + j}] if type(v{n + j}) is int "
                              f"else dec(v{n + j})"]
                entries = [f"{name!r}: v{i}"
                           for i, name in enumerate((*info.value, *info.fixed))]
                for j, name in enumerate(info.scratch):
                    namespace[f"default{j}"] = self._scratch[info.cls, name]
                    entries.append(f"{name!r}: {_fresh(self._scratch[info.cls, name], j)}")
                lines.append("    obj.__dict__ = {" + ", ".join(entries) + "}")
            lines.append("    return obj")
        exec("\n".join(lines), namespace)  # noqa: S102 - source made here from field names
        return cast(Callable[[Any], Any], namespace["read"])

    def _enum_named(self, name: str) -> Any:
        cls_name, _, member = name.rpartition(".")
        kind = _resolve(cls_name)
        if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
            raise ValueFormError(f"a stored model-checker value names {name!r}, not an enum")
        value = kind[member]
        self._enums[name] = value
        return value

    # -- the template's constants ----------------------------------------

    def changed(self) -> list[str]:
        """Constants (by their index) whose value is no longer what it was
        when the value form was made: changed in place by the core."""
        return [f"constant {i} ({type(v).__name__})"
                for i, (v, before) in enumerate(zip(self.constants, self._at_start))
                if not _same(v, before)]

    def check_unchanged(self) -> None:
        found = self.changed()
        if found:
            raise SharedStateChanged(
                f"{', '.join(found)} changed in place during the search, but every stored "
                f"state shares it (sim.explore.modelcheck.values.FORMS, fixed): the "
                f"search's states and verdict cannot be trusted; make the field a value "
                f"field")


def _same(a: Any, b: Any) -> bool:
    """Whether ``b`` (a deep copy of ``a`` taken earlier) still equals ``a``
    field by field (objects without ``__eq__`` compare by identity)."""
    if type(a) is not type(b):
        return False
    if a is b or type(a) in _LEAVES or isinstance(a, (enum.Enum, type, types.FunctionType)):
        return a is b or a == b
    if isinstance(a, (tuple, list, deque)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (set, frozenset)):
        return bool(a == b)
    fields = _slots(type(a)) if not hasattr(a, "__dict__") else tuple(vars(a))
    if hasattr(a, "__dict__") and vars(a).keys() != vars(b).keys():
        return False
    return all(_same(getattr(a, f, _UNSET), getattr(b, f, _UNSET)) for f in fields)


class SharedStateChanged(RuntimeError):
    """A value every stored state shares was changed in place during a search."""




# This process's value forms by search (see `form_for`).
_FORMS: dict[str, ValueForm] = {}


def form_for(scope: Scope, protocol: str, reduce: bool, only: Sequence[str] | None
             ) -> ValueForm:
    """This process's value form for a search, made (with its template, the
    search's initial state) the first time it is asked for. One a search:
    states rebuilt by one form hold its template's constants, which another
    form's table does not know (it would write them by value: other keys)."""
    text = repr((scope, protocol, reduce, tuple(sorted(only)) if only is not None else None))
    name = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    form = _FORMS.get(name)
    if form is None or form.changed():
        form = _FORMS[name] = ValueForm(initial(scope, protocol, reduce=reduce, only=only),
                                        reduce)
    return form


__all__ = ["FORMS", "Form", "SharedStateChanged", "ValueForm", "ValueFormError", "form_for"]
