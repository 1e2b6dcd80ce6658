"""What the long commands show on a terminal: a progress bar on stderr and, on a
terminal stdout, their result tables drawn by ``rich``.

A bar appears only when stderr is a terminal, ``--json`` is not given and
``--no-progress`` is not given; it is transient (erased when the work ends), so
what stays on the screen is what the command prints without one. Nothing here
writes to stdout except `print_table`, which draws a rich table only when stdout
is a terminal and otherwise prints `sim.commands.output.table` exactly as
before. ``rich`` is optional (the ``progress`` extra): without it the bar is one
plain status line on stderr, rewritten in place.

Every command uses one API::

    with progress_for(args, total=seeds, label="kvstate", unit="seeds") as bar:
        bar.advance(1, found="S16")          # or bar.update(completed=..., **fields)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Protocol

from sim.commands.output import table

# At most this many seconds between redraws forced by an update (the rich bar
# also redraws itself a few times a second, for its spinner and clock).
MIN_REFRESH = 0.1
# The plain fallback rewrites its line at most this often.
PLAIN_INTERVAL = 0.5
PLAIN_WIDTH = 100


class Bar(Protocol):
    # False for the NullBar: a command then passes no callback at all, so a run
    # without a bar is the run it was before there were bars.
    active: bool

    def advance(self, n: float = 1, **fields: object) -> None: ...

    def update(self, *, completed: float | None = None, total: float | None = None,
               **fields: object) -> None: ...


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr and no rich tables: plain output, as "
                        "when not on a terminal (--json never shows a bar either)")


def _off(args: argparse.Namespace) -> bool:
    """``--json`` or ``--no-progress``: plain output whatever the terminal."""
    return bool(getattr(args, "json", False) or getattr(args, "no_progress", False))


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _count(completed: float, total: float | None, unit: str) -> str:
    def num(x: float) -> str:
        return f"{x:.1f}" if unit == "s" else f"{int(x):,}"

    if total is None:
        return f"{num(completed)} {unit}".strip() if unit else ""
    return f"{num(completed)}/{num(total)} {unit}".strip()


def _info(fields: dict[str, object]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in fields.items() if v is not None)


class _State:
    """Counts and fields shared by both renderers."""

    def __init__(self, total: float | None, unit: str) -> None:
        self.completed = 0.0
        self.total = total
        self.unit = unit
        self.fields: dict[str, object] = {}

    def apply(self, advance: float, completed: float | None, total: float | None,
              fields: dict[str, object]) -> None:
        self.completed = (self.completed if completed is None else completed) + advance
        if total is not None:
            self.total = total
        self.fields.update(fields)


class NullBar:
    """Progress off: every call does nothing."""

    active = False

    def advance(self, n: float = 1, **fields: object) -> None:
        pass

    def update(self, *, completed: float | None = None, total: float | None = None,
               **fields: object) -> None:
        pass


class PlainBar:
    """Without rich (or on a dumb terminal): one status line, rewritten in place
    at most every `PLAIN_INTERVAL` seconds and cleared at the end."""

    active = True

    def __init__(self, stream: IO[str], label: str, total: float | None, unit: str) -> None:
        self.stream, self.label = stream, label
        self.state = _State(total, unit)
        self.started = time.perf_counter()
        self.last = 0.0
        self.shown = False
        # One character short of the terminal: a full-width line would wrap.
        self.width = min(PLAIN_WIDTH, shutil.get_terminal_size((PLAIN_WIDTH + 1, 24)).columns - 1)
        self._draw()  # at once, as the rich bar: a first report may be seconds away

    def advance(self, n: float = 1, **fields: object) -> None:
        self.state.apply(n, None, None, fields)
        self._draw()

    def update(self, *, completed: float | None = None, total: float | None = None,
               **fields: object) -> None:
        self.state.apply(0, completed, total, fields)
        self._draw()

    def line(self) -> str:
        s = self.state
        parts = [self.label, _count(s.completed, s.total, s.unit),
                 f"{time.perf_counter() - self.started:.0f} s elapsed", _info(s.fields)]
        return "  ".join(p for p in parts if p)[:self.width]

    def _draw(self) -> None:
        now = time.perf_counter()
        if self.shown and now - self.last < PLAIN_INTERVAL:
            return
        self.last = now
        self.stream.write("\r" + self.line().ljust(self.width))
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _rich_columns() -> list[Any]:
    """Spinner, label, bar, count, elapsed, the caller's fields (last: on a
    narrow terminal they are what is cut). The spinner and the clock keep
    going at a full bar: the work is over only when the bar goes away (a
    simulation settles after its last arrival)."""
    from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Spinner(SpinnerColumn):
        def render(self, task: Any) -> Any:
            return self.spinner.render(task.get_time())

    class Elapsed(TimeElapsedColumn):
        def render(self, task: Any) -> Text:
            seconds = int(task.elapsed or 0)
            return Text(f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}",
                        style="progress.elapsed")

    return [Spinner(), TextColumn("[bold]{task.description}"), BarColumn(bar_width=20),
            TextColumn("{task.fields[count]}"), Elapsed(), TextColumn("{task.fields[info]}")]


class RichBar:
    """A transient rich bar (`_rich_columns`; the bar pulses without a total)."""

    active = True

    def __init__(self, console: Any, label: str, total: float | None, unit: str) -> None:
        from rich.progress import Progress

        self.state = _State(total, unit)
        # The bar draws on its own console (stderr) and leaves sys.stdout and
        # sys.stderr alone: what a command prints to stdout goes where it went.
        self.progress = Progress(*_rich_columns(), console=console, transient=True,
                                 redirect_stdout=False, redirect_stderr=False,
                                 refresh_per_second=4)
        self.task = self.progress.add_task(label, total=total, count=_count(0, total, unit),
                                           info="")
        self.last = 0.0

    def advance(self, n: float = 1, **fields: object) -> None:
        self._set(n, None, None, fields)

    def update(self, *, completed: float | None = None, total: float | None = None,
               **fields: object) -> None:
        self._set(0, completed, total, fields)

    def _set(self, advance: float, completed: float | None, total: float | None,
             fields: dict[str, object]) -> None:
        s = self.state
        s.apply(advance, completed, total, fields)
        self.progress.update(self.task, completed=s.completed, total=s.total,
                             count=_count(s.completed, s.total, s.unit), info=_info(s.fields))
        now = time.perf_counter()
        if now - self.last >= MIN_REFRESH:
            self.last = now
            self.progress.refresh()


def _rich_console(stream: IO[str]) -> Any:
    """A rich console on ``stream``, or None where rich is not installed."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=stream)


