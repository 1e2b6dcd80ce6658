"""kvstate inside vLLM 0.33.0: ``KvstateConnector`` (needs the ``vllm`` extra).

vLLM imports this package by ``kv_connector_module_path="adapters.vllm"`` and
takes ``KvstateConnector`` (or ``ObservedMooncakeStoreConnector``, upstream's
connector watched by kvstate) from it; importing it therefore imports vLLM. Other
modules of the package (the conformance harness, the test rig) are imported by
name and pull in only what they use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvstateConnector", "ObservedMooncakeStoreConnector"]


def __getattr__(name: str) -> Any:
    # Lazy: `import adapters.vllm.options` must not import vLLM.
    if name == "KvstateConnector":
        from .connector import KvstateConnector

        return KvstateConnector
    if name == "ObservedMooncakeStoreConnector":
        from .observer import ObservedMooncakeStoreConnector

        return ObservedMooncakeStoreConnector
    raise AttributeError(name)
