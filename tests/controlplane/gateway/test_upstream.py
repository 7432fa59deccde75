"""The gateway's client to workers (``controlplane.gateway.upstream.Upstream``)
against a raw socket server written here, so that each test sets exactly
what the "worker" sends and when: piping a body as it arrives, a body that
breaks off, back-pressure, a kept-alive connection the worker had closed, and
``on_head`` running before the caller resumes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from controlplane.gateway.upstream import Upstream, UpstreamBroken, UpstreamResponse
from tests.controlplane.gateway.raw import HEAD, chunk, read_request, worker


def run(test: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(test())  # type: ignore[arg-type]


def test_a_piped_body_arrives_as_sent_and_the_connection_is_reused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: one response per request
            body = await read_request(reader)
            writer.write(HEAD + chunk(b"first:" + body))  # the head and the first bytes together
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(chunk(b"second") + b"0\r\n\r\n")

    async def test() -> None:
        async with worker(script) as (url, accepted):
            client = Upstream()
            for n in range(2):
                got: list[bytes] = []
                response = await client.send(url, [], b"req%d" % n)
                assert response.status == 200
                done = response.pipe(got.append)
                assert got == [b"first:req%d" % n]  # what came with the head is handed over at once
                assert await asyncio.wait_for(done, 5) is True
                assert got == [b"first:req%d" % n, b"second"]
                await response.close()
            assert accepted[0] == 1
            await client.close()

    run(test)


def test_on_head_takes_the_stream_up_before_the_caller_resumes() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(b"token") + b"0\r\n\r\n")

    async def test() -> None:
        async with worker(script) as (url, _):
            client = Upstream()
            got: list[bytes] = []
            taken: list[asyncio.Future[bool]] = []

            def on_head(response: UpstreamResponse) -> bool:
                taken.append(response.pipe(got.append))
                return True

            response = await client.start(url, [], b"{}", on_head=on_head).response()
            assert response.status == 200 and got == [b"token"] and taken[0].done()
            await response.close()
            await client.close()

    run(test)


def test_a_body_that_breaks_off_fails_the_pipe_with_upstream_broken() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(b"partial"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # no terminating chunk

    async def test() -> None:
        async with worker(script) as (url, _):
            client = Upstream()
            got: list[bytes] = []
            response = await client.send(url, [], b"{}")
            with pytest.raises(UpstreamBroken):
                await asyncio.wait_for(response.pipe(got.append), 5)
            assert got == [b"partial"]
            await response.close()
            await client.close()

    run(test)


def test_pause_stops_the_reads_from_the_worker_until_resume() -> None:
    sent = [0]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD)
        for _ in range(2000):  # 128 MB offered: far more than the socket buffers hold
            writer.write(chunk(b"x" * 65536))
            await writer.drain()
            sent[0] += 1
        writer.write(b"0\r\n\r\n")

    async def test() -> None:
        async with worker(script) as (url, _):
            client = Upstream()
            received = [0]
            response = await client.send(url, [], b"{}")
            done = response.pipe(lambda data: received.__setitem__(0, received[0] + len(data)))
            response.pause()
            await asyncio.sleep(0.3)
            at_pause, sent_at_pause = received[0], sent[0]
            await asyncio.sleep(0.3)
            assert received[0] == at_pause  # nothing read while paused...
            assert sent[0] == sent_at_pause < 2000  # ...so the worker is held up too
            response.resume()
            assert await asyncio.wait_for(done, 30) is True
            assert received[0] == 2000 * 65536
            await response.close()
            await client.close()

    run(test)


def test_a_kept_alive_connection_the_worker_closed_is_replaced_without_an_error() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Says keep-alive, then closes as soon as the reply is out: the next
        # request the client writes on it finds it gone.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def test() -> None:
        async with worker(script) as (url, accepted):
            client = Upstream()
            for _ in range(3):
                response = await client.send(url, [], b"{}")
                assert (response.status, await response.read()) == (200, b"ok")
                # Back to back: the next write may go out before the close is
                # seen (a stale connection, retried on a fresh one) or after
                # (skipped); either way the caller sees no error.
            assert accepted[0] == 3
            await client.close()

    run(test)
