"""A store that is down: what every entry point answers, and when it last was.

PostgreSQL or Redis being away is an outage, not a bug: the API answers 503
with a JSON body and ``Retry-After``, a page answers a plain 503 page, an
agent's heartbeat answers 503 (the agent backs off and serves on), and the
log gets one line per failure, not a traceback. Three doors lead in, and all
three use ``store_down()`` here: the API's exception handler
(``controlplane.accounts.errors``), the Django middleware below (pages and
everything else Django serves) and the heartbeat fast path
(``controlplane.fleet.heartbeat``).

Every time the control plane fails to reach its database it records the
moment (``note_database_failure``), so that the health sweep does not take
its own deafness for the workers' silence (``controlplane.fleet.health``).
The moment is kept in Redis, which outlives a database outage, under a
sorted-set member written with ``GT`` so that processes racing each other
only ever move it forward; each process also remembers its own last failure,
for a Redis that is away too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar, cast

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.views import defaults
from kombu.exceptions import OperationalError as BrokerError

log = logging.getLogger(__name__)
ResponseT = TypeVar("ResponseT", bound=HttpResponse)

# How long a client should wait before trying again: about one heartbeat, the
# shortest rhythm anything in the fleet keeps.
RETRY_AFTER_SECONDS = 2

DATABASE = "database"
REDIS = "redis"

# Connection-level failures only: an IntegrityError is a bug, not an outage.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, BrokerError)
# What a Celery task retries (with capped backoff): any store being away, whatever it answered.
STORE_ERRORS = DATABASE_ERRORS + REDIS_ERRORS


def store_down(exc: BaseException) -> str | None:
    """Which store ``exc`` says is unreachable (``DATABASE``, ``REDIS``), or None."""
    if isinstance(exc, DATABASE_ERRORS) and _unreachable(exc):
        return DATABASE
    if isinstance(exc, REDIS_ERRORS):
        return REDIS
    return None


def _unreachable(exc: BaseException) -> bool:
    """The server never answered (no SQLSTATE: refused, reset, closed) or
    said it cannot serve (class 08, connection exception; 57P, shutting down
    or starting up). A deadlock or a statement timeout is an answer."""
    sqlstate = getattr(exc.__cause__, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


def payload(store: str) -> dict[str, Any]:
    return {
        "detail": f"the control plane's {store} is unreachable; try again shortly.",
        "unavailable": store,
        "retry_after_seconds": RETRY_AFTER_SECONDS,
    }


def headers() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_SECONDS)}


def note(store: str, exc: BaseException, where: str) -> None:
    """One log line per failure (the traceback says nothing an operator can act
    on) and, for the database, the moment it happened."""
    first_line = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
    log.warning("%s unreachable while serving %s: %s", store, where, first_line)
    if store == DATABASE:
        note_database_failure()


# ---- when the database last failed ---------------------------------------------------
_lock = threading.Lock()
_local_failed_at = 0.0
_last_written_at = 0.0
# Writing the same moment to Redis once per heartbeat is wasteful; a failure
# within this many seconds of the last one written only updates memory.
_WRITE_EVERY_SECONDS = 0.2


def _key() -> str:
    config = cast(dict[str, Any], settings.CHANNEL_LAYERS["default"]["CONFIG"])
    return f"{config.get('prefix', 'chunkpilot')}:outages"


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    # Short timeouts: this runs on the way to a 503, which must stay quick.
    return redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)


def note_database_failure(now: float | None = None) -> None:
    """The control plane just failed to reach its database (unix time ``now``)."""
    global _local_failed_at, _last_written_at
    now = time.time() if now is None else now
    with _lock:
        _local_failed_at = max(_local_failed_at, now)
        if now - _last_written_at < _WRITE_EVERY_SECONDS:
            return
        _last_written_at = now
    # Redis away too: this process remembers; the next failure tries again.
    with contextlib.suppress(redis.RedisError):
        _client(settings.REDIS_URL).zadd(_key(), {DATABASE: now}, gt=True)


def last_database_failure() -> float | None:
    """Unix time the control plane last failed to reach its database, as far
    as any process has told Redis (or this one remembers); None if never."""
    try:
        shared = _client(settings.REDIS_URL).zscore(_key(), DATABASE)
    except redis.RedisError:
        shared = None
    known = max(float(shared or 0.0), _local_failed_at)
    return known or None


def forget() -> None:
    """Tests: start from no outage at all."""
    global _local_failed_at, _last_written_at
    with _lock:
        _local_failed_at = _last_written_at = 0.0
    _client(settings.REDIS_URL).zrem(_key(), DATABASE)


# ---- pages and everything else Django serves -----------------------------------------
def response_for(request: HttpRequest, store: str) -> HttpResponse:
    """The API and agents get JSON; a person gets the plain page (rendered
    without the database: no context processors, no session)."""
    if request.path.startswith("/api/") or "application/json" in request.headers.get("Accept", ""):
        response: HttpResponse = JsonResponse(payload(store), status=503)
    else:
        response = HttpResponse(render_to_string("503.html", {"store": store}), status=503)
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return quiet(response)


def quiet(response: ResponseT) -> ResponseT:
    """``note()`` logged this outage in one line: Django's request log would
    add an ERROR line for each 5xx, so mark the response as logged already."""
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


class StoreOutageMiddleware:
    """Turns a store outage raised by a view (a page's queries, its session,
    its user) into a 503, with one log line instead of a traceback."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        store = store_down(exception)
        if store is None:
            return None
        note(store, exception, request.path)
        return response_for(request, store)


def server_error(request: HttpRequest) -> HttpResponse:
    """``handler500``: the backstop for an outage raised outside any view (a
    middleware's own query, the session saved on the way out). Django calls it
    inside its ``except``, so the exception is at hand."""
    exc = sys.exc_info()[1]
    store = store_down(exc) if exc is not None else None
    if store is None:
        if request.path.startswith("/api/"):
            # An API client parses JSON in every case, an unexpected error included.
            return JsonResponse({"detail": "internal server error; the control plane's log has the cause."}, status=500)
        return defaults.server_error(request)
    note(store, exc, request.path)  # type: ignore[arg-type]
    return response_for(request, store)
