"""What a local worker process does first: take the signals back.

Campaigns, the model checker and the per-variant tool table fork worker
processes. A worker leaves Ctrl-C to its parent, which ends it: a terminal
sends SIGINT to the whole process group, and each worker's
KeyboardInterrupt would print a traceback. And a worker dies quietly when
its pool ends it (SIGTERM): a process forked after Ray started in the parent
(``--ray``, or a library user's ``ray.init()``) inherits Ray's crash handler,
which printed a stack dump per worker at every pool's end.
"""

from __future__ import annotations

import signal


def take_signals() -> None:
    """Ctrl-C ignored (the parent's), SIGTERM the default (die quietly)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


__all__ = ["take_signals"]
