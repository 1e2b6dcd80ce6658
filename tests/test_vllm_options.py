"""The vLLM connector's options (`adapters.vllm.options`), read from
`kv_connector_extra_config` when the engine starts: what an outside review
typed wrong, refused there with the field, the value and the likely intent.
Pure parsing: no vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest

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
