"""Calls to workers: one streaming HTTP/1.1 request per attempt, over pooled
keep-alive connections.

``send`` returns once the worker's status line and headers are in; any
failure until then is ``UpstreamUnavailable``, which the proxy may retry on
another worker because the client has seen nothing yet. Failures after that
(``UpstreamBroken``) end the client's response.

``Upstream`` implements it: a small asyncio
protocol around httptools' C parser (the one uvicorn uses): a connection per
request in flight, kept alive in a per-worker idle list, body chunks handed
over as they arrive with flow control, either awaited (``next_chunk``) or
piped (``pipe``: each chunk goes to a callback from the socket's own read
callback, which is how the gateway relays streams without waking a task per
event; ``pause``/``resume`` carry the client's back-pressure to the worker's
socket). Profiling the gateway at 32 concurrent requests over httpx's
AsyncClient showed httpcore's pool scanning every pooled connection, with a
poll() system call each, on every request, and more time in the client than
in all the rest of the gateway; ``manage.py bench_gateway --client httpx``
reproduces the comparison (the httpx client is the benchmark's,
``controlplane/bench/upstream.py``).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools


class UpstreamUnavailable(Exception):
    """No response head from the worker: refused, reset, timed out."""


class UpstreamBroken(Exception):
    """The worker's response broke off after it began."""


class UpstreamTimedOut(Exception):
    """The request reached the worker, which sent no response head within
    the read timeout: a hung engine, or this request hanging it. Never retried
    on another worker (it may be the request that hangs them)."""


@dataclass(frozen=True)
class UpstreamTimeouts:
    connect_seconds: float = 2.0
    # The longest a worker may take to send its response head, and the longest
    # gap while a whole (not piped) body is read; None: no limit. A worker
    # sends its head with the first token (a stream) or with the whole reply,
    # so this bounds prefill, or generation, plus queueing: generous. A piped
    # stream's gaps are the relay's to judge.
    read_seconds: float | None = None


