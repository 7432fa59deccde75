"""Helpers for worker tests: a real worker process, a real ASGI server in a
thread (for stand-ins at the edge: a control plane, an SSE source)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.support import PYTHON, Process, child_env, free_port, running, wait_until

VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@contextlib.contextmanager
def worker(
    model: Path,
    log_path: Path,
    *,
    engine: str = "reference",
    profile: str | None = None,
    extra: list[str] | None = None,
    timeout: float = 180.0,
    wait_ready: bool = True,
) -> Iterator[tuple[str, Process]]:
    """``python -m workers serve`` on a free port; yields (base URL, process)."""
    port = free_port()
    argv = [PYTHON, "-m", "workers", "serve", "--engine", engine, "--model", str(model), "--port", str(port)]
    if profile:
        argv += ["--profile", profile]
    argv += extra or []
    env = child_env(**VLLM_ENV) if engine == "vllm" else child_env()
    url = f"http://127.0.0.1:{port}"
    with running(argv, env=env, log_path=log_path) as proc:
        if wait_ready:
            proc.wait_http(f"{url}/health", timeout=timeout)
        yield url, proc


class ThreadedServer:
    """uvicorn serving an ASGI app from a background thread."""

    def __init__(self, app: Any, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("threaded server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from Prometheus text."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([^{ ]+)(\{[^}]*\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


def metric_names(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, timeout=10.0, **kwargs)


__all__ = ["worker", "ThreadedServer", "metric_value", "metric_names", "wait_until", "get"]
