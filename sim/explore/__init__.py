"""The exploration engines, above the simulator: seeded campaigns
(`campaign`), Hypothesis's stateful machine (`fuzz`), the model checker
(`modelcheck`, a sub-package), a Ray cluster (`cluster`) and worker processes
(`workers`) that campaigns, the model checker and benchmarks spread over.
Imports `sim.simulator` and `kvstate`; never the trace tools, pictures,
benchmarks or commands."""
