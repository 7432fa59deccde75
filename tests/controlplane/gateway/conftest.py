"""Real processes for the gateway tests: ``manage.py rungateway`` against
the test database and Redis, and synthetic workers (a real HTTP server
streaming OpenAI chunks on a fixed clock)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import control_plane_env
from tests.support import PYTHON, Process, child_env, free_port, running

# Short clocks so tests wait for changes in fractions of a second.
GATEWAY_ENV = {
    "GATEWAY_POLL_SECONDS": "0.5",
    "GATEWAY_HEARTBEAT_SECONDS": "0.3",
    "GATEWAY_LIVENESS_TTL_SECONDS": "2",
    "GATEWAY_LOG_FLUSH_SECONDS": "0.2",
    "GATEWAY_EJECT_SECONDS": "30",
}


class GatewayProc:
    def __init__(self, proc: Process, port: int):
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=5).json()


@pytest.fixture
def start_gateway(
    transactional_db: Any, tmp_path: Path
) -> Iterator[Callable[..., contextlib.AbstractContextManager[GatewayProc]]]:
    """Context manager factory: ``with start_gateway() as gw:`` runs one
    gateway until the block ends (stopped with SIGTERM, as in production)."""
    counter = iter(range(1000))

    @contextlib.contextmanager
    def start(port: int | None = None, **env: str) -> Iterator[GatewayProc]:
        port = port or free_port()
        n = next(counter)
        argv = [PYTHON, "manage.py", "rungateway", "--port", str(port), "--log-level", "warning"]
        with running(
            argv, env=control_plane_env(**{**GATEWAY_ENV, **env}), log_path=tmp_path / f"gateway-{n}.log"
        ) as proc:
            proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
            yield GatewayProc(proc, port)

    yield start


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., contextlib.AbstractContextManager[tuple[str, Process]]]]:
    """Context manager factory for a synthetic worker process; yields (url, process)."""
    counter = iter(range(1000))

    @contextlib.contextmanager
    def start(
        name: str, *, ttft_ms: float = 5, itl_ms: float = 5, model: str = "tiny", status: int = 200
    ) -> Iterator[tuple[str, Process]]:
        port = free_port()
        argv = [
            PYTHON,
            "-m",
            "controlplane.bench.synthetic",
            "--port",
            str(port),
            "--name",
            name,
            "--model",
            model,
            "--ttft-ms",
            str(ttft_ms),
            "--itl-ms",
            str(itl_ms),
            "--status",
            str(status),
        ]
        with running(argv, env=child_env(), log_path=tmp_path / f"worker-{name}-{next(counter)}.log") as proc:
            url = f"http://127.0.0.1:{port}"
            proc.wait_http(f"{url}/health", timeout=30)
            yield url, proc

    yield start
