"""GPU smoke test: ``python -m adapters.vllm.gpu_smoke`` (needs a CUDA GPU and full vLLM).

Runs ``vllm.LLM`` on a tiny randomly initialised Llama made locally (a
``config.json`` and ``load_format="dummy"``: no download, no tokenizer, prompts
given as token ids) twice: once without a connector, once with
``KvstateConnector`` on a ``mooncake_master`` it starts on loopback. With the
connector the batch (requests sharing a long prefix) is generated twice, so
the second pass loads from the store. It checks and prints:

- greedy outputs with the connector equal the outputs without it, both passes;
- the second pass's lookups hit the store (counted from the connector's trace);
- every trace line passes ``kvstate check``;
- wall time per engine step with and without the connector (its overhead).

Exit 0 when every check holds, 1 otherwise. The pieces that need no GPU
(model directory, connector configuration, trace analysis) are tested on CPU
in ``tests/test_vllm_connector.py``; the whole script has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .rig import tiny_model_dir


def smoke_prompts(batch: int, prefix: int, suffix: int) -> list[list[int]]:
    """``batch`` prompts that share their first ``prefix`` tokens."""
    shared = [100 + (i * 37) % 30000 for i in range(prefix)]
    return [shared + [200 + (b * 997 + i * 13) % 30000 for i in range(suffix)]
            for b in range(batch)]


def connector_transfer_config(trace: str, protocol: str = "kvstate") -> dict[str, Any]:
    """The ``kv_transfer_config`` the smoke test (and a user) passes to vLLM."""
    return {"kv_connector": "KvstateConnector", "kv_connector_module_path": "adapters.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"save_decode_cache": True, "enable_lookup": True,
                                          "kvstate_protocol": protocol,
                                          "kvstate_trace": trace, "kvstate_monitor": "log"}}


def write_store_config(path: Path, master: str) -> None:
    path.write_text(json.dumps({"master_server_address": master,
                                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                "global_segment_size": "1gb", "local_buffer_size": "256mb"}))


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


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],  # type: ignore[typeddict-item]
                        params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from vllm import LLM

    from adapters.master import Master
    from sim.check import check_trace

    model = tiny_model_dir(workdir / "model")
    prompts = smoke_prompts(args.batch, args.prefix, args.suffix)
    common = {"model": model, "load_format": "dummy", "skip_tokenizer_init": True,
              "enforce_eager": True, "gpu_memory_utilization": args.gpu_memory, "seed": 0,
              "block_size": 16, "max_model_len": args.prefix + args.suffix + args.max_tokens + 16}
    plain = LLM(**common)
    baseline, plain_s = _generate(plain, prompts, args.max_tokens)
    del plain

    master = Master()
    try:
        write_store_config(workdir / "mooncake.json", master.address)
        os.environ["MOONCAKE_CONFIG_PATH"] = str(workdir / "mooncake.json")
        trace = str(workdir / "engine.jsonl")
        from vllm.config import KVTransferConfig

        llm = LLM(**common, kv_transfer_config=KVTransferConfig(**connector_transfer_config(trace)))
        first, first_s = _generate(llm, prompts, args.max_tokens)
        second, second_s = _generate(llm, prompts, args.max_tokens)
        del llm
    finally:
        master.stop()
    checked = check_trace(trace)
    steps = args.max_tokens + 1
    result = {
        "outputs_equal_first_pass": first == baseline,
        "outputs_equal_second_pass": second == baseline,
        "store": store_hits(trace),
        "trace_ok": checked.ok,
        "step_ms_without_connector": 1000 * plain_s / steps,
        "step_ms_with_connector_first_pass": 1000 * first_s / steps,
        "step_ms_with_connector_second_pass": 1000 * second_s / steps,
    }
    result["ok"] = (result["outputs_equal_first_pass"] and result["outputs_equal_second_pass"]
                    and result["store"]["lookups_with_hits"] > 0 and checked.ok)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.gpu_smoke")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gpu-memory", type=float, default=0.3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
