"""kvstate: vLLM's Mooncake Store connector KV-save protocol as state tables,
a sans-IO planner (scheduler side) and executor (one per tensor-parallel rank),
an invariant catalogue and the tools that check implementations against it.

The public API is what ``__all__`` lists; every name is importable from the
package (``from kvstate import Planner, Executor, ConnectorConfig``) and is
loaded on first use, so ``import kvstate`` stays cheap. In groups:

- configuration: `ConnectorConfig`, `GroupSpec`, `GroupKind`, `Role`;
- the records that flow between the pieces (`kvstate.records`): a
  `SchedulerStep` in, a `Plan` out of the planner; `SaveMeta` and `LoadMeta`
  inside a plan; the store calls an executor asks for (`ExistsCall`,
  `PutCall`, `GetCall`); its `Report` / `LoadReport`; the planner's
  `Settlement`; KV events (`BlockStored`);
- the state tables (`kvstate.tables`: one `Machine` per piece of state, its
  states and events, `IllegalTransition`);
- the core: `Planner`, `Executor`, protocol variants (`Variant`, `VARIANTS`,
  `get_variant`);
- checking: the invariant catalogue (`INVARIANTS`, `CATALOGUE`, `broken_by`)
  and its online `Monitor`; observations (`Observation`);
- driving it: the synchronous engine model `Harness` over a `MemoryStore`;
- extending it: the interfaces a planner, executor, store and policy of your
  own must offer (`PlannerProtocol`, `ExecutorProtocol`, `StoreProtocol`, ...:
  `kvstate.protocols`); the Hypothesis machine `kvstate.testing.ConnectorMachine`
  (needs ``kvstate[test]``, so it is not re-exported here);
- traces: `TraceReader`, `TraceError`, `encode_header`, `encode_observation`,
  `trace_schema`. (``kvstate check`` is `sim.traces.check.check_trace`: the core
  imports nothing from ``sim``.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstate.config import ConnectorConfig, GroupKind, GroupSpec, Role
    from kvstate.events import BlockStored, EventQuorum
    from kvstate.executor import Executor, RankJob
    from kvstate.harness import EngineRequest, Harness
    from kvstate.invariants import CATALOGUE, INVARIANTS, Finding, Invariant, Monitor, broken_by
    from kvstate.ledger import Ledger
    from kvstate.memory_store import MemoryStore, StoreRaised
    from kvstate.observations import Observation
    from kvstate.pins import PinPolicy
    from kvstate.planner import LoadResult, LookupQuery, Planner
    from kvstate.protocols import (
        ExecutorFactory,
        ExecutorProtocol,
        JobProtocol,
        MetadataPolicy,
        PlannerFactory,
        PlannerProtocol,
        RetryPolicy,
        StoreProtocol,
    )
    from kvstate.records import (
        NULL_BLOCK_ID,
        CachedRequest,
        ExistsCall,
        GenerationEnd,
        GenerationStart,
        GetCall,
        LoadMeta,
        LoadReport,
        NewRequest,
        Plan,
        PutCall,
        Report,
        ResumedRequest,
        SaveMeta,
        SchedulerStep,
        Settlement,
        Violation,
    )
    from kvstate.tables import (
        JOB,
        MACHINES,
        MACHINES_BY_NAME,
        PIN,
        PRESSURE,
        REQUEST,
        RETRY,
        SAVED_MARK,
        SKIP,
        IllegalTransition,
        JobEvent,
        JobState,
        Machine,
        PinEvent,
        PinState,
        PressureEvent,
        PressureState,
        RequestEvent,
        RequestState,
        RetryEvent,
        RetryState,
        SavedMarkEvent,
        SavedMarkState,
        SkipEvent,
        SkipState,
    )
    from kvstate.trace import (
        TraceError,
        TraceReader,
        encode_header,
        encode_observation,
        trace_schema,
    )
    from kvstate.variants import KVSTATE, MUTANTS, VARIANTS, Variant, get_variant

# Which module defines each public name.
_WHERE: dict[str, str] = {
    'ConnectorConfig': 'kvstate.config',
    'GroupKind': 'kvstate.config',
    'GroupSpec': 'kvstate.config',
    'Role': 'kvstate.config',
    'NULL_BLOCK_ID': 'kvstate.records',
    'CachedRequest': 'kvstate.records',
    'ExistsCall': 'kvstate.records',
    'GenerationEnd': 'kvstate.records',
    'GenerationStart': 'kvstate.records',
    'GetCall': 'kvstate.records',
    'LoadMeta': 'kvstate.records',
    'LoadReport': 'kvstate.records',
    'NewRequest': 'kvstate.records',
    'Plan': 'kvstate.records',
    'PutCall': 'kvstate.records',
    'Report': 'kvstate.records',
    'ResumedRequest': 'kvstate.records',
    'SaveMeta': 'kvstate.records',
    'SchedulerStep': 'kvstate.records',
    'Settlement': 'kvstate.records',
    'Violation': 'kvstate.records',
    'JOB': 'kvstate.tables',
    'MACHINES': 'kvstate.tables',
    'MACHINES_BY_NAME': 'kvstate.tables',
    'PIN': 'kvstate.tables',
    'PRESSURE': 'kvstate.tables',
    'REQUEST': 'kvstate.tables',
    'RETRY': 'kvstate.tables',
    'SAVED_MARK': 'kvstate.tables',
    'SKIP': 'kvstate.tables',
    'IllegalTransition': 'kvstate.tables',
    'JobEvent': 'kvstate.tables',
    'JobState': 'kvstate.tables',
    'Machine': 'kvstate.tables',
    'PinEvent': 'kvstate.tables',
    'PinState': 'kvstate.tables',
    'PressureEvent': 'kvstate.tables',
    'PressureState': 'kvstate.tables',
    'RequestEvent': 'kvstate.tables',
    'RequestState': 'kvstate.tables',
    'RetryEvent': 'kvstate.tables',
    'RetryState': 'kvstate.tables',
    'SavedMarkEvent': 'kvstate.tables',
    'SavedMarkState': 'kvstate.tables',
    'SkipEvent': 'kvstate.tables',
    'SkipState': 'kvstate.tables',
    'LoadResult': 'kvstate.planner',
    'LookupQuery': 'kvstate.planner',
    'Planner': 'kvstate.planner',
    'Executor': 'kvstate.executor',
    'RankJob': 'kvstate.executor',
    'BlockStored': 'kvstate.events',
    'EventQuorum': 'kvstate.events',
    'Observation': 'kvstate.observations',
    'KVSTATE': 'kvstate.variants',
    'MUTANTS': 'kvstate.variants',
    'VARIANTS': 'kvstate.variants',
    'Variant': 'kvstate.variants',
    'get_variant': 'kvstate.variants',
    'CATALOGUE': 'kvstate.invariants',
    'INVARIANTS': 'kvstate.invariants',
    'Finding': 'kvstate.invariants',
    'Invariant': 'kvstate.invariants',
    'Monitor': 'kvstate.invariants',
    'broken_by': 'kvstate.invariants',
    'EngineRequest': 'kvstate.harness',
    'Harness': 'kvstate.harness',
    'MemoryStore': 'kvstate.memory_store',
    'StoreRaised': 'kvstate.memory_store',
    'Ledger': 'kvstate.ledger',
    'PinPolicy': 'kvstate.pins',
    'ExecutorFactory': 'kvstate.protocols',
    'ExecutorProtocol': 'kvstate.protocols',
    'JobProtocol': 'kvstate.protocols',
    'MetadataPolicy': 'kvstate.protocols',
    'PlannerFactory': 'kvstate.protocols',
    'PlannerProtocol': 'kvstate.protocols',
    'RetryPolicy': 'kvstate.protocols',
    'StoreProtocol': 'kvstate.protocols',
    'TraceError': 'kvstate.trace',
    'TraceReader': 'kvstate.trace',
    'encode_header': 'kvstate.trace',
    'encode_observation': 'kvstate.trace',
    'trace_schema': 'kvstate.trace',
}

__all__ = [
    'BlockStored',
    'CATALOGUE',
    'CachedRequest',
    'ConnectorConfig',
    'EngineRequest',
    'EventQuorum',
    'Executor',
    'ExecutorFactory',
    'ExecutorProtocol',
    'ExistsCall',
    'Finding',
    'GenerationEnd',
    'GenerationStart',
    'GetCall',
    'GroupKind',
    'GroupSpec',
    'Harness',
    'INVARIANTS',
    'IllegalTransition',
    'Invariant',
    'JOB',
    'JobEvent',
    'JobProtocol',
    'JobState',
    'KVSTATE',
    'Ledger',
    'LoadMeta',
    'LoadReport',
    'LoadResult',
    'LookupQuery',
    'MACHINES',
    'MACHINES_BY_NAME',
    'MUTANTS',
    'Machine',
    'MemoryStore',
    'MetadataPolicy',
    'Monitor',
    'NULL_BLOCK_ID',
    'NewRequest',
    'Observation',
    'PIN',
    'PRESSURE',
    'PinEvent',
    'PinPolicy',
    'PinState',
    'Plan',
    'Planner',
    'PlannerFactory',
    'PlannerProtocol',
    'PressureEvent',
    'PressureState',
    'PutCall',
    'REQUEST',
    'RETRY',
    'RankJob',
    'Report',
    'RequestEvent',
    'RequestState',
    'ResumedRequest',
    'RetryEvent',
    'RetryPolicy',
    'RetryState',
    'Role',
    'SAVED_MARK',
    'SKIP',
    'SaveMeta',
    'SavedMarkEvent',
    'SavedMarkState',
    'SchedulerStep',
    'Settlement',
    'SkipEvent',
    'SkipState',
    'StoreProtocol',
    'StoreRaised',
    'TraceError',
    'TraceReader',
    'VARIANTS',
    'Variant',
    'Violation',
    'broken_by',
    'encode_header',
    'encode_observation',
    'get_variant',
    'trace_schema',
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
