"""The gateway's request path: OpenAI's API, served by ``server.serve``.

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
  5. Attempt: forward the body. Only a connection that fails before the
     worker's first byte, or the worker's refusal to admit the request (429
     ``queue_full``, 503 ``worker_<state>``), moves on to the next worker.
     Anything else the worker says (a 4xx about the request's own
     parameters, a 5xx from an engine that failed on it) goes to the client
     as it is, so one poisoned request cannot walk across a pool; so does a
     reply that breaks off (502) or sends no head in time (504). A stream's
     200 is taken up in the worker socket's read callback (``_Relay``): the head and the
     first events go to the client in one write, and every later read is
     piped through the meter to the client's socket from that callback, with
     no task woken per event; a slow client pauses the read from the worker.
  6. Record: one ``RequestRecord`` with what the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from controlplane.accounts.secrets import hash_secret
from controlplane.fleet.pools import PoolRole
from controlplane.gateway import facts
from controlplane.gateway.cohort import bucket_of, sticky_key
from controlplane.gateway.inflight import (
    STATUS_STREAM_BROKEN,
    STATUS_STREAM_TIMED_OUT,
    InFlight,
    InFlightCollector,
    Stream,
    StreamLabels,
)
from controlplane.gateway.meter import StreamMeter, Usage
from controlplane.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from controlplane.gateway.params import apply_output_cap, output_cap
from controlplane.gateway.record import RequestRecord
from controlplane.gateway.server import Exchange, Headers
from controlplane.gateway.state import (
    ClientKeyInfo,
    GatewayState,
    PoolTarget,
    StateHolder,
    TableTarget,
    WorkerTarget,
)
from controlplane.gateway.upstream import (
    PendingResponse,
    Upstream,
    UpstreamBroken,
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimedOut,
    UpstreamUnavailable,
)
from workers import openai_rules
from workers.openai_error import ApiError

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
MODEL_PATH = "/v1/models/"
# A worker's refusal to admit a request: the only replies tried again on
# another worker (with connections that fail before the first byte).
DECLINED_STATUSES = frozenset({429, 503})
DECLINED_CODES = frozenset({"queue_full"})
DECLINED_CODE_PREFIX = "worker_"  # worker_draining, worker_starting, ...: not admitting
SESSION_HEADER = b"x-chunkpilot-session"
COHORT_HEADER = b"x-chunkpilot-cohort"
# Response headers worth passing from a worker to the client; hop-by-hop
# ones and the length (re-derived by the server) are not.
PASSED_HEADERS = frozenset({b"content-type", b"cache-control", b"retry-after", b"x-accel-buffering"})
STATUS_CLIENT_GONE = 499  # nginx's code: the client closed the connection first
# Request ids: random per process, then counted (uuid4 per request cost more
# than anything else before the request left for the worker).
_ID_PREFIX = os.urandom(6).hex()
_id_counter = itertools.count()
_USAGE_OPTION = b', "stream_options": {"include_usage": true}}'


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3  # workers tried per request before giving up
    eject_seconds: float = 10.0  # how long a worker that refused a connection is passed over
    expose_routing_to_admins: bool = True  # x-chunkpilot-pool/-worker on admin keys' replies
    stream_silence_seconds: float = 10.0  # a stream this long without a token counts as silent (gauges)
    stream_idle_timeout_seconds: float = 120.0  # ... and this long is ended with an error event (0: never)
    track_streams: bool = True  # off: no silence gauges, no idle timeout (to measure their cost)


def _no_capacity(message: str) -> ApiError:
    return ApiError(
        message, status=503, type="service_unavailable", code="no_worker_available", headers={"retry-after": "1"}
    )


@dataclass(slots=True)
class _Request:
    """What one completion request carries through the path."""

    arrival: float
    record: RequestRecord
    key: ClientKeyInfo
    pool: PoolTarget
    body: bytes  # as sent to workers
    strip_usage: bool  # the usage event was asked for by the gateway, not the client
    tried: set[int] = field(default_factory=set)  # worker ids


@dataclass(slots=True)
class _Attempt:
    """The request on its way to one worker."""

    worker: WorkerTarget
    relay: _Relay | None
    pending: PendingResponse
    error: ApiError | None = None  # why it failed, when another worker may try


class Gateway:
    """The request handler (``handle``). ``record`` is called once per proxied request."""

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
        # Authorization headers already checked against this state's keys
        # (a hash and a decode per request otherwise); emptied with each new state.
        self._known_keys: dict[bytes, ClientKeyInfo] = {}
        self._known_keys_of: GatewayState | None = None
        self._observers: dict[tuple[str, str], tuple[Any, ...]] = {}  # metric children by (model, cohort)
        self.metrics.watch(self._epochs_by_model, self._outstanding_by_name)
        self.inflight = InFlight(
            clock,
            silence_seconds=self.settings.stream_silence_seconds,
            idle_timeout_seconds=self.settings.stream_idle_timeout_seconds,
        )
        self.metrics.registry.register(InFlightCollector(self.inflight))
        self._watcher: asyncio.Future[None] | None = None

    # ---- lifecycle ------------------------------------------------------------
    async def startup(self) -> None:
        self._upstream = self._upstream_factory()
        self._watcher = asyncio.ensure_future(self.inflight.watch())
        for hook in self._on_startup:
            await hook()
        # Everything loaded so far (Django, the modules, the first snapshot)
        # lives as long as the process: keep the cyclic GC from rescanning it.
        # A full collection of that heap took 200 ms on a busy 2-core host,
        # a stall every stream in flight would see.
        gc.freeze()

    async def shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for hook in self._on_shutdown:
            with contextlib.suppress(Exception):
                await hook()
        if self._upstream is not None:
            await self._upstream.close()

    def handle(self, ex: Exchange) -> Awaitable[None] | None:
        """Answers ``ex``, or starts to: a completion returns the coroutine
        that finishes it. Everything up to the request's write to a worker
        happens here, in the server's read callback, without waiting for a
        task to be scheduled."""
        path, method = ex.path, ex.method
        try:
            if path in COMPLETION_PATHS:
                if method != "POST":
                    raise ApiError(f"{path} takes POST.", status=405, code="method_not_allowed")
                return self._completion(ex)
            elif path == "/v1/models" and method == "GET":
                self._authenticate(ex.headers, self.holder.current)
                _json(ex, 200, self._models())
            elif path.startswith(MODEL_PATH) and method == "GET":
                self._authenticate(ex.headers, self.holder.current)
                _json(ex, 200, self._model(unquote(path.removeprefix(MODEL_PATH))))
            elif path == "/health":
                self._health(ex)
            elif path == "/metrics":
                _reply(ex, 200, self.metrics.render(), CONTENT_TYPE.encode())
            else:
                raise ApiError(f"no route {method} {path}", status=404, type="not_found_error", code="not_found")
        except ApiError as error:
            _error(ex, error)
        return None

    # ---- small endpoints -------------------------------------------------------
    def _health(self, ex: Exchange) -> None:
        state = self.holder.current
        body = {
            "status": "ok" if state.loaded_at else "loading",
            "models": {model: table.epoch for model, table in state.tables.items()},
            "state_age_seconds": self.holder.age_seconds,
        }
        _json(ex, 200 if state.loaded_at else 503, body)

    def _models(self) -> dict[str, Any]:
        tables = self.holder.current.tables
        return {"object": "list", "data": [_model_card(tables[model]) for model in sorted(tables)]}

    def _model(self, model: str) -> dict[str, Any]:
        """GET /v1/models/{model}: one card, or OpenAI's 404."""
        table = self.holder.current.tables.get(model)
        if table is None:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
        return _model_card(table)

    def _epochs_by_model(self) -> dict[str, int]:
        return {model: table.epoch for model, table in self.holder.current.tables.items()}

    def _outstanding_by_name(self) -> dict[str, int]:
        return {self._worker_names.get(wid, str(wid)): n for wid, n in self.outstanding.items()}

    # ---- completions --------------------------------------------------------------
    def _authenticate(self, headers: dict[bytes, bytes], state: GatewayState) -> ClientKeyInfo:
        auth = headers.get(b"authorization", b"")
        if self._known_keys_of is not state or len(self._known_keys) > 10_000:
            self._known_keys, self._known_keys_of = {}, state
        elif (known := self._known_keys.get(auth)) is not None:
            return known
        scheme, _, token = auth.partition(b" ")
        if not token or scheme.lower() != b"bearer":
            raise ApiError(
                "You didn't provide an API key: send `Authorization: Bearer <key>`.", status=401, code="invalid_api_key"
            )
        info = state.keys.get(hash_secret(token.strip().decode("latin-1")))
        if info is None:
            raise ApiError("Incorrect API key provided.", status=401, code="invalid_api_key")
        self._known_keys[auth] = info
        return info

    def _completion(self, ex: Exchange) -> Awaitable[None] | None:
        arrival = self.clock()
        state = self.holder.current
        headers = ex.headers
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or f"{_ID_PREFIX}{next(_id_counter):x}"
        rec = RequestRecord(request_id=request_id, created_at=time.time(), model="")
        try:
            key = self._authenticate(headers, state)
        except ApiError as error:
            self.metrics.requests.labels("", "", str(error.status)).inc()
            raise
        rec.api_key_id = key.id
        try:
            body, data = ex.body, _json_object(ex.body)
            table = self._table(state, data)
            rec.model = table.model
            rec.stream = data.get("stream") is True
            pool = self._pool(table, data, headers, key)
            rec.cohort, rec.pool_id = pool.role.value, pool.id
            body, strip_usage = _body_for_workers(
                body,
                data,
                stream=rec.stream,
                chat=ex.path == "/v1/chat/completions",
                cap=output_cap(key.max_output_tokens, table.max_output_tokens),
            )
            req = _Request(arrival, rec, key, pool, body, strip_usage)
            first = self._attempt(ex, req)
        except ApiError as error:
            self._refused(ex, rec, key, error)
            if rec.model:
                self._finish(rec, arrival)
            return None
        return self._complete(ex, req, first)

    def _refused(self, ex: Exchange, rec: RequestRecord, key: ClientKeyInfo, error: ApiError) -> None:
        rec.status, rec.error = error.status, error.message[:500]
        _error(ex, error, self._routing_headers(rec, key))

    async def _complete(self, ex: Exchange, req: _Request, first: _Attempt | None) -> None:
        try:
            await self._forward(ex, req, first)
        except ApiError as error:
            self._refused(ex, req.record, req.key, error)
        finally:
            self._finish(req.record, req.arrival)

    def _table(self, state: GatewayState, data: dict[str, Any]) -> TableTarget:
        model = data.get("model")
        if model is None and len(state.tables) == 1:
            return next(iter(state.tables.values()))  # as a worker does: one model, no name needed
        if not isinstance(model, str):
            raise ApiError("`model` is required.", status=400, param="model")
        table = state.tables.get(model)
        if table is None:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
        return table

    def _pool(
        self, table: TableTarget, data: dict[str, Any], headers: dict[bytes, bytes], key: ClientKeyInfo
    ) -> PoolTarget:
        forced = headers.get(COHORT_HEADER)
        if forced is not None:
            if not key.is_admin:
                raise ApiError(
                    "Only admin keys may choose a cohort with x-chunkpilot-cohort.",
                    status=403,
                    type="permission_error",
                    code="cohort_override_forbidden",
                )
            try:
                role = PoolRole(forced.decode("latin-1").strip().lower())
            except ValueError:
                raise ApiError(
                    f"x-chunkpilot-cohort must be one of canary, baseline, stable; got {forced.decode('latin-1')!r}.",
                    status=400,
                    code="invalid_cohort",
                ) from None
            pool = table.pool_for_role(role)
            if pool is None:
                raise ApiError(
                    f"The routing table of `{table.model}` has no {role.value} pool.", status=400, code="invalid_cohort"
                )
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

    def _attempt(self, ex: Exchange, req: _Request) -> _Attempt | None:
        """Sends the request to the next worker of its pool (None: none left).
        The write happens now when an idle connection to the worker is at hand."""
        worker = self.pick_worker(req.pool, req.tried)
        if worker is None:
            return None
        upstream = self._upstream
        assert upstream is not None, "the gateway has not started"
        rec = req.record
        req.tried.add(worker.id)
        self._worker_names[worker.id] = worker.name
        self.outstanding[worker.id] += 1
        rec.worker_id, rec.profile_revision_id = worker.id, worker.revision_id
        relay = _Relay(self, ex, req) if rec.stream else None
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", rec.request_id.encode()),
            # When the gateway took the request (nginx's and the APMs'
            # X-Request-Start): the worker's TTFT counts from here, so time the
            # request spent before the worker's loop read it is not lost.
            (b"x-request-start", b"t=%.6f" % rec.created_at),
        ]
        pending = upstream.start(
            worker.url + ex.path, headers, req.body, on_head=relay.on_head if relay is not None else None
        )
        return _Attempt(worker, relay, pending)

    async def _forward(self, ex: Exchange, req: _Request, attempt: _Attempt | None) -> None:
        rec, pool = req.record, req.pool
        last_error: ApiError | None = None
        for n in range(max(1, self.settings.max_attempts)):
            if n:
                attempt = self._attempt(ex, req)
            if attempt is None:
                break
            worker, relay = attempt.worker, attempt.relay
            try:
                # Phase 1: the response head. Only a connection that failed
                # before the worker's first byte moves on to the next worker
                # (see ``_head``).
                response = await self._head(attempt, pool)
                if response is None:
                    last_error = attempt.error
                    continue
                if relay is not None and relay.done is not None:
                    # Phase 2b: a stream, under way since its head arrived;
                    # from its first byte on there is no going back.
                    self.ejected_until.pop(worker.id, None)
                    await self._relay(ex, rec, relay, response, pool, worker)
                    return
                # Phase 2a: a whole reply, read before the client sees any of it.
                try:
                    payload = await _unless_gone(ex.gone, response.read())
                except UpstreamBroken as exc:
                    await response.close()
                    self._failed(pool, worker, "stream", exc)
                    raise _upstream_failed(
                        502, f"The reply of worker {worker.name} broke off: {exc}", "upstream_broken"
                    ) from exc
                if payload is None:
                    rec.status, rec.error = STATUS_CLIENT_GONE, "the client went away"
                    await response.close()
                    return
                if (declined := _declined(response, payload)) is not None:
                    # The worker refused to admit the request (a full queue,
                    # draining, starting): it never ran, so another may take it.
                    last_error = declined
                    self.metrics.upstream_errors.labels(pool.name, worker.name, "status").inc()
                    continue
                self.ejected_until.pop(worker.id, None)
                self._reply_whole(ex, req, response, payload)
                return
            finally:
                self.outstanding[worker.id] -= 1
        rec.worker_id = rec.profile_revision_id = None
        if last_error is None:
            last_error = _no_capacity(f"No worker of pool `{pool.name}` ({pool.role.value}) can take the request.")
        raise last_error

    async def _head(self, attempt: _Attempt, pool: PoolTarget) -> UpstreamResponse | None:
        """The worker's response head; None (and ``attempt.error`` set) when
        the connection failed before any byte of it, which is the one failure
        another worker may retry. A worker that took the request and then
        sent no head in time (``GATEWAY_READ_TIMEOUT_SECONDS``) may be hung by
        this very request: 504, not retried."""
        worker = attempt.worker
        try:
            return await attempt.pending.response()
        except UpstreamUnavailable as exc:
            attempt.error = self._failed(pool, worker, "connect", exc)
            return None
        except UpstreamTimedOut as exc:
            self._failed(pool, worker, "timeout", exc)
            raise _upstream_failed(
                504, f"Worker {worker.name} did not answer in time: {exc}", "upstream_timeout"
            ) from exc

    def _failed(self, pool: PoolTarget, worker: WorkerTarget, kind: str, exc: Exception) -> ApiError:
        """A worker that failed at the transport level is passed over for a while."""
        self.ejected_until[worker.id] = self.clock() + self.settings.eject_seconds
        self.metrics.upstream_errors.labels(pool.name, worker.name, kind).inc()
        log.warning(
            "worker %s (%s) failed (%s), ejected for %.0fs: %s",
            worker.name,
            worker.url,
            kind,
            self.settings.eject_seconds,
            exc,
        )
        return _no_capacity(f"worker {worker.name} failed: {exc}")

    def _routing_headers(self, rec: RequestRecord, key: ClientKeyInfo | None) -> Headers:
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

    def _response_headers(self, req: _Request, response: UpstreamResponse) -> Headers:
        headers = [(k, v) for k, v in response.headers if k in PASSED_HEADERS]
        return headers + self._routing_headers(req.record, req.key)

    def _reply_whole(self, ex: Exchange, req: _Request, response: UpstreamResponse, payload: bytes) -> None:
        rec = req.record
        rec.status = response.status
        ex.reply(response.status, self._response_headers(req, response), payload)
        if response.status == 200:
            usage, reported = facts.of_body(payload)
            _take_usage(rec, usage)
            facts.take_facts(rec, reported)
        else:
            rec.error = ApiError.from_reply(response.status, payload).message

    async def _relay(
        self,
        ex: Exchange,
        rec: RequestRecord,
        relay: _Relay,
        response: UpstreamResponse,
        pool: PoolTarget,
        worker: WorkerTarget,
    ) -> None:
        """Waits for the stream's end (or the client's going away) and logs it."""
        done, meter = relay.done, relay.meter
        assert done is not None
        rec.status = 200
        stalled = self._track(relay, rec, pool, worker)
        try:
            if not done.done():
                await asyncio.wait((done, ex.gone, stalled), return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                done.result()  # raises if the stream broke off
                ex.end(meter.flush())
            elif stalled.done():
                self._end_stalled(ex, rec, meter)
            elif not meter.done:
                rec.status, rec.error = STATUS_CLIENT_GONE, "the client went away mid-stream"
            # else: the client had the whole stream, [DONE] included, and hung
            # up before the worker's closing bytes arrived: a complete request.
        except UpstreamBroken as exc:
            self._failed(pool, worker, "stream", exc)
            # The client got a 200 head and a stream that ends in an error event;
            # the log gives it a status of its own (597), so a status filter
            # finds it and the error rate counts it.
            rec.status = STATUS_STREAM_BROKEN
            rec.error = f"the worker's stream broke off: {exc}"[:500]
            error = ApiError(
                "The worker's stream broke off.", status=502, type="service_unavailable", code="upstream_broken"
            )
            ex.end(meter.flush() + b"data: " + error.encode() + b"\n\n")
        finally:
            self.inflight.remove(id(relay))
            ex.on_pause = ex.on_resume = None
            await response.close()
        if meter.upstream_error and not rec.error:
            rec.error = meter.upstream_error
        rec.ttft_seconds = meter.ttft_seconds
        rec.max_gap_seconds = meter.gap_seconds
        rec.tpot_seconds = meter.tpot_seconds
        _take_usage(rec, meter.usage)
        facts.take_facts(rec, meter.facts, meter.gaps)
        if rec.output_tokens is None:
            rec.output_tokens = meter.output_tokens

    # ---- streams in flight (gateway/inflight.py) ------------------------------------------
    def _track(self, relay: _Relay, rec: RequestRecord, pool: PoolTarget, worker: WorkerTarget) -> asyncio.Future[None]:
        """Keep the stream in the in-flight set; the future is set if its idle timeout ends it."""
        stalled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.settings.track_streams:
            return stalled  # never set

        def on_timeout() -> None:
            if not stalled.done():
                stalled.set_result(None)

        labels = StreamLabels(rec.model, rec.cohort, pool.name, worker.name)
        self.inflight.add(id(relay), Stream(labels, relay.meter, on_timeout))
        return stalled

    def _end_stalled(self, ex: Exchange, rec: RequestRecord, meter: StreamMeter) -> None:
        """The worker stopped feeding the stream: end it for the client with an
        error event, in OpenAI's shape, and log it with a status of its own."""
        timeout = self.inflight.idle_timeout_seconds
        rec.status = STATUS_STREAM_TIMED_OUT
        rec.error = f"no token for {timeout:g} s: the gateway ended the stream (GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS)"
        error = ApiError(
            f"The worker sent nothing for {timeout:g} s; the stream was ended.",
            status=504,
            type="timeout_error",
            code="stream_idle_timeout",
        )
        ex.end(meter.flush() + b"data: " + error.encode() + b"\n\n")

    def _finish(self, rec: RequestRecord, arrival: float) -> None:
        rec.e2e_seconds = self.clock() - arrival
        m = self.metrics
        if rec.status != 200:
            m.requests.labels(rec.model, rec.cohort, str(rec.status)).inc()
        else:
            observers = self._observers.get((rec.model, rec.cohort))
            if observers is None:  # labels() looks up under a lock: once per model and cohort
                labels = (rec.model, rec.cohort)
                observers = self._observers[labels] = (
                    m.requests.labels(*labels, "200"),
                    m.e2e.labels(*labels),
                    m.ttft.labels(*labels),
                    m.max_gap.labels(*labels),
                    m.tpot.labels(*labels),
                )
            ok, e2e, ttft, max_gap, tpot = observers
            ok.inc()
            e2e.observe(rec.e2e_seconds)
            if rec.ttft_seconds is not None:
                ttft.observe(rec.ttft_seconds)
            if rec.max_gap_seconds is not None:
                max_gap.observe(rec.max_gap_seconds)
            if rec.tpot_seconds is not None:
                tpot.observe(rec.tpot_seconds)
        try:
            self.record(rec)
        except Exception:
            log.exception("could not queue the request log row")


class _Relay:
    """One stream from a worker to a client, driven by the worker socket's
    callbacks: ``on_head`` takes up a 200 as soon as its head is read, and
    ``on_data`` passes each later read through the meter to the client."""

    __slots__ = ("gateway", "ex", "req", "meter", "done", "headers", "_feed", "_clock")

    def __init__(self, gateway: Gateway, ex: Exchange, req: _Request):
        self.gateway, self.ex, self.req = gateway, ex, req
        self.meter = StreamMeter(req.arrival, strip_usage=req.strip_usage)
        self.done: asyncio.Future[bool] | None = None  # set once the stream is taken up
        self.headers: Headers = []
        self._feed, self._clock = self.meter.feed, gateway.clock

    def on_head(self, response: UpstreamResponse) -> bool:
        """The worker's head is in: a 200 starts the client's stream now
        (anything else is left to the request's task: a retry or a whole reply)."""
        if response.status != 200:
            return False
        ex = self.ex
        self.headers = self.gateway._response_headers(self.req, response)
        ex.on_pause, ex.on_resume = response.pause, response.resume
        self.done = response.pipe(self.on_data)  # what came with the head is fed at once
        if not ex.started:
            ex.start(200, self.headers)
        return True

    def on_data(self, chunk: bytes) -> None:
        out = self._feed(chunk, self._clock())
        ex = self.ex
        if ex.started:
            ex.write(out)
        else:  # the head and the first events in one write
            ex.start(200, self.headers, out)


# ---- helpers -------------------------------------------------------------------------
def _model_card(table: TableTarget) -> dict[str, Any]:
    card: dict[str, Any] = {"id": table.model, "object": "model", "created": 0, "owned_by": "chunkpilot"}
    # vLLM's card field: clients (the load generator) size prompts by it.
    if (max_model_len := table.max_model_len) is not None:
        card["max_model_len"] = max_model_len
    if table.max_output_tokens is not None:  # the route's cap, so clients can see it
        card["max_output_tokens"] = table.max_output_tokens
    return card


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except RecursionError as exc:  # ``[`` × 100,000: past the interpreter's stack, not a server fault
        raise ApiError("the request body is nested too deeply.", status=400, code="invalid_json") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", status=400, code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object.", status=400, code="invalid_json")
    return data


