"""The control plane's agent endpoints over HTTP (workers/contract.py)."""

from __future__ import annotations

import math
from typing import Any

import httpx

from workers.contract import (
    HEARTBEAT_PATH,
    REGISTER_PATH,
    HeartbeatReply,
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
)

# A reply that says no interval (an older control plane, or a garbled value):
# the agent keeps its own.
NO_INTERVAL = 0.0


def interval_of(data: dict[str, Any]) -> float:
    """The reply's ``heartbeat_interval_seconds``: a positive finite number, else NO_INTERVAL."""
    value = data.get("heartbeat_interval_seconds")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return NO_INTERVAL
    return float(value)


class ControlPlaneError(RuntimeError):
    """The control plane answered, but not as the contract says."""


class Unreachable(ControlPlaneError):
    """No answer (connection refused, timeout) or a 5xx: keep serving, retry."""


class Unauthorized(ControlPlaneError):
    """401: a bad enrollment token, or a worker secret it no longer knows."""


class ControlPlaneClient:
    def __init__(
        self, base_url: str, *, timeout_seconds: float = 5.0, transport: httpx.AsyncBaseTransport | None = None
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_seconds, transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
        try:
            response = await self._http.post(path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise Unreachable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 401:
            raise Unauthorized(f"{path}: 401 {response.text[:200]}")
        if response.status_code >= 500:
            raise Unreachable(f"{path}: {response.status_code} {response.text[:200]}")
        if response.status_code >= 400:
            raise ControlPlaneError(f"{path}: {response.status_code} {response.text[:500]}")
        try:
            return response.json()
        except ValueError as exc:
            raise ControlPlaneError(f"{path}: the reply is not JSON: {response.text[:200]}") from exc

    async def register(self, request: RegisterRequest) -> RegisterReply:
        data = await self._post(REGISTER_PATH, request)
        if not isinstance(data, dict) or not isinstance(data.get("secret"), str):
            raise ControlPlaneError(f"register: unexpected reply {data!r}")
        return RegisterReply(
            worker_id=int(data["worker_id"]),
            secret=data["secret"],
            heartbeat_interval_seconds=interval_of(data),
        )

    async def heartbeat(self, secret: str, request: HeartbeatRequest) -> HeartbeatReply:
        data = await self._post(HEARTBEAT_PATH, request, headers={"Authorization": f"Bearer {secret}"})
        if not isinstance(data, dict):
            raise ControlPlaneError(f"heartbeat: unexpected reply {data!r}")
        return HeartbeatReply(
            worker_id=int(data.get("worker_id", 0)),
            desired=data.get("desired"),
            drain=bool(data.get("drain", False)),
            heartbeat_interval_seconds=interval_of(data),
        )
