"""The gateway's HTTP/1.1 server: httptools' request parser (the C parser
uvicorn uses) on an asyncio protocol, handing each whole request to a handler.

Why not uvicorn: the gateway is a proxy whose cost is measured against
nginx's, and at 64 streams py-spy put most of its time not in routing but in
the ASGI cycle around it: a message dict, a coroutine step and a flow-control
check for every event relayed, and a ``receive`` task per request to learn
of a disconnect. A proxy needs a small part of HTTP, and this module is that
part:

- requests with bodies read whole before the handler runs (OpenAI requests
  are small; over ``max_body_bytes`` is a 413, from the declared length when
  there is one), ``Expect: 100-continue`` answered;
- keep-alive with an idle timeout, pipelined requests answered in order;
- a request that stops arriving part-way (a declared body never sent) is
  answered 408 after ``body_timeout_seconds`` without a byte more;
- responses written whole (``reply``) or streamed with chunked encoding
  (``start``/``write``/``end``; close-delimited for HTTP/1.0 clients), the
  head and the first bytes in one write;
- the client's going away as a future (``Exchange.gone``), and its socket's
  back-pressure as callbacks (``on_pause``/``on_resume``) a relay hooks the
  worker's socket to, so a slow client slows the read from the worker instead
  of filling memory;
- a malformed request gets a 400 and the connection is closed.

``serve`` runs a handler until SIGTERM or SIGINT, then stops listening, lets
the requests in flight finish (up to ``grace_seconds``) and runs the
shutdown hooks, so the request log's last rows are written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import httptools

from workers.openai_error import ApiError

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]
# After a refusal, how long and how much of the client's rest is read and
# dropped before the connection closes (nginx's lingering_timeout is 5 s).
LINGER_SECONDS = 2.0
LINGER_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    max_body_bytes: int = 32 << 20
    max_head_bytes: int = 64 << 10  # request line and headers
    keep_alive_seconds: float = 30.0  # an idle connection is closed after this
    # A request begun and then not continued for this long (the rest of its
    # head, or of the body its Content-Length declared) gets a 408.
    body_timeout_seconds: float = 10.0
    # The whole head must be in this long after it began, however steadily it
    # trickles in (nginx's client_header_timeout): one header line every 8 s
    # never tripped the gap timer above and held the connection for good.
    head_timeout_seconds: float = 10.0
    grace_seconds: float = 30.0  # how long requests in flight may finish on shutdown
    backlog: int = 4096
    write_high_water: int = 1 << 20  # bytes queued to a client before its relay pauses


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


@functools.cache
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class Exchange:
    """One request and its response. The handler reads ``method``, ``path``,
    ``headers`` (lower-case names) and ``body``, then answers with ``reply``
    or with ``start``, ``write``... and ``end``."""

    __slots__ = (
        "method",
        "path",
        "headers",
        "body",
        "keep_alive",
        "http_10",
        "gone",
        "on_pause",
        "on_resume",
        "started",
        "ended",
        "too_large",
        "_conn",
        "_chunked",
    )

    def __init__(
        self,
        conn: _HttpProtocol,
        method: str,
        url: bytes,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        http_10: bool,
    ):
        self.method = method
        self.path = url.partition(b"?")[0].decode("latin-1")  # workers are sent the path alone, as before
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http_10 = http_10
        self.gone: asyncio.Future[None] = conn.loop.create_future()  # done when the client disconnects
        if conn.lost:
            self.gone.set_result(None)
        self.on_pause: Callable[[], None] | None = None  # the client's socket is full / drained again
        self.on_resume: Callable[[], None] | None = None
        self.started = self.ended = False
        self.too_large = False  # the body was over the limit and is not here
        self._conn = conn
        self._chunked = False

    def _head(self, status: int, headers: Headers, framing: bytes) -> bytes:
        self.started = True
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(framing)
        return b"".join(lines)

    def reply(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole response: head and body in one write."""
        assert not self.started, "the response has begun already"
        self._conn.write(self._head(status, headers, b"content-length: %d\r\n\r\n" % len(body)) + body)
        self._finish()

    def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """The head of a streamed response, with its first bytes if there are any."""
        assert not self.started, "the response has begun already"
        if self.http_10:  # no chunked encoding before HTTP/1.1: the end of the body is the end of the connection
            self.keep_alive = False
            self._conn.write(self._head(status, headers, b"\r\n") + first)
            return
        self._chunked = True
        head = self._head(status, headers, b"transfer-encoding: chunked\r\n\r\n")
        self._conn.write(head + b"%x\r\n%s\r\n" % (len(first), first) if first else head)

    def write(self, data: bytes) -> None:
        if data and not self.ended:
            self._conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    def end(self, data: bytes = b"") -> None:
        if self.ended:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data:
            self._conn.write(data)
        self._finish()

    def _finish(self) -> None:
        self.ended = True
        self._conn.finished(self)


