"""/health over HTTP while the engine loads: 503 and "loading", then 200 and
"ready" once it has loaded. The app is served as ``serve`` serves it (the
engine starts in a task beside the server), on the real reference engine;
the test holds the start back to see the loading state for certain."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from tests.workers.server.support import ThreadedServer, get, wait_until
from workers import engines
from workers.profile import EngineProfile
from workers.server.app import build_app
from workers.server.host import EngineHost, RunningProfile
from workers.server.metrics import MetricsExporter

PROFILE = EngineProfile(max_num_batched_tokens=128, max_num_seqs=2, block_size=32, kv_cache_bytes=8 << 20)


def test_health_answers_503_loading_until_the_engine_has_loaded(tiny_model: Path) -> None:
    spec = engines.EngineSpec(kind="reference", model=str(tiny_model), device="cpu", max_model_len=512)
    backend = engines.backend("reference")
    host = EngineHost(lambda p: backend.build(spec, p), RunningProfile(PROFILE))
    gate: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        gate["loop"], gate["open"] = asyncio.get_running_loop(), asyncio.Event()

        async def start_engine() -> None:
            await gate["open"].wait()
            await host.start()

        task = asyncio.ensure_future(start_engine())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await host.shutdown()

    app = build_app(host, MetricsExporter(model_name="tiny", max_model_len=512), model_name="tiny", lifespan=lifespan)
    with ThreadedServer(app) as server:
        loading = get(f"{server.url}/health")
        assert loading.status_code == 503
        assert loading.json()["status"] == "loading" and loading.json()["load_error"] is None
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_loading"

        gate["loop"].call_soon_threadsafe(gate["open"].set)
        ready = wait_until(lambda: (r := get(f"{server.url}/health")).status_code == 200 and r, timeout=60)
        assert ready.json()["status"] == "ready"
