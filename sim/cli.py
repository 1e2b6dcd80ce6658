"""The ``kvstate`` command line.

Exit codes: 0 ok, 1 an invariant was violated, 2 a usage or input error, 130
interrupted (Ctrl-C), 141 the reader of the output went away. Every command that
reports a result takes ``--json`` and then prints exactly one JSON object with at
least ``ok`` and ``violations`` (`trace observed` writes a trace instead). One
module per command (`sim.commands`): each registers its own parser and runs it;
this module builds the parser from them and maps every error to its exit code,
once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from sim.commands import COMMANDS
from sim.commands.errors import UsageError
from sim.commands.options import add_sim_options, options_from

__all__ = ["UsageError", "add_sim_options", "build_parser", "main", "options_from"]


class _Parser(argparse.ArgumentParser):
    """argparse's refusal of an option (exit 2) also prints the ``--json``
    error object when the command line asks for JSON (`_json_error`)."""

    wants_json = False

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # Python 3.11's argparse drops a "--" given as an option's own value
        # (``--root=--``) and hands the option an empty list, past its type
        # and choices (a TypeError later): the value is the text "--".
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        # And it checks an absent ``nargs="*"`` positional's empty list against
        # its choices: ``kvstate bench`` (no part: "core sim") was refused as
        # "invalid choice: []".
        if not action.option_strings and action.nargs == argparse.ZERO_OR_MORE \
                and not arg_strings:
            return action.default if action.default is not None else []
        return super()._get_values(action, arg_strings)

    def error(self, message: str) -> NoReturn:
        if _Parser.wants_json:
            from sim.commands.output import envelope

            print(envelope({"ok": False, "violations": [], "error": {"message": message}}),
                  flush=True)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"sim.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _printable_output()
    parser = build_parser()
    _Parser.wants_json = "--json" in (sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    with _sigterm_unwinds():
        return _run(args)


def _printable_output() -> None:
    """Standard output (and error) write what they cannot encode as escapes,
    as Python's standard error does: a file name that is not UTF-8 (a lone
    surrogate once decoded) printed in a report ended the command with a
    UnicodeEncodeError traceback, after its work, under any UTF-8 locale but
    C.UTF-8 (issue 32, class 4)."""
    for stream in (sys.stdout, sys.stderr):  # (Python's own stderr does it already)
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            with contextlib.suppress(ValueError, OSError):  # closed, or not reconfigurable
                stream.reconfigure(errors="backslashreplace")


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a service manager, ``timeout``, ``kill``) unwinds the command
    like an exception, exit 143 (128 + 15): ``finally`` blocks run, so a file
    being written beside its destination is removed and worker pools and
    started processes are ended, where the default action would kill the
    process on the spot and leave them behind. Only from the main thread
    (a signal handler can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except SystemExit as exc:
        if exc.code == 128 + signal.SIGTERM:
            print(f"kvstate {sys.argv[1] if len(sys.argv) > 1 else ''}: terminated",
                  file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from kvstate.trace import TraceError
    from kvstate.workloads import WorkloadError
    from sim.extras import MissingExtra
    from sim.traces.coverage import CoverageError

    try:
        return int(args.func(args))
    except (UsageError, TraceError, WorkloadError, CoverageError, MissingExtra) as exc:
        print(f"kvstate {args.command}: error: {exc}", file=sys.stderr)
        _json_error(args, exc)
        return 2
    except BrokenPipeError:
        # Whoever read the output stopped reading (`| head`): nothing went
        # wrong here. Standard output goes to /dev/null so that the exit's own
        # flush does not fail again; 141 is what the shell reports for a
        # process SIGPIPE ended (128 + 13).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kvstate {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        _json_error(args, exc)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: no traceback; what the command printed so far stands. 130 is
        # the shell's code for a process ended by SIGINT (128 + 2).
        print(f"kvstate {args.command}: interrupted", file=sys.stderr)
        return 130


def _json_error(args: argparse.Namespace, exc: BaseException) -> None:
    """With ``--json``, exit 2 prints an object too, so a tool reading
    standard output gets the error (not nothing): ``ok`` false, no
    violations, and ``error`` with the message and, where the error knows
    them, the file (``where``: ``file:line`` for a trace) and ``field``."""
    if not getattr(args, "json", False):
        return
    from sim.commands.output import envelope

    error: dict[str, object] = {"message": getattr(exc, "message", None) or str(exc)}
    for name in ("where", "field"):
        value = getattr(exc, name, None)
        if value:
            error[name] = value
    if isinstance(exc, OSError):
        error["message"] = exc.strerror or str(exc)
        if exc.filename:
            error["where"] = str(exc.filename)
    try:
        print(envelope({"ok": False, "violations": [], "error": error}), flush=True)
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    sys.exit(main())
