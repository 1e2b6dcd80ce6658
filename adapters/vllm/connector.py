"""``KvstateConnector``: the kvstate protocol as a vLLM 0.33.0 KV connector.

Load it with::

    KVTransferConfig(kv_connector="KvstateConnector", kv_connector_module_path="adapters.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

The scheduler role is `kvstate.planner.Planner` (`.scheduler_side`), each
worker rank a `kvstate.executor.Executor` on a send thread (`.worker_side`),
the store a real Mooncake store configured from ``MOONCAKE_CONFIG_PATH`` as
upstream's ``MooncakeStoreConnector`` is (`adapters.mooncake`, every call
bounded). The extra-config fields are listed in `.options`.

What travels between the roles: the plan (kvstate's ``Plan``: save and load
metas, ended generations — delta metadata, so its size follows the new blocks,
not the context) as ``KVConnectorMetadata``; the ranks' reports, load reports
and (with a trace or monitor on) observations as ``KVConnectorWorkerMetadata``,
which vLLM aggregates across ranks.

Hybrid models: the connector declares ``SupportsHMA``, so vLLM keeps its
hybrid KV cache manager on; each KV-cache group (full attention, sliding
window) is a kvstate group with its own keys, lookup rule and tables
(`.options.connector_config`; Mamba groups are refused at start, with the
reason), each rank addresses a block in its group's tensors
(`.worker_side.KVLayout`), and a failed load is told per request
(``failed_recving``), the only way vLLM takes it with several groups.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from adapters.mooncake import MooncakeConfig, MooncakeStore
from kvstate.records import LoadReport, Plan, Report
from kvstate.variants import get_variant

from .options import ConnectorOptions, connector_config
from .recorder import EngineLog
from .scheduler_side import SchedulerSide
from .versions import check_vllm_version
from .worker_side import RankObservation, WorkerSide

logger = logging.getLogger("kvstate.vllm")

# The scheduler's client only asks existence questions, so it mounts no
# segment (0: Mooncake's setup then contributes no memory to the store). It
# used to mount the smallest segment Mooncake takes (16 MiB): the master
# placed some objects in it, and they left the store with the engine — the
# holes a second engine found in a prefix the first had stored whole.
LOOKUP_SEGMENT_BYTES = 0
# Its local transfer buffer (it moves no bytes; Mooncake wants one).
LOOKUP_BUFFER_BYTES = 16 << 20

_HASH_NAMES = {"sha256": "vllm-sha256", "sha256_cbor": "vllm-sha256_cbor"}


def trace_header(hash_algo: str, producer: str) -> dict[str, Any]:
    """A trace header's engine fields: the producer, the engine's block-hash
    function and its NONE_HASH, so ``kvstate check`` recomputes event hashes
    the way this engine did (or knows it cannot). Called at the first flush:
    NONE_HASH is settled only once the engine core initialised its hashing."""
    import vllm
    from vllm.v1.core import kv_cache_utils

    header: dict[str, Any] = {"producer": producer, "store": "shared",
                              "vllm": getattr(vllm, "__version__", "unknown"),
                              "block_hash": _HASH_NAMES.get(hash_algo, "opaque")}
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if isinstance(none_hash, bytes):
        header["none_hash"] = none_hash.hex()
    return header


class KvstateConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> every rank."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan


class KvstateWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's reports from the ranks, rank -> scheduler (summed by ``aggregate``)."""

    def __init__(self, reports: list[tuple[tuple[int, int, int], Report]],
                 load_reports: list[LoadReport], observations: list[RankObservation]) -> None:
        self.reports = reports
        self.load_reports = load_reports
        self.observations = observations

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvstateWorkerMetadata:
        assert isinstance(other, KvstateWorkerMetadata)
        self.reports.extend(other.reports)
        self.load_reports.extend(other.load_reports)
        self.observations.extend(other.observations)
        return self


