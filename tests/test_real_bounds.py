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
