"""Setup against an address that is not a mooncake_master cannot hang (issue 28, item 2).

The binding's ``setup`` holds the GIL while it retries: 20 tries, each up to
Mooncake's 30 s RPC timeout against a port that accepts and never answers,
so neither a thread's timeout nor Ctrl-C could stop it. Each case runs in a
process of its own (on failing code it would hang the test's process too):
a dead address, a server that answers garbage, one that never answers, and
an HTTP server must each fail within the setup timeout, naming the address;
Ctrl-C stops a setup that waits. Loopback only.

``python tests/test_store_setup.py`` prints what the probe adds to a good
setup (no timings are asserted here).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP_TIMEOUT = 1.0
# A bad setup must have failed by the timeout plus this much: a killed probe
# process's exit, the error's making (not the Python start: timed inside).
SLACK = 0.75

# Runs in a process of its own: the store's construction, timed, and its
# error as JSON.
CONSTRUCT = """\
import json, sys, time
sys.path.insert(0, sys.argv[1])
from adapters.mooncake import MooncakeConfig, MooncakeStore
started = time.monotonic()
try:
    MooncakeStore(MooncakeConfig(master_server_address=sys.argv[2]), timeout=1.0,
                  setup_timeout=float(sys.argv[3]))
    error = None
except BaseException as exc:
    error = [type(exc).__name__, str(exc)]
print(json.dumps({"seconds": time.monotonic() - started, "error": error}), flush=True)
"""


def _serve(answer: bytes | None) -> tuple[socket.socket, threading.Event]:
    """A loopback server that accepts; sends ``answer`` then stays, or (None) never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()

    def loop() -> None:
        held = []
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            held.append(conn)
            if answer is not None:
                try:
                    conn.sendall(answer)
                except OSError:
                    pass
        for conn in held:
            conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return listener, stop


class _Quiet(http.server.BaseHTTPRequestHandler):
    """Answers every request 400 (Mooncake's RPC is not HTTP), and logs nothing."""

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def bad_addresses() -> Iterator[dict[str, str]]:
    """name -> an address where no mooncake_master is."""
    if os.environ.get("KVSTATE_NO_MOONCAKE") == "1":
        pytest.skip("KVSTATE_NO_MOONCAKE=1: the real store is switched off")
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    garbage, stop_garbage = _serve(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\xff" * 512)
    silent, stop_silent = _serve(None)
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        yield {"dead": f"127.0.0.1:{dead_port}",
               "garbage": f"127.0.0.1:{garbage.getsockname()[1]}",
               "silent": f"127.0.0.1:{silent.getsockname()[1]}",
               "http": f"127.0.0.1:{web.server_address[1]}"}
    finally:
        stop_garbage.set()
        stop_silent.set()
        web.shutdown()
        garbage.close()
        silent.close()


def _construct(address: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CONSTRUCT, str(ROOT), address,
                             str(SETUP_TIMEOUT)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, MC_LOG_LEVEL="ERROR"))


@pytest.mark.slow
@pytest.mark.mooncake
def test_setup_against_what_is_not_a_master_fails_within_the_timeout_naming_it(
        bad_addresses) -> None:
    runs = {name: _construct(address) for name, address in bad_addresses.items()}
    outcomes = {}
    deadline = time.monotonic() + SETUP_TIMEOUT + 20  # they run at once
    for name, run in runs.items():
        try:
            out, _ = run.communicate(timeout=max(0.0, deadline - time.monotonic()))
            outcomes[name] = json.loads(out.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            outcomes[name] = {"seconds": None, "error": ["still in setup after", "20 s"]}
    wrong = {}
    for name, outcome in outcomes.items():
        address, error = bad_addresses[name], outcome["error"]
        if (outcome["seconds"] is None or outcome["seconds"] > SETUP_TIMEOUT + SLACK
                or error is None or error[0] != "ConnectionError" or address not in error[1]):
            wrong[name] = outcome
    assert not wrong, f"each must fail within {SETUP_TIMEOUT} s (+{SLACK}) with a " \
                      f"ConnectionError naming its address: {wrong}"
    assert "no mooncake_master reachable" in outcomes["dead"]["error"][1]
    assert "got no answer" in outcomes["silent"]["error"][1] or \
        "RPC call timed out" in outcomes["silent"]["error"][1]


@pytest.mark.slow
@pytest.mark.mooncake
def test_ctrl_c_stops_a_setup_that_waits_for_an_answer(bad_addresses) -> None:
    address = bad_addresses["silent"]
    run = subprocess.Popen([sys.executable, "-c", CONSTRUCT, str(ROOT), address, "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env=dict(os.environ, MC_LOG_LEVEL="ERROR"))
    try:
        time.sleep(1.5)  # started, imported, waiting on the address
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()
        pytest.fail(f"setup against {address} ignored Ctrl-C for 5 s")
    assert json.loads(out.strip().splitlines()[-1])["error"][0] == "KeyboardInterrupt"


def measure(rounds: int = 7) -> dict[str, float]:
    """Median seconds of a bare binding setup, of the probe alone, and of a
    whole `MooncakeStore` construction, against one master, interleaved."""
    from statistics import median

    from adapters.master import Master
    from adapters.mooncake import (
        MooncakeConfig,
        MooncakeStore,
        _import_store,
        probe_master_setup,
    )

    master = Master()
    config = MooncakeConfig(master_server_address=master.address,
                            global_segment_size=16 << 20, local_buffer_size=16 << 20)
    binding = _import_store()
    times: dict[str, list[float]] = {"setup": [], "probe": [], "store": []}
    try:
        for _ in range(rounds):
            client = binding()
            started = time.perf_counter()
            rc = client.setup(config.local_hostname, config.metadata_server,
                              config.global_segment_size, config.local_buffer_size,
                              config.protocol, config.device_name, config.master_server_address)
            times["setup"].append(time.perf_counter() - started)
            assert rc == 0
            client.close()
            started = time.perf_counter()
            probe_master_setup(config, 30.0)
            times["probe"].append(time.perf_counter() - started)
            started = time.perf_counter()
            store = MooncakeStore(config)
            times["store"].append(time.perf_counter() - started)
            store.close()
    finally:
        master.stop()
    out = {name: median(values) for name, values in times.items()}
    out["probe_over_setup"] = out["probe"] / out["setup"]
    out["store_over_setup"] = out["store"] / out["setup"]
    return out


if __name__ == "__main__":
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    sys.path.insert(0, str(ROOT))
    print(json.dumps({k: round(v, 4) for k, v in measure().items()}))
