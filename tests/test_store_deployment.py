"""The store's topology and the vLLM versions the connector starts in: what a
deployment gets wrong is refused at start with the field and the reason.
Pure parsing: no store, no vLLM."""

from __future__ import annotations

import json

import pytest

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
