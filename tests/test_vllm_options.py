"""The vLLM connector's options (`adapters.vllm.options`), read from
`kv_connector_extra_config` when the engine starts: what an outside review
typed wrong, refused there with the field, the value and the likely intent.
Pure parsing: no vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import json_values
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm.options import ConnectorOptions


@pytest.mark.parametrize(("field", "meant"), [
    ("KVSTATE_MONITOR", "kvstate_monitor"), ("kvstate-trace", "kvstate_trace"),
    ("kvstateMonitor", "kvstate_monitor"), ("save_decode_cahce", "save_decode_cache"),
    ("enable_lookups", "enable_lookup"), ("Cache-Prefix", "cache_prefix"),
])
def test_a_misspelt_field_is_refused_with_the_field_it_looks_like(field: str,
                                                                   meant: str) -> None:
    # These used to start the engine with the setting left at its default
    # (the monitor off, no trace, decode saves off) without a word.
    with pytest.raises(ValueError, match=rf"\['{field}'\]=.*did you mean '{meant}'"):
        ConnectorOptions.from_extra_config({field: "raise"})


def test_fields_of_other_readers_are_left_alone() -> None:
    options = ConnectorOptions.from_extra_config(
        {"mooncake_protocol": "tcp", "model_name": "m", "local_buffer_size": 1,
         "save_decode_cache": True})
    assert options.save_decode_cache is True


def test_a_trace_that_cannot_be_written_is_refused_when_the_connector_is_built(
        tmp_path: Path) -> None:
    for path, why in [(str(tmp_path / "missing" / "t.jsonl"), "no directory"),
                      (str(tmp_path), "is a directory")]:
        with pytest.raises(ValueError, match=rf"\['kvstate_trace'\]=.*cannot be written: {why}"):
            ConnectorOptions.from_extra_config({"kvstate_trace": path})
    home = ConnectorOptions.from_extra_config({"kvstate_trace": "~/kvstate-trace.jsonl"})
    assert home.trace == str(Path.home() / "kvstate-trace.jsonl")


# --------------------------------------------------------------------------
# The class of an outside probe (issue: bad input, bounded work): values of
# the wrong shape used to escape as TypeError/AttributeError, and values out
# of any sane range were accepted without a word.

@pytest.mark.parametrize(("extra", "message"), [
    ([("kvstate_monitor", "raise")], r"kv_connector_extra_config=\[.*expected a JSON object.*list"),
    (5, r"kv_connector_extra_config=5: expected a JSON object.*int"),
    ("kvstate_monitor=raise", r"expected a JSON object.*str"),
    ({1: "x"}, r"field names must be strings, got 1"),
    ({"kvstate_store_timeout": 1e-300}, r"\['kvstate_store_timeout'\]=1e-300: expected seconds"),
    ({"kvstate_put_step": 10**100}, r"\['kvstate_put_step'\]=1000.*expected an integer in 1..1024"),
    ({"cache_prefix": "p" * (1 << 20)}, r"\['cache_prefix'\]='p{40}\.\.\. \(1048576 characters\)'"),
    ({"kvstate_load_async": "sometimes"}, r"\['kvstate_load_async'\]='sometimes': expected true or false"),
    ({"kvstate_load_async": 1}, r"\['kvstate_load_async'\]=1: expected true or false"),
])
def test_extra_config_of_the_wrong_shape_or_range_is_refused_naming_it(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorOptions.from_extra_config(extra)


def test_extra_config_bounds_keep_what_users_write() -> None:
    options = ConnectorOptions.from_extra_config(
        {"kvstate_store_timeout": 0.5, "kvstate_put_step": 8, "cache_prefix": "tenant-a"})
    assert (options.store_timeout, options.put_step, options.cache_prefix) == (0.5, 8, "tenant-a")


def test_loads_are_asynchronous_unless_a_user_says_false() -> None:
    assert ConnectorOptions.from_extra_config({}).load_async is True
    for value in (False, "false", " False "):
        assert ConnectorOptions.from_extra_config({"kvstate_load_async": value}).load_async is False


_fields = st.sampled_from(["kvstate_protocol", "kvstate_trace_layer", "kvstate_monitor",
                           "kvstate_store_timeout", "kvstate_put_step", "kvstate_load_async",
                           "save_decode_cache",
                           "enable_lookup", "cache_prefix", "mooncake_protocol"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_fields, json_values, max_size=4) | json_values)
def test_anyjson_values_extra_config_parses_or_is_refused_naming_a_field(extra) -> None:
    """Whatever JSON a user writes, the parser answers with options or a
    ValueError that names the config or the field: never another exception."""
    try:
        ConnectorOptions.from_extra_config(extra)
    except ValueError as exc:
        assert "kv_connector_extra_config" in str(exc)
