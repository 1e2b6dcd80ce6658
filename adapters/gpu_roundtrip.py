"""GPU readiness check (not part of the tests): the real round trip with CUDA
KV tensors, optionally over RDMA, printing bytes per second.

    python -m adapters.gpu_roundtrip --master 127.0.0.1:50051 [--protocol rdma --device mlx5_0]

Needs a GPU, the CUDA build of mooncake-transfer-engine and a running master.
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
    parser.add_argument("--master", required=True, help="host:port of mooncake_master")
    parser.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp")
    parser.add_argument("--device", default="", help="RDMA device name(s)")
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    store = MooncakeStore(MooncakeConfig(master_server_address=args.master,
                                         protocol=args.protocol, device_name=args.device,
                                         global_segment_size=1 << 30,
                                         local_buffer_size=256 << 20))
    try:
        shared = prompt(256, salt=1)
        arrivals = [(f"g{i}", shared + prompt(256, salt=i), 8) for i in range(args.requests)]
        result = run_real(store, arrivals, ConnectorConfig(block_size=16, world_size=2),
                          num_blocks=2048, heads=8, head_dim=128, device="cuda")
    finally:
        store.close()
    print(json.dumps({"ok": result.ok, **result.figures}, sort_keys=True))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