# Answers the exchange, or starts to and returns what finishes it: the part
# before its first wait runs in the read callback, with no task to schedule.
Handler = Callable[[Exchange], Awaitable[None] | None]


class _HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: _Server):
        self.server = server
        self.loop = server.loop
        self.settings = server.settings
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.paused = False  # the client's socket buffer is full
        self.current: Exchange | None = None
        self.waiting: collections.deque[Exchange] = collections.deque()  # pipelined requests
        self._idle_timer: asyncio.TimerHandle | None = None
        self._request_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_message = False  # part of a request has arrived, not all of it
        self._lingering = -1  # bytes read and dropped after a refusal; -1 while not refused
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._head_size = 0
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        transport.set_write_buffer_limits(high=self.settings.write_high_water)  # type: ignore[attr-defined]
        self.server.connections.add(self)
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:  # refused: what the client still sends is read and dropped
            self._lingering += len(data)
            if self._lingering > LINGER_MAX_BYTES and self.transport is not None:
                self.transport.close()
            return
        self._cancel_idle_timer()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(BadRequest(400, "protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            # What a callback raised arrives wrapped, the original as the context.
            cause = exc.__context__
            self._refuse(cause if isinstance(cause, BadRequest) else BadRequest(400, f"malformed request: {exc}"))
        if self._lingering < 0:
            self._arm_request_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_idle_timer()
        self._cancel_request_timer()
        self._cancel_head_timer()
        self.server.connections.discard(self)
        for exchange in (self.current, *self.waiting):
            if exchange is not None and not exchange.gone.done():
                exchange.gone.set_result(None)
        if self.paused and self.current is not None and self.current.on_resume is not None:
            self.current.on_resume()  # let the relay read to its end and see the client gone

    def pause_writing(self) -> None:
        self.paused = True
        if self.current is not None and self.current.on_pause is not None:
            self.current.on_pause()

    def resume_writing(self) -> None:
        self.paused = False
        if self.current is not None and self.current.on_resume is not None:
            self.current.on_resume()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._reset()
        self._in_message = True
        self._cancel_head_timer()
        if not self.lost:
            self._head_timer = self.loop.call_later(self.settings.head_timeout_seconds, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value
        self._count_head(len(name) + len(value))

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > self.settings.max_head_bytes:
            raise BadRequest(431, f"the request line and headers are over {self.settings.max_head_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        declared = self._headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            # Refused at once, as the worker does: waiting for a 100 GB body
            # that is never sent would only end in a 408.
            raise BadRequest(
                413, f"the request body is over {self.settings.max_body_bytes} bytes.", code="request_too_large"
            )
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._size += len(body)
        if self._size > self.settings.max_body_bytes:
            self._too_large = True
            self._body = []
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        parser = self.parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        exchange = Exchange(
            self,
            parser.get_method().decode("latin-1"),
            self._url,
            self._headers,
            body,
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
        )
        if self._too_large:
            exchange.keep_alive = False  # the rest of a refused body may still be on its way
            exchange.too_large, exchange.body = True, b""
        self._reset()
        if self.current is None:
            self._run(exchange)
        else:
            self.waiting.append(exchange)
            if self.transport is not None and len(self.waiting) > 16:
                self.transport.pause_reading()  # a client pipelining without reading its answers

    # -- requests
    def _run(self, exchange: Exchange) -> None:
        self.current = exchange
        self.server.in_flight += 1
        if exchange.too_large:
            _too_large(exchange, self.settings.max_body_bytes)
            return
        try:
            rest = self.server.handler(exchange)
        except Exception:  # noqa: BLE001 - one request's bug must not take the connection's others with it
            self._failed(exchange)
            rest = None
        if rest is None:
            self._close_out(exchange)
        else:
            self.loop.create_task(self._handle(exchange, rest))

    async def _handle(self, exchange: Exchange, rest: Awaitable[None]) -> None:
        try:
            await rest
        except Exception:  # noqa: BLE001 - as above
            self._failed(exchange)
        finally:
            self._close_out(exchange)

    def _failed(self, exchange: Exchange) -> None:
        log.exception("the gateway failed on %s %s", exchange.method, exchange.path)
        if not exchange.started and not self.lost:
            exchange.keep_alive = False
            exchange.reply(
                500,
                [(b"content-type", b"application/json")],
                ApiError("internal error", status=500, type="server_error", code="internal_error").encode(),
            )

    def _close_out(self, exchange: Exchange) -> None:
        """The handler is done: a response it left unfinished is ended here."""
        if not exchange.ended:
            if exchange.started and not self.lost:
                exchange.keep_alive = False  # a stream cut short: the client sees the connection end
                exchange.end()
            else:
                exchange.ended = True
                self.finished(exchange)

    def write(self, data: bytes) -> None:
        if not self.lost and self.transport is not None:
            self.transport.write(data)

    def finished(self, exchange: Exchange) -> None:
        """The response is written: the next request, an idle wait, or the end."""
        if exchange is not self.current:
            return
        self.current = None
        self.server.in_flight -= 1
        if self.lost or self.transport is None:
            return
        if not exchange.keep_alive or self.server.stopping:
            self.transport.close()
            return
        if self.waiting:
            if len(self.waiting) <= 16:
                self.transport.resume_reading()
            self._run(self.waiting.popleft())
        else:
            self._arm_idle_timer()

    def _refuse(self, error: BadRequest) -> None:
        if self.transport is None or self.lost:
            return
        if self.current is None:
            body = ApiError(str(error), status=error.status, code=error.code).encode()
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (error.status, _reason(error.status), len(body), body)
            )
            if self.transport.can_write_eof():
                self._linger(self.transport)
                return
        self.transport.close()

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after a refusal as nginx's lingering close does: send the
        reply and our end of the stream, then read and drop what the client
        is still sending for a moment. Closing at once with its unread bytes
        (the rest of a 200 KB URL) makes the kernel answer with a reset,
        which can destroy the reply before the client reads it."""
        self._cancel_idle_timer()
        self._cancel_request_timer()
        self._cancel_head_timer()
        self._lingering = 0
        transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, transport.close)

    def close_if_idle(self) -> None:
        if self.current is None and self.transport is not None:
            self.transport.close()

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        if self.transport is not None:
            self._idle_timer = self.loop.call_later(self.settings.keep_alive_seconds, self.close_if_idle)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    # A request that stops arriving: without this, a client that declares a
    # body and never sends it holds its connection (and a slot) until it leaves.
    def _arm_request_timer(self) -> None:
        """After each read: a request left incomplete must continue in time."""
        self._cancel_request_timer()
        if self._in_message and not self.lost and self.transport is not None:
            self._request_timer = self.loop.call_later(self.settings.body_timeout_seconds, self._request_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse(
            BadRequest(408, f"the request's head did not arrive in full within {self.settings.head_timeout_seconds:g}s")
        )

    def _cancel_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if not self._in_message:
            return
        if self.current is not None:  # a pipelined request's tail: judged once the one before is answered
            self._arm_request_timer()
            return
        self._refuse(
            BadRequest(
                408,
                f"the request did not arrive in full: nothing more of it came for "
                f"{self.settings.body_timeout_seconds:g}s",
            )
        )


def _too_large(exchange: Exchange, limit: int) -> None:
    exchange.reply(
        413,
        [(b"content-type", b"application/json")],
        ApiError(f"the request body is over {limit} bytes.", status=413, code="request_too_large").encode(),
    )


class _Server:
    def __init__(self, handler: Handler, settings: ServerSettings, loop: asyncio.AbstractEventLoop):
        self.handler = handler
        self.settings = settings
        self.loop = loop
        self.connections: set[_HttpProtocol] = set()
        self.in_flight = 0
        self.stopping = False


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    settings: ServerSettings | None = None,
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve until ``stop`` is set (SIGTERM and SIGINT set it), then shut down gracefully."""
    loop = asyncio.get_running_loop()
    settings = settings or ServerSettings()
    state = _Server(handler, settings, loop)
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signum, stop.set)
    if startup is not None:
        await startup()
    listener = await loop.create_server(
        lambda: _HttpProtocol(state), host, port, backlog=settings.backlog, reuse_address=True
    )
    try:
        if ready is not None:
            ready()
        await stop.wait()
    finally:
        state.stopping = True
        listener.close()
        for conn in list(state.connections):
            conn.close_if_idle()
        deadline = loop.time() + settings.grace_seconds
        while state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(state.connections):
            if conn.transport is not None:
                conn.transport.close()
        with contextlib.suppress(Exception):
            await listener.wait_closed()
        if shutdown is not None:
            await shutdown()
