"""Which failures the gateway tries again on another worker, in one process:
``Gateway.handle`` in front of raw socket workers (``raw.py``) that answer
exactly what each test scripts, counting the connections each accepted.

Only a connection that fails before the worker's first byte, or the worker's
own refusal to admit the request, moves on; anything a worker says about a
request it took goes to the client, so one poisoned request cannot walk
across a pool."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
import uvloop

from tests.controlplane.gateway.raw import (
    KEY,
    answering,
    gateway_before,
    read_request,
    reply,
    worker,
)
from tests.support import free_port

ENGINE_FAILED = reply(
    503,
    b'{"error": {"message": "The engine failed: probability tensor contains nan", '
    b'"type": "service_unavailable", "code": "engine_error"}}',
    b"retry-after: 1",
)
BAD_PARAM = reply(
    400,
    b'{"error": {"message": "`temperature` must be finite.", "type": "invalid_request_error", '
    b'"param": "temperature", "code": null}}',
)
CRASHED = reply(500, b'{"error": {"message": "internal error", "type": "server_error", "code": null}}')
DRAINING = reply(
    503,
    b'{"error": {"message": "The worker is draining", "type": "service_unavailable", "code": "worker_draining"}}',
    b"retry-after: 1",
)
QUEUE_FULL = reply(
    429, b'{"error": {"message": "queue full", "type": "rate_limit_error", "code": "queue_full"}}', b"retry-after: 1"
)
OK = reply(
    200,
    b'{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " ok", '
    b'"finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}',
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def through_gateway(scripts: list[Script], *, stream: bool = False, **gateway: Any) -> tuple[httpx.Response, list[int]]:
    """One request through a gateway before one worker per script; the
    response and how many connections each worker accepted."""

    async def test() -> tuple[httpx.Response, list[int]]:
        async with AsyncExitStack() as stack:
            served = [await stack.enter_async_context(worker(script)) for script in scripts]
            port, _ = await stack.enter_async_context(gateway_before([url for url, _ in served], **gateway))
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "m", "prompt": "hi", "stream": stream},
                    headers={"authorization": f"Bearer {KEY}"},
                )
            return response, [accepted[0] for _, accepted in served]

    return uvloop.run(test())  # type: ignore[no-any-return]


def test_a_workers_4xx_about_the_requests_parameters_goes_to_the_client_and_no_other_worker_sees_it() -> None:
    for stream in (False, True):
        response, accepted = through_gateway([answering(BAD_PARAM)] * 3, stream=stream)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temperature"
        assert sum(accepted) == 1, accepted


@pytest.mark.parametrize("client", ["native", "httpx"])
def test_an_engine_that_failed_on_the_request_is_not_a_reason_to_try_the_next_worker(client: str) -> None:
    """The demo's two stable workers both died of one NaN temperature: the
    first answered 503 ``engine_error`` and the gateway sent it on."""
    for stream in (False, True):
        response, accepted = through_gateway([answering(ENGINE_FAILED)] * 3, stream=stream, client=client)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_error"
        assert sum(accepted) == 1, accepted
    response, accepted = through_gateway([answering(CRASHED)] * 3, client=client)
    assert response.status_code == 500 and sum(accepted) == 1


@pytest.mark.parametrize("client", ["native", "httpx"])
def test_a_whole_reply_that_breaks_off_is_a_502_and_not_sent_to_another_worker(client: str) -> None:
    async def breaks_off(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{"id"')
        await writer.drain()
        writer.close()

    response, accepted = through_gateway([breaks_off] * 3, client=client)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_broken"
    assert sum(accepted) == 1, accepted


@pytest.mark.parametrize("client", ["native", "httpx"])
def test_a_workers_refusal_to_admit_the_request_moves_it_to_the_next_worker(client: str) -> None:
    """Draining and a full queue are said before the request runs: safe to retry."""
    for refusal in (DRAINING, QUEUE_FULL):
        response, accepted = through_gateway([answering(refusal), answering(refusal), answering(OK)], client=client)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == " ok"
        assert accepted[2] == 1  # where the worker scan starts rotates: the refusers are passed 0-2 times
    # Every worker refusing: the client gets the last refusal, with its Retry-After.
    response, accepted = through_gateway([answering(DRAINING)] * 3, client=client)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "no_worker_available" and accepted == [1, 1, 1]


def test_a_refused_connection_moves_the_request_to_the_next_worker() -> None:
    async def test() -> tuple[int, int]:
        async with worker(answering(OK)) as (ok_url, accepted):
            dead = f"http://127.0.0.1:{free_port()}/v1/completions"  # nothing listens there
            async with gateway_before([dead, ok_url]) as (port, _), httpx.AsyncClient(timeout=10) as client:
                statuses = [
                    (
                        await client.post(
                            f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": "m", "prompt": "hi"},
                            headers={"authorization": f"Bearer {KEY}"},
                        )
                    ).status_code
                    for _ in range(4)
                ]
            return sum(s == 200 for s in statuses), accepted[0]

    num_ok, accepted = uvloop.run(test())
    assert num_ok == 4 and accepted >= 1


@pytest.mark.parametrize("client", ["native", "httpx"])
def test_a_worker_that_sends_no_head_within_the_read_timeout_gets_504_and_the_request_aborted(client: str) -> None:
    """A hung engine (``seed: 2**70`` hung one) held requests for minutes:
    with a read timeout the client hears 504, the worker sees the connection
    close, and no other worker is handed the request."""
    closed: list[bool] = []

    async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        closed.append(await reader.read(1) == b"")  # blocks until the gateway gives up and closes

    for stream in (False, True):
        closed.clear()
        response, accepted = through_gateway([hangs, hangs], stream=stream, read_seconds=0.5, client=client)
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["code"] == "upstream_timeout" and "0.5s" in error["message"]
        assert sum(accepted) == 1 and closed == [True]


def test_a_slow_whole_reply_within_the_read_timeout_is_not_cut() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(0.3)
        head, _, body = OK.partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n" + body[:10])
        await asyncio.sleep(0.3)
        writer.write(body[10:])
        await writer.drain()
        await asyncio.sleep(1)

    response, _ = through_gateway([slow], read_seconds=1.0)
    assert response.status_code == 200 and json.loads(response.content)["choices"][0]["text"] == " ok"


@pytest.mark.parametrize("client", ["native", "httpx"])
def test_the_worker_is_told_when_the_gateway_took_the_request(client: str) -> None:
    """X-Request-Start (t=<unix seconds>, as nginx sets it): the worker's
    TTFT starts there, so a wait before its loop read the request counts."""
    seen: list[bytes] = []

    async def records_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(OK)
        await writer.drain()

    before = time.time()
    response, _ = through_gateway([records_head], client=client)
    after = time.time()
    assert response.status_code == 200
    (stamp,) = [line for line in seen[0].split(b"\r\n") if line.lower().startswith(b"x-request-start:")]
    started = float(stamp.split(b":", 1)[1].strip().removeprefix(b"t="))
    assert before <= started <= after
