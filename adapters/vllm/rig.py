"""A vLLM engine without a model: the real ``Scheduler`` and KV cache manager,
connector workers built the way vLLM builds them, and a fake forward pass.

A test double shipped with the package (in trio's spirit): the connector's
tests, ``kvstate bench vllm`` and the interop check all drive vLLM through it.

- ``tiny_model_dir`` writes a Llama ``config.json`` (no weights) that
  ``ModelConfig`` accepts offline with ``skip_tokenizer_init``.
- ``Rig`` holds one ``Scheduler`` and one worker connector per TP rank, each
  with CPU KV tensors laid out blocks-first (``(num_blocks, 2, block_size,
  heads, head_dim)`` per layer). ``step()`` does what vLLM's engine core and
  model runner do per step: ``schedule()``, then per worker bind the
  metadata, load (before the forward when the step has synchronous loads),
  the forward pass, ``wait_for_save``, collect load errors, worker metadata
  and stats, then ``update_from_output()`` with the ranks' outputs aggregated
  by vLLM's own ``KVOutputAggregator``.
- The fake forward writes, for every computed token position, values derived
  from the prefix up to it (a rolling hash of the token ids), the layer and
  the rank's key namespace — so two requests with a common prefix have equal
  KV bytes for it, as with a real model, and ``expected_block`` says what any
  block must hold. Sampled tokens derive from the request id and position.
- ``Rig(sliding_window=W)`` runs a hybrid model: full attention on layers 0
  and 2, a sliding window of ``W`` tokens on layers 1 and 3, each group with
  its own block tables in vLLM's hybrid KV cache manager, when the
  connector declares ``SupportsHMA`` (`hybrid_manager_on`); otherwise one
  full-attention group of all four layers, as vLLM unifies the specs. The
  KV tensors are laid out as vLLM lays out a hybrid model's: one tensor per
  layer slot, shared by one layer of each group.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # traffic stays on loopback

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

EOS = 2
LAYERS = 2
HEADS = 2
HEAD_DIM = 8  # the default; Rig(head_dim=) makes blocks bigger (a store fills sooner)
_MASK = (1 << 64) - 1
_MODULUS = 65521  # a prime below 2**16: values stay exact in float32


def tiny_model_dir(path: str | Path, num_kv_heads: int = HEADS) -> str:
    """A directory holding only a tiny Llama ``config.json`` (no weights)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
        "num_attention_heads": max(4, num_kv_heads), "num_key_value_heads": num_kv_heads, "vocab_size": 32000,
        "max_position_embeddings": 1 << 18, "torch_dtype": "float32",
    }))
    return str(path)


def layer_names(count: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(count)]


# A hybrid model's layers (`Rig` with a sliding window): full attention on
# even layers, the window on odd ones (Gemma-like interleaving).
HYBRID_LAYERS = 4


def prefix_values(tokens: list[int]) -> list[int]:
    """One value per position, determined by every token up to it (FNV-1a)."""
    h = 0xCBF29CE484222325
    out = []
    for token in tokens:
        h = ((h ^ token) * 0x100000001B3) & _MASK
        out.append(h % _MODULUS)
    return out


def sampled_token(req_id: str, position: int) -> int:
    seed = sum(map(ord, req_id)) * 7919 + position * 104729
    return 100 + seed % 30000


@contextlib.contextmanager
def tp_rank(rank: int, world: int) -> Iterator[None]:
    """Build a worker connector for ``rank`` of ``world`` in this process:
    vLLM's parallel-state queries answer as that rank would."""
    import vllm.distributed.parallel_state as ps

    saved = ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size
    ps.get_tensor_model_parallel_rank = lambda: rank
    ps.get_tensor_model_parallel_world_size = lambda: world
    try:
        yield
    finally:
        ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size = saved


