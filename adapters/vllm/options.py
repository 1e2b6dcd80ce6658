"""What a user configures: vLLM's ``kv_connector_extra_config`` read once, checked once.

The connector accepts upstream ``MooncakeStoreConnector``'s field names for
what both connectors share (``save_decode_cache``, ``enable_lookup``,
``cache_prefix``; the store itself from ``MOONCAKE_CONFIG_PATH``), so a
deployment switches connectors by changing the class name, plus kvstate's own
fields, all prefixed ``kvstate_``:

- ``kvstate_protocol``: ``kvstate`` (default) or any variant name
  (`kvstate.variants.VARIANTS`), e.g. ``e2`` to run upstream's bookkeeping;
- ``kvstate_trace``: a path; the scheduler writes the engine's trace there;
- ``kvstate_trace_layer``: ``annotated`` (default: kvstate's internals too) or
  ``observed`` (only what vLLM's own objects show, `kvstate.contract`);
- ``kvstate_monitor``: ``off`` | ``log`` | ``raise`` — the invariant catalogue
  online, inside the engine;
- ``kvstate_store_timeout``: seconds one store call may take (upstream has no
  bound: S6);
- ``kvstate_put_step``: override the derived replication factor;
- ``kvstate_load_async``: ``true`` (default) loads in a receive thread while
  the engine runs other requests (the request waits in vLLM's
  ``WAITING_FOR_REMOTE_KVS``), as upstream's connector does; ``false`` makes
  the forward pass wait for the store (synchronous loads).

Unknown ``kvstate_*`` fields are refused (a typo must not silently turn a
monitor off), and so is any field that reads as one of the connector's own
names misspelt (other case, ``-`` for ``_``, a letter or two off:
``KVSTATE_MONITOR``, ``save_decode_cahce``); other unknown fields are left to
whoever else reads the dict. A bad value raises ``ValueError`` naming the
field and the value, and a ``kvstate_trace`` that cannot be written is
refused when the connector is built, not at the first step that writes it.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import attrs

from adapters.mooncake import not_text
from adapters.mooncake import shown as _shown
from kvstate.trace.destination import unwritable
from kvstate.variants import VARIANTS, is_variant

MONITOR_MODES = ("off", "log", "raise")
# Bounds on what a user may configure, so that a typo is refused at start:
# a store call shorter than a millisecond cannot succeed (a loopback round
# trip is ~0.1 ms before any bytes move); an hour is the old upper bound.
MIN_STORE_TIMEOUT = 0.001
MAX_STORE_TIMEOUT = 3600.0
# The replication factor divides the TP size, which a trace bounds at 1,024
# ranks (`kvstate.trace.LIMITS`).
MAX_PUT_STEP = 1024
# The prefix starts every store key the connector writes: a namespace, not a
# payload (Mooncake keys are meant to be short).
MAX_CACHE_PREFIX = 256

KNOWN_KVSTATE_FIELDS = (
    "kvstate_protocol", "kvstate_trace", "kvstate_trace_layer", "kvstate_monitor",
    "kvstate_store_timeout", "kvstate_put_step", "kvstate_load_async",
)
TRACE_LAYERS = ("annotated", "observed")
# Upstream MooncakeStoreConnector's names this connector reads too.
SHARED_FIELDS = ("save_decode_cache", "enable_lookup", "cache_prefix")
# How close a field must be to one of ours to be taken for its misspelling
# (difflib's ratio: "save_decode_cahce" is 0.94 from "save_decode_cache",
# unrelated names like "mooncake_protocol" stay below 0.6).
MISSPELT = 0.85


def _misspelling(field: str) -> str | None:
    """The connector's own field ``field`` looks like a misspelling of."""
    ours = (*KNOWN_KVSTATE_FIELDS, *SHARED_FIELDS)
    if field in ours:
        return None
    folded = field.lower().replace("-", "_")
    for name in ours:
        if folded == name or folded.replace("_", "") == name.replace("_", ""):
            return name
    close = difflib.get_close_matches(folded, ours, n=1, cutoff=MISSPELT)
    return close[0] if close else None



def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"kv_connector_extra_config[{field!r}]={_shown(value)}: {why}")





def _flag(extra: dict[str, Any], field: str, default: bool) -> bool:
    value = extra.get(field, default)
    if isinstance(value, bool):
        return value
    # vLLM's JSON CLI hands strings through as given ("true"/"false").
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _bad(field, value, "expected true or false")


