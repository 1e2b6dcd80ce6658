"""The core against a real mooncake_master on 127.0.0.1 and real KV bytes."""

from __future__ import annotations

import json
import os
import uuid

import pytest

pytestmark = [pytest.mark.mooncake, pytest.mark.slow]

# Skipped before the adapters (torch, the Mooncake wheel) are imported, so the
# switch works where they are not installed; otherwise a missing package fails.
if os.environ.get("KVSTATE_NO_MOONCAKE") == "1":
    pytest.skip("KVSTATE_NO_MOONCAKE=1: the real store is switched off", allow_module_level=True)

from adapters.mooncake import MooncakeConfig, MooncakeStore, code_name, parse_size  # noqa: E402
from adapters.runner import RealStore, registered, run_real, verify  # noqa: E402
from adapters.torch_kv import PagedKV  # noqa: E402
from kvstate.config import ConnectorConfig  # noqa: E402
from kvstate.harness import Harness  # noqa: E402
from kvstate.scenarios import prompt  # noqa: E402


def isolated(**kwargs) -> ConnectorConfig:
    """Each test writes under its own key prefix."""
    return ConnectorConfig(cache_prefix=f"t{uuid.uuid4().hex[:8]}", block_size=4, **kwargs)


def test_round_trip_verifies_every_stored_byte(mooncake_store) -> None:
    shared = prompt(16, salt=1)
    arrivals = [("a", shared + prompt(6, 2), 6), ("b", shared + prompt(9, 3), 5),
                ("c", shared + prompt(6, 2), 4)]
    result = run_real(mooncake_store, arrivals, isolated(world_size=2, save_decode_cache=True,
                                                          enable_kv_events=True))
    figures = result.figures
    assert result.ok, result.violations
    assert figures["verified_keys"] == figures["keys_written"] > 0
    assert figures["wrong_keys"] == 0
    assert figures["dedup_hits"] > 0  # the shared prefix is found, not re-put
    assert figures["loads"] > 0  # "c" repeats "a"'s prompt: a lookup hit, loaded for real
    assert figures["store_errors"] == {}
    # Existence checks are counted per kind of save (a loaded request's first
    # decode save also checks the prompt chunks its loading step skipped).
    assert figures["decode_saves_per_rank"] > 0
    assert figures["exists_calls_per_decode_save"] <= 1.0
    assert figures["exists_keys_per_decode_save"] > 0


def _preempt_running_job(store: MooncakeStore, variant: str
                         ) -> tuple[Harness, RealStore, PagedKV, list[str]]:
    config = isolated()
    kv = PagedKV(1, 1, 3, 4)
    with registered(store, kv.tensors()):
        h, real = _run_preempt(store, kv, config, variant)
        _, _, wrong = verify(store, kv, real.written)
    return h, real, kv, wrong


def _run_preempt(store: MooncakeStore, kv: PagedKV, config: ConnectorConfig, variant: str
                 ) -> tuple[Harness, RealStore]:
    real = RealStore(store, kv)
    h = Harness(config, variant, num_blocks=3, store=real)  # type: ignore[arg-type]
    h.pool.on_write = kv.fill
    h.add("a", prompt(8), max_new_tokens=3)
    h.step()
    h.advance(0)                      # exists answered; the put is pending
    h.add("b", prompt(8, salt=7))
    h.step(preempt=["a"], hold=["a"])
    h.step(hold=["a"])                # b reuses whatever blocks are free
    h.run_ranks()                     # the pending put reads the blocks now
    h.settle()
    return h, real


def test_a_freed_block_is_never_stored_under_a_valid_key(mooncake_store) -> None:
    h, real, kv, wrong = _preempt_running_job(mooncake_store, "kvstate")
    assert real.written and wrong == [] and h.monitor.findings == []
    assert not any(h.pool.refs[1:])  # every pin released
    # Upstream before the fix: the store now serves b's bytes under a's key.
    h1, _, _, wrong1 = _preempt_running_job(mooncake_store, "e1")
    assert wrong1 and "K1" in h1.monitor.fired()


def test_a_full_store_answers_minus_200_and_nothing_wrong_is_readable(mooncake_master) -> None:
    from adapters.master import Master

    # A master of its own whose only segment is 16 MiB (Mooncake's smallest):
    # at 128 KiB per key it is full after ~128 keys.
    master = Master()
    store = MooncakeStore(MooncakeConfig(master_server_address=master.address,
                                         global_segment_size=16 << 20,
                                         local_buffer_size=16 << 20))
    try:
        arrivals = [(f"r{i}", prompt(40, salt=i), 2) for i in range(60)]
        result = run_real(store, arrivals, isolated(world_size=2), num_blocks=64,
                          heads=8, head_dim=1024)
        figures = result.figures
        assert figures["store_errors"].get("NO_AVAILABLE_HANDLE", 0) > 0
        assert figures["wrong_keys"] == 0
        assert not [v for v in result.violations if v["invariant"] in ("S6", "S4", "K1")]
        # Every key the run stored is either still there with the right bytes, or was
        # evicted by the full master (never there with wrong bytes).
        assert figures["verified_keys"] + figures["missing_at_verify"] == figures["keys_written"]
    finally:
        store.close()
        master.stop()


