"""The gateway's HTTP/1.1 server (``controlplane.gateway.server``) on a real
socket, spoken to byte by byte: keep-alive and pipelining, bodies over the
limit, malformed requests, chunked and close-delimited streams, the
client's going away, back-pressure, a handler that fails, and shutdown.
No Django, no database: a handler written here stands in for the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvloop

from controlplane.gateway.server import Exchange, ServerSettings, serve
from tests.support import free_port, wait_until_async

JSON = [(b"content-type", b"application/json")]


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[Exchange], Awaitable[None] | None], **settings: Any
) -> AsyncIterator[dict[str, Any]]:
    """Runs ``serve`` on a free port until the block ends; yields what the test may look at."""
    port = free_port()
    stop = asyncio.Event()
    up = asyncio.Event()
    seen: dict[str, Any] = {"port": port, "stop": stop, "shutdown_ran": False}

    async def shutdown() -> None:
        seen["shutdown_ran"] = True

    task = asyncio.ensure_future(
        serve(
            handler, "127.0.0.1", port, settings=ServerSettings(**settings), shutdown=shutdown, stop=stop, ready=up.set
        )
    )
    await asyncio.wait_for(up.wait(), 10)
    seen["task"] = task
    try:
        yield seen
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response: status, headers, and the body (content-length, chunked, or to EOF)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:] if line)
    if status == 100:
        return status, headers, b""
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await asyncio.wait_for(reader.read(), 10)


def post(path: str, body: bytes, *extra: bytes, version: bytes = b"1.1") -> bytes:
    return (
        b"POST "
        + path.encode()
        + b" HTTP/"
        + version
        + b"\r\nhost: x\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n"
        + b"".join(h + b"\r\n" for h in extra)
        + b"\r\n"
        + body
    )


def echo(ex: Exchange) -> None:
    """Answers at once, from the read callback: the method, path and body back."""
    ex.reply(200, JSON, b"%s %s %s" % (ex.method.encode(), ex.path.encode(), ex.body))


def run(test: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(test())  # type: ignore[arg-type]


def test_keep_alive_and_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    def handler(ex: Exchange) -> Awaitable[None] | None:
        if ex.path == "/slow":

            async def later() -> None:
                await asyncio.sleep(0.05)  # the next request waits for this answer
                echo(ex)

            return later()
        echo(ex)
        return None

    async def test() -> None:
        async with serving(handler) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/a", b"1"))
            assert (await read_response(reader))[2] == b"POST /a 1"
            writer.write(post("/slow", b"2") + post("/b", b"3") + post("/c", b"4"))  # pipelined
            assert [(await read_response(reader))[2] for _ in range(3)] == [b"POST /slow 2", b"POST /b 3", b"POST /c 4"]
            writer.close()

    run(test)


def test_a_body_over_the_limit_gets_413_and_the_connection_is_closed() -> None:
    async def test() -> None:
        async with serving(echo, max_body_bytes=100) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/v1/completions", b"x" * 101))
            status, headers, body = await read_response(reader)
            assert status == 413 and headers[b"connection"] == b"close"
            assert b"request_too_large" in body
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
            # At the limit is fine.
            reader, writer = await connect(srv["port"])
            writer.write(post("/ok", b"x" * 100))
            assert (await read_response(reader))[0] == 200

    run(test)


def test_headers_over_the_limit_get_431_and_the_connection_is_closed() -> None:
    async def test() -> None:
        async with serving(echo, max_head_bytes=1024) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/a", b"", *[b"x-filler-%d: %s" % (i, b"y" * 100) for i in range(20)]))
            status, _, body = await read_response(reader)
            assert status == 431 and b"over 1024 bytes" in body
            assert await asyncio.wait_for(reader.read(), 5) == b""

    run(test)


def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async def test() -> None:
        async with serving(echo) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n")
            assert (await read_response(reader))[0] == 100
            writer.write(b"hello")
            assert (await read_response(reader))[2] == b"POST /e hello"

    run(test)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n", 400),
        (b"GET /v1/models?q=" + b"a" * 210_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n", 431),  # a URL over 200 KB
    ],
    ids=["request-line", "header", "url-over-200kb"],
)
def test_a_malformed_request_gets_a_json_error_in_openais_shape_and_the_connection_closes(
    head: bytes, status: int
) -> None:
    async def test() -> None:
        async with serving(echo) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(head)
            got, headers, body = await read_response(reader)
            assert (got, headers[b"content-type"]) == (status, b"application/json")
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
            assert await asyncio.wait_for(reader.read(), 5) == b""

    run(test)


def stream_three(ex: Exchange) -> Awaitable[None]:
    async def rest() -> None:
        ex.start(200, [(b"content-type", b"text/event-stream")], b"data: 1\n\n")
        for n in (2, 3):
            await asyncio.sleep(0.01)
            ex.write(b"data: %d\n\n" % n)
        ex.end()

    return rest()


def test_a_stream_is_chunked_on_http_11_and_kept_alive() -> None:
    async def test() -> None:
        async with serving(stream_three) as srv:
            reader, writer = await connect(srv["port"])
            for _ in range(2):  # the connection survives the stream
                writer.write(post("/s", b""))
                status, headers, body = await read_response(reader)
                assert status == 200 and headers[b"transfer-encoding"] == b"chunked"
                assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"

    run(test)


def test_a_stream_to_an_http_10_client_ends_with_the_connection() -> None:
    async def test() -> None:
        async with serving(stream_three) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/s", b"", version=b"1.0"))
            status, headers, body = await read_response(reader)
            assert status == 200 and b"transfer-encoding" not in headers and headers[b"connection"] == b"close"
            assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"

    run(test)


def test_the_client_going_away_completes_the_exchanges_gone_future() -> None:
    noticed = asyncio.Event()

    def handler(ex: Exchange) -> Awaitable[None]:
        async def wait() -> None:
            ex.start(200, [], b"first")
            await asyncio.wait_for(ex.gone, 5)
            noticed.set()
            ex.write(b"after")  # to a closed connection: dropped, no error

        return wait()

    async def test() -> None:
        async with serving(handler) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/s", b""))
            await reader.readuntil(b"first")
            writer.close()
            await asyncio.wait_for(noticed.wait(), 5)

    run(test)


def test_a_client_that_does_not_read_pauses_the_handler_and_resumes_it_when_it_does() -> None:
    events: list[str] = []

    def handler(ex: Exchange) -> Awaitable[None]:
        resumed = asyncio.Event()
        ex.on_pause = lambda: events.append("pause")

        def on_resume() -> None:
            events.append("resume")
            resumed.set()

        ex.on_resume = on_resume

        async def flood() -> None:
            ex.start(200, [])
            while "pause" not in events:  # a relay writes until told the client is full
                ex.write(b"x" * 65536)
                await asyncio.sleep(0)
            await asyncio.wait_for(resumed.wait(), 10)
            ex.end()

        return flood()

    async def test() -> None:
        async with serving(handler, write_high_water=1 << 16) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/flood", b""))
            # Reading nothing meanwhile: the server must tell the handler to stop writing.
            await wait_until_async(lambda: events, 10, "the server to pause the flooding handler")
            assert events == ["pause"]
            status, _, body = await read_response(reader)  # now read it all
            assert status == 200 and len(body) >= 1 << 16
            assert events == ["pause", "resume"]

    run(test)


def test_a_failing_handler_gets_a_500_and_the_server_keeps_serving() -> None:
    def handler(ex: Exchange) -> Awaitable[None] | None:
        if ex.path == "/boom":
            raise RuntimeError("a bug")
        if ex.path == "/boom-later":

            async def later() -> None:
                await asyncio.sleep(0)
                raise RuntimeError("a later bug")

            return later()
        echo(ex)
        return None

    async def test() -> None:
        async with serving(handler) as srv:
            for path in ("/boom", "/boom-later"):
                reader, writer = await connect(srv["port"])
                writer.write(post(path, b""))
                status, _, body = await read_response(reader)
                assert status == 500 and b"internal_error" in body and b"a bug" not in body
            reader, writer = await connect(srv["port"])
            writer.write(post("/fine", b"ok"))
            assert (await read_response(reader))[2] == b"POST /fine ok"

    run(test)


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout() -> None:
    async def test() -> None:
        async with serving(echo, keep_alive_seconds=0.2) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/a", b""))
            await read_response(reader)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server, not by us

    run(test)


def test_a_client_that_declares_a_body_and_does_not_send_it_gets_408_and_the_connection_closes() -> None:
    """It held the connection for over 40 s: now the rest must come within
    ``body_timeout_seconds`` of the last byte."""

    async def test() -> None:
        async with serving(echo, body_timeout_seconds=0.3) as srv:
            for partial in (
                post("/v1/completions", b"x" * 100)[:-90],  # 10 of the 100 bytes declared
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",
            ):  # the head, unfinished
                reader, writer = await connect(srv["port"])
                writer.write(partial)
                status, headers, body = await read_response(reader)
                assert status == 408 and headers[b"connection"] == b"close"
                assert b"did not arrive in full" in body
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
            # A body that keeps coming, each part within the timeout, is served whole.
            reader, writer = await connect(srv["port"])
            request = post("/slow", b"y" * 30)
            for i in range(0, len(request), 20):
                writer.write(request[i : i + 20])
                await asyncio.sleep(0.1)
            assert (await read_response(reader))[2] == b"POST /slow " + b"y" * 30
            # An idle kept-alive connection between requests is the keep-alive timeout's, not this one's.
            await asyncio.sleep(0.5)
            writer.write(post("/again", b"z"))
            assert (await read_response(reader))[2] == b"POST /again z"

    run(test)


def test_a_head_that_trickles_in_past_the_head_deadline_gets_408() -> None:
    """One header line every so often, each within the gap timeout, held a
    connection for good (3,000 of them, one line every 8 s): the whole head
    now has a deadline of its own, as nginx's client_header_timeout."""

    async def test() -> None:
        async with serving(echo, body_timeout_seconds=0.4, head_timeout_seconds=0.6) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(b"POST /v1/completions HTTP/1.1\r\n")
            replies: list[tuple[int, dict[bytes, bytes], bytes]] = []

            async def read() -> None:
                replies.append(await read_response(reader))

            reading = asyncio.ensure_future(read())
            for i in range(10):  # a line every 0.2 s: never 0.4 s without a byte
                await asyncio.sleep(0.2)
                if reading.done():
                    break
                writer.write(b"x-line-%d: y\r\n" % i)
            await asyncio.wait_for(reading, 5)
            status, headers, body = replies[0]
            assert status == 408 and headers[b"connection"] == b"close"
            assert b"head did not arrive in full" in body
            # A head that arrives in time is served.
            reader, writer = await connect(srv["port"])
            writer.write(post("/ok", b"x"))
            assert (await read_response(reader))[0] == 200

    run(test)