@attrs.frozen(slots=True)
class ConnectorOptions:
    protocol: str = "kvstate"
    save_decode_cache: bool = False
    enable_lookup: bool = True
    cache_prefix: str = ""
    trace: str | None = None
    trace_layer: str = "annotated"
    monitor: str = "off"
    store_timeout: float = 5.0
    put_step: int | None = None
    load_async: bool = True

    @classmethod
    def from_extra_config(cls, extra: Any) -> ConnectorOptions:
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ValueError(f"kv_connector_extra_config={_shown(extra)}: expected a JSON object "
                             f"(field names to values), got {type(extra).__name__}")
        extra = dict(extra)
        for field in extra:
            if not isinstance(field, str):
                raise ValueError(f"kv_connector_extra_config: field names must be strings, "
                                 f"got {_shown(field)}")
            if field.startswith("kvstate_") and field not in KNOWN_KVSTATE_FIELDS:
                known = ", ".join(KNOWN_KVSTATE_FIELDS)
                raise _bad(field, extra[field], f"unknown kvstate field (known: {known})")
            meant = _misspelling(field)
            if meant is not None:
                raise _bad(field, extra[field], f"not a field; did you mean {meant!r}?")
        protocol = extra.get("kvstate_protocol", "kvstate")
        try:
            known_protocol = isinstance(protocol, str) and is_variant(protocol)
        except ValueError as exc:  # a module KVSTATE_VARIANTS names does not import
            raise _bad("kvstate_protocol", protocol, str(exc)) from None
        if not known_protocol:
            raise _bad("kvstate_protocol", protocol,
                       f"unknown protocol (one of: {', '.join(sorted(VARIANTS))})")
        trace = extra.get("kvstate_trace")
        if trace is not None and (not isinstance(trace, str) or not trace):
            raise _bad("kvstate_trace", trace, "expected a file path")
        if trace is not None:
            trace = os.path.expanduser(trace)
            why = unwritable(trace)
            if why is not None:
                raise _bad("kvstate_trace", trace, f"cannot be written: {why}")
        layer = extra.get("kvstate_trace_layer", "annotated")
        if layer not in TRACE_LAYERS:
            raise _bad("kvstate_trace_layer", layer, f"expected one of {', '.join(TRACE_LAYERS)}")
        monitor = extra.get("kvstate_monitor", "off")
        if monitor not in MONITOR_MODES:
            raise _bad("kvstate_monitor", monitor, f"expected one of {', '.join(MONITOR_MODES)}")
        timeout = extra.get("kvstate_store_timeout", 5.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                MIN_STORE_TIMEOUT <= timeout <= MAX_STORE_TIMEOUT):
            raise _bad("kvstate_store_timeout", timeout,
                       f"expected seconds in [{MIN_STORE_TIMEOUT}, {MAX_STORE_TIMEOUT}]")
        put_step = extra.get("kvstate_put_step")
        if put_step is not None and (isinstance(put_step, bool) or not isinstance(put_step, int)
                                     or not 1 <= put_step <= MAX_PUT_STEP):
            raise _bad("kvstate_put_step", put_step, f"expected an integer in 1..{MAX_PUT_STEP}")
        prefix = extra.get("cache_prefix", "")
        if not isinstance(prefix, str) or "@" in prefix or len(prefix) > MAX_CACHE_PREFIX \
                or not_text(prefix):
            raise _bad("cache_prefix", prefix,
                       f"expected a string without '@', NUL or lone surrogates, at most "
                       f"{MAX_CACHE_PREFIX} characters")
        return cls(
            protocol=protocol,
            save_decode_cache=_flag(extra, "save_decode_cache", False),
            enable_lookup=_flag(extra, "enable_lookup", True),
            cache_prefix=prefix,
            trace=trace,
            trace_layer=layer,
            monitor=monitor,
            store_timeout=float(timeout),
            put_step=put_step,
            load_async=_flag(extra, "kvstate_load_async", True),
        )


