"""Bad configuration is refused with the field and the value named."""

from __future__ import annotations

import pytest

from kvstate.config import ConnectorConfig, GroupKind, GroupSpec, Role
from kvstate.executor import Executor
from kvstate.variants import get_variant


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": 24, "hash_block_size": 16}, "ConnectorConfig.block_size=24"),
        ({"role": "kv_sender"}, "ConnectorConfig.role='kv_sender'"),
        ({"put_step": 0}, "ConnectorConfig.put_step=0"),
        ({"world_size": 4, "put_step": 3}, "ConnectorConfig.put_step=3: must divide"),
        ({"block_size": 0}, "ConnectorConfig.block_size=0"),
        ({"world_size": -1}, "ConnectorConfig.world_size=-1"),
        ({"alignment": 20}, "ConnectorConfig.alignment=20"),
        ({"cache_prefix": "a@b"}, "ConnectorConfig.cache_prefix='a@b'"),
        ({"pressure_backoff": 0}, "ConnectorConfig.pressure_backoff=0"),
        ({"save_decode_cache": "yes"}, "ConnectorConfig.save_decode_cache='yes'"),
        ({"groups": ()}, "ConnectorConfig.groups=()"),
        ({"model_name": ""}, "ConnectorConfig.model_name=''"),
    ],
)
def test_invalid_field_raises_value_error_naming_field_and_value(kwargs, needle) -> None:
    with pytest.raises(ValueError) as err:
        ConnectorConfig(**kwargs)
    assert needle in str(err.value)


def test_roles_accept_vllm_names() -> None:
    assert ConnectorConfig(role="kv_consumer").role is Role.CONSUMER
    assert ConnectorConfig(role="kv_both").role is Role.BOTH
    assert ConnectorConfig().save_decode_cache is False  # decode saving is off by default


def test_sliding_window_group_needs_a_window() -> None:
    with pytest.raises(ValueError, match=r"GroupSpec.sliding_window=None"):
        GroupSpec(GroupKind.SLIDING_WINDOW)
    with pytest.raises(ValueError, match=r"GroupSpec.sliding_window=8"):
        GroupSpec(GroupKind.FULL, 8)


def test_rank_out_of_range_and_unknown_variant() -> None:
    with pytest.raises(ValueError, match=r"Executor.rank=2"):
        Executor(ConnectorConfig(world_size=2), 2)
    with pytest.raises(ValueError, match="unknown protocol variant 'e3'"):
        get_variant("e3")