def test_killed_master_gives_clear_errors_and_leaks_no_pins() -> None:
    from adapters.master import Master

    master = Master()
    store = MooncakeStore(MooncakeConfig(master_server_address=master.address,
                                         global_segment_size=64 << 20), timeout=3.0)
    config = isolated(world_size=1)
    kv = PagedKV(1, 1, 64, 4)  # this store dies with its master: nothing to unregister
    for tensor in kv.tensors():
        store.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    real = RealStore(store, kv)
    h = Harness(config, num_blocks=64, store=real, record=False)  # type: ignore[arg-type]
    h.pool.on_write = kv.fill
    h.add("a", prompt(16), max_new_tokens=2)
    h.step()
    h.run_ranks()
    assert real.puts > 0
    master.stop()                     # the master dies mid-run
    h.add("b", prompt(16, salt=4), max_new_tokens=2)
    h.settle(max_steps=50)
    assert real.errors, "the dead master's failures must be counted by name"
    assert set(real.errors) <= {"RPC_FAIL", "TimeoutError", "ConnectionError",
                                "TRANSFER_FAIL", "ERROR_-1"} | set(map(code_name, range(-1000, 0)))
    assert not [f for f in h.monitor.findings if f.invariant in ("S6", "S4", "K1")]
    assert not any(h.pool.refs[1:])


