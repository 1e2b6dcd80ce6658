"""The simulator proper, the bottom of `sim`: a discrete-event kernel
(`kernel`), the engine model (`engine`), the simulated store (`store`), fault
injection (`faults`), the KV-event consumer (`consumer`), the run that wires
them to kvstate's planner and ranks (`runner`), and the scripted walk-through
(`demo`). The workloads it runs are `kvstate.workloads` (shared with the real
runner in `adapters`). Imports `kvstate` only."""
