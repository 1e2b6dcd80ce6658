"""``kvstate bench engine``: the connectors in a real computing engine, one run.

The same prefix-heavy, decode-heavy workload (`workload`: requests sharing a
few long system prefixes, each with a short question of its own and a long
answer) is served, in one run of this benchmark, by:

- an engine without a connector: every prompt computed (the recompute
  reference for time to first token);
- per connector (``KvstateConnector``, upstream's ``MooncakeStoreConnector``),
  on a fresh store of its own (`adapters.vllm.deployment`): a *cold* engine
  (the store empty: it looks up, misses and saves) and then a *warm* engine
  in a fresh process (the store full: it looks up, hits and loads);
  kvstate's warm engine twice, with asynchronous loads (its default, as
  upstream's) and with synchronous ones (``kvstate_load_async: false``),
  which share a prefix through vLLM's cache instead of loading it per
  request.

Per engine it reports the engine step time and generated tokens a second
(the wave's wall time over its steps and tokens), the connector's share of
the step (wall time inside the connector's API methods on the engine's step
path, scheduler and worker side, over the wave's wall time; send threads run
beside it and show in the step time instead), the mean time to first token,
and the bytes the store took (the master's ``master_allocated_bytes`` after
the cold engine) and the bytes loaded (tokens the connector offered vLLM
from the store, in whole blocks, times the block's bytes). Ratios are
against the engine without a connector, measured in the same run: the
machine is shared and noisy, only same-run ratios mean anything.

Engines run one after another, each in its own process, with the
interpreter ``python`` (the CPU engine's virtualenv on CPU).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from .engine import BLOCK_SIZE, MODEL_SHAPE, EngineRequest, Wave, make_model_with

CONNECTORS = {"kvstate": "KvstateConnector", "mooncake": "upstream MooncakeStoreConnector"}


def workload(quick: bool) -> Wave:
    """Prefix-heavy and decode-heavy: ``prefixes`` system prompts of
    ``prefix`` tokens, each shared by ``per_prefix`` requests with ``own``
    tokens of their own, ``answer`` tokens generated each."""
    prefixes, per_prefix, prefix, own, answer = (2, 3, 256, 32, 32) if quick else (
        4, 4, 768, 64, 96)
    requests = []
    for p in range(prefixes):
        system = [10 + (p * 7919 + i * 31) % 4000 for i in range(prefix)]
        for q in range(per_prefix):
            mine = [10 + (p * 131 + q * 977 + i * 13) % 4000 for i in range(own)]
            requests.append(EngineRequest(f"p{p}q{q}", system + mine, answer))
    return Wave(requests)


def block_bytes(layers: int = MODEL_SHAPE["num_hidden_layers"],
                kv_heads: int = MODEL_SHAPE["num_key_value_heads"]) -> int:
    head = MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"]
    return layers * 2 * kv_heads * head * BLOCK_SIZE * 4  # K and V, float32


def warmup() -> Wave:
    """Four short requests of their own before the measured wave, so that no
    engine's first-step costs (allocations, first kernel calls) fall into
    the measured wave's time to first token. 24 + 4 tokens: less than a
    block, so a connector stores nothing for them."""
    return Wave([EngineRequest(f"warm{i}", [4000 - (i * 53 + j * 7) % 3900 for j in range(24)],
                               4) for i in range(4)])


def _row(result: dict[str, Any], wave: Wave, stored: float | None) -> dict[str, Any]:
    w = result["waves"][1]  # after the warm-up wave
    steps = max(1, w["steps"])
    generated = sum(len(o[0]) for o in w["outputs"].values())
    ttft = list(w["first_token_s"].values())
    inside = sum(w.get("connector_s", {}).values())
    # vLLM appends a random suffix to request ids: the warm-up's are "warm*".
    external = sum(v for k, v in result.get("external_tokens", {}).items()
                   if not k.startswith("warm"))
    return {
        "step_ms": round(1000.0 * w["wall_s"] / steps, 3),
        "tokens_per_s": round(generated / w["wall_s"], 1),
        "connector_share": round(inside / w["wall_s"], 4),
        "ttft_ms": round(1000.0 * sum(ttft) / max(1, len(ttft)), 2),
        "store_hit_tokens": external,
        "bytes_stored": None if stored is None else int(stored),
        "bytes_loaded": external // BLOCK_SIZE * block_bytes(),
        "outputs": w["outputs"],
    }


def _one_round(python: str, model: str, root: Path, wave: Wave) -> dict[str, dict[str, Any]]:
    """No connector, then each connector cold and warm on a fresh store of its
    own; ratios against this round's engine without a connector."""
    from .deployment import Deployment

    waves = [warmup(), wave]
    rows: dict[str, dict[str, Any]] = {}
    common: dict[str, Any] = {"time_connector": True, "kv_cache_bytes": 64 << 20,
                              "max_model_len": 4096}
    for connector in (None, *CONNECTORS):
        where = root / (connector or "none")
        where.mkdir(parents=True, exist_ok=True)
        with Deployment(where, model, python=python) as deployment:
            if connector is None:
                rows["none"] = _row(deployment.run("none", waves, connector=None, **common),
                                    wave, None)
                continue
            # The connector as served: lookups on, no monitor, no trace.
            extra: dict[str, Any] = {"enable_lookup": True}
            cold = deployment.run("cold", waves, connector=connector, trace=False,
                                  monitor="off", extra=extra, **common)
            stored = deployment.master.metrics().get("master_allocated_bytes")
            warm = deployment.run("warm", waves, connector=connector, trace=False,
                                  monitor="off", extra=extra, **common)
            rows[f"{connector} cold"] = _row(cold, wave, stored)
            rows[f"{connector} warm"] = _row(warm, wave, None)
            if connector == "kvstate":
                sync = deployment.run("warm-sync", waves, connector=connector, trace=False,
                                      monitor="off", extra={**extra, "kvstate_load_async": False},
                                      **common)
                rows["kvstate warm sync"] = _row(sync, wave, None)
    reference = rows["none"]
    for name, row in rows.items():
        row["outputs_equal"] = None if name == "none" else row["outputs"] == reference["outputs"]
        row["step_ratio"] = row["step_ms"] / reference["step_ms"]
        row["ttft_ratio"] = row["ttft_ms"] / reference["ttft_ms"]
    for row in rows.values():
        row.pop("outputs")
    return rows


