"""GPU readiness check (not part of the tests): the real round trip with CUDA
KV tensors, optionally over RDMA, printing bytes per second.

    python -m adapters.gpu_roundtrip [--master HOST:PORT] [--protocol rdma --device mlx5_0]

Needs a GPU and the CUDA build of mooncake-transfer-engine; starts its own
``mooncake_master`` on loopback unless given one. ``--tensors cpu`` runs the
same path with CPU tensors (the test suite does, so the script cannot rot
unnoticed on machines without a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys

from adapters.mooncake import MooncakeConfig, MooncakeStore
from adapters.runner import run_real
from kvstate.config import ConnectorConfig
from kvstate.scenarios import prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="",
                        help="host:port of mooncake_master (default: start one on loopback)")
    parser.add_argument("--tensors", choices=("cuda", "cpu"), default="cuda",
                        help="where the KV caches live (cpu: a smoke test of the path)")
    parser.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp")
    parser.add_argument("--device", default="", help="RDMA device name(s)")
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args(argv)
    import torch

    if args.tensors == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (or --tensors cpu)", file=sys.stderr)
        return 2
    master = None
    if not args.master:
        from adapters.master import Master

        master = Master()
    address = args.master or master.address  # type: ignore[union-attr]
    small = args.tensors == "cpu"
    store = MooncakeStore(MooncakeConfig(master_server_address=address,
                                         protocol=args.protocol, device_name=args.device,
                                         global_segment_size=(64 << 20) if small else 1 << 30,
                                         local_buffer_size=(16 << 20) if small else 256 << 20))
    try:
        shared = prompt(256, salt=1)
        arrivals = [(f"g{i}", shared + prompt(256, salt=i), 8) for i in range(args.requests)]
        result = run_real(store, arrivals, ConnectorConfig(block_size=16, world_size=2),
                          num_blocks=256 if small else 2048, heads=2 if small else 8,
                          head_dim=16 if small else 128, device=args.tensors)
    finally:
        store.close()
        if master is not None:
            master.stop()
    print(json.dumps({"ok": result.ok, **result.figures}, sort_keys=True))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
