"""Connector configuration: the knobs upstream's connector reads, validated once.

Every field is checked when the record is built, so a planner or executor never
sees an impossible configuration. A bad value raises ``ValueError`` naming the
field and the value (``ConnectorConfig.block_size=24: ...``) so whoever wrote the
configuration can find it without reading a traceback.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs


class Role(enum.Enum):
    """The connector's ``kv_role`` (vLLM's names, kept verbatim)."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"ConnectorConfig.{field}={value!r}: {why}")


def _role(value: Any) -> Role:
    if isinstance(value, Role):
        return value
    for role in Role:
        if value in (role.value, role.name.lower()):
            return role
    names = ", ".join(r.value for r in Role)
    raise _bad("role", value, f"unknown role (expected one of {names})")


@attrs.frozen(slots=True)
class GroupSpec:
    """One KV-cache group. Every group shares the connector's block size here;
    upstream's hybrid models with per-group block sizes are out of scope (the
    connector there works in lcm-sized chunks, which is what ``block_size`` is)."""

    kind: GroupKind = GroupKind.FULL
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise ValueError(f"GroupSpec.kind={self.kind!r}: expected a GroupKind")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                raise ValueError(
                    f"GroupSpec.sliding_window={self.sliding_window!r}: a sliding-window "
                    "group needs a window of at least 1 token"
                )
        elif self.sliding_window is not None:
            raise ValueError(
                f"GroupSpec.sliding_window={self.sliding_window!r}: only a sliding-window "
                "group has a window"
            )


def _positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(field, value, "must be an integer >= 1")


@attrs.frozen(slots=True)
class ConnectorConfig:
    """What the scheduler side and every rank agree on.

    ``put_step`` is upstream's replication factor: 1 when every rank
    holds distinct KV heads, ``world_size`` for MLA (every rank holds the same
    bytes, so each chunk is stored by exactly one rank).
    ``alignment`` is the lcm boundary (defaults to ``block_size``).
    ``pressure_backoff`` is in the injected clock's units (seconds for a real
    clock, virtual time in the simulator).
    """

    role: Role = attrs.field(default=Role.BOTH, converter=_role)
    block_size: int = 16
    hash_block_size: int | None = None
    world_size: int = 1
    put_step: int = 1
    save_decode_cache: bool = False
    enable_kv_events: bool = False
    model_name: str = "test-model"
    cache_prefix: str = ""
    config_fingerprint: str = ""
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0
    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    alignment: int | None = None
    pressure_backoff: float = 1.0

    def __attrs_post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("world_size", self.world_size)
        _positive("put_step", self.put_step)
        if self.hash_block_size is not None:
            _positive("hash_block_size", self.hash_block_size)
            if self.block_size % self.hash_block_size:
                raise _bad(
                    "block_size",
                    self.block_size,
                    f"must be a multiple of hash_block_size={self.hash_block_size}",
                )
        if self.alignment is not None:
            _positive("alignment", self.alignment)
            if self.alignment % self.block_size:
                raise _bad(
                    "alignment", self.alignment, f"must be a multiple of block_size={self.block_size}"
                )
        if self.world_size % self.put_step:
            raise _bad(
                "put_step", self.put_step, f"must divide world_size={self.world_size}"
            )
        for name in ("pcp_rank", "dcp_rank", "pp_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _bad(name, value, "must be an integer >= 0")
        if not self.groups:
            raise _bad("groups", self.groups, "at least one KV-cache group is needed")
        for i, group in enumerate(self.groups):
            if not isinstance(group, GroupSpec):
                raise _bad(f"groups[{i}]", group, "expected a GroupSpec")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise _bad("model_name", self.model_name, "must be a non-empty string")
        for name in ("cache_prefix", "config_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or "@" in value:
                raise _bad(name, value, "must be a string without '@' (the key separator)")
        if not isinstance(self.pressure_backoff, (int, float)) or self.pressure_backoff <= 0:
            raise _bad("pressure_backoff", self.pressure_backoff, "must be a number > 0")
        for name in ("save_decode_cache", "enable_kv_events"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be true or false")

    @property
    def hash_block(self) -> int:
        """Granularity of the request's hash chain (defaults to the block size)."""
        return self.hash_block_size or self.block_size

    @property
    def hashes_per_block(self) -> int:
        return self.block_size // self.hash_block

    @property
    def lcm_block_size(self) -> int:
        """Only prefixes aligned to this are stored (upstream: the lcm of the
        groups' block sizes, e.g. a hybrid model's full-attention chunk). It is a
        multiple of ``block_size``; sliding-window groups keep only the blocks a
        hit at one of these boundaries needs."""
        return self.alignment or self.block_size

    @property
    def num_namespaces(self) -> int:
        """Distinct key namespaces across ranks (``tp_rank // put_step``)."""
        return self.world_size // self.put_step

    @property
    def quorum(self) -> int:
        """Distinct ranks that must report a stored chunk before its event is
        published: each namespace holds one shard of it."""
        return math.ceil(self.world_size / self.put_step)

    @property
    def is_consumer(self) -> bool:
        return self.role is Role.CONSUMER