def bench_engine(python: str, quick: bool = False, rounds: int | None = None,
                 workdir: str | None = None) -> dict[str, Any]:
    """``rounds`` whole rounds (default 3, 1 with ``quick``), each with fresh
    engines and stores; every figure is the median over rounds, and a ratio
    the median of the rounds' own same-run ratios."""
    rounds = rounds or (1 if quick else 3)
    wave = workload(quick)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        model = make_model_with(python, root / "model")
        measured = [_one_round(python, model, root / f"round{i}", wave) for i in range(rounds)]
    rows: dict[str, dict[str, Any]] = {}
    for name in measured[0]:
        row: dict[str, Any] = {}
        for field, value in measured[0][name].items():
            values = [m[name][field] for m in measured]
            if field == "outputs_equal":
                row[field] = None if value is None else all(values)
            elif value is None:
                row[field] = None
            else:
                row[field] = round(statistics.median(values), 4)
        rows[name] = row
    return {"workload": {"requests": len(wave.requests),
                         "prompt_tokens": sum(len(r.prompt) for r in wave.requests),
                         "generated_tokens": sum(r.max_tokens for r in wave.requests),
                         "block_bytes": block_bytes(), "rounds": rounds},
            "rows": rows}


def format_engine(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"real engine (tiny Llama), {w['requests']} requests, {w['prompt_tokens']} "
             f"prompt tokens, {w['generated_tokens']} generated; medians of {w['rounds']} "
             "round(s); ratios against no connector in the same round"]
    header = ["engine", "step ms", "x", "tokens/s", "connector share", "TTFT ms", "x",
              "store hits", "bytes stored", "bytes loaded", "outputs equal"]
    table = [header]
    for name, row in report["rows"].items():
        table.append([name, f"{row['step_ms']:.2f}", f"{row['step_ratio']:.2f}",
                      f"{row['tokens_per_s']:.0f}", f"{100 * row['connector_share']:.1f}%",
                      f"{row['ttft_ms']:.1f}", f"{row['ttft_ratio']:.2f}",
                      f"{row['store_hit_tokens']:.0f}",
                      "-" if row["bytes_stored"] is None else f"{row['bytes_stored']:,.0f}",
                      f"{row['bytes_loaded']:,.0f}",
                      {None: "ref", True: "yes", False: "NO"}[row["outputs_equal"]]])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)))
    return "\n".join(lines)
