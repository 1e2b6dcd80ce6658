"""``kvstate trace observed``: a trace cut to its observed layer.

What an engine that knows nothing of kvstate would have written for the same
run (`kvstate.contract`): no generation numbers, no rank-state writes, no
verdicts or claims of quiescence, no content tags. Engine authors use it to
see exactly what their recorder must write; the tests use it to show that a
trace with no annotations still shows every variant's bug (``kvstate check``
finds a subset of the same findings, ``kvstate replay`` derives the same
generations; `specs/trace.md` lists what only annotations let it judge).

The input is read twice: once through the checked reader (a malformed trace is
refused with file:line:field before anything is written), once to cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import attrs

from kvstate.contract import observed_layer
from kvstate.trace import TraceReader, iter_lines, open_trace_file, parse_json
from kvstate.trace.reader import trace_name


@attrs.frozen
class Cut:
    lines_in: int
    lines_out: int
    records_dropped: int  # annotation records (StateWritten, Quiescent)


def write_observed(src: str | Path, out: IO[str]) -> Cut:
    with TraceReader(src) as reader:  # validate first: nothing is written from a bad trace
        for _ in reader:
            pass
    lines_in = lines_out = 0
    name = trace_name(src)
    with open_trace_file(src) as handle:
        for number, text in iter_lines(handle, name):
            lines_in += 1
            kept = observed_layer(parse_json(text, f"{name}:{number}"))
            if kept is not None:
                out.write(json.dumps(kept, separators=(",", ":")) + "\n")
                lines_out += 1
    return Cut(lines_in, lines_out, lines_in - lines_out)

