"""A store that misbehaves under a running engine (`adapters.vllm.chaos`).

vLLM 0.33.0's real Scheduler with ``KvstateConnector`` (monitor raising,
trace on) against a real ``mooncake_master`` on 127.0.0.1 that is killed
and restarted on its ports three times (every object lost) and stopped for
3 s (SIGSTOP) mid-round. What must hold: no wrong bytes ever computed over,
nothing pinned or in flight after the drain, saving resumes on its own after
every fault, the restart costs hits and nothing else, and both engines'
traces check clean and replay.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

from adapters.master import Master  # noqa: E402
from adapters.vllm import chaos  # noqa: E402
from adapters.vllm.rig import tiny_model_dir  # noqa: E402
from sim.traces.check import check_trace  # noqa: E402
from sim.traces.replay import replay_trace  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.mooncake]


def test_master_restarts_and_a_stall_cost_hits_never_bytes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", "")  # set by the run, restored after
    master = Master()
    try:
        figures = chaos.run(master, tiny_model_dir(tmp_path / "model"), str(tmp_path),
                            restarts=3, stall_s=3.0)
    finally:
        master.stop()
    assert figures["wrong_blocks"] == []
    assert figures["pins_left"] == 0 and figures["jobs_left"] == 0
    assert len(figures["restarts"]) == 3
    for restart in figures["restarts"]:
        # Saving resumed on its own; the prefix stored before was gone (no
        # hit until the engine stored it again), and hits came back after.
        assert restart["seconds_to_first_put"] < chaos.RECOVERY_BOUND_S
        assert restart["hit_tokens_before"] > 0 and restart["hit_tokens_after"] > 0
    # The stall outlived the 1 s store bound: an episode, and a recovery.
    assert figures["store_episodes"] >= 1 and figures["store_recoveries"] >= 1
    assert figures["stall"]["seconds_to_first_put"] < chaos.RECOVERY_BOUND_S
    assert figures["second_engine_hit_tokens"] > 0
    for trace in figures["traces"]:
        checked = check_trace(trace)
        assert checked.ok, [str(f) for f in checked.findings][:3]
        replayed = replay_trace(trace)
        assert replayed.ok, replayed.divergence
