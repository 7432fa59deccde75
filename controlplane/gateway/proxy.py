"""The gateway's request path: a raw ASGI app that speaks OpenAI's API.

It never touches the database. Everything it decides from is in the
``StateHolder`` the refresher keeps current; everything it records leaves
through ``record`` (a queue the log writer drains) and the metrics. The path
of a completion request:

  1. Key: ``Authorization: Bearer <key>``, hashed and looked up in the cached
     key set (401 otherwise).
  2. Table: the body's ``model`` names a routing table (404 if none).
  3. Cohort: the sticky key's bucket picks a pool through the table's layout;
     an admin key may force one with ``x-chunkpilot-cohort``.
  4. Worker: the routable worker of that pool with the fewest requests in
     flight from this gateway; locally ejected workers (a failed connect) only
     as a last resort.
  5. Attempt: forward the body. Until the worker's response head arrives the
     client has seen nothing, so a refused connection or a retryable status
     (429, 502-504) moves on to the next worker. After that the stream is
     passed through event by event, as it arrives.
  6. Record: one ``RequestRecord`` with what the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from controlplane.gateway.cohort import Role, bucket_of, sticky_key
from controlplane.gateway.meter import StreamMeter, Usage, usage_of_body
from controlplane.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from controlplane.gateway.state import (
    ClientKeyInfo,
    GatewayState,
    PoolTarget,
    StateHolder,
    TableTarget,
    WorkerTarget,
    hash_key,
)
from controlplane.gateway.upstream import (
    Upstream,
    UpstreamBroken,
    UpstreamClient,
    UpstreamResponse,
    UpstreamUnavailable,
)

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
SESSION_HEADER = b"x-chunkpilot-session"
COHORT_HEADER = b"x-chunkpilot-cohort"
# Response headers worth passing from a worker to the client; hop-by-hop
# ones and the length (re-derived by the server) are not.
PASSED_HEADERS = frozenset({b"content-type", b"cache-control", b"retry-after", b"x-accel-buffering"})
STATUS_CLIENT_GONE = 499  # nginx's code: the client closed the connection first


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3  # workers tried per request before giving up
    eject_seconds: float = 10.0  # how long a worker that refused a connection is passed over
    max_body_bytes: int = 32 << 20
    expose_routing_to_admins: bool = True  # x-chunkpilot-pool/-worker on admin keys' replies


@dataclass
class RequestRecord:
    """One client request as the gateway saw it: a ``RequestLog`` row to be."""

    request_id: str
    created_at: float  # time.time() at arrival
    model: str
    cohort: str = ""
    pool_id: int | None = None
    worker_id: int | None = None
    profile_revision_id: int | None = None
    api_key_id: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    ttft_seconds: float | None = None
    max_gap_seconds: float | None = None
    tpot_seconds: float | None = None
    e2e_seconds: float | None = None
    status: int = 0
    error: str = ""
    stream: bool = False


class ApiError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or []

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        ).encode()


def _no_capacity(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="no_worker_available",
                    headers=[(b"retry-after", b"1")])


@dataclass
class _Request:
    """What one completion request carries through the path."""

    arrival: float
    record: RequestRecord
    key: ClientKeyInfo | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)


class Gateway:
    """The ASGI app. ``record`` is called once per proxied request."""

    def __init__(
        self,
        holder: StateHolder,
        *,
        record: Callable[[RequestRecord], None],
        metrics: GatewayMetrics | None = None,
        settings: ProxySettings | None = None,
        upstream_factory: Callable[[], UpstreamClient] = Upstream,
        on_startup: list[Callable[[], Awaitable[None]]] | None = None,
        on_shutdown: list[Callable[[], Awaitable[None]]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.holder = holder
        self.record = record
        self.metrics = metrics or GatewayMetrics()
        self.settings = settings or ProxySettings()
        self._upstream_factory = upstream_factory
        self._upstream: UpstreamClient | None = None
        self._on_startup = on_startup or []
        self._on_shutdown = on_shutdown or []
        self.clock = clock
        self.outstanding: defaultdict[int, int] = defaultdict(int)  # by worker id: this gateway's own count
        self.ejected_until: dict[int, float] = {}  # by worker id, clock time
        self._turn = 0  # rotates the start of each scan so ties spread
        self._worker_names: dict[int, str] = {}
        self.metrics.watch(self._epochs_by_model, self._outstanding_by_name)

    # ---- ASGI ----------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # noqa: BLE001 - reported to the server, which exits
                    log.exception("gateway startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        self._upstream = self._upstream_factory()
        for hook in self._on_startup:
            await hook()
        # Everything loaded so far (Django, the modules, the first snapshot)
        # lives as long as the process: keep the cyclic GC from rescanning it.
        # A full collection of that heap took 200 ms on a busy 2-core host,
        # a stall every stream in flight would see.
        gc.freeze()

    async def shutdown(self) -> None:
        for hook in self._on_shutdown:
            with contextlib.suppress(Exception):
                await hook()
        if self._upstream is not None:
            await self._upstream.close()

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        try:
            if path in COMPLETION_PATHS:
                if method != "POST":
                    raise ApiError(405, f"{path} takes POST.", code="method_not_allowed")
                await self._completion(scope, receive, send)
            elif path == "/v1/models" and method == "GET":
                self._authenticate(_headers(scope), self.holder.current)
                await _json(send, 200, self._models())
            elif path == "/health":
                await self._health(send)
            elif path == "/metrics":
                await _reply(send, 200, self.metrics.render(), CONTENT_TYPE.encode())
            else:
                raise ApiError(404, f"no route {method} {path}", type="not_found_error", code="not_found")
        except ApiError as error:
            await _error(send, error)

    # ---- small endpoints -------------------------------------------------------
    async def _health(self, send: Send) -> None:
        state = self.holder.current
        body = {
            "status": "ok" if state.loaded_at else "loading",
            "models": {model: table.epoch for model, table in state.tables.items()},
            "state_age_seconds": self.holder.age_seconds,
        }
        await _json(send, 200 if state.loaded_at else 503, body)

    def _models(self) -> dict[str, Any]:
        tables = self.holder.current.tables
        data = []
        for model in sorted(tables):
            card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "chunkpilot"}
            # vLLM's card field: clients (the load generator) size prompts by it.
            if (max_model_len := tables[model].max_model_len) is not None:
                card["max_model_len"] = max_model_len
            data.append(card)
        return {"object": "list", "data": data}

    def _epochs_by_model(self) -> dict[str, int]:
        return {model: table.epoch for model, table in self.holder.current.tables.items()}

    def _outstanding_by_name(self) -> dict[str, int]:
        return {self._worker_names.get(wid, str(wid)): n for wid, n in self.outstanding.items()}

    # ---- completions --------------------------------------------------------------
    def _authenticate(self, headers: dict[bytes, bytes], state: GatewayState) -> ClientKeyInfo:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if not token or scheme.lower() != b"bearer":
            raise ApiError(401, "You didn't provide an API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")
        info = state.keys.get(hash_key(token.strip().decode("latin-1")))
        if info is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return info

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = self.clock()
        state = self.holder.current
        headers = _headers(scope)
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex
        rec = RequestRecord(request_id=request_id, created_at=time.time(), model="")
        try:
            key = self._authenticate(headers, state)
        except ApiError as error:
            self.metrics.requests.labels("", "", str(error.status)).inc()
            raise
        rec.api_key_id = key.id
        try:
            body, data = await self._read_json(receive)
            table = self._table(state, data)
            rec.model = table.model
            rec.stream = data.get("stream") is True
            pool = self._pool(table, data, headers, key)
            rec.cohort, rec.pool_id = pool.role.value, pool.id
            if rec.stream and not _asks_usage(data):
                # Ask for usage so the log has token counts; the meter drops
                # the usage event again before the client would see it.
                data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
                body, strip_usage = json.dumps(data, ensure_ascii=False).encode(), True
            else:
                strip_usage = False
            await self._forward(scope, receive, send, _Request(arrival, rec, key, headers), pool, body, strip_usage)
        except ApiError as error:
            rec.status, rec.error = error.status, error.message[:500]
            await _error(send, error, self._routing_headers(rec, key))
        finally:
            if rec.model:
                self._finish(rec, arrival)

    async def _read_json(self, receive: Receive) -> tuple[bytes, dict[str, Any]]:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(STATUS_CLIENT_GONE, "the client went away while sending the body.")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise ApiError(413, f"the request body is over {self.settings.max_body_bytes} bytes.",
                               code="request_too_large")
            parts.append(chunk)
            if not message.get("more_body"):
                break
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object.", code="invalid_json")
        return body, data

    def _table(self, state: GatewayState, data: dict[str, Any]) -> TableTarget:
        model = data.get("model")
        if model is None and len(state.tables) == 1:
            return next(iter(state.tables.values()))  # as a worker does: one model, no name needed
        if not isinstance(model, str):
            raise ApiError(400, "`model` is required.", param="model")
        table = state.tables.get(model)
        if table is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return table

    def _pool(self, table: TableTarget, data: dict[str, Any], headers: dict[bytes, bytes],
              key: ClientKeyInfo) -> PoolTarget:
        forced = headers.get(COHORT_HEADER)
        if forced is not None:
            if not key.is_admin:
                raise ApiError(403, "Only admin keys may choose a cohort with x-chunkpilot-cohort.",
                               type="permission_error", code="cohort_override_forbidden")
            try:
                role = Role(forced.decode("latin-1").strip().lower())
            except ValueError:
                raise ApiError(400, f"x-chunkpilot-cohort must be one of canary, baseline, stable; got "
                                    f"{forced.decode('latin-1')!r}.", code="invalid_cohort") from None
            pool = table.pool_for_role(role)
            if pool is None:
                raise ApiError(400, f"The routing table of `{table.model}` has no {role.value} pool.",
                               code="invalid_cohort")
            return pool
        session = headers.get(SESSION_HEADER)
        sticky = sticky_key(session.decode("latin-1") if session else None, data.get("user"), key.id)
        slot = table.layout.slot_for(bucket_of(table.salt, sticky or uuid.uuid4().hex))
        if slot is None:
            raise _no_capacity(f"The routing table of `{table.model}` sends no traffic anywhere.")
        return table.pools[slot.member]

    def pick_worker(self, pool: PoolTarget, tried: set[int]) -> WorkerTarget | None:
        """Fewest requests in flight from this gateway wins; ties rotate. A
        worker ejected for a failed connect is chosen only when nothing else is left."""
        workers = pool.workers
        n = len(workers)
        if not n:
            return None
        self._turn += 1
        now = self.clock()
        best: WorkerTarget | None = None
        best_rank = (2, 0)
        for i in range(n):
            worker = workers[(self._turn + i) % n]
            if worker.id in tried:
                continue
            ejected = self.ejected_until.get(worker.id, 0.0) > now
            rank = (int(ejected), self.outstanding[worker.id])
            if rank < best_rank:
                best, best_rank = worker, rank
        return best

    async def _forward(self, scope: Scope, receive: Receive, send: Send, req: _Request, pool: PoolTarget,
                       body: bytes, strip_usage: bool) -> None:
        rec = req.record
        upstream = self._upstream
        assert upstream is not None, "the gateway has not started"
        path = scope["path"]
        out_headers = [(b"content-type", b"application/json"), (b"x-request-id", rec.request_id.encode())]
        tried: set[int] = set()
        last_error: ApiError | None = None
        for _ in range(max(1, self.settings.max_attempts)):
            worker = self.pick_worker(pool, tried)
            if worker is None:
                break
            tried.add(worker.id)
            self._worker_names[worker.id] = worker.name
            self.outstanding[worker.id] += 1
            try:
                # Phase 1: the response head. The client has seen nothing, so
                # any failure here moves on to the next worker.
                try:
                    response = await upstream.send(worker.url + path, out_headers, body)
                except UpstreamUnavailable as exc:
                    last_error = self._failed(pool, worker, "connect", exc)
                    continue
                rec.worker_id, rec.profile_revision_id = worker.id, worker.revision_id
                if response.status in RETRYABLE_STATUSES:
                    last_error = await _retryable(response)
                    self.metrics.upstream_errors.labels(pool.name, worker.name, "status").inc()
                    continue
                # Phase 2a: a whole reply is read before the client sees any
                # of it, so a reply that breaks off is still retried.
                if not (rec.stream and response.status == 200):
                    try:
                        payload = await _unless_gone(receive, response.read())
                    except UpstreamBroken as exc:
                        await response.close()
                        last_error = self._failed(pool, worker, "stream", exc)
                        continue
                    if payload is None:
                        rec.status, rec.error = STATUS_CLIENT_GONE, "the client went away"
                        await response.close()
                        return
                    self.ejected_until.pop(worker.id, None)
                    await self._reply_whole(send, req, response, payload)
                    return
                # Phase 2b: a stream is passed through as it arrives; from its
                # first byte on there is no going back.
                self.ejected_until.pop(worker.id, None)
                await self._relay(send, receive, req, response, strip_usage, pool, worker)
                return
            finally:
                self.outstanding[worker.id] -= 1
        rec.worker_id = rec.profile_revision_id = None
        if last_error is None:
            last_error = _no_capacity(f"No worker of pool `{pool.name}` ({pool.role.value}) can take the request.")
        raise last_error

    def _failed(self, pool: PoolTarget, worker: WorkerTarget, kind: str, exc: Exception) -> ApiError:
        """A worker that failed at the transport level is passed over for a while."""
        self.ejected_until[worker.id] = self.clock() + self.settings.eject_seconds
        self.metrics.upstream_errors.labels(pool.name, worker.name, kind).inc()
        log.warning("worker %s (%s) failed (%s), ejected for %.0fs: %s",
                    worker.name, worker.url, kind, self.settings.eject_seconds, exc)
        return _no_capacity(f"worker {worker.name} failed: {exc}")

    def _routing_headers(self, rec: RequestRecord, key: ClientKeyInfo | None) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", rec.request_id.encode())]
        if rec.cohort:
            headers.append((b"x-chunkpilot-cohort", rec.cohort.encode()))
        if key is not None and key.is_admin and self.settings.expose_routing_to_admins:
            pool_name = _pool_name(self.holder.current, rec)
            if pool_name:
                headers.append((b"x-chunkpilot-pool", pool_name.encode()))
            if rec.worker_id is not None:
                headers.append((b"x-chunkpilot-worker", self._worker_names.get(rec.worker_id, "").encode()))
        return headers

    def _response_headers(self, req: _Request, response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in response.headers if k in PASSED_HEADERS]
        return headers + self._routing_headers(req.record, req.key)

    async def _reply_whole(self, send: Send, req: _Request, response: UpstreamResponse, payload: bytes) -> None:
        rec = req.record
        rec.status = response.status
        headers = self._response_headers(req, response)
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
        if response.status == 200:
            _take_usage(rec, usage_of_body(payload))
        else:
            rec.error = _error_message(payload)

    async def _relay(self, send: Send, receive: Receive, req: _Request, response: UpstreamResponse,
                     strip_usage: bool, pool: PoolTarget, worker: WorkerTarget) -> None:
        rec = req.record
        rec.status = 200
        meter = StreamMeter(req.arrival, strip_usage=strip_usage)
        await send({"type": "http.response.start", "status": 200, "headers": self._response_headers(req, response)})
        gone = asyncio.ensure_future(receive())  # completes when the client disconnects
        clock, feed, next_chunk = self.clock, meter.feed, response.next_chunk
        try:
            while (chunk := await next_chunk()) is not None:
                out = feed(chunk, clock())
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if gone.done():
                    rec.status, rec.error = STATUS_CLIENT_GONE, "the client went away mid-stream"
                    break
            else:
                await send({"type": "http.response.body", "body": meter.flush(), "more_body": False})
        except UpstreamBroken as exc:
            self._failed(pool, worker, "stream", exc)
            # The client got a 200 and a stream that ends in an error event:
            # the log says so (status as sent, error set), as for a worker's own error event.
            rec.error = f"the worker's stream broke off: {exc}"[:500]
            error = ApiError(502, "The worker's stream broke off.", type="service_unavailable", code="upstream_broken")
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": meter.flush() + b"data: " + error.body() + b"\n\n",
                            "more_body": False})
        finally:
            gone.cancel()
            await response.close()
        if meter.upstream_error and not rec.error:
            rec.error = meter.upstream_error
        rec.ttft_seconds = meter.ttft_seconds
        rec.max_gap_seconds = meter.gap_seconds
        rec.tpot_seconds = meter.tpot_seconds
        _take_usage(rec, meter.usage)
        if rec.output_tokens is None:
            rec.output_tokens = meter.output_tokens

    def _finish(self, rec: RequestRecord, arrival: float) -> None:
        rec.e2e_seconds = self.clock() - arrival
        m = self.metrics
        m.requests.labels(rec.model, rec.cohort, str(rec.status)).inc()
        if rec.status == 200:
            m.e2e.labels(rec.model, rec.cohort).observe(rec.e2e_seconds)
            if rec.ttft_seconds is not None:
                m.ttft.labels(rec.model, rec.cohort).observe(rec.ttft_seconds)
            if rec.max_gap_seconds is not None:
                m.max_gap.labels(rec.model, rec.cohort).observe(rec.max_gap_seconds)
            if rec.tpot_seconds is not None:
                m.tpot.labels(rec.model, rec.cohort).observe(rec.tpot_seconds)
        try:
            self.record(rec)
        except Exception:  # noqa: BLE001 - the log is never worth failing a request over
            log.exception("could not queue the request log row")


# ---- helpers -------------------------------------------------------------------------
def _headers(scope: Scope) -> dict[bytes, bytes]:
    return dict(scope["headers"])  # ASGI header names are lower-case already


def _asks_usage(data: dict[str, Any]) -> bool:
    options = data.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _take_usage(rec: RequestRecord, usage: Usage | None) -> None:
    if usage is not None:
        rec.prompt_tokens, rec.cached_tokens, rec.output_tokens = (
            usage.prompt_tokens, usage.cached_tokens, usage.output_tokens,
        )


def _pool_name(state: GatewayState, rec: RequestRecord) -> str:
    table = state.tables.get(rec.model)
    pool = table.pools.get(rec.pool_id) if table is not None and rec.pool_id is not None else None
    return pool.name if pool is not None else ""


def _error_message(payload: bytes) -> str:
    try:
        data = json.loads(payload)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("error")
        return str(message)[:500]
    except (ValueError, KeyError, TypeError, AttributeError):
        return payload[:500].decode("utf-8", "replace")


async def _retryable(response: UpstreamResponse) -> ApiError:
    """A worker said "not now": keep what it said, in case no other worker can."""
    try:
        payload = await response.read()
    except UpstreamBroken:
        payload = b""
    finally:
        await response.close()
    retry_after = next((v for k, v in response.headers if k.lower() == b"retry-after"), b"1")
    return ApiError(response.status, _error_message(payload) or "the worker is busy.",
                    type="service_unavailable" if response.status != 429 else "rate_limit_error",
                    code="no_worker_available", headers=[(b"retry-after", retry_after)])


async def _unless_gone(receive: Receive, work: Awaitable[bytes]) -> bytes | None:
    """``work``'s result, or None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(receive())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return None
    finally:
        gone.cancel()


async def _reply(send: Send, status: int, body: bytes, content_type: bytes,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, data: Any) -> None:
    await _reply(send, status, json.dumps(data).encode(), b"application/json")


async def _error(send: Send, error: ApiError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    if error.status == STATUS_CLIENT_GONE:
        return
    await _reply(send, error.status, error.body(), b"application/json", [*error.headers, *(extra or [])])