def make_vllm_config(model_dir: str, *, connector: str = "KvstateConnector",
                     module: str | None = "adapters.vllm", role: str = "kv_both",
                     extra: dict[str, Any] | None = None, block_size: int = 16,
                     num_blocks: int = 64, tp: int = 1, kv_events: bool = False,
                     max_num_batched_tokens: int = 256, max_model_len: int = 4096,
                     max_num_seqs: int = 16, kv_load_failure_policy: str = "recompute",
                     ) -> VllmConfig:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32")
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_chunked_prefill=True,
                                is_encoder_decoder=False)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    transfer = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                                kv_role=role,  # type: ignore[arg-type]  # vLLM checks it
                                kv_connector_extra_config=dict(extra or {}),
                                kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
                                )
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                        device_config=DeviceConfig("cpu"), kv_transfer_config=transfer,
                        parallel_config=ParallelConfig(tensor_parallel_size=tp),
                        kv_events_config=events)
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def make_kv_cache_config(num_blocks: int, block_size: int, head_dim: int = HEAD_DIM,
                         sliding_window: int | None = None, hybrid: bool = True,
                         ) -> KVCacheConfig:
    """One full-attention group of ``LAYERS`` layers; with ``sliding_window``,
    ``HYBRID_LAYERS`` layers: two groups (full attention on even layers, the
    window on odd ones) when ``hybrid``, else one full-attention group of all
    of them (what vLLM makes of a sliding-window model when its hybrid KV
    cache manager is off)."""
    def full() -> FullAttentionSpec:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS,
                                 head_size=head_dim, dtype=torch.float32)

    if sliding_window is None:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(layer_names(), full())])
    names = layer_names(HYBRID_LAYERS)
    if not hybrid:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(names, full())])
    window: KVCacheSpec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=HEADS, head_size=head_dim, dtype=torch.float32,
        sliding_window=sliding_window)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[0::2], full()), KVCacheGroupSpec(names[1::2], window)])