@contextmanager
def progress_for(args: argparse.Namespace, *, total: float | None = None, label: str = "",
                 unit: str = "", stream: IO[str] | None = None,
                 console: Any = None) -> Iterator[Bar]:
    """A progress bar for one piece of work: ``total`` units of ``unit`` (None:
    unknown, the bar pulses). A `NullBar` unless stderr is a terminal and
    neither ``--json`` nor ``--no-progress`` was given; then a rich bar when
    rich is installed and the terminal takes escape codes, else a `PlainBar`. ``console`` (a rich Console) replaces stderr, for tests; its
    ``is_terminal`` then stands for the TTY check."""
    if console is not None:
        stream = console.file
        tty = bool(console.is_terminal)
    else:
        stream = sys.stderr if stream is None else stream
        tty = _isatty(stream)
    if _off(args) or not tty:
        yield NullBar()
        return
    if console is None:
        console = _rich_console(stream)
    if console is None or console.is_dumb_terminal:
        plain = PlainBar(stream, label, total, unit)
        try:
            yield plain
        finally:
            plain.close()
        return
    if not console.is_terminal:  # TTY_COMPATIBLE=0 and the like: no bar
        yield NullBar()
        return
    bar = RichBar(console, label, total, unit)
    with bar.progress:  # stopped (and erased) on any exit, Ctrl-C included
        yield bar


def print_table(args: argparse.Namespace, rows: list[list[str]],
                stream: IO[str] | None = None) -> None:
    """``rows`` (the first the header) as a rich table where stdout is a
    terminal and progress is on; otherwise exactly ``print(table(rows))``, as
    the commands printed it before."""
    out = sys.stdout if stream is None else stream
    if _off(args) or not _isatty(out):
        print(table(rows), file=out)
        return
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(table(rows), file=out)
        return
    console = Console(file=out)
    if not console.is_terminal or console.is_dumb_terminal:
        print(table(rows), file=out)
        return
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in rows[0]:
        grid.add_column(Text(name), overflow="fold")
    for row in rows[1:]:
        grid.add_row(*(Text(cell) for cell in row))  # cells are text, never rich markup
    console.print(grid)
