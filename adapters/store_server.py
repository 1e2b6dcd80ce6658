"""A Mooncake store that outlives its engines: a standalone ``mooncake_client``.

Mooncake keeps an object's bytes in the *segment* of some client: memory a
client mounts when it sets up (``global_segment_size``). A segment lives as
long as its process; when an engine that mounted one exits, every object the
master placed there leaves the store with it (and the master places objects
in any mounted segment, not only in the writer's). A deployment whose
engines restart must therefore keep the store's memory in a process of its
own and give the engines none:

- one ``mooncake_client`` process (the wheel's binary, beside
  ``mooncake_master``) mounts the segment: ``--global_segment_size=SIZE``,
  ``--metadata_server=P2PHANDSHAKE``, ``--host=127.0.0.1`` (loopback here);
- every engine's ``MOONCAKE_CONFIG_PATH`` file says ``"global_segment_size":
  0``: its clients put and get through their registered KV buffers and mount
  nothing (``KvstateConnector``'s lookup client mounts nothing in any case).

`StoreServer` starts and stops such a process (tests, ``engine_smoke``,
``kvstate bench engine``); `engine_store_config` writes the engines' file.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from .master import MasterError, free_port, stop_process, wait_listening, wheel_binary

# How long the process may take to mount its segment and register with the
# master (seen here: under 2 s for 1 GiB).
READY_TIMEOUT = 30.0


def engine_store_config(path: str | Path, master: str, *, segment: str | int = 0,
                        local_buffer: str = "64mb") -> str:
    """The ``MOONCAKE_CONFIG_PATH`` file of an engine on ``master``. ``segment``
    0 (the default) is the deployment above (upstream's ``"mode":
    "standalone-store"``); a size makes the engine hold store memory itself
    (``"embedded"``: gone when it exits)."""
    path = Path(path)
    mode = "standalone-store" if segment in (0, "0") else "embedded"
    path.write_text(json.dumps({"master_server_address": master,
                                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                "mode": mode, "global_segment_size": segment,
                                "local_buffer_size": local_buffer}))
    return str(path)


class StoreServer:
    """One standalone ``mooncake_client`` holding ``segment`` of store memory."""

    def __init__(self, master: str, segment: str = "1gb") -> None:
        self.master = master
        self.segment = segment
        self.port = free_port()
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, MC_LOG_LEVEL="ERROR")
        self.process = subprocess.Popen(
            [wheel_binary("mooncake_client"), f"--master_server_address={master}",
             "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1", f"--port={self.port}",
             f"--global_segment_size={segment}", "--protocol=tcp"],
            stdout=subprocess.DEVNULL, stderr=self._stderr, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Ready once its service port answers, which it opens after mounting."""
        try:
            wait_listening(self.process, self.port, self._stderr,
                           f"mooncake_client ({self.segment} on {self.master})", READY_TIMEOUT)
        except MasterError:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.process)
        self._stderr.close()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
