"""The pictures: `plot` (a run's timeline from its trace) and `diagram_svg`
(a machine's table as an SVG state diagram). They draw and return a summary;
the command layer (`sim.commands.plot`, `sim.commands.diagram`) checks the
options and the output path and prints."""