def test_config_like_vllms_connector(tmp_path, monkeypatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                "master_server_address": "127.0.0.1:50051",
                                "global_segment_size": "4gb", "local_buffer_size": "512MB",
                                "device_name": "", "mode": "embedded"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    config = MooncakeConfig.from_env()
    assert config.global_segment_size == 4 << 30 and config.local_buffer_size == 512 << 20
    assert parse_size("64 KiB", "x") == 64 << 10
    with pytest.raises(ValueError, match="protocol='ib'"):
        MooncakeConfig(master_server_address="127.0.0.1:1", protocol="ib")
    path.write_text('{"master_server_address": "127.0.0.1:1", "segment": 1}')
    with pytest.raises(ValueError, match="unknown field 'segment'"):
        MooncakeConfig.from_env()
    assert code_name(-200) == "NO_AVAILABLE_HANDLE" and code_name(-42) == "ERROR_-42"


def test_real_command_verifies_a_workload_and_benchmarks_the_adapter(capsys) -> None:
    from sim.cli import main

    assert main(["real", "--requests", "12", "--world-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["figures"]["verified_keys"] == out["figures"]["keys_written"] > 0
    assert main(["real", "--bench", "--segment-mib", "512", "--repeats", "3", "--json"]) == 0
    bench = json.loads(capsys.readouterr().out)["adapter"]
    assert set(bench) == {"16KiB", "256KiB", "4096KiB"}
    assert all(row["put_ratio"] > 0 and row["get_ratio"] > 0 for row in bench.values())
    assert main(["real", "--master", "no-port-here"]) == 2
    assert "master_server_address='no-port-here'" in capsys.readouterr().err


def test_keys_leased_by_a_read_cannot_be_removed_and_are_named(mooncake_store) -> None:
    """A read grants a lease (10 s by default): removing the key now fails with
    OBJECT_HAS_LEASE, named as such; the keys stay readable with their bytes."""
    config = isolated(world_size=1)
    arrivals = [("a", prompt(16, salt=11), 2)]
    first = run_real(mooncake_store, arrivals, config)
    assert first.ok and first.figures["keys_written"] > 0
    kv = PagedKV(1, 1, 4, 4)
    key = f"{config.cache_prefix}@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
    with registered(mooncake_store, kv.tensors()):
        written = [k for k in _keys_with_prefix(mooncake_store, config, arrivals)]
        assert written and written[0].startswith(key)
        checked, missing, wrong = verify(mooncake_store, kv, written)  # the read leases them
        assert checked == len(written) and not missing and not wrong
        rc = mooncake_store._store.remove(written[0])
        assert code_name(rc) == "OBJECT_HAS_LEASE"
        assert all(mooncake_store.exists(written))  # still there, still the right bytes
        assert verify(mooncake_store, kv, written)[2] == []


def _keys_with_prefix(store: MooncakeStore, config: ConnectorConfig, arrivals) -> list[str]:
    """The keys ``run_real`` wrote, hashed as it hashes (vLLM's sha256 by default)."""
    from kvstate.blockhash import VLLM_SHA256, chain_hash_fn
    from kvstate.keys import HashChain, chunk_hash, key_for, key_prefix

    keys = []
    for _, tokens, _ in arrivals:
        hashes = HashChain(config.hash_block, list(tokens),
                           hash_fn=chain_hash_fn(VLLM_SHA256)).hashes
        for cid in range(len(tokens) // config.block_size):
            keys.append(key_for(key_prefix(config, 0, 0), chunk_hash(hashes, cid, 1)))
    present = store.exists(keys)
    return [k for k, p in zip(keys, present) if p]


def test_ranks_in_their_own_processes_verify_every_byte(mooncake_master) -> None:
    """Each rank a separate process with its own client, segment and caches;
    the loads of "c" read what rank processes stored, across clients."""
    import os

    from adapters.runner import run_real_processes

    shared = prompt(16, salt=4)
    arrivals = [("a", shared + prompt(6, 5), 6), ("b", shared + prompt(9, 6), 5),
                ("c", shared + prompt(6, 5), 4)]
    config = isolated(world_size=3, save_decode_cache=True, enable_kv_events=True)
    mooncake = MooncakeConfig(master_server_address=mooncake_master.address,
                              global_segment_size=32 << 20, local_buffer_size=16 << 20)
    result = run_real_processes(mooncake, arrivals, config)
    figures = result.figures
    assert result.ok, result.violations
    pids = figures["rank_pids"]
    assert len(set(pids)) == 3 and os.getpid() not in pids  # really three other processes
    assert all(n > 0 for n in figures["puts_per_rank"])
    assert figures["verified_keys"] == figures["keys_written"] > 0
    assert figures["loads"] > 0 and figures["dedup_hits"] > 0


def test_a_dead_rank_process_is_named(mooncake_master) -> None:
    from adapters.rank_process import RankProcessError, RankProcesses

    mooncake = MooncakeConfig(master_server_address=mooncake_master.address,
                              global_segment_size=16 << 20, local_buffer_size=16 << 20)
    ranks = RankProcesses(mooncake, 2, 1, 1, 4, 4)
    try:
        ranks.procs[1].kill()
        ranks.procs[1].join(5)
        with pytest.raises(RankProcessError, match="rank 1 process"):
            ranks.exists(1, ["nothing"])
        assert ranks.exists(0, ["nothing"]) == [False]  # the other rank still answers
    finally:
        ranks.close()


def test_gpu_roundtrip_script_runs_its_path_on_cpu_tensors(mooncake_master, capsys) -> None:
    """The GPU readiness script is not run here (no GPU); its code path is."""
    from adapters.gpu_roundtrip import main

    assert main(["--master", mooncake_master.address, "--tensors", "cpu",
                 "--requests", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["verified_keys"] == out["keys_written"] > 0


def _vllm_chunk_keys(config: ConnectorConfig, tokens: list[int], monkeypatch) -> list[str]:
    """The keys a vLLM 0.33.0 engine (sha256 prefix caching, PYTHONHASHSEED
    unset) looks up for ``tokens``: its own block hashing and none-hash seed,
    upstream's key format, every rank namespace."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

    from kvstate.keys import key_for, key_prefix

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    parent = sha256(resolve_none_hash_seed(sha256))  # vLLM's NONE_HASH, its globals untouched
    keys = []
    bs = config.block_size
    for start in range(0, len(tokens) // bs * bs, bs):
        parent = hash_block_tokens(sha256, parent, tokens[start:start + bs])
        keys += [key_for(key_prefix(config, ns * config.put_step, 0), parent)
                 for ns in range(config.num_namespaces)]
    return keys


def test_a_store_kvstate_real_fills_holds_the_keys_vllm_looks_up(monkeypatch) -> None:
    """By default the real store is keyed by vLLM's own sha256 block hashes
    (kvstate's 16-byte hash names keys no vLLM engine ever asks for). A store
    of its own: the session's shared store is full by now and evicts."""
    pytest.importorskip("vllm")
    from adapters.master import Master

    master = Master()
    store = MooncakeStore(MooncakeConfig(master_server_address=master.address,
                                         global_segment_size=64 << 20,
                                         local_buffer_size=16 << 20))
    try:
        tokens = prompt(24, salt=5)
        config = isolated(world_size=2, save_decode_cache=True, enable_kv_events=True)
        vllm_keys = _vllm_chunk_keys(config, tokens, monkeypatch)
        result = run_real(store, [("a", tokens, 3)], config)
        assert result.ok, result.violations  # S17 recomputes every event's digest with sha256
        assert result.figures["block_hash"] == "vllm-sha256"
        assert len(vllm_keys) == 12 and all(store.exists(vllm_keys))
        other = isolated(world_size=2, save_decode_cache=True, enable_kv_events=True)
        own = run_real(store, [("a", tokens, 3)], other, block_hash="kvstate")
        assert own.ok and own.figures["keys_written"] > 0
        assert not any(store.exists(_vllm_chunk_keys(other, tokens, monkeypatch)))
    finally:
        store.close()
        master.stop()


def test_real_command_refuses_an_unknown_block_hash(capsys) -> None:
    from sim.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["real", "--block-hash", "md5"])
    assert exc.value.code == 2
    assert "--block-hash" in capsys.readouterr().err
