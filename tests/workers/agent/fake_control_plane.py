"""A stand-in control plane speaking ``workers.contract`` over real HTTP.

It is the edge of the worker's world: the worker tests drive it (set the
desired profile, ask for a drain, go offline) and read what the agent told
it. It parses with the contract's own functions, so a payload that breaks
the contract fails here as it would at the real control plane.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from workers.contract import (
    HEARTBEAT_PATH,
    REGISTER_PATH,
    ContractError,
    parse_heartbeat,
    parse_register,
)


@dataclass
class FakeControlPlane:
    tokens: set[str] = field(default_factory=lambda: {"enroll-1"})
    heartbeat_interval_seconds: float | None = 0.2  # None: the replies carry none, as an older control plane's
    desired: dict[str, Any] | None = None
    drain: bool = False
    registrations: list[dict[str, Any]] = field(default_factory=list)
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    secrets: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_desired(self, revision_id: int, fields: dict[str, Any], name: str = "p", revision: int = 1) -> None:
        with self.lock:
            self.desired = {"revision_id": revision_id, "name": name, "revision": revision, "fields": fields}

    def last(self) -> dict[str, Any] | None:
        with self.lock:
            return self.heartbeats[-1] if self.heartbeats else None

    def states_since(self, index: int) -> list[tuple[str, int | None]]:
        with self.lock:
            return [(h["state"], h["running_revision_id"]) for h in self.heartbeats[index:]]

    def _with_interval(self, reply: dict[str, Any]) -> dict[str, Any]:
        if self.heartbeat_interval_seconds is not None:
            reply["heartbeat_interval_seconds"] = self.heartbeat_interval_seconds
        return reply

    def app(self) -> Starlette:
        async def register(request: Request) -> JSONResponse:
            try:
                data = parse_register(await request.json())
            except ContractError as exc:
                return JSONResponse({"errors": exc.errors}, status_code=400)
            with self.lock:
                if data["enroll_token"] not in self.tokens:
                    return JSONResponse({"detail": "unknown enrollment token"}, status_code=401)
                self.tokens.discard(data["enroll_token"])  # single use
                worker_id = len(self.registrations) + 1
                secret = secrets.token_urlsafe(16)
                self.secrets[secret] = worker_id
                self.registrations.append(dict(data))
            return JSONResponse(self._with_interval({"worker_id": worker_id, "secret": secret}), status_code=201)

        async def heartbeat(request: Request) -> JSONResponse:
            auth = request.headers.get("authorization", "")
            worker_id = self.secrets.get(auth.removeprefix("Bearer "))
            if worker_id is None:
                return JSONResponse({"detail": "unknown worker secret"}, status_code=401)
            try:
                data = parse_heartbeat(await request.json())
            except ContractError as exc:
                return JSONResponse({"errors": exc.errors}, status_code=400)
            with self.lock:
                self.heartbeats.append(dict(data))
                reply = self._with_interval({"worker_id": worker_id, "desired": self.desired, "drain": self.drain})
            return JSONResponse(reply)

        return Starlette(
            routes=[
                Route(REGISTER_PATH, register, methods=["POST"]),
                Route(HEARTBEAT_PATH, heartbeat, methods=["POST"]),
            ]
        )
