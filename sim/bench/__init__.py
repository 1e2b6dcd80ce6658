"""``kvstate bench``: one benchmark a module, each timing one thing against a
baseline measured in the same run (never against a fixed time).

* `sim.bench.core`: the connector's bookkeeping per decode step (planner, ranks);
* `sim.bench.simulation`: simulator throughput against a bare event loop;
* `sim.bench.check`: trace-check throughput by decoder;
* `sim.bench.memory`: peak memory of a FAST'25 replay;
* `sim.bench.variants`: time to catch each seeded variant;
* `sim.bench.tools`: every variant against the simulator, Hypothesis and the model checker;
* `sim.bench.stateful`: the Hypothesis state machine's rate;
* `sim.bench.modelcheck`, `sim.bench.visited`, `sim.bench.campaign`: verification at
  scale (issue 11); `sim.bench.clock` is the CPU clock they read.

A benchmark imports the tools it times (`sim.explore`, `sim.traces`, `sim.simulator`),
never the command layer: `sim.commands.bench` formats and prints.
"""
