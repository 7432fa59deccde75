"""A raw socket "worker" for the gateway's in-process tests: each test's
script decides exactly what is sent and when."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from tests.support import free_port

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


@contextlib.asynccontextmanager
async def worker(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A server running ``script`` per connection; yields its URL and the
    number of connections it accepted (a one-element list)."""
    accepted = [0]

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await script(reader, writer)

    port = free_port()
    server = await asyncio.start_server(on_connection, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}/v1/completions", accepted
    finally:
        server.close()