class UpstreamResponse(Protocol):
    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> list[tuple[bytes, bytes]]: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call; None at the end."""

    def pipe(self, on_data: Callable[[bytes], None]) -> asyncio.Future[bool]:
        """Hands the body to ``on_data`` as it arrives, starting with what
        arrived already; the future is True at the body's end and raises
        ``UpstreamBroken`` if it breaks off."""

    def pause(self) -> None:
        """Stop reading from the worker until ``resume``."""

    def resume(self) -> None: ...

    async def read(self) -> bytes: ...

    async def close(self) -> None: ...


OnHead = Callable[[UpstreamResponse], bool]


class PendingResponse(Protocol):
    async def response(self) -> UpstreamResponse:
        """The response, once its head is in."""


class UpstreamClient(Protocol):
    def start(
        self, url: str, headers: list[tuple[bytes, bytes]], body: bytes, *, on_head: OnHead | None = None
    ) -> PendingResponse:
        """Sends the request: at once when an idle connection to the worker
        is at hand (the native client), else from ``response()``. ``on_head``
        is called with the response as soon as its head is read, before
        ``response()``'s caller resumes (from the socket's callback, in the
        native client): that is where a relay takes up a stream without
        waiting for a task to be scheduled."""

    async def send(self, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """``start`` and ``response`` in one."""

    async def close(self) -> None: ...


# ---- the native client -----------------------------------------------------------------
# Body bytes held for a slow client before the worker's socket stops being read.
HIGH_WATER_BYTES = 1 << 20
LOW_WATER_BYTES = 1 << 16


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.in_flight = False  # a request was written and its response is not done
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] = self.loop.create_future()
        self.body: collections.deque[bytes] = collections.deque()
        self.num_buffered = 0
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._on_data: Callable[[bytes], None] | None = None
        self._piped: asyncio.Future[bool] | None = None
        self._on_head: Callable[[], object] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"unparseable reply: {exc}")
            if self.transport is not None:
                self.transport.close()
        # After the whole read is parsed, so the body that came with the head is here too.
        if self._on_head is not None and self.head.done() and not self.head.exception():
            on_head, self._on_head = self._on_head, None
            try:
                on_head()
            except Exception as exc:  # noqa: BLE001 - the pipe's owner sees it from its future
                self._end_pipe(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(f"connection closed by the worker ({exc or 'EOF'})")

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._on_data is not None:
            try:
                self._on_data(body)
            except Exception as exc:  # noqa: BLE001 - the pipe's owner sees it from its future
                self._end_pipe(exc)
            return
        self.body.append(body)
        self.num_buffered += len(body)
        if self.num_buffered > HIGH_WATER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        # Asked now: once this callback returns, the parser has moved on.
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._end_pipe(None)
        self._wake()

    # -- for the client
    def _fail(self, message: str) -> None:
        if not self.in_flight:
            return  # an idle connection closing: nobody waits on it
        if not self.head.done():
            self.head.set_exception(UpstreamUnavailable(message))
        elif self.error is None and not self.complete:
            self.error = UpstreamBroken(message)
            self._end_pipe(self.error)
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end_pipe(self, error: Exception | None) -> None:
        piped = self._piped
        if piped is None or piped.done():
            return
        self._on_data = None
        if error is None:
            piped.set_result(True)
        else:
            piped.set_exception(error)
            if self.transport is not None and not self.complete:
                self.transport.close()

    def _take_body(self) -> bytes:
        chunk = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.num_buffered = 0
        if self.paused:
            self.resume()
        return chunk

    def pipe(self, on_data: Callable[[bytes], None]) -> asyncio.Future[bool]:
        self._piped = piped = self.loop.create_future()
        if self.body:
            on_data(self._take_body())
        if self.complete:
            piped.set_result(True)
        elif self.error is not None:
            piped.set_exception(self.error)
        else:
            self._on_data = on_data
        return piped

    def abandon(self) -> None:
        """Closed before the body's end: the worker sees the request aborted."""
        if self._piped is not None and not self._piped.done():
            self._piped.cancel()  # nobody waits on it any more
        self._on_data = None
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            if not self.closed:
                self.transport.resume_reading()

    async def next_chunk(self, timeout_seconds: float | None = None) -> bytes | None:
        """The body bytes that arrived since the last call (joined), or None
        at the end; ``UpstreamBroken`` when nothing arrives for ``timeout_seconds``."""
        while True:
            if self.body:
                return self._take_body()
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self._waiter = waiter = self.loop.create_future()
            timer = (
                None
                if timeout_seconds is None
                else self.loop.call_later(timeout_seconds, self._read_timed_out, waiter, timeout_seconds)
            )
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def _read_timed_out(self, waiter: asyncio.Future[None], timeout_seconds: float) -> None:
        if waiter.done() or self.error is not None or self.complete:
            return
        self._fail(f"the worker sent nothing for {timeout_seconds:g}s")
        if self.transport is not None:
            self.transport.close()  # the worker sees the request aborted

    def _head_timed_out(self, timeout_seconds: float) -> None:
        if not self.head.done():
            self.head.set_exception(UpstreamTimedOut(f"no response head from the worker within {timeout_seconds:g}s"))
            self.in_flight = False  # its head will not come now: the closing below fails nobody else
            if self.transport is not None:
                self.transport.close()  # the worker sees the request aborted


class _Response:
    def __init__(self, client: Upstream, key: tuple[str, int, bool], conn: _Connection):
        self._client, self._key, self._conn = client, key, conn
        self._done = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    def _head_in(self) -> _Response:
        """Keeps the head: the connection forgets it once it is reused."""
        self.status, self.headers = self._conn.status, self._conn.headers
        return self

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def next_chunk(self) -> bytes | None:
        chunk = await self._conn.next_chunk(self._client.timeouts.read_seconds)
        if chunk is None:
            self._finish()
        return chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def pipe(self, on_data: Callable[[bytes], None]) -> asyncio.Future[bool]:
        return self._conn.pipe(on_data)

    def pause(self) -> None:
        self._conn.pause()

    def resume(self) -> None:
        self._conn.resume()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._client._release(self._key, self._conn)

    async def close(self) -> None:
        """Done with it: a response not read to the end closes its connection,
        which is how the worker learns to abort the request."""
        if not self._done:
            self._done = True
            if self._conn.complete:
                self._client._release(self._key, self._conn)
            else:
                self._conn.abandon()