def _asks_usage(data: dict[str, Any]) -> bool:
    options = data.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _body_for_workers(
    body: bytes, data: dict[str, Any], *, stream: bool, chat: bool, cap: int | None
) -> tuple[bytes, bool]:
    """The body as workers are sent it (checked, capped, usage asked for),
    and whether the usage event is the gateway's to drop again."""
    openai_rules.check_request(data, chat=chat)
    changed = apply_output_cap(data, chat, cap)
    strip_usage = stream and not _asks_usage(data)
    if strip_usage:
        # Ask for usage so the log has token counts; the meter drops the
        # usage event again before the client would see it.
        if "stream_options" in data or changed:
            data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
            changed = True
        else:  # spliced in before the object's closing brace: no re-encoding
            body = body.rstrip()[:-1] + _USAGE_OPTION
    if changed:
        # ASCII escapes: a lone surrogate in a prompt (valid JSON) has no UTF-8 form.
        body = json.dumps(data).encode()
    return body, strip_usage


def _take_usage(rec: RequestRecord, usage: Usage | None) -> None:
    if usage is not None:
        rec.prompt_tokens, rec.cached_tokens, rec.output_tokens = (
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.output_tokens,
        )


def _pool_name(state: GatewayState, rec: RequestRecord) -> str:
    table = state.tables.get(rec.model)
    pool = table.pools.get(rec.pool_id) if table is not None and rec.pool_id is not None else None
    return pool.name if pool is not None else ""


