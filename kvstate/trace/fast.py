"""The fast path: typed decoding in C (msgspec, optional)."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

import attrs

from kvstate.contract import ANNOTATIONS, OMITTABLE
from kvstate.trace.codec import NO_ABSENT, OBSERVATIONS, _type_name

#
# ``kvstate check`` spends most of its time turning JSON into checked records.
# With msgspec installed, every observation type is mirrored as a msgspec
# ``Struct`` built from the same registry (same names, fields, defaults), and
# one typed decoder parses and checks a line in C: types, required and unknown
# fields, record tags, list shapes. What it cannot express is kept exact:
# ``{"@hex": ...}`` goes through ``bytes.fromhex`` in a hook, a nested record
# must carry its ``"@"`` tag (a union with a never-matching twin makes msgspec
# require it), time must be finite, and any line msgspec refuses is decoded
# again by the checked Python decoder (`kvstate.trace.codec`), which raises the precise
# ``TraceError`` (file:line:field:value) or — where msgspec is stricter than
# the format (an integer beyond 64 bits, 1e999) — accepts it. So the fast path
# accepts exactly what the checked decoder accepts. Its records are structs
# shaped like the attrs records (same field names and values; hashes are a
# ``bytes`` subclass, enum values a small struct), so only readers that read
# fields (the monitors) take them: ``TraceReader(path, fast=True)``.
# Measured (`kvstate bench check`): see README "Measured".

try:
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - exercised where msgspec is absent
    _msgspec = None  # type: ignore[assignment]


class _Hex(bytes):
    """A block hash decoded on the fast path (``bytes`` in all but name)."""

    __slots__ = ()


class _Impossible:
    """The field type of a never-matching twin: its hook always refuses."""


def _fast_hook(kind: Any, value: Any) -> Any:
    if kind is _Hex and type(value) is dict and len(value) == 1:
        text = value.get("@hex")
        if type(text) is str:
            return _Hex.fromhex(text)  # ValueError: not hex, refused like the slow path
    raise ValueError(f"not a {getattr(kind, '__name__', kind)}")


class _FastCodec:
    """Structs mirroring the registry and one typed decoder over all
    observation types (tagged by ``"type"``)."""

    def __init__(self) -> None:
        ms = _msgspec
        assert ms is not None
        self.structs: dict[Any, Any] = {}
        self.defaults: dict[str, tuple[str | None, dict[str, Any]]] = {}
        # Records holding annotations (a Plan, a Settlement): those fields
        # decode to UNSET when left out, so ``fill`` can tell.
        self.unset: dict[Any, tuple[str, ...]] = {
            attrs.fields_dict(OBSERVATIONS[kind])[holder].type: names
            for kind, (holder, names) in ANNOTATIONS.items() if holder is not None}
        lines = []
        for name, cls in sorted(OBSERVATIONS.items()):
            holder, names = ANNOTATIONS.get(name, (None, ()))
            fields: list[tuple[Any, ...]] = [("i", int), ("e", int), ("t", float)]
            omittable = OMITTABLE.get(name, {})
            for f in attrs.fields(cls):
                unset = holder is None and f.name in names
                fields.append(self._field(f, unset, omittable))
            lines.append(ms.defstruct(name, fields, tag_field="type", tag=name,
                                      forbid_unknown_fields=True, gc=False, kw_only=True))
            if name in ANNOTATIONS:
                record: Any = attrs.fields_dict(cls)[holder].type if holder else cls
                self.defaults[name] = (holder, {
                    f.name: f.default for f in attrs.fields(record) if f.name in names})
        self.decoder = ms.json.Decoder(typing.Union[tuple(lines)],  # noqa: UP007 - built
                                       dec_hook=_fast_hook)

    def _field(self, f: Any, unset: bool, omittable: dict[str, Any]) -> tuple[Any, ...]:
        kind = self._type(f.type)
        if unset:
            return (f.name, typing.Union[kind, _msgspec.UnsetType],  # noqa: UP007
                    _msgspec.UNSET)
        if f.name in omittable:  # left out by the observed layer: reads as the table says
            return (f.name, kind, omittable[f.name])
        if f.default is attrs.NOTHING:
            return (f.name, kind)
        return (f.name, kind, f.default)

    def _type(self, annotation: Any) -> Any:
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if origin in (typing.Union, types.UnionType):
            return typing.Union[tuple(self._type(a) for a in args)]  # noqa: UP007
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple[self._type(args[0]), ...]  # type: ignore[misc]
            return tuple[tuple(self._type(a) for a in args)]  # type: ignore[misc]
        if annotation is bytes:
            return _Hex
        if annotation in (int, str, float, bool, type(None)):
            return annotation
        if isinstance(annotation, type) and (attrs.has(annotation)
                                             or issubclass(annotation, enum.Enum)):
            found = self.structs.get(annotation)
            if found is None:
                found = self.structs[annotation] = self._record(annotation)
            return found
        raise TypeError(f"no fast decoding for {_type_name(annotation)}")

    def _record(self, cls: type) -> Any:
        ms = _msgspec
        assert ms is not None
        if issubclass(cls, enum.Enum):
            values = tuple(m.value for m in cls)
            struct = ms.defstruct(cls.__name__, [("value", typing.Literal[values])],
                                  tag_field="@enum", tag=cls.__name__,
                                  forbid_unknown_fields=True, gc=False)
            tag = "@enum"
        else:
            unset = self.unset.get(cls, ())
            fields = attrs.fields(cls)  # type: ignore[arg-type]
            struct = ms.defstruct(cls.__name__,
                                  [self._field(f, f.name in unset,
                                               OMITTABLE.get(cls.__name__, {}))
                                   for f in fields],
                                  tag_field="@", tag=cls.__name__,
                                  forbid_unknown_fields=True, gc=False, kw_only=True)
            tag = "@"
        # A tagged struct alone accepts a missing tag; in a union it is required.
        twin = ms.defstruct(f"{cls.__name__}Twin", [("never", _Impossible)], tag_field=tag,
                            tag=f"\x00{cls.__name__}", forbid_unknown_fields=True, gc=False)
        return typing.Union[struct, twin]  # noqa: UP007

    def fill(self, kind: str, obs: Any) -> frozenset[str]:
        """Replace the annotations a line left out by their defaults; their names."""
        holder, defaults = self.defaults[kind]
        record = obs if holder is None else getattr(obs, holder)
        missing = []
        unset = _msgspec.UNSET
        for name, default in defaults.items():
            if getattr(record, name) is unset:
                setattr(record, name, default)
                missing.append(name)
        return frozenset(missing) if missing else NO_ABSENT


_FAST: list[_FastCodec | None] = []


def fast_codec() -> _FastCodec | None:
    """The fast decoder, built once; ``None`` without msgspec."""
    if not _FAST:
        _FAST.append(_FastCodec() if _msgspec is not None else None)
    return _FAST[0]
