"""A raw socket "worker" for the gateway's in-process tests: each test's
script decides exactly what is sent and when; and ``gateway_before``, a
gateway in the same process (no Django, no database) in front of such workers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from controlplane.accounts.secrets import hash_secret
from controlplane.bench.upstream import CLIENTS
from controlplane.fleet.pools import PoolRole
from controlplane.gateway.proxy import Gateway
from controlplane.gateway.server import serve
from controlplane.gateway.state import (
    ClientKeyInfo,
    GatewayState,
    PoolTarget,
    StateHolder,
    WorkerTarget,
    build_table,
)
from controlplane.gateway.upstream import UpstreamTimeouts
from tests.support import free_port

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
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


def reply(status: int, body: bytes, *extra: bytes) -> bytes:
    """A whole response with a JSON body."""
    head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (status, len(body))
    return head + b"".join(h + b"\r\n" for h in extra) + b"\r\n" + body


def answering(response: bytes, seen: list[bytes] | None = None) -> Script:
    """A worker script: reads each request on the connection (kept in
    ``seen``) and sends ``response`` to it."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(reader)
            if seen is not None:
                seen.append(body)
            writer.write(response)
            await writer.drain()

    return script


KEY = "sk-raw-test"


@contextlib.asynccontextmanager
async def gateway_before(
    worker_urls: list[str],
    *,
    model: str = "m",
    key_cap: int | None = None,
    table_cap: int | None = None,
    read_seconds: float | None = None,
    client: str = "native",
) -> AsyncIterator[tuple[int, list[Any]]]:
    """``Gateway.handle`` served in this process in front of ``worker_urls``
    (one pool), with one client key (``KEY``), calling workers with the
    upstream ``client`` named (``controlplane.bench.upstream.CLIENTS``: the
    gateway's own or the benchmark's httpx); yields the port and the request
    records."""
    workers = tuple(
        WorkerTarget(i + 1, f"w{i}", url.removesuffix("/v1/completions"), 1, None) for i, url in enumerate(worker_urls)
    )
    pool = PoolTarget(1, "p", PoolRole.STABLE, 10000, workers)
    table = build_table(id=1, model=model, salt="s", epoch=1, pools=[pool], max_output_tokens=table_cap)
    state = GatewayState(
        tables={model: table}, keys={hash_secret(KEY): ClientKeyInfo(1, False, key_cap)}, loaded_at=time.monotonic()
    )
    records: list[Any] = []
    gw = Gateway(
        StateHolder(state),
        record=records.append,
        upstream_factory=lambda: CLIENTS[client](UpstreamTimeouts(connect_seconds=2, read_seconds=read_seconds)),
    )
    port, stop, up = free_port(), asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(
        serve(gw.handle, "127.0.0.1", port, startup=gw.startup, shutdown=gw.shutdown, stop=stop, ready=up.set)
    )
    await asyncio.wait_for(up.wait(), 10)
    try:
        yield port, records
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
