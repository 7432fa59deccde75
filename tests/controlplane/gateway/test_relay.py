"""The gateway's stream relay in one process: ``Gateway.handle`` served by
``server.serve`` in front of a raw socket "worker" written here, so each test
sets exactly when the worker's bytes arrive. What is checked is what the
request log is told (``RequestRecord``) when a client leaves early."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable

import uvloop

from controlplane.accounts.secrets import hash_secret
from controlplane.fleet.pools import PoolRole
from controlplane.gateway.proxy import Gateway
from controlplane.gateway.record import RequestRecord
from controlplane.gateway.server import serve
from controlplane.gateway.state import (
    ClientKeyInfo,
    GatewayState,
    PoolTarget,
    StateHolder,
    WorkerTarget,
    build_table,
)
from tests.controlplane.gateway.raw import HEAD, chunk, read_request, worker
from tests.support import free_port

KEY = "sk-relay-test"
EVENT = b'data: {"choices":[{"index":0,"text":" hi","finish_reason":null}]}\n\n'


@contextlib.asynccontextmanager
async def gateway_before(worker_url: str) -> AsyncIterator[tuple[int, list[RequestRecord]]]:
    base = worker_url.removesuffix("/v1/completions")
    pool = PoolTarget(1, "p", PoolRole.STABLE, 10000, (WorkerTarget(1, "w", base, 1, None),))
    state = GatewayState(
        tables={"m": build_table(id=1, model="m", salt="s", epoch=1, pools=[pool])},
        keys={hash_secret(KEY): ClientKeyInfo(1, False)},
        loaded_at=time.monotonic(),
    )
    records: list[RequestRecord] = []
    gw = Gateway(StateHolder(state), record=records.append)
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


async def stream_until(port: int, marker: bytes) -> None:
    """A client that asks for a stream, reads until ``marker``, and hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"model": "m", "prompt": "hi", "stream": true}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
        + KEY.encode()
        + b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await asyncio.wait_for(reader.readuntil(marker), 10)
    writer.close()


def slow_to_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Awaitable[None]:
    """Two token events, then [DONE], and only a second later the chunked body's end."""

    async def script() -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(EVENT))
        await asyncio.sleep(0.05)
        writer.write(chunk(EVENT + b"data: [DONE]\n\n"))
        await asyncio.sleep(1.0)
        writer.write(b"0\r\n\r\n")
        await asyncio.sleep(1.0)

    return script()


def run_case(marker: bytes) -> RequestRecord:
    async def test() -> RequestRecord:
        async with worker(slow_to_close) as (url, _), gateway_before(url) as (port, records):
            await stream_until(port, marker)
            for _ in range(200):
                if records:
                    return records[0]
                await asyncio.sleep(0.01)
            raise AssertionError("no request record")

    return uvloop.run(test())  # type: ignore[no-any-return]


def test_a_client_that_hangs_up_after_done_is_logged_as_a_complete_request() -> None:
    rec = run_case(b"data: [DONE]\n\n")
    assert (rec.status, rec.error) == (200, "")
    assert rec.output_tokens == 2 and rec.ttft_seconds is not None
    assert rec.e2e_seconds is not None and rec.e2e_seconds < 0.9  # not held until the worker's last bytes


def test_a_client_that_hangs_up_before_done_is_logged_as_gone() -> None:
    rec = run_case(b" hi")
    assert (rec.status, rec.error) == (499, "the client went away mid-stream")
