"""Start a real ``mooncake_master`` on free loopback ports (tests, `kvstate real`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Master:
    def __init__(self) -> None:
        binary = shutil.which("mooncake_master")
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'kvstate[mooncake]'")
        self.port = free_port()
        self.metrics_port = free_port()
        env = dict(os.environ, MC_LOG_LEVEL="ERROR")
        self.process = subprocess.Popen(
            [binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("mooncake_master did not open its port within 20 s")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
