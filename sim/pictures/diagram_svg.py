"""``kvstate diagram MACHINE --svg OUT.svg``: a machine's table drawn as an SVG.

The picture is built from `kvstate.tables` alone, like the mermaid diagrams of
`kvstate.diagrams`, and laid out without a graph-layout tool (no graphviz):

- **layers**: a depth-first walk from the initial state, in table order, marks
  the edges that close a cycle; without them and the self-loops the table is a
  DAG, and each state sits on the layer of its longest path from the initial
  state (so a flow reads top to bottom; a state the initial one does not reach
  starts a walk of its own). Within a layer, states keep table order, centred.
- **states** are boxes (a final state, one whose row is empty, has a double
  border); a dot and an arrow mark the initial state.
- **transitions** are arrows labelled with the event; an event whose guard the
  table names (``Machine.guards``) carries a tag ``[G1]`` whose text is listed
  under the diagram. Arrows between the same two states bow apart; an arrow
  that skips a layer or runs along one bows out of the row; self-loops are
  loops on the box's right side.

With coverage (the (state, event) pairs traces fired), each transition is
green (fired) or red (never fired), and each box filled as the mermaid diagram
does (every outgoing transition fired, some, or the state never visited);
without it, transitions are grey (no coverage to show). Every box and arrow
carries an SVG id (``state-NAME``, ``transition-STATE-EVENT``) so tools and
tests can find them. The output is byte-identical for the same input: a fixed
``svg.hashsalt``, no date in the metadata, text kept as ``<text>``.
matplotlib is needed (``pip install 'kvstate[plot]'``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from kvstate.tables import Machine

COVERED = "#2ca02c"  # a transition the traces fired
NEVER = "#d62728"  # a transition they never fired
NOT_APPLICABLE = "#7f7f7f"  # no coverage given (and the initial marker)
FILLS = {"covered": "#ccffcc", "partial": "#ffffdd", "unvisited": "#ffcccc", None: "#eef2fa"}

X_GAP = 1.4  # between boxes of a layer (data units)
Y_GAP = 2.4  # between layers
BOX_H = 0.6
CHAR_W = 0.13  # width of a character of a state's name in a box
SCALE = 1.05  # inches per data unit
BENDS = (0.0, 0.2, -0.2, 0.35, -0.35, 0.5, -0.5, 0.7, -0.7, 0.9, -0.9)  # arc3 rad tried
FAN = 0.28  # rad between arrows joining the same two states
LABEL_CHAR_W = 0.058  # width of a character of a transition's label
LABEL_AT = (0.5, 0.42, 0.58, 0.34, 0.66, 0.26, 0.74)  # where on its arrow a label may go
SIDE = 2.2  # room beside the widest layer for arrows bowing out and loops
MARGIN = 0.12  # clearance an arrow keeps from other boxes


def _point(p0: tuple[float, float], p2: tuple[float, float], rad: float,
           t: float) -> tuple[float, float]:
    """The point at ``t`` of matplotlib's arc3 curve from p0 to p2 (a quadratic
    Bezier whose control point is the chord's midpoint moved ``rad`` chord
    lengths to one side)."""
    (x0, y0), (x2, y2) = p0, p2
    cx = (x0 + x2) / 2 + rad * (y2 - y0)
    cy = (y0 + y2) / 2 - rad * (x2 - x0)
    u = 1 - t
    return (u * u * x0 + 2 * u * t * cx + t * t * x2, u * u * y0 + 2 * u * t * cy + t * t * y2)


def _curve(p0: tuple[float, float], p2: tuple[float, float],
           rad: float) -> list[tuple[float, float]]:
    """Points along the arc3 curve, away from its ends (inside the two boxes)."""
    return [_point(p0, p2, rad, i / 40) for i in range(2, 39)]


def _overlaps(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    """Whether two (centre x, centre y, half width, half height) rectangles meet."""
    return abs(a[0] - b[0]) < a[2] + b[2] and abs(a[1] - b[1]) < a[3] + b[3]


def _crossings(p0: tuple[float, float], p2: tuple[float, float], base: float, fan: int,
               boxes: list[tuple[float, float, float, float]], x_span: float) -> int:
    """How often ``fan`` arrows bowed around ``base`` run through other boxes
    (or so far out that a label would leave the picture)."""
    total = 0
    for k in range(fan):
        for px, py in _curve(p0, p2, base + FAN * (k - (fan - 1) / 2)):
            total += abs(px) > x_span / 2 - 1.0
            total += sum(1 for b in boxes if _overlaps((px, py, 0.0, 0.0), b))
    return total


@attrs.frozen
class DiagramSummary:
    machine: str
    output: str
    states: int
    transitions: int
    covered: int | None  # None: no coverage given
    never: tuple[tuple[str, str], ...]


def _layers(machine: Machine[Any, Any]) -> dict[Any, int]:
    states: list[Any] = [*machine.table]  # table order: every state has a row
    back: set[tuple[Any, Any]] = set()
    seen: set[Any] = set()
    on_path: set[Any] = set()

    def walk(state: Any) -> None:
        seen.add(state)
        on_path.add(state)
        for nxt in machine.table[state].values():
            if nxt in on_path:
                back.add((state, nxt))
            elif nxt not in seen:
                walk(nxt)
        on_path.discard(state)

    walk(machine.initial)
    for state in states:  # states the initial state does not reach
        if state not in seen:
            walk(state)
    layer = {s: 0 for s in states}
    for _ in states:  # longest path on the DAG (at most |states| rounds)
        changed = False
        for s in states:
            for nxt in machine.table[s].values():
                if nxt is not s and (s, nxt) not in back and layer[nxt] < layer[s] + 1:
                    layer[nxt] = layer[s] + 1
                    changed = True
        if not changed:
            break
    return layer


def _state_classes(machine: Machine[Any, Any], seen: set[tuple[Any, Any]]) -> dict[Any, str]:
    """covered / partial / unvisited per state, as `kvstate.diagrams.to_mermaid`."""
    out = {}
    for state in machine.states:
        row = [(state, e) for e in machine.table[state]]
        hit = sum(1 for pair in row if pair in seen)
        visited = hit or any(s is state for s, _ in seen) or any(
            machine.table[s].get(e) is state for s, e in seen)
        out[state] = ("covered" if row and hit == len(row)
                      else "partial" if visited else "unvisited")
    return out


def draw(machine: Machine[Any, Any], output: str | Path,
         coverage: Iterable[tuple[enum.Enum, enum.Enum]] | None = None,
         *, title: str | None = None) -> DiagramSummary:
    """Draw ``machine``'s table into the SVG file ``output``."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    seen = set(coverage) if coverage is not None else None
    states: list[Any] = [*machine.table]  # table order: every state has a row
    layer = _layers(machine)
    rows: dict[int, list[Any]] = {}
    for s in states:
        rows.setdefault(layer[s], []).append(s)
    width = {s: CHAR_W * len(s.name) + 0.5 for s in states}
    pos: dict[Any, tuple[float, float]] = {}
    for n, row in sorted(rows.items()):
        total = sum(width[s] for s in row) + X_GAP * (len(row) - 1)
        x = -total / 2
        for s in row:
            pos[s] = (x + width[s] / 2, -n * Y_GAP)
            x += width[s] + X_GAP
    order = {s: i for i, s in enumerate(states)}

    guard_tags: dict[Any, str] = {}
    for s in states:
        for e in machine.table[s]:
            if e in machine.guards and e not in guard_tags:
                guard_tags[e] = f"G{len(guard_tags) + 1}"

    # Bend of every non-loop arrow: the arrows between two states (either
    # direction) fan out around a base bend, the first of BENDS whose curves
    # cross no other box (else the one crossing fewest).
    pairs: dict[tuple[Any, Any], list[tuple[Any, Any]]] = {}
    for s in states:
        for e, nxt in machine.table[s].items():
            if nxt is not s:
                a, b = sorted((s, nxt), key=order.__getitem__)
                pairs.setdefault((a, b), []).append((s, e))
    x_span = max(sum(width[s] for s in r) + X_GAP * (len(r) - 1) for r in rows.values()) + 2 * SIDE
    rad: dict[tuple[Any, Any], float] = {}
    for (a, b), edges in pairs.items():
        boxes_around = [(pos[s][0], pos[s][1], width[s] / 2 + MARGIN, BOX_H / 2 + MARGIN)
                        for s in states if s is not a and s is not b]
        scores = [(_crossings(pos[a], pos[b], base, len(edges), boxes_around, x_span), n)
                  for n, base in enumerate(BENDS)]
        base = BENDS[min(scores)[1]]
        for k, (s, e) in enumerate(edges):
            geometric = base + FAN * (k - (len(edges) - 1) / 2)
            rad[(s, e)] = geometric if s is a else -geometric

    # Sizes in inches: one data unit is SCALE inches on both axes (so arc3's
    # curves are the ones `_curve` tested), a title band above, guards below.
    guard_lines = [f"{tag}  {e.name.lower()}: {machine.guards[e]}"
                   for e, tag in guard_tags.items()]
    y_span = max(rows) * Y_GAP + 2.4
    ax_w, ax_h = x_span * SCALE, y_span * SCALE
    below = 0.17 * (len(guard_lines) + 1) + 0.4
    above = 0.5
    fig_w = max(ax_w, 0.07 * max((len(line) for line in guard_lines), default=0) + 2.0)
    fig_h = ax_h + below + above
    # A fixed salt for the ids matplotlib hashes, text kept as <text> (so the
    # names can be searched), matplotlib's own font: the same bytes every time.
    with matplotlib.rc_context({"svg.hashsalt": f"kvstate-diagram-{machine.name}",
                                "svg.fonttype": "none", "font.family": "DejaVu Sans",
                                "path.simplify": False}):
        fig = Figure(figsize=(fig_w, fig_h))
        ax = fig.add_axes(((fig_w - ax_w) / 2 / fig_w, below / fig_h, ax_w / fig_w, ax_h / fig_h))
        ax.set_axis_off()
        ax.set_xlim(-x_span / 2, x_span / 2)
        ax.set_ylim(-max(rows) * Y_GAP - 1.0, 1.4)
        ax.set_aspect("equal", adjustable="box")

        classes = _state_classes(machine, seen) if seen is not None else {}
        boxes = {}
        for s in states:
            x, y = pos[s]
            final = not machine.table[s]
            box = FancyBboxPatch((x - width[s] / 2, y - BOX_H / 2), width[s], BOX_H,
                                 boxstyle="round,pad=0.02,rounding_size=0.12",
                                 facecolor=FILLS[classes.get(s)], edgecolor="#223355",
                                 linewidth=2.4 if final else 1.2, zorder=2)
            box.set_gid(f"state-{s.name}")
            ax.add_patch(box)
            boxes[s] = box
            if final:  # a double border
                inner = FancyBboxPatch((x - width[s] / 2 + 0.07, y - BOX_H / 2 + 0.07),
                                       width[s] - 0.14, BOX_H - 0.14,
                                       boxstyle="round,pad=0.0,rounding_size=0.08",
                                       facecolor="none", edgecolor="#223355",
                                       linewidth=0.8, zorder=2)
                ax.add_patch(inner)
            ax.text(x, y, s.name, ha="center", va="center", fontsize=9, zorder=3,
                    gid=f"label-{s.name}")

        ix, iy = pos[machine.initial]
        ax.plot([ix], [iy + BOX_H / 2 + 0.55], "o", color="black", markersize=7)
        start = FancyArrowPatch((ix, iy + BOX_H / 2 + 0.5), (ix, iy + BOX_H / 2),
                                arrowstyle="-|>", mutation_scale=12, color="black",
                                linewidth=1.0, shrinkA=0, shrinkB=0)
        start.set_gid("initial")
        ax.add_patch(start)

        counted = 0
        never: list[tuple[str, str]] = []
        loops: dict[Any, int] = {}
        taken = [(pos[s][0], pos[s][1], width[s] / 2, BOX_H / 2) for s in states]
        for s in states:
            for e, nxt in machine.table[s].items():
                if seen is None:
                    colour = NOT_APPLICABLE
                elif (s, e) in seen:
                    colour = COVERED
                    counted += 1
                else:
                    colour = NEVER
                    never.append((s.name, e.name))
                label = e.name.lower() + (f" [{guard_tags[e]}]" if e in guard_tags else "")
                x, y = pos[s]
                if nxt is s:
                    k = loops.get(s, 0)
                    loops[s] = k + 1
                    right = x + width[s] / 2
                    arrow = FancyArrowPatch((right, y + 0.14), (right, y - 0.14),
                                            connectionstyle=f"arc3,rad={-2.2 - 1.6 * k}",
                                            arrowstyle="-|>", mutation_scale=11,
                                            color=colour, linewidth=1.3,
                                            shrinkA=0, shrinkB=0, zorder=1)
                    # the loop's farthest point: half its arc3 control offset
                    lx, ly = right + 0.14 * (2.2 + 1.6 * k) + 0.08, y
                    ha = "left"
                    half_w = LABEL_CHAR_W * len(label) / 2 + 0.05
                    taken.append((lx + half_w, ly, half_w, 0.12))
                else:
                    r = rad[(s, e)]
                    arrow = FancyArrowPatch(pos[s], pos[nxt],
                                            connectionstyle=f"arc3,rad={r}",
                                            arrowstyle="-|>", mutation_scale=12,
                                            color=colour, linewidth=1.3, patchA=boxes[s],
                                            patchB=boxes[nxt], shrinkA=1, shrinkB=1,
                                            zorder=1)
                    # the label near the curve's midpoint, where it covers
                    # no box and no label placed before it
                    half = (LABEL_CHAR_W * len(label) / 2 + 0.05, 0.12)
                    lx, ly = _point(pos[s], pos[nxt], r, 0.5)
                    for t in LABEL_AT:
                        px, py = _point(pos[s], pos[nxt], r, t)
                        rect = (px, py, *half)
                        if not any(_overlaps(rect, other) for other in taken):
                            lx, ly = px, py
                            break
                    taken.append((lx, ly, *half))
                    ha = "center"
                arrow.set_gid(f"transition-{s.name}-{e.name}")
                ax.add_patch(arrow)
                ax.text(lx, ly, label, ha=ha, va="center", fontsize=7, color=colour,
                        zorder=4, gid=f"transition-label-{s.name}-{e.name}",
                        bbox={"boxstyle": "round,pad=0.12", "facecolor": "white",
                              "edgecolor": "none", "alpha": 0.85})

        entries = sum(len(machine.table[s]) for s in states)
        heading = title or f"{machine.name} machine (kvstate.tables)"
        if seen is not None:
            heading += f": {counted} of {entries} transitions fired"
        fig.text(0.5, 1.0 - 0.28 / fig_h, heading, ha="center", va="center", fontsize=12)
        handles = [Line2D([], [], color=c, linewidth=2, label=t) for c, t in (
            ((COVERED, f"fired ({counted})"), (NEVER, f"never fired ({len(never)})"))
            if seen is not None else ((NOT_APPLICABLE, "transition (no coverage given)"),))]
        fig.legend(handles=handles, loc="lower right", fontsize=8, frameon=False,
                   bbox_to_anchor=(0.99, 0.0))
        if guard_lines:
            fig.text(0.15 / fig_w, 0.15 / fig_h, "guards\n" + "\n".join(guard_lines),
                     ha="left", va="bottom", fontsize=8, linespacing=1.5)
        fig.savefig(output, format="svg", metadata={"Date": None})
    return DiagramSummary(machine=machine.name, output=str(output), states=len(states),
                          transitions=entries, covered=counted if seen is not None else None,
                          never=tuple(never))
