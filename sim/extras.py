"""Optional dependencies, checked before a command starts its work.

The core needs only ``attrs``; a few commands need an extra (``pip install
'kvstate[EXTRA]'``). ``require`` names the extra instead of letting an
``ImportError`` escape as a traceback; the command line turns `MissingExtra`
into exit code 2 with that message.
"""

from __future__ import annotations

import importlib.util

# module -> the extra of pyproject.toml that installs it
EXTRAS = {
    "hypothesis": "fuzz",
    "matplotlib": "plot",
    "transitions": "test",
}


class MissingExtra(Exception):
    """A command needs a package that is not installed."""


def require(module: str, command: str) -> None:
    """Raise `MissingExtra` naming the extra if ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        extra = EXTRAS.get(module)
        how = f"pip install 'kvstate[{extra}]'" if extra else f"pip install {module}"
        raise MissingExtra(f"{command} needs the package {module!r}, which is not installed: "
                           f"{how}")
