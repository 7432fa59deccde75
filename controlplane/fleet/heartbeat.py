"""The heartbeat endpoint's one code path, and the ASGI fast path that serves it.

Heartbeats are the fleet's steady background load (every worker, every
``HEARTBEAT_INTERVAL_SECONDS``). Through Django's full ASGI stack each one
would cost a fresh thread, three sync/async hops around WhiteNoise and the
middleware chain, and DRF's dispatch — several times the cost of the two
queries that do the work. So ``asgi.py`` routes ``POST HEARTBEAT_PATH``
straight here, to a small pool of long-lived threads that keep their
database connections; everything else goes to Django as usual. The DRF view
(``AgentHeartbeatView``) calls the same ``heartbeat_response()``, so the test
client, the OpenAPI document and the fast path cannot disagree.

Every reply (and the enrollment's) tells the worker when to heartbeat next:
``heartbeat_interval_seconds()``, which grows with the number of live
workers so that the fleet's heartbeats stay near ``HEARTBEAT_TARGET_RATE``
a second. The count is one query per process every few seconds, not one
per heartbeat; the worker row records what it was told, and the health
sweep judges its silence against that.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import DatabaseError, connection

from controlplane import outages
from controlplane.fleet import conf
from controlplane.fleet.health import WorkerState, fleet_heartbeat_interval
from controlplane.fleet.models import Worker
from workers import contract

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="worker"'}
MAX_BODY_BYTES = 256 * 1024
# How stale a process's count of the fleet may be: a fleet grows by
# enrollments far slower than this, and a worker told an interval a little
# short for the fleet it joined is told a better one on its next heartbeat.
FLEET_COUNT_MAX_AGE_SECONDS = 5.0


class _FleetCount:
    """The number of workers that heartbeat (every one not offline), counted
    at most once every FLEET_COUNT_MAX_AGE_SECONDS in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_workers = 0
        self._counted_at: float | None = None

    def get(self) -> int:
        now = time.monotonic()
        with self._lock:
            if self._counted_at is not None and now - self._counted_at < FLEET_COUNT_MAX_AGE_SECONDS:
                return self._num_workers
        num_workers = Worker.objects.exclude(state=WorkerState.OFFLINE).count()
        with self._lock:
            self._num_workers, self._counted_at = num_workers, now
        return num_workers

    def forget(self) -> None:
        """Count afresh next time (tests that grow a fleet between heartbeats)."""
        with self._lock:
            self._counted_at = None


fleet_count = _FleetCount()


def heartbeat_interval_seconds() -> float:
    """The interval to tell a worker now: ``HEARTBEAT_INTERVAL_SECONDS``
    while the fleet is small, longer as it grows (``health.fleet_heartbeat_interval``)."""
    return fleet_heartbeat_interval(
        fleet_count.get(),
        target_rate=conf.HEARTBEAT_TARGET_RATE.get(),
        floor_seconds=conf.HEARTBEAT_INTERVAL_SECONDS.get(),
        ceiling_seconds=conf.HEARTBEAT_INTERVAL_MAX_SECONDS.get(),
    )


def heartbeat_response(authorization: str | None, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Authenticate, parse, record: (HTTP status, JSON payload, headers).

    401 for a missing or unknown worker secret, 400 by field for a body that
    breaks the contract, else 200 with the contract's HeartbeatReply."""
    scheme, _, secret = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return 401, {"detail": "expected 'Authorization: Bearer <worker secret>'."}, UNAUTHORIZED_HEADERS
    worker = Worker.authenticate(secret.strip())
    if worker is None:
        return 401, {"detail": "unknown worker secret; register again."}, UNAUTHORIZED_HEADERS
    try:
        data = json.loads(body or b"null")
    except ValueError as exc:
        return 400, {"non_field_errors": [f"not valid JSON: {exc}"]}, {}
    try:
        hb = contract.parse_heartbeat(data)
    except contract.ContractError as exc:
        return 400, exc.errors, {}
    try:
        reply = worker.record_heartbeat(hb, heartbeat_interval_seconds=heartbeat_interval_seconds())
        return 200, dict(reply), {}
    except DatabaseError:
        if not Worker.objects.filter(pk=worker.pk).exists():
            # deleted by an operator between authentication and update
            return 401, {"detail": "unknown worker secret; register again."}, UNAUTHORIZED_HEADERS
        raise


class HeartbeatFastPath:
    """ASGI middleware: serves ``POST HEARTBEAT_PATH``, passes the rest on."""

    def __init__(self, app: ASGIApp, *, max_threads: int | None = None):
        self.app = app
        self.path = contract.HEARTBEAT_PATH
        self.max_threads = max_threads or conf.HEARTBEAT_THREADS.get()
        self._executor: ThreadPoolExecutor | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY_BYTES:
                await _respond(send, 413, {"detail": "heartbeat body too large."}, {})
                return
        authorization = next(
            (value.decode("latin-1") for name, value in scope.get("headers", []) if name == b"authorization"), None
        )
        if self._executor is None:
            # Long-lived threads: each keeps its database connection, so at
            # most max_threads connections per process, reused, never leaked.
            self._executor = ThreadPoolExecutor(self.max_threads, thread_name_prefix="heartbeat")
        loop = asyncio.get_running_loop()
        status, payload, headers = await loop.run_in_executor(self._executor, _handle, authorization, bytes(body))
        await _respond(send, status, payload, headers)


_thread = threading.local()


def _prepare_connection() -> None:
    """Heartbeat connections commit without waiting for the WAL flush.

    Everything a heartbeat thread writes is the worker's soft state (and, now
    and then, the audit row of a change in it, in the same transaction). After
    a database crash the last fraction of a second of it may be gone, state
    and audit row together, and the worker's next heartbeat writes both
    again; meanwhile no heartbeat waits for an fsync. Not with a connection
    pool: its connections also serve other code."""
    if connection.vendor != "postgresql" or connection.settings_dict.get("OPTIONS", {}).get("pool"):
        return
    connection.ensure_connection()
    if getattr(_thread, "prepared", None) is not connection.connection:
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO OFF")
        _thread.prepared = connection.connection


def _handle(authorization: str | None, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    try:
        _prepare_connection()
        return heartbeat_response(authorization, body)
    except Exception as exc:
        connection.close()  # whatever went wrong, start the next one afresh
        if store := outages.store_down(exc):
            # The agent backs off on a 503 and serves on with what it has.
            outages.note(store, exc, "a heartbeat")
            return 503, outages.payload(store), outages.headers()
        log.exception("heartbeat failed")
        return 500, {"detail": "internal error"}, {}
    finally:
        if connection.settings_dict.get("OPTIONS", {}).get("pool"):
            connection.close()  # back to the pool


async def _respond(send: Send, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
    body = json.dumps(payload).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