def _declined(response: UpstreamResponse, payload: bytes) -> ApiError | None:
    """What a worker said when it refused to admit the request ("not now":
    kept in case no other worker can take it), else None. Only the worker's
    own refusals before admission count (``workers/server/app.py``: 429
    ``queue_full``, 503 ``worker_<state>``); any other status, a 503 from
    an engine that failed on this request included, goes to the client as it is."""
    if response.status not in DECLINED_STATUSES:
        return None
    said = ApiError.from_reply(response.status, payload)
    code = said.code or ""
    if code not in DECLINED_CODES and not code.startswith(DECLINED_CODE_PREFIX):
        return None
    retry_after = next((v for k, v in response.headers if k.lower() == b"retry-after"), b"1")
    return ApiError(
        said.message or "the worker is busy.",
        status=response.status,
        type="service_unavailable" if response.status != 429 else "rate_limit_error",
        code="no_worker_available",
        headers={"retry-after": retry_after.decode("latin-1")},
    )


def _upstream_failed(status: int, message: str, code: str) -> ApiError:
    return ApiError(message, status=status, type="service_unavailable", code=code)


async def _unless_gone(gone: asyncio.Future[None], work: Awaitable[bytes]) -> bytes | None:
    """``work``'s result, or None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    either: set[asyncio.Future[Any]] = {task, gone}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return None


def _reply(ex: Exchange, status: int, body: bytes, content_type: bytes, headers: Headers | None = None) -> None:
    ex.reply(status, [(b"content-type", content_type), *(headers or [])], body)


def _json(ex: Exchange, status: int, data: Any) -> None:
    _reply(ex, status, json.dumps(data).encode(), b"application/json")


def _error(ex: Exchange, error: ApiError, extra: Headers | None = None) -> None:
    if error.status == STATUS_CLIENT_GONE or ex.started:
        return
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    _reply(ex, error.status, error.encode(), b"application/json", [*headers, *(extra or [])])
