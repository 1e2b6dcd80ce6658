"""Interoperation with upstream's ``MooncakeStoreConnector`` on one master.

``python -m adapters.vllm.interop --master HOST:PORT --writer upstream|kvstate``
runs two engines (`adapters.vllm.rig`) against one Mooncake master: the writer
serves request ``a``, then an engine with the *other* connector serves ``b``,
which shares ``a``'s first four blocks. It prints one JSON object: the tokens
the reader found in the store, how many loaded blocks hold exactly the bytes
the writer's forward pass wrote (every layer, every rank), and the reader's
load errors. It exits with ``os._exit``: upstream's worker leaves non-daemon
threads and ZMQ sockets that would otherwise keep the interpreter alive, so
the tests run this in a subprocess with a deadline.

What makes upstream runnable here: vLLM's distributed state initialised with
gloo (world size 1) for its rank queries, and ``torch.cuda.Event`` replaced by
a host stand-in (CPU tensors need no stream fence).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any

PREFIX_TOKENS = 64


class HostEvent:
    def record(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


def prepare_process(master: str, workdir: str, model_dir: str) -> None:
    """Make this process one where upstream's connector runs beside
    kvstate's: a Mooncake config for ``master`` (loopback, P2PHANDSHAKE) in
    ``MOONCAKE_CONFIG_PATH``, ``torch.cuda.Event`` replaced by `HostEvent`,
    and vLLM's distributed state initialised with gloo, world size 1."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    config_path = os.path.join(workdir, "mooncake.json")
    with open(config_path, "w") as handle:
        json.dump({"master_server_address": master, "metadata_server": "P2PHANDSHAKE",
                   "protocol": "tcp", "global_segment_size": "64mb",
                   "local_buffer_size": "32mb"}, handle)
    os.environ["MOONCAKE_CONFIG_PATH"] = config_path

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from adapters.master import free_port

    from .rig import make_vllm_config

    torch.cuda.Event = HostEvent  # type: ignore[misc,assignment]
    with set_current_vllm_config(make_vllm_config(model_dir)):
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.ensure_model_parallel_initialized(1, 1)


def run(master: str, writer: str, workdir: str) -> dict[str, Any]:
    from .rig import Rig, make_vllm_config, tiny_model_dir

    model_dir = tiny_model_dir(os.path.join(workdir, "model"))
    prepare_process(master, workdir, model_dir)
    prefix = f"i{uuid.uuid4().hex[:8]}"

    def engine(kind: str) -> Rig:
        extra: dict[str, Any] = {"cache_prefix": prefix, "save_decode_cache": True}
        if kind == "kvstate":
            vc = make_vllm_config(model_dir, extra=extra, num_blocks=64)
        else:
            vc = make_vllm_config(model_dir, connector="MooncakeStoreConnector", module=None,
                                  extra=extra, num_blocks=64)
        return Rig(vc, 64)

    reader = "kvstate" if writer == "upstream" else "upstream"
    shared = _prompt(PREFIX_TOKENS, salt=80)
    first = engine(writer)
    first.add("a", shared + [3, 4, 5], max_tokens=3)
    for _ in range(2000):
        if not first.busy():
            break
        first.step()
        time.sleep(0.002)

    second = engine(reader)
    tokens = shared + [6, 7]
    second.add("b", tokens, max_tokens=3)
    hit = -1
    for _ in range(500):  # upstream looks up and loads asynchronously
        so = second.step()
        if so.scheduled_new_reqs:
            hit = so.scheduled_new_reqs[0].num_computed_tokens
            break
        time.sleep(0.01)
    matching = 0
    if hit > 0:
        (table,) = second.scheduler.kv_cache_manager.get_block_ids("b")
        matching = sum(second.block_holds(0, table[i], tokens, i * second.block_size)
                       for i in range(hit // second.block_size))
    return {"writer": writer, "reader": reader, "hit_tokens": hit,
            "blocks_with_writer_bytes": matching,
            "load_errors": sorted(second.invalid_block_ids)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm.interop")
    parser.add_argument("--master", required=True, help="HOST:PORT of a running mooncake_master")
    parser.add_argument("--writer", choices=("upstream", "kvstate"), required=True)
    args = parser.parse_args(argv)
    code = 0
    try:
        with tempfile.TemporaryDirectory() as workdir:
            print(json.dumps(run(args.master, args.writer, workdir)), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as JSON, then a hard exit
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
