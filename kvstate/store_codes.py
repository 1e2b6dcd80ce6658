"""The Mooncake store's return codes, by name.

Mooncake's Python client answers store calls with integers, not exceptions:
0 for success, a negative ``ErrorCode`` otherwise. The values are Mooncake's
own (``enum class ErrorCode`` in ``mooncake-store/include/types.h``; those a
connector meets are listed here). A code not listed reads as ``ERROR_<n>``.
"""

from __future__ import annotations

import enum


class StoreCode(enum.IntEnum):
    OK = 0
    #: The store has no space for the object: a put under pressure. The
    #: connector backs off and marks the request skipped (PRESSURE table).
    NO_AVAILABLE_HANDLE = -200
    #: Bad arguments, also an empty value or one larger than the client's
    #: local buffer.
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    #: ``remove`` of an object another client holds a lease on.
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    #: The master is unreachable (killed, restarting).
    RPC_FAIL = -900


def code_name(code: int) -> str:
    """``"NO_AVAILABLE_HANDLE"`` for -200; ``"ERROR_-123"`` for a code not listed."""
    try:
        return StoreCode(code).name
    except ValueError:
        return f"ERROR_{code}"
