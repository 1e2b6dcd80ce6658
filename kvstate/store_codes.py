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
    #: A get of an object whose put has not ended.
    REPLICA_IS_NOT_READY = -703
    #: Also ``PutEnd`` of an object whose metadata went meanwhile.
    OBJECT_NOT_FOUND = -704
    #: ``remove`` of an object another client holds a lease on.
    OBJECT_HAS_LEASE = -706
    #: ``Client::Get``: the lease its query took ran out mid-transfer.
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    #: ``Client::Get``: the bytes read fail the object's checksum.
    CHECKSUM_MISMATCH = -801
    #: The master is unreachable (killed, restarting).
    RPC_FAIL = -900
    #: The master did not answer in time.
    RPC_TIMEOUT = -901


def code_name(code: int) -> str:
    """``"NO_AVAILABLE_HANDLE"`` for -200; ``"ERROR_-123"`` for a code not listed."""
    try:
        return StoreCode(code).name
    except ValueError:
        return f"ERROR_{code}"