def test_a_declared_body_over_the_limit_is_refused_at_once_without_waiting_for_it() -> None:
    async def test() -> None:
        async with serving(echo, max_body_bytes=100, body_timeout_seconds=30) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000000\r\n\r\n")
            status, headers, body = await asyncio.wait_for(read_response(reader), 5)  # not the 30 s body timeout
            assert status == 413 and headers[b"connection"] == b"close"
            assert b"request_too_large" in body

    run(test)


def test_shutdown_lets_the_request_in_flight_finish_then_runs_the_hook() -> None:
    in_flight = asyncio.Event()

    def handler(ex: Exchange) -> Awaitable[None]:
        async def slow() -> None:
            in_flight.set()
            await asyncio.sleep(0.3)
            echo(ex)

        return slow()

    async def test() -> None:
        async with serving(handler) as srv:
            reader, writer = await connect(srv["port"])
            writer.write(post("/slow", b"1"))
            await asyncio.wait_for(in_flight.wait(), 10)
            srv["stop"].set()  # while the request is in flight
            status, headers, body = await read_response(reader)
            assert (status, body) == (200, b"POST /slow 1")
            await asyncio.wait_for(srv["task"], 5)
            assert srv["shutdown_ran"]
            try:  # no longer listening
                await connect(srv["port"])
                raise AssertionError("the server still accepts connections")
            except OSError:
                pass

    run(test)
