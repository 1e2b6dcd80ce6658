"""A master address where nothing listens fails at once, naming the address.

Mooncake's client retries ``setup`` for a minute or more against a dead
address; ``kvstate real --master`` (and every ``MooncakeStore``) now checks the
TCP port first. Loopback only.
"""

from __future__ import annotations

import socket

import pytest

from adapters.mooncake import MooncakeConfig, MooncakeStore, probe_master
from sim.cli import main


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_store_against_a_dead_master_names_the_address() -> None:
    address = f"127.0.0.1:{closed_port()}"
    with pytest.raises(ConnectionError, match=f"no mooncake_master reachable at {address}"):
        MooncakeStore(MooncakeConfig(master_server_address=address), timeout=1.0)


def test_kvstate_real_against_a_dead_master_is_a_usage_error(capsys) -> None:
    address = f"127.0.0.1:{closed_port()}"
    assert main(["real", "--master", address, "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert f"no mooncake_master reachable at {address}" in err
    assert "Traceback" not in err


def test_a_listening_port_passes_and_a_malformed_address_is_refused() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        probe_master(f"127.0.0.1:{listener.getsockname()[1]}", 1.0)  # no error
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        probe_master("localhost", 1.0)
