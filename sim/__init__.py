"""kvstate's tools, in layers (docs/reference/layout.md; tests/test_layout.py
keeps imports one way): `sim.cli` and `sim.commands` on top; `sim.bench` and
`sim.pictures`; `sim.explore` and `sim.traces`; `sim.simulator` at the
bottom, over the core, `kvstate`."""
