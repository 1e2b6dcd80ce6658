"""Minimizing never proposes an engine shape that cannot exist.

A shrink pass that halves the world size must keep ``put_step`` dividing it (the
replication factor of MLA-style striding); a candidate no engine could have is
not a smaller failing run and is skipped. Before, ``kvstate minimize --protocol
stride-by-relative-chunk --put-step 2 --world-size 2`` ended in a ValueError
traceback from the config's own validation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.variants import VARIANTS
from sim.cli import main
from sim.simulator.runner import SimOptions, build_configs
from sim.traces.minimize import minimize


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "kvstate"])
def test_every_shrunk_shape_is_a_valid_engine(variant: str) -> None:
    # Every variant's bug shows at this shape and seed, so there is always a run to shrink.
    shrunk = minimize(SimOptions(protocol=variant, put_step=2, world_size=2), max_runs=60)
    build_configs(shrunk.options)  # raises on an impossible shape
    assert shrunk.options.world_size % shrunk.options.put_step == 0
    assert shrunk.options.requests <= 400


def test_the_reported_command_minimizes_without_a_traceback(tmp_path: Path, capsys) -> None:
    out = tmp_path / "min.jsonl"
    code = main(["minimize", "--protocol", "stride-by-relative-chunk", "--put-step", "2",
                 "--world-size", "2", "--max-runs", "60", "--out", str(out), "--json"])
    assert code == 1  # minimized a violating run
    assert out.exists() and main(["check", str(out)]) == 1
    assert "Traceback" not in capsys.readouterr().err