def replication_factor(vllm_config: Any, tp_size: int) -> int:
    """Upstream's ``put_step`` for one attention group: byte-identical TP
    replicas (MLA: every rank; GQA with fewer KV heads than ranks:
    ``tp_size // num_kv_heads``; else 1)."""
    model = vllm_config.model_config
    if getattr(model, "use_mla", False):
        return tp_size
    heads = model.get_total_num_kv_heads()
    return max(1, tp_size // max(1, heads))


def connector_config(vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions) -> Any:
    """The protocol's ``ConnectorConfig`` for this engine, from vLLM's configs:
    one ``GroupSpec`` per KV-cache group (`kv_cache_groups`).

    Refuses, with the reason, what the connector does not model: pipeline
    parallelism, decode/prefill context parallelism, and KV-cache groups other
    than full attention and sliding window (`group_spec`).
    """
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from kvstate.config import ConnectorConfig, Role

    parallel = vllm_config.parallel_config
    unsupported = []
    if parallel.pipeline_parallel_size > 1:
        unsupported.append(f"pipeline_parallel_size={parallel.pipeline_parallel_size}")
    if parallel.decode_context_parallel_size > 1:
        unsupported.append(f"decode_context_parallel_size={parallel.decode_context_parallel_size}")
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        unsupported.append(f"prefill_context_parallel_size={parallel.prefill_context_parallel_size}")
    groups = kv_cache_config.kv_cache_groups
    specs = []
    for g, group in enumerate(groups):
        spec = group_spec(g, group)
        if isinstance(spec, str):
            unsupported.append(spec)
        else:
            specs.append(spec)
    sizes = sorted({_unwrap(group.kv_cache_spec).block_size for group in groups})
    if len(sizes) > 1:
        # kvstate's GroupSpec has no block size of its own: every group is
        # chunked, keyed and masked in the connector's one block size.
        # Upstream stores each group in its own block size at the lcm's
        # alignment, which the model cannot state yet.
        unsupported.append(f"KV-cache groups of different block sizes {sizes}")
    role = vllm_config.kv_transfer_config.kv_role
    windowed = any(spec.sliding_window is not None for spec in specs)
    if windowed and role == Role.CONSUMER.value and options.save_decode_cache:
        # A consumer's first decode save backfills the prompt, planned long
        # after vLLM freed the prompt's blocks that left the window: the job
        # would read blocks another request may have taken
        # (`scheduler_side.SchedulerSide._window_fence`).
        unsupported.append("save_decode_cache on a kv_consumer with a sliding-window group")
    if len(groups) > 1 and not options.load_async:
        # vLLM 0.33.0 takes no block-level load failure from an engine with
        # several groups (block ids are only unique within a group: the
        # scheduler raises); a failed load is reported per request
        # (failed_recving), which exists only for asynchronous loads.
        unsupported.append("kvstate_load_async=false with several KV-cache groups")
    if unsupported:
        raise ValueError("KvstateConnector does not support " + "; ".join(unsupported))
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    tp_size = parallel.tensor_parallel_size
    put_step = options.put_step or replication_factor(vllm_config, tp_size)
    if tp_size % put_step:
        raise _bad("kvstate_put_step", put_step, f"must divide the TP size {tp_size}")
    kv_events = vllm_config.kv_events_config
    return ConnectorConfig(
        role=Role(role),
        block_size=block_size,
        hash_block_size=hash_block_size if hash_block_size != block_size else None,
        world_size=tp_size,
        put_step=put_step,
        save_decode_cache=options.save_decode_cache,
        enable_kv_events=bool(kv_events and kv_events.enable_kv_cache_events),
        model_name=vllm_config.model_config.model,
        cache_prefix=options.cache_prefix,
        groups=tuple(specs),
    )


def _unwrap(spec: Any) -> Any:
    """A group whose layers differ only in shape (``UniformTypeKVCacheSpecs``)
    is managed as its layers' one kind, as upstream reads it."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


# Why a Mamba group is refused. Upstream stores a Mamba group (``align``
# mode) through two paths the model has no words for yet: boundary states,
# a request's recurrent state at a chunk boundary handed over by vLLM with
# its exact block (``kv_connector_block_state.boundary_state_offloads``,
# pinned outside any save job, since Mamba block tables are not append-only:
# interior state blocks are nulled and freed, speculative blocks relocate);
# and partial tails, the state at a prompt end inside a block, registered at
# finish (``register_finished_partial_tail``). Neither is a chunk of a
# prefix: the planner's jobs, pins and saved offsets, and the checker's
# invariants, would first have to state what a state block holds and when
# its bytes are final.
MAMBA_REFUSAL = ("a Mamba (state-space) group: its boundary states and partial tails are not "
                 "chunks of a prefix, and kvstate's model cannot state or check them yet")


def group_spec(index: int, group: Any) -> Any:
    """The ``GroupSpec`` of one vLLM KV-cache group, or why it is refused.

    Kinds follow vLLM's own manager of the group (``KVCacheSpecRegistry``):
    ``FullAttentionManager`` (full attention, MLA) and ``SlidingWindowManager``
    (sliding window, MLA with a window) are modelled; a window spec's
    ``extra_retained_tokens`` widen its window, as upstream's coverage spec
    does (an external hit allocates those blocks too)."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from kvstate.config import GroupKind, GroupSpec

    spec = _unwrap(group.kv_cache_spec)
    name = type(spec).__name__
    where = f"KV-cache group {index} ({name})"
    if not group.enable_kv_transfer or not spec.prefix_cacheable:
        return f"{where}: not transferable or not prefix-cacheable"
    if group.is_eagle_group or group.host_resident:
        return f"{where}: EAGLE drafter or host-resident groups"
    manager = KVCacheSpecRegistry.get_manager_class(spec, getattr(group, "role", None))
    if manager is MambaManager:
        return f"{where}: {MAMBA_REFUSAL}"
    if manager is FullAttentionManager:
        return GroupSpec()
    if manager is SlidingWindowManager:
        window = spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
        return GroupSpec(GroupKind.SLIDING_WINDOW, window)
    return f"{where}: kept by vLLM's {getattr(manager, '__name__', manager)}, not modelled"
