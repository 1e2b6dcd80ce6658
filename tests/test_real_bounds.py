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
])
def test_sizes_beyond_their_bound_are_refused_before_any_work(
        capsys, argv: list[str], words: list[str]) -> None:
    assert main(["real", *argv]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err
    assert "Traceback" not in err