def hybrid_manager_on(vllm_config: VllmConfig) -> bool:
    """Decide, as vLLM 0.33.0's ``VllmConfig`` does on a platform with
    hybrid KV caches (CPU, CUDA) when nobody chose, whether the hybrid KV
    cache manager stays on: only if the configured connector declares
    ``SupportsHMA``. This process's platform is vLLM's unspecified one,
    which turns the manager off for everyone, so the rig decides."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    scheduler = vllm_config.scheduler_config
    transfer = vllm_config.kv_transfer_config
    on = transfer is None or KVConnectorFactory.supports_hma_config(transfer)
    scheduler.disable_hybrid_kv_cache_manager = not on
    return on


class Rig:
    """See the module docstring. ``workers`` may be given (a test that builds
    them through vLLM's own initialisation); otherwise one connector per rank
    is built here with ``role=WORKER``."""

    def __init__(self, vllm_config: VllmConfig, num_blocks: int, *,
                 workers: list[Any] | None = None, put_step: int = 1,
                 head_dim: int = HEAD_DIM, sliding_window: int | None = None) -> None:
        init_none_hash(sha256)
        self.config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = num_blocks
        hybrid = sliding_window is not None and hybrid_manager_on(vllm_config)
        self.kv_cache_config = make_kv_cache_config(num_blocks, self.block_size, head_dim,
                                                    sliding_window, hybrid)
        # Each group's layers, with each layer's index (its values' offset).
        self.groups = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        self.layer_index = {name: int(name.split(".")[2])
                            for names in self.groups for name in names}
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.block_size)
        self.connector = self.scheduler.connector
        if self.connector is not None:
            # vLLM hands take_events() to its publisher; keep a copy to inspect.
            take = self.connector.take_events
            self.connector.take_events = lambda: self._keep(take())  # type: ignore[method-assign]
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.put_step = put_step
        self.caches: list[dict[str, torch.Tensor]] = []
        if workers is None:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            workers = []
            for rank in range(tp):
                with tp_rank(rank, tp):
                    workers.append(KVConnectorFactory.create_connector(
                        vllm_config, KVConnectorRole.WORKER, self.kv_cache_config))
        self.workers = workers
        for worker in self.workers:
            caches = self._kv_tensors(head_dim)
            worker.register_kv_caches(caches)
            self.caches.append(caches)
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.finished: list[str] = []
        self.events: list[Any] = []
        self.stats: list[dict[str, Any]] = []
        self.invalid_block_ids: set[int] = set()
        # vLLM's own rules: a transfer is finished once every rank reported it;
        # worker metadata and stats are aggregate()d across ranks.
        self.aggregator = KVOutputAggregator(len(self.workers))
        # Called with each worker after its wait_for_save, before its
        # get_finished: a harness waits there for the connector's threads
        # (`adapters.vllm.load_conformance`).
        self.settle: Callable[[Any], None] | None = None

    def _kv_tensors(self, head_dim: int) -> dict[str, torch.Tensor]:
        """One rank's KV tensors by layer: the i-th layer of every group
        shares the i-th tensor (vLLM's layout; one group: a tensor a layer)."""
        slots: list[torch.Tensor] = []
        caches: dict[str, torch.Tensor] = {}
        for names in self.groups:
            for i, name in enumerate(names):
                if i == len(slots):
                    slots.append(torch.zeros(
                        (self.num_blocks, 2, self.block_size, HEADS, head_dim),
                        dtype=torch.float32))
                caches[name] = slots[i]
        return dict(sorted(caches.items(), key=lambda item: self.layer_index[item[0]]))

    def _keep(self, events: Any) -> list[Any]:
        events = list(events)
        self.events.extend(events)
        return events

    # ------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(request_id=req_id, prompt_token_ids=list(prompt),
                          sampling_params=params, pooling_params=None,
                          block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def namespace(self, rank: int) -> int:
        return rank // self.put_step

    def expected_value(self, tokens: list[int], position: int, layer: int, rank: int) -> float:
        return float(prefix_values(tokens[:position + 1])[-1]
                     + 65536 * (layer + 4 * self.namespace(rank)))

    def block_holds(self, rank: int, block: int, tokens: list[int], first_position: int,
                    group: int = 0) -> bool:
        """Does ``block`` of ``rank`` hold, in every layer of KV-cache group
        ``group``, the KV of ``tokens`` at positions ``[first_position,
        first_position + block_size)``?"""
        values = prefix_values(tokens[:first_position + self.block_size])
        for name in self.groups[group]:
            layer = self.layer_index[name]
            cache = self.caches[rank][name]
            for offset in range(self.block_size):
                want = values[first_position + offset] + 65536 * (layer + 4 * self.namespace(rank))
                if not bool((cache[block, :, offset] == want).all()):
                    return False
        return True

    def corrupt_blocks(self) -> list[str]:
        """Every computed block of a running request (``REQUEST#BLOCK``) whose
        bytes on some rank are not the KV of its prefix: what a load of
        wrong bytes leaves behind (full-attention group)."""
        bad = []
        bs = self.block_size
        for request in self.scheduler.running:
            req_id = request.request_id
            table = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            tokens = list(request.all_token_ids)
            for i in range(min(request.num_computed_tokens // bs, len(table))):
                for rank in range(len(self.caches)):
                    if not self.block_holds(rank, table[i], tokens, i * bs):
                        bad.append(f"{req_id}#{i}")
                        break
        return bad

    def _forward(self, req_id: str, start: int, count: int) -> None:
        request = self.requests[req_id]
        tokens = list(request.all_token_ids)
        values = prefix_values(tokens[:start + count])
        tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        bs = self.block_size
        for rank, caches in enumerate(self.caches):
            for names, table in zip(self.groups, tables):
                for name in names:
                    cache = caches[name]
                    base = 65536 * (self.layer_index[name] + 4 * self.namespace(rank))
                    for position in range(start, start + count):
                        cache[table[position // bs], :, position % bs] = float(
                            values[position] + base)

    def step(self) -> Any:
        so = self.scheduler.schedule()
        self.steps += 1
        starts: dict[str, int] = {d.req_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
        cd = so.scheduled_cached_reqs
        for i, req_id in enumerate(cd.req_ids):
            starts[req_id] = cd.num_computed_tokens[i]
        outputs = []
        sync = bool(getattr(so, "has_sync_kv_loads", True))
        for worker in self.workers:
            worker.handle_preemptions(so.kv_connector_metadata)
            worker.bind_connector_metadata(so.kv_connector_metadata)
            if sync:
                worker.start_load_kv(None)
        for req_id, count in so.num_scheduled_tokens.items():
            self._forward(req_id, starts[req_id], count)
        for worker in self.workers:
            if not sync:
                worker.start_load_kv(None)
            worker.wait_for_save()
            if self.settle is not None:
                self.settle(worker)
            out = KVConnectorOutput()
            results = worker.get_transfer_results(so.finished_req_ids)
            out.finished_sending = results.finished_sending
            out.finished_recving = results.finished_recving
            out.failed_recving = results.failed_recving
            out.invalid_block_ids = worker.get_block_ids_with_load_errors()
            out.kv_connector_stats = worker.get_kv_connector_stats()
            out.kv_cache_events = worker.get_kv_connector_kv_cache_events()
            out.kv_connector_worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            outputs.append(out)
        merged = self.aggregator.aggregate([
            ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=out)
            for out in outputs])
        combined = (merged.kv_connector_output if merged is not None
                    and merged.kv_connector_output is not None else KVConnectorOutput())
        self.invalid_block_ids |= combined.invalid_block_ids
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            request = self.requests[req_id]
            if starts[req_id] + so.num_scheduled_tokens[req_id] >= request.num_tokens:
                sampled.append([sampled_token(req_id, request.num_tokens)])
            else:
                sampled.append([])
        runner_out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                       sampled_token_ids=sampled,
                                       kv_connector_output=None if combined.is_empty() else combined)
        engine_outputs = self.scheduler.update_from_output(so, runner_out)
        for eco in engine_outputs.values():
            for output in eco.outputs:
                if output.finish_reason is not None:
                    self.finished.append(output.request_id)
        return so

    def run(self, max_steps: int = 2000) -> int:
        """Step until nothing is waiting, running or held by the connector. A
        step that scheduled nothing waits a millisecond: a real step takes
        that long, and the send threads need the interpreter to progress."""
        for n in range(max_steps):
            if not self.busy():
                return n
            so = self.step()
            if not so.num_scheduled_tokens:
                time.sleep(0.001)
        raise RuntimeError(f"the engine still had work after {max_steps} steps")

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every rank's send thread finished what it has queued."""
        for worker in self.workers:
            side = worker.worker
            if side is None:
                continue
            def idle(side: Any = side) -> bool:
                return not side.executor.queue and side.in_flight is None

            deadline = time.monotonic() + timeout
            while not idle() and time.monotonic() < deadline:
                time.sleep(0.002)
            if not idle():
                raise TimeoutError(f"rank {side.rank} still busy after {timeout}s")

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or s.has_unfinished_requests()
                    or (s.connector is not None and s.connector.has_pending_push_work()))

    def totals(self) -> dict[str, int]:
        """Every counter of the scheduler and all ranks since the rig started."""
        out: dict[str, int] = {}
        sides = [self.connector.scheduler] if self.connector is not None else []  # type: ignore[attr-defined]
        for side in sides:
            side.stats()
            for name, value in side.totals.items():
                out[name] = out.get(name, 0) + value
        for worker in self.workers:
            worker.worker.take_counters()
            for name, value in worker.worker.totals.items():
                out[name] = out.get(name, 0) + value
        return out

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()