class KvstateConnectorStats(KVConnectorStats):
    """Counters per logging interval, summed over ranks; gauges (pins held,
    jobs in flight, send-queue depth, ledger entries) are the latest values,
    summed over ranks as well (a total across the engine)."""

    GAUGES = ("pins_held", "jobs_in_flight", "send_queue_depth", "ledger_entries",
              "store_recovering")

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvstateConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvstateConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. ``SupportsHMA``: vLLM keeps its hybrid KV
    cache manager on (a sliding-window group frees the blocks that left its
    window); every KV-cache group is a kvstate group (`.options.group_spec`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        import vllm

        check_vllm_version(getattr(vllm, "__version__", "unknown"))
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("KvstateConnector needs the engine's kv_cache_config")
        transfer = vllm_config.kv_transfer_config
        self.options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        self.kv_config = connector_config(vllm_config, kv_cache_config, self.options)
        self.variant = get_variant(self.options.protocol)
        self._kv_cache_config = kv_cache_config
        self._hash_algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "")
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._log: EngineLog | None = None
        self._stores: list[MooncakeStore] = []
        if role == KVConnectorRole.SCHEDULER:
            lookup_store = None
            if self.options.enable_lookup:
                base = MooncakeConfig.from_env()
                lookup_store = self._open(attrs.evolve(
                    base, global_segment_size=LOOKUP_SEGMENT_BYTES, mode="standalone-store",
                    local_buffer_size=LOOKUP_BUFFER_BYTES))
            self._log = EngineLog(self.kv_config, self.variant.name, path=self.options.trace,
                                  monitor=self.options.monitor, header=self._trace_header,
                                  layer=self.options.trace_layer)
            self.scheduler = SchedulerSide(self.kv_config, self.variant,
                                           lookup_store=lookup_store, log=self._log,
                                           load_async=self.options.load_async)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            record = self.options.trace is not None or self.options.monitor != "off"
            store = self._open(MooncakeConfig.from_env())
            self.worker = WorkerSide(self.kv_config, get_tensor_model_parallel_rank(),
                                     self.variant, store, record=record,
                                     load_async=self.options.load_async)

    def _open(self, config: MooncakeConfig) -> MooncakeStore:
        store = MooncakeStore(config, timeout=self.options.store_timeout)
        self._stores.append(store)
        return store

    def _trace_header(self) -> dict[str, Any]:
        return trace_header(self._hash_algo, "kvstate vLLM connector")

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self._log is not None:
            self._log.close()
        for store in self._stores:
            store.close()
        self._stores = []

    # ------------------------------------------------------------------
    # Scheduler role.

    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("KvstateConnector: a scheduler method called on a worker")
        return self.scheduler

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched().pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvstateConnectorMetadata(self._sched().build(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvstateWorkerMetadata):
            # Ranks' reports in the order the trace lists their jobs (by plan,
            # rank, sequence): settling them in any order is the same, and
            # this one lets a recorded trace replay line for line.
            reports = [report for _, report in sorted(meta.reports, key=lambda r: r[0])]
            self._sched().settle(reports, meta.load_reports, meta.observations)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # The pins hold whatever a save job still reads, in every group:
        # never a delayed free.
        self._sched().finished(request.request_id)
        return False, None

    def take_events(self) -> Iterable[Any]:
        return self._sched().take_events()

    def has_pending_push_work(self) -> bool:
        return self._sched().planner.has_pending_push_work()

    @property
    def violations(self) -> list[Any]:
        """What the online monitor found so far (``kvstate_monitor`` log/raise)."""
        return list(self._log.violations) if self._log is not None else []

    # ------------------------------------------------------------------
    # Worker role.

    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("KvstateConnector: a worker method called on the scheduler")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        groups = [list(group.layer_names) for group in self._kv_cache_config.kv_cache_groups]
        self._work().register(kv_caches, self._kv_cache_config.num_blocks, groups)

    def _plan(self) -> Plan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstateConnectorMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._work()
        if worker.load_async:
            worker.queue_loads(self._plan())
        else:
            worker.load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self._work().take_plan(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Nothing is ever sent after a request finished (pins hold what a
        # save still reads); received: the requests whose loads all landed.
        # Their failed blocks go out in this same pass, through
        # get_block_ids_with_load_errors (vLLM's contract: no later than it).
        worker = self._work()
        if not worker.load_async:
            return None, None
        return None, worker.take_landed_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # With several groups a failed load is told per request, in the pass
        # that names it received (`WorkerSide.take_failed_loads`).
        sending, received = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(received or ()),
            failed_recving=self._work().take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        worker = self._work()
        reports, load_reports, observations = worker.take_output()
        if not (reports or load_reports or observations or worker.record):
            return None
        # A recording engine ships metadata every step, empty or not: vLLM
        # calls update_connector_output only for a step with some connector
        # output, and that call is where the recorder writes the step's
        # lines. Without it, a step whose ranks saved and loaded nothing was
        # written only at the next step that did, and an engine killed
        # meanwhile lost every such step (`adapters/vllm/recorder.py`).
        return KvstateWorkerMetadata(reports, load_reports, observations)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is not None:
            return KvstateConnectorStats(data=self.worker.take_counters())
        if self.scheduler is not None:
            return KvstateConnectorStats(data=self.scheduler.stats())
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvstateConnectorStats(data=dict(data or {}))


__all__ = ["KvstateConnector", "KvstateConnectorMetadata", "KvstateWorkerMetadata",
           "KvstateConnectorStats"]
