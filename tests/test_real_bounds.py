"""`kvstate real` checks what it would allocate before starting anything.

Before, ``--block-size 1000000`` built 30 GiB of KV caches and was killed for
memory. Now every size is checked against its stated bound first and refused
with exit 2 naming the option, the value and the bound.
"""

from __future__ import annotations

import pytest

from sim.cli import main


@pytest.mark.parametrize("argv, words", [
    (["--block-size", "1000000"], ["--block-size=1000000", "GiB", "--block-size <="]),
    (["--block-size", "40000", "--world-size", "4"], ["--block-size=40000", "--world-size 4"]),
    (["--segment-mib", "1"], ["--segment-mib=1", "16 MiB"]),
    (["--segment-mib", "100000000"], ["--segment-mib=100000000"]),
    # An outside review: 3 GB of workload built after the master started, and
    # an OverflowError from the socket layer.
    (["--requests", "100000000"], ["--requests=100000000", "at most 100,000"]),
    (["--timeout", "1e10"], ["--timeout=1e+10", "at most 3600 seconds"]),
])
def test_sizes_beyond_their_bound_are_refused_before_any_work(
        capsys, argv: list[str], words: list[str]) -> None:
    assert main(["real", *argv]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err
    assert "Traceback" not in err


def test_the_master_binary_is_found_beside_python_when_not_on_path(monkeypatch) -> None:
    # A virtualenv used without activating it: its bin/ holds mooncake_master
    # but is not on PATH ("not found: pip install" was the advice before).
    import os
    import sys

    from adapters.master import master_binary

    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.access(beside, os.X_OK):
        pytest.skip("no mooncake_master beside this Python (the mooncake extra is elsewhere)")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert master_binary() == beside


@pytest.mark.slow
@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\n\r\nnot a master\n"],
                         ids=["never-answers", "something-else-answers"])
def test_real_against_an_address_that_is_not_a_master_fails_in_time_naming_it(
        answer: bytes) -> None:
    """An outside review: ``kvstate real --master 127.0.0.1:P`` where a
    socket accepts and never answers hung past ``--timeout 3`` (Mooncake's
    setup retries while holding Python's GIL, so no timer could fire). The
    store now probes the master in a child process: exit 2 within the setup
    timeout (here max(10, 3 x 3) s), the address named, no traceback."""
    import socket
    import subprocess
    import sys
    import threading
    import time

    pytest.importorskip("mooncake.store")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)  # kept open: the client waits on it
            if answer:
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "sim.cli", "real", "--master",
                               f"127.0.0.1:{port}", "--timeout", "3", "--requests", "2"],
                              capture_output=True, text=True, timeout=120)
    finally:
        server.close()
        for conn in held:
            conn.close()
    took = time.monotonic() - started
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    assert took < 60, took  # the setup bound is 10 s; interpreter start and imports aside
