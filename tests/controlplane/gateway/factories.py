"""Rows the gateway tests need, made the way the product makes them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import PoolSpec, RoutingTable
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_pool
from tests.support import PYTHON, child_env, free_port, running


def ready_worker(pool: Pool, url: str = "http://127.0.0.1:9", name: str | None = None) -> Worker:
    """Enrolled into ``pool`` and reporting ready, as an agent would."""
    worker, _ = enroll_worker(name, pool=pool, url=url)
    worker.record_heartbeat(heartbeat_request("ready"))
    worker.refresh_from_db()
    return worker


def routed_model(
    model: str = "tiny", *, canary_bp: int = 0, urls: dict[str, list[str]] | None = None, salt: str | None = None
) -> tuple[RoutingTable, dict[str, Pool], dict[str, list[Worker]]]:
    """A table with a stable and a canary pool, each with ready workers at
    ``urls`` (role → worker URLs; one placeholder worker each by default)."""
    urls = urls or {"stable": ["http://127.0.0.1:9"], "canary": ["http://127.0.0.1:9"]}
    pools: dict[str, Pool] = {}
    workers: dict[str, list[Worker]] = {}
    for role, role_urls in urls.items():
        pools[role] = make_pool(f"{model}-{role}".replace("/", "-"))
        workers[role] = [
            ready_worker(pools[role], url, name=f"{model}-{role}-{i}".replace("/", "-"))
            for i, url in enumerate(role_urls)
        ]
    table = RoutingTable.create_audited(model, actor="test", salt=salt)
    weights = {"canary": canary_bp, "stable": 10000 - canary_bp}
    table.configure([PoolSpec(pools[r], r, weights.get(r, 0)) for r in pools], actor="test")
    return table, pools, workers


def pool_spec(pool: Pool, role: str, weight_bp: int) -> dict[str, Any]:
    return {"pool": pool.name, "role": role, "weight_bp": weight_bp}


@contextlib.contextmanager
def routed_reference_worker(model: Path, log_dir: Path, max_model_len: int, profile: dict[str, Any]) -> Iterator[str]:
    """A real reference worker serving ``model`` as "tiny" with ``profile``,
    the stable pool's one worker in the routing table; yields its URL."""
    port = free_port()
    argv = [
        *(PYTHON, "-m", "workers", "serve", "--engine", "reference", "--model", str(model), "--port", str(port)),
        *("--served-model-name", "tiny", "--max-model-len", str(max_model_len), "--profile", json.dumps(profile)),
    ]
    with running(argv, env=child_env(), log_path=log_dir / "worker.log") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/health", timeout=180)
        routed_model(urls={"stable": [url]})
        yield url
