"""Shared fixtures: one real Mooncake master and store per test session.

The Mooncake tests run for real: a missing package or library fails them. They
skip only when ``KVSTATE_NO_MOONCAKE=1`` says the store is unavailable on
purpose.

Markers (registered in pyproject.toml): ``slow`` (left out of a plain
``pytest``; ``pytest -m ''`` runs everything, as CI does), ``mooncake`` (added
here to every test that uses the real store), ``vllm``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


MOONCAKE_FIXTURES = {"mooncake_master", "mooncake_store"}


def _json_values() -> Any:
    """Any JSON value a user could write (Hypothesis), for the config parsers' tests."""
    from hypothesis import strategies as st

    return st.recursive(
        st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
        | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                    max_size=3),
        max_leaves=8)


json_values = _json_values()


# Test modules marked slow as a whole (their ``pytestmark``). The default
# selection (``-m 'not slow'``) would deselect every test in them anyway, but
# importing them costs ~25 s (vLLM, torch; Ray ~1 s); they are not even
# collected then. `tests/test_markers.py` keeps this set equal to the modules'
# own marks.
WHOLLY_SLOW_MODULES = frozenset({"test_cluster.py", "test_conformance.py", "test_engine.py",
                                 "test_engine_hybrid.py", "test_hybrid_connector.py",
                                 "test_load_conformance.py", "test_mooncake.py",
                                 "test_observer.py", "test_store_chaos.py",
                                 "test_vllm_connector.py"})


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    if (collection_path.name in WHOLLY_SLOW_MODULES
            and config.getoption("markexpr", "").strip() == "not slow"):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the real store carries the ``mooncake`` marker
    (``-m 'not mooncake'`` leaves them out), wherever it lives."""
    for item in items:
        if MOONCAKE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.mooncake)


@pytest.fixture(scope="session")
def mooncake_master():
    if os.environ.get("KVSTATE_NO_MOONCAKE") == "1":
        pytest.skip("KVSTATE_NO_MOONCAKE=1: the real store is switched off")
    from adapters.master import Master

    master = Master()
    yield master
    master.stop()


@pytest.fixture(scope="session")
def mooncake_store(mooncake_master):
    from adapters.mooncake import MooncakeConfig, MooncakeStore

    store = MooncakeStore(MooncakeConfig(master_server_address=mooncake_master.address,
                                         global_segment_size=128 << 20,
                                         local_buffer_size=64 << 20))
    yield store
    store.close()
