"""A store that outlives its engines, and engines run on it one after another.

`Deployment` is what the end-to-end tests, ``engine_smoke`` and ``kvstate
bench engine`` stand up: a ``mooncake_master`` and a standalone store process
on 127.0.0.1 (`adapters.store_server`: the engines mount no store memory, so
nothing they stored leaves with them), and engines started each in a fresh
process (`adapters.vllm.engine.run_in_process`) with the interpreter of the
environment that holds a computing vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from adapters.master import Master
from adapters.store_server import StoreServer, engine_store_config

from .engine import EngineSpec, Wave, run_in_process


class Deployment:
    def __init__(self, workdir: str | Path, model: str, *, python: str | None = None,
                 segment: str = "1gb", master_flags: tuple[str, ...] = (),
                 device: str = "cpu") -> None:
        self.workdir = Path(workdir)
        self.model = model
        self.python = python or sys.executable
        self.device = device
        self.master = Master(master_flags)
        try:
            self.store = StoreServer(self.master.address, segment)
        except BaseException:
            self.master.stop()
            raise
        self.config = engine_store_config(self.workdir / "mooncake.json", self.master.address)

    def run(self, name: str, waves: list[Wave], connector: str | None = "kvstate", *,
            trace: bool = True, monitor: str = "raise", env: dict[str, str] | None = None,
            extra: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
        """Run one engine named ``name``; a kvstate engine gets the online
        monitor (``monitor``) and writes ``NAME.jsonl`` (its path returned
        as ``result["trace"]``) unless ``trace`` is false."""
        extra = dict(extra or {})
        if connector in ("kvstate", "observed"):
            extra.setdefault("kvstate_monitor", monitor)
            if trace:
                extra["kvstate_trace"] = str(self.workdir / f"{name}.jsonl")
        result = run_in_process(
            EngineSpec(model=self.model, waves=waves, connector=connector, extra=extra,
                       mooncake_config=self.config if connector else None,
                       device=self.device, **spec),
            self.workdir, name, python=self.python, env=env)
        if "kvstate_trace" in extra:
            result["trace"] = extra["kvstate_trace"]
        return result

    def close(self) -> None:
        self.store.stop()
        self.master.stop()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
