"""The store's topology and the vLLM versions the connector starts in: what a
deployment gets wrong is refused at start with the field and the reason.
Pure parsing: no store, no vLLM."""

from __future__ import annotations

import json

import pytest
from conftest import json_values
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.mooncake import MooncakeConfig
from adapters.store_server import engine_store_config
from adapters.vllm.versions import OVERRIDE, check_vllm_version, release


def test_an_engine_file_for_a_standalone_store_mounts_nothing(tmp_path) -> None:
    path = engine_store_config(tmp_path / "mc.json", "127.0.0.1:5000")
    data = json.loads(open(path).read())
    assert data["mode"] == "standalone-store" and data["global_segment_size"] == 0
    config = MooncakeConfig.from_dict(data, path)
    assert config.global_segment_size == 0 and config.mode == "standalone-store"
    embedded = MooncakeConfig.from_dict(
        json.loads(open(engine_store_config(tmp_path / "e.json", "127.0.0.1:5000",
                                            segment="64mb")).read()))
    assert embedded.mode == "embedded" and embedded.global_segment_size == 64 << 20


@pytest.mark.parametrize(("fields", "message"), [
    ({"global_segment_size": 0}, r"mc\.json: .*global_segment_size=0: mode 'embedded' needs"),
    ({"mode": "standalone-store", "global_segment_size": "1gb"},
     r"mc\.json: .*global_segment_size=1073741824: mode 'standalone-store' mounts no"),
    ({"mode": "shared"}, r"mc\.json: MooncakeConfig\.mode='shared': expected one of embedded, "
                         r"standalone-store"),
])
def test_a_segment_that_contradicts_the_mode_is_refused_naming_the_file(fields, message) -> None:
    # Upstream's MooncakeStoreConfig refuses the same combinations, so a file
    # one connector accepts the other accepts too.
    data = {"master_server_address": "127.0.0.1:5000", **fields}
    with pytest.raises(ValueError, match=message):
        MooncakeConfig.from_dict(data, "mc.json")


@pytest.mark.parametrize(("version", "parsed"), [
    ("0.33.0", (0, 33)), ("0.32.1.dev4+gabc", (0, 32)), ("v1.0", (1, 0)), ("unknown", None)])
def test_release_of_a_version_string(version, parsed) -> None:
    assert release(version) == parsed


def test_tested_vllm_versions_start(monkeypatch) -> None:
    monkeypatch.delenv(OVERRIDE, raising=False)
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.0")
    check_vllm_version("0.33.1.dev2+g1234")


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "unknown"])
def test_other_vllm_versions_are_refused_naming_the_version(version, monkeypatch) -> None:
    monkeypatch.delenv(OVERRIDE, raising=False)
    with pytest.raises(RuntimeError, match=rf"tested with vLLM 0\.32, 0\.33; this is vLLM "
                                           rf"'{version}'.*{OVERRIDE}=1"):
        check_vllm_version(version)


def test_the_override_starts_an_untested_version_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv(OVERRIDE, "1")
    with caplog.at_level("WARNING", logger="kvstate.vllm"):
        check_vllm_version("0.34.0")
    assert "this is vLLM '0.34.0'" in caplog.text and "starting anyway" in caplog.text


@pytest.mark.parametrize(("fields", "message"), [
    ({"global_segment_size": "1.5"}, r"global_segment_size='1.5': not a whole number of bytes"),
    ({"global_segment_size": "99999999999t"}, r"global_segment_size='99999999999t': expected 0 to"),
    ({"local_buffer_size": 10**30}, r"local_buffer_size=10{30}: expected 0 to"),
    ({"local_buffer_size": 0}, r"local_buffer_size=0: the client needs a transfer buffer"),
    ({"master_server_address": "127.0.0.1:0"}, r"master_server_address=.*port in 1\.\.65535"),
    ({"master_server_address": "127.0.0.1:99999"}, r"master_server_address=.*port in 1\.\.65535"),
    ({"local_hostname": 5}, r"local_hostname=5: expected a string"),
    ({"metadata_server": None}, r"metadata_server=None: expected a string"),
    ({"device_name": ["x"]}, r"device_name=\['x'\]: expected a string"),
    ({"mode": [1, 2]}, r"mode=\[1, 2\]: expected a string"),
])
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_file_and_field(fields,
                                                                            message) -> None:
    data = {"master_server_address": "127.0.0.1:5000", **fields}
    with pytest.raises(ValueError, match=rf"mc\.json: MooncakeConfig\.{message}"):
        MooncakeConfig.from_dict(data, "mc.json")


@pytest.mark.parametrize(("content", "message"), [
    (b"[1, 2]", "expected a JSON object"),
    (b'{"master_server_address": "\xff\xfe"}', r"not UTF-8 \(byte 27\)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"master_server_address": "h:1", "x" ', r":1: invalid JSON"),
    (b" " * ((1 << 20) + 1), r"1048577 bytes; a Mooncake config is at most 1048576"),
])
def test_a_config_file_that_is_not_a_config_is_refused_naming_the_file(tmp_path, monkeypatch,
                                                                      content, message) -> None:
    path = tmp_path / "mc.json"
    path.write_bytes(content)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    with pytest.raises(ValueError, match=rf"{path}.*{message}"):
        MooncakeConfig.from_env()


def test_a_fifo_as_the_config_file_is_refused_without_blocking(tmp_path, monkeypatch) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(fifo))
    with pytest.raises(ValueError, match="not a regular file"):
        MooncakeConfig.from_env()


_fields = st.sampled_from(["master_server_address", "metadata_server", "local_hostname",
                           "protocol", "device_name", "global_segment_size",
                           "local_buffer_size", "mode", "tenant_id", "nonsense"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_fields, json_values, max_size=5))
def test_anyjson_values_object_parses_or_is_refused_naming_the_file(data) -> None:
    try:
        config = MooncakeConfig.from_dict(data, "mc.json")
    except ValueError as exc:
        assert str(exc).startswith("mc.json: ")
    else:  # what is accepted is a config Mooncake can take
        assert 0 <= config.global_segment_size <= (1 << 50)
        assert 0 < config.local_buffer_size <= (1 << 50)
