"""Start a real ``mooncake_master`` on free loopback ports (tests, `kvstate real`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

# Fresh ports are picked and then bound by the master, so another process can
# take one in between; a few tries make that race harmless.
START_TRIES = 3
START_TIMEOUT = 20.0  # seconds for a process to open its port (seen: well under 1 s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MasterError(RuntimeError):
    """No master could be started here: the binary missing, or it exited
    (its own last words in the message)."""


def wheel_binary(name: str) -> str:
    """A Mooncake program (``mooncake_master``, ``mooncake_client``) on PATH,
    else beside this Python (a virtualenv's ``bin/``, where the wheel installs
    it, need not be on PATH)."""
    found = shutil.which(name)
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if found is None and os.access(beside, os.X_OK):
        found = beside
    if found is None:
        raise MasterError(f"{name} not found on PATH or beside {sys.executable}: "
                          "pip install 'kvstate[mooncake]' installs it")
    return found


def wait_listening(process: subprocess.Popen[bytes], port: int, stderr: IO[bytes], what: str,
                   timeout: float) -> None:
    """Return once ``process`` accepts connections on 127.0.0.1:``port``;
    raise `MasterError` with its last words (``stderr``) if it exits first,
    or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr.seek(0)
            said = stderr.read().decode(errors="replace").strip().splitlines()[-3:]
            raise MasterError(f"{what} exited with {process.returncode}: "
                              f"{' | '.join(said) or '-'}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise MasterError(f"{what} did not open port {port} within {timeout:.0f} s")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` in state T (stopped), from /proc; a thread
    that exits meanwhile is skipped."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                # "pid (comm) S ...": comm may hold spaces and parens, so the
                # state is the first field after the last ")".
                state = stat.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("T", "t"):
            return False
    return True


def master_binary() -> str:
    return wheel_binary("mooncake_master")


class Master:
    """``flags``: more ``mooncake_master`` flags, e.g. ``--eviction_ratio=0``
    (a store that never evicts: full is full, every further put -200)."""

    def __init__(self, flags: tuple[str, ...] = ()) -> None:
        binary = master_binary()
        self.flags = tuple(flags)
        for attempt in range(START_TRIES):
            try:
                self._start(binary)
                return
            except MasterError:
                if attempt == START_TRIES - 1:
                    raise

    def _start(self, binary: str, ports: tuple[int, int] | None = None) -> None:
        self.port, self.metrics_port = ports or (free_port(), free_port())
        env = dict(os.environ, MC_LOG_LEVEL="ERROR")
        with tempfile.TemporaryFile() as stderr:
            self.process = subprocess.Popen(
                [binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                 "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                 *self.flags],
                stdout=subprocess.DEVNULL, stderr=stderr, env=env)
            try:
                wait_listening(self.process, self.port, stderr,
                               f"mooncake_master (ports {self.port}, {self.metrics_port})",
                               START_TIMEOUT)
            except MasterError:
                self.stop()
                raise

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus counters and gauges (``/metrics`` on its
        metrics port), e.g. ``master_allocated_bytes``, ``master_key_count``."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode(errors="replace")
        values: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line.startswith("#") or not value:
                continue
            try:
                values[name] = float(value.split()[0])
            except ValueError:
                continue
        return values

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.process)

    def pause(self, within: float = 10.0) -> None:
        """SIGSTOP this master and return only once every one of its threads
        is stopped. ``kill`` returns when the signal is queued, not when it
        has acted: the kernel stops a process's threads one by one as each
        next runs, and on a loaded machine an RPC thread can answer for a
        while after ``kill`` returned (CI saw a call answered on a
        "stopped" master). ``MasterError`` if not all stopped ``within``."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + within
        while not _all_threads_stopped(self.process.pid):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise MasterError(f"mooncake_master {self.process.pid} not stopped "
                                  f"within {within:g} s of SIGSTOP")
            time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT (harmless on a master that is not stopped or has exited)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill this master (SIGKILL: a crash, stopped or not) and start a
        fresh one on the same ports: its metadata starts empty, so every
        object is gone and clients must mount their segments again. Someone
        may take a port in between; a few tries, then `MasterError`."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        binary = master_binary()
        for attempt in range(START_TRIES):
            try:
                self._start(binary, (self.port, self.metrics_port))
                return
            except MasterError:
                if attempt == START_TRIES - 1:
                    raise
                time.sleep(0.5)  # a port in TIME_WAIT or briefly taken
