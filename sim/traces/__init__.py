"""The trace tools: read a trace someone wrote (the simulator, a real engine,
a recorder) and judge it. `check` (the invariant catalogue over a trace),
`replay` (a trace's decisions against kvstate's or a variant's planner),
`minimize` (shrink a failing run or trace), `observed` (cut a trace to the
observed layer), `coverage` (the transitions a trace fired). Import
`sim.simulator` (minimize re-runs the simulator) and `kvstate`."""