class Upstream:
    """The native client (see the module's note)."""

    def __init__(self, timeouts: UpstreamTimeouts | None = None, *, max_idle_per_worker: int = 512):
        self.timeouts = timeouts or UpstreamTimeouts()
        self.max_idle_per_worker = max_idle_per_worker
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = collections.defaultdict(list)
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target(self, url: str) -> tuple[tuple[str, int, bool], bytes, bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamUnavailable(f"not an http(s) URL: {url!r}")
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            target = ((parts.hostname, port, tls), parts.netloc.encode(), path.encode())
            if len(self._targets) < 10_000:
                self._targets[url] = target
        return target

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), host, port, ssl=self._ssl if tls else None),
                self.timeouts.connect_seconds,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"cannot connect to {host}:{port}: {exc or type(exc).__name__}") from exc
        return conn

    def _take_idle(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _release(self, key: tuple[str, int, bool], conn: _Connection) -> None:
        idle = self._idle[key]
        if conn.closed or not conn.keep_alive or len(idle) >= self.max_idle_per_worker:
            if conn.transport is not None:
                conn.transport.close()
            return
        conn._begin()
        conn.reused = True
        conn.in_flight = False
        idle.append(conn)

    def start(
        self, url: str, headers: list[tuple[bytes, bytes]], body: bytes, *, on_head: OnHead | None = None
    ) -> _Pending:
        return _Pending(self, url, headers, body, on_head)

    async def send(self, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> _Response:
        return await self.start(url, headers, body).response()

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()


class _Pending:
    """One request to a worker: written at once over an idle connection,
    else once ``response()`` has connected."""

    def __init__(
        self, client: Upstream, url: str, headers: list[tuple[bytes, bytes]], body: bytes, on_head: OnHead | None
    ):
        self._client, self._on_head = client, on_head
        self._error: UpstreamUnavailable | None = None
        self._conn: _Connection | None = None
        try:
            self._key, netloc, path = client._target(url)
        except UpstreamUnavailable as exc:
            self._error = exc
            return
        self._head = b"".join(
            [
                b"POST ",
                path,
                b" HTTP/1.1\r\nhost: ",
                netloc,
                b"\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\n",
                *[name + b": " + value + b"\r\n" for name, value in headers],
                b"\r\n",
            ]
        )
        self._body = body
        conn = client._take_idle(self._key)
        if conn is not None:
            self._write(conn)

    def _write(self, conn: _Connection) -> None:
        assert conn.transport is not None
        self._conn = conn
        conn.in_flight = True
        self._response = response = _Response(self._client, self._key, conn)
        on_head = self._on_head
        if on_head is not None:
            conn._on_head = lambda: on_head(response._head_in())
        body = self._body
        if len(body) < 65536:
            conn.transport.write(self._head + body)
        else:
            conn.transport.write(self._head)
            conn.transport.write(body)

    async def response(self) -> _Response:
        if self._error is not None:
            raise self._error
        while True:
            conn = self._conn
            if conn is None:
                self._write(await self._client._connect(self._key))
                conn = self._conn
                assert conn is not None
            read_seconds = self._client.timeouts.read_seconds
            timer = (
                None if read_seconds is None else conn.loop.call_later(read_seconds, conn._head_timed_out, read_seconds)
            )
            try:
                await conn.head
            except UpstreamUnavailable:
                if conn.transport is not None:
                    conn.transport.close()
                if conn.reused and not conn.received:
                    # The worker had closed the idle connection: nothing was sent; try a fresh one.
                    self._conn = self._client._take_idle(self._key)
                    if self._conn is not None:
                        self._write(self._conn)
                    continue
                raise
            except asyncio.CancelledError:
                if conn.transport is not None:
                    conn.transport.close()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            return self._response._head_in()
